"""The event ring over an anonymous mmap: ordering, presence counters, overruns, liveness."""
from __future__ import annotations

import logging
import mmap
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from ecd.memory import fence
from ecd.memory import ring as ring_mod
from ecd.memory.ring import (ABSENT, ASK, HERE, MAGIC, MAX_SEQ, NOT_HERE, SHARED, EventKind, RingReader, RingWriter, key_hash,
                             ring_bytes)

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
    assert ring_bytes(64, 128) == 4096 + 128 * 8 + 64 * 32


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


def _colliding(h: int, prefix: str) -> int:
    """Another key hash in h's bucket."""
    return next(o for o in (key_hash("ns", f"{prefix}{i}") for i in range(100_000))
                if o % BUCKETS == h % BUCKETS and o != h)


def test_presence_words_name_the_key_or_say_absent(writer, reader):
    h1 = key_hash("ns", "a")
    h2 = _colliding(h1, "b")  # same bucket, another key
    absent = next(h for h in (key_hash("ns", f"z{i}") for i in range(1000)) if h % BUCKETS != h1 % BUCKETS)
    bucket = h1 & (BUCKETS - 1)
    assert reader.lookup(h1) == NOT_HERE
    writer.publish(h1, 1)
    assert reader.lookup(h1) == HERE  # the word is h1 itself
    assert reader.lookup(h2) == ASK  # another key's hash: the ring cannot say
    assert int(writer.counts[bucket]) == 1 and int(writer.presence[bucket]) == h1
    writer.publish(h1, 2)  # a replacement publishes its new generation before the old one goes
    writer.unpublish(EventKind.DELETED, h1, 1)
    assert reader.lookup(h1) == HERE and int(writer.counts[bucket]) == 1
    writer.publish(h2, 3)  # a second hash in the bucket: SHARED, both are asked about
    assert int(writer.presence[bucket]) == SHARED
    assert reader.lookup(h1) == ASK and reader.lookup(h2) == ASK
    assert reader.lookup(absent) == NOT_HERE
    writer.unpublish(EventKind.DELETED, h2, 3)
    assert reader.lookup(h1) == ASK  # SHARED until the bucket empties: never a wrong "here"
    writer.unpublish(EventKind.EVICTED, h1, 2)
    assert reader.lookup(h1) == NOT_HERE and reader.lookup(h2) == NOT_HERE
    assert int(writer.counts.sum()) == 0
    assert (writer.presence == ABSENT).all()
    writer.publish(h2, 4)  # an emptied bucket names its next key again
    assert reader.lookup(h2) == HERE and reader.lookup(h1) == ASK
    assert reader.corruptions == 0


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
    # a slot carrying a later stamp than write_seq allows (the writer's next lap would show in
    # write_seq, read after the copy) was written by someone else
    writer.publish(1, 1)
    writer.publish(2, 2)
    reader.next_seq = writer.events_written - 2
    writer.slots[(reader.next_seq) & (SLOTS - 1), 0] = np.uint64(reader.next_seq + SLOTS)
    assert reader.poll() is None
    assert reader.corruptions == 1 and reader.overruns == 0
    assert reader.last_problem == "slot stamps ahead of write_seq"
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


def test_key_hash_never_collides_with_a_reserved_presence_word(monkeypatch):
    # the 4 values a presence word uses for something else are moved, keeping their bucket
    for reserved in (0, 2**64 - 1, ABSENT, SHARED):
        class Digest:
            def digest(self, reserved=reserved):
                return reserved.to_bytes(8, "little")
        monkeypatch.setattr(ring_mod.hashlib, "blake2b", lambda *a, **k: Digest())
        h = key_hash("ns", "k")
        assert h not in (0, 2**64 - 1, ABSENT, SHARED) and h & 0xFFFF == reserved & 0xFFFF


def test_key_hash_is_stable_across_processes():
    code = "from ecd.memory.ring import key_hash; print(key_hash('ns', 'mm:abc'), key_hash('', 'é'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}, check=True, timeout=60)
    assert out.stdout.split() == [str(key_hash("ns", "mm:abc")), str(key_hash("", "é"))]


def test_key_hash_known_value():
    # Pinned: clients and daemons built from different checkouts must agree on the hash, so a
    # change to key_hash is a protocol change (bump the ring VERSION), not a refactor.
    assert key_hash("ns", "k") == 6109780668389145436
    assert key_hash("", "x") == 6095741918608312367


def test_key_hash_tells_apart_pairs_that_join_to_the_same_text():
    assert key_hash("a\0", "x") != key_hash("a", "\0x")
    assert key_hash("1:a", "b") != key_hash("1", "a\0b")


