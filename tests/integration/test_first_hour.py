"""What a new user meets first (issue 41): endpoints typed by hand, a daemon that is not there, the
CLI finding the daemon, the errors to catch. Each case is a real process that must end promptly
(before, a bare socket path left the interpreter hanging at exit and a missing socket waited the
whole timeout)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import ecd
from conftest import REPO, wait_for
from ecd.config import LeasesSection
from ecd.memory.entry_index import slot_area_bytes
from ecd.writes.submission import area_bytes

# segment 0 holds the submission area (memfd pools: ecd/writes/submission.py) and the read slots
# (memory/entry_index.py) after its share of the pool
SLOT_AREA = (slot_area_bytes(LeasesSection().slot_sessions, LeasesSection().read_slots)
             + area_bytes(LeasesSection().slot_sessions, LeasesSection().submit_records))

ECD = [sys.executable, "-m", "ecd"]


def run(args: list[str], env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd="/",
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


BAD_CLIENT = """
import sys, ecd
try:
    ecd.ControlClient(sys.argv[1], timeout=30)
except Exception as exc:
    print(type(exc).__name__, exc)
"""


@pytest.mark.parametrize("endpoint,error", [
    ("/tmp/no-such-dir-ecd/ecd.sock", "DaemonUnavailable no daemon socket at /tmp/no-such-dir-ecd/ecd.sock"),
    ("ipc:///tmp/no-such-dir-ecd/ecd.sock", "DaemonUnavailable no daemon socket at"),
    ("ecd.sock", "InvalidEndpoint endpoint 'ecd.sock': expected ipc:///path/to/ecd.sock"),
    ("tcp://localhost", "InvalidEndpoint endpoint 'tcp://localhost'"),
    ("ipc://", "InvalidEndpoint"),
])
def test_a_bad_or_absent_endpoint_fails_at_once_and_the_process_exits(endpoint, error):
    began = time.monotonic()
    out = run([sys.executable, "-c", BAD_CLIENT, endpoint], timeout=60)
    took = time.monotonic() - began
    assert out.returncode == 0 and out.stdout.startswith(error), (out.stdout, out.stderr)
    assert took < 25, f"{took:.1f}s: it waited out its 30 s timeout, or hung at exit"


def test_a_bare_socket_path_means_ipc(daemon):
    with ecd.ControlClient(daemon.socket_path, timeout=10) as c:  # no ipc:// prefix
        assert c.endpoint == daemon.endpoint and c.ping() > 0


def test_the_cli_finds_the_daemon_from_ecd_config_and_says_where_it_looked(daemon):
    ok = run(ECD + ["status", "--json", "--interval", "0"], env={"ECD_CONFIG": str(daemon.config)})
    assert ok.returncode == 0, ok.stderr
    assert daemon.endpoint in ok.stdout
    missing = run(ECD + ["status", "--endpoint", "/tmp/no-such-dir-ecd/ecd.sock"], timeout=30)
    assert missing.returncode == 3 and len(missing.stderr.strip().splitlines()) == 1, missing.stderr
    assert "daemon unreachable at ipc:///tmp/no-such-dir-ecd/ecd.sock (--endpoint): no daemon socket" in missing.stderr
    bad = run(ECD + ["status", "--endpoint", "ecd.sock"], timeout=30)
    assert bad.returncode == 2 and "--endpoint 'ecd.sock': expected ipc://" in bad.stderr, bad.stderr
    default = run(ECD + ["status"], env={"ECD_CONFIG": ""}, timeout=30)
    assert "(the default; --endpoint, --config or $ECD_CONFIG name another)" in default.stderr or \
        default.returncode == 0, default.stderr


def test_every_error_a_user_catches_is_exported_and_a_permission_error_is_not_retryable():
    for name in ("SocketPermissionDenied", "PoolNotVisible", "InvalidEndpoint", "DaemonUnavailable",
                 "PermissionDenied", "KeyNotFound", "PoolFull", "QuotaExceeded", "IntegrityError"):
        assert issubclass(getattr(ecd, name), ecd.EcdError), name
        assert name in ecd.__all__, name
    assert not issubclass(ecd.SocketPermissionDenied, ecd.DaemonUnavailable)  # retry loops must not spin on it
    assert issubclass(ecd.SocketPermissionDenied, PermissionError)
    assert issubclass(ecd.InvalidEndpoint, ValueError)


def test_every_help_text_keeps_its_bracketed_config_names():
    """`[pool.cuda]`, `[restart]`, `[control]`: rich markup used to swallow them ("CUDA where  is set")."""
    import re

    from typer.testing import CliRunner

    from ecd.cli.commands import app
    runner = CliRunner()
    checked = 0
    for command in app.registered_commands:
        name = command.name or command.callback.__name__.replace("_", "-")
        text = " ".join(runner.invoke(app, [name, "--help"], terminal_width=200).output.split())
        for bracketed in re.findall(r"\[[a-z_.]+\]", command.callback.__doc__ or ""):
            assert bracketed in text, f"`ecd {name} --help` lost {bracketed}: {text[:400]}"
            checked += 1
    assert checked >= 3, "no bracketed names found: the test would check nothing"


VIEW_WRITER = """
import sys, torch, ecd
c = ecd.Client(sys.argv[1], timeout=10)
c.put("v", torch.zeros(4096, dtype=torch.uint8))
with c.view("v") as view:
    view.fill_(1)  # the line faulthandler must name
