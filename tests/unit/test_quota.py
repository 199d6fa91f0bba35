"""Per-namespace quotas and guaranteed shares, and eviction that never throws entries away for a
hole it cannot make. Same harness as test_store.py; every scenario ends with `env.check()`, which
also asserts that each namespace's used bytes equal the sum of its entries' extents."""
from __future__ import annotations

from ecd.config import NamespaceSection
from ecd.daemon.registry.entries import State
from ecd.errors import Code
from ecd.protocol import Extent, Failure

from test_store import A, Env, item, never


def ns(quota: int = 0, guaranteed: int = 0) -> NamespaceSection:
    return NamespaceSection(quota=quota, guaranteed=guaranteed)


def present(env: Env, ns_name: str, *keys: str) -> list[bool]:
    return [env.present(k, ns_name) for k in keys]


# ---- quotas: a namespace over its quota evicts its own entries first -----------------------------

def test_over_quota_evicts_own_lru_entries_first_even_with_room_in_the_pool():
    env = Env(pool_sizes=(8 * A,), namespaces={"a": ns(quota=2 * A)})
    s = env.session()
    env.put(s, "b0", ns="b")
    env.put(s, "b1", ns="b")  # older than a's entries: plain LRU would take these
    env.put(s, "a0", ns="a")
    env.put(s, "a1", ns="a")
    assert env.store.ns_used == {"a": 2 * A, "b": 2 * A}
    env.put(s, "a2", ns="a")
    assert present(env, "a", "a0", "a1", "a2") == [False, True, True]
    assert present(env, "b", "b0", "b1") == [True, True]
    assert env.store.ns_used["a"] == 2 * A
    assert env.store.counters["evicted_quota"] == 1 and env.store.counters["evictions"] == 0
    env.check()


def test_over_quota_in_a_full_pool_never_evicts_another_namespace():
    env = Env(namespaces={"a": ns(quota=2 * A)})
    s = env.session()
    env.put(s, "b0", ns="b")
    env.put(s, "b1", ns="b")
    env.put(s, "a0", ns="a")
    env.put(s, "a1", ns="a")
    assert env.store.exists(s, "a", ["a0"], 0) == [True]  # a1 is now a's least recently used
    env.put(s, "a2", ns="a")
    assert present(env, "a", "a0", "a1", "a2") == [True, False, True]
    assert present(env, "b", "b0", "b1") == [True, True]
    env.check()


def test_quota_exceeded_when_own_entries_are_all_held():
    env = Env(pool_sizes=(8 * A,), namespaces={"a": ns(quota=3 * A)})
    s, reader = env.session(), env.session()
    env.put(s, "a0", ns="a")
    env.put(s, "a1", ns="a")
    env.lease(reader, "a0", ns="a")
    assert env.store.exists(reader, "a", ["a1"], pin_s=30) == [True]
    env.alloc(s, "w", ns="a")  # being written: counts too
    env.put(s, "b0", ns="b")  # another namespace is never a quota victim
    result = env.store.alloc(s, "a", item("a2"))
    assert isinstance(result, Failure) and result.code == Code.QUOTA_EXCEEDED
    msg = result.message
    assert "namespace 'a'" in msg and f"quota of {3 * A} bytes" in msg
    assert f"{3 * A} bytes in use" in msg and f"{3 * A} bytes of it are held" in msg
    assert present(env, "a", "a0", "a1") == [True, True] and env.present("b0", "b")
    assert env.store.quota_refusals == {"a": 1} and env.store.quota_refused == 1
    # the other namespace is not limited by a's quota
    env.put(s, "b1", ns="b")
    # once the pin goes, a1 may be evicted for a's next put
    assert env.store.unpin(reader, "a", ["a1"]) == [True]
    env.put(s, "a2", ns="a")
    assert present(env, "a", "a0", "a1", "a2") == [True, False, True]
    env.check()


def test_entry_larger_than_the_quota_is_refused_without_evicting():
    env = Env(pool_sizes=(8 * A,), namespaces={"a": ns(quota=2 * A)})
    s = env.session()
    env.put(s, "a0", ns="a")
    result = env.store.alloc(s, "a", item("big", 3 * A))
    assert isinstance(result, Failure) and result.code == Code.QUOTA_EXCEEDED
    assert "larger than the quota itself" in result.message
    assert env.present("a0", "a")
    env.check()


