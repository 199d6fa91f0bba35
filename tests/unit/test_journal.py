"""The restart journal (ecd/memory/journal.py) and the adoption of its records into a new Store
(ecd/daemon/restart/adopt.py), in process: a real Journal over an anonymous mapping, a real
Store over a real HostTier and RingWriter. The daemon-level restarts (real processes, SIGTERM
and SIGKILL, a keeper) are tests/integration/test_restart.py."""
from __future__ import annotations

import hashlib
import mmap
import random

import pytest

from ecd.config import LeasesSection, LimitsSection
from ecd.daemon.registry.entries import State
from ecd.daemon.registry.store import Store
from ecd.daemon.restart.adopt import Kept, adopt_entries
from ecd.daemon.tiers.base import NullTier
from ecd.daemon.tiers.host import HostTier
from ecd.memory.allocator import ALIGNMENT, align_up
from ecd.memory.journal import (ENTRY_MAGIC, ENTRY_SHARE, GRANULE, HEADER_BYTES, Journal, JournalRefused,
                                Layout, new_key)
from ecd.memory.ring import ASK, HERE, RingReader, RingWriter, key_hash, ring_bytes
from ecd.protocol import AllocItem, Extent

LAYOUT = Layout("n1", "memfd", (64 * ALIGNMENT, 64 * ALIGNMENT))
SIZE = 1 << 20
KEY = new_key()


def _mac(key: bytes, data: bytes) -> bytes:
    return hashlib.blake2b(data, key=key, digest_size=8).digest()


def fresh(size: int = SIZE) -> tuple[mmap.mmap, Journal]:
    buf = mmap.mmap(-1, size)
    return buf, Journal.create(buf, size, LAYOUT, KEY)


def record(journal: Journal, generation: int, key: str, pool: int = 0, offset: int = 0, ns: str = "ns",
           committed: bool = True) -> int:
    return journal.entry(generation, pool, offset, 100, "float32", (5, 5), ns, key, checksum=0xABC, committed=committed)


def test_entries_survive_and_forgotten_ones_do_not():
    buf, journal = fresh()
    kept = {record(journal, g, f"k{g}", offset=g * ALIGNMENT): g for g in range(1, 40)}
    gone = [at for at, g in kept.items() if g % 3 == 0]
    for at in gone:
        journal.forget(at)
    intent = journal.intent(99, 1, 7 * ALIGNMENT, 512)
    assert intent >= HEADER_BYTES
    _, entries, intents, skipped = Journal.open(buf, SIZE, LAYOUT, KEY)
    assert skipped == 0
    assert sorted(e.generation for e in entries) == [g for g in range(1, 40) if g % 3]
    e = next(e for e in entries if e.generation == 4)
    assert (e.pool, e.offset, e.nbytes, e.checksum, e.dtype, e.shape, e.ns, e.key) == (
        0, 4 * ALIGNMENT, 100, 0xABC, "float32", (5, 5), "ns", "k4")
    assert [(i.generation, i.pool, i.offset, i.size, i.at) for i in intents] == [(99, 1, 7 * ALIGNMENT, 512, intent)]


def test_a_put_not_committed_reads_back_as_writing_and_its_commit_flips_it():
    buf, journal = fresh()
    at = record(journal, 7, "k", committed=False)
    (e,) = Journal.open(buf, SIZE, LAYOUT, KEY)[1]
    assert (e.committed, e.checksum) == (False, 0)
    journal.commit(at, 0xFEED, key_hash("ns", "k"))
    (e,) = Journal.open(buf, SIZE, LAYOUT, KEY)[1]
    assert (e.committed, e.checksum, e.key, e.keyhash) == (True, 0xFEED, "k", key_hash("ns", "k"))
    buf[at + 24] ^= 1  # the checksum word is not under the MAC: the state and checksum are the commit's
    assert Journal.open(buf, SIZE, LAYOUT, KEY)[1][0].checksum == 0xFEED ^ 1


