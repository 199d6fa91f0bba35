"""The event ring over an anonymous mmap: ordering, presence counters, overruns, liveness."""
from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ecd.memory import ring as ring_mod
from ecd.memory.ring import (MAGIC, EventKind, RingReader, RingWriter, key_hash, ring_bytes)

REPO = Path(__file__).resolve().parents[2]
SLOTS, BUCKETS = 64, 128


@pytest.fixture
def buf():
    return mmap.mmap(-1, ring_bytes(SLOTS, BUCKETS))


@pytest.fixture
def writer(buf):
    return RingWriter(buf, SLOTS, BUCKETS, epoch=7)


@pytest.fixture
def reader(buf, writer):
    return RingReader(buf, SLOTS, BUCKETS)


def events(array) -> list[tuple[int, int, int]]:
    assert array is not None
    return [(int(k), int(h), int(g)) for k, h, g in array]


def test_ring_bytes_layout():
    assert ring_bytes(64, 128) == 4096 + 128 * 4 + 64 * 32


def test_writer_formats_header_and_writes_epoch_event(buf, writer):
    header = np.frombuffer(buf, np.uint64, count=32)
    assert int(header[0]) == MAGIC
    assert int(header[2]) == SLOTS and int(header[3]) == BUCKETS and int(header[4]) == 7
    assert writer.events_written == 1
    # a reader that attaches from sequence 0 sees the EPOCH event
    r = RingReader(buf, SLOTS, BUCKETS)
    assert r.epoch == 7
    r.next_seq = 0
    assert events(r.poll()) == [(EventKind.EPOCH, 0, 7)]


def test_reader_starts_at_head_and_sees_events_in_order(writer, reader):
    assert reader.pending() == 0
    assert events(reader.poll()) == []
    writer.publish(111, 1)
    writer.publish(222, 2)
    writer.unpublish(EventKind.EVICTED, 111, 1)
    writer.unpublish(EventKind.DELETED, 222, 2)
    assert reader.pending() == 4
    got = events(reader.poll())
    assert got == [(EventKind.PUBLISHED, 111, 1), (EventKind.PUBLISHED, 222, 2),
                   (EventKind.EVICTED, 111, 1), (EventKind.DELETED, 222, 2)]
    assert reader.pending() == 0
    assert events(reader.poll()) == []
    writer.publish(333, 3)
    assert events(reader.poll()) == [(EventKind.PUBLISHED, 333, 3)]
    assert reader.overruns == 0


def test_full_64bit_hash_survives(writer, reader):
    h = key_hash("ns", "k")
    big = (1 << 64) - 2
    writer.publish(h, 5)
    writer.publish(big, 2**63 - 1)
    assert events(reader.poll()) == [(EventKind.PUBLISHED, h, 5), (EventKind.PUBLISHED, big, 2**63 - 1)]


def test_events_wrap_around_the_slots(writer, reader):
    for batch in range(5):  # 5 * 40 events through 64 slots
        for i in range(40):
            writer.publish(batch * 1000 + i, batch * 1000 + i)
        got = events(reader.poll())
        assert [g for _, _, g in got] == [batch * 1000 + i for i in range(40)]
    assert reader.overruns == 0


def test_presence_counters(writer, reader):
    h1 = key_hash("ns", "a")
    h2 = key_hash("ns", "b")
    absent = next(h for h in (key_hash("ns", f"z{i}") for i in range(1000))
                  if h % BUCKETS not in (h1 % BUCKETS, h2 % BUCKETS))
    assert not reader.maybe_present(h1)
    writer.publish(h1, 1)
    assert reader.maybe_present(h1)
    assert int(writer.presence[h1 & (BUCKETS - 1)]) == 1
    writer.publish(h1, 2)  # two READY entries in the same bucket (e.g. two namespaces colliding)
    writer.publish(h2, 3)
    assert int(writer.presence[h1 & (BUCKETS - 1)]) == (3 if h1 % BUCKETS == h2 % BUCKETS else 2)
    assert not reader.maybe_present(absent)
    writer.unpublish(EventKind.DELETED, h1, 1)
    assert reader.maybe_present(h1)
    writer.unpublish(EventKind.EVICTED, h1, 2)
    writer.unpublish(EventKind.DELETED, h2, 3)
    assert not reader.maybe_present(h1)
    assert not reader.maybe_present(h2)
    assert int(writer.presence.sum()) == 0


def test_exactly_slots_minus_one_pending_is_read(writer, reader):
    for i in range(SLOTS - 1):
        writer.publish(i, i)
    got = events(reader.poll())
    assert [g for _, _, g in got] == list(range(SLOTS - 1))
    assert reader.overruns == 0


