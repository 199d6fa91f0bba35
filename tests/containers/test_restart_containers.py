"""A killed daemon container's pool adopted by the next one (issue 27, points 1, 3, 5), across real
containers: the daemon in one (`[restart] keeper = "holder"`), the holder in another (the same
image running `ecd hold`, its own pid, IPC, mount and network namespaces, only the socket
directory shared: what deploy/k8s/holder.yaml runs as a DaemonSet of its own), a producer and a
consumer in two more. The daemon container is SIGKILLed (`podman kill -s KILL`, as the OOM killer
or a crash would) and replaced by a new container; the consumer gets every entry bit-identical,
the producer's client carries on by itself, and `ecd status` shows the pool adopted. Then the
holder lets go (SIGTERM, or `--hold` after the last daemon) and exits 0: nothing stays behind.

Needs root, podman and the image (`make test-containers` builds it; containers_util says how a
missing one skips, or fails under ECD_CONTAINER_TESTS=1). An image whose ecd has no `ecd hold`
or no memfd pool (built before issue 27's keeper) skips with that reason.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
import time
from pathlib import Path

import pytest

from ecd.daemon.restart.holder_wire import socket_path
from containers_util import (CLIENT_UID, CONFINED, DAEMON_UID, IMAGE, ContainerNode, podman, probe_features,
                             unavailable_reason)

MiB = 1 << 20
# inline (under limits.inline_max_bytes), small, 1 MiB and odd-sized pool puts
SIZES = [4096, 64 << 10, MiB, 3 * MiB + 17]
ENTRIES = 48
HOLD_S = 120


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("ECD_CONTAINER_TESTS") == "1":
        pytest.fail(f"ECD_CONTAINER_TESTS=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def restart_missing() -> str | None:
    """Why the image's ecd cannot keep its pool in a holder container, or None: it needs
    `ecd hold` and a config with [restart] keeper = "holder" (issue 27), and the memfd pool
    (issue 24: named /dev/shm files die with the daemon container's own /dev/shm)."""
    memfd = probe_features()["memfd"]
    if memfd is not None:
        return f"the pool crosses containers only as memfds: {memfd}"
    with tempfile.TemporaryDirectory(prefix="ecd-probe-") as tmp:
        Path(tmp, "restart.toml").write_text('[restart]\nkeeper = "holder"\nhold = "60s"\n'
                                             '[pool.host]\nsize = "64MiB"\n')
        os.chmod(tmp, 0o755)
        out = podman("run", "--rm", *CONFINED, "--no-healthcheck", "-v", f"{tmp}:/probe:ro", "--entrypoint",
                     "/bin/sh", IMAGE, "-c", "ecd hold --help >/dev/null 2>&1 || { echo 'no `ecd hold` command'; "
                     "exit 1; }; ecd check-config /probe/restart.toml 2>&1 | tail -n 1", check=False)
    if out.returncode != 0:
        return f"the image's ecd cannot keep its pool across a restart (issue 27): {out.stdout.strip()[-200:]}"
    return None


@pytest.fixture(scope="module")
def can_restart() -> None:
    reason = unavailable_reason()
    if reason is not None:
        _skip_or_fail(reason)
    missing = restart_missing()
    if missing is not None:
        pytest.skip(missing)


class HeldNode:
    """A ContainerNode whose daemon keeps its pool in a holder container beside it."""

    def __init__(self, hold_s: float) -> None:
        self.node = ContainerNode(f'allowed_uids = [{CLIENT_UID}]\n[restart]\nkeeper = "holder"\n'
                                  f'hold = "{hold_s:g}s"')
        self.holder = f"{self.node.prefix}-holder"
        self.hold_s = hold_s

    def start_holder(self) -> None:
        # The image's entrypoint is `ecd`: this is `ecd hold ...`, as the daemon's uid (the holder
        # socket admits only its own), no health check (the image's probes the daemon's /healthz).
        podman("run", "-d", "--name", self.holder, *CONFINED, "--read-only", "--no-healthcheck",
               "--user", f"{DAEMON_UID}:{DAEMON_UID}", "-v", f"{self.node.sockets}:/run/ecd", IMAGE,
               "hold", "--node", self.node.prefix, "--runtime-dir", "/run/ecd", "--hold", f"{self.hold_s:g}")
        socket = Path(socket_path(str(self.node.sockets), self.node.prefix))
        deadline = time.monotonic() + 60
        while not socket.exists():
            assert time.monotonic() < deadline, f"the holder did not listen on {socket}: {self.holder_logs()}"
            assert self.holder_state() == "running", f"the holder exited: {self.holder_logs()}"
            time.sleep(0.1)

    def holder_state(self) -> str:
        return podman("inspect", "--format", "{{.State.Status}}", self.holder, check=False).stdout.strip()

    def holder_exit_code(self) -> int:
        return int(podman("inspect", "--format", "{{.State.ExitCode}}", self.holder).stdout)

    def holder_logs(self) -> str:
        out = podman("logs", self.holder, check=False)
        return (out.stdout + out.stderr)[-3000:]

    def wait_holder_exit(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.holder_state() in ("running", "stopping"):
            assert time.monotonic() < deadline, f"the holder still runs after {timeout}s: {self.holder_logs()}"
            time.sleep(0.2)
        return self.holder_exit_code()

    def kill_daemon(self) -> None:
        """SIGKILL, as the OOM killer or a crash: no drain, no goodbye to the holder. The container
        is removed (its cgroup, pid namespace and /dev/shm go), as when a pod is replaced."""
        podman("kill", "--signal", "KILL", self.node.daemon, timeout=30)
        podman("wait", self.node.daemon, timeout=60, check=False)
        podman("rm", "-f", "-t", "0", self.node.daemon, timeout=60)

    def status(self) -> dict:
        out = podman("exec", self.node.daemon, "ecd", "status", "--config", "/etc/ecd/node.toml", "--json",
                     "--interval", "0", check=False)
        assert out.returncode == 0, out.stdout + out.stderr
        return json.loads(out.stdout)

    def close(self) -> None:
        self.node.close()
        podman("rm", "-f", "-t", "0", self.holder, check=False, timeout=60)


@pytest.fixture
def held(can_restart):
    nodes: list[HeldNode] = []

    def make(hold_s: float = HOLD_S) -> HeldNode:
        nodes.append(HeldNode(hold_s))
        return nodes[-1]
    yield make
    for n in nodes:
        n.close()


def test_a_killed_daemon_container_is_replaced_and_the_new_one_adopts_every_entry(held):
    n = held()
    n.start_holder()
    n.node.start_daemon()
    before = n.status()
    assert before["restart"]["keeper"] == "holder" and not before["restart"]["adopted"], before["restart"]
    producer = n.node.client("producer")
    want = {f"kept-{i}": (SIZES[i % len(SIZES)], 1 + i % 250) for i in range(ENTRIES)}
    for key, (nbytes, seed) in want.items():
        producer.ok(f"put {key} {nbytes} {seed}")
    assert n.status()["entries"]["ready"] == ENTRIES

    n.kill_daemon()
    assert n.holder_state() == "running", n.holder_logs()
    n.node.start_daemon()  # a new container: new pid namespace, new cgroup, the same socket directory

    status = n.status()
    restart = status["restart"]
    assert restart["adopted"] and restart["keeper"] == "holder", (restart, n.node.logs())
    assert restart["entries"] == ENTRIES and status["entries"]["ready"] == ENTRIES, restart
    assert restart["bytes"] == sum(nbytes for nbytes, _ in want.values()), restart
    # Out of use for a write TTL: at most the producer's reservation, the extent its client took
    # for its next put (it may have been copying into it when the daemon died).
    assert restart["quarantined"] <= 1 and restart["skipped_records"] == 0, restart
    print(f"adopted {restart['entries']} entries ({restart['bytes']} bytes) in {restart['seconds']:.3f}s")
    # A consumer that never saw the old daemon gets every entry, bit-identical (the pattern is
    # checked byte by byte in its container).
    consumer = n.node.client("consumer")
    for key, (nbytes, seed) in want.items():
        assert consumer.ok(f"get {key} {nbytes} {seed}")["equal"], f"{key} differs after the restart"
    # The producer's client was connected to the killed daemon: it reconnects by itself, sees the
    # new epoch, maps the (same) pool again and reads and writes on.
    key, (nbytes, seed) = next(iter(want.items()))
    assert producer.ok(f"get {key} {nbytes} {seed}")["equal"]
    assert producer.ok(f"view {key} {nbytes} {seed}")["equal"]
    producer.ok(f"put after-restart {MiB} 7")
    assert consumer.ok(f"get after-restart {MiB} 7")["equal"]

    # The final stop: the daemon drains and exits (SIGTERM), the holder is told to let go
    # (SIGTERM: its pod deleted): it frees the pool at once and exits 0.
    podman("stop", "-t", "30", n.node.daemon, timeout=60)
    assert n.holder_state() == "running", "the holder must outlive a daemon's stop (it holds for `hold`)"
    podman("stop", "-t", "10", n.holder, timeout=60)
    assert n.wait_holder_exit(30) == 0, n.holder_logs()
    let_go = re.search(r"SIGTERM: let go of (\d+) descriptor", n.holder_logs())
    assert let_go and int(let_go.group(1)) >= 2, n.holder_logs()  # the pool's segment(s) and the journal
    assert not Path(socket_path(str(n.node.sockets), n.node.prefix)).exists()


def test_the_holder_lets_go_by_itself_hold_seconds_after_the_daemon_died(held):
    n = held(hold_s=3)
    n.start_holder()
    n.node.start_daemon()
    producer = n.node.client("producer")
    producer.ok(f"put short-lived {MiB} 5")
    assert n.holder_state() == "running", "a holder someone else runs waits for its first daemon without a deadline"
    # The clock starts before the kill: the daemon cannot die, and the holder's hold cannot start,
    # before it is issued; `podman kill` itself may take a second to return under load.
    killed = time.monotonic()
    n.kill_daemon()
    assert n.wait_holder_exit(60) == 0, n.holder_logs()
    waited = time.monotonic() - killed
    assert waited >= 2.5, f"the holder let go {waited:.1f}s after the daemon died, before its 3 s hold"
    logs = n.holder_logs()
    assert "let go of" in logs, logs
    assert not Path(socket_path(str(n.node.sockets), n.node.prefix)).exists()
