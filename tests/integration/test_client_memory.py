"""A long-lived client's memory stays flat (issue 12), and its bounded location cache never
changes an answer: a location it dropped costs a round trip, nothing else.

Before: the location cache (keyhash -> namespace, key, generation of every entry the client put
or read) was pruned only by exists(), so a client that only puts and gets grew by ~26 MiB RssAnon
per 100k distinct keys. benchmarks/client_memory.py runs the full 100k-key version."""
from __future__ import annotations

import gc

import torch

from conftest import metric, proc_memory_kib, scrape_metrics
from ecd.memory.ring import key_hash

KIB128 = 128 * 256  # float32 elements in 128 KiB


def overruns(daemon) -> float:
    return metric(scrape_metrics(daemon.metrics_port), "ecd_ring_reader_overruns_total")


def test_memory_stays_flat_over_distinct_keys(daemon):
    """128 KiB put + get of 30k distinct keys through a 64 MiB pool (the daemon evicts all along):
    after 10k keys of warm-up, 20k more leave RssAnon where it was. (Before: +5 MiB.)"""
    warmup, more = 10_000, 20_000
    t = torch.arange(KIB128, dtype=torch.float32)
    with daemon.client() as c:
        base = None
        for i in range(1, warmup + more + 1):
            t[0] = i
            c.put(f"k{i}", t)
            got = c.get(f"k{i}")
            assert got[0].item() == i
            del got
            if i == warmup:
                gc.collect()
                base = proc_memory_kib()["RssAnon"]
        gc.collect()
        grown_mib = (proc_memory_kib()["RssAnon"] - base) / 1024
        assert grown_mib < 2.0, f"RssAnon grew {grown_mib:.2f} MiB over {more} keys after warm-up"
        assert c.exists(f"k{warmup + more}") is True and c.exists("k1") is False


def same_bucket_keys(n: int, buckets: int = 64) -> list[str]:
    """n keys whose hashes share one presence bucket: its word is SHARED, so the ring cannot
    answer "present" for them and the location cache is what saves the round trip."""
    names = (f"e{i}" for i in range(1_000_000))
    return [k for k in names if key_hash("default", k) % buckets == 0][:n]


def test_a_dropped_location_costs_one_round_trip_never_a_wrong_answer(daemon_factory):
    from ecd.client.location_cache import LocationCache
    from ecd.client.testing import replace_location_cache
    daemon = daemon_factory(extra="[ring]\npresence_buckets = 64")
    t = torch.ones(KIB128)
    keys = same_bucket_keys(20)
    # submit=False: the round trip's reply is what puts the location in the cache
    with daemon.client(submit=False) as c, daemon.client() as other:
        replace_location_cache(c, LocationCache(8))  # room for the last 8 only
        for key in keys:
            c.put(key, t)
        assert len(c.location_cache) == 8 and all(key_hash("default", k) in c.location_cache for k in keys[-8:])
        asked = c.stats()["ops"].get("exists", 0)
        assert c.exists(keys) == [True] * 20  # 12 dropped locations: asked, in one round trip
        assert c.stats()["ops"].get("exists", 0) == asked + 1
        assert c.exists(keys[-8:]) == [True] * 8  # still cached: no round trip
        assert c.stats()["ops"].get("exists", 0) == asked + 1
        assert other.delete([keys[0], keys[-1]]) == [True, True]  # one dropped, one cached
        assert c.exists([keys[0], keys[-1], keys[1]]) == [False, False, True]


def test_a_client_that_only_puts_and_gets_follows_the_ring(daemon_factory):
    """Its puts and gets apply ring events once RING_SYNC_BACKLOG are unread: what the daemon
    evicted leaves its cache without an exists() call, and nothing is reported as an overrun."""
    d = daemon_factory(size="8MiB")  # 64 entries of 128 KiB
    t = torch.ones(KIB128)
    with d.client(submit=False) as c:  # the round trip's reply caches the location
        c.put("mine", t)
        mine = key_hash("default", "mine")
        assert mine in c.location_cache
        for i in range(700):  # a publish and an eviction each: 1400 events
            c.put(f"k{i}", t)
        assert mine not in c.location_cache  # evicted (LRU), and this client read it on the ring
        assert len(c.location_cache) <= 64 + 512  # the pool's entries, plus puts since the last sync
        assert c.exists("mine") is False
        c.ping()
        assert overruns(d) == 0


def test_an_idle_client_catches_up_with_the_ring_quietly(daemon):
    """A client that was idle while others wrote more than RING_MAX_BACKLOG events drops its
    locations at its next put (it cannot tell which are still valid) without an overrun
    report, and answers right afterwards."""
    with daemon.client(submit=False) as c, daemon.client() as other:  # locations cached from replies
        c.put("mine", torch.ones(KIB128))
        assert key_hash("default", "mine") in c.location_cache
        other.put_many({f"o{i}": torch.ones(1) for i in range(5000)})  # 5000 events
        c.put("next", torch.ones(KIB128))
        assert len(c.location_cache) == 0
        assert c.exists(["mine", "next", "o4999", "absent"]) == [True, True, True, False]
        c.ping()
        assert overruns(daemon) == 0


def test_a_present_key_put_by_another_client_is_answered_from_the_ring(daemon):
    """Unpinned exists() of a key another process put: the presence word names it, no round
    trip; a pin is taken by a read slot (the entry index locates it), no round trip either, and
    the daemon counts it; a delete is seen at once; a key sharing a bucket with another asks."""
    t = torch.ones(16)
    with daemon.client() as producer, daemon.client() as consumer:
        producer.put("there", t)
        asked = consumer.stats()["ops"].get("exists", 0)
        assert consumer.exists(["there", "nowhere"]) == [True, False]
        assert consumer.stats()["ops"].get("exists", 0) == asked  # both from the ring
        assert consumer.exists("there", pin_s=5) is True
        assert consumer.stats()["ops"].get("exists", 0) == asked  # pinned by a read slot
        assert [e["pins"] for e in producer.keys()[1] if e["key"] == "there"] == [1]
        assert consumer.unpin("there") is True
        assert [e["pins"] for e in producer.keys()[1] if e["key"] == "there"] == [0]
        assert consumer.stats()["ops"].get("exists", 0) == asked and consumer.stats()["ops"].get("unpin", 0) == 0
        assert producer.delete("there") is True
        assert consumer.exists("there") is False
        assert consumer.stats()["ops"].get("exists", 0) == asked
