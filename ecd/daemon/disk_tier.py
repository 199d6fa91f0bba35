"""The disk tier (`[pool.disk]`): spill on eviction, promote on read, write-through for persisted
puts, and the warm restart that re-indexes it. The loop's side; the files and the blocking I/O
are ecd/memory/disk.py, which runs only on this tier's worker threads.

What it keeps: `records`, one DiskRecord per (namespace, key) whose bytes are on disk or on their
way there, in LRU order (first: least recently used), and the bytes they take (`used`, within
`[pool.disk] size`). A key's record and its host entry (Store.index) may coexist only when they
hold the same bytes: `record.generation == entry.generation` (a promoted or persisted entry); a
put that replaces a key drops its record first (Store.commit). The event ring's presence table
counts a key while it is in the index or here, so a client's exists() never answers a spilled
key "absent" (Store._unindex keeps the presence when a record stays).

Flows (each a task on the loop; disk I/O only in the executor, completions back on the loop):
- spill (Store._evict -> spill): the evicted entry's bytes are copied into the spill buffer (an
  aligned RAM staging area, so the host extent is free at once and the put that evicted it never
  waits for the disk), then written on a worker thread; the record is WRITING until then (a read
  of it waits for the write, then promotes). No room on disk (after dropping least recently used
  spilled records) or in the spill buffer: the entry is dropped as before, counted by reason.
- promote (Store.acquire/exists -> promote): one task per key however many readers ask (pull
  once): a host extent is allocated (WRITING: invisible), the record is read into it on a worker
  thread and checked (header fields, xxh3 of the bytes), and only then committed (READY, ring
  event, parked gets woken). A record that fails the check is never served: counted
  (ecd_integrity_failures_total{where="disk"}), logged, removed; the read is a clean miss.
- persist (Commit/Publish/PutInline with persist): the committed entry is leased (it stays in
  place while a worker thread writes it, fsyncs it and renames it into place); the put is answered
  once that is done, or with NOT_DURABLE saying why.
- restart (open): the directory is listed and every header read (threads); leftover `.tmp` files
  (torn writes) and records whose header or size is wrong are removed; the newest record of a key
  wins. Bytes are checked on promotion (a restart reads headers only: seconds for 10k records).
Faults (ENOSPC, EIO, EROFS, files deleted or truncated behind the daemon's back) fail the one
operation, are counted by kind and logged (the first of a kind as a warning), and the daemon
keeps serving from memory.
"""
from __future__ import annotations

import asyncio
import collections
import fcntl
import logging
import math
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..config import DiskPoolSection, format_size
from ..errors import Code, ConfigError
from ..memory import disk as files
from ..memory.allocator import ExtentAllocator
from ..memory.ring import EventKind, key_hash
from ..protocol import AllocItem, DiskStats, Extent, Failure
from .cluster import Histogram
from .entries import Entry

if TYPE_CHECKING:  # pragma: no cover
    from .store import Store

log = logging.getLogger("ecd.disk")

