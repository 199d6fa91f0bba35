"""Event-ring readers that stop (SIGSTOP) or read slowly: the daemon never waits for them, and a
lapped reader detects the overrun when it next reads, drops its cache and answers correctly. And
a torture test without a daemon: a writer process appending as fast as it can to a 64-slot ring,
reader processes checking every event they read (ring_torture.py)."""
from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import ring_torture
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


# ---- torture: one writer process, several reader processes, a 64-slot ring --------------------

def torture(directory, seconds: float, readers: int, barrier: str = "default",
            slots: int = 64) -> tuple[dict, list[dict]]:
    """Run ring_torture.py: a writer appending as fast as it can and `readers` readers checking
    every event they read, for `seconds`; the writer's and the readers' counts."""
    script = str(Path(ring_torture.__file__))
    path = Path(directory) / "ring"
    with open(path, "wb") as f:
        f.truncate(ring_torture.file_bytes(slots))
    procs = []
    try:
        def start(*args: str) -> subprocess.Popen:
            proc = subprocess.Popen([sys.executable, script, *args], stdout=subprocess.PIPE, text=True)
            procs.append(proc)
            assert proc.stdout.readline() == "ready\n"
            return proc

        start("writer", str(path), str(slots), barrier)
        for i in range(readers):
            start("reader", str(path), str(slots), barrier, str(i))
        with open(path, "r+b") as f:
            buf = mmap.mmap(f.fileno(), 0)
        control = np.frombuffer(buf, np.uint64, count=2,
                                offset=ring_torture.ring_bytes(slots, ring_torture.BUCKETS))
        control[0] = 1
        time.sleep(seconds)
        control[1] = 1
        results = [json.loads(proc.stdout.readline()) for proc in procs]
        for proc in procs:
            assert proc.wait(30) == 0
        del control
        buf.close()
        return results[0], results[1:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("barrier, seconds", [("default", 3.0), ("libatomic", 1.5)])
def test_ring_torture_readers_never_see_a_torn_event(tmp_path, barrier, seconds):
    """A writer appending as fast as it can to a 64-slot ring, three readers polling it with
    random pauses: every event a reader returns is checked against its sequence number (each
    word is derived from it), lapped readers must detect it and resync. Also run with a hardware
    barrier forced where the CPU needs none (x86), so that code path runs across processes too.
    On x86 this cannot catch reordering by the hardware; it does catch torn reads from the
    interleaving of writer and readers (slots overwritten while being copied)."""
    writer, readers = torture(tmp_path, seconds, readers=3, barrier=barrier)
    checked = sum(r["checked"] for r in readers)
    summary = (f"ring torture ({writer['barrier']} barrier, {seconds} s): {writer['events']} events written "
               f"({writer['per_s']}/s), {checked} checked, {sum(r['overruns'] for r in readers)} overruns "
               f"({sum(r['late_overruns'] for r in readers)} found by the second look at write_seq), "
               f"{sum(r['torn'] for r in readers)} torn, {sum(r['corruptions'] for r in readers)} corruptions")
    print(summary)
    assert all(r["torn"] == 0 and r["corruptions"] == 0 for r in readers), (summary, readers)
    assert writer["events"] > 10 * 64 and checked > 1000, summary
    assert sum(r["overruns"] for r in readers) > 0, summary  # the readers were lapped, and knew it