def test_overrun_when_writer_laps_reader(writer, reader):
    writer.publish(1, 1)
    assert events(reader.poll()) == [(EventKind.PUBLISHED, 1, 1)]
    for i in range(SLOTS + 5):
        writer.publish(100 + i, 100 + i)
    assert reader.pending() == SLOTS + 5
    assert reader.poll() is None
    assert reader.overruns == 1
    assert reader.pending() == 0  # resynced to the head
    assert reader.next_seq == writer.events_written
    writer.publish(9, 9)
    writer.unpublish(EventKind.DELETED, 9, 9)
    assert events(reader.poll()) == [(EventKind.PUBLISHED, 9, 9), (EventKind.DELETED, 9, 9)]
    assert reader.overruns == 1


def test_overwritten_slot_stamp_is_detected(writer, reader):
    # a reader positioned at a sequence whose slot now carries a later stamp was overrun even if
    # write_seq alone does not show it
    writer.publish(1, 1)
    writer.publish(2, 2)
    reader.next_seq = writer.events_written - 2
    writer.slots[(reader.next_seq) & (SLOTS - 1), 0] = np.uint64(reader.next_seq + SLOTS)
    assert reader.poll() is None
    assert reader.overruns == 1
    assert reader.pending() == 0


def test_max_events_backlog_limit(writer, reader):
    for i in range(10):
        writer.publish(i, i)
    assert reader.poll(max_events=9) is None
    assert reader.overruns == 1
    assert reader.pending() == 0
    for i in range(3):
        writer.publish(50 + i, 50 + i)
    assert [g for _, _, g in events(reader.poll(max_events=3))] == [50, 51, 52]
    assert reader.overruns == 1


def test_skip_to_head(writer, reader):
    writer.publish(1, 1)
    writer.publish(2, 2)
    reader.skip_to_head()
    assert reader.pending() == 0
    assert events(reader.poll()) == []


def test_alive_and_close(writer, reader):
    assert reader.alive(5.0)
    writer.close()
    assert not reader.alive(5.0)
    assert not reader.alive(1e9)


def test_alive_false_when_heartbeat_is_old(writer, reader):
    writer.header[ring_mod._HEARTBEAT] = np.uint64(time.monotonic_ns() - 10 * 10**9)
    assert not reader.alive(5.0)
    assert reader.alive(60.0)
    writer.heartbeat()
    assert reader.alive(5.0)


def test_alive_false_when_clock_moves_on(writer, reader, monkeypatch):
    now = time.monotonic_ns()
    monkeypatch.setattr(ring_mod.time, "monotonic_ns", lambda: now + 3 * 10**9)
    assert reader.alive(5.0)
    assert not reader.alive(2.0)


def test_reader_rejects_bad_magic(buf):
    with pytest.raises(ValueError, match="magic"):
        RingReader(buf, SLOTS, BUCKETS)  # never formatted
    RingWriter(buf, SLOTS, BUCKETS, epoch=1)
    np.frombuffer(buf, np.uint64, count=1)[0] = np.uint64(0x1234)
    with pytest.raises(ValueError, match="magic"):
        RingReader(buf, SLOTS, BUCKETS)


def test_reader_rejects_bad_version(buf, writer):
    writer.header[ring_mod._VERSION] = np.uint64(99)
    with pytest.raises(ValueError, match="version"):
        RingReader(buf, SLOTS, BUCKETS)


def test_reader_rejects_wrong_geometry():
    m = mmap.mmap(-1, ring_bytes(128, BUCKETS))
    RingWriter(m, 128, BUCKETS, epoch=1)
    with pytest.raises(ValueError, match="geometry"):
        RingReader(m, 64, BUCKETS)


def test_key_hash_separates_namespace_and_key():
    assert key_hash("a", "bc") != key_hash("ab", "c")
    assert key_hash("ns", "k") == key_hash("ns", "k")
    assert 0 <= key_hash("ns", "k") < 2**64


def test_key_hash_is_stable_across_processes():
    code = "from ecd.memory.ring import key_hash; print(key_hash('ns', 'mm:abc'), key_hash('', 'é'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}, check=True, timeout=60)
    assert out.stdout.split() == [str(key_hash("ns", "mm:abc")), str(key_hash("", "é"))]


def test_key_hash_known_value():
    # Pinned: clients and daemons built from different checkouts must agree on the hash, so a
    # change to key_hash is a protocol change (bump the ring VERSION), not a refactor.
    assert key_hash("ns", "k") == 13982026912262787732
    assert key_hash("", "x") == 2812061760185643760