INTERNAL_SESSION_ID = -(1 << 40)  # the disk tier's store session (the peer plane's count down from -1)
# 1 ms .. 60 s: a write-through is one write and two fsyncs
PERSIST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Read failures that mean the record itself is bad: never served, removed. Any other kind (the
# file vanished: forgotten; EIO, EMFILE, EACCES...: kept) is not the record's fault.
INTEGRITY_KINDS = ("corrupt", "header", "truncated")
DROP_REASONS = ("too_small", "too_large", "disk_full", "backlog", "disabled", "failed")


@dataclass(slots=True, eq=False)
class DiskRecord:
    header: files.RecordHeader
    name: str  # file name in the tier's directory
    size: int  # bytes it takes on disk (counted in `used`)
    generation: int = 0  # the host entry whose bytes it holds (0: none in this run yet)
    ready: bool = False  # its file is whole (renamed into place); False while written
    written: "asyncio.Future[bool] | None" = None  # while WRITING: True once ready
    reads: int = 0  # promotions reading its file now
    dropped: bool = False  # deleted, replaced or evicted: its file goes once no one uses it
    guard: files.WriteGuard | None = None  # while WRITING: cancelled when dropped (no rename after)

    @property
    def persisted(self) -> bool:
        return self.header.persisted

    @property
    def ns(self) -> str:
        return self.header.ns

    @property
    def key(self) -> str:
        return self.header.key


class DiskTier:
    def __init__(self, config: DiskPoolSection, epoch: int) -> None:
        self.config = config
        self.path = config.path
        self.capacity = int(config.size)
        self.epoch = epoch
        self.direct = False
        self.dirfd = -1
        self.records: collections.OrderedDict[tuple[str, str], DiskRecord] = collections.OrderedDict()
        self.used = 0
        self.sequence = 0  # records this run wrote (file names)
        # promotions in flight, per key: the record each reads (a key's record may be replaced by
        # a newer one, spilled again, while an older promotion still waits on the first)
        self.promoting: dict[tuple[str, str], tuple[DiskRecord, asyncio.Task]] = {}
        self.writes = 0  # writes in flight
        self.executor: ThreadPoolExecutor | None = None
        self.staging: mmap.mmap | None = None
        self.staging_alloc: ExtentAllocator | None = None
        self.store: "Store | None" = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.segments: list[Any] = []
        self.session: Any = None
        self.counters: collections.Counter = collections.Counter()
        self.errors: collections.Counter = collections.Counter()
        self.dropped: collections.Counter = collections.Counter()
        self.persist_latency = Histogram(PERSIST_BUCKETS)
        self.loaded = 0
        self.load_s = 0.0
        # record files to remove (_remove_file): the batch waiting for a worker, the future it
        # completes, the one a worker runs now; removals_queued counts them all (removal_mark)
        self._unlinks: list[str] = []
        self._unlinks_done: "asyncio.Future[None] | None" = None
        self._unlinking: "asyncio.Future[None] | None" = None
        self.removals_queued = 0
        self._loaded: list[DiskRecord] = []

    # ---- start-up and shutdown ------------------------------------------------------------

    def open(self) -> None:
        """Check the directory, take it, and re-index what a previous run left. ConfigError
        (one line naming pool.disk and the path) when it cannot be used; nothing is created."""
        path = self.path
        if not os.path.isdir(path):
            raise ConfigError(f"pool.disk.path: {path} is not a directory (create it on a local filesystem)")
        try:
            direct = files.probe_direct_io(path)
        except OSError as exc:
            raise ConfigError(f"pool.disk.path: {path} is not writable ({exc.strerror})") from None
        if self.config.direct_io is True and not direct:
            raise ConfigError(f"pool.disk.direct_io: the filesystem of {path} does not support O_DIRECT "
                              "(tmpfs?): use a local disk, or direct_io = \"auto\" or false")
        self.direct = direct and self.config.direct_io is not False
        if not direct and self.config.direct_io == "auto":
            log.warning("pool.disk: the filesystem of %s does not support O_DIRECT: using buffered I/O", path)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # one daemon per directory
        except OSError:
            os.close(fd)
            raise ConfigError(f"pool.disk.path: {path} is in use by another ecd daemon") from None
        self.dirfd = fd
        try:
            self._reindex()
            vfs = os.statvfs(path)
            room = vfs.f_bavail * vfs.f_frsize + self.used
            if room < self.capacity:
                raise ConfigError(f"pool.disk.size: {path} has room for {format_size(room)} ({room} bytes, "
                                  f"its records included), pool.disk.size is {format_size(self.capacity)}: "
                                  "shrink it or free space")
        except BaseException:
            self.close()
            raise
        self.executor = ThreadPoolExecutor(self.config.io_threads, thread_name_prefix="ecd-disk")
        size = int(self.config.spill_buffer)
        # faulted in now: a first spill touching fresh pages took ~10 ms per 16 MiB on the loop
        self.staging = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
        self.staging_alloc = ExtentAllocator(size)

    def _reindex(self) -> None:
        started = time.monotonic()
        names, temps = files.list_directory(self.path)
        for name in temps:  # a crash mid-write: the record it was writing never existed
            files.remove(self.path, name)
        if temps:
            log.info("pool.disk: removed %d unfinished write(s) of a previous run", len(temps))
        newest: dict[tuple[str, str], DiskRecord] = {}
        with ThreadPoolExecutor(8, thread_name_prefix="ecd-disk-scan") as pool:
            scanned = files.scan(self.path, names, pool)
        for name, header, size in scanned:
            if isinstance(header, files.DiskIOError):
                if header.kind not in INTEGRITY_KINDS:  # unreadable now (permissions, EIO): left alone
                    self._count_error(header, f"not re-indexing {name}")
                    continue
                self.counters["integrity_failures"] += 1
                log.error("pool.disk: removing %s at start: %s", name, header)
                files.remove(self.path, name)
                continue
            record = DiskRecord(header, name, size, ready=True)
            k = (header.ns, header.key)
            other = newest.get(k)
            if other is not None:  # two records of one key: a crash between a write and a removal
                older, record = sorted((other, record), key=lambda r: (r.header.epoch, r.header.sequence))
                files.remove(self.path, older.name)
            newest[k] = record
            # (epoch, sequence) orders a key's records: this run's must come after every one on
            # disk even if the wall clock (the epoch's source) stepped back since
            self.epoch = max(self.epoch, header.epoch + 1)
        # least recently written first: the LRU order a restart can know
        for record in sorted(newest.values(), key=lambda r: r.header.written_ns):
            if self.used + record.size > self.capacity and not record.persisted:
                files.remove(self.path, record.name)  # the budget shrank: oldest spills go first
                continue
            self.records[(record.header.ns, record.header.key)] = record
            self.used += record.size
        self.loaded = len(self.records)
        self.load_s = time.monotonic() - started
        if names:
            log.info("pool.disk: re-indexed %d record(s), %s, in %.3fs", self.loaded, format_size(self.used),
                     self.load_s)

    def attach(self, store: "Store", loop: asyncio.AbstractEventLoop, segments: list[Any]) -> None:
        """Serve: the store consults this tier from now on; re-indexed keys become present."""
        self.store, self.loop, self.segments = store, loop, segments
        self.session = store.open_session(INTERNAL_SESSION_ID, 0)
        self.session.watched = True  # the daemon itself: a forced eviction must not revoke its leases
        store.disk = self
        for (ns, key) in self.records:
            store.ring.publish(key_hash(ns, key), 0)

    def close(self) -> None:
        """Wait for the worker threads (they read and write the pools: before those are unmapped)."""
        if self.executor is not None:
            self.executor.shutdown(wait=True)  # queued work finishes: it holds no lease to lose
            self.executor = None
        if self._unlinks and self.dirfd >= 0:  # removals no worker took: done here, before exit
            files.remove_durably(self.path, self.dirfd, self._unlinks)
            self._unlinks = []
        if self.dirfd >= 0:
            os.close(self.dirfd)
            self.dirfd = -1

    @property
    def internal_sessions(self) -> int:
        return 1 if self.session is not None else 0

    # ---- what the store asks --------------------------------------------------------------

    def holds(self, ns: str, key: str) -> bool:
        return (ns, key) in self.records

    def record(self, ns: str, key: str) -> DiskRecord | None:
        return self.records.get((ns, key))

    def clean(self, entry: Entry) -> bool:
        """Whether `entry`'s bytes are in a whole record already (promoted or persisted): evicting
        it writes nothing."""
        record = self.records.get((entry.ns, entry.key))
        return record is not None and record.generation == entry.generation and record.ready

    def touch(self, ns: str, key: str) -> None:
        if (ns, key) in self.records:
            self.records.move_to_end((ns, key))

    def drop(self, ns: str, key: str, kind: EventKind = EventKind.DELETED) -> bool:
        """Forget the key's record (delete, replacement, operator eviction); its file goes."""
        record = self.records.get((ns, key))
        if record is None:
            return False
        self._forget(record, kind)
        return True

    def _forget(self, record: DiskRecord, kind: EventKind) -> None:
        header = record.header
        del self.records[(header.ns, header.key)]
        self.used -= record.size
        record.dropped = True
        assert self.store is not None
        if (header.ns, header.key) not in self.store.index:  # the record held the key's presence
            self.store.ring.unpublish(kind, key_hash(header.ns, header.key), 0)
        if record.ready and not record.reads:
            self._remove_file(record)
        elif record.guard is not None and record.guard.cancel():
            self._remove_file(record)  # renamed into place, its completion not seen yet: goes now

    def _remove_file(self, record: DiskRecord) -> None:
        """Unlink on a worker thread (an unlink of a large file frees its extents: not for the
        loop), in batches each ending with one fsync of the directory. A request whose answer
        promises the file is gone (Delete, Evict) waits for it: removals_since()."""
        assert self.loop is not None
        self.removals_queued += 1
        self._unlinks.append(record.name)
        if self._unlinks_done is None:
            self._unlinks_done = self.loop.create_future()
        if not self._unlinking:
            self._next_removals()

    def removal_mark(self) -> int:
        return self.removals_queued

    def removals_since(self, mark: int) -> "asyncio.Future[None] | None":
        """A future done once every removal queued since `mark` (removal_mark()) is on disk, or
        None when there was none."""
        if mark == self.removals_queued:
            return None
        latest = self._unlinks_done or self._unlinking  # its batch waits for a worker, or runs
        return None if latest is None else asyncio.shield(latest)

    def _next_removals(self) -> None:
        assert self.loop is not None
        names, done = self._unlinks, self._unlinks_done
        self._unlinks, self._unlinks_done = [], None
        if not names or done is None:
            self._unlinking = None
            return
        self._unlinking = done
        try:
            work: asyncio.Future = self.loop.run_in_executor(self.executor, files.remove_durably, self.path,
                                                             self.dirfd, names)
        except RuntimeError:  # the executor shut down: close() removes what is left
            self._unlinks[:0] = names
            self._unlinking = None
            done.set_result(None)
            return

        def finished(work: asyncio.Future) -> None:
            errors = [] if work.cancelled() else ([files.DiskIOError("internal", repr(work.exception()))]
                                                  if work.exception() is not None else work.result())
            for error in errors:
                self._count_error(error, "removing a record")
            if not done.done():
                done.set_result(None)
            self._next_removals()
        work.add_done_callback(finished)

    def _make_room(self, size: int) -> bool:
        """Drop least recently used spilled (not persisted) records until `size` more bytes fit."""
        if self.used + size <= self.capacity:
            return True
        victims, freeing = [], 0
        for record in self.records.values():  # least recently used first
            if record.ready and not record.reads and not record.persisted:
                victims.append(record)
                freeing += record.size
                if self.used - freeing + size <= self.capacity:
                    break
        if self.used - freeing + size > self.capacity:
            return False
        for record in victims:
            self._forget(record, EventKind.EVICTED)
            self.counters["disk_evictions"] += 1
        return True

    def _header(self, entry: Entry, persisted: bool) -> files.RecordHeader:
        self.sequence += 1
        return files.RecordHeader(entry.ns, entry.key, entry.dtype, tuple(entry.shape), entry.nbytes, entry.checksum,
                                  self.epoch, self.sequence, time.time_ns(), persisted)

    # ---- spill ----------------------------------------------------------------------------

    def spill(self, entry: Entry) -> None:
        """Store._evict: `entry` leaves the host pool now. Keep its bytes on disk if they fit."""
        assert self.store is not None and self.staging is not None and self.staging_alloc is not None
        k = (entry.ns, entry.key)
        record = self.records.get(k)
        if record is not None and record.generation == entry.generation:
            return  # its bytes are on disk already (promoted or persisted): nothing to write
        if record is not None:  # cannot be (a put drops the old record), but never serve stale bytes
            self._forget(record, EventKind.DELETED)
        if not self.config.spill:
            self.dropped["disabled"] += 1
            return
        if entry.pool not in self.store.host_pools:
            return  # CUDA arena entries are not spilled
        if entry.nbytes < self.config.min_spill_size:
            self.dropped["too_small"] += 1
            return
        size = files.record_size(entry.ns, entry.key, entry.dtype, len(entry.shape), entry.nbytes)
        if size > self.capacity:
            self.dropped["too_large"] += 1
            return
        staged_size = max(files.padded(entry.nbytes), files.HEADER_UNIT)  # whole blocks: O_DIRECT-aligned
        staged = self.staging_alloc.alloc(staged_size)
        if staged is None:
            self.dropped["backlog"] += 1  # the disk is slower than evictions: drop rather than block
            return
        if not self._make_room(size):
            self.staging_alloc.free_extent(staged, staged_size)
            self.dropped["disk_full"] += 1
            return
        # A memcpy on the loop (~1 ms per 16 MiB), so the put that evicted this entry gets its
        # extent now; the write itself runs on a worker thread.
        with memoryview(self.segments[entry.pool].buf) as seg, memoryview(self.staging) as stage:
            stage[staged:staged + entry.nbytes] = seg[entry.offset:entry.offset + entry.nbytes]
        header = self._header(entry, persisted=False)
        record = DiskRecord(header, files.header_record_name(header), size, generation=entry.generation,
                            guard=files.WriteGuard())
        self._start_write(record, staged, staged_size, entry.checksum)

    def _start_write(self, record: DiskRecord, staged: int, staged_size: int, expect: int) -> None:
        assert self.loop is not None and self.staging is not None
        header = record.header
        self.records[(header.ns, header.key)] = record
        self.used += record.size
        record.written = self.loop.create_future()
        self.writes += 1
        # handed to a worker thread now, not from a task's first step: the loop may first serve a
        # batch of requests, and the disk would sit idle meanwhile
        view = memoryview(self.staging)[staged:staged + header.nbytes]
        try:
            write: asyncio.Future | BaseException = self.loop.run_in_executor(
                self.executor, files.write_record, self.path, self.dirfd, header, view, self.direct, False, expect,
                record.guard)
        except RuntimeError as exc:  # the executor shut down: the daemon is stopping
            write = exc
        self.loop.create_task(self._spill_write(record, write, view, staged, staged_size))

    async def _spill_write(self, record: DiskRecord, write: "asyncio.Future[str] | BaseException", view: memoryview,
                           staged: int, staged_size: int) -> None:
        assert self.staging_alloc is not None
        error: files.DiskIOError | None = None
        try:
            if isinstance(write, BaseException):
                raise write
            await write
        except files.DiskIOError as exc:
            error = exc
        except RuntimeError as exc:  # the executor shut down: the daemon is stopping
            error = files.DiskIOError("shutdown", str(exc))
        except Exception as exc:  # a bug: the write failed, its waiters are answered all the same
            log.exception("pool.disk: spill of %r failed", record.header.key)
            error = files.DiskIOError("internal", f"{type(exc).__name__}: {exc}")
        finally:
            view.release()
            self.staging_alloc.free_extent(staged, staged_size)
            self.writes -= 1
        self._write_done(record, error, "spill")

    def _write_done(self, record: DiskRecord, error: files.DiskIOError | None, what: str) -> None:
        written = record.written
        record.written = record.guard = None
        if error is not None and error.kind == "cancelled":
            pass  # dropped while written (_forget): nothing was kept, nothing failed
        elif error is None:
            record.ready = True
            self.counters["spills" if what == "spill" else "persisted"] += 1
            if record.dropped:  # deleted or replaced while it was written
                self._remove_file(record)
        else:
            self._count_error(error, f"{what} of {record.header.key!r} failed")
            if what == "spill":
                self.dropped["failed"] += 1
            if not record.dropped:
                self._forget(record, EventKind.EVICTED)
        if written is not None and not written.done():
            written.set_result(error is None)

    # ---- promote --------------------------------------------------------------------------

    def promote(self, ns: str, key: str) -> bool:
        """Start reading the key's record back into the host pool (once, however many ask).
        False when there is no record."""
        assert self.loop is not None
        k = (ns, key)
        record = self.records.get(k)
        running = self.promoting.get(k)
        if running is not None and (record is None or running[0] is record):
            return True  # its end answers the waiters (a dropped record's: a miss)
        if record is None:
            return False
        self.records.move_to_end(k)
        self.promoting[k] = (record, self.loop.create_task(self._promote(record)))
        return True

    async def _promote(self, record: DiskRecord) -> None:
        header = record.header
        k = (header.ns, header.key)
        try:
            failure = await self._promote_once(record)
        except Exception as exc:  # a bug must cost this read, not leave the readers parked
            log.exception("promotion of %r failed", header.key)
            failure = Failure(Code.INTERNAL, f"reading {header.key!r} from the disk tier failed: {exc!r}")
        finally:
            if self.promoting.get(k, (None,))[0] is record:
                del self.promoting[k]
        assert self.store is not None
        if failure is not None:
            self.counters["promotion_failures"] += 1
            if k not in self.promoting:  # else a newer record's promotion answers the waiters
                self.store.promotion_failed(header.ns, header.key, failure)

    async def _promote_once(self, record: DiskRecord) -> Failure | None:
        store, loop, header = self.store, self.loop, record.header
        assert store is not None and loop is not None
        missing = Failure(Code.KEY_NOT_FOUND, f"no entry {header.key!r} in namespace {header.ns!r}")
        if record.written is not None and not await asyncio.shield(record.written):
            return missing  # its spill failed
        if record.dropped:
            return missing
        if (header.ns, header.key) in store.index:
            return None
        # counted as read from here: the allocation below may evict entries whose spills make
        # room on disk, and this record must not be the room they make
        record.reads += 1
        extent = store.alloc(self.session, header.ns, AllocItem(header.key, header.dtype, list(header.shape),
                                                                header.nbytes), clean_first=True)
        if not isinstance(extent, Extent):
            record.reads -= 1
            if record.dropped and not record.reads:
                self._remove_file(record)
            return Failure(extent.code, f"{header.key!r} is on disk but cannot come back into the host pool: "
                                        f"{extent.message}")
        entry = store.by_generation[extent.generation]
        entry.when = math.inf  # its write deadline: never expired while a worker thread fills it
        error: files.DiskIOError | None = None
        try:
            with memoryview(self.segments[entry.pool].buf) as seg:
                dst = seg[entry.offset:entry.offset + header.nbytes]
                try:
                    await loop.run_in_executor(self.executor, files.read_record, self.path, record.name, header,
                                               dst, self.direct)
                except files.DiskIOError as exc:
                    error = exc
                except RuntimeError as exc:  # executor shut down
                    error = files.DiskIOError("shutdown", str(exc))
                finally:
                    dst.release()
        finally:
            record.reads -= 1
        if error is not None or record.dropped or (header.ns, header.key) in store.index:
            store.abort(self.session, extent.generation)
            if record.dropped and not record.reads:
                self._remove_file(record)
            if error is None:
                return None if (header.ns, header.key) in store.index else missing
            self._read_failed(record, error)
            return missing
        record.generation = extent.generation
        failure = store.commit(self.session, extent.generation, header.checksum)
        if failure is None:
            self.counters["promotions"] += 1
            self.counters["promoted_bytes"] += header.nbytes
        return failure

    def _read_failed(self, record: DiskRecord, error: files.DiskIOError) -> None:
        """A record whose bytes or header fail their check, or whose file is gone, is dropped; one
        that could not be read for another reason (EIO, EMFILE, EACCES...) is kept: this read
        is a miss, a later one may succeed, and an acknowledged persist is never deleted for it."""
        header = record.header
        if error.kind in INTEGRITY_KINDS:
            # never served: counted, logged (once: the record goes now), removed
            self.counters["integrity_failures"] += 1
            log.error("pool.disk: %r in namespace %r failed its check and is removed: %s", header.key, header.ns, error)
        else:
            self._count_error(error, f"reading {header.key!r} failed")
            if error.kind != "missing":
                return
        if not record.dropped:
            self._forget(record, EventKind.EVICTED)

    def _count_error(self, error: files.DiskIOError, what: str) -> None:
        self.errors[error.kind] += 1
        first = self.errors[error.kind] == 1
        log.log(logging.WARNING if first else logging.DEBUG, "pool.disk: %s: %s%s", what, error,
                " (further errors of this kind are logged at debug level)" if first else "")

    # ---- persist --------------------------------------------------------------------------

    def persist(self, entries: list[Entry | None]) -> "asyncio.Future[list[Failure | None]]":
        """Write committed entries through to disk, durably: per entry None once it is (or was
        already), else NOT_DURABLE saying why. `None` in `entries`: an item whose commit failed
        (its failure stands). Each entry is leased here, synchronously, before anything else can
        replace or delete it; the writes run on worker threads."""
        assert self.loop is not None
        started = time.monotonic()
        # every write starts now (they run side by side), and each is awaited to its end whatever
        # another one raised: none may be left holding its lease
        steps = [self._begin_persist(e) if e is not None else None for e in entries]
        running = [self.loop.create_task(step) if asyncio.iscoroutine(step) else step for step in steps]

        async def finish() -> list[Failure | None]:
            results: list[Failure | None] = []
            for step in running:
                if not isinstance(step, asyncio.Task):
                    results.append(step)
                    continue
                try:
                    results.append(await step)
                except Exception as exc:  # a bug must cost this put its durability, nothing more
                    log.exception("pool.disk: persist failed")
                    results.append(Failure(Code.NOT_DURABLE, f"not persisted: {type(exc).__name__}: {exc}"))
            self.persist_latency.observe(time.monotonic() - started)
            return results
        return asyncio.ensure_future(finish(), loop=self.loop)

    def _begin_persist(self, entry: Entry) -> Any:
        store, loop = self.store, self.loop
        assert store is not None and loop is not None
        k = (entry.ns, entry.key)
        if entry.pool not in store.host_pools:
            return Failure(Code.INVALID, f"{entry.key!r} is in a CUDA arena: persist is for host-pool entries")
        record = self.records.get(k)
        if record is not None and record.generation == entry.generation and record.persisted:
            return self._await_written(record)
        if record is not None:  # a spilled copy of the same bytes, not durable: written again
            self._forget(record, EventKind.DELETED)
        size = files.record_size(entry.ns, entry.key, entry.dtype, len(entry.shape), entry.nbytes)
        if not self._make_room(size):
            self.errors["full"] += 1
            return Failure(Code.NOT_DURABLE, f"{entry.key!r} stored in memory but not persisted: the disk tier "
                                             f"({self.path}) holds {self.used} of {self.capacity} bytes in "
                                             f"records it may not drop, {size} more needed")
        # Leased while a worker thread writes it from the pool: it cannot be evicted or recycled.
        session = self.session
        session.leases[entry.generation] += 1
        entry.readers += 1
        store._make_unevictable(entry)
        header = self._header(entry, persisted=True)
        record = DiskRecord(header, files.header_record_name(header), size, generation=entry.generation,
                            guard=files.WriteGuard())
        self.records[k] = record
        self.used += size
        record.written = loop.create_future()
        self.writes += 1
        return self._persist_write(entry, record)

    async def _await_written(self, record: DiskRecord) -> Failure | None:
        if record.written is None or await asyncio.shield(record.written):
            return None
        return Failure(Code.NOT_DURABLE, f"{record.header.key!r} stored in memory but not persisted: its write failed")

    async def _persist_write(self, entry: Entry, record: DiskRecord) -> Failure | None:
        store, loop = self.store, self.loop
        assert store is not None and loop is not None
        error: files.DiskIOError | None = None
        try:
            with memoryview(self.segments[entry.pool].buf) as seg:
                src = seg[entry.offset:entry.offset + entry.nbytes]
                try:
                    await loop.run_in_executor(self.executor, files.write_record, self.path, self.dirfd, record.header,
                                               src, self.direct, True, entry.checksum, record.guard)
                except files.DiskIOError as exc:
                    error = exc
                except RuntimeError as exc:
                    error = files.DiskIOError("shutdown", str(exc))
                except Exception as exc:  # a bug: not durable, and the lease still goes back below
                    log.exception("pool.disk: persist of %r failed", entry.key)
                    error = files.DiskIOError("internal", f"{type(exc).__name__}: {exc}")
                finally:
                    src.release()
        finally:
            self.writes -= 1
            store.release(self.session, entry.generation)
        self._write_done(record, error, "persist")
        if error is not None:
            return Failure(Code.NOT_DURABLE, f"{entry.key!r} stored in memory but not persisted: {error}")
        return None

    # ---- introspection --------------------------------------------------------------------

    def stats(self) -> DiskStats:
        staged = self.staging_alloc.used if self.staging_alloc is not None else 0
        return DiskStats(self.path, self.direct, self.capacity, self.used, len(self.records),
                         sum(1 for r in self.records.values() if r.persisted), self.counters["spills"],
                         self.counters["promotions"], self.writes, staged, self.counters["integrity_failures"],
                         dict(self.errors), dict(self.dropped), self.loaded, self.load_s)