# ---- a ring another process scribbled over ----------------------------------------------------
# Any member of node.group can map the ring read-write. Whatever it writes, a reader never raises,
# never reads more than `slots` events, never believes a damaged header, zeroed or garbled
# presence words or a write_seq that went backwards; the daemon never reads the mapping back
# (its counts are private) and rewrites what differs at its next heartbeat.

def scribbled(reader, before: int) -> bool:
    return reader.corruptions > before


@pytest.mark.parametrize("word, value", [(ring_mod._MAGIC, 0x1234), (ring_mod._VERSION, 1),
                                         (ring_mod._SLOTS, SLOTS * 2), (ring_mod._BUCKETS, 0),
                                         (ring_mod._EPOCH, 8), (5, 1), (7, 2**64 - 1)])
def test_overwritten_header_word_is_distrusted_until_the_daemon_rewrites_it(writer, reader, word, value):
    writer.publish(1, 1)
    assert reader.usable(5.0)
    position = reader.next_seq
    writer.header[word] = np.uint64(value)
    writer.publish(2, 2)
    assert not reader.usable(5.0)
    assert reader.poll() is None
    assert reader.next_seq == position  # nothing read from a ring that is not what the daemon wrote
    assert reader.corruptions == 2 and reader.overruns == 0
    writer.heartbeat()  # the daemon's repair
    assert writer.repairs == 1
    assert reader.usable(5.0)
    assert events(reader.poll()) == [(EventKind.PUBLISHED, 1, 1), (EventKind.PUBLISHED, 2, 2)]


def test_garbage_closed_flag_and_heartbeat(writer, reader):
    writer.header[ring_mod._CLOSED] = np.uint64(7)
    assert not reader.usable(5.0) and reader.corruptions == 1
    writer.heartbeat()
    assert reader.usable(5.0)
    writer.header[ring_mod._CLOSED] = np.uint64(1)  # a real close is no corruption
    assert not reader.usable(5.0) and reader.corruptions == 1
    writer.heartbeat()  # ... but the daemon did not close it: rewritten
    for beat in (2**64 - 1, time.monotonic_ns() + 60 * 10**9):  # a dead daemon made to look alive
        writer.header[ring_mod._HEARTBEAT] = np.uint64(beat)
        assert not reader.alive(5.0)
        assert not reader.usable(5.0)
    assert reader.corruptions == 3
    writer.heartbeat()
    assert reader.usable(5.0)


@pytest.mark.parametrize("head", [2**64 - 1, 2**63, MAX_SEQ + 1, 2**64 - 1000])
def test_huge_write_seq_is_corruption_not_an_overrun_to_follow(writer, reader, head):
    writer.publish(1, 1)
    assert events(reader.poll()) == [(EventKind.PUBLISHED, 1, 1)]
    position = reader.next_seq
    writer.header[ring_mod._WRITE_SEQ] = np.uint64(head)
    assert reader.poll() is None and reader.poll(max_events=8) is None
    assert reader.next_seq == position  # not resynced to a head the daemon will never reach
    reader.skip_to_head()
    assert reader.next_seq == position
    assert reader.corruptions == 2 and reader.overruns == 0
    writer.publish(2, 2)  # rewrites write_seq: nothing was lost
    assert events(reader.poll()) == [(EventKind.PUBLISHED, 2, 2)]


def test_write_seq_moved_backwards(writer, reader):
    for i in range(5):
        writer.publish(i, i)
    reader.poll()
    for head in (0, writer.events_written - 3):
        before = reader.corruptions
        writer.header[ring_mod._WRITE_SEQ] = np.uint64(head)
        assert reader.poll() is None and scribbled(reader, before)
        writer.heartbeat()
        # Back at the real head: events read twice at worst, and a re-read event can only make
        # the caller drop a cached location (its cache was dropped with the None anyway).
        got = reader.poll()
        assert got is not None and len(got) <= SLOTS
    writer.publish(9, 9)
    assert events(reader.poll()) == [(EventKind.PUBLISHED, 9, 9)]


def test_write_seq_ahead_of_the_written_slots(writer, reader):
    for i in range(SLOTS + 1):  # every slot written once: those ahead of the head hold older stamps
        writer.publish(i, i)
        if i % 32 == 0:
            reader.poll()
    reader.poll()
    writer.header[ring_mod._WRITE_SEQ] = np.uint64(writer.events_written + 10)
    assert reader.poll() is None
    assert reader.corruptions == 1 and reader.overruns == 0  # stamps behind write_seq: not a lap
    writer.publish(2, 2)  # the real head is now behind the reader: noticed, resynced
    assert reader.poll() is None and reader.corruptions == 2
    writer.publish(3, 3)
    assert events(reader.poll()) == [(EventKind.PUBLISHED, 3, 3)]


