"""The disk tier (`[pool.disk]`): spill on eviction, promote on read, write-through for persisted
puts, and the warm restart that re-indexes it. The loop's side; the files and the blocking I/O
are ecd/memory/disk.py, which runs only on this tier's worker threads. By job: the record set and
what every flow does to it (disk_records.py), spill and promote (disk_spill.py), write-through
(disk_persist.py), whether the filesystem takes writes (disk_health.py); start-up, re-index,
shutdown and stats here.

What it keeps: `records`, one DiskRecord per (namespace, key) whose bytes are on disk or on their
way there, in LRU order (first: least recently used), and the bytes they take (`used`, within
`[pool.disk] size`). A key's record and its host entry (Store.index) may coexist only when they
hold the same bytes: `record.generation == entry.generation` (a promoted or persisted entry); a
put that replaces a key drops its record first (Store.commit -> replaced). The event ring's presence table
counts a key while it is in the index or here, so a client's exists() never answers a spilled
key "absent" (Store.unindex keeps the presence when a record stays).

Flows (each a task on the loop; disk I/O only in the executor, completions back on the loop):
- spill (Placement.evict -> spill): the evicted entry's bytes are copied into the spill buffer (an
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
keeps serving from memory. A full or read-only filesystem also marks the tier degraded until a
probe write succeeds (disk_health.py); met at start, it is no reason not to start (a restart
after a crash must not stay down because another program filled the disk: exit 2 is never
retried by systemd): the records are re-indexed and served.
"""
from __future__ import annotations

import asyncio
import fcntl
import logging
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Iterator

from ...config_types import format_size
from ...errors import ConfigError
from ...memory import disk as files
from ...memory.allocator import ExtentAllocator
from ...memory.ring import key_hash
from ...protocol import DiskStats
from .disk_health import DEGRADING_KINDS
from .disk_metrics import disk_metrics
from .disk_persist import Persist
from .disk_records import INTEGRITY_KINDS, INTERNAL_SESSION_ID, SPILL_DROP_REASONS, DiskRecord, mark_done
from .disk_spill import SpillPromote

if TYPE_CHECKING:  # pragma: no cover
    from ..registry.store import Store

log = logging.getLogger("ecd.disk")

__all__ = ["INTERNAL_SESSION_ID", "SPILL_DROP_REASONS", "DiskRecord", "DiskTier"]


