"""Clients SIGKILLed at every stage of their work: the daemon reclaims what they held at once."""
from __future__ import annotations

import os
import signal
import tempfile

from chaos_worker import payload
from conftest import entry_bytes, wait_for
from invariants import Worker, assert_healthy, serving_worker

BIG = "big#8000000"  # 32 MB of a 64 MiB pool


def test_client_killed_between_alloc_and_commit_gets_its_extent_back(daemon):
    writer = serving_worker(daemon.endpoint)
    assert writer.ask("alloc-stuck half#7500000 30000000").startswith("allocated")
    with daemon.client() as c:
        stats = c.stats()
        assert stats["entries_writing"] == 1 and stats["used_bytes"] >= 30_000_000
        writer.kill()
        stats = wait_for(lambda: (s := c.stats())["entries_writing"] == 0 and s, timeout=5.0)
        assert stats, "the dead writer's extent was not reclaimed"
        assert stats["reclaimed_sessions"] == 1
        assert c.exists("half#7500000") is False  # never published
    assert_healthy(daemon)


def test_client_killed_mid_copy_leaves_the_old_entry_and_a_reusable_extent(daemon):
    old = "old#4000000"  # 16 MB, put by a process that is gone (so no reservation stays)
    putter = serving_worker(daemon.endpoint)
    assert putter.ask(f"put {old}") == "ok"
    putter.send("quit")
    putter.proc.wait(30)
    with daemon.client() as c:
        writer = Worker("slow-put", daemon.endpoint, "other#6000000", "6000000")
        assert writer.read() == "copying"  # half of its 24 MB of garbage is in the pool now
        assert c.stats()["entries_writing"] == 1
        writer.kill()
        assert wait_for(lambda: c.stats()["entries_writing"] == 0, timeout=5.0)
        assert c.exists("other#6000000") is False
        # 44 MB fit only in the dead writer's reclaimed extent (evicting `old` would not do).
        c.put("next#11000000", payload("next#11000000"))
        assert c.exists([old, "next#11000000"]) == [True, True]
        assert c.stats()["evictions"] == 0
        assert c.get(old).equal(payload(old))
    assert_healthy(daemon)


def test_client_killed_while_holding_a_view_releases_its_lease(daemon):
    with daemon.client() as c:
        c.put(BIG, payload(BIG))
        viewer = serving_worker(daemon.endpoint)
        assert viewer.ask(f"view-hold {BIG}") == "ok"
        assert c.stats()["read_leases"] == 1
        assert c.delete(BIG) is True  # retired, bytes kept for the viewer
        assert c.stats()["entries_retired"] == 1 and c.stats()["used_bytes"] >= 32_000_000
        viewer.kill()
        stats = wait_for(lambda: (s := c.stats())["read_leases"] == 0 and s, timeout=5.0)
        assert stats, "the dead viewer's lease was not reclaimed"
        assert stats["entries_retired"] == 0 and entry_bytes(stats) == 0
    assert_healthy(daemon)


def test_client_killed_while_parked_is_forgotten(daemon):
    waiter = serving_worker(daemon.endpoint)
    waiter.send("get later#10 30")
    with daemon.client() as c:
        assert wait_for(lambda: c.stats()["waiters"] == 1, timeout=10.0)
        waiter.kill()
        assert wait_for(lambda: c.stats()["waiters"] == 0, timeout=5.0)
        c.put("later#10", payload("later#10"))  # waking nobody must not break anything
        assert c.get("later#10").equal(payload("later#10"))
    assert_healthy(daemon)


def test_client_killed_while_idle_gives_back_its_session_and_reservation(daemon):
    idle = serving_worker(daemon.endpoint)
    assert idle.ask(f"put {BIG}") == "ok"
    assert idle.ask("put small#1000") == "ok"  # its put lease holds pool space for the next puts
    assert idle.ask("exists big#8000000") == "ok True"
    with daemon.client() as c:
        stats = c.stats()
        assert stats["clients"] == 2 and stats["leased_bytes"] > 0
        idle.kill()
        stats = wait_for(lambda: (s := c.stats())["clients"] == 1 and s, timeout=5.0)
        assert stats and stats["leased_bytes"] == 0 and stats["reservations"] == 0 and stats["reserved_bytes"] == 0
        assert c.get(BIG).equal(payload(BIG))  # what it published stays
    assert_healthy(daemon)


def test_many_clients_killed_at_once_during_mixed_work(daemon_factory):
    d = daemon_factory(size="32MiB")  # small enough that the mix also evicts and hits PoolFull
    n = 12
    outdir = tempfile.mkdtemp(prefix="ecd-mixed-", dir="/tmp")
    workers = [Worker("mixed", d.endpoint, str(i), str(1000 + i), stdout_file=f"{outdir}/{i}.out")
               for i in range(n)]

    def ticks(i: int) -> int:
        lines = open(f"{outdir}/{i}.out").read().split()
        return max([int(x) for x in lines if x.isdigit()] or [0])

    try:
        # Every worker well into its work (not just started) before the massacre.
        assert wait_for(lambda: all(ticks(i) >= 20 for i in range(n)), timeout=90.0, interval=0.2), \
            [ticks(i) for i in range(n)]
        with d.client() as c:
            assert c.stats()["clients"] == n + 1
        for w in workers:
            os.kill(w.pid, signal.SIGKILL)
    finally:
        for w in workers:
            w.kill()
    for i in range(n):
        out = open(f"{outdir}/{i}.out").read()
        assert "MISMATCH" not in out, f"worker {i} read corrupted bytes: {out}"
    with d.client() as c:
        stats = wait_for(lambda: (s := c.stats())["clients"] == 1 and s, timeout=10.0)
        # every killed worker's session (a Bye lost when some other client closed may add one)
        assert stats and stats["reclaimed_sessions"] >= n, stats
    assert_healthy(d)