def test_a_torn_record_is_skipped_and_its_neighbours_kept():
    buf, journal = fresh()
    first = record(journal, 1, "a")
    torn = record(journal, 2, "b" * 300)
    last = record(journal, 3, "c")
    buf[torn + 40] ^= 0xFF  # a kill in the middle of writing it
    reopened, entries, _, skipped = Journal.open(buf, SIZE, LAYOUT, KEY)
    assert skipped == 1
    assert sorted((e.at, e.key) for e in entries) == [(first, "a"), (last, "c")]
    # the torn record's space was zeroed and is reused, and the journal still reads back
    again = record(reopened, 4, "d")
    _, entries, _, skipped = Journal.open(buf, SIZE, LAYOUT, KEY)
    assert skipped == 0 and sorted(e.key for e in entries) == ["a", "c", "d"] and again >= HEADER_BYTES


def test_a_record_smuggled_in_a_key_is_never_adopted():
    """A client picks its keys: one that spells a record (with a MAC made without the journal's
    secret key) must not be taken for one, neither inside its live record nor after that one
    was torn or deleted."""
    buf, journal = fresh()
    body = b"\x01" * 60
    head = ENTRY_MAGIC + (1).to_bytes(2, "little") + len(body).to_bytes(2, "little")
    forged = head + _mac(b"\0" * 32, head + body) + body
    key = "x" * (GRANULE - 20) + forged.decode("latin-1")
    carrier = record(journal, 1, key)
    _, entries, _, skipped = Journal.open(buf, SIZE, LAYOUT, KEY)
    assert [e.key for e in entries] == [key] and skipped == 0
    buf[carrier + 10] ^= 0xFF  # the carrier torn: the scan walks through its bytes
    _, entries, _, skipped = Journal.open(buf, SIZE, LAYOUT, KEY)
    assert entries == [] and skipped >= 1


@pytest.mark.parametrize("field,other", [("node", Layout("n2", "memfd", LAYOUT.segments)),
                                          ("backing", Layout("n1", "named", LAYOUT.segments)),
                                          ("segments", Layout("n1", "memfd", (128 * ALIGNMENT,)))])
def test_a_journal_of_another_layout_is_refused_with_the_reason(field, other):
    buf, journal = fresh()
    record(journal, 1, "a")
    with pytest.raises(JournalRefused, match=field):
        Journal.open(buf, SIZE, other, KEY)


def test_a_journal_of_another_format_or_a_damaged_header_is_refused():
    buf, _ = fresh()
    buf[8] = 99  # the format number
    with pytest.raises(JournalRefused, match="format 99"):
        Journal.open(buf, SIZE, LAYOUT, KEY)
    buf, _ = fresh()
    buf[60] ^= 1  # inside the header's MACed part
    with pytest.raises(JournalRefused, match="fails its MAC"):
        Journal.open(buf, SIZE, LAYOUT, KEY)
    with pytest.raises(JournalRefused, match="no valid header"):
        Journal.open(mmap.mmap(-1, SIZE), SIZE, LAYOUT, KEY)


def test_a_journal_written_with_another_key_is_refused_whatever_its_header_says():
    """Issue 40: the MAC key is not in the journal. One written by someone without the daemon's
    key (a fake holder's, say) is refused as a whole, even with every record and the header
    consistent with the key it was made with; and a record forged the way format 1 allowed (its
    MAC keyed by bytes of the header) is not adopted from a genuine journal either."""
    buf = mmap.mmap(-1, SIZE)
    forger = Journal.create(buf, SIZE, LAYOUT, new_key())
    forger.entry(5, 0, 0, 100, "float32", (5, 5), "ns", "victim", checksum=0xABC, committed=True)
    with pytest.raises(JournalRefused, match="not written with the key kept beside it"):
        Journal.open(buf, SIZE, LAYOUT, KEY)
    buf, journal = fresh()
    body = b"\x01" * 60
    head = ENTRY_MAGIC + (2).to_bytes(2, "little") + len(body).to_bytes(2, "little")
    header_bytes = bytes(buf[16:48])  # where format 1 kept its key
    buf[HEADER_BYTES:HEADER_BYTES + 128] = head + _mac(header_bytes, head + body) + body + bytes(128 - 16 - len(body))
    _, entries, _, skipped = Journal.open(buf, SIZE, LAYOUT, KEY)
    assert entries == [] and skipped == 1


