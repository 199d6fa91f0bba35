"""The client's location cache (ecd/client/location_cache.py): a bounded LRU that ring events
keep current. Dropping an entry must only ever cost a round trip (tests/integration covers that
end to end); here, the map itself."""
from __future__ import annotations

import pytest

from ecd.client.location_cache import LOCATION_CACHE_ENTRIES, LocationCache
from ecd.memory.ring import EventKind

PUB, EVICT, DEL = int(EventKind.PUBLISHED), int(EventKind.EVICTED), int(EventKind.DELETED)


def test_capacity_bounds_it_and_the_least_recently_used_goes_first():
    c = LocationCache(3)
    for h in (1, 2, 3):
        c.remember(h, "ns", f"k{h}", 10 + h)
    assert c.known(1, "ns", "k1")  # 1 is now the most recent: 2 is the oldest
    c.remember(4, "ns", "k4", 14)
    assert len(c) == 3 and 2 not in c and all(h in c for h in (1, 3, 4))
    c.remember(3, "ns", "k3", 23)  # remembering again (a newer generation) refreshes it too
    c.remember(5, "ns", "k5", 15)
    assert sorted(h for h in range(6) if h in c) == [3, 4, 5]


def test_millions_of_keys_never_hold_more_than_the_capacity():
    c = LocationCache()
    for h in range(3 * LOCATION_CACHE_ENTRIES):
        c.remember(h, "ns", str(h), h)
        assert len(c) <= LOCATION_CACHE_ENTRIES
    assert len(c) == LOCATION_CACHE_ENTRIES
    assert 0 not in c and 3 * LOCATION_CACHE_ENTRIES - 1 in c


def test_known_checks_namespace_and_key_not_only_the_hash():
    c = LocationCache()
    c.remember(7, "ns", "a", 1)
    assert c.known(7, "ns", "a")
    assert not c.known(7, "ns", "b")  # another key with the same 64-bit hash
    assert not c.known(7, "other", "a")
    assert not c.known(8, "ns", "a")


def test_ring_events_drop_evicted_deleted_and_replaced_locations():
    c = LocationCache()
    for h in range(1, 6):
        c.remember(h, "ns", str(h), 100 + h)
    c.apply([(EVICT, 1, 101), (DEL, 2, 102), (PUB, 3, 999), (PUB, 4, 104), (EVICT, 42, 1)])
    assert [h for h in range(1, 6) if h in c] == [4, 5]  # 3 was replaced by generation 999
    c.forget(4)
    c.forget(4)  # forgetting what is not there is fine
    assert len(c) == 1 and bool(c)
    c.clear()
    assert len(c) == 0 and not c


def test_capacity_must_be_positive():
    with pytest.raises(ValueError):
        LocationCache(0)
