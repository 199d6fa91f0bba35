"""Helpers for the security tests: daemons with a custom [control]/[node]/[leases] section."""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO, DaemonProcess, scrape_metrics
from conftest import metric as conftest_metric

ECD = [sys.executable, "-m", "ecd"]


def write_node_toml(d: DaemonProcess, *, endpoint: str | None = None, control: str = "", node: str = "",
                    leases: str = "", runtime_dir: str | None = None, tables: str = "") -> None:
    """Rewrite the daemon's node.toml (same node name and paths) with extra keys per section
    (`tables`: whole tables after the rest, e.g. [tenants.NAME])."""
    runtime_dir = runtime_dir or d.runtime_dir
    endpoint = endpoint or d.endpoint
    Path(d.config).write_text(f"""
[node]
name = "{d.node}"
runtime_dir = "{runtime_dir}"
log_level = "debug"
{node}
[control]
endpoint = "{endpoint}"
{control}
[pool.host]
size = "64MiB"
backing = "{d.backing}"
[leases]
{leases}
[metrics]
listen = "127.0.0.1:0"
{tables}
""")
    d.endpoint = endpoint


def start_tcp(d: DaemonProcess, **kwargs) -> str:
    """Start a daemon on tcp://127.0.0.1:0 and return the endpoint it bound."""
    write_node_toml(d, endpoint="tcp://127.0.0.1:0", **kwargs)
    d.start()
    match = re.search(r"serving node \S+ on (tcp://[^:]+:\d+)", d.log())
    assert match, d.log()
    d.endpoint = match.group(1)
    return d.endpoint


def ecd(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([*ECD, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO)


def keygen(directory: Path, name: str) -> tuple[Path, Path]:
    result = ecd("keygen", str(directory), "--name", name)
    assert result.returncode == 0, result.stderr
    return directory / f"{name}.key", directory / f"{name}.key_secret"


def serve_error(config: Path, timeout: float = 60.0) -> tuple[int, str]:
    """Run `ecd serve` on a config expected to be refused; (exit code, stderr)."""
    proc = subprocess.run([*ECD, "serve", "--config", str(config)], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)
    return proc.returncode, proc.stderr


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def metric(d: DaemonProcess, name: str, **labels) -> float:
    """One sample from the daemon's /metrics (0 when absent)."""
    try:
        return conftest_metric(scrape_metrics(d.metrics_port), name, **labels)
    except KeyError:
        return 0.0
