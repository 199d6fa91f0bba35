"""Eviction, PoolFull, delete and atomic replace against a real daemon with a small pool."""
from __future__ import annotations

import pytest
import torch

import ecd
from conftest import entry_bytes

MiB = 1 << 20


def mib_tensor(n: int, fill: float) -> torch.Tensor:
    return torch.full((n * MiB // 4,), fill, dtype=torch.float32)


@pytest.fixture
def small(daemon_factory):
    return daemon_factory(size="8MiB")


def test_lru_eviction_keeps_recently_used_entries(small):
    with small.client() as c:
        for i in range(4):
            c.put(f"k{i}", mib_tensor(2, i))  # fills the 8 MiB pool
        c.get("k0")  # k0 becomes most recently used; k1 is now the LRU entry
        c.put("k4", mib_tensor(2, 4))  # exactly one eviction
        assert c.exists(["k0", "k1", "k2", "k3", "k4"]) == [True, False, True, True, True]
        stats = c.stats()
        assert stats["evictions"] == 1 and stats["entries_ready"] == 4
        assert torch.equal(c.get("k0"), mib_tensor(2, 0))


def test_pinned_entries_survive_eviction_until_unpinned(daemon_factory):
    small = daemon_factory(size="8MiB", extra="[limits]\npinned_share = 1.0\n")  # pins may hold it all
    with small.client() as c:
        c.put("pinned", mib_tensor(4, 1))
        c.put("plain", mib_tensor(3, 2))
        assert c.exists(["pinned", "plain"], pin_s=30) == [True, True]
        with pytest.raises(ecd.PoolFull):
            c.put("big", mib_tensor(5, 3))
        assert c.unpin(["plain"]) == [True]
        c.put("big2", mib_tensor(3, 3))  # evicts "plain" only
        assert c.exists(["pinned", "plain", "big2"]) == [True, False, True]
        assert c.stats()["pins"] == 1


@pytest.mark.parametrize("slots", [False, True], ids=["daemon-pins", "slot-pins"])
def test_pins_past_their_budget_are_not_taken(small, slots):
    """pinned_share = 0.5 of 8 MiB: 4 MiB pinned fits, 3 more do not. A daemon pin past the budget
    answers False to the pinned lookup; a pin in a read slot (client/pins.py) answers True but the
    plan applies the budget, each session's smallest pins first: the 3 MiB pin is kept, the 4 MiB
    one is not. Either way the pin past the budget stays evictable, and is evicted first."""
    with small.client(local_reads=slots) as c:
        c.put("pinned", mib_tensor(4, 1))
        c.put("plain", mib_tensor(3, 2))
        asked = c.stats()["ops"].get("exists", 0)
        assert c.exists(["pinned", "plain"], pin_s=30) == [True, slots]
        assert c.stats()["ops"].get("exists", 0) == asked + (not slots)  # slot pins ask nothing
        assert c.exists("plain") is True
        c.put("big", mib_tensor(4, 3))  # evicts the one whose pin the budget did not keep
        assert c.exists(["pinned", "plain", "big"]) == [not slots, slots, True]
        assert c.unpin(["pinned"]) == [True]
        assert c.exists("big", pin_s=30) is True  # the budget freed by the unpin


def test_too_large_for_any_segment_is_invalid_not_an_eviction_storm(small):
    with small.client() as c:
        c.put("keep", mib_tensor(1, 1))
        with pytest.raises(ecd.InvalidRequest, match="larger than the largest pool segment"):
            c.put("huge", mib_tensor(9, 0))
        assert c.exists("keep") is True and c.stats()["evictions"] == 0


def test_delete_frees_space_and_hides_the_key(small):
    with small.client() as c:
        c.put("d", mib_tensor(4, 1))
        used = c.stats()["used_bytes"]
        assert c.delete(["d", "nope"]) == [True, False]
        assert c.exists("d") is False
        with pytest.raises(ecd.KeyNotFound):
            c.get("d")
        assert c.stats()["used_bytes"] == used - 4 * MiB


def test_delete_while_viewed_keeps_bytes_for_the_viewer(small):
    with small.client() as c:
        c.put("v", mib_tensor(2, 7))
        with c.view("v") as v:
            assert c.delete("v") is True
            assert c.exists("v") is False
            assert c.stats()["entries_retired"] == 1
            assert torch.equal(v, mib_tensor(2, 7))
        assert c.stats()["entries_retired"] == 0 and entry_bytes(c.stats()) == 0


def test_put_replaces_atomically_while_a_reader_holds_the_old_view(small, actors):
    other = actors(small.endpoint)
    with small.client() as c:
        c.put("img", mib_tensor(1, 1.0))
        with c.view("img") as old:
            assert other.ask("put img 99 262144") == "ok"  # another process replaces it
            assert torch.equal(old, mib_tensor(1, 1.0))  # the holder still sees the old bytes
            assert other.ask("get img 99 262144") == "ok"  # later readers see the new ones
        stats = c.stats()
        assert stats["entries_ready"] == 1 and stats["entries_retired"] == 0
        assert entry_bytes(stats) == MiB


def test_batched_put_and_get(small):
    with small.client() as c:
        items = {f"blk{i}": torch.randn(1000 + i) for i in range(50)}
        c.put_many(items)
        got = c.get_many(list(items) + ["missing"], missing_ok=True)
        assert got[-1] is None
        assert all(torch.equal(g, t) for g, t in zip(got, items.values()))
        with pytest.raises(ecd.KeyNotFound):
            c.get_many(["blk0", "missing"])
        ops = c.stats()["ops"]
        # one request for all 50 puts (a put lease; or Alloc + Commit on the round-trip route), and
        # at most one lookup each for the gets (entries it can locate are read without one)
        assert ops.get("lease_space", 0) + ops.get("alloc", 0) <= 1 and ops.get("commit", 0) <= 1
        assert ops.get("acquire", 0) <= 2 and "publish" not in ops


def test_failed_batch_put_leaves_nothing_behind(small):
    with small.client() as c:
        with pytest.raises(ecd.InvalidRequest):
            c.put_many({"ok": torch.ones(10), "bad": torch.ones(3 * MiB)})  # 12 MiB > pool
        stats = c.stats()
        assert stats["entries_writing"] == 0 and entry_bytes(stats) == 0 and c.exists("ok") is False


def test_view_many_leases_every_entry_for_the_block_and_releases_them_together(small):
    """One round trip's views: each the entry's bytes, leased until the block exits
    (delete meanwhile retires the bytes, it does not free them); a missing key is None only
    with missing_ok, otherwise KeyNotFound and no lease is left behind."""
    a, b = mib_tensor(1, 3.0), torch.arange(1000, dtype=torch.int64)
    with small.client() as c:
        c.put("a", a)
        c.put("b", b)
        acquires = c.stats()["ops"].get("acquire", 0)
        with c.view_many(["a", "absent", "b"], missing_ok=True) as views:
            assert c.stats()["ops"]["acquire"] == acquires + 1  # one round trip for all three
            assert views[1] is None
            assert torch.equal(views[0], a) and torch.equal(views[2], b)
            assert c.stats()["read_leases"] == 2
            assert c.delete("a") is True
            assert torch.equal(views[0], a) and c.stats()["entries_retired"] == 1
        assert c.stats()["read_leases"] == 0 and c.stats()["entries_retired"] == 0
        with pytest.raises(ecd.KeyNotFound):
            with c.view_many(["b", "absent"]):
                pass
        assert c.stats()["read_leases"] == 0
