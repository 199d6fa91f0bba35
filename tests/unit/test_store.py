"""Store driven directly: fake scheduler and clock, a real RingWriter over an anonymous mmap.

Every test ends with `env.check()`, which asserts the registry's cross-structure invariants:
the ring's presence counters equal the number of READY entries per bucket, allocator bytes
match the entries that hold extents, every unheld READY entry is evictable (and nothing else
is), and reader/pin counts agree with what the open sessions hold.
"""
from __future__ import annotations

import collections
import itertools
import mmap

import pytest

from ecd.errors import Code
from ecd.memory.allocator import ALIGNMENT, align_up
from ecd.memory.ring import ABSENT, SHARED, EventKind, RingReader, RingWriter, key_hash, ring_bytes
from ecd.config import LeasesSection, LimitsSection
from ecd.daemon.registry.entries import RequestError, State
from ecd.daemon.registry.store import Store
from ecd.daemon.tiers.base import NullTier
from ecd.daemon.tiers.host import HostTier
from ecd.protocol import AllocItem, Extent, Failure, Location

A = ALIGNMENT
SLOTS, BUCKETS = 4096, 16  # few buckets: keys collide, so per-bucket counts above 1 get exercised


class FakeHandle:
    def __init__(self, delay: float, callback) -> None:
        self.delay = delay
        self.callback = callback
        self.cancelled = False
        self.fired = False

    def cancel(self) -> None:
        self.cancelled = True

    def fire(self) -> None:
        assert not self.cancelled and not self.fired
        self.fired = True
        self.callback()


class FakeScheduler:
    def __init__(self) -> None:
        self.handles: list[FakeHandle] = []

    def call_later(self, delay: float, callback) -> FakeHandle:
        handle = FakeHandle(delay, callback)
        self.handles.append(handle)
        return handle

    def pending(self) -> list[FakeHandle]:
        return [h for h in self.handles if not h.cancelled and not h.fired]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Done:
    """An on_done callback that records what it was given."""

    def __init__(self) -> None:
        self.calls: list[list] = []

    def __call__(self, results) -> None:
        self.calls.append(results)

    @property
    def result(self):
        assert len(self.calls) == 1, self.calls
        return self.calls[0]


def never(results):  # an on_done for acquires that must not park
    raise AssertionError(f"unexpected completion {results}")