def test_replacing_a_key_at_the_quota_evicts_the_old_generation():
    env = Env(pool_sizes=(8 * A,), namespaces={"a": ns(quota=2 * A)})
    s = env.session()
    env.put(s, "k", ns="a")
    env.put(s, "j", ns="a")
    assert env.store.exists(s, "a", ["j"], 0) == [True]
    env.put(s, "k", ns="a")  # old k is a's LRU entry: evicted for the quota, then replaced
    assert env.store.ns_used["a"] == 2 * A and env.present("k", "a") and env.present("j", "a")
    env.check()


def test_reservation_counts_toward_the_namespace_of_its_commit():
    env = Env(pool_sizes=(8 * A,), namespaces={"a": ns(quota=2 * A)})
    s, reader = env.session(), env.session()
    env.put(s, "a0", ns="a")
    ext = env.store.reserve(s, A)  # asked for with a's commit: it counts toward a
    assert isinstance(ext, Extent) and env.store.ns_used == {"a": 2 * A}
    env.check()
    assert env.store.publish(s, "a", ext.generation, item("a1")) is None  # already paid for
    assert present(env, "a", "a0", "a1") == [True, True] and env.store.ns_used == {"a": 2 * A}
    # a at its quota: no reservation (the next put takes Alloc, which evicts a's own); not a refused put
    refused = env.store.reserve(s, A)
    assert isinstance(refused, Failure) and refused.code == Code.QUOTA_EXCEEDED and s.reservation is None
    assert env.store.quota_refused == 0
    env.check()
    # a reservation of another namespace's commit moves to a when published there: a's quota decides
    env.put(s, "u0", ns="u")
    ext = env.store.reserve(s, A)
    assert env.store.ns_used == {"a": 2 * A, "u": 2 * A}
    assert env.store.publish(s, "a", ext.generation, item("a2")) is None
    assert present(env, "a", "a0", "a1", "a2") == [False, True, True]
    assert env.store.ns_used == {"a": 2 * A, "u": A}
    env.check()
    # all of a's entries held: Publish is refused and the reservation freed
    env.put(s, "u1", ns="u")
    env.lease(reader, "a1", ns="a")
    env.lease(reader, "a2", ns="a")
    ext = env.store.reserve(s, A)
    used = env.used()
    refused = env.store.publish(s, "a", ext.generation, item("a3"))
    assert isinstance(refused, Failure) and refused.code == Code.QUOTA_EXCEEDED
    assert s.reservation is None and env.used() == used - A and not env.present("a3", "a")
    assert env.store.ns_used == {"a": 2 * A, "u": 2 * A}
    env.check()
    # a client that committed nothing gets none (else Commit([], reserve=N) from many sessions
    # would hold the pool outside every quota)
    refused = env.store.reserve(env.session(), A)
    assert isinstance(refused, Failure) and refused.code == Code.INVALID
    env.check()

def test_namespace_bytes_follow_entries_through_every_state():
    env = Env(pool_sizes=(8 * A,), namespaces={"a": ns(quota=8 * A)})
    w, r = env.session(), env.session()
    env.put(w, "k", 2 * A, ns="a")
    env.lease(r, "k", ns="a")
    env.put(w, "k", A, ns="a")  # the old generation is RETIRED while r reads it: still counted
    assert env.store.ns_used == {"a": 3 * A}
    assert env.store.count_states()[State.RETIRED] == 1
    env.check()
    env.store.close_session(r)
    assert env.store.ns_used == {"a": A}
    env.store.delete("a", ["k"])
    assert env.store.ns_used == {}
    env.check()


# ---- guaranteed shares --------------------------------------------------------------------------

def test_guaranteed_share_is_never_evicted_by_another_namespace():
    env = Env(namespaces={"g": ns(guaranteed=2 * A)})
    s = env.session()
    for k in ("g0", "g1", "g2"):
        env.put(s, k, ns="g")
    env.put(s, "x0", ns="x")
    env.put(s, "x1", ns="x")  # g0 is LRU and above g's share: it goes
    assert present(env, "g", "g0", "g1", "g2") == [False, True, True]
    env.put(s, "x2", ns="x")  # g1, g2 are g's share: x0 goes instead
    assert present(env, "g", "g1", "g2") == [True, True]
    assert present(env, "x", "x0", "x1", "x2") == [False, True, True]
    env.check()
    env.lease(s, "x1", ns="x")
    env.lease(s, "x2", ns="x")
    result = env.store.alloc(s, "x", item("x3"))
    assert isinstance(result, Failure) and result.code == Code.POOL_FULL
    assert "2 kept for their namespace's guaranteed share" in result.message
    assert present(env, "g", "g1", "g2") == [True, True]
    # g's own entries are always evictable for g
    env.put(s, "g3", ns="g")
    assert present(env, "g", "g1", "g2", "g3") == [False, True, True]
    env.check()


