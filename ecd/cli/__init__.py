"""The `ecd` command line: commands.py (the typer app), output.py, doctor.py, bench.py."""
