"""The entry index (ecd/memory/entry_index.py): what the daemon writes, a reader finds exactly,
and nothing else: other keys of the same hash, half-written and scribbled records are misses."""
from __future__ import annotations

import mmap

import numpy as np
import pytest

from ecd.memory.entry_index import KEY_BYTES, RECORD_WORDS, WAYS, IndexReader, IndexWriter, index_bytes
from ecd.memory.ring import key_hash

RECORDS = 64


@pytest.fixture
def pair():
    buf = mmap.mmap(-1, 4096 + index_bytes(RECORDS))
    return IndexWriter(buf, 4096, RECORDS), IndexReader(buf, 4096, RECORDS)


def put(writer, ns, key, generation, keyhash=None, shape=(2, 3), dtype="float32"):
    keyhash = key_hash(ns, key) if keyhash is None else keyhash
    nbytes = int(np.prod(shape)) * {"float32": 4, "bfloat16": 2}[dtype]
    return writer.put(keyhash, ns, key, generation, 0, 4096 * generation, nbytes, dtype, list(shape), 77)


def test_a_put_entry_is_found_with_its_whole_location(pair):
    writer, reader = pair
    assert put(writer, "ns", "k", 5, shape=(4, 8), dtype="bfloat16")
    assert reader.lookup(key_hash("ns", "k"), "ns", "k") == (5, 0, 20480, 64, "bfloat16", [4, 8], 77)
    assert reader.lookup(key_hash("ns", "other"), "ns", "other") is None
    writer.remove(5)
    assert reader.lookup(key_hash("ns", "k"), "ns", "k") is None


def test_keys_of_one_hash_are_told_apart_by_their_bytes(pair):
    writer, reader = pair
    same = 12345
    assert put(writer, "a", "x", 1, keyhash=same) and put(writer, "ab", "", 2, keyhash=same)
    assert reader.lookup(same, "a", "x")[0] == 1
    assert reader.lookup(same, "ab", "")[0] == 2  # same bytes "ax"/"ab" differ; lengths split them
    assert reader.lookup(same, "a", "b") is None


def test_a_full_bucket_or_a_long_key_is_not_indexed_and_counted(pair):
    writer, reader = pair
    bucket_hash = 3  # every key below lands in bucket 3
    for g in range(1, WAYS + 1):
        assert put(writer, "ns", f"k{g}", g, keyhash=bucket_hash + (g << 32))
    assert not put(writer, "ns", "one-more", 99, keyhash=bucket_hash + (99 << 32))
    assert not put(writer, "ns", "x" * KEY_BYTES, 100)
    assert writer.skipped == 2
    writer.remove(2)  # room again
    assert put(writer, "ns", "one-more", 99, keyhash=bucket_hash + (99 << 32))
    assert reader.lookup(bucket_hash + (99 << 32), "ns", "one-more")[0] == 99