def test_garbage_slots(writer, reader):
    rng = np.random.default_rng(1)
    for i in range(8):
        writer.publish(i, i)
    writer.slots[:] = rng.integers(0, 2**64, writer.slots.shape, dtype=np.uint64)
    assert reader.poll() is None  # lapped or scribbled: either way the caller resyncs
    assert reader.overruns + reader.corruptions == 1
    writer.publish(100, 100)
    assert events(reader.poll()) == [(EventKind.PUBLISHED, 100, 100)]


@pytest.mark.parametrize("kind", [0, 5, 2**64 - 1])
def test_event_of_unknown_kind_with_a_valid_stamp(writer, reader, kind):
    writer.publish(1, 1)
    writer.publish(2, 2)
    writer.slots[(writer.events_written - 1) & (SLOTS - 1), 1] = np.uint64(kind)
    assert reader.poll() is None
    assert reader.corruptions == 1 and reader.pending() == 0
    writer.publish(3, 3)
    assert events(reader.poll()) == [(EventKind.PUBLISHED, 3, 3)]


@pytest.mark.parametrize("fill", ["zero", "ones", "random"])
def test_overwritten_presence_words_mean_ask_not_absent(writer, reader, fill):
    h = key_hash("ns", "k")
    writer.publish(h, 1)
    words = {"zero": 0, "ones": 2**64 - 1}
    if fill == "random":
        writer.presence[:] = np.random.default_rng(2).integers(0, 2**64, BUCKETS, dtype=np.uint64)
    else:
        writer.presence[:] = np.uint64(words[fill])
    # no bucket reads as "certainly absent" or as naming a key any more, least of all the
    # present key's: every lookup asks, and counts the garbled word
    assert all(reader.lookup(b | 1 << 40) == ASK for b in range(BUCKETS))  # a key hash in bucket b
    assert reader.lookup(h) == ASK
    # random words pass the bucket check 1 time in BUCKETS (such a word still means "ask")
    counted = reader.corruptions
    assert counted == BUCKETS + 1 if fill != "random" else counted > BUCKETS * 0.9
    writer.heartbeat()  # the daemon rewrites the table from its private truth
    assert reader.lookup(h) == HERE
    assert sum(reader.lookup(b | 1 << 40) != NOT_HERE for b in range(BUCKETS)) == 1
    assert reader.corruptions == counted  # h's word is well formed for bucket h % BUCKETS


def test_writer_never_reads_the_mapping_back(writer, reader):
    h = key_hash("ns", "k")
    writer.presence[:] = 0  # a group member zeroes the table ...
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no numpy overflow warning either
        writer.unpublish(EventKind.DELETED, h, 1)  # ... the daemon decrements a zero count (a bug elsewhere)
        writer.publish(h, 2)
        writer.publish(h, 3)
        writer.unpublish(EventKind.DELETED, h, 2)
    assert int(writer.counts[h & (BUCKETS - 1)]) == 1
    assert reader.lookup(h) == HERE
    writer.header[ring_mod._WRITE_SEQ] = np.uint64(3)
    writer.publish(5, 5)  # its sequence is its own, not what it finds in the header
    assert int(writer.header[ring_mod._WRITE_SEQ]) == writer.events_written == 6


def test_repairs_are_logged_once(writer, reader, caplog):
    with caplog.at_level(logging.DEBUG, logger="ecd.ring"):
        for _ in range(3):
            writer.header[ring_mod._MAGIC] = np.uint64(0)
            assert not reader.usable(5.0)
            writer.heartbeat()
    assert writer.repairs == 3 and reader.corruptions == 3
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len([r for r in warned if r.message.startswith("event ring overwritten")]) == 1  # the daemon
    assert len([r for r in warned if r.message.startswith("the ecd event ring")]) == 1  # the reader


