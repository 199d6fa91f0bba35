"""The store's answer to a truncated pool file (ecd/daemon/tiers/host.py), driven directly:
the segment is a memfd this process truncates, as a group member would the /dev/shm file. Nothing
here touches the mapping past a cut (that would be SIGBUS in the test runner); the daemon-level
attack is tests/security/test_pool_truncation.py."""
from __future__ import annotations

import asyncio
import os

from ecd.errors import Code
from ecd.memory.ring import EventKind, NOT_HERE, key_hash
from ecd.protocol import Extent, Location
from test_store import A, Env, item
from test_store_disk import ENTRY, POOL, DiskEnv, payload, pool_segment


def events(env: Env) -> list[tuple[int, int]]:
    return [(kind, keyhash) for kind, keyhash, _ in env.events()]


def test_a_shrunk_segment_is_restored_and_only_the_cut_entries_go():
    env = Env(pool_sizes=(8 * A,))
    segment = pool_segment(8 * A)
    env.store.host.segments = [segment]
    writer, reader = env.session(), env.session()
    for i in range(4):
        extent = env.alloc(writer, f"k{i}")
        segment.buf[extent.offset:extent.offset + A] = bytes([i + 1]) * A
        assert env.store.commit(writer, extent.generation) is None
    held = env.lease(reader, "k3")  # a reader's lease outlives the drop
    w = env.alloc(writer, "w")  # a write in progress past the cut
    k2 = env.store.index[("ns", "k2")]
    env.events()

    os.ftruncate(segment.fd, k2.offset + 100)  # k0, k1 whole; k2, k3 and w cut
    env.store.host.check_pools()

    assert os.fstat(segment.fd).st_size == 8 * A, "restored"
    assert [env.present(f"k{i}") for i in range(4)] == [True, True, False, False]
    assert bytes(segment.buf[0:A]) == b"\x01" * A
    assert sorted(events(env)) == sorted([(EventKind.EVICTED, key_hash("ns", "k2")),
                                          (EventKind.EVICTED, key_hash("ns", "k3"))])
    assert env.reader.lookup(key_hash("ns", "k2")) == NOT_HERE
    assert env.store.counters["pool_truncations"] == 1 and env.store.counters["evicted_truncated"] == 2
    refused = env.store.commit(writer, w.generation)
    assert refused is not None and refused.code == Code.CORRUPT and "truncated" in refused.message
    assert env.store.release(reader, held.generation) is None  # the retired k3 is freed now
    assert all(not isinstance(r, Location) for r in env.get(reader, ["k2", "k3"]))
    env.check()
    env.store.host.check_pools()  # whole again: nothing more happens
    assert env.store.counters["pool_truncations"] == 1


def test_a_reservation_the_cut_took_sends_its_put_the_alloc_way():
    env = Env(pool_sizes=(8 * A,))
    segment = pool_segment(8 * A)
    env.store.host.segments = [segment]
    writer = env.reserving(env.session())
    env.put(writer, "k0")
    reservation = env.store.reserve(writer, A)
    assert isinstance(reservation, Extent)
    os.ftruncate(segment.fd, reservation.offset)
    env.store.host.check_pools()
    refused = env.store.publish(writer, "ns", reservation.generation, item("r"))
    assert refused is not None and refused.code == Code.STALE and "truncated" in refused.message
    assert env.present("k0") and not env.present("r")
    env.check()


def test_a_spill_of_a_cut_extent_writes_nothing(tmp_path):
    """The eviction that spills reads the pool file with pread: a cut is a short read, and the
    bytes are not written to disk as the key's value."""
    async def main():
        env = DiskEnv(str(tmp_path), asyncio.get_running_loop())
        for i in range(4):  # the pool is full
            env.put_bytes(f"k{i}")
        env.store.exists(env.writer, "ns", ["k0", "k1", "k2"], 0)  # k3 is the least recently used
        k3 = env.store.index[("ns", "k3")]
        assert k3.offset == 3 * ENTRY
        os.ftruncate(env.segments[0].fd, k3.offset + 100)
        extent = env.store.alloc(env.writer, "ns", item("k4", ENTRY))  # evicts k3: its spill reads the cut
        assert isinstance(extent, Extent)
        os.ftruncate(env.segments[0].fd, POOL)
        await env.settle()
        assert env.disk.dropped["failed"] == 1
        assert not env.disk.holds("ns", "k3")
        assert env.store.abort(env.writer, extent.generation) is None
        env.check()
        env.put_bytes("k5")  # into k3's old place
        env.put_bytes("k6")  # evicts k0: the tier goes on spilling what is whole
        await env.settle()
        assert env.disk.counters["spills"] == 1
        (loc,) = await env.get(env.session(), ["k0"])
        assert isinstance(loc, Location) and env.read(loc) == payload("k0")
    asyncio.run(main())
