"""The daemon SIGKILLed under load and restarted: clients raise DaemonUnavailable within their
timeout (never hang), reconnect and work. By default ([restart] adopt = true) the restarted daemon
adopts the pool the holder kept: the entries are still there, the same memory (named files keep
their inodes); the rest of the dead run's shared memory (the ring, stray segments) is removed at
start. With adopt = false the pool goes with the run (memfds: nothing of it is left under any
name) or is removed at start (named files), and the restarted daemon starts empty."""
from __future__ import annotations

import gc
import json
import os
import signal
import tempfile
import time

import pytest

import ecd
from ecd.memory.ring import READER_TRUST_S
from chaos_worker import payload
from conftest import shm_files, wait_for
from invariants import Worker, assert_healthy
from pool_holders import holder_pids, memfds

TIMEOUT = 1.0  # the workers' Client timeout
WRITE_TTL = 3.0
SHORT_TTL = f'[leases]\nwrite_ttl = "{WRITE_TTL:g}s"'
SLACK = 5.0  # scheduling slack on a loaded 2-vCPU machine: a hang would be unbounded
COLD = "[restart]\nadopt = false"  # the behaviour before issue 27: a restart starts empty
ADOPT = pytest.mark.parametrize("adopt", [True, False], ids=["adopt", "cold"])


def _put_and_let_go(daemon, key: str) -> None:
    """A put by a client that is then gone from this process, mappings and all (a closed client's
    mappings stay until the object is collected: views taken from it stay valid)."""
    c = daemon.client()
    c.put(key, payload(key))
    c.close()
    del c
    gc.collect()


def _wait_out_quarantine(daemon) -> None:
    """Extents of writes the kill cut (a client's reservation included) are out of use for the
    write TTL after an adopting restart; the accounting checks want them free again."""
    with daemon.client() as c:
        quarantined = c.stats()["restart"]["quarantined"]
    if quarantined:
        assert wait_for(lambda: "free again" in daemon.log(), timeout=WRITE_TTL + SLACK, interval=0.1)


@ADOPT
def test_daemon_restart_client_reconnects(daemon_factory, adopt):
    daemon = daemon_factory(extra=SHORT_TTL if adopt else COLD)
    with daemon.client(timeout=TIMEOUT) as c:
        c.put("before#1000", payload("before#1000"))
        first_epoch = c.epoch
        daemon.stop(signal.SIGKILL)
        # Within READER_TRUST_S of the ring's last heartbeat, a get of an entry the client can
        # locate copies it without asking (its memory is still mapped, and no next run reuses it
        # before that: client/local_read.py), so it may return the right bytes; after, it asks.
        try:
            assert c.get("before#1000").equal(payload("before#1000"))
        except ecd.DaemonUnavailable:
            pass
        time.sleep(READER_TRUST_S)
        started = time.monotonic()
        with pytest.raises(ecd.DaemonUnavailable):
            c.get("before#1000")
        assert time.monotonic() - started < TIMEOUT + SLACK  # bounded by the timeout, never a hang
        started = time.monotonic()
        with pytest.raises(ecd.DaemonUnavailable):
            c.exists("before#1000")
        assert time.monotonic() - started < TIMEOUT + SLACK
        daemon.start()
        # adopted: the same client reads the old run's entry; cold: it went with the old daemon
        assert c.exists("before#1000") is adopt
        if adopt:
            assert c.get("before#1000").equal(payload("before#1000"))
        c.put("after#100000", payload("after#100000"))
        assert c.get("after#100000").equal(payload("after#100000"))
        assert c.epoch != first_epoch
    _wait_out_quarantine(daemon)  # the killed run's put leases
    assert_healthy(daemon)