print("wrote into a read-only view", flush=True)
"""


def test_writing_into_a_view_dies_saying_where(daemon):
    out = run([sys.executable, "-c", VIEW_WRITER, daemon.endpoint])
    assert out.returncode in (-11, 139), (out.returncode, out.stdout, out.stderr[-2000:])
    assert "wrote into a read-only view" not in out.stdout
    assert "Segmentation fault" in out.stderr and 'File "<string>", line 6' in out.stderr, out.stderr[-2000:]
    with daemon.client() as c:  # the daemon and the entry are unharmed
        assert bool((c.get("v") == 0).all())


def test_a_stop_says_who_keeps_the_pool_and_how_to_return_it(daemon_factory):
    from ecd.config import load_config_file
    from pool_holders import holder_pids
    d = daemon_factory()
    assert d.stop() == 0
    line = next(line for line in d.log().splitlines() if "shutting down" in line)
    assert "keeper (pid " in line and f"keeps the host pool ({(64 << 20) + SLOT_AREA} bytes)" in line, line
    assert "for up to 300 s" in line and f"`ecd release --config {d.config}`" in line, line
    assert holder_pids(d.node), "the holder the line names is not there"
    released = run(ECD + ["release", "--config", str(d.config)])
    assert released.returncode == 0, released.stderr
    assert wait_for(lambda: holder_pids(d.node) == [], timeout=10)
    # the development config (`make serve`) holds briefly: a laptop's stops do not pile up pools
    assert float(load_config_file(str(REPO / "configs" / "node.toml")).restart.hold) <= 30


def test_doctor_refuses_the_pool_serve_refuses_with_the_same_line(tmp_path):
    from ecd.memory.memfd import available_memory
    available = available_memory()
    if available is None:
        pytest.skip("no MemAvailable in /proc/meminfo")
    size = (4 * available >> 30) + 1  # GiB, well past what the node has
    config = tmp_path / "big.toml"
    config.write_text(f'[node]\nname = "big{os.getpid()}"\nruntime_dir = "{tmp_path}/run"\n[control]\n'
                      f'endpoint = "ipc://{tmp_path}/run/ecd.sock"\n[pool.host]\nsize = "{size}GiB"\n'
                      f'segment_size = "1GiB"\n')
    doctor = run(ECD + ["doctor", "--config", str(config)])
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    line = next(line for line in (doctor.stdout + doctor.stderr).splitlines() if line.startswith("error: pool.host.size"))
    serve = run(ECD + ["serve", "--config", str(config)], timeout=60)
    assert serve.returncode == 2, serve.stderr
    said = line.removeprefix("error: pool.host.size: ").split(" of memory available")[1]
    assert "pool.host.size" in serve.stderr and said in serve.stderr, (line, serve.stderr)


def test_a_machine_without_an_nvidia_driver_installs_cpu_torch(tmp_path):
    """`make serve`'s venv: PyTorch's CPU index where there is no NVIDIA driver (PyPI's torch is the
    CUDA build, several GB), and pip's own choice, said, when that index does not answer. Run on a
    venv-less copy of the Makefile with an index that cannot answer and a pip that only echoes."""
    import shutil
    has_driver = os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None
    index = subprocess.run(["make", "-s", "-f", str(REPO / "Makefile"), "--eval", "show-index: ; @echo $(TORCH_INDEX)",
                            "show-index"], cwd=tmp_path, capture_output=True, text=True, timeout=60).stdout.strip()
    assert index == ("" if has_driver else "https://download.pytorch.org/whl/cpu"), index
    fake = tmp_path / "venv" / "bin"
    fake.mkdir(parents=True)
    (fake / "python").write_text('#!/bin/sh\n[ "$1" = "-c" ] && exit 1\necho "pip $*"\n')  # no torch, no index
    (fake / "python").chmod(0o755)
    out = subprocess.run(["make", "-f", str(REPO / "Makefile"), "venv/.torch", "VENV=venv",
                          "TORCH_INDEX=http://127.0.0.1:9/whl/cpu"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "installing torch==2.13.0 as pip finds it (http://127.0.0.1:9/whl/cpu does not answer)" in out.stdout
    assert "pip -m pip install --progress-bar on torch==2.13.0" in out.stdout, out.stdout