def item(key: str, nbytes: int = A, dtype: str = "uint8") -> AllocItem:
    itemsize = {"uint8": 1, "float32": 4, "int64": 8}[dtype]
    return AllocItem(key, dtype, [nbytes // itemsize], nbytes)


LEASE_KEYS = ("write_ttl", "max_pin", "max_wait")


def store_limits(**limits) -> tuple[LimitsSection, LeasesSection]:
    """[limits] and [leases] as node.toml would give them, with these values (of either section)."""
    leases = {k: limits.pop(k) for k in LEASE_KEYS if k in limits}
    return LimitsSection(**limits), LeasesSection(**leases)


class Env:
    def __init__(self, pool_sizes=(4 * A,), namespaces=None, arena_sizes=(), lower_tier=None, **limits) -> None:
        self.clock = FakeClock()
        self.sched = FakeScheduler()
        self.buf = mmap.mmap(-1, ring_bytes(SLOTS, BUCKETS))
        self.ring = RingWriter(self.buf, SLOTS, BUCKETS, epoch=1)
        self.reader = RingReader(self.buf, SLOTS, BUCKETS)
        self.store = Store(HostTier(list(pool_sizes), list(arena_sizes)), lower_tier or NullTier(), self.ring,
                           self.sched, *store_limits(**limits), clock=self.clock, namespaces=namespaces)
        self._ids = itertools.count(1)

    def session(self):
        return self.store.open_session(next(self._ids), pid=0)

    def reserving(self, session, ns: str = "ns"):
        """`session` as if it had just committed into `ns` (a reservation is asked for with a
        commit, and counts toward that commit's namespace)."""
        session.reserve_ns = ns
        return session

    def alloc(self, session, key: str, nbytes: int = A, ns: str = "ns") -> Extent:
        extent = self.store.alloc(session, ns, item(key, nbytes))
        assert isinstance(extent, Extent), extent
        return extent

    def put(self, session, key: str, nbytes: int = A, ns: str = "ns") -> int:
        extent = self.alloc(session, key, nbytes, ns)
        assert self.store.commit(session, extent.generation) is None
        return extent.generation

    def get(self, session, keys, ns: str = "ns"):
        return self.store.acquire(session, ns, list(keys), 0, never)

    def lease(self, session, key: str, ns: str = "ns") -> Location:
        (loc,) = self.get(session, [key], ns)
        assert isinstance(loc, Location), loc
        return loc

    def present(self, key: str, ns: str = "ns") -> bool:
        return (ns, key) in self.store.index

    def used(self, pool: int = 0) -> int:
        return self.store.host.allocators[pool].used

    def events(self) -> list[tuple[int, int, int]]:
        polled = self.reader.poll()
        assert polled is not None, "test reader overran"
        return [(int(k), int(h), int(g)) for k, h, g in polled]

    def check(self) -> None:
        store = self.store
        entries = list(store.by_generation.values())
        ready = [e for e in entries if e.state is State.READY]
        # the index holds exactly the READY entries
        assert sorted(e.generation for e in store.index.values()) == sorted(e.generation for e in ready)
        for (ns, key), e in store.index.items():
            assert (e.ns, e.key) == (ns, key) and e.keyhash == key_hash(ns, key)
        # presence counters: one per key that is READY in the pool or has a disk-tier record (a
        # spilled key stays present), nothing else; the shared table says ABSENT exactly where a
        # counter is zero, and names a key hash only where every present key in the bucket has it
        # (SHARED otherwise)
        present = {(e.ns, e.key) for e in ready} | {(r.ns, r.key) for r in store.lower_tier.listing()}
        expected = collections.Counter(key_hash(ns, key) & (BUCKETS - 1) for ns, key in present)
        actual = {b: int(n) for b, n in enumerate(self.ring.counts) if n}
        assert actual == dict(expected)
        hashes = collections.defaultdict(set)
        for ns, key in present:
            hashes[key_hash(ns, key) & (BUCKETS - 1)].add(key_hash(ns, key))
        for bucket, word in enumerate(int(w) for w in self.ring.presence):
            if bucket not in expected:
                assert word == ABSENT
            elif word != SHARED:
                assert hashes[bucket] == {word}
        # allocator bytes are exactly those of entries and reservations holding extents
        reservations = list(store.reservations.values())
        for pool, allocator in enumerate(store.host.allocators):
            want = (sum(align_up(max(e.nbytes, 1)) for e in entries if e.pool == pool)
                    + sum(r.size for r in reservations if r.pool == pool))
            assert allocator.used == want, f"pool {pool}: used {allocator.used}, entries hold {want}"
        # a reservation is its owner's one reservation, its generation no entry's
        assert store.reserved_bytes == sum(r.size for r in reservations)
        for r in reservations:
            assert r.owner.reservation is r and r.generation not in store.by_generation
        # entries' and reservations' extents and the free ones tile each pool exactly
        for pool, allocator in enumerate(store.host.allocators):
            spans = sorted([(e.offset, align_up(max(e.nbytes, 1))) for e in entries if e.pool == pool]
                           + [(r.offset, r.size) for r in reservations if r.pool == pool]
                           + allocator.free_extents())
            assert all(o1 + s1 == o2 for (o1, s1), (o2, _) in zip(spans, spans[1:])), spans
            assert spans[0][0] == 0 and spans[-1][0] + spans[-1][1] == allocator.capacity
        # evictable == READY entries with no reader and no pin
        unheld = {e.generation for e in ready if not e.readers and not e.pins}
        assert set(store.evictable) == unheld
        assert sum(store.evictable_bytes) == sum(align_up(max(e.nbytes, 1)) for e in store.evictable.values())
        # namespace bytes: every entry counts toward its own (a reservation: its commit's)
        want_ns = collections.Counter()
        for e in entries:
            want_ns[e.ns] += align_up(max(e.nbytes, 1))
        for r in reservations:
            want_ns[r.ns] += r.size
        assert store.ns_used == dict(want_ns)
        # what a guaranteed share protects: the READY bytes of the namespace
        want_ready = {ns: sum(align_up(max(e.nbytes, 1)) for e in ready if e.ns == ns) for ns in store.guarantees}
        assert store.guaranteed_ready == want_ready
        # each quota'd namespace's LRU is the global LRU order restricted to it
        placement = store.placement
        assert set(placement.quota_lru) == set(store.quotas)
        for ns, lru in placement.quota_lru.items():
            assert list(lru) == [g for g, e in store.evictable.items() if e.ns == ns]
            assert placement.quota_evictable_bytes[ns] == sum(align_up(max(e.nbytes, 1)) for e in lru.values())
        # reader and pin counts agree with the sessions
        sessions = list(store.each_session())
        for s in sessions:
            assert s.parked_keys == sum(len(w.keys) for w in s.waiters)
        for e in entries:
            assert e.readers == sum(s.leases.get(e.generation, 0) for s in sessions), e
            if e.state is not State.WRITING:
                assert e.pins == sum(1 for s in sessions if e.generation in s.pins), e
        for e in entries:
            assert e.state is not State.RETIRED or e.readers > 0, "retired entry without readers not freed"
        # parked waiters are registered under their missing keys
        for s in sessions:
            for w in s.waiters:
                for key in w.missing:
                    assert w in store.waiters[(w.ns, key)]
        if store.lower_tier.persists:  # the disk tier
            self.check_disk()

    def check_disk(self) -> None:
        """The disk tier: its bytes are its records' and within its budget; a key's record and
        its READY entry coexist only when they hold the same bytes (the same generation)."""
        disk = self.store.lower_tier
        records = list(disk.records.values())
        assert disk.used == sum(r.size for r in records) <= disk.capacity
        for (ns, key), record in disk.records.items():
            assert (record.header.ns, record.header.key) == (ns, key) and not record.dropped
            entry = self.store.index.get((ns, key))
            assert entry is None or entry.generation == record.generation, (key, entry, record)
            assert record.ready == (record.written is None)
        # every record not yet whole has its write in flight (a dropped record's may be too)
        assert disk.writes >= sum(1 for r in records if not r.ready)


@pytest.fixture
def env() -> Env:
    return Env()


# ---- put: alloc / commit / abort ----------------------------------------------------------------

def test_writing_entry_is_invisible(env):
    s = env.session()
    ext = env.alloc(s, "k")
    assert env.store.by_generation[ext.generation].state is State.WRITING
    assert env.used() == A
    (res,) = env.get(env.session(), ["k"])
    assert isinstance(res, Failure) and res.code == Code.KEY_NOT_FOUND
    assert env.store.exists(s, "ns", ["k"], 0) == [False]
    assert not env.ring.counts.any() and (env.ring.presence == ABSENT).all()
    assert env.events() == []
    assert env.store.count_states() == {State.WRITING: 1, State.READY: 0, State.RETIRED: 0}
    env.check()


def test_commit_makes_entry_ready_and_visible(env):
    s = env.session()
    ext = env.alloc(s, "k", 4 * 16)
    assert ext.generation == 1 and ext.pool == 0 and ext.offset == 0
    assert env.store.commit(s, ext.generation) is None
    assert env.store.exists(s, "ns", ["k", "other"], 0) == [True, False]
    assert env.events() == [(EventKind.PUBLISHED, key_hash("ns", "k"), ext.generation)]
    reader = env.session()
    (loc,) = env.get(reader, ["k"])
    assert loc == Location(ext.generation, 0, 0, 64, "uint8", [64])
    assert env.store.by_generation[ext.generation].readers == 1
    assert reader.leases == {ext.generation: 1}
    # namespaces are separate
    (miss,) = env.get(reader, ["k"], ns="other")
    assert isinstance(miss, Failure) and miss.code == Code.KEY_NOT_FOUND
    env.check()


def test_generations_are_unique_and_increasing(env):
    s = env.session()
    gens = [env.put(s, f"k{i}", 1) for i in range(3)]
    g4 = env.alloc(s, "k0", 1).generation
    env.store.abort(s, g4)
    g5 = env.alloc(s, "k1", 1).generation
    assert gens + [g4, g5] == [1, 2, 3, 4, 5]
    env.check()


def test_commit_by_another_session_is_not_owner(env):
    owner, other = env.session(), env.session()
    ext = env.alloc(owner, "k")
    failure = env.store.commit(other, ext.generation)
    assert isinstance(failure, Failure) and failure.code == Code.NOT_OWNER
    assert env.store.by_generation[ext.generation].state is State.WRITING
    assert not env.present("k")
    failure = env.store.abort(other, ext.generation)
    assert isinstance(failure, Failure) and failure.code == Code.NOT_OWNER
    assert env.store.commit(owner, ext.generation) is None
    assert env.present("k")
    env.check()


def test_commit_of_unknown_aborted_or_committed_generation_is_stale(env):
    s = env.session()
    for gen in (0, 999):
        failure = env.store.commit(s, gen)
        assert isinstance(failure, Failure) and failure.code == Code.STALE
    ext = env.alloc(s, "k")
    assert env.store.abort(s, ext.generation) is None
    failure = env.store.commit(s, ext.generation)
    assert isinstance(failure, Failure) and failure.code == Code.STALE
    gen = env.put(s, "k")
    failure = env.store.commit(s, gen)
    assert isinstance(failure, Failure) and failure.code == Code.STALE
    failure = env.store.abort(s, gen)
    assert isinstance(failure, Failure) and failure.code == Code.STALE
    assert env.store.by_generation[gen].state is State.READY
    env.check()


def test_abort_frees_the_extent(env):
    s = env.session()
    a = env.alloc(s, "a", 3 * A)
    assert env.used() == 3 * A
    assert env.store.abort(s, a.generation) is None
    assert env.used() == 0
    assert a.generation not in env.store.by_generation
    assert s.writes == {}
    failure = env.store.abort(s, a.generation)
    assert isinstance(failure, Failure) and failure.code == Code.STALE
    # the freed space is reusable at once, without evicting anything
    b = env.alloc(s, "b", 4 * A)
    assert b.offset == 0
    assert env.store.counters["evictions"] == 0
    env.check()


@pytest.mark.parametrize("bad, code, fragment", [
    (AllocItem("k", "float31", [4], 16), Code.INVALID, "unknown dtype"),
    (AllocItem("k", "float32", [4], 15), Code.INVALID, "nbytes=15"),
    (AllocItem("k", "float32", [2, 3], 16), Code.INVALID, "needs 24"),
    (AllocItem("k", "uint8", [1] * 5, 1), Code.LIMIT, "max_ndim"),
    (AllocItem("k" * 33, "uint8", [1], 1), Code.LIMIT, "max_key_bytes"),
    (AllocItem("é" * 17, "uint8", [1], 1), Code.LIMIT, "max_key_bytes"),  # 34 bytes, 17 chars
    (AllocItem("", "uint8", [1], 1), Code.INVALID, "empty key"),
    (AllocItem("k", "uint8", [4 * A + 1], 4 * A + 1), Code.INVALID, "larger than the largest pool"),
])
def test_alloc_validation_failures(bad, code, fragment):
    env = Env(max_ndim=4, max_key_bytes=32)
    s = env.session()
    env.put(s, "keep")
    result = env.store.alloc(s, "ns", bad)
    assert isinstance(result, Failure)
    assert result.code == code
    assert fragment in result.message, result.message
    assert env.used() == A
    assert env.store.count_states()[State.WRITING] == 0
    assert env.present("keep")  # a refused alloc evicts nothing
    assert env.store.counters["alloc_refused"] == 1
    env.check()


def test_namespace_too_long_is_refused():
    env = Env(max_key_bytes=8)
    result = env.store.alloc(env.session(), "n" * 9, item("k"))
    assert isinstance(result, Failure) and result.code == Code.LIMIT
    env.check()


def test_largest_allowed_and_zero_byte_items():
    env = Env()
    s = env.session()
    z = env.store.alloc(s, "ns", AllocItem("z", "float32", [0, 7], 0))
    assert isinstance(z, Extent)
    assert env.used() == A  # a zero-byte tensor still holds one aligned extent
    assert env.store.abort(s, z.generation) is None
    whole = env.store.alloc(s, "ns", item("w", 4 * A))
    assert isinstance(whole, Extent)
    env.check()


# ---- LRU eviction -------------------------------------------------------------------------------

def test_lru_eviction_order(env):
    s = env.session()
    gens = {k: env.put(s, k) for k in ("k0", "k1", "k2", "k3")}
    env.events()
    env.put(s, "k4")  # pool full: k0 is least recently used
    assert [env.present(k) for k in ("k0", "k1", "k2", "k3", "k4")] == [False, True, True, True, True]
    ev = env.events()
    assert ev[0] == (EventKind.EVICTED, key_hash("ns", "k0"), gens["k0"])
    assert ev[1][0] == EventKind.PUBLISHED
    assert env.store.counters["evictions"] == 1
    env.put(s, "k5")
    assert not env.present("k1")
    env.check()


def test_acquire_and_release_moves_entry_to_mru(env):
    s = env.session()
    for k in ("k0", "k1", "k2", "k3"):
        env.put(s, k)
    loc = env.lease(s, "k0")
    assert env.store.release(s, loc.generation) is None
    env.put(s, "k4")
    assert env.present("k0") and not env.present("k1")
    env.put(s, "k5")
    assert env.present("k0") and not env.present("k2")
    env.put(s, "k6")
    assert env.present("k0") and not env.present("k3")
    env.put(s, "k7")
    assert not env.present("k0")
    env.check()


def test_exists_moves_entry_to_mru(env):
    s = env.session()
    for k in ("k0", "k1", "k2", "k3"):
        env.put(s, k)
    assert env.store.exists(s, "ns", ["k1", "k0"], 0) == [True, True]
    env.put(s, "k4")
    assert not env.present("k2")
    env.put(s, "k5")
    assert not env.present("k3")
    env.put(s, "k6")
    assert not env.present("k1")  # k1 was touched before k0
    assert env.present("k0")
    env.check()


def test_eviction_frees_several_small_entries_for_a_big_one(env):
    s = env.session()
    for k in ("k0", "k1", "k2", "k3"):
        env.put(s, k)
    env.put(s, "big", 2 * A)
    assert [env.present(k) for k in ("k0", "k1", "k2", "k3")] == [False, False, True, True]
    assert env.store.counters["evictions"] == 2
    env.check()


def test_leased_and_pinned_entries_are_never_evicted(env):
    s, holder = env.session(), env.session()
    gens = {k: env.put(s, k) for k in ("k0", "k1", "k2", "k3")}
    env.lease(holder, "k0")
    assert env.store.exists(holder, "ns", ["k1"], pin_s=30) == [True]
    assert set(env.store.evictable) == {gens["k2"], gens["k3"]}
    env.put(s, "k4")
    env.put(s, "k5")
    assert [env.present(k) for k in ("k0", "k1", "k2", "k3")] == [True, True, False, False]
    env.put(s, "k6")
    env.put(s, "k7")
    assert env.present("k0") and env.present("k1")
    assert env.store.by_generation[gens["k0"]].readers == 1
    assert env.store.by_generation[gens["k1"]].pins == 1
    env.check()


def test_pool_full_when_everything_is_leased(env):
    s = env.session()
    for k in ("k0", "k1", "k2", "k3"):
        env.put(s, k)
    env.get(s, ["k0", "k1", "k2"])
    env.store.exists(s, "ns", ["k3"], pin_s=10)
    result = env.store.alloc(s, "ns", item("new"))
    assert isinstance(result, Failure) and result.code == Code.POOL_FULL
    msg = result.message
    assert f"no room for {A} bytes" in msg
    assert f"{4 * A} of {4 * A} bytes in use" in msg
    assert f"{4 * A} bytes held: 4 entries leased or pinned" in msg
    assert "0 being written" in msg
    assert all(env.present(k) for k in ("k0", "k1", "k2", "k3"))
    assert env.store.counters["evictions"] == 0
    assert env.store.counters["pool_full"] == 1
    env.check()


def test_pool_full_counts_writes_in_progress(env):
    s = env.session()
    env.put(s, "k0")
    env.lease(s, "k0")
    env.alloc(s, "w1", 2 * A)
    env.alloc(s, "w2")
    result = env.store.alloc(s, "ns", item("new"))
    assert isinstance(result, Failure) and result.code == Code.POOL_FULL
    assert f"{4 * A} bytes held: 1 entries leased or pinned, 2 being written" in result.message
    env.check()


def test_alloc_that_cannot_fit_evicts_nothing(env):
    s = env.session()
    for k in ("k0", "k1", "k2", "k3"):
        env.put(s, k)
    env.lease(s, "k1")
    env.lease(s, "k3")  # leased extents at A and 3A: no 2A hole can ever be made
    result = env.store.alloc(s, "ns", item("big", 2 * A))
    assert isinstance(result, Failure) and result.code == Code.POOL_FULL
    env.check()
    assert env.present("k0") and env.present("k2")  # evicting them could not have helped


def test_second_pool_used_before_evicting():
    env = Env(pool_sizes=(2 * A, 2 * A))
    s = env.session()
    places = [env.alloc(s, f"k{i}") for i in range(4)]
    assert [(e.pool, e.offset) for e in places] == [(0, 0), (0, A), (1, 0), (1, A)]
    for e in places:
        env.store.commit(s, e.generation)
    ext = env.alloc(s, "k4")
    assert (ext.pool, ext.offset) == (0, 0)  # evicted k0 and reused its hole
    assert not env.present("k0")
    env.check()


# ---- replace and delete -------------------------------------------------------------------------

def test_replace_on_commit_keeps_old_bytes_for_a_holder(env):
    w, r1, r2 = env.session(), env.session(), env.session()
    g1 = env.put(w, "k")
    old = env.lease(r1, "k")
    env.events()
    g2 = env.put(w, "k")
    assert g2 != g1
    assert env.store.by_generation[g1].state is State.RETIRED
    assert env.used() == 2 * A  # the old bytes stay until r1 lets go
    assert env.events() == [(EventKind.DELETED, key_hash("ns", "k"), g1),
                            (EventKind.PUBLISHED, key_hash("ns", "k"), g2)]
    new = env.lease(r2, "k")
    assert new.generation == g2 and new.offset != old.offset
    # a retired entry is not evictable even when the pool is under pressure
    env.put(w, "x")
    env.put(w, "y")
    result = env.store.alloc(w, "ns", item("z", 2 * A))
    assert env.store.by_generation[g1].state is State.RETIRED
    assert isinstance(result, Extent)  # x and y were evicted instead
    assert not env.present("x") and not env.present("y")
    env.check()
    assert env.store.release(r1, g1) is None
    assert g1 not in env.store.by_generation
    assert env.used() == 3 * A
    assert env.store.count_states() == {State.WRITING: 1, State.READY: 1, State.RETIRED: 0}
    env.check()


def test_replace_without_readers_frees_old_extent_at_once(env):
    w = env.session()
    g1 = env.put(w, "k")
    g2 = env.put(w, "k")
    assert g1 not in env.store.by_generation
    assert env.used() == A
    (loc,) = env.get(w, ["k"])
    assert loc.generation == g2
    env.check()


def test_delete_of_a_leased_entry(env):
    s, holder = env.session(), env.session()
    g = env.put(s, "k")
    env.lease(holder, "k")
    env.events()
    assert env.store.delete("ns", ["k", "missing"]) == [True, False]
    assert env.events() == [(EventKind.DELETED, key_hash("ns", "k"), g)]
    assert env.store.by_generation[g].state is State.RETIRED
    assert env.store.exists(s, "ns", ["k"], 0) == [False]
    (miss,) = env.get(s, ["k"])
    assert isinstance(miss, Failure) and miss.code == Code.KEY_NOT_FOUND
    assert env.store.delete("ns", ["k"]) == [False]
    assert env.used() == A
    env.check()
    assert env.store.release(holder, g) is None
    assert env.used() == 0
    env.check()


def test_delete_unheld_entry_frees_at_once(env):
    s = env.session()
    env.put(s, "k")
    assert env.store.delete("ns", ["k"]) == [True]
    assert env.used() == 0 and env.store.by_generation == {}
    env.check()


# ---- release ----------------------------------------------------------------------------------

def test_release_of_a_generation_not_held(env):
    s, other = env.session(), env.session()
    g = env.put(s, "k")
    for who, gen in ((s, g), (s, 12345), (other, g)):
        failure = env.store.release(who, gen)
        assert isinstance(failure, Failure) and failure.code == Code.NOT_OWNER
    env.lease(s, "k")
    failure = env.store.release(other, g)
    assert isinstance(failure, Failure) and failure.code == Code.NOT_OWNER
    assert env.store.by_generation[g].readers == 1
    assert env.store.release(s, g) is None
    failure = env.store.release(s, g)  # only one lease was held
    assert isinstance(failure, Failure) and failure.code == Code.NOT_OWNER
    env.check()


def test_lease_counts_per_generation(env):
    s = env.session()
    g = env.put(s, "k")
    env.get(s, ["k", "k"])
    env.lease(s, "k")
    assert s.leases[g] == 3 and env.store.by_generation[g].readers == 3
    for _ in range(2):
        assert env.store.release(s, g) is None
    assert g not in env.store.evictable
    assert env.store.release(s, g) is None
    assert g in env.store.evictable and g not in s.leases
    env.check()


# ---- waiters --------------------------------------------------------------------------------------

def test_parked_acquire_completes_on_commit(env):
    reader, writer = env.session(), env.session()
    done = Done()
    assert env.store.acquire(reader, "ns", ["k"], 5.0, done) is None
    (timer,) = env.sched.pending()
    assert timer.delay == 5.0
    assert env.store.lease_totals() == (0, 0, 1)
    ext = env.alloc(writer, "k")
    assert done.calls == []  # WRITING does not wake anyone
    assert env.store.commit(writer, ext.generation) is None
    (loc,) = done.result
    assert isinstance(loc, Location) and loc.generation == ext.generation
    assert timer.cancelled
    assert reader.leases == {ext.generation: 1} and reader.waiters == set()
    assert env.store.waiters == {}
    assert env.store.lease_totals() == (1, 0, 0)
    env.check()


def test_parked_acquire_times_out_with_key_not_found(env):
    reader = env.session()
    done = Done()
    assert env.store.acquire(reader, "ns", ["k"], 2.0, done) is None
    (timer,) = env.sched.pending()
    timer.fire()
    (miss,) = done.result
    assert isinstance(miss, Failure) and miss.code == Code.KEY_NOT_FOUND
    assert "'k'" in miss.message
    assert env.store.waiters == {} and reader.waiters == set()
    # a later commit wakes nobody
    env.put(env.session(), "k")
    assert len(done.calls) == 1
    env.check()


def test_wait_is_capped_by_max_wait():
    env = Env(max_wait=3.0)
    env.store.acquire(env.session(), "ns", ["k"], 1000.0, Done())
    (timer,) = env.sched.pending()
    assert timer.delay == 3.0


def test_acquire_without_wait_does_not_park(env):
    s = env.session()
    (res,) = env.store.acquire(s, "ns", ["k"], 0.0, never)
    assert isinstance(res, Failure) and res.code == Code.KEY_NOT_FOUND
    assert env.sched.handles == [] and env.store.waiters == {}
    env.check()


def test_acquire_with_wait_returns_now_when_all_present(env):
    s = env.session()
    g = env.put(s, "k")
    (loc,) = env.store.acquire(s, "ns", ["k"], 10.0, never)
    assert loc.generation == g
    assert env.sched.handles == []
    env.check()


def test_multi_key_waiter_completes_only_when_all_keys_are_there(env):
    reader, writer = env.session(), env.session()
    ga = env.put(writer, "a")
    done = Done()
    assert env.store.acquire(reader, "ns", ["a", "b", "c"], 10.0, done) is None
    assert set(env.store.waiters) == {("ns", "b"), ("ns", "c")}
    gc = env.put(writer, "c")
    assert done.calls == []
    assert set(env.store.waiters) == {("ns", "b")}
    env.check()
    gb = env.put(writer, "b")
    assert [r.generation for r in done.result] == [ga, gb, gc]
    assert reader.leases == {ga: 1, gb: 1, gc: 1}
    assert env.sched.pending() == []
    env.check()


def test_multi_key_waiter_timeout_returns_partial_results(env):
    reader, writer = env.session(), env.session()
    ga = env.put(writer, "a")
    done = Done()
    env.store.acquire(reader, "ns", ["a", "b"], 10.0, done)
    env.sched.pending()[0].fire()
    a, b = done.result
    assert isinstance(a, Location) and a.generation == ga
    assert isinstance(b, Failure) and b.code == Code.KEY_NOT_FOUND
    assert reader.leases == {ga: 1}
    assert env.store.waiters == {}
    env.check()


def test_multi_key_waiter_does_not_complete_while_a_key_it_saw_was_evicted(env):
    reader, writer = env.session(), env.session()
    env.put(writer, "a")
    done = Done()
    env.store.acquire(reader, "ns", ["a", "b"], 10.0, done)
    for k in ("x", "y", "z"):
        env.put(writer, k)
    env.put(writer, "b")  # the pool is full: a (least recently used) is evicted for b
    assert not env.present("a")
    # the request asked to wait up to 10 s for a and b; a is missing again, its wait is not over
    assert done.calls == [] or all(isinstance(r, Location) for r in done.calls[0])


def test_waiters_per_key_are_all_woken(env):
    r1, r2, writer = env.session(), env.session(), env.session()
    d1, d2 = Done(), Done()
    env.store.acquire(r1, "ns", ["k"], 5.0, d1)
    env.store.acquire(r2, "ns", ["k"], 5.0, d2)
    g = env.put(writer, "k")
    assert d1.result[0].generation == g and d2.result[0].generation == g
    assert env.store.by_generation[g].readers == 2
    assert env.sched.pending() == []
    env.check()


def test_fail_waiters(env):
    s = env.session()
    done = Done()
    env.store.acquire(s, "ns", ["a", "b"], 5.0, done)
    env.store.fail_waiters(Code.SHUTTING_DOWN, "bye")
    assert [r.code for r in done.result] == [Code.SHUTTING_DOWN, Code.SHUTTING_DOWN]
    assert env.store.waiters == {} and env.sched.pending() == []
    env.check()


# ---- sessions -------------------------------------------------------------------------------------

def test_close_session_reclaims_writes_leases_pins_and_waiters(env):
    keeper, dying = env.session(), env.session()
    ga = env.put(keeper, "a")
    gb = env.put(keeper, "b")
    env.lease(dying, "a")
    env.lease(dying, "a")
    env.store.exists(dying, "ns", ["b"], pin_s=60)
    env.alloc(dying, "w", 2 * A)
    done = Done()
    env.store.acquire(dying, "ns", ["never"], 30.0, done)
    (timer,) = env.sched.pending()
    assert env.used() == 4 * A
    assert env.store.lease_totals() == (2, 1, 1)
    env.check()

    env.store.close_session(dying)
    assert env.used() == 2 * A  # only a and b remain
    assert env.store.count_states() == {State.WRITING: 0, State.READY: 2, State.RETIRED: 0}
    assert env.store.by_generation[ga].readers == 0
    assert env.store.by_generation[gb].pins == 0
    assert set(env.store.evictable) == {ga, gb}
    assert env.store.waiters == {} and timer.cancelled and done.calls == []
    assert env.store.lease_totals() == (0, 0, 0)
    assert env.store.session(dying.id) is None and env.store.sessions == 1
    env.store.close_session(dying)  # idempotent
    env.check()
    # the reclaimed space is usable: a and b are evictable again
    env.put(keeper, "big", 4 * A)
    env.check()


def test_close_session_frees_retired_entries_it_was_holding(env):
    w, dying = env.session(), env.session()
    g1 = env.put(w, "k")
    env.lease(dying, "k")
    env.put(w, "k")
    assert env.store.by_generation[g1].state is State.RETIRED
    env.store.close_session(dying)
    assert g1 not in env.store.by_generation
    assert env.used() == A
    env.check()


def test_closed_writer_cannot_commit(env):
    s = env.session()
    ext = env.alloc(s, "k")
    env.store.close_session(s)
    failure = env.store.commit(s, ext.generation)
    assert isinstance(failure, Failure) and failure.code == Code.STALE
    assert env.used() == 0
    env.check()


# ---- expiry -----------------------------------------------------------------------------------

def test_write_ttl_expiry():
    env = Env(write_ttl=60.0)
    s = env.session()
    ext = env.alloc(s, "k")
    env.clock.now += 59.9
    env.store.expire()
    assert env.store.by_generation[ext.generation].state is State.WRITING
    env.clock.now += 0.1
    env.store.expire()
    assert ext.generation not in env.store.by_generation
    assert s.writes == {} and env.used() == 0
    assert env.store.counters["expired_writes"] == 1
    failure = env.store.commit(s, ext.generation)
    assert isinstance(failure, Failure) and failure.code == Code.STALE
    env.check()


def test_write_ttl_does_not_touch_committed_entries():
    env = Env(write_ttl=5.0)
    s = env.session()
    g = env.put(s, "k")
    env.clock.now += 10
    env.store.expire()
    assert env.present("k") and env.store.by_generation[g].state is State.READY
    assert env.store.counters["expired_writes"] == 0
    env.check()


def test_pin_expiry():
    env = Env(max_pin=100.0)
    s = env.session()
    g = env.put(s, "k")
    assert env.store.exists(s, "ns", ["k", "nope"], pin_s=10) == [True, False]
    assert g not in env.store.evictable and s.pins == {g: 1010.0}
    env.clock.now += 9.9
    env.store.expire()
    assert env.store.by_generation[g].pins == 1
    env.clock.now += 0.1
    env.store.expire()
    assert env.store.by_generation[g].pins == 0
    assert s.pins == {} and g in env.store.evictable
    env.check()


def test_pin_is_extended_not_shortened_and_capped():
    env = Env(max_pin=100.0)
    s = env.session()
    g = env.put(s, "k")
    env.store.exists(s, "ns", ["k"], pin_s=10)
    env.store.exists(s, "ns", ["k"], pin_s=5)  # shorter: ignored
    assert s.pins == {g: 1010.0}
    env.store.exists(s, "ns", ["k"], pin_s=1000)  # capped at max_pin
    assert s.pins == {g: 1100.0}
    assert env.store.by_generation[g].pins == 1
    env.clock.now = 1050.0
    env.store.expire()  # the old 1010 deadline is ignored
    assert env.store.by_generation[g].pins == 1
    env.clock.now = 1100.0
    env.store.expire()
    assert env.store.by_generation[g].pins == 0 and g in env.store.evictable
    env.check()


def test_unpin(env):
    s, other = env.session(), env.session()
    g = env.put(s, "k")
    env.store.exists(s, "ns", ["k"], pin_s=10)
    env.store.exists(other, "ns", ["k"], pin_s=10)
    assert env.store.by_generation[g].pins == 2
    assert env.store.unpin(s, "ns", ["k", "missing"]) == [True, False]
    assert env.store.unpin(s, "ns", ["k"]) == [False]
    assert g not in env.store.evictable
    assert env.store.unpin(other, "ns", ["k"]) == [True]
    assert g in env.store.evictable
    env.check()


def test_pin_survives_replacement_of_the_key(env):
    scheduler_side, writer = env.session(), env.session()
    env.put(writer, "k")
    assert env.store.exists(scheduler_side, "ns", ["k"], pin_s=60) == [True]
    env.put(writer, "k")  # another producer publishes the same key again
    for i in range(4):
        env.put(writer, f"fill{i}")
    assert env.store.exists(scheduler_side, "ns", ["k"], 0) == [True]


# ---- limits ---------------------------------------------------------------------------------------

def test_batch_over_max_batch():
    env = Env(max_batch=3)
    s = env.session()
    keys = ["a", "b", "c", "d"]
    calls = [
        lambda: env.store.acquire(s, "ns", keys, 0, never),
        lambda: env.store.exists(s, "ns", keys, 0),
        lambda: env.store.unpin(s, "ns", keys),
        lambda: env.store.delete("ns", keys),
        lambda: env.store.check_batch(4),
    ]
    for call in calls:
        with pytest.raises(RequestError) as info:
            call()
        assert info.value.code == Code.LIMIT
        assert "max_batch=3" in str(info.value)
    env.store.check_batch(3)
    assert env.store.exists(s, "ns", keys[:3], 0) == [False] * 3
    env.check()


def test_acquire_with_bad_key_is_refused_whole():
    env = Env(max_key_bytes=4)
    s = env.session()
    env.put(s, "ok")
    for keys, code in ((["ok", ""], Code.INVALID), (["ok", "toolong"], Code.LIMIT)):
        with pytest.raises(RequestError) as info:
            env.store.acquire(s, "ns", keys, 0, never)
        assert info.value.code == code
    assert s.leases == {}  # nothing was leased by the refused request
    env.check()


def test_max_waiters_per_client():
    env = Env(max_waiters_per_client=2)
    s, other = env.session(), env.session()
    env.store.acquire(s, "ns", ["a"], 5, Done())
    env.store.acquire(s, "ns", ["b"], 5, Done())
    with pytest.raises(RequestError) as info:
        env.store.acquire(s, "ns", ["c"], 5, Done())
    assert info.value.code == Code.LIMIT and "max_waiters_per_client=2" in str(info.value)
    assert len(s.waiters) == 2 and ("ns", "c") not in env.store.waiters
    assert len(env.sched.pending()) == 2
    assert env.store.acquire(other, "ns", ["c"], 5, Done()) is None  # per client
    # a request that does not need to park is not limited
    env.put(other, "d")
    (loc,) = env.store.acquire(s, "ns", ["d"], 5, never)
    assert isinstance(loc, Location)
    env.check()


def test_keys_parked_per_client_are_limited_too():
    """max_waiters_per_client parked requests of max_batch keys each would be 67M parked keys
    (tens of GB) with the defaults: one client's parked requests name at most the larger of the
    two limits in keys."""
    env = Env(pool_sizes=(16 * A,), max_waiters_per_client=4, max_batch=10)
    s, other = env.session(), env.session()
    env.store.acquire(s, "ns", [f"a{i}" for i in range(10)], 5, Done())  # one full batch parks
    with pytest.raises(RequestError) as info:
        env.store.acquire(s, "ns", ["b"], 5, Done())
    assert info.value.code == Code.LIMIT and "keys parked" in str(info.value)
    assert len(s.waiters) == 1 and s.parked_keys == 10 and ("ns", "b") not in env.store.waiters
    env.store.acquire(other, "ns", [f"c{i}" for i in range(6)], 5, Done())  # per client
    env.store.acquire(other, "ns", [f"d{i}" for i in range(4)], 5, Done())
    env.check()
    env.store.close_session(other)
    env.put(s, "a0", 16)  # wakes nothing yet (nine keys still missing)
    for i in range(1, 10):
        env.put(s, f"a{i}", 16)
    assert s.parked_keys == 0 and not s.waiters  # answered: its keys count no more
    env.store.acquire(s, "ns", ["b"], 5, Done())
    env.check()


def test_max_leases_per_client():
    env = Env(max_leases_per_client=2)
    s, other = env.session(), env.session()
    for k in ("a", "b", "c"):
        env.put(other, k)
    with pytest.raises(RequestError) as info:
        env.store.acquire(s, "ns", ["a", "b", "c"], 0, never)
    assert info.value.code == Code.LIMIT and "max_leases_per_client=2" in str(info.value)
    assert s.leases == {}
    env.get(s, ["a", "b"])
    with pytest.raises(RequestError):
        env.store.acquire(s, "ns", ["c"], 0, never)
    assert len(s.leases) == 2
    env.check()


# ---- reservations: copy first, name it after ----------------------------------------------------

def test_reservation_is_published_under_a_key(env):
    s, reader = env.reserving(env.session()), env.session()
    ext = env.store.reserve(s, A)
    assert isinstance(ext, Extent) and env.used() == A
    assert env.store.exists(reader, "ns", ["k"], 0) == [False]  # anonymous: invisible
    assert env.store.publish(s, "ns", ext.generation, item("k", A)) is None
    loc = env.lease(reader, "k")
    assert (loc.generation, loc.pool, loc.offset) == (ext.generation, ext.pool, ext.offset)
    assert s.reservation is None
    env.check()


def test_one_reservation_per_client_and_it_cannot_be_committed_nameless(env):
    s = env.reserving(env.session())
    ext = env.store.reserve(s, A)
    again = env.store.reserve(s, A)
    assert isinstance(again, Failure) and again.code == Code.LIMIT
    refused = env.store.commit(s, ext.generation)
    assert isinstance(refused, Failure) and refused.code == Code.INVALID
    other = env.session()
    stolen = env.store.publish(other, "ns", ext.generation, item("k", A))
    assert isinstance(stolen, Failure) and stolen.code == Code.STALE
    assert s.reservation is not None and env.used() == A
    env.check()


def test_publish_of_the_wrong_size_frees_the_reservation(env):
    s = env.reserving(env.session())
    ext = env.store.reserve(s, 2 * A)
    failure = env.store.publish(s, "ns", ext.generation, item("k", A))
    assert isinstance(failure, Failure) and failure.code == Code.INVALID
    assert env.used() == 0 and s.reservation is None and not env.present("k")
    env.check()


def test_reserve_never_evicts(env):
    s = env.session()
    for k in ("k0", "k1", "k2", "k3"):
        env.put(s, k)
    refused = env.store.reserve(s, A)
    assert isinstance(refused, Failure) and refused.code == Code.POOL_FULL
    assert all(env.present(k) for k in ("k0", "k1", "k2", "k3"))
    env.check()


def test_reservation_expires_with_the_write_ttl_and_dies_with_its_client():
    env = Env(write_ttl=5.0)
    s = env.reserving(env.session())
    ext = env.store.reserve(s, A)
    env.clock.now += 6.0
    env.store.expire()
    assert s.reservation is None and env.used() == 0
    late = env.store.publish(s, "ns", ext.generation, item("k", A))
    assert isinstance(late, Failure) and late.code == Code.STALE
    env.store.reserve(s, A)
    env.store.close_session(s)
    assert env.used() == 0
    env.check()


def test_reservation_of_a_watched_client_is_never_expired():
    env = Env(write_ttl=5.0)
    s = env.reserving(env.session())
    s.watched = True  # the daemon holds a pidfd: the reservation goes when the process goes
    ext = env.store.reserve(s, A)
    env.clock.now += 60.0
    env.store.expire()
    assert s.reservation is not None and env.used() == A
    assert env.store.publish(s, "ns", ext.generation, item("k", A)) is None
    env.check()


def test_reservations_are_counted_by_outcome_and_in_bytes():
    """Their own record: every way one starts and ends is counted, and reserved_bytes follows
    the extents held (what ecd_reservations_total and ecd_reserved_bytes report)."""
    env = Env(write_ttl=5.0)
    store = env.store
    a, b, c = (env.reserving(env.session()) for _ in range(3))
    first = store.reserve(a, A)
    store.reserve(b, 2 * A)
    assert store.reservation_totals() == (2, 3 * A) and store.writes_in_progress() == 0
    assert store.publish(a, "ns", first.generation, item("k", A)) is None  # published
    assert store.abort(b, b.reservation.generation) is None  # aborted
    store.reserve(a, A)
    store.close_session(a, reclaimed=True)  # reclaimed with its client: not a put it was writing
    assert store.counters["reclaimed_client_exit"] == 0
    store.reserve(c, A)
    env.clock.now += 6.0
    store.expire()  # expired: c is not a watched process
    for _ in range(4):  # refused: no free extent without evicting
        env.put(env.session(), f"fill{_}")
    assert isinstance(store.reserve(c, A), Failure)
    outcomes = {o: store.counters[f"reservations_{o}"] for o in
                ("granted", "refused", "published", "aborted", "expired", "reclaimed")}
    assert outcomes == {"granted": 4, "refused": 1, "published": 1, "aborted": 1, "expired": 1, "reclaimed": 1}
    assert store.reservation_totals() == (0, 0)
    env.check()


def test_a_reservation_is_not_an_entry_of_any_state(env):
    s = env.reserving(env.session())
    ext = env.store.reserve(s, A)
    assert ext.generation not in env.store.by_generation
    assert env.store.count_states()[State.WRITING] == 0 and env.store.writes_in_progress() == 0
    assert env.store.held([ext.generation]) == [True]  # it holds its extent all the same
    other = env.session()
    refused = env.store.abort(other, ext.generation)
    assert isinstance(refused, Failure) and refused.code == Code.NOT_OWNER
    env.check()


def test_evict_of_a_key_named_twice_evicts_it_once(env):
    """Found by benchmarks/fuzz.py: a repeated key made the second removal raise KeyError."""
    s = env.session()
    env.put(s, "dup")
    env.put(s, "kept")
    assert env.store.evict("ns", ["dup", "dup", "absent", "dup"], False, False, False) == (1, [], ["absent"], [])
    assert not env.present("dup") and env.present("kept")
    s.watched = True  # a live process's lease: the forced eviction waits for it to drain
    loc = env.lease(s, "kept")
    assert env.store.evict("ns", ["kept", "kept"], False, False, True) == (1, [], [], [loc.generation])
    env.check()


def test_forced_eviction_revokes_only_the_leases_of_sessions_nothing_watches():
    """A watched session's process is alive and may be reading: its lease drains. An unwatched
    one's (tcp, unverifiable pid) is taken back, or it could keep the bytes forever."""
    env = Env()
    watched, unwatched = env.session(), env.session()
    watched.watched = True
    env.put(watched, "both")
    env.put(watched, "remote-only")
    both = [env.lease(watched, "both"), env.lease(unwatched, "both")][0]
    env.lease(unwatched, "remote-only")
    used = env.store.host.allocators[0].used
    assert env.store.evict("ns", ["both", "remote-only"], False, False, True) == (2, [], [], [both.generation])
    assert unwatched.leases == {} and watched.leases == {both.generation: 1}
    assert env.store.host.allocators[0].used < used  # remote-only is freed at once
    assert env.store.release(watched, both.generation) is None
    env.check()


def test_deadline_heap_stays_proportional_to_live_deadlines():
    """Committed writes and re-pinned keys leave dead deadlines behind; at thousands of puts per
    second they must not pile up for a whole write TTL (the soak benchmark saw +21 MiB)."""
    env = Env(write_ttl=60.0, max_pin=600.0)
    s = env.session()
    pending = env.alloc(s, "pending")  # a live write deadline that must survive the sweeps
    env.put(s, "pinned")
    for i in range(50_000):
        env.put(s, f"k{i % 100}")
        env.clock.now += 0.001
        env.store.exists(s, "ns", ["pinned"], pin_s=100)  # extends the pin: the old deadline dies
    assert len(env.store.deadlines) < 10_000
    assert env.store.by_generation[pending.generation].state is State.WRITING
    env.clock.now += 60
    env.store.expire()
    assert pending.generation not in env.store.by_generation  # its deadline was kept
    env.clock.now += 100
    env.store.expire()
    assert not s.pins  # and so was the last pin's
    env.check()


def test_evict_echoes_at_most_a_thousand_missing_keys(env):
    """An Evict naming max_batch absent keys must not answer with all of them."""
    s = env.session()
    env.put(s, "present")
    keys = ["present"] + [f"absent-{i}" for i in range(5000)]
    evicted, refused, missing, draining = env.store.evict("ns", keys, False, False, False)
    assert evicted == 1 and refused == [] and draining == []
    assert missing == [f"absent-{i}" for i in range(1000)]
    env.check()
