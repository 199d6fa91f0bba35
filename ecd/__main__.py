from .cli.commands import main

main()
