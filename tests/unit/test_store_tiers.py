"""Store tiers: the host pool (segments) and CUDA arenas (`arena_sizes`), each placed in, evicted
from and reserved in on its own. Every test ends with the store's consistency check."""
from __future__ import annotations

import pytest

from ecd.daemon.registry.entries import RequestError
from ecd.errors import Code
from ecd.protocol import Extent, Failure

from test_store import A, Env, item

HOST, ARENA0, ARENA1 = 0, 1, 2  # one host segment, then two arenas


class TierEnv(Env):
    def __init__(self, host=(4 * A,), arenas=(4 * A, 8 * A), namespaces=None, **limits) -> None:
        super().__init__(host, namespaces, arena_sizes=arenas, **limits)

    def alloc_in(self, session, key, nbytes=A, arena=-1, ns="ns"):
        return self.store.alloc(session, ns, item(key, nbytes), self.store.tier(arena))

    def put_in(self, session, key, nbytes=A, arena=-1, ns="ns") -> Extent:
        ext = self.alloc_in(session, key, nbytes, arena, ns)
        assert isinstance(ext, Extent), ext
        assert self.store.commit(session, ext.generation) is None
        return ext


@pytest.fixture
def env() -> TierEnv:
    return TierEnv()


def test_pool_indices_host_first_then_arenas(env):
    assert env.store.host.host_pools == (HOST,) and env.store.host.arena_pools == (ARENA0, ARENA1)
    assert [a.capacity for a in env.store.host.allocators] == [4 * A, 4 * A, 8 * A]
    env.check()


def test_alloc_places_in_the_named_tier_only(env):
    s = env.session()
    assert env.put_in(s, "h").pool == HOST
    assert env.put_in(s, "a", arena=ARENA1).pool == ARENA1
    assert env.put_in(s, "b", arena=ARENA0).pool == ARENA0
    assert env.store.tier_of(env.store.index[("ns", "a")].generation) == (ARENA1,)
    # the host pool: None (a reservation then goes in the host segments of its session's part)
    assert env.store.tier_of(env.store.index[("ns", "h")].generation) is None
    assert env.store.tier_of(10_000) is None
    env.check()


def test_invalid_arena_is_refused(env):
    for bad in (HOST, 3, -2, 99):
        with pytest.raises(RequestError) as info:
            env.store.tier(bad)
        assert info.value.code == Code.INVALID and f"arena={bad}" in str(info.value)
    no_arenas = Env()
    with pytest.raises(RequestError, match=r"no CUDA arenas"):
        no_arenas.store.tier(1)
    env.check()


def test_host_placement_never_spills_into_an_arena(env):
    s, reader = env.session(), env.session()
    for i in range(4):
        env.put_in(s, f"h{i}")
        env.lease(reader, f"h{i}")  # held: cannot be evicted
    full = env.alloc_in(s, "more")
    assert isinstance(full, Failure) and full.code == Code.POOL_FULL
    assert "in CUDA arena" not in full.message
    assert env.used(ARENA0) == env.used(ARENA1) == 0
    env.check()


def test_arena_placement_never_spills_into_host_or_another_arena(env):
    s, reader = env.session(), env.session()
    for i in range(4):
        env.put_in(s, f"a{i}", arena=ARENA0)
        env.lease(reader, f"a{i}")
    full = env.alloc_in(s, "more", arena=ARENA0)
    assert isinstance(full, Failure) and full.code == Code.POOL_FULL
    assert f"in CUDA arena {ARENA0}" in full.message
    assert env.used(HOST) == 0 and env.used(ARENA1) == 0
    too_big = env.alloc_in(s, "big", 8 * A, arena=ARENA0)  # fits arena 1, not arena 0
    assert isinstance(too_big, Failure) and too_big.code == Code.INVALID and "CUDA arena 1" in too_big.message
    assert env.put_in(s, "big", 8 * A, arena=ARENA1).pool == ARENA1  # larger than any host segment
    env.check()


