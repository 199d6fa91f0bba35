"""The image's HEALTHCHECK script (deploy/image/healthcheck.py) against a real daemon on the host:
healthy only while the daemon serves /healthz at the address its config names. Runs everywhere
(no podman needed)."""
from __future__ import annotations

import subprocess
import sys

from conftest import REPO, DaemonProcess
from ports import free_port

SCRIPT = REPO / "deploy" / "image" / "healthcheck.py"


def run_check(config) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-I", str(SCRIPT)], env={"ECD_CONFIG": str(config)},
                          capture_output=True, text=True, timeout=30)


def test_healthy_while_serving_then_unhealthy_with_the_reason():
    d = DaemonProcess()
    try:
        port = free_port()
        # the image's own form: a wildcard listen address, reached through loopback
        d.config.write_text(d.config.read_text().replace('listen = "127.0.0.1:0"', f'listen = "0.0.0.0:{port}"'))
        d.start()
        ok = run_check(d.config)
        assert ok.returncode == 0 and ok.stdout.strip() == "ok", ok
        d.stop()
        down = run_check(d.config)
        assert down.returncode != 0 and f"127.0.0.1:{port}/healthz" in down.stderr, down
    finally:
        d.cleanup()


def test_a_config_without_metrics_is_unhealthy_and_says_why(tmp_path):
    config = tmp_path / "node.toml"
    config.write_text('[metrics]\nlisten = ""\n')
    check = run_check(config)
    assert check.returncode != 0 and "turns the metrics endpoint off" in check.stderr, check
    check = run_check(tmp_path / "missing.toml")
    assert check.returncode != 0 and "cannot read" in check.stderr, check
