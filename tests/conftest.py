"""Fixtures that start the real daemon (`python -m ecd serve`) as a subprocess on a temp node."""
from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
# One /proc/PID/status reader for tests and benchmarks (re-exported: tests import it from here).
from bench_daemon import proc_memory_kib  # noqa: E402,F401

ACTOR = REPO / "tests" / "actor.py"
_counter = itertools.count()
_DAEMONS_OF_THIS_TEST: list["DaemonProcess"] = []  # for the failure report (pytest_runtest_makereport)
LOG_TAIL_LINES = 40


def shm_files(node: str) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"ecd.{node}."))


# `[pool.host] backing` of every test daemon that does not choose one: ECD_TEST_POOL_BACKING=named
# runs a suite against the /dev/shm files, unset (or "memfd") against the default.
DEFAULT_BACKING = os.environ.get("ECD_TEST_POOL_BACKING", "")


def write_config(runtime_dir: str, node: str, size: str = "64MiB", extra: str = "",
                 metrics: str = "127.0.0.1:0", backing: str = "") -> Path:
    """A node.toml for a test daemon; metrics on a free port so tests never fight over 9464.
    `backing`: `[pool.host] backing` ("" leaves the default, or ECD_TEST_POOL_BACKING's)."""
    backing = backing or DEFAULT_BACKING
    path = Path(runtime_dir) / "node.toml"
    path.write_text(f"""
[node]
name = "{node}"
runtime_dir = "{runtime_dir}"
log_level = "debug"
[control]
endpoint = "ipc://{runtime_dir}/ecd.sock"
[pool.host]
size = "{size}"
{f'backing = "{backing}"' if backing else ""}
[metrics]
listen = "{metrics}"
{extra}
""")
    return path


# For a vandal process (a `python -c` script, run with cwd=REPO) that writes into a pool segment
# behind the daemon's back: `open_pool(pool_target(client, pool))` is a read-write descriptor of it.
OPEN_POOL = """
def open_pool(target):
    import os
    if not target.startswith("fds:"):
        return os.open(target, os.O_RDWR)
    from ecd.fd_passing import receive
    path, index = target[len("fds:"):].rsplit(":", 1)
    _, items = receive(path, 10.0)
    wanted = -1
    for item, fd in items:
        if item.kind == "pool" and item.index == int(index):
            wanted = fd
        else:
            os.close(fd)
    return wanted
"""


def pool_target(client, pool: int) -> str:
    """What a vandal opens for host pool segment `pool` of `client`'s daemon: its /dev/shm file
    (backing = "named"), or "fds:<the fd socket>:<pool>" (backing = "memfd")."""
    welcome = client.welcome
    if not welcome.fd_socket:
        return f"/dev/shm/{welcome.pools[pool].name}"
    socket_dir = os.path.dirname(client.endpoint[len("ipc://"):])
    return f"fds:{os.path.join(socket_dir, welcome.fd_socket)}:{pool}"


class DaemonProcess:
    """One `ecd serve` subprocess; restartable on the same node, config and endpoint."""

    def __init__(self, size: str = "64MiB", extra: str = "", backing: str = "") -> None:
        # Short paths: a unix socket path must fit in 107 bytes.
        self.runtime_dir = tempfile.mkdtemp(prefix="ecd-", dir="/tmp")
        self.node = f"t{os.getpid()}x{next(_counter)}"
        self.endpoint = f"ipc://{self.runtime_dir}/ecd.sock"
        self.socket_path = f"{self.runtime_dir}/ecd.sock"
        self.backing = backing or DEFAULT_BACKING or "memfd"
        self.config = write_config(self.runtime_dir, self.node, size, extra, backing=backing)
        self.log_path = Path(self.runtime_dir) / "daemon.log"
        self.proc: subprocess.Popen | None = None
        self.metrics_port: int | None = None

    def start(self, timeout: float = 20.0, env: dict | None = None, prefix: tuple[str, ...] = ()) -> None:
        """`prefix`: a command the daemon runs under (e.g. `unshare --pid --fork`)."""
        self._log = open(self.log_path, "ab")
        start_offset = self._log.tell()
        self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "ecd", "serve", "--config", str(self.config)],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}: {self.log()}")
            started = self.log_path.read_bytes()[start_offset:]
            if b"serving node" in started:
                match = re.search(rb"metrics on http://[^:]+:(\d+)/metrics", started)
                self.metrics_port = int(match.group(1)) if match else None
                return
            time.sleep(0.02)
        raise RuntimeError(f"daemon did not start within {timeout}s: {self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def describe(self) -> str:
        """State and log tail, for a failed test's report: a daemon that hung and one that died
        (UCX aborting, an OOM kill) fail the client the same way, by a timeout."""
        state = "not started"
        if self.proc is not None:
            rc = self.proc.poll()
            state = "running" if rc is None else f"exited with {rc}"
        try:
            tail = self.log().splitlines()[-LOG_TAIL_LINES:]
        except OSError as exc:
            tail = [f"(no log: {exc})"]
        return "\n".join([f"daemon {self.node} ({self.endpoint}): {state}", *tail])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        rc = self.proc.wait(timeout)
        self._log.close()
        self.proc = None
        return rc

    def client(self, **kwargs):
        from ecd import Client
        kwargs.setdefault("timeout", 5.0)
        return Client(self.endpoint, **kwargs)

    def release_pool(self, timeout: float = 10.0) -> None:
        """A final stop's second half: the holder the daemon spawned ([restart] keeper = "auto")
        lets the pool go now instead of holding it for the next run. The holder refuses while a
        daemon's connection is still open: a killed daemon's (one in a pid namespace of its own
        dies after the process that made it) closes in a moment."""
        from ecd.daemon.restart.holder_client import HolderKeeper
        from ecd.daemon.restart.keeper import KeeperUnavailable
        deadline = time.monotonic() + timeout
        while True:
            try:
                HolderKeeper(self.node, self.runtime_dir, spawn=False).release()
                return
            except KeeperUnavailable:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)

    def cleanup(self) -> None:
        if self.proc is not None:
            self.stop(signal.SIGKILL)
        self.release_pool()
        for name in shm_files(self.node):
            os.unlink(f"/dev/shm/{name}")
        shutil.rmtree(self.runtime_dir, ignore_errors=True)