def test_eviction_for_room_takes_only_entries_of_the_target_tier(env):
    s = env.session()
    env.put_in(s, "h-old")  # the least recently used of all
    for i in range(4):
        env.put_in(s, f"a{i}", arena=ARENA0)
    env.put_in(s, "b-old", arena=ARENA1)
    ext = env.put_in(s, "a-new", arena=ARENA0)  # arena 0 is full: evicts its own LRU entry
    assert ext.pool == ARENA0
    assert env.present("h-old") and env.present("b-old") and not env.present("a0")
    for i in range(3):
        env.put_in(s, f"h{i}")
    ext = env.put_in(s, "h-new")  # host full: evicts h-old, never an arena entry
    assert ext.pool == HOST and not env.present("h-old")
    assert all(env.present(k) for k in ("a1", "a2", "a3", "a-new", "b-old"))
    assert env.store.counters["evictions"] == 2
    env.check()


def test_reservation_goes_in_the_tier_it_is_asked_for(env):
    s = env.reserving(env.session())
    res = env.store.reserve(s, 2 * A, env.store.tier(ARENA1))
    assert isinstance(res, Extent) and res.pool == ARENA1
    assert env.store.tier_of(res.generation) == (ARENA1,)
    assert env.store.publish(s, "ns", res.generation, item("p", 2 * A)) is None
    assert env.store.index[("ns", "p")].pool == ARENA1
    res = env.store.reserve(s, A)  # default: the host pool
    assert isinstance(res, Extent) and res.pool == HOST
    assert env.store.abort(s, res.generation) is None
    too_big = env.store.reserve(s, 8 * A, env.store.tier(ARENA0))
    assert isinstance(too_big, Failure) and too_big.code == Code.INVALID
    env.check()


def test_reservation_never_evicts_in_its_tier(env):
    s = env.session()
    for i in range(4):
        env.put_in(s, f"a{i}", arena=ARENA0)
    res = env.store.reserve(s, A, env.store.tier(ARENA0))
    assert isinstance(res, Failure) and res.code == Code.POOL_FULL
    assert all(env.present(f"a{i}") for i in range(4))
    res = env.store.reserve(s, A, env.store.tier(ARENA1))  # another tier has room
    assert isinstance(res, Extent) and res.pool == ARENA1
    env.check()


def test_publish_of_an_arena_reservation_checks_the_arena_size(env):
    s = env.reserving(env.session())
    res = env.store.reserve(s, 6 * A, env.store.tier(ARENA1))  # larger than the host segment
    assert isinstance(res, Extent)
    assert env.store.publish(s, "ns", res.generation, item("big", 6 * A)) is None
    assert env.store.index[("ns", "big")].pool == ARENA1
    env.check()


def test_quota_counts_bytes_in_every_tier():
    class Ns:
        quota, guaranteed, verify = 3 * A, 0, False
    env = TierEnv(namespaces={"q": Ns()})
    s = env.session()
    env.put_in(s, "h0", ns="q")
    env.put_in(s, "a0", arena=ARENA0, ns="q")
    env.put_in(s, "a1", arena=ARENA1, ns="q")
    assert env.store.ns_used["q"] == 3 * A
    # over the quota: the namespace's own LRU entry goes, whatever its tier
    ext = env.put_in(s, "a2", arena=ARENA0, ns="q")
    assert ext.pool == ARENA0 and not env.present("h0", ns="q")
    assert env.store.ns_used["q"] == 3 * A
    env.check()


def test_quota_eviction_in_another_tier_does_not_count_as_room(env):
    """A quota victim in the host pool frees host bytes: that is no room for an arena put."""
    class Ns:
        quota, guaranteed, verify = 5 * A, 0, False
    env = TierEnv(namespaces={"q": Ns()})
    s, reader = env.session(), env.session()
    env.put_in(s, "h0", ns="q")  # LRU: the quota victim
    for i in range(4):
        env.put_in(s, f"a{i}", arena=ARENA0, ns="q")
        env.lease(reader, f"a{i}", ns="q")
    full = env.alloc_in(s, "a4", arena=ARENA0, ns="q")
    assert isinstance(full, Failure) and full.code == Code.POOL_FULL
    assert env.present("h0", ns="q")  # nothing evicted for a put that could not fit
    env.check()


def test_leases_and_session_close_in_arenas(env):
    s, reader = env.session(), env.session()
    env.put_in(s, "a", arena=ARENA0)
    loc = env.lease(reader, "a")
    assert loc.pool == ARENA0
    env.put_in(s, "a", arena=ARENA0)  # replace: the old bytes stay for the reader
    assert env.used(ARENA0) == 2 * A
    env.store.close_session(reader)
    assert env.used(ARENA0) == A
    env.store.close_session(s)
    env.check()
