"""Event-ring readers that stop (SIGSTOP) or read slowly: the daemon never waits for them, and a
lapped reader detects the overrun when it next reads, drops its cache and answers correctly."""
from __future__ import annotations

import os
import signal
import time

from chaos_worker import payload
from conftest import wait_for
from invariants import Worker, assert_healthy, scrape, serving_worker, stopped

SMALL_RING = "[ring]\nslots = 64\npresence_buckets = 1024\n"
MINE, STABLE, NEW = "mine#100000", "stable#100000", "new#100000"


def overruns(reader) -> tuple[int, int]:
    reply = reader.ask("ring").split()
    assert reply[0] == "ok", reply
    return int(reply[1]), int(reply[2])


def test_stopped_ring_reader_does_not_block_the_daemon_and_detects_the_overrun(daemon_factory):
    d = daemon_factory(extra=SMALL_RING)
    with d.client() as c:
        c.put(MINE, payload(MINE))
        c.put(STABLE, payload(STABLE))
        reader = serving_worker(d.endpoint)
        assert reader.ask(f"get {MINE}") == "ok" and reader.ask(f"get {STABLE}") == "ok"
        assert overruns(reader) == (0, 2)  # two cached locations: the reader follows the ring
        os.kill(reader.pid, signal.SIGSTOP)
        assert wait_for(lambda: stopped(reader.pid), timeout=10.0)
        try:
            events_before = c.stats()["ring_events"]
            assert c.delete(MINE) is True  # an event the stopped reader must not miss silently
            producer = Worker("produce", d.endpoint, "1500")  # 1500 puts + 750 deletes, 64 slots
            producer.proc.wait(120)  # bounded: nobody waits for the stopped reader
            assert producer.proc.returncode == 0 and producer.read().startswith("done")
            c.put(NEW, payload(NEW))
            assert c.stats()["ring_events"] - events_before >= 2250
            assert c.ping() > 0
        finally:
            os.kill(reader.pid, signal.SIGCONT)
    assert reader.ask(f"exists {MINE} {STABLE} {NEW} absent#1") == "ok False True True False"
    assert overruns(reader)[0] == 1
    assert reader.ask(f"get {MINE}") == "missing"
    assert reader.ask(f"get {NEW}") == "ok"
    assert reader.ask("ping") == "ok"  # its overrun report is handled before this ping
    assert scrape(d.metrics_port)["ecd_ring_reader_overruns_total"] == 1
    reader.send("quit")
    reader.proc.wait(30)
    assert_healthy(d)


def test_slow_ring_reader_is_lapped_every_time_and_stays_correct(daemon_factory):
    d = daemon_factory(extra=SMALL_RING)
    laps = 3
    with d.client() as c:
        c.put(STABLE, payload(STABLE))
        reader = serving_worker(d.endpoint)
        for lap in range(laps):
            assert reader.ask(f"get {STABLE}") == "ok"  # a cached location to keep current
            started = time.monotonic()
            for i in range(100):  # more events than slots between two of the reader's reads
                key = f"lap{lap}-{i}#4"
                c.put(key, payload(key))
                if i % 2:
                    c.delete(key)
            assert time.monotonic() - started < 60.0
            answer = reader.ask(f"exists {STABLE} lap{lap}-0#4 lap{lap}-1#4")
            assert answer == "ok True True False", (lap, answer)
            assert overruns(reader)[0] == lap + 1
    assert reader.ask("ping") == "ok"
    assert scrape(d.metrics_port)["ecd_ring_reader_overruns_total"] == laps
    reader.send("quit")
    reader.proc.wait(30)
    assert_healthy(d)