class DiskTier(SpillPromote, Persist):
    """The tier: its state and record set (disk_records.DiskRecords), spill and promotion
    (disk_spill), write-through (disk_persist); here its start (checks, re-index), attachment to
    the store, shutdown and stats."""

    # ---- start-up and shutdown ------------------------------------------------------------

    def open(self) -> None:
        """Check the directory, take it, and re-index what a previous run left. ConfigError
        (one line naming pool.disk and the path) when it cannot be used; nothing is created. A
        filesystem that is full or read-only now is no config error: the tier starts degraded
        (disk_health.py) and serves what it re-indexed."""
        path = self.path
        if not os.path.isdir(path):
            raise ConfigError(f"pool.disk.path: {path} is not a directory (create it on a local filesystem)")
        refused = ""
        try:
            direct = files.probe_direct_io(path)
        except OSError as exc:
            if files.error_kind(exc) not in DEGRADING_KINDS:  # permissions and the like: a restart won't help
                raise ConfigError(f"pool.disk.path: {path} is not writable ({exc.strerror})") from None
            # another program filled it, or it was remounted read-only: what a restart after a
            # crash may meet, and must not be refused for (exit 2 stops systemd's restarts)
            refused = f"{files.error_kind(exc)}: cannot write in {path}: {exc.strerror}"
            direct = False  # unknown until a write succeeds: buffered I/O reads on any filesystem
        self._direct_known = not refused
        if self.config.direct_io is True and not direct and not refused:
            raise ConfigError(f"pool.disk.direct_io: the filesystem of {path} does not support O_DIRECT "
                              "(tmpfs?): use a local disk, or direct_io = \"auto\" or false")
        self.direct = direct and self.config.direct_io is not False
        if not direct and self.config.direct_io == "auto" and not refused:
            log.warning("pool.disk: the filesystem of %s does not support O_DIRECT: using buffered I/O", path)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # one daemon per directory
        except OSError:
            os.close(fd)
            raise ConfigError(f"pool.disk.path: {path} is in use by another ecd daemon") from None
        self.dirfd = fd
        try:
            if refused:
                self.health.degrade(refused)
            self._reindex()
            self._check_room()
        except BaseException:
            self.close()
            raise
        self.executor = ThreadPoolExecutor(self.config.io_threads, thread_name_prefix="ecd-disk")
        size = int(self.config.spill_buffer)
        # faulted in now: a first spill touching fresh pages took ~10 ms per 16 MiB on the loop
        self.staging = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
        self.staging_alloc = ExtentAllocator(size)

    def _check_room(self) -> None:
        """A budget larger than the filesystem is a config error; one larger than the room other
        programs' files leave it now is only a warning (writes fail with ENOSPC once it is full):
        those files are not this daemon's config, and must not stop it from starting."""
        vfs = os.statvfs(self.path)
        whole = (vfs.f_blocks - (vfs.f_bfree - vfs.f_bavail)) * vfs.f_frsize  # root's reserve is not ours
        if whole < self.capacity:
            raise ConfigError(f"pool.disk.size: {self.path} has room for {format_size(whole)} ({whole} bytes) "
                              f"when empty, pool.disk.size is {format_size(self.capacity)}: shrink it")
        room = vfs.f_bavail * vfs.f_frsize + self.used
        if room < self.capacity:
            log.warning("pool.disk.size: %s has room for %s now (its records included), pool.disk.size is %s: "
                        "other files fill the filesystem; spills and write-throughs fail with ENOSPC once it is full",
                        self.path, format_size(room), format_size(self.capacity))

    def _reindex(self) -> None:
        started = time.monotonic()
        names, temps = files.list_directory(self.path)
        # a crash mid-write: the record it was writing never existed
        removed = sum(self._remove_at_start(name, "an unfinished write") for name in temps)
        if removed:
            log.info("pool.disk: removed %d unfinished write(s) of a previous run", removed)
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
                self._remove_at_start(name, "a bad record")
                continue
            record = DiskRecord(header, name, size, ready=True)
            k = (header.ns, header.key)
            other = newest.get(k)
            if other is not None:  # two records of one key: a crash between a write and a removal
                older, record = sorted((other, record), key=lambda r: (r.header.epoch, r.header.sequence))
                self._remove_at_start(older.name, "an older record of a key")
            newest[k] = record
            # (epoch, sequence) orders a key's records: this run's must come after every one on
            # disk even if the wall clock (the epoch's source) stepped back since
            self.epoch = max(self.epoch, header.epoch + 1)
        # least recently written first: the LRU order a restart can know
        for record in sorted(newest.values(), key=lambda r: r.header.written_ns):
            if self.used + record.size > self.capacity and not record.persisted:
                self._remove_at_start(record.name, "a spill over the budget")  # oldest spills go first
                continue
            self.records[(record.header.ns, record.header.key)] = record
            self.used += record.size
        self.loaded = len(self.records)
        self.load_s = time.monotonic() - started
        if names:
            log.info("pool.disk: re-indexed %d record(s), %s, in %.3fs", self.loaded, format_size(self.used),
                     self.load_s)

    def _remove_at_start(self, name: str, what: str) -> bool:
        """Remove a file the re-index does not keep. A failure (a read-only filesystem) is counted
        and never a reason not to start: the file, not indexed, is removed once the tier takes
        writes again (_recovered; an older record of a key left behind would otherwise come back
        at a later start once the newer one is deleted)."""
        try:
            files.remove(self.path, name)
            return True
        except OSError as exc:
            self._count_error(files.DiskIOError(files.error_kind(exc), f"{name}: {exc.strerror}"),
                              f"cannot remove {what} at start")
            self._unremoved.append(name)
            return False

    def attach(self, store: "Store", loop: asyncio.AbstractEventLoop, segments: list[Any]) -> None:
        """Serve: the store (made with this tier as its lower_tier) consults it from now on;
        re-indexed keys become present."""
        self.store, self.loop, self.segments = store, loop, segments
        self.session = store.open_session(INTERNAL_SESSION_ID, 0)
        self.session.watched = True  # the daemon itself: a forced eviction must not revoke its leases
        for (ns, key) in self.records:
            store.announcer.ring_of(ns).publish(key_hash(ns, key), 0)
        self.health.attach(loop, lambda: self.executor, self._recovered)

    def _recovered(self, direct: bool) -> None:
        """A probe write succeeded after the tier was degraded: the files the start or a removal
        could not remove go now; a tier that started degraded did not know whether the filesystem takes
        O_DIRECT (it used buffered I/O, which reads anywhere): now it does."""
        if self._unremoved:
            self._unlinks.extend(self._unremoved)
            self._unremoved = []
            if self._unlinks_done is None:
                assert self.loop is not None
                self._unlinks_done = self.loop.create_future()
            if not self._unlinking:
                self._next_removals()
        if self._direct_known:
            return
        self._direct_known = True
        if self.config.direct_io is True and not direct:
            log.error("pool.disk.direct_io: the filesystem of %s does not support O_DIRECT: the disk tier goes "
                      "on with buffered I/O (use a local disk, or direct_io = \"auto\" or false)", self.path)
        elif not direct and self.config.direct_io == "auto":
            log.warning("pool.disk: the filesystem of %s does not support O_DIRECT: using buffered I/O", self.path)
        self.direct = direct and self.config.direct_io is not False

    def close(self) -> None:
        """Wait for the worker threads (they read and write the pools: before those are unmapped)."""
        self.health.close()
        if self.executor is not None:
            self.executor.shutdown(wait=True)  # queued work finishes: it holds no lease to lose
            self.executor = None
        # removals no worker took, and those that waited for reads (the workers are done, so
        # are the reads; the promotions' ends, which would queue them, may never run): done
        # here, before exit, and whoever waits for them answered
        waiting = self._removals_after_reads
        leftover = self._unlinks + [record.name for record in waiting]
        if leftover and self.dirfd >= 0:
            files.remove_durably(self.path, self.dirfd, leftover)
        for removal in [self._unlinks_done] + [removal for _, removal in waiting.values()]:
            if removal is not None:
                mark_done(removal)
        self._unlinks = []
        self._removals_after_reads = {}
        self._unlinks_done = None
        if self.dirfd >= 0:
            os.close(self.dirfd)
            self.dirfd = -1

    @property
    def internal_sessions(self) -> int:
        return 1 if self.session is not None else 0

    # ---- introspection --------------------------------------------------------------------

    def stats(self) -> DiskStats:
        staged = self.staging_alloc.used if self.staging_alloc is not None else 0
        return DiskStats(self.path, self.direct, self.capacity, self.used, len(self.records),
                         sum(1 for r in self.records.values() if r.persisted), self.counters["spills"],
                         self.counters["promotions"], self.writes, staged, self.counters["integrity_failures"],
                         dict(self.errors), dict(self.dropped), self.loaded, self.load_s, self.health.reason,
                         self.health.seconds())


    def metric_families(self) -> Iterator[Any]:
        return disk_metrics(self)

    def integrity_failures(self) -> dict[str, int]:
        """Records found corrupt on disk (never served, removed)."""
        return {"disk": self.counters["integrity_failures"]}
