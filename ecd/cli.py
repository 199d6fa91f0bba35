"""The `ecd` command line (typer)."""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from . import __version__
from .config import dumps_toml, load_config_file
from .errors import ConfigError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="ecd: per-node tensor hand-off daemon for disaggregated LLM serving.")

EXIT_OK, EXIT_DAEMON, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3


def _fail(message: str, code: int) -> None:
    typer.echo(f"ecd: {message}", err=True)
    raise typer.Exit(code)


def _setup_logging(level: str) -> None:
    # Under journald (JOURNAL_STREAM set) the journal adds its own timestamps.
    fmt = "%(levelname)s %(name)s: %(message)s" if os.environ.get("JOURNAL_STREAM") else \
        "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level.upper(), format=fmt, stream=sys.stderr)


@app.command()
def serve(config: Path = typer.Option(..., "--config", "-c", help="node.toml"),
          log_level: Optional[str] = typer.Option(None, "--log-level", help="overrides node.log_level")) -> None:
    """Run the daemon in the foreground until SIGINT/SIGTERM."""
    from .daemon.server import Daemon, StartupError
    try:
        cfg = load_config_file(config)
    except ConfigError as exc:
        _fail(f"config error: {exc}", EXIT_USAGE)
    _setup_logging(log_level or cfg.node.log_level)
    daemon = Daemon(cfg, str(config))
    try:
        daemon.prepare()
    except StartupError as exc:
        _fail(f"cannot start: {exc}", EXIT_USAGE)
    daemon.run()


@app.command("check-config")
def check_config(path: Path = typer.Argument(..., help="node.toml to validate")) -> None:
    """Validate a config file and print the effective configuration."""
    try:
        cfg = load_config_file(path)
    except ConfigError as exc:
        _fail(f"config error: {exc}", EXIT_USAGE)
    typer.echo(dumps_toml(cfg), nl=False)


@app.command()
def version() -> None:
    """Print the ecd version."""
    typer.echo(__version__)


def main() -> None:
    app()