def test_presence_audit_sweeps_a_large_table_in_slices():
    buckets = ring_mod.AUDIT_BUCKETS * 2
    m = mmap.mmap(-1, ring_bytes(SLOTS, buckets))
    w = RingWriter(m, SLOTS, buckets, epoch=1)
    w.publish(buckets - 1, 1)
    w.presence[:] = 0
    w.heartbeat()
    assert (w.presence[:buckets // 2] == ABSENT).all() and not w.presence[buckets // 2:].any()
    w.heartbeat()
    assert int(w.presence[-1]) == buckets - 1 and (w.presence[:-1] == ABSENT).all()


def test_reader_survives_any_bytes(buf, writer, reader):
    """Random scribbles over header, presence and slots between the writer's and the reader's
    steps: the reader never raises and never returns more than `slots` events or an unknown
    kind; once the daemon has repaired the ring it follows it again."""
    rng = np.random.default_rng(3)
    raw = np.frombuffer(buf, np.uint8)  # the mapping the reader reads
    regions = [(0, 4096), (ring_mod._WRITE_SEQ * 8, ring_mod._WRITE_SEQ * 8 + 8), (4096, 4096 + BUCKETS * 8),
               (4096 + BUCKETS * 8, raw.size), (0, raw.size)]
    for step in range(3000):
        op = rng.integers(0, 10)
        if op < 3:
            lo, hi = regions[rng.integers(0, len(regions))]
            n = int(rng.integers(1, 64))
            at = rng.integers(lo, hi, n)
            raw[at] = rng.integers(0, 256, n, dtype=np.uint8)
        elif op < 6:
            writer.publish(int(rng.integers(0, 2**64, dtype=np.uint64)), step)
        elif op == 6:
            writer.heartbeat()
        got = reader.poll(int(rng.integers(1, 2 * SLOTS)) if step % 2 else None)
        if got is not None:
            assert got.shape[1] == 3 and len(got) <= SLOTS
            assert ((got[:, 0] >= 1) & (got[:, 0] <= len(EventKind))).all()
        assert 0 <= reader.next_seq <= MAX_SEQ
        reader.usable(5.0), reader.alive(5.0), reader.lookup(int(rng.integers(0, 2**63))), reader.pending()
        if step % 7 == 0:
            reader.skip_to_head()
    assert reader.corruptions > 0
    for _ in range(2):
        writer.heartbeat()
    reader.poll()
    assert reader.usable(5.0)
    assert events(reader.poll()) == []
    writer.publish(42, 42)
    assert events(reader.poll()) == [(EventKind.PUBLISHED, 42, 42)]
    assert all((reader.lookup(b) != NOT_HERE) == bool(writer.counts[b]) for b in range(BUCKETS))


# ---- a client attaching while the header is overwritten ---------------------------------------

def _welcome(epoch: int):
    from types import SimpleNamespace
    return SimpleNamespace(epoch=epoch, ring=SimpleNamespace(slots=SLOTS, buckets=BUCKETS, index_records=0))


@pytest.mark.timing
def test_attach_waits_for_the_daemon_to_repair_a_scribbled_header(buf, writer):
    import threading
    from ecd.client.mapping import open_ring
    ring_file = type("F", (), {"buf": buf})()
    for word, value in ((ring_mod._MAGIC, 0), (ring_mod._EPOCH, 99)):
        writer.header[word] = np.uint64(value)
        repair = threading.Timer(0.1, writer.heartbeat)
        repair.start()
        started = time.monotonic()
        ring = open_ring(ring_file, _welcome(7))
        repair.join()
        assert ring is not None and ring.epoch == 7 and time.monotonic() - started < 0.45


@pytest.mark.timing
def test_attach_gives_up_in_bounded_time(buf, writer):
    from ecd.client.mapping import RING_REPAIR_WAIT_S, open_ring
    ring_file = type("F", (), {"buf": buf})()
    writer.header[ring_mod._MAGIC] = np.uint64(0)  # and nobody repairs it
    started = time.monotonic()
    with pytest.raises(ValueError, match="magic"):
        open_ring(ring_file, _welcome(7))
    assert RING_REPAIR_WAIT_S <= time.monotonic() - started < RING_REPAIR_WAIT_S + 1.0
    writer.heartbeat()
    # another daemon's ring (a stale file of a dead one): no wait at all
    writer.close()
    started = time.monotonic()
    assert open_ring(ring_file, _welcome(8)) is None
    assert time.monotonic() - started < 0.1


# ---- memory ordering: the barriers, and slots the writer reaches while a reader copies them ---

class Interleave:
    """Stands in for ring.memory_barrier: counts the calls and, once armed, runs `action` at the
    reader's `at`-th barrier of a poll (1: between reading write_seq and copying the slots, 2:
    between the copy and the second look at write_seq), as the writer on another core may."""

    def __init__(self, at: int = 0, action=None) -> None:
        self.calls, self.at, self.action, self.armed, self.seen = 0, at, action, False, 0

    def __call__(self) -> None:
        self.calls += 1
        if self.armed:
            self.seen += 1
            if self.seen == self.at:
                self.armed = False  # the writer's own barriers while it runs are not the reader's
                self.action()

    def arm(self) -> None:
        self.armed, self.seen = True, 0


def test_barriers_per_operation(writer, reader, monkeypatch):
    hook = Interleave()
    monkeypatch.setattr(ring_mod, "memory_barrier", hook)
    writer.publish(1, 1)
    assert hook.calls == 2  # before the slot, before write_seq
    writer.unpublish(EventKind.DELETED, 1, 1)
    assert hook.calls == 4
    hook.calls = 0
    assert len(reader.poll()) == 2 and hook.calls == 2  # after write_seq, after the copy
    assert len(reader.poll()) == 0 and hook.calls == 2  # nothing new: no barrier at all


def test_slot_rewritten_while_copied_is_an_overrun_never_a_torn_event(writer, reader, monkeypatch):
    """The writer laps the reader between its look at write_seq and its copy, and has written
    part of the next slot (a weakly ordered CPU may show any part): the copy holds an event whose
    stamp is right and whose words are not. The second look at write_seq throws it away."""
    for i in range(10):
        writer.publish(1000 + i, 1000 + i)
    start = reader.next_seq
    victim = start & (SLOTS - 1)

    def lap_and_half_write():
        while writer.events_written < start + SLOTS:  # write_seq = start + SLOTS: slot `victim` is fair game
            writer.publish(7, 7)
        writer.slots[victim, 2] = np.uint64(0xBAD)  # keyhash of the next append, stamp not yet
        assert int(writer.slots[victim, 0]) == start  # the copy will see the stamp it expects

    hook = Interleave(at=1, action=lap_and_half_write)
    monkeypatch.setattr(ring_mod, "memory_barrier", hook)
    hook.arm()
    assert reader.poll() is None
    assert reader.overruns == reader.late_overruns == 1 and reader.corruptions == 0
    assert reader.next_seq == writer.events_written  # resynced to the head
    writer.publish(9, 9)
    assert events(reader.poll()) == [(EventKind.PUBLISHED, 9, 9)]


def test_lap_after_the_copy_is_an_overrun(writer, reader, monkeypatch):
    """The copy may have been whole, but the reader cannot know whether the writer reached it."""
    for i in range(10):
        writer.publish(i, i)
    start = reader.next_seq

    def lap():
        while writer.events_written < start + SLOTS:
            writer.publish(7, 7)

    hook = Interleave(at=2, action=lap)
    monkeypatch.setattr(ring_mod, "memory_barrier", hook)
    hook.arm()
    assert reader.poll() is None and reader.overruns == reader.late_overruns == 1 and reader.corruptions == 0


def test_events_appended_during_a_poll_wait_for_the_next(writer, reader, monkeypatch):
    writer.publish(1, 1)
    hook = Interleave(at=1, action=lambda: [writer.publish(2 + i, 2 + i) for i in range(SLOTS - 2)])
    monkeypatch.setattr(ring_mod, "memory_barrier", hook)
    hook.arm()
    assert events(reader.poll()) == [(EventKind.PUBLISHED, 1, 1)]  # write_seq - start = SLOTS - 1: not lapped
    assert [g for _, _, g in events(reader.poll())] == list(range(2, SLOTS))
    assert reader.overruns == 0 and reader.corruptions == 0


@pytest.mark.parametrize("strategy", fence.STRATEGIES)
def test_ring_through_each_barrier(buf, strategy, monkeypatch):
    monkeypatch.setattr(ring_mod, "memory_barrier", fence.make(strategy))
    w = RingWriter(buf, SLOTS, BUCKETS, epoch=3)
    r = RingReader(buf, SLOTS, BUCKETS)
    for batch in range(3):
        for i in range(40):
            w.publish(batch * 100 + i, batch * 100 + i)
        assert [g for _, _, g in events(r.poll())] == [batch * 100 + i for i in range(40)]
    for i in range(SLOTS + 1):
        w.publish(i, i)
    assert r.poll() is None and r.overruns == 1 and r.corruptions == 0


def test_barrier_only_where_the_cpu_needs_one():
    assert (fence.barrier is None) == fence.STRONGLY_ORDERED
    assert fence.STRONGLY_ORDERED == (fence.MACHINE in ("x86_64", "amd64", "i386", "i686"))
    assert ring_mod.memory_barrier is fence.barrier
    if fence.barrier is not None:
        assert fence.STRATEGY in ("libatomic", "code")  # the lock is a last resort, not expected here
    with pytest.raises(ValueError, match="unknown"):
        fence.make("mfence")


def test_hardware_barriers_run():
    for strategy in fence.STRATEGIES:
        try:
            barrier = fence.make(strategy)
        except OSError:
            assert strategy != "lock"  # always there
            continue
        for _ in range(3):
            assert barrier() is None