def test_a_full_journal_keeps_quarantining_what_it_cannot_record_and_records_again_once_freed():
    size = HEADER_BYTES + (GRANULE << 8)  # the smallest journal: 16 KiB of records
    buf, journal = fresh(size)
    runs = (GRANULE << 8) // (2 * GRANULE)  # an entry record here takes 2 granules
    entries = [record(journal, g, "k") for g in range(1, int(runs * ENTRY_SHARE) + 1)]
    assert journal.full == 0 and min(entries) >= HEADER_BYTES
    # past ENTRY_SHARE: the put's entry is not recorded (not adopted), a one-granule intent is
    intents = []
    while (at := record(journal, 1000 + len(intents), "k")) >= 0:
        intents.append(at)
    assert journal.full == len(intents) + 1 and len(intents) == 2 * (runs - len(entries))
    _, read_entries, read_intents, skipped = Journal.open(buf, size, LAYOUT, KEY)
    assert (len(read_entries), len(read_intents), skipped) == (len(entries), len(intents), 0)
    assert record(journal, 1999, "k") == -1  # nothing fits now, not even an intent
    for at in [*intents, entries[5]]:  # space freed: below the entries' share again, recorded whole
        journal.forget(at)
    again = record(journal, 2000, "k")
    assert again == entries[5]  # the lowest free run of its size
    # a record larger than any run is never an entry: it is quarantined by an intent
    big = journal.entry(2001, 0, 0, 1, "u8", (), "ns", "k" * 20000)
    _, read_entries, read_intents, _ = Journal.open(buf, size, LAYOUT, KEY)
    assert again in [e.at for e in read_entries] and [i.generation for i in read_intents] == [2001]
    assert big == read_intents[0].at


def test_freed_runs_merge_so_records_of_other_sizes_fit_again():
    size = HEADER_BYTES + 2 * (GRANULE << 8)  # two runs of the largest size
    buf, journal = fresh(size)
    small = [journal.intent(g, 0, g * ALIGNMENT, ALIGNMENT) for g in range(1, 1000)]
    small = [at for at in small if at >= 0]
    assert len(small) == 512 and journal.intent(5000, 0, 0, 1) == -1  # every granule taken
    for at in small:
        journal.forget(at)
    # a record of the largest size: it fits only if the one-granule runs merged back
    big = journal.entry(6000, 0, 0, 1, "u8", (), "ns", "k" * 12000)
    (e,) = Journal.open(buf, size, LAYOUT, KEY)[1]
    assert (big, e.at, e.generation) == (HEADER_BYTES, HEADER_BYTES, 6000)


def test_random_records_and_forgets_read_back_exactly():
    rng = random.Random(7)
    buf, journal = fresh()
    live: dict[int, str] = {}
    for generation in range(1, 5000):
        if live and rng.random() < 0.45:
            at = rng.choice(list(live))
            journal.forget(at)
            del live[at]
        else:
            key = "k" * rng.randint(1, 700) + str(generation)
            at = record(journal, generation, key)
            assert at >= 0
            live[at] = key
    reopened, entries, _, skipped = Journal.open(buf, SIZE, LAYOUT, KEY)
    assert skipped == 0 and {e.at: e.key for e in entries} == live
    assert reopened.records == len(live)


# ---- adoption into a Store ----------------------------------------------------------------

class Scheduler:
    def __init__(self) -> None:
        self.later: list[tuple[float, object]] = []

    def call_later(self, delay, callback):
        self.later.append((delay, callback))
        return self


def new_store(journal) -> tuple[Store, Scheduler]:
    scheduler = Scheduler()
    buf = mmap.mmap(-1, ring_bytes(4096, 64))
    ring = RingWriter(buf, 4096, 64, epoch=1)
    store = Store(HostTier(list(LAYOUT.segments)), NullTier(), ring, scheduler, LimitsSection(), LeasesSection(),
                  clock=lambda: 5.0)
    store.journal = journal
    store.ring_reader = RingReader(buf, 4096, 64)  # type: ignore[attr-defined]  # what a client would see
    return store, scheduler