def test_a_record_being_written_or_scribbled_is_a_miss_and_repaired(pair):
    writer, reader = pair
    put(writer, "ns", "k", 7)
    keyhash = key_hash("ns", "k")
    record = writer.record_of(7)
    row = reader.words[record]
    row[0] += 1  # odd: as if the daemon were writing it
    assert reader.lookup(keyhash, "ns", "k") is None
    row[0] += 1  # even again: the same words read as before
    assert reader.lookup(keyhash, "ns", "k")[0] == 7
    row[5] = 1 << 40  # a size that does not match the shape: not the daemon's
    assert reader.lookup(keyhash, "ns", "k") is None
    assert writer.repair()  # the heartbeat's audit rewrites it from the daemon's copy
    assert reader.lookup(keyhash, "ns", "k")[0] == 7
    assert not writer.repair()
    reader.words[:] = 0  # everything gone: repaired a slice per heartbeat
    assert reader.lookup(keyhash, "ns", "k") is None
    for _ in range(RECORDS // 16):
        writer.repair(records=16)
    assert writer.repair(records=RECORDS) is False and reader.lookup(keyhash, "ns", "k")[0] == 7


def test_garbage_everywhere_raises_nothing(pair):
    writer, reader = pair
    rng = np.random.default_rng(1)
    reader.words[:] = rng.integers(0, 2**63, size=(RECORDS, RECORD_WORDS), dtype=np.uint64)
    reader.words[:, 0] &= ~np.uint64(1)
    for i in range(200):
        assert reader.lookup(int(rng.integers(0, 2**63)), "ns", f"k{i}") is None


def test_no_index_is_an_index_of_nothing():
    buf = mmap.mmap(-1, 4096)
    writer, reader = IndexWriter(buf, 4096, 0), IndexReader(buf, 4096, 0)
    assert not writer.put(1, "ns", "k", 1, 0, 0, 4, "float32", [1], 0)
    assert reader.lookup(1, "ns", "k") is None
    with pytest.raises(ValueError):
        IndexWriter(buf, 0, 6)


# ---- read slots ----------------------------------------------------------------------------------

@pytest.fixture
def slot_pool():
    """A sealed memfd the size of a pool segment's share plus a slot area of 4 pages of 8 slots."""
    from ecd.memory.entry_index import slot_area_at_end, slot_area_bytes
    from ecd.memory.memfd import MemfdFile
    segment = MemfdFile.create_sealed("ecd.test-slots.0", (1 << 20) + slot_area_bytes(4, 8))
    try:
        yield segment, slot_area_at_end(segment, 4, 8)
    finally:
        segment.unlink()


def page_of(segment, area, page):
    from ecd.memory.entry_index import SlotPage
    offset, slots = area.location(page)
    return SlotPage(segment.buf, offset, slots)


def test_a_slot_holds_its_generation_until_cleared_and_a_pin_until_its_deadline(slot_pool):
    segment, area = slot_pool
    now = 10**12
    assert area.held(now, 10**9) == frozenset()  # no page handed out: nothing to read
    page = area.assign()
    assert page == 0 and area.location(page) == (1 << 20, 8)
    slots = page_of(segment, area, page)
    viewed = slots.hold([11, 12])
    pinned = slots.hold([13], deadline_ns=now + 5 * 10**8)
    forged = slots.hold([14], deadline_ns=now + 10 * 10**9)  # past max_pin: no client was given it
    assert viewed is not None and pinned is not None and forged is not None
    assert area.held(now, 10**9) == {11, 12}  # a pin never defers a free ...
    assert area.scan(now, 10**9) == ({11, 12}, [(0, 13, now + 5 * 10**8)])  # ... it keeps out of plans
    assert area.scan(now + 6 * 10**8, 10**9) == ({11, 12}, [])  # the pin ran out
    slots.extend(pinned[0], now + 7 * 10**8)
    slots.extend(pinned[0], now + 6 * 10**8)  # an earlier deadline never shortens it
    assert area.scan(now + 6 * 10**8, 10**9)[1] == [(0, 13, now + 7 * 10**8)]
    slots.clear(viewed)
    assert area.scan(now, 10**9) == (set(), [(0, 13, now + 7 * 10**8)])
    assert slots.hold([1] * 7) is None and slots.available == 6  # more than it has free: nothing written


def test_a_released_page_is_zeroed_and_handed_out_again_lowest_first(slot_pool):
    segment, area = slot_pool
    pages = [area.assign() for _ in range(4)]
    assert pages == [0, 1, 2, 3] and area.assign() is None  # all taken: that session asks the daemon
    page_of(segment, area, 2).hold([21, 22])
    assert area.revoke(2, 21) == 1 and area.held(0, 10**9) == {22}
    assert area.release(2) == 1  # one slot was still held
    assert area.held(0, 10**9) == frozenset() and area.assign() == 2


def test_a_previous_run_s_slots_stay_held_for_the_quarantine(slot_pool):
    from ecd.memory.entry_index import SlotArea
    segment, area = slot_pool
    page = page_of(segment, area, area.assign())
    page.hold([31, 32])
    page.hold([33], deadline_ns=110)  # a pin: the new run holds no pins of the old one
    again = SlotArea(segment, area.offset, 4, 8)  # the next daemon run over the same pool
    assert again.adopt(100, quarantine_ns=50, max_pin_ns=10**9) == 2
    assert again.held(120, 10**9) == {31, 32}  # no page assigned yet: the ghosts alone
    again.drop_ghost(31)  # its reader leased it again and let go
    assert again.held(120, 10**9) == {32}
    assert again.held(151, 10**9) == frozenset()  # the quarantine is over
    assert not np.frombuffer(segment.buf, np.uint64, count=64, offset=area.offset).any()  # cleared for this run
