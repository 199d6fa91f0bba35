"""Store + DiskTier driven directly on a real event loop (no daemon): spill on eviction, promote
on read (once for concurrent readers), replacement and deletion of spilled keys, corrupt and
missing records, persist. Every step ends with the registry's invariant check (test_store.Env.check,
which covers the disk tier: presence of spilled keys, one record per key agreeing with its host
entry, the disk budget)."""
from __future__ import annotations

import asyncio
import mmap
import os
import threading
from types import SimpleNamespace

import pytest

from ecd.config import load_config
from ecd.daemon.tiers.disk import DiskTier
from ecd.errors import Code
from ecd.integrity import checksum
from ecd.memory.host import ShmFile
from ecd.memory.ring import NOT_HERE, key_hash
from ecd.protocol import Extent, Failure, Location
from test_store import Env, item

KIB = 1024
ENTRY = 64 * KIB
POOL = 4 * ENTRY  # four entries fit


def payload(key: str, n: int = ENTRY) -> bytes:
    seed = checksum(key.encode())
    return (seed.to_bytes(8, "little") * (n // 8 + 1))[:n]


def pool_segment(size: int) -> ShmFile:
    """A pool segment as the daemon has it (the mapping and its file's fd: spills pread it), on a
    memfd, allocated up front as the daemon's are (a page missing means a cut: ecd/daemon/tiers/host.py)."""
    fd = os.memfd_create("ecd-test-pool", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    os.posix_fallocate(fd, 0, size)
    return ShmFile("ecd-test-pool", size, mmap.mmap(fd, size), fd)


class DiskEnv(Env):
    def __init__(self, path: str, loop, size: str = "16MiB", **disk) -> None:
        cfg = load_config({"pool": {"disk": {"path": path, "size": size, "min_spill_size": 0, **disk}}}).pool.disk
        self.disk = DiskTier(cfg, epoch=7)
        self.disk.open()
        super().__init__(pool_sizes=(POOL,), lower_tier=self.disk)
        self.store.scheduler = loop  # parked requests and promotions need real timers and tasks
        self.segments = [pool_segment(POOL)]
        self.disk.attach(self.store, loop, self.segments)
        self.writer = self.session()

    def put_bytes(self, key: str, data: bytes | None = None) -> int:
        data = payload(key) if data is None else data
        extent = self.store.alloc(self.writer, "ns", item(key, len(data)))
        assert isinstance(extent, Extent), extent
        self.segments[0].buf[extent.offset:extent.offset + len(data)] = data
        assert self.store.commit(self.writer, extent.generation, checksum(data)) is None
        return extent.generation

    def put_five(self) -> None:
        """k0..k4: the pool holds four, so k0 is evicted (spilled)."""
        for i in range(5):
            self.put_bytes(f"k{i}")

    async def settle(self) -> None:
        for _ in range(2000):
            if not self.disk.writes and not self.disk.promoting:
                return
            await asyncio.sleep(0.005)
        raise AssertionError("disk tier did not settle")

    async def get(self, session, keys):
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        now = self.store.acquire(session, "ns", list(keys), 0, done.set_result)
        return now if now is not None else await asyncio.wait_for(done, 10)

    def read(self, loc: Location) -> bytes:
        return bytes(self.segments[0].buf[loc.offset:loc.offset + loc.nbytes])


async def gone(path: str) -> None:
    for _ in range(1000):
        if not os.path.exists(path):
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"{path} was not removed")


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def tier_dir(tmp_path):
    path = tmp_path / "disk"
    path.mkdir()
    return str(path)


def test_evicted_entries_spill_and_come_back_bit_identical(tier_dir):
    async def main():
        env = DiskEnv(tier_dir, asyncio.get_running_loop())
        reader = env.session()
        keys = [f"k{i}" for i in range(10)]  # 10 entries through a pool of 4
        for key in keys:
            env.put_bytes(key)
            env.check()
        await env.settle()
        env.check()
        assert env.disk.counters["spills"] == 6
        assert all(env.store.exists(reader, "ns", keys, 0))
        assert all(env.reader.lookup(key_hash("ns", k)) != NOT_HERE for k in keys)  # spilled keys stay present
        for key in keys:
            (loc,) = await env.get(reader, [key])
            assert isinstance(loc, Location), loc
            assert env.read(loc) == payload(key)
            env.store.release(reader, loc.generation)
            env.check()
        await env.settle()
        env.check()
        # k0 came back by spilling k6; each of k1-k5 then took the room of the one read before it
        # (its bytes on disk already: dropped, not written); k6 came back, k7-k9 never left
        assert env.disk.counters["promotions"] == 7
        assert env.disk.counters["spills"] == 7
        env.disk.close()
    run(main())


def test_concurrent_readers_promote_once(tier_dir):
    async def main():
        env = DiskEnv(tier_dir, asyncio.get_running_loop())
        env.put_five()  # k0 spills
        await env.settle()
        assert not env.present("k0") and env.disk.holds("ns", "k0")
        readers = [env.session() for _ in range(4)]
        results = await asyncio.gather(*(env.get(r, ["k0"]) for r in readers))
        assert env.disk.counters["promotions"] == 1
        generations = {res[0].generation for res in results}
        assert len(generations) == 1
        for r, (loc,) in zip(readers, results):
            assert env.read(loc) == payload("k0")
            env.store.release(r, loc.generation)
        env.check()
        env.disk.close()
    run(main())


def test_replacing_or_deleting_a_spilled_key_drops_its_record(tier_dir):
    async def main():
        env = DiskEnv(tier_dir, asyncio.get_running_loop())
        for i in range(6):
            env.put_bytes(f"k{i}")  # k0, k1 spill
        await env.settle()
        env.put_bytes("k0", payload("new"))  # replaced while on disk: the old bytes must never be served
        env.check()
        assert env.store.delete("ns", ["k1"]) == [True]
        env.check()
        assert env.store.exists(env.session(), "ns", ["k1"], 0) == [False]
        await env.settle()
        reader = env.session()
        (loc,) = await env.get(reader, ["k0"])
        assert env.read(loc) == payload("new")
        env.store.release(reader, loc.generation)
        # the files of dropped records are removed on worker threads
        files_left = lambda: sorted(n for n in os.listdir(tier_dir) if n.endswith(".ecd"))  # noqa: E731
        for _ in range(1000):
            if files_left() == sorted(r.name for r in env.disk.records.values()):
                break
            await asyncio.sleep(0.005)
        assert files_left() == sorted(r.name for r in env.disk.records.values())
        env.check()
        env.disk.close()
    run(main())


def test_a_flipped_byte_is_never_served(tier_dir):
    async def main():
        env = DiskEnv(tier_dir, asyncio.get_running_loop())
        env.put_five()
        await env.settle()
        record = env.disk.record("ns", "k0")
        path = os.path.join(tier_dir, record.name)
        with open(path, "r+b") as f:
            f.seek(record.header.header_len + 1000)
            byte = f.read(1)
            f.seek(record.header.header_len + 1000)
            f.write(bytes([byte[0] ^ 0x01]))
        reader = env.session()
        (result,) = await env.get(reader, ["k0"])
        assert isinstance(result, Failure) and result.code == Code.KEY_NOT_FOUND
        assert env.disk.counters["integrity_failures"] == 1
        assert not env.disk.holds("ns", "k0")
        await gone(path)  # removed on a worker thread
        assert env.store.exists(reader, "ns", ["k0"], 0) == [False]
        env.check()
        env.disk.close()
    run(main())


def test_a_deleted_file_is_a_clean_miss(tier_dir):
    async def main():
        env = DiskEnv(tier_dir, asyncio.get_running_loop())
        env.put_five()
        await env.settle()
        os.unlink(os.path.join(tier_dir, env.disk.record("ns", "k0").name))
        reader = env.session()
        (result,) = await env.get(reader, ["k0"])
        assert isinstance(result, Failure) and result.code == Code.KEY_NOT_FOUND
        assert env.disk.errors["missing"] == 1
        # the pool was full: the promotion's extent evicted (spilled) another entry, then was aborted
        env.check()
        env.disk.close()
    run(main())


def test_persist_writes_through_and_survives_a_new_tier(tier_dir):
    async def main():
        env = DiskEnv(tier_dir, asyncio.get_running_loop())
        generation = env.put_bytes("p")
        entry = env.store.by_generation[generation]
        (result,) = await env.disk.persist([entry])
        assert result is None
        assert env.disk.record("ns", "p").persisted and entry.readers == 0
        env.check()
        env.disk.close()
        again = DiskEnv(tier_dir, asyncio.get_running_loop())  # a restart: headers re-indexed
        assert again.disk.loaded == 1 and again.disk.record("ns", "p").persisted
        assert again.reader.lookup(key_hash("ns", "p")) != NOT_HERE
        reader = again.session()
        (loc,) = await again.get(reader, ["p"])
        assert again.read(loc) == payload("p")
        again.store.release(reader, loc.generation)
        again.check()
        again.disk.close()
    run(main())


def test_spill_budget_drops_least_recently_used_spills(tier_dir):
    async def main():
        env = DiskEnv(tier_dir, asyncio.get_running_loop(), size="16MiB")
        env.disk.capacity = 3 * (ENTRY + 4096)  # room for three spilled records
        for i in range(10):
            env.put_bytes(f"k{i}")
            await env.settle()
            env.check()
        assert len(env.disk.records) == 3 and env.disk.counters["disk_evictions"] == 3
        assert not env.disk.holds("ns", "k0")
        env.check()  # k0's presence went with its record (check() counts presence exactly)
        env.disk.close()
    run(main())


def test_a_peer_lookup_is_answered_at_once_and_starts_the_promotion(tier_dir):
    async def main():
        env = DiskEnv(tier_dir, asyncio.get_running_loop())
        env.put_five()  # k0 spills
        await env.settle()
        peer = env.session()

        def never(results):
            raise AssertionError(f"a peer's lookup parked: {results}")
        (now,) = env.store.acquire(peer, "ns", ["k0"], 0.0, never, park_for_disk=False)
        assert isinstance(now, Failure) and now.code == Code.KEY_NOT_FOUND
        await env.settle()  # its promotion ran meanwhile: the next lookup finds it in memory
        (loc,) = env.store.acquire(peer, "ns", ["k0"], 0.0, never, park_for_disk=False)
        assert isinstance(loc, Location) and env.read(loc) == payload("k0")
        env.store.release(peer, loc.generation)
        env.check()
        env.disk.close()
    run(main())


def test_a_read_of_a_spill_still_being_written_waits_for_it(tier_dir):
    async def main():
        env = DiskEnv(tier_dir, asyncio.get_running_loop())
        env.put_five()  # k0's spill starts; nothing has run on the loop yet
        record = env.disk.record("ns", "k0")
        assert not record.ready and env.store.exists(env.session(), "ns", ["k0"], 0) == [True]
        reader = env.session()
        (loc,) = await env.get(reader, ["k0"])
        assert env.read(loc) == payload("k0")
        env.store.release(reader, loc.generation)
        await env.settle()
        env.check()
        env.disk.close()
    run(main())


def test_a_promotion_into_a_pool_held_full_says_so(tier_dir):
    async def main():
        env = DiskEnv(tier_dir, asyncio.get_running_loop())
        env.put_five()
        await env.settle()
        holder = env.session()
        held = env.store.acquire(holder, "ns", [f"k{i}" for i in range(1, 5)], 0, None)
        assert all(isinstance(loc, Location) for loc in held)  # every extent leased: nothing to evict
        reader = env.session()
        (result,) = await env.get(reader, ["k0"])
        assert isinstance(result, Failure) and result.code == Code.POOL_FULL and "on disk" in result.message
        assert env.disk.holds("ns", "k0")  # still there for a later read
        for loc in held:
            env.store.release(holder, loc.generation)
        (loc,) = await env.get(reader, ["k0"])
        assert env.read(loc) == payload("k0")
        env.store.release(reader, loc.generation)
        env.check()
        env.disk.close()
    run(main())


@pytest.mark.parametrize("disk, reason", [({"spill": False}, "disabled"), ({"min_spill_size": "1MiB"}, "too_small")])
def test_evictions_not_worth_spilling_are_dropped_and_counted(tier_dir, disk, reason):
    async def main():
        env = DiskEnv(tier_dir, asyncio.get_running_loop(), **disk)
        env.put_five()
        await env.settle()
        assert not env.disk.records and env.disk.dropped[reason] == 1
        assert env.store.exists(env.session(), "ns", ["k0"], 0) == [False]
        env.check()
        env.disk.close()
    run(main())


def test_operator_evict_removes_keys_from_both_tiers(tier_dir):
    async def main():
        env = DiskEnv(tier_dir, asyncio.get_running_loop())
        for i in range(6):
            env.put_bytes(f"k{i}")  # k0, k1 on disk only
        await env.settle()
        evicted, refused, missing, _ = env.store.evict("ns", ["k0", "k5", "nope"], False, False, False)
        assert (evicted, refused, missing) == (2, [], ["nope"])
        assert not env.disk.holds("ns", "k0") and env.disk.holds("ns", "k1")
        env.check()
        evicted, *_ = env.store.evict("", [], False, True, False)
        assert evicted == 4 and not env.disk.records and len(env.store.index) == 0  # k1 (on disk), k2-k4
        env.check()
        env.disk.close()
    run(main())


def test_unusable_paths_are_refused_with_the_key_and_path(tmp_path):
    from ecd.errors import ConfigError
    missing = str(tmp_path / "nope")
    cfg = load_config({"pool": {"disk": {"path": missing, "size": "16MiB"}}}).pool.disk
    with pytest.raises(ConfigError, match=r"pool\.disk\.path: .*nope"):
        DiskTier(cfg, 1).open()


def test_a_read_that_fails_for_another_reason_keeps_the_record(tier_dir, monkeypatch):
    """EIO, EMFILE, EACCES on a read are not the record's fault: that read misses, the record
    (here an acknowledged persist) stays, and the next read serves it."""
    import ecd.daemon.tiers.disk as tier_mod
    from ecd.memory import disk as files

    async def main():
        env = DiskEnv(tier_dir, asyncio.get_running_loop())
        entry = env.store.by_generation[env.put_bytes("p")]
        (result,) = await env.disk.persist([entry])
        assert result is None
        env.put_five()  # p is evicted: on disk only
        await env.settle()
        assert ("ns", "p") not in env.store.index and env.disk.record("ns", "p") is not None
        real = files.read_record

        def failing(*args, **kwargs):
            raise files.DiskIOError("io", "Too many open files")
        monkeypatch.setattr(tier_mod.files, "read_record", failing)
        reader = env.session()
        (result,) = await env.get(reader, ["p"])
        assert isinstance(result, Failure) and result.code == Code.KEY_NOT_FOUND
        assert env.disk.errors["io"] == 1 and env.disk.counters["integrity_failures"] == 0
        record = env.disk.record("ns", "p")
        assert record is not None and os.path.exists(os.path.join(tier_dir, record.name))
        monkeypatch.setattr(tier_mod.files, "read_record", real)
        (loc,) = await env.get(reader, ["p"])
        assert isinstance(loc, Location) and env.read(loc) == payload("p")
        env.store.release(reader, loc.generation)
        env.check()
        env.disk.close()
    run(main())


def test_a_restart_never_orders_its_records_before_older_ones(tier_dir):
    """The epoch comes from the wall clock; one that stepped back must not make a new record
    lose to an older one of the same key at the next start."""
    async def main():
        env = DiskEnv(tier_dir, asyncio.get_running_loop())
        (result,) = await env.disk.persist([env.store.by_generation[env.put_bytes("p")]])
        assert result is None
        env.disk.close()
        again = DiskEnv(tier_dir, asyncio.get_running_loop())  # epoch 7 again: the clock did not move on
        assert again.disk.epoch > 7
        again.disk.close()
    run(main())


def test_a_write_whose_directory_fsync_fails_leaves_no_record(tmp_path, monkeypatch):
    from ecd.memory import disk as files
    header = files.RecordHeader("ns", "k", "uint8", (16,), 16, 0, 1, 1, 0, True)
    dirfd = os.open(tmp_path, os.O_RDONLY)
    real_fsync = os.fsync

    def fsync(fd):
        if fd == dirfd:
            raise OSError(5, "Input/output error")
        real_fsync(fd)
    monkeypatch.setattr(files.os, "fsync", fsync)
    try:
        with pytest.raises(files.DiskIOError) as info:
            files.write_record(str(tmp_path), dirfd, header, memoryview(bytes(range(16))), False, True)
        assert info.value.kind == "eio"
    finally:
        os.close(dirfd)
    assert os.listdir(tmp_path) == []  # neither the record nor its temporary file


def test_a_persist_batch_survives_one_write_raising_and_leaves_no_lease(tier_dir, monkeypatch):
    import ecd.daemon.tiers.disk as tier_mod
    from ecd.memory import disk as files
    real = files.write_record

    def write_record(directory, dirfd, header, *args, **kwargs):
        if header.key == "bad":
            raise ValueError("a bug in the writer")
        return real(directory, dirfd, header, *args, **kwargs)
    monkeypatch.setattr(tier_mod.files, "write_record", write_record)

    async def main():
        env = DiskEnv(tier_dir, asyncio.get_running_loop())
        entries = [env.store.by_generation[env.put_bytes(k)] for k in ("a", "bad", "c")]
        results = await env.disk.persist(entries)
        assert results[0] is None and results[2] is None
        assert isinstance(results[1], Failure) and results[1].code == Code.NOT_DURABLE
        assert all(e.readers == 0 for e in entries) and env.disk.writes == 0
        assert env.disk.record("ns", "bad") is None and env.disk.errors["internal"] == 1
        assert env.disk.record("ns", "a").persisted and env.disk.record("ns", "c").persisted
        env.check()
        env.disk.close()
    run(main())


def test_a_promotion_of_an_older_record_never_answers_for_a_newer_one(tier_dir, monkeypatch):
    """A get waits on k0's first spill (R1, its write held back); k0 is replaced and spilled
    again (R2). A get of the new k0 must read R2, not be told "missing" by R1's promotion."""
    import threading

    import ecd.daemon.tiers.disk as tier_mod
    from ecd.memory import disk as files
    real, gate, held = files.write_record, threading.Event(), []

    def write_record(directory, dirfd, header, *args, **kwargs):
        if header.key == "k0" and not held:
            held.append(header)
            gate.wait(10)
        return real(directory, dirfd, header, *args, **kwargs)
    monkeypatch.setattr(tier_mod.files, "write_record", write_record)

    async def main():
        env = DiskEnv(tier_dir, asyncio.get_running_loop())
        env.put_five()  # k0 evicted: R1's write starts, and waits on the gate
        reader = env.session()
        first = asyncio.ensure_future(env.get(reader, ["k0"]))  # parks; promotes R1 (waits on it)
        await asyncio.sleep(0.02)
        new = payload("k0-new")
        env.put_bytes("k0", new)  # R1 dropped; the parked get is answered with the new entry
        (loc,) = await first
        assert env.read(loc) == new
        env.store.release(reader, loc.generation)
        for i in range(5, 9):
            env.put_bytes(f"k{i}")  # the new k0 evicted in turn: R2
        for _ in range(400):
            record = env.disk.record("ns", "k0")
            if record is not None and record.ready:
                break
            await asyncio.sleep(0.005)
        second = asyncio.ensure_future(env.get(env.session(), ["k0"]))
        await asyncio.sleep(0.05)
        gate.set()  # R1's write ends: its promotion finds R1 dropped
        (loc,) = await second
        assert isinstance(loc, Location), loc
        assert env.read(loc) == new
        await env.settle()
        env.disk.close()
    run(main())


def test_a_promotion_makes_room_by_dropping_an_entry_already_on_disk(tier_dir):
    async def main():
        env = DiskEnv(tier_dir, asyncio.get_running_loop())
        env.put_five()  # k0 spills
        await env.settle()
        reader = env.session()
        (loc,) = await env.get(reader, ["k0"])  # back in memory (k1 spilled for it): its record stays
        env.store.release(reader, loc.generation)
        await env.settle()
        assert env.disk.clean(env.store.index[("ns", "k0")])
        spills = env.disk.counters["spills"]
        # k2 is the least recently used, but k0's bytes are on disk already: dropping it writes nothing
        (loc,) = await env.get(reader, ["k1"])
        assert env.read(loc) == payload("k1")
        env.store.release(reader, loc.generation)
        await env.settle()
        assert env.disk.counters["spills"] == spills
        assert env.present("k2") and not env.present("k0") and env.disk.holds("ns", "k0")
        (loc,) = await env.get(reader, ["k0"])  # and it comes back from the record it kept
        assert env.read(loc) == payload("k0")
        env.store.release(reader, loc.generation)
        await env.settle()
        env.check()
        env.disk.close()
    run(main())


def test_a_key_deleted_while_its_spill_is_written_never_reaches_the_directory(tier_dir, monkeypatch):
    """A crash right after the write finished, before the loop saw it, must not leave a record
    a restart would serve: the write sees the deletion before it renames its file into place."""
    from ecd.memory import disk as files
    release, finished = threading.Event(), threading.Event()

    def write_record(*args, **kwargs):  # held on its worker thread until the key is deleted
        assert release.wait(10)
        try:
            return real_write(*args, **kwargs)
        finally:
            finished.set()
    real_write = files.write_record
    monkeypatch.setattr(files, "write_record", write_record)

    async def main():
        env = DiskEnv(tier_dir, asyncio.get_running_loop())
        env.put_five()  # k0's spill is handed to a worker thread, held in its write
        assert env.disk.record("ns", "k0") is not None
        assert env.store.delete("ns", ["k0"]) == [True]
        release.set()
        assert finished.wait(10)  # the worker is done; the loop has not run its completion
        assert not [n for n in os.listdir(tier_dir) if n.endswith(".ecd")]  # what a crash now leaves
        await env.settle()
        assert not os.listdir(tier_dir)
        assert not env.disk.errors and not env.disk.dropped
        env.check()
        env.disk.close()
    run(main())


def test_a_delete_is_answered_once_its_record_is_removed_durably_off_the_loop(tier_dir, monkeypatch):
    calls = []
    unlink, fsync = os.unlink, os.fsync

    def record_unlink(path, *args, **kwargs):
        calls.append(("unlink", os.path.basename(path), threading.current_thread()))
        return unlink(path, *args, **kwargs)

    def record_fsync(fd):
        calls.append(("fsync", fd, threading.current_thread()))
        return fsync(fd)
    monkeypatch.setattr(os, "unlink", record_unlink)
    monkeypatch.setattr(os, "fsync", record_fsync)

    async def main():
        env = DiskEnv(tier_dir, asyncio.get_running_loop())
        env.put_five()  # k0 spills
        await env.settle()
        name = env.disk.record("ns", "k0").name
        mark = env.disk.removal_mark()
        calls.clear()
        assert env.store.delete("ns", ["k0"]) == [True]
        assert env.disk.removals_since(env.disk.removal_mark()) is None  # nothing since the last mark
        removed = env.disk.removals_since(mark)
        assert removed is not None and not removed.done()
        await asyncio.wait_for(removed, 10)
        assert not os.path.exists(os.path.join(tier_dir, name))
        loop_thread = threading.current_thread()
        (unlinked,) = [c for c in calls if c[0] == "unlink"]
        assert unlinked[1] == name and unlinked[2] is not loop_thread
        # the directory was synced after the unlink, on a worker thread too
        assert ("fsync", env.disk.dirfd, unlinked[2]) in calls[calls.index(unlinked):]
        env.check()
        env.disk.close()
    run(main())


def test_the_preference_for_entries_on_disk_looks_only_so_far_into_the_lru_order(tier_dir, monkeypatch):
    from ecd.daemon.registry import placement
    monkeypatch.setattr(placement, "CLEAN_FIRST_WALK", 2)  # k0 (on disk) is third least recently used

    async def main():
        env = DiskEnv(tier_dir, asyncio.get_running_loop())
        env.put_five()
        await env.settle()
        reader = env.session()
        (loc,) = await env.get(reader, ["k0"])
        env.store.release(reader, loc.generation)
        await env.settle()
        (loc,) = await env.get(reader, ["k1"])  # plain LRU: k2 goes (spilled), k0 stays
        env.store.release(reader, loc.generation)
        await env.settle()
        assert env.present("k0") and not env.present("k2") and env.disk.holds("ns", "k2")
        env.check()
        env.disk.close()
    run(main())


def _hold_reads(monkeypatch):
    """Make promotions' reads wait for `release`: (reading, release) events."""
    import ecd.daemon.tiers.disk as tier_mod
    real, reading, release = tier_mod.files.read_record, threading.Event(), threading.Event()

    def held_read(*args, **kwargs):
        reading.set()
        assert release.wait(10)
        return real(*args, **kwargs)
    monkeypatch.setattr(tier_mod.files, "read_record", held_read)
    return reading, release


async def _k0_promotion_held(env: DiskEnv, reading: threading.Event):
    """Spill k0 and start reading it back, its read held (_hold_reads): (its file, the get)."""
    env.put_five()  # k0 spills
    await env.settle()
    path = os.path.join(env.disk.path, env.disk.record("ns", "k0").name)
    get = asyncio.ensure_future(env.get(env.session(), ["k0"]))
    assert await asyncio.get_running_loop().run_in_executor(None, reading.wait, 10)
    return path, get


def _delete_k0(env: DiskEnv):
    """Delete k0 as a Delete request would: the future its answer waits for (removals_since)."""
    mark = env.disk.removal_mark()
    assert env.store.delete("ns", ["k0"]) == [True]
    return env.disk.removals_since(mark)


def test_a_delete_while_a_promotion_reads_the_record_waits_for_its_removal(tier_dir, monkeypatch):
    """The file of a record deleted while a promotion reads it goes only when the read ends; the
    delete must be answered only after that (a crash before must not bring the key back at the
    next start), through the same mark the handlers take (Handlers.dispatch)."""
    reading, release = _hold_reads(monkeypatch)

    async def main():
        env = DiskEnv(tier_dir, asyncio.get_running_loop())
        path, get = await _k0_promotion_held(env, reading)
        removed = _delete_k0(env)
        assert removed is not None
        await asyncio.sleep(0.1)
        assert not removed.done() and os.path.exists(path)  # the read holds the file: not answered yet
        release.set()
        await asyncio.wait_for(removed, 10)
        assert not os.path.exists(path)
        (result,) = await get
        assert isinstance(result, Failure) and result.code == Code.KEY_NOT_FOUND
        await env.settle()
        assert env.disk.removals_since(env.disk.removal_mark()) is None and not env.disk.removals_held_by_reads
        env.check()
        env.disk.close()
    run(main())


def test_a_delete_request_is_answered_only_once_a_read_record_is_removed(tier_dir, monkeypatch):
    """The same through Handlers.dispatch: the Delete's reply goes out once the file is gone."""
    from ecd.daemon.control.handlers import Handlers
    from ecd.protocol import Delete, Flags
    reading, release = _hold_reads(monkeypatch)

    async def main():
        env = DiskEnv(tier_dir, asyncio.get_running_loop())
        path, get = await _k0_promotion_held(env, reading)
        replies = []

        def send(identity, reply):
            replies.append((reply, os.path.exists(path)))

        def reply_error(*args):
            raise AssertionError(f"error reply {args}")
        handlers = Handlers(SimpleNamespace(lower_tier=env.disk, store=env.store), None, send, reply_error,
                            lambda _: None, lambda _: None)
        assert handlers.dispatch(b"client", env.session(), Delete(1, "ns", ["k0"])) is None  # answered later
        await asyncio.sleep(0.1)
        assert not replies and os.path.exists(path)
        release.set()
        for _ in range(1000):
            if replies:
                break
            await asyncio.sleep(0.005)
        assert replies == [(Flags(1, [True]), False)]  # the file was gone when the reply went out
        (result,) = await get
        assert isinstance(result, Failure) and result.code == Code.KEY_NOT_FOUND
        await env.settle()
        env.check()
        env.disk.close()
    run(main())


def test_a_shutdown_removes_a_record_deleted_while_read_and_answers_its_waiter(tier_dir, monkeypatch):
    """close() waits for the read on the worker thread; the promotion's end, which would remove
    the file, may never run after it: close() removes it and completes the delete's wait."""
    reading, release = _hold_reads(monkeypatch)

    async def main():
        env = DiskEnv(tier_dir, asyncio.get_running_loop())
        path, get = await _k0_promotion_held(env, reading)
        removed = _delete_k0(env)
        assert removed is not None and not removed.done()
        release.set()
        env.disk.close()  # the loop does not run meanwhile: the promotion has not seen its read end
        assert not os.path.exists(path)
        await asyncio.wait_for(removed, 10)
        (result,) = await asyncio.wait_for(get, 10)
        assert isinstance(result, Failure)
    run(main())


@pytest.mark.parametrize("where", ["alloc", "read"])
def test_a_bug_inside_a_promotion_leaves_no_read_count_and_no_extent(tier_dir, monkeypatch, where):
    """An unexpected exception (a bug, not a DiskIOError) while promoting costs that read only:
    the record's read count drops (a delete would otherwise wait for it until shutdown) and an
    extent already taken is given back (it is never expired while a read fills it)."""
    import ecd.daemon.tiers.disk as tier_mod

    def broken(*args, **kwargs):
        raise ValueError("a bug")

    async def main():
        env = DiskEnv(tier_dir, asyncio.get_running_loop())
        env.put_five()  # k0 spills
        await env.settle()
        if where == "alloc":
            monkeypatch.setattr(env.store, "alloc", broken)
        else:
            monkeypatch.setattr(tier_mod.files, "read_record", broken)
        (result,) = await env.get(env.session(), ["k0"])
        assert isinstance(result, Failure) and result.code == Code.INTERNAL, result
        record = env.disk.record("ns", "k0")
        assert record is not None and record.reads == 0
        assert not env.disk.session.writes  # an extent the promotion took went back (not left WRITING)
        path = os.path.join(tier_dir, record.name)
        removed = _delete_k0(env)
        assert removed is not None
        await asyncio.wait_for(removed, 10)  # answered: nothing holds the file any more
        assert not os.path.exists(path)
        env.check()
        env.disk.close()
    run(main())