# Every daemon a test starts inherits this: the holders they spawn ([restart] keeper = "auto"
# keeps the pool for `hold` seconds after its daemon ends) are found by it and told to let go
# when the session ends, wherever a test started its daemon.
TEST_RUN_MARK = f"ECD_TEST_RUN={os.getpid()}"
os.environ["ECD_TEST_RUN"] = str(os.getpid())


def holders_of_this_run() -> list[int]:
    """Pids of the holder processes that daemons of this test run spawned."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            if b"ecd.daemon.restart.holder" not in cmdline:
                continue
            if TEST_RUN_MARK.encode() in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                pids.append(int(entry))
        except OSError:
            continue
    return pids


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report carries each of its daemons' state and log tail."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.when == "call":
        for d in _DAEMONS_OF_THIS_TEST:
            report.sections.append((f"daemon {d.node}", d.describe()))


def pytest_sessionfinish(session, exitstatus):
    for pid in holders_of_this_run():  # SIGTERM: a holder lets the pool go and exits
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass


def pytest_collection_modifyitems(config, items):
    """Tests marked `netns_inner` run only inside the network namespace their outer test makes
    (ECD_NIXL_NETNS=1 there): deselected anywhere else. Tests marked `gpu` skip cleanly where
    torch sees no CUDA device (torch is imported only when such tests were collected)."""
    if os.environ.get("ECD_NIXL_NETNS") != "1":
        outside = [item for item in items if item.get_closest_marker("netns_inner") is not None]
        if outside:
            config.hook.pytest_deselected(items=outside)
            items[:] = [item for item in items if item.get_closest_marker("netns_inner") is None]
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture
def daemon_factory():
    made: list[DaemonProcess] = []

    def make(size: str = "64MiB", extra: str = "", start: bool = True, backing: str = "") -> DaemonProcess:
        d = DaemonProcess(size, extra, backing)
        made.append(d)
        _DAEMONS_OF_THIS_TEST.append(d)
        if start:
            d.start()
        return d

    yield make
    for d in made:
        d.cleanup()
        _DAEMONS_OF_THIS_TEST.remove(d)


@pytest.fixture
def daemon(daemon_factory) -> DaemonProcess:
    return daemon_factory()


class Actor:
    """A separate client process driven over stdin/stdout (see tests/actor.py)."""

    def __init__(self, endpoint: str, namespace: str = "default") -> None:
        self.proc = subprocess.Popen([sys.executable, str(ACTOR), endpoint, namespace],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        assert self.ask("ping").startswith("ok"), "actor did not start"

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def read(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"actor exited with {self.proc.wait()}")
        return line.strip()

    def ask(self, line: str) -> str:
        self.send(line)
        return self.read()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def actors():
    made: list[Actor] = []

    def make(endpoint: str, namespace: str = "default") -> Actor:
        a = Actor(endpoint, namespace)
        made.append(a)
        return a

    yield make
    for a in made:
        if a.proc.poll() is None:
            a.kill()


def entry_bytes(stats: dict) -> int:
    """Pool bytes held by entries, leaving out the extents reserved or leased for clients' next puts."""
    return stats["used_bytes"] - stats["reserved_bytes"] - stats["leased_bytes"]


def scrape_metrics(port: int) -> str:
    """The daemon's /metrics text exposition."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return resp.read().decode()


def metric_samples(body: str) -> dict[str, float]:
    """A text exposition as {series: value}, e.g. {'ecd_leases{kind="read"}': 0.0}."""
    samples = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            samples[series] = float(value)
    return samples


def metric(body: str, name: str, **labels) -> float:
    """The value of one sample (KeyError if absent); labels not given match anything."""
    for series, value in metric_samples(body).items():
        if series == name if not labels else series.startswith(name + "{") and all(
                f'{k}="{v}"' in series for k, v in labels.items()):
            return value
    raise KeyError(f"{name}{labels or ''}")


def metric_by_label(body: str, name: str, label: str) -> dict[str, float]:
    """{label value: sample value} of a family with one label, e.g. reasons of a counter."""
    pattern = re.compile(rf'^{re.escape(name)}\{{{label}="([^"]*)"\}}$')
    return {m.group(1): value for series, value in metric_samples(body).items()
            if (m := pattern.match(series))}


def line_within(proc: subprocess.Popen, timeout: float = 60.0) -> str:
    """The next line a helper process (attacker, client) writes to its stdout, stripped: the
    test fails, rather than hangs, when none comes within `timeout`."""
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    assert out and out[0], f"the process said nothing within {timeout}s (exit {proc.poll()})"
    return out[0].strip()


def wait_for(predicate, timeout: float = 5.0, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            return value
        time.sleep(interval)
