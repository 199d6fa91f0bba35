"""The disk tier's record set (ecd/daemon/tiers/disk.py says what the tier does): one DiskRecord
per key on disk, in LRU order within the byte budget, and what every flow does to it: look a key
up, drop it (its file removed on a worker thread, durably), make room by dropping least recently
used spills, finish a write; and the LowerTier questions (tiers/base.py) the store asks of it. The
flows themselves are mixins over this state: spill and promote (disk_spill.py), write-through
(disk_persist.py); start-up, re-indexing and shutdown are disk.DiskTier's."""
from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...config import DiskPoolSection
from ...memory import disk as files
from ...memory.allocator import ExtentAllocator
from ...memory.ring import EventKind, key_hash
from ..ops.histogram import Histogram
from .disk_health import DiskHealth
from ..registry.entries import Entry

if TYPE_CHECKING:  # pragma: no cover
    import mmap

    from ..registry.store import Store

log = logging.getLogger("ecd.disk")

INTERNAL_SESSION_ID = -(1 << 40)  # the disk tier's store session (the peer plane's count down from -1)
# 1 ms .. 60 s: a write-through is one write and two fsyncs
PERSIST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Read failures that mean the record itself is bad: never served, removed. Any other kind (the
# file vanished: forgotten; EIO, EMFILE, EACCES...: kept) is not the record's fault.
INTEGRITY_KINDS = ("corrupt", "header", "truncated")
# Why an evicted entry was not spilled (DiskRecords.dropped; ecd_disk_spills_dropped_total's reasons).
SPILL_DROP_REASONS = ("too_small", "too_large", "disk_full", "backlog", "disabled", "failed")


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
    meta: Any = None  # the entry's EntryMeta, kept in memory for KV events (not in the file)

    @property
    def persisted(self) -> bool:
        return self.header.persisted

    @property
    def ns(self) -> str:
        return self.header.ns

    @property
    def key(self) -> str:
        return self.header.key


class DiskRecords:
    def __init__(self, config: DiskPoolSection, epoch: int) -> None:
        self.config = config
        self.path = config.path
        self.capacity = int(config.size)
        self.epoch = epoch
        self.direct = False
        self._direct_known = True  # False: started degraded, O_DIRECT not probed yet (buffered meanwhile)
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
        self.health = DiskHealth(self.path)  # degraded while the filesystem refuses writes
        # record files to remove (_remove_file): the batch waiting for a worker, the future it
        # completes, the one a worker runs now; removals_queued counts them all (removal_mark),
        # and the removals that wait for a promotion's read to end (_remove_after_reads): each
        # record's number in that count and the future done once its file is gone durably
        self._unlinks: list[str] = []
        self._unlinks_done: "asyncio.Future[None] | None" = None
        self._unlinking: "asyncio.Future[None] | None" = None
        self.removals_queued = 0
        self._removals_after_reads: dict[DiskRecord, tuple[int, "asyncio.Future[None]"]] = {}
        self._loaded: list[DiskRecord] = []
        # record files the re-index or a removal could not remove (a read-only filesystem):
        # removed once the tier takes writes again (DiskTier._recovered)
        self._unremoved: list[str] = []

    # ---- what the store asks (tiers/base.LowerTier) ---------------------------------------

    persists = True  # put(persist=True) is written through here

    def holds(self, ns: str, key: str) -> bool:
        return (ns, key) in self.records

    def listing(self, ns: str | None = None) -> list[DiskRecord]:
        return [r for r in self.records.values() if ns is None or r.header.ns == ns]

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

    def replaced(self, entry: Entry) -> None:
        """Store.commit: a record of the key's older bytes goes (they must never be served)."""
        record = self.records.get((entry.ns, entry.key))
        if record is not None and record.generation != entry.generation:
            self._forget(record, EventKind.DELETED)

    def cut(self, entry: Entry) -> None:
        """A pool truncation took `entry`'s bytes (Store.drop_cut): a record of them still being
        written from the pool (persist) may have read zeros and goes; a whole one keeps the key."""
        record = self.records.get((entry.ns, entry.key))
        if record is not None and record.generation == entry.generation and not record.ready:
            self._forget(record, EventKind.EVICTED)

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
            self.store.announcer.ring_of(header.ns).unpublish(kind, key_hash(header.ns, header.key), 0)
        if record.ready:
            self.store.announcer.disk_removed(header.ns, header.key, record.meta)
        if record.ready and record.reads:
            self._remove_after_reads(record)
        elif record.ready:
            self._remove_file(record)
        elif record.guard is not None and record.guard.cancel():
            self._remove_file(record)  # renamed into place, its completion not seen yet: goes now
        # else still written: cancelled before its rename, so its file never gets its name (a
        # crash leaves a temporary file at most, which the next start removes)

    def _remove_after_reads(self, record: DiskRecord) -> None:
        """A record dropped while promotions read it keeps its file until the last read ends
        (_end_read then calls _remove_file). Counted as queued now all the same, so the request
        that dropped it is answered only once that file is gone too (removals_since): a crash
        before then must not leave a file that a restart would serve again."""
        assert self.loop is not None
        self.removals_queued += 1
        self._removals_after_reads[record] = (self.removals_queued, self.loop.create_future())

    def _end_read(self, record: DiskRecord) -> None:
        """A promotion's read of `record` ended: the file of a record dropped meanwhile goes now."""
        record.reads -= 1
        if record.dropped and not record.reads:
            self._remove_file(record)

    def _remove_file(self, record: DiskRecord) -> None:
        """Unlink on a worker thread (an unlink of a large file frees its extents: not for the
        loop), in batches each ending with one fsync of the directory. A request whose answer
        promises the file is gone (Delete, Evict, a replacing put) waits for it: removals_since().
        A removal that waited for reads (_remove_after_reads) was counted then, and its future
        completes with the batch it joins here."""
        assert self.loop is not None
        deferred = self._removals_after_reads.pop(record, None)
        if deferred is None:
            self.removals_queued += 1
        self._unlinks.append(record.name)
        if self._unlinks_done is None:
            self._unlinks_done = self.loop.create_future()
        if deferred is not None:
            self._unlinks_done.add_done_callback(functools.partial(mark_done, deferred[1]))
        if not self._unlinking:
            self._next_removals()

    @property
    def removals_held_by_reads(self) -> int:
        """Dropped records whose files wait for a promotion's read to end (_remove_after_reads)."""
        return len(self._removals_after_reads)

    def removal_mark(self) -> int:
        return self.removals_queued

    def removals_since(self, mark: int) -> "asyncio.Future[None] | None":
        """A future done once every removal queued since `mark` (removal_mark()) is on disk, or
        None when there was none: the latest unlink batch (batches run one after the other, so
        it ends after every earlier one) and the removals still waiting for a read to end."""
        if mark == self.removals_queued:
            return None
        waits = [removal for number, removal in self._removals_after_reads.values() if number > mark]
        latest = self._unlinks_done or self._unlinking  # its batch waits for a worker, or runs
        if latest is not None:
            waits.append(latest)
        if not waits:
            return None
        if len(waits) == 1:
            return asyncio.shield(waits[0])

        async def all_done() -> None:
            for wait in waits:  # shielded: a waiter that gives up cancels none of them
                await asyncio.shield(wait)
        return asyncio.ensure_future(all_done(), loop=self.loop)

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
            errors = [] if work.cancelled() else ([("", files.DiskIOError("internal", repr(work.exception())))]
                                                  if work.exception() is not None else work.result())
            for name, error in errors:
                self._count_error(error, "removing a record")
                if name and error.kind == "readonly":  # a restart would index it again: retried on recovery
                    self._unremoved.append(name)
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
            elif self.store is not None:
                self.store.announcer.disk_stored(record.header.ns, record.header.key, record.meta)
        else:
            self._count_error(error, f"{what} of {record.header.key!r} failed")
            if what == "spill":
                self.dropped["failed"] += 1
            if not record.dropped:
                self._forget(record, EventKind.EVICTED)
        if written is not None and not written.done():
            written.set_result(error is None)

    def _count_error(self, error: files.DiskIOError, what: str) -> None:
        self.errors[error.kind] += 1
        first = self.errors[error.kind] == 1
        log.log(logging.WARNING if first else logging.DEBUG, "pool.disk: %s: %s%s", what, error,
                " (further errors of this kind are logged at debug level)" if first else "")
        self.health.failed(error)  # full or read-only: the tier is degraded until a probe write succeeds


def mark_done(future: "asyncio.Future[None]", _: object = None) -> None:
    """Complete a removal's future (also as a done callback of the batch it joined): once only,
    and not on a loop already closed (close() may run after the loop ended)."""
    if not future.done() and not future.get_loop().is_closed():
        future.set_result(None)
