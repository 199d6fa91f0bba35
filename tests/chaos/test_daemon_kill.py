"""The daemon SIGKILLed under load and restarted: clients raise DaemonUnavailable within their
timeout (never hang), reconnect and work; the dead run's shared memory is removed at start (named
files), or went with the run (memfds: nothing of the pool is left under any name)."""
from __future__ import annotations

import json
import os
import signal
import tempfile
import time

import pytest

import ecd
from chaos_worker import payload
from conftest import shm_files, wait_for
from invariants import Worker, assert_healthy

TIMEOUT = 1.0  # the workers' Client timeout
SLACK = 5.0  # scheduling slack on a loaded 2-vCPU machine: a hang would be unbounded


def test_daemon_restart_client_reconnects(daemon):
    with daemon.client(timeout=TIMEOUT) as c:
        c.put("before#1000", payload("before#1000"))
        first_epoch = c.epoch
        daemon.stop(signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(ecd.DaemonUnavailable):
            c.get("before#1000")
        assert time.monotonic() - started < TIMEOUT + SLACK  # bounded by the timeout, never a hang
        started = time.monotonic()
        with pytest.raises(ecd.DaemonUnavailable):
            c.exists("before#1000")
        assert time.monotonic() - started < TIMEOUT + SLACK
        daemon.start()
        assert c.exists("before#1000") is False  # the cache content went with the old daemon
        c.put("after#100000", payload("after#100000"))
        assert c.get("after#100000").equal(payload("after#100000"))
        assert c.epoch != first_epoch
    assert_healthy(daemon)


def test_stale_segments_of_a_killed_daemon_are_removed_on_start(daemon_factory):
    daemon = daemon_factory(backing="named")  # memfds leave no file: the next test
    with daemon.client() as c:
        c.put("k#100000", payload("k#100000"))
    daemon.stop(signal.SIGKILL)
    left = shm_files(daemon.node)
    assert f"ecd.{daemon.node}.0" in left  # SIGKILL cannot clean up...
    stray = f"/dev/shm/ecd.{daemon.node}.7"
    open(stray, "wb").close()  # ...and a segment of an older, bigger pool lingers too
    daemon.start()
    assert not os.path.exists(stray)
    assert "removed" in daemon.log() and "stale" in daemon.log()
    with daemon.client() as c:
        assert c.exists("k#100000") is False  # a new epoch: the content is gone, the service is back
    assert_healthy(daemon)


def test_a_killed_memfd_daemon_leaves_no_pool_behind_and_restarts(daemon):
    with daemon.client() as c:
        c.put("k#100000", payload("k#100000"))
    daemon.stop(signal.SIGKILL)
    assert shm_files(daemon.node) == [f"ecd.{daemon.node}.lock"]  # the pool died with the process
    assert os.path.exists(daemon.socket_path + ".fds")  # the fd socket's file is left: replaced at start
    daemon.start()
    with daemon.client() as c:
        assert c.mapping.sealed and c.exists("k#100000") is False
        c.put("k#100000", payload("k#100000"))
        assert c.get("k#100000").equal(payload("k#100000"))
    assert_healthy(daemon)


def _records(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _inodes(node: str) -> dict[str, int]:
    return {name: os.stat(f"/dev/shm/{name}").st_ino for name in shm_files(node)
            if not name.endswith(".lock")}


@pytest.mark.parametrize("backing", ["memfd", "named"])
def test_daemon_killed_under_steady_load_then_restarted(daemon_factory, backing):
    daemon = daemon_factory(backing=backing)
    n = 4
    workdir = tempfile.mkdtemp(prefix="ecd-load-", dir="/tmp")
    stop = f"{workdir}/stop"
    logs = [f"{workdir}/w{i}.jsonl" for i in range(n)]
    workers = [Worker("loop", daemon.endpoint, str(i), logs[i], stop, str(TIMEOUT)) for i in range(n)]

    def all_workers(predicate) -> bool:
        return all(os.path.exists(p) and any(predicate(r) for r in _records(p)) for p in logs)

    try:
        assert wait_for(lambda: all_workers(lambda r: r["op"] == "get" and r["outcome"] == "ok"),
                        timeout=60.0, interval=0.1), "workers did not get going"
        before = _inodes(daemon.node)
        if backing == "named":
            assert f"ecd.{daemon.node}.0" in before and f"ecd.{daemon.node}.ring" in before
        else:
            assert before == {}  # memfds: no names; the workers got descriptors

        daemon.stop(signal.SIGKILL)
        killed = time.monotonic()
        # The dead run's segments stay behind: nobody could unlink them.
        assert _inodes(daemon.node) == before
        assert wait_for(lambda: all_workers(lambda r: r["outcome"] == "unavailable" and r["start"] >= killed),
                        timeout=30.0, interval=0.1), "a worker never saw DaemonUnavailable"

        daemon.start()
        restarted = time.monotonic()
        after = _inodes(daemon.node)
        assert set(after) == set(before)
        assert all(after[name] != before[name] for name in before), "a segment of the dead run survived"
        assert ("stale" in daemon.log()) == (backing == "named")
        # Every worker works again, puts and gets alike.
        for op in ("put", "get"):
            assert wait_for(lambda: all_workers(lambda r: r["op"] == op and r["outcome"] == "ok"
                                                and r["start"] > restarted), timeout=60.0, interval=0.1), \
                f"a worker's {op} never succeeded after the restart"
    finally:
        open(stop, "w").close()
        for w in workers:
            try:
                w.proc.wait(30)
            finally:
                w.kill()

    for i, path in enumerate(logs):
        records = _records(path)
        assert records[-1]["op"] == "stopped", f"worker {i} did not finish cleanly"
        calls = records[:-1]
        outcomes = {r["outcome"] for r in calls}
        assert outcomes <= {"ok", "unavailable", "missing"}, (i, outcomes)
        assert not [r for r in calls if r["outcome"] == "mismatch"], f"worker {i} read corrupted bytes"
        # Never a hang: each call (a put may be several round trips) ends within its timeouts.
        slowest = max(calls, key=lambda r: r["end"] - r["start"])
        assert slowest["end"] - slowest["start"] < 2 * TIMEOUT + SLACK, (i, slowest)
        for r in calls:
            if r["outcome"] == "unavailable":
                assert r["end"] - r["start"] < TIMEOUT + SLACK, (i, r)
        assert any(r["outcome"] == "ok" and r["start"] > restarted for r in calls)
    assert_healthy(daemon)
