"""The tier interface's own behaviour: the null tier a daemon without `[pool.disk]` runs with (it
holds nothing, keeps nothing, makes nothing durable, and a store over it behaves as a store with
no lower tier), the disk tier and the null tier both answering the LowerTier protocol, and the
host tier's choice of pools."""
from __future__ import annotations

import asyncio

import pytest

from ecd.config import load_config
from ecd.daemon.registry.entries import RequestError
from ecd.daemon.tiers.base import LowerTier, NullTier
from ecd.daemon.tiers.disk import DiskTier
from ecd.daemon.restart.adopt import pool_layout, slot_tail_bytes, tail_pools
from ecd.daemon.tiers.host import HostTier
from ecd.errors import Code
from ecd.memory.ring import EventKind
from ecd.protocol import Failure

from test_store import A, Env


def test_the_null_tier_holds_nothing_and_makes_nothing_durable():
    env = Env(pool_sizes=(2 * A,))
    tier = env.store.lower_tier
    assert isinstance(tier, NullTier)
    s = env.session()
    env.put(s, "k0")
    entry = env.store.index[("ns", "k0")]
    tier.spill(entry)
    assert not tier.holds("ns", "k0") and not tier.clean(entry) and not tier.promote("ns", "k0")
    assert not tier.drop("ns", "k0", EventKind.EVICTED) and list(tier.listing()) == []
    assert not tier.persists and tier.writes == 0 and tier.internal_sessions == 0
    assert tier.stats() is None and list(tier.metric_families()) == [] and tier.integrity_failures() == {}
    assert tier.removals_since(tier.removal_mark()) is None
    env.check()


def test_an_eviction_over_the_null_tier_is_gone_for_good():
    env = Env(pool_sizes=(2 * A,))
    s = env.session()
    for key in ("k0", "k1", "k2"):
        env.put(s, key)
    assert not env.present("k0") and env.store.counters["evictions"] == 1
    assert not env.store.is_local("ns", "k0") and env.get(s, ["k0"])[0].code == Code.KEY_NOT_FOUND
    assert env.store.exists(s, "ns", ["k0"], 0) == [False]
    env.check()


def test_the_null_tier_refuses_a_persist_it_is_asked_for():
    async def main():
        return await NullTier().persist([None])
    assert asyncio.run(main()) == [None]

    class Written:
        key = "k"

    async def refused():
        return await NullTier().persist([Written()])  # type: ignore[list-item]
    (failure,) = asyncio.run(refused())
    assert isinstance(failure, Failure) and failure.code == Code.NOT_DURABLE


def test_both_lower_tiers_answer_the_protocol(tmp_path):
    def check(tier: LowerTier) -> None:  # mypy checks the types; this checks every name is there
        for name in LowerTier.__dict__:
            if not name.startswith("_"):
                assert hasattr(tier, name), name
    check(NullTier())
    cfg = load_config({"pool": {"disk": {"path": str(tmp_path), "size": "16MiB"}}}).pool.disk
    disk = DiskTier(cfg, epoch=1)
    disk.open()
    try:
        check(disk)
        assert disk.persists and disk.integrity_failures() == {"disk": 0} and disk.stats() is not None
    finally:
        disk.close()


def test_a_sized_tenant_s_entries_are_placed_in_its_own_segments_only():
    """HostTier's groups (restart/adopt.py's pool_layout): a sized tenant's scope places in its
    segments, every other namespace in the rest."""
    host = HostTier([4 * A, 2 * A, 2 * A], groups={"team-a": (1, 2)})
    assert host.shared_pools == (0,) and host.pools_for("team-a\0") == (1, 2) and host.pools_for("kv") == (0,)
    assert host.tier(-1, "team-a\0") == (1, 2) and host.tier(-1) == (0,)
    assert "tenant 'team-a''s segments" in host.too_large(3 * A, (1, 2))
    assert host.alloc(2 * A, host.tier(-1, "team-a\0")) == (1, 0)
    config = load_config({"pool": {"host": {"size": "64MiB", "segment_size": "16MiB"}},
                          "tenants": {"b": {"uids": [7], "size": "20MiB"}, "a": {"uids": [8], "size": "8MiB"}}})
    sizes, groups = pool_layout(config)
    tail = slot_tail_bytes(config)  # each part's first segment: its clients' submission pages and read slots
    assert groups == {"a": (3,), "b": (4, 5)} and sizes[3:] == ((8 << 20) + tail, (16 << 20) + tail, 4 << 20), sizes
    assert sum(sizes[:3]) - tail == 36 << 20 and tail_pools(groups) == {"": 0, "a": 3, "b": 4}


def test_the_host_tier_places_in_the_pools_it_is_asked_for():
    host = HostTier([4 * A, 2 * A], [8 * A])
    assert host.host_pools == (0, 1) and host.arena_pools == (2,)
    assert host.tier(-1) == (0, 1) and host.tier(2) == (2,)
    with pytest.raises(RequestError) as refused:
        host.tier(1)  # a host segment is no arena
    assert refused.value.code == Code.INVALID
    assert host.too_large(4 * A, (0, 1)) is None and "largest pool segment" in host.too_large(5 * A, (0, 1))
    assert "CUDA arena 2" in host.too_large(9 * A, (2,))
    assert host.alloc(4 * A, (0, 1)) == (0, 0)
    assert host.alloc(4 * A, (0, 1)) is None  # neither segment has room now
    assert host.alloc(2 * A, (0, 1)) == (1, 0)
    host.free(0, 0, 4 * A)
    assert host.allocators[0].used == 0
    host.check_pools()  # no segments (memfd or a test): nothing to check