def test_guarantee_and_quota_together():
    env = Env(namespaces={"a": ns(quota=3 * A, guaranteed=A), "b": ns(quota=3 * A, guaranteed=A)})
    s = env.session()
    env.put(s, "a0", ns="a")
    env.put(s, "a1", ns="a")
    env.put(s, "b0", ns="b")
    env.put(s, "b1", ns="b")
    env.put(s, "b2", ns="b")  # pool full, b under quota: a0 (LRU, a above its share) goes
    assert present(env, "a", "a0", "a1") == [False, True]
    env.put(s, "b3", ns="b")  # b at its quota: its own b0 goes, never a1 (a's share)
    assert present(env, "a", "a1") == [True]
    assert present(env, "b", "b0", "b1", "b2", "b3") == [False, True, True, True]
    env.check()


def test_unconfigured_namespaces_keep_plain_lru():
    env = Env(namespaces={"a": ns(quota=A, guaranteed=A)})
    s = env.session()
    for i in range(8):
        env.put(s, f"k{i}", ns=("u", "v")[i % 2])
    assert present(env, "u", "k0", "k2", "k4", "k6") == [False, False, True, True]
    assert present(env, "v", "k1", "k3", "k5", "k7") == [False, False, True, True]
    assert env.store.counters["evictions"] == 4 and env.store.quota_refused == 0
    assert env.store.ns_used == {"u": 2 * A, "v": 2 * A}
    env.check()


# ---- eviction that only evicts what makes the hole ----------------------------------------------

def test_eviction_takes_only_the_entries_of_the_hole_it_makes():
    env = Env(pool_sizes=(6 * A,))
    s, holder = env.session(), env.session()
    for i in range(6):
        env.put(s, f"k{i}")
    env.lease(holder, "k1")  # k0 alone can never be part of a 2A hole
    env.put(s, "big", 2 * A)
    assert [env.present(f"k{i}") for i in range(6)] == [True, True, False, False, True, True]
    assert env.store.counters["evictions"] == 2
    env.check()


def test_hole_that_needs_a_guaranteed_entry_evicts_nothing():
    env = Env(namespaces={"g": ns(guaranteed=A)})
    s = env.session()
    env.put(s, "x0", ns="x")
    env.put(s, "g0", ns="g")
    env.put(s, "x1", ns="x")
    env.lease(s, "x1", ns="x")
    env.put(s, "x2", ns="x")
    env.lease(s, "x2", ns="x")  # the only 2A hole would be x0 + g0, and g0 is g's share
    result = env.store.alloc(s, "x", item("big", 2 * A))
    assert isinstance(result, Failure) and result.code == Code.POOL_FULL
    assert env.present("x0", "x") and env.present("g0", "g")
    assert env.store.counters["evictions"] == 0
    env.check()


def test_quota_victims_and_room_victims_together():
    env = Env(namespaces={"a": ns(quota=2 * A)})
    s = env.session()
    env.put(s, "b0", ns="b")  # offsets: b0 0, a0 A, b1 2A, a1 3A
    env.put(s, "a0", ns="a")
    env.put(s, "b1", ns="b")
    env.put(s, "a1", ns="a")
    env.lease(s, "b1", ns="b")
    ext = env.alloc(s, "big", 2 * A, ns="a")  # the quota takes a0 and a1, the hole also b0
    assert (ext.pool, ext.offset) == (0, 0)
    assert not env.present("a0", "a") and not env.present("a1", "a") and not env.present("b0", "b")
    assert env.store.counters["evicted_quota"] == 2 and env.store.counters["evictions"] == 1
    env.check()