@ADOPT
def test_stale_segments_of_a_killed_daemon_are_removed_on_start(daemon_factory, adopt):
    # memfds leave no file: the next test
    daemon = daemon_factory(backing="named", extra=SHORT_TTL if adopt else COLD)
    with daemon.client() as c:
        c.put("k#100000", payload("k#100000"))
    daemon.stop(signal.SIGKILL)
    left = shm_files(daemon.node)
    assert f"ecd.{daemon.node}.0" in left  # SIGKILL cannot clean up...
    segment = os.stat(f"/dev/shm/ecd.{daemon.node}.0").st_ino
    stray = f"/dev/shm/ecd.{daemon.node}.7"
    open(stray, "wb").close()  # ...and a segment of an older, bigger pool lingers too
    daemon.start()
    assert not os.path.exists(stray)
    assert "removed" in daemon.log() and "stale" in daemon.log()  # the stray one and the dead run's ring
    # adopted: the same file, its entry still there; cold: a new file, a new epoch, the content gone
    assert (os.stat(f"/dev/shm/ecd.{daemon.node}.0").st_ino == segment) is adopt
    with daemon.client() as c:
        assert c.exists("k#100000") is adopt
    _wait_out_quarantine(daemon)
    assert_healthy(daemon)


def test_a_killed_memfd_daemon_leaves_no_pool_behind_and_restarts(daemon_factory):
    daemon = daemon_factory(extra=COLD)
    _put_and_let_go(daemon, "k#100000")
    daemon.stop(signal.SIGKILL)
    assert shm_files(daemon.node) == [f"ecd.{daemon.node}.lock"]  # the pool died with the process
    assert wait_for(lambda: memfds(daemon.node) == {}), memfds(daemon.node)
    assert holder_pids(daemon.node) == []
    assert os.path.exists(daemon.socket_path + ".fds")  # the fd socket's file is left: replaced at start
    daemon.start()
    with daemon.client() as c:
        assert c.mapping.sealed and c.exists("k#100000") is False
        c.put("k#100000", payload("k#100000"))
        assert c.get("k#100000").equal(payload("k#100000"))
    assert_healthy(daemon)


def test_a_killed_memfd_daemon_leaves_its_pool_with_the_holder_and_adopts_it(daemon_factory):
    daemon = daemon_factory(extra=SHORT_TTL)
    _put_and_let_go(daemon, "k#100000")
    daemon.stop(signal.SIGKILL)
    assert shm_files(daemon.node) == [f"ecd.{daemon.node}.lock"]  # memfds have no names...
    [holder] = holder_pids(daemon.node)
    kept = memfds(daemon.node)
    # ...and only the holder holds them
    assert kept and all(len(where) == 1 and where[0].split()[0] == str(holder) for where in kept.values()), \
        f"the pool should be held by the holder {holder} alone: {kept}"
    daemon.start()
    with daemon.client() as c:
        assert c.mapping.sealed and c.stats()["restart"]["entries"] == 1
        assert c.get("k#100000").equal(payload("k#100000"))
        # the same memory, adopted; but the old run's ring, which the new run reads and lets go
        assert len(set(kept) - set(memfds(daemon.node))) == 1, (kept, memfds(daemon.node))
    _wait_out_quarantine(daemon)
    assert_healthy(daemon)


def _records(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _inodes(node: str) -> dict[str, int]:
    return {name: os.stat(f"/dev/shm/{name}").st_ino for name in shm_files(node)
            if not name.endswith(".lock")}


@pytest.mark.parametrize("backing", ["memfd", "named"])
def test_daemon_killed_under_steady_load_then_restarted(daemon_factory, backing):
    # the puts the kill cut keep their extents out of use for a write TTL: short, so that the
    # accounting checks at the end see them free again
    daemon = daemon_factory(backing=backing, extra=SHORT_TTL)
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
        # adopted: the pool's segments are the same files; the ring is always new (a new epoch)
        assert {name for name in before if after[name] != before[name]} == \
            ({f"ecd.{daemon.node}.ring"} if backing == "named" else set())
        assert ("stale" in daemon.log()) == (backing == "named")  # the dead run's ring
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
    # the restart adopted the workers' entries: assert_healthy reads every one back
    with daemon.client() as c:
        restart = c.stats()["restart"]
    assert restart["adopted"] and restart["entries"] > 0, restart
    _wait_out_quarantine(daemon)
    assert_healthy(daemon)
