"""Write-through (`put(persist=True)`): DiskTier's persist flow (ecd/daemon/tiers/disk.py describes
it; the record set is disk_records.py)."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ...errors import Code
from ...memory import disk as files
from ...memory.ring import EventKind
from ...protocol import Failure
from .disk_records import DiskRecord, DiskRecords
from ..registry.entries import Entry

log = logging.getLogger("ecd.disk")


class Persist(DiskRecords):
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
        if entry.pool not in store.host.host_pools:
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
        store.placement.make_unevictable(entry)
        header = self._header(entry, persisted=True)
        record = DiskRecord(header, files.header_record_name(header), size, generation=entry.generation,
                            guard=files.WriteGuard(), meta=entry.meta)
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

