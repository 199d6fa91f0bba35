"""Spill on eviction and promotion on read: DiskTier's flows between the host pool and its records
(ecd/daemon/tiers/disk.py describes them; the record set is disk_records.py)."""
from __future__ import annotations

import asyncio
import logging
import math

from ...errors import Code
from ...memory import disk as files
from ...memory.ring import EventKind
from ...protocol import AllocItem, Extent, Failure
from .disk_records import INTEGRITY_KINDS, DiskRecord, DiskRecords
from ..registry.entries import Entry

log = logging.getLogger("ecd.disk")


class SpillPromote(DiskRecords):
    # ---- spill ----------------------------------------------------------------------------

    def spill(self, entry: Entry) -> None:
        """Placement.evict: `entry` leaves the host pool now. Keep its bytes on disk if they fit."""
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
        if entry.pool not in self.store.host.host_pools:
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
        # A copy on the loop (~1 ms per 16 MiB), so the put that evicted this entry gets its
        # extent now; the write itself runs on a worker thread. pread from the pool file, not the
        # mapping: a file another process truncated gives a short count, not SIGBUS.
        with memoryview(self.staging) as stage:
            copied = self.segments[entry.pool].read_into(entry.offset, stage[staged:staged + entry.nbytes])
        if copied < entry.nbytes:  # its bytes are gone: never written as the key's value
            self.staging_alloc.free_extent(staged, staged_size)
            self.dropped["failed"] += 1
            log.error("pool.disk: %r not spilled: host pool segment %d was truncated by another process",
                      entry.key, entry.pool)
            return
        header = self._header(entry, persisted=False)
        record = DiskRecord(header, files.header_record_name(header), size, generation=entry.generation,
                            guard=files.WriteGuard(), meta=entry.meta)
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
                self.store.waiting.promotion_failed(header.ns, header.key, failure)

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
        try:
            extent = store.alloc(self.session, header.ns, AllocItem(header.key, header.dtype, list(header.shape),
                                                                    header.nbytes), clean_first=True)
        except BaseException:  # a bug: the read count must not stay up (a delete would wait for it)
            self._end_read(record)
            raise
        if not isinstance(extent, Extent):
            self._end_read(record)
            return Failure(extent.code, f"{header.key!r} is on disk but cannot come back into the host pool: "
                                        f"{extent.message}")
        entry = store.by_generation[extent.generation]
        entry.meta = record.meta  # published with it again (KV events)
        entry.when = math.inf  # its write deadline: never expired while a worker thread fills it
        store.host.check_pool(entry.pool)  # a truncated pool file is restored before a worker writes into it
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
        except BaseException:  # a bug: the extent, never to expire (when = inf), goes back now
            store.abort(self.session, extent.generation)
            raise
        finally:
            self._end_read(record)
        if error is not None or record.dropped or (header.ns, header.key) in store.index:
            store.abort(self.session, extent.generation)
            if error is None:
                return None if (header.ns, header.key) in store.index else missing
            self._read_failed(record, error)
            return missing
        store.host.check_pool(entry.pool)
        if store.host.cut_writes.pop(extent.generation, None) is not None:
            store.abort(self.session, extent.generation)  # the record stays: the next read tries again
            return Failure(Code.CORRUPT, f"{header.key!r} was read back from disk into host pool segment "
                                         f"{entry.pool}, which another process truncated meanwhile: read it again")
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