def test_quota_victims_stay_when_no_hole_can_be_made():
    env = Env(namespaces={"a": ns(quota=2 * A)})
    s = env.session()
    env.put(s, "b0", ns="b")
    env.put(s, "a0", ns="a")
    env.put(s, "b1", ns="b")
    env.put(s, "a1", ns="a")
    env.lease(s, "b0", ns="b")
    env.lease(s, "b1", ns="b")
    result = env.store.alloc(s, "a", item("big", 2 * A))
    assert isinstance(result, Failure) and result.code == Code.POOL_FULL
    assert env.present("a0", "a") and env.present("a1", "a")  # evicting them could not have helped
    assert env.store.counters["evicted_quota"] == 0
    env.check()


# ---- reload -------------------------------------------------------------------------------------

def test_lowered_quota_applies_at_the_next_allocation():
    env = Env(pool_sizes=(8 * A,), namespaces={"a": ns(quota=4 * A)})
    s = env.session()
    for i in range(4):
        env.put(s, f"a{i}", ns="a")
    env.store.set_namespaces({"a": ns(quota=2 * A)})
    assert env.store.ns_used == {"a": 4 * A}  # nothing evicted eagerly
    env.check()
    env.put(s, "a4", ns="a")  # now a evicts its own down to the new quota
    assert present(env, "a", "a0", "a1", "a2", "a3", "a4") == [False, False, False, True, True]
    env.store.set_namespaces({})  # quota removed
    for i in range(5, 9):
        env.put(s, f"a{i}", ns="a")
    assert env.store.ns_used == {"a": 6 * A} and env.store.quota_refused == 0
    env.check()


# ---- randomized: the invariants hold after every operation --------------------------------------

def test_random_operations_keep_quotas_guarantees_and_invariants():
    import random

    rng = random.Random(5)
    policies = {"q": ns(quota=6 * A, guaranteed=2 * A), "g": ns(guaranteed=4 * A), "h": ns(quota=4 * A)}
    env = Env(pool_sizes=(12 * A, 8 * A), namespaces=policies)
    store = env.store
    sessions = [env.session() for _ in range(3)]
    current = {"ns": None}
    evicted = []
    real_evict = store.placement.evict

    def spy(victim, counter):  # the caller frees what evict() returns, after all its victims' events
        evicted.append((victim.ns, counter, victim.nbytes, current["ns"]))
        return real_evict(victim, counter)

    store.placement.evict = spy
    names = ["q", "g", "h", "u", "v"]
    for step in range(3000):
        s = rng.choice(sessions)
        name = rng.choice(names)
        key = f"k{rng.randrange(12)}"
        op = rng.random()
        current["ns"] = name
        evicted.clear()
        if op < 0.45:
            result = store.alloc(s, name, item(key, A * rng.choice((1, 1, 2, 3))))
            if isinstance(result, Extent) and rng.random() < 0.9:
                assert store.commit(s, result.generation) is None
            elif isinstance(result, Failure):
                assert result.code in (Code.POOL_FULL, Code.QUOTA_EXCEEDED), result
                assert not evicted, "a refused put evicted something"
        elif op < 0.55:
            if s.reservation is None:
                store.reserve(s, A)
            else:
                store.publish(s, name, s.reservation.generation, item(key, A))
        elif op < 0.7:
            store.acquire(s, name, [key], 0, never)
        elif op < 0.8 and s.leases:
            store.release(s, rng.choice(list(s.leases)))
        elif op < 0.85:
            store.exists(s, name, [key], pin_s=rng.choice((0, 5)))
        elif op < 0.9:
            pending = [g for g, e in s.writes.items() if e is not s.reservation]
            if pending:
                store.abort(s, rng.choice(pending))
        elif op < 0.93:
            store.delete(name, [key])
        elif op < 0.95:
            env.clock.now += 3
            store.expire()
        elif op < 0.96:
            store.close_session(s)
            sessions[sessions.index(s)] = env.session()
        for victim_ns, counter, _, by in evicted:
            if counter == "evicted_quota":
                assert victim_ns == by, "a quota evicted another namespace"
            elif victim_ns != by and victim_ns in store.guarantees:
                assert store.guaranteed_ready[victim_ns] >= store.guarantees[victim_ns], \
                    f"step {step}: {by} took {victim_ns} below its guaranteed share"
        for quota_ns, quota in store.quotas.items():
            assert store.ns_used.get(quota_ns, 0) <= quota, f"step {step}: {quota_ns} over its quota"
        env.check()
    assert store.counters["evicted_quota"] and store.counters["evictions"] and store.quota_refused