def put(store: Store, session, key: str, nbytes: int, ns: str = "ns", commit: bool = True) -> int:
    extent = store.alloc(session, ns, AllocItem(key, "uint8", [nbytes], nbytes))
    assert isinstance(extent, Extent), extent
    if commit:
        assert store.commit(session, extent.generation, checksum=nbytes) is None
    return extent.generation


def snapshot(store: Store) -> dict:
    return {k: (e.generation, e.pool, e.offset, e.nbytes, e.dtype, e.shape, e.checksum)
            for k, e in store.index.items()}


def test_a_new_store_adopts_what_was_committed_and_nothing_else():
    buf, journal = fresh()
    old, _ = new_store(journal)
    writer = old.open_session(1, 0)
    for i in range(30):
        put(old, writer, f"k{i}", 300 + i, ns="a" if i % 2 else "b")
    put(old, writer, "k3", 999, ns="a")  # a replace
    old.delete("b", ["k4", "k6"])
    unfinished = put(old, writer, "half", 700, commit=False)
    reader = old.open_session(2, 0)
    old.acquire(reader, "a", ["k5"], 0, lambda r: None)  # a read lease: dies with the old daemon
    old.reserve(writer, 500)  # a reservation of the writer's: also dies
    before = snapshot(old)

    _, entries, intents, skipped = Journal.open(buf, SIZE, LAYOUT, KEY)
    assert all(e.keyhash == key_hash(e.ns, e.key) for e in entries if e.committed)  # as the commit recorded it
    new, scheduler = new_store(journal)
    stats = adopt_entries(new, Kept(None, None, journal, -1, entries, intents, skipped, 0.0), 60.0)  # type: ignore[arg-type]
    assert snapshot(new) == before
    assert stats.entries == len(before) == 28 and stats.bytes == sum(v[3] for v in before.values())
    assert stats.quarantined == 2 and stats.skipped_records == 0
    assert all(e.state is State.READY and not e.readers and not e.pins for e in new.index.values())
    assert set(new.evictable) == {e.generation for e in new.index.values()}
    assert new.ns_used == {ns: sum(align_up(v[3]) for (n, _), v in before.items() if n == ns) for ns in ("a", "b")}
    for (ns, key), _ in new.index.items():  # on the ring: clients' lookups see them
        assert new.ring_reader.lookup(key_hash(ns, key)) in (HERE, ASK)  # ASK: a bucket two keys share
    assert sum(new.ring_reader.lookup(key_hash(ns, key)) == HERE for (ns, key), _ in new.index.items()) > 0
    # the unfinished write's and the reservation's extents stay out of use until the write TTL
    used = sum(a.used for a in new.host.allocators)
    assert used == sum(align_up(v[3]) for v in before.values()) + align_up(700) + align_up(500)
    (delay, end_quarantine), = scheduler.later
    assert delay == 60.0
    end_quarantine()
    assert sum(a.used for a in new.host.allocators) == used - align_up(700) - align_up(500)
    # generations go on above every adopted one; the journal follows the new store
    session = new.open_session(9, 0)
    assert put(new, session, "later", 10) > max(unfinished, *(v[0] for v in before.values()))
    _, entries, intents, _ = Journal.open(buf, SIZE, LAYOUT, KEY)
    assert {(e.ns, e.key) for e in entries} == set(before) | {("ns", "later")} and intents == []


def test_a_replace_killed_between_its_two_records_adopts_the_newer():
    buf, journal = fresh()
    older = record(journal, 5, "k", offset=0)
    record(journal, 9, "k", offset=4 * ALIGNMENT)
    _, entries, intents, skipped = Journal.open(buf, SIZE, LAYOUT, KEY)
    new, _ = new_store(journal)
    adopt_entries(new, Kept(None, None, journal, -1, entries, intents, skipped, 0.0), 1.0)  # type: ignore[arg-type]
    assert new.index[("ns", "k")].generation == 9
    assert [e.at for e in Journal.open(buf, SIZE, LAYOUT, KEY)[1]] != [older]
    assert new.host.allocators[0].used == align_up(100)


