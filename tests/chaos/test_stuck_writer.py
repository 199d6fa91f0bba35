"""A write lease abandoned by a live client (it allocated and never commits, or it is stopped
right after its Alloc): reclaimed after leases.write_ttl, the space reused, and the stuck
client's late put fails cleanly instead of corrupting the entry that now owns the space."""
from __future__ import annotations

import os
import signal

from chaos_worker import payload
from conftest import entry_bytes, wait_for
from invariants import Worker, assert_healthy, serving_worker, stopped

SHORT_TTL = '[leases]\nwrite_ttl = "1s"\n'


def test_abandoned_write_is_reclaimed_after_write_ttl(daemon_factory):
    d = daemon_factory(extra=SHORT_TTL)
    stuck = serving_worker(d.endpoint)  # alive but never commits
    assert stuck.ask("alloc-stuck s#250000 1000000").startswith("allocated")
    with d.client() as c:
        assert c.stats()["entries_writing"] == 1
        stats = wait_for(lambda: (s := c.stats())["entries_writing"] == 0 and s, timeout=10.0)
        assert stats and stats["expired_writes"] == 1 and entry_bytes(stats) == 0
    assert stuck.ask("ping") == "ok"  # the client itself is fine
    stuck.send("quit")
    stuck.proc.wait(30)
    assert_healthy(d)


def test_writer_stopped_after_alloc_loses_its_extent_and_cannot_corrupt_the_next_owner(daemon_factory):
    d = daemon_factory(extra=SHORT_TTL)  # 64 MiB pool
    stuck_key, reuse = "stuck#10000000", "reuse#10000000"  # 40 MB each: only one fits
    writer = Worker("stop-after-alloc", d.endpoint, stuck_key, "10000000")
    assert writer.read().startswith("allocated")
    try:
        assert wait_for(lambda: stopped(writer.pid), timeout=10.0)
        with d.client() as c:
            assert wait_for(lambda: c.stats()["expired_writes"] == 1, timeout=15.0)
            c.put(reuse, payload(reuse))  # fits only in the stuck writer's reclaimed extent
            assert c.stats()["evictions"] == 0
            os.kill(writer.pid, signal.SIGCONT)
            answer = writer.read()
            assert answer.startswith("error StaleGeneration"), answer
            assert writer.proc.wait(30) == 0
            assert c.exists([stuck_key, reuse]) == [False, True]
            assert c.get(reuse).equal(payload(reuse)), "the stuck writer's late copy corrupted the new entry"
    finally:
        writer.kill()
    assert_healthy(d)
