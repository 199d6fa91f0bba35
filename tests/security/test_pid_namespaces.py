"""Clients in other pid namespaces, as in Kubernetes: the daemon runs in a pid namespace of its own
and every client in another (`unshare --pid --fork`, siblings like two containers' namespaces), so
SO_PEERCRED tells the daemon pid 0 for each of them. Their sessions are still watched by a pidfd
(SO_PEERPIDFD), reclaimed within 2 s of their process dying (also while a child it forked keeps
the connection open), capped per process, and shown by `ecd status` and the metrics.

Before (issue 24): such a session was heartbeat-only, its leases came back after leases.session_ttl
(60 s here), and max_clients_per_pid did not apply to it (20 of 20 welcomed with a cap of 8).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import line_within, metric, scrape_metrics, wait_for
from ecd import ControlClient
from ecd.daemon.control.connections import SO_PEERPIDFD, pidfs

HERE = Path(__file__).resolve().parent
NS_CLIENT = HERE / "ns_client.py"
ATTACKER = HERE / "attacker.py"
UNSHARE = shutil.which("unshare")
DAEMON_NS = (UNSHARE or "unshare", "--pid", "--fork", "--mount-proc", "--kill-child")
# No --mount-proc: /proc stays the host's, where the client reads its host pid (NSpid).
CLIENT_NS = (UNSHARE or "unshare", "--pid", "--fork", "--kill-child")
CAP = 8  # limits.max_clients_per_pid here


def _why_no_namespaces() -> str | None:
    if UNSHARE is None:
        return "needs the unshare tool (util-linux) to give the daemon and clients their own pid namespaces"
    probe = subprocess.run([*DAEMON_NS, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot make a pid namespace here (unshare --pid needs root or user namespaces): {probe.stderr.strip()}"
    return None


def _peer_pidfd_works() -> bool:
    left, right = socket.socketpair(socket.AF_UNIX)
    try:
        os.close(left.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD))
        return True
    except OSError:
        return False
    finally:
        left.close()
        right.close()


pytestmark = pytest.mark.skipif(_why_no_namespaces() is not None, reason=str(_why_no_namespaces()))
needs_peer_pidfd = pytest.mark.skipif(not _peer_pidfd_works(), reason="this kernel has no SO_PEERPIDFD (Linux 6.5+): "
                                      "a client in another pid namespace is heartbeat-watched there")


@pytest.fixture
def ns_daemon(daemon_factory):
    """A daemon in its own pid namespace: every client of this test is pid 0 to it."""
    d = daemon_factory(extra=f'[leases]\nsession_ttl = "60s"\n[limits]\nmax_clients_per_pid = {CAP}', start=False)
    d.start(prefix=DAEMON_NS)
    return d


def first_json(proc: subprocess.Popen, timeout: float = 60.0) -> dict:
    return json.loads(line_within(proc, timeout))


def in_own_pid_namespace(*args: str) -> subprocess.Popen:
    return subprocess.Popen([*CLIENT_NS, sys.executable, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)


def status_json(endpoint: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "ecd", "status", "--endpoint", endpoint, "--interval", "0",
                          "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


@needs_peer_pidfd
@pytest.mark.parametrize("death", ["engine_with_forked_child", "whole_container"])
def test_a_dead_client_of_another_pid_namespace_is_reclaimed_within_2s(ns_daemon, death):
    d = ns_daemon
    with d.client() as producer:
        producer.put("k", torch.arange(64, dtype=torch.int64))
    holder = in_own_pid_namespace(str(NS_CLIENT), "hold", d.endpoint, "default", "k",
                                  *(["fork"] if death == "engine_with_forked_child" else []))
    try:
        report = first_json(holder)
        with ControlClient(d.endpoint, timeout=10.0) as observer:
            stats = observer.stats()
            assert (stats["read_leases"], stats["pins"], stats["entries_writing"]) == (1, 1, 1), stats
            idle_bytes = stats["used_bytes"] - (1 << 20)
            killed = time.monotonic()
            if death == "whole_container":
                holder.kill()  # unshare dies, its --kill-child takes the namespace's init and all in it
            else:
                os.kill(report["host_pid"], signal.SIGKILL)  # the engine; its child keeps the connection
            back = wait_for(lambda: observer.stats()["read_leases"] == 0, timeout=2.0)
            elapsed = time.monotonic() - killed
            assert back, f"leases still held {elapsed:.1f}s after the client died: {observer.stats()}"
            stats = observer.stats()
            assert (stats["pins"], stats["entries_writing"], stats["used_bytes"]) == (0, 0, idle_bytes), stats
            if death == "engine_with_forked_child":
                assert alive(report["child_host_pid"])  # the connection is still open
                assert "exited: reclaiming session" in d.log()
            # The kernel named no pid for it, yet the daemon watched its process: no heartbeats asked.
            assert report["heartbeat_s"] == 0
            print(f"{death}: leases, pins and the write's space back {elapsed * 1000:.0f} ms after the kill")
    finally:
        holder.kill()
        holder.wait()


def test_sessions_of_a_process_in_another_pid_namespace_are_capped(ns_daemon):
    d = ns_daemon
    first = in_own_pid_namespace(str(ATTACKER), "sessions", d.endpoint, "20")
    second = None
    try:
        report = first.stdout.readline()
        assert report.startswith(f"welcomed={CAP} refused={20 - CAP} silent=0"), report
        assert f"limits.max_clients_per_pid={CAP}" in report
        # per process, not per uid or per namespace-less bucket: another process has its own cap
        # (on a kernel without pidfs, Linux < 6.9, such processes share one cap per uid)
        second = in_own_pid_namespace(str(ATTACKER), "sessions", d.endpoint, "20")
        expected = CAP if pidfs() else 0
        assert second.stdout.readline().startswith(f"welcomed={expected} refused={20 - expected}")
        body = scrape_metrics(d.metrics_port)
        assert metric(body, "ecd_sessions_refused_total", limit="max_clients_per_pid") == 40 - CAP - expected
        if _peer_pidfd_works():
            assert metric(body, "ecd_sessions", watch="pidfd") == CAP + expected
        first.kill()  # the process goes: all its sessions with it
        first.wait()
        with ControlClient(d.endpoint, timeout=10.0) as observer:
            assert wait_for(lambda: observer.stats()["clients"] == 1 + expected, timeout=2.0), observer.stats()
    finally:
        for p in (first, second):
            if p is not None:
                p.kill()
                p.wait()


@needs_peer_pidfd
def test_status_shows_each_sessions_pid_namespace_and_watch(ns_daemon):
    d = ns_daemon
    with d.client() as producer:
        producer.put("k", torch.arange(64, dtype=torch.int64))
    holder = in_own_pid_namespace(str(NS_CLIENT), "hold", d.endpoint, "default", "k")
    try:
        report = first_json(holder)
        out = subprocess.run([sys.executable, "-m", "ecd", "status", "--endpoint", d.endpoint, "--interval", "0"],
                             capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
        assert out.returncode == 0, out.stderr
        row = next((line for line in out.stdout.splitlines() if "ns-holder" in line), "")
        assert "0 (another pid namespace)" in row and str(report["pid_ns"]) in row and "pidfd" in row, out.stdout
        mine = [s for s in status_json(d.endpoint)["sessions"] if s["name"] == "ns-holder"]
        assert len(mine) == 1, mine
        assert mine[0]["pid"] == 0 and mine[0]["watch"] == "pidfd" and mine[0]["uid"] == os.getuid(), mine
        assert mine[0]["pid_ns"] == report["pid_ns"] and not mine[0]["pid_ns_claimed"], (mine, report)
        body = scrape_metrics(d.metrics_port)
        assert metric(body, "ecd_sessions", watch="pidfd") == 1
        assert metric(body, "ecd_sessions", watch="heartbeat") == 0
    finally:
        holder.kill()
        holder.wait()