def test_records_that_do_not_fit_the_pool_are_dropped_not_trusted():
    buf, journal = fresh()
    record(journal, 1, "ok", offset=0)
    record(journal, 2, "overlaps", offset=0)  # the same extent as another: a bug, never served
    record(journal, 3, "past-the-end", offset=64 * ALIGNMENT)
    assert record(journal, 4, "no-such-pool", pool=7) == -1  # a CUDA arena's: never journaled
    journal.pools = 8  # as a journal written by a bug (or an arena record) would have it
    record(journal, 4, "no-such-pool", pool=7)
    _, entries, intents, skipped = Journal.open(buf, SIZE, LAYOUT, KEY)
    new, _ = new_store(journal)
    stats = adopt_entries(new, Kept(None, None, journal, -1, entries, intents, skipped, 0.0), 1.0)  # type: ignore[arg-type]
    assert [key for (_, key), _ in new.index.items()] in (["ok"], ["overlaps"])
    assert stats.entries == 1 and stats.skipped_records == 3


def test_marking_keys_present_at_once_leaves_the_words_one_by_one_would():
    rng = random.Random(3)
    buckets = 64
    one_by_one = RingWriter(mmap.mmap(-1, ring_bytes(64, buckets)), 64, buckets, epoch=1)
    at_once = RingWriter(mmap.mmap(-1, ring_bytes(64, buckets)), 64, buckets, epoch=1)
    before = [rng.getrandbits(63) for _ in range(20)]  # keys published before (a disk tier's, say)
    for h in before:
        one_by_one.publish(h, 1)
        at_once.publish(h, 1)
    # collisions on purpose: a few buckets, repeated hashes, buckets shared with `before`
    hashes = [rng.choice(before) if rng.random() < 0.2 else rng.getrandbits(63) for _ in range(500)]
    for h in hashes:
        one_by_one.mark_present(h)
    at_once.mark_all_present(hashes)
    assert (at_once.counts == one_by_one.counts).all()
    assert (at_once.words == one_by_one.words).all() and (at_once.presence == one_by_one.presence).all()


def test_an_entry_deleted_while_read_is_quarantined_not_adopted_nor_free():
    buf, journal = fresh()
    old, _ = new_store(journal)
    session = old.open_session(1, 0)
    put(old, session, "read", 5000)
    put(old, session, "gone", 5000)
    reader = old.open_session(2, 0)
    (loc,) = old.acquire(reader, "ns", ["read"], 0, lambda r: None)
    old.delete("ns", ["read", "gone"])  # "read" is retired: its reader still holds the bytes
    _, entries, intents, skipped = Journal.open(buf, SIZE, LAYOUT, KEY)
    new, scheduler = new_store(journal)
    stats = adopt_entries(new, Kept(None, None, journal, -1, entries, intents, skipped, 0.0), 30.0)  # type: ignore[arg-type]
    assert stats.entries == 0 and stats.quarantined == 1
    assert new.host.allocators[loc.pool].used == align_up(5000)  # the read extent is not handed out
    (_, end_quarantine), = scheduler.later
    end_quarantine()
    assert new.host.allocators[loc.pool].used == 0


def test_a_retired_entry_leaves_the_journal_with_its_last_reader():
    buf, journal = fresh()
    store, _ = new_store(journal)
    session, reader = store.open_session(1, 0), store.open_session(2, 0)
    put(store, session, "read", 5000)
    store.acquire(reader, "ns", ["read"], 0, lambda r: None)
    store.delete("ns", ["read"])
    assert [e.committed for e in Journal.open(buf, SIZE, LAYOUT, KEY)[1]] == [False]
    store.close_session(reader)  # its lease goes: the entry is freed, its record with it
    assert Journal.open(buf, SIZE, LAYOUT, KEY)[1] == []
