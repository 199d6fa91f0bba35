"""A client's submission page: its puts placed in put leases and posted as records (issue 43).

The put route (ecd/client/put.py) hands a host-pool put here when the daemon gave this session a
page; `place` takes each tensor's bytes from the front of the current lease (the next granted
one when it is full, or one asked for with LeaseSpace: the only round trip, once a lease), and
a sequence number; the route copies the bytes; `post` writes each record, sequence number last,
and rings the doorbell (the daemon's eventfd) only when the daemon said it sleeps (or the caller
will wait). So a
steady producer sends the daemon no message: the daemon grants the next lease on the page
before the current one runs out.

Semantics: a put returns once its bytes are copied and its record posted; the entry becomes
visible when the daemon commits the record. `wait` (Client.put's default) waits for that commit
on a futex, and raises the daemon's refusal, if any; `flush` waits for every record posted so
far and raises the first refusal not yet reported. This client's own reads settle its posted
puts first (without raising), so it reads its own writes. Records the daemon had not read when
it stopped are dropped with it: a wait or flush across a daemon restart raises
StaleGeneration (RESTARTED), as a put whose commit the old daemon never answered would.
"""
from __future__ import annotations

import collections
import contextlib
import math
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

import numpy as np

from ..errors import RESTARTED, Code, DaemonUnavailable, EcdError, StaleGeneration, error_from_code
from ..memory import kernel_copy
from ..memory.allocator import align_up
from ..memory.fence import barrier, full_barrier
from ..memory.ring import READER_TRUST_S
from ..protocol import Acked, Extent, Failure, encoder
from . import futex
from .submission import (COMMITTED_AT, CONSUMED_AT, COPY_WINDOW, DTYPE_CODES, EPOCH_AT, ERROR, ERRORS, ERRORS_AT,
                         ERRORS_COUNT_AT, FLAG_ABORT, FLAG_CHECKSUM, GRANT, GRANTS, GRANTS_AT, GRANTS_COUNT_AT, MAX_KEY,
                         MAX_META, MAX_NDIM, PAGE_HEADER, RECORD_BODY, REVOKED_AT, SEQ, SLEEPING_AT, WAITING_AT, page_bytes,
                         record_offset)

if TYPE_CHECKING:  # pragma: no cover
    from ..client.mapping import EpochMapping
    from ..protocol import Welcome

WAIT_SLICE_S = 0.05  # a wait looks at the session this often (a reconnect, the client's timeout)
HOST_TIER = -1  # a lease in the host pool (else: in the CUDA arena of that pool index)
MAX_ASK = 64 << 20  # a lease asked for holds at most this much of a batch's rest (one contiguous extent)
LEASE_RETRY_S = 0.5  # after a refused LeaseSpace, puts go the ordinary way this long before asking again
GONE_SILENCE_S = 3 * READER_TRUST_S  # a ring this silent: its daemon was killed (SIGKILL leaves it open)

# (page, namespace, nbytes, tier) -> the daemon's reply to LeaseSpace, or None when the client's
# session is no longer this page's: the round trip the page asks its client for (PutRoute.lease_space)
LeaseSpaceCall = Callable[["Submissions", str, int, int], Optional[Acked]]


def submissions(welcome: "Welcome", mapping: "EpochMapping | None",
                previous: "Submissions | None" = None) -> "Submissions | None":
    """The session's page, when the daemon gave one and this client maps the pool (taking over
    what `previous`, the page of this client's session before, has not reported)."""
    location = welcome.ring.submissions
    if len(location) != 4 or mapping is None or not mapping.local or not mapping.sealed or mapping.doorbell_fd < 0:
        return None  # (a named file may be truncated under the page's loads: none is given for one)
    pool, page_at, records, area_at = location
    if not (0 <= pool < len(mapping.rw) and mapping.rw[pool] is not None and 0 < records and 0 <= area_at < page_at
            and page_at + page_bytes(records) <= len(mapping.rw[pool])):
        return None  # not inside a segment it maps: ignore it, put the ordinary way
    heartbeat_s, write_ttl = welcome.heartbeat_s, welcome.limits.write_ttl_s
    # > 0: the daemon cannot watch this process: a lease it left unused this long may be gone
    window = math.inf if heartbeat_s <= 0 else min(write_ttl / 2, 1.5 * heartbeat_s)
    page = Submissions(location, mapping, welcome.session, welcome.epoch, window, min(window, COPY_WINDOW * write_ttl))
    if previous is not None:
        page.inherit(previous)
    return page


class _Lease:
    """The put lease this client places in: its front moves as puts are placed."""

    __slots__ = ("generation", "pool", "front", "end", "used_at")

    def __init__(self, generation: int, pool: int, start: int, end: int, used_at: float) -> None:
        self.generation, self.pool, self.front, self.end = generation, pool, start, end
        self.used_at = used_at  # monotonic: when last placed in (or asked for)


class Placed:
    """One put placed in a lease: where its bytes go and the record that will name them."""

    __slots__ = ("key", "extent", "seq", "dtype", "shape", "nbytes", "meta")

    def __init__(self, key: str, extent: Extent, seq: int, dtype: int, shape: tuple, nbytes: int,
                 meta: bytes = b"") -> None:
        self.key, self.extent, self.seq, self.dtype, self.shape, self.nbytes = key, extent, seq, dtype, shape, nbytes
        self.meta = meta  # its EntryMeta, encoded: written into the lease after its bytes


class Submissions:
    def __init__(self, location: list[int], mapping: "EpochMapping", session: int, epoch: int,
                 window: float, copy_window: float) -> None:
        pool, self.page_at, self.records, self.area_at = location
        buf = mapping.rw[pool]
        self.mapping, self.session, self.epoch = mapping, session, epoch
        self.buf = buf
        self.header = np.frombuffer(buf, np.uint64, count=PAGE_HEADER // 8, offset=self.page_at)
        self.area = np.frombuffer(buf, np.uint32, count=64, offset=self.area_at)
        self.area_epoch = np.frombuffer(buf, np.uint64, count=1, offset=self.area_at + EPOCH_AT)
        base = kernel_copy.address_of(buf)
        self._committed_address = base + self.page_at + COMMITTED_AT
        # its own descriptor of the doorbell: the mapping's closes with its epoch, and a number
        # closed under a put in flight could be some other file's by the time it rings
        self.doorbell = os.dup(mapping.doorbell_fd)
        weakref.finalize(self, os.close, self.doorbell)
        self.lock = threading.Lock()
        self.next_seq = 1
        self.posted = 0  # the last sequence number posted
        # the last one posted with every one before it (others are placed, and a thread of this
        # process is copying or asking for room): what a wait under the client's lock waits for
        self.posted_in_order = 0
        self._posted_ahead: set[int] = set()
        self.leases: dict[int, _Lease] = {}  # by tier (HOST_TIER, or a CUDA arena's pool index): placed in now
        # how long after its last use a lease may still be placed in (inf: the daemon watches this
        # process, its leases end only with it or revoked on the page; else they expire unused:
        # PutRoute.safe_write_window), and how long after a placement its bytes may be copied
        self.window, self.copy_window = window, copy_window
        self.grants_taken = 0
        self.namespace = ""  # the namespace of its leases (Client.namespace may change between puts)
        self._refused_until: dict[int, float] = {}  # by tier: after a refused LeaseSpace, the ordinary route
        self._asked_at = time.monotonic()  # a grant is no older than the last LeaseSpace, or the page's Welcome
        self._keys: dict[int, str] = {}  # seq -> key, of records posted and not yet settled
        self._errors_seen = 0
        self._unreported: list[tuple[int, int, str]] = []  # (seq, code, message) of refusals not raised yet
        self._waiters = 0
        self._committed_seen = 0  # the highest `committed` read while the page was this run's
        self._raised_lost = 0  # records of waited puts a restart took, already raised to their callers
        # (device copies, placed, timeout, sources) of puts whose records wait for their copies (post_after)
        self._deferred: collections.deque[tuple[Any, list[Placed], float, Any]] = collections.deque()
        self._deferred_lock = threading.RLock()
        self._posting_deferred = False  # reentry guard: post -> a wait for room -> post_deferred

    # ---- place ----------------------------------------------------------------------------

    def place(self, namespace: str, lease_space: LeaseSpaceCall, tensors: dict[str, Any], sizes: list[int],
              dtypes: list[str], metas: Mapping[str, Any] | None = None, tier: int = HOST_TIER,
              timeout: float = 5.0) -> list[Placed]:
        """A place in a lease of `tier` (the host pool, or a CUDA arena's pool index) and a
        sequence number for each tensor of `namespace` it can take, in order; the others (a key
        over MAX_KEY bytes, over MAX_NDIM dimensions, a meta over MAX_META or any in an arena, no
        lease to be had) are left out for the ordinary route. `lease_space`: the client's one
        round trip for a lease (the only thing the page asks of it). A refusal raised for a later
        tensor posts those placed before it as aborted (`timeout`: for room on the page): the
        daemon reads records in order, and one never posted would hold up every later one."""
        placed: list[Placed] = []
        if self.stale():
            return placed  # a new daemon run's area: this client reconnects (put_many) and gets a page of it
        try:
            self._place(placed, namespace, lease_space, tensors, sizes, dtypes, metas, tier)
        except BaseException:
            if placed:
                with contextlib.suppress(EcdError):  # (a daemon gone: the page goes with it)
                    self.post(placed, [0] * len(placed), False, False, timeout, aborted=True)
            raise
        return placed

    def _place(self, placed: list[Placed], namespace: str, lease_space: LeaseSpaceCall, tensors: dict[str, Any],
               sizes: list[int], dtypes: list[str], metas: Mapping[str, Any] | None, tier: int) -> None:
        left = sum(align_up(max(nbytes, 1)) for nbytes in sizes)  # a lease asked for holds the rest of the batch
        with self.lock:
            if namespace != self.namespace:  # leases are a namespace's: those held so far are another's
                self.namespace = namespace
                self.leases.clear()
                self.grants_taken = int(self.header[GRANTS_COUNT_AT // 8])
            for (key, tensor), nbytes, dtype in zip(tensors.items(), sizes, dtypes):
                code = DTYPE_CODES.get(dtype)
                meta = encoder.encode(metas[key]) if metas and metas.get(key) is not None else b""
                if (code is None or tensor.dim() > MAX_NDIM or len(key.encode()) > MAX_KEY or len(meta) > MAX_META
                        or (meta and tier != HOST_TIER)):  # (an arena's bytes are not this process's to write)
                    continue
                size = align_up(max(nbytes, 1)) + align_up(len(meta))
                extent = self._take(lease_space, size, left + align_up(len(meta)), nbytes + align_up(len(meta)), tier)
                left -= align_up(max(nbytes, 1))
                if extent is None:
                    continue
                placed.append(Placed(key, extent, self.next_seq, code, tuple(tensor.shape), nbytes, meta))
                self.next_seq += 1

    def _take(self, lease_space: LeaseSpaceCall, size: int, ask: int, exact: int, tier: int) -> Extent | None:
        """`size` bytes from the front of the current lease (or the next); a lease of `ask` bytes
        is asked for when none holds them (`exact`: the put's own bytes, unaligned, asked for when
        the batch has nothing after it). Called under `self.lock`, which it lets go of while it
        asks."""
        lease, now = self.leases.get(tier), time.monotonic()
        if lease is not None and (now - lease.used_at > self.window or lease.generation < self._revoked()):
            lease = None  # the daemon may have taken it back, or is taking it back
            del self.leases[tier]
        if lease is None or lease.front + size > lease.end:
            lease = self._next_lease(size, tier)
            if lease is None:
                if now < self._refused_until.get(tier, 0.0):
                    return None
                self.lock.release()  # no lock across the round trip (a reconnect in it reads this page)
                try:
                    # just this put (its exact bytes, as an Alloc names them), or the batch's rest
                    asked = self._ask(lease_space, size, max(size, min(ask, MAX_ASK)) if ask > size else exact, tier)
                finally:
                    self.lock.acquire()
                if not asked:
                    return None
                lease = self._next_lease(size, tier)
                if lease is None:
                    return None
        extent = Extent(lease.generation, lease.pool, lease.front)
        lease.front += size
        lease.used_at = now
        return extent

    def deadline(self, tier: int = HOST_TIER) -> float:
        """Until when the bytes of what was just placed in `tier` may be copied."""
        lease = self.leases.get(tier)
        return lease.used_at + self.copy_window if lease is not None else 0.0

    def _revoked(self) -> int:
        """Leases below this generation are being taken back (unused for the write TTL)."""
        full_barrier()  # this load after the placement's before it (the daemon frees a grace later)
        return int(self.header[REVOKED_AT // 8])

    def _next_lease(self, size: int, tier: int) -> _Lease | None:
        """The next lease of `tier` the daemon granted on the page that holds `size` bytes (the
        client never goes back to an older one of a tier). Grants of other tiers passed on the way
        become their tier's current lease."""
        granted = int(self.header[GRANTS_COUNT_AT // 8])
        if granted - self.grants_taken > GRANTS:
            self.grants_taken = granted - GRANTS  # a hostile or broken page: skip what was overwritten
        while self.grants_taken < granted:
            if barrier is not None:
                barrier()  # the count's load before the grant's
            at = GRANTS_AT + (self.grants_taken % GRANTS) * GRANT.size
            generation, pool, start, nbytes = GRANT.unpack_from(self.header.data.cast("B"), at)
            self.grants_taken += 1
            sizes, arenas = self.mapping.sizes, self.mapping.arena_sizes
            pool_size = sizes[pool] if pool < len(sizes) else arenas.get(pool, 0)
            if start + nbytes > pool_size or generation < self._revoked():
                continue  # not in this client's pools (a broken page), or revoked already
            granted_tier = HOST_TIER if pool < len(sizes) else pool
            lease = self.leases[granted_tier] = _Lease(generation, pool, start, start + nbytes, self._asked_at)
            if granted_tier == tier and nbytes >= size:
                return lease
        return None

    def _ask(self, lease_space: LeaseSpaceCall, size: int, ask: int, tier: int) -> bool:
        """LeaseSpace: one round trip for a lease of at least `ask` bytes (`size`: this put's).
        A refusal of just this put's size for its quota or for room is the put's own (an Alloc
        would be refused the same): raised. Any other refusal: the put goes the round-trip way."""
        self._asked_at = time.monotonic()
        reply = lease_space(self, self.namespace, ask, tier)
        if reply is None:
            return False  # another session's page by now (a restarted daemon): its grant is there
        refused = reply.results[0]
        if isinstance(refused, Failure):
            if align_up(max(ask, 1)) == size and refused.code in (Code.QUOTA_EXCEEDED, Code.POOL_FULL):
                raise error_from_code(refused.code, refused.message)
            self._refused_until[tier] = time.monotonic() + LEASE_RETRY_S
            return False
        return True

    # ---- post -----------------------------------------------------------------------------

    def post(self, placed: list[Placed], digests: list[int], checksum: bool, wait: bool, timeout: float,
             aborted: bool = False) -> None:
        """Write each placed put's record (FLAG_ABORT: its copy failed), sequence number last;
        ring when the daemon sleeps or the caller waits; wait for the commit with `wait`."""
        if not placed:
            return
        if self._deferred:
            self.post_deferred(block=False)
        self._check_epoch()
        flags = FLAG_ABORT if aborted else (FLAG_CHECKSUM if checksum else 0)
        buf, records = self.buf, self.records
        pool = self.mapping.rw
        for put, digest in zip(placed, digests):
            self._room_for(put.seq, timeout)
            if put.meta and not aborted and put.extent.pool < len(pool):  # (place leaves none in an arena)
                meta_at = put.extent.offset + align_up(max(put.nbytes, 1))
                pool[put.extent.pool][meta_at:meta_at + len(put.meta)] = put.meta
            at = record_offset(self.page_at, records, put.seq)
            key = put.key.encode()
            shape = put.shape + (0,) * (MAX_NDIM - len(put.shape))
            RECORD_BODY.pack_into(buf, at + 8, put.extent.generation, put.extent.offset, put.nbytes, digest, flags,
                                  put.dtype, len(put.shape), len(key), len(put.meta), *shape, key)
            if barrier is not None:
                barrier()  # the record's fields before its sequence number
            SEQ.pack_into(buf, at, put.seq)
            self._keys[put.seq] = put.key
        with self.lock:
            self.posted = max(self.posted, placed[-1].seq)
            self._posted_ahead.update(put.seq for put in placed)
            while self.posted_in_order + 1 in self._posted_ahead:
                self.posted_in_order += 1
                self._posted_ahead.discard(self.posted_in_order)
        if len(self._keys) > 2 * records:  # a producer that never flushes: forget what was settled
            self._collect(self._committed())
        full_barrier()  # the sequence numbers' stores before `sleeping`'s load (the daemon: the reverse)
        if wait or self.area[SLEEPING_AT // 4]:
            self.ring()
        if wait:
            try:
                self.wait_for(placed[-1].seq, timeout)
            except StaleGeneration:
                self._raised_lost += len(placed)  # said by this raise: not again as lost
                raise
            self._raise_refused([p.seq for p in placed])

    def post_after(self, copies: Any, placed: list[Placed], timeout: float, sources: Any) -> None:
        """Post `placed` once `copies` (a CopyBatch of their copies, queued on the device and
        recorded) have completed, without waiting for them now: at this client's next use of
        the page after that (its next put, a flush, a read settling its writes, its close).
        `sources`: the tensors copied from, kept until then (a temporary freed sooner could have
        its memory handed to other work, on another stream, while the copy still reads it)."""
        with self._deferred_lock:
            self._deferred.append((copies, placed, timeout, sources))
        self.post_deferred(block=False)

    def post_deferred(self, block: bool) -> None:
        """Post, in order, the records whose copies are done (`block`: waiting for each). A copy
        that failed posts its records as aborted and its error is reported at the next flush; a
        restart meanwhile drops them, said likewise."""
        # not blocking: another thread posting them (it may wait for room a record of this one's fills)
        if not self._deferred_lock.acquire(blocking=block):
            return
        try:
            if self._posting_deferred:
                return  # (this thread is posting them already, and now waits for room)
            self._posting_deferred = True
            try:
                while self._deferred:
                    copies, placed, timeout, sources = self._deferred[0]
                    if not block and not copies.done():
                        return
                    self._deferred.popleft()
                    self._post_copied(copies, placed, timeout)  # (waits for the copies first)
                    del sources  # only now: the copies no longer read them
            finally:
                self._posting_deferred = False
        finally:
            self._deferred_lock.release()

    def _post_copied(self, copies: Any, placed: list[Placed], timeout: float) -> None:
        keys = ", ".join(repr(p.key) for p in placed[:3]) + (" ..." if len(placed) > 3 else "")
        failed = ""
        try:
            copies.wait()
        except Exception as exc:  # the device failed the copy: nothing of these puts is stored
            copies.wait_quietly()
            failed = f"the device copy of {keys} failed: {exc}"
        try:
            self.post(placed, [0] * len(placed), False, False, timeout, aborted=bool(failed))
        except EcdError as exc:  # a restart took the page: these puts went with it
            failed = failed or f"{keys} not stored: {exc}"
        if failed:
            self._unreported.append((placed[0].seq, Code.INVALID, failed))

    def ring(self) -> None:
        try:
            os.eventfd_write(self.doorbell, 1)
        except BlockingIOError:
            pass  # its counter is full: the daemon has a ring to read already

    def _room_for(self, seq: int, timeout: float) -> None:
        """The record's slot is free once the daemon read the record `records` before it."""
        if seq - int(self.header[CONSUMED_AT // 8]) > self.records:
            self.ring()
            self.wait_for(seq - self.records, timeout, word=CONSUMED_AT)

    def stale(self) -> bool:
        """A new daemon run owns the area now (this page may be another session's)."""
        return int(self.area_epoch[0]) != self.epoch

    def gone(self) -> bool:
        """Stale, or this run's daemon stopped: its ring closed, or silent past GONE_SILENCE_S (a
        cold restart maps a new pool: nobody writes this area again). Longer than a reader's
        trust in the ring: a daemon only slow to beat (a loaded machine) still commits what was
        posted, and a put said to be dropped must have been."""
        return self.stale() or not self.mapping.ring.alive(GONE_SILENCE_S)

    def _check_epoch(self) -> None:
        if self.stale():
            raise StaleGeneration(RESTARTED)

    def _committed(self) -> int:
        """The last sequence number the daemon settled, as far as this run's page says (read
        before the epoch: a value read after a restart handed the page on is not believed)."""
        committed = int(self.header[COMMITTED_AT // 8])
        if not self.stale():
            self._committed_seen = max(self._committed_seen, committed)
        return self._committed_seen

    def _drop_lost(self, raise_it: bool) -> None:
        """The daemon restarted: what it had not settled is gone with it. Said once: raised, or
        kept for the next flush (of this client's next page: `inherit`)."""
        lost = max(0, self.posted - self._committed_seen - self._raised_lost)
        self.posted = self._committed_seen  # (posted_in_order stays: what this process posted, in order)
        self._keys.clear()
        if lost:
            message = (f"the daemon restarted: up to {lost} put(s) made with wait=False were dropped with it "
                       "(committed entries are kept): put them again")
            if raise_it:
                raise StaleGeneration(message)
            self._unreported.append((0, Code.STALE, message))

    def inherit(self, previous: "Submissions") -> None:
        """This session's page follows `previous` (a reconnect): its unreported refusals and lost
        puts are this one's to report."""
        previous.post_deferred(block=True)
        if previous.gone():
            previous._drop_lost(raise_it=False)
        else:
            previous._collect(previous.posted)
        self._unreported = previous._unreported + self._unreported

    # ---- wait -----------------------------------------------------------------------------

    def wait_for(self, seq: int, timeout: float, word: int = COMMITTED_AT, deferred: bool = True) -> None:
        """Until the page's `word` (committed, or consumed) reaches `seq`: a futex wait, woken by
        the daemon after each batch. StaleGeneration when the daemon restarted meanwhile,
        DaemonUnavailable past `timeout` without progress. `deferred`: post the records held back
        for their device copies first (they may come before the one waited for)."""
        if deferred and self._deferred:
            self.post_deferred(block=True)  # records waited for may come after ones still held back
        header = self.header
        index = word // 8
        deadline = time.monotonic() + timeout
        last, in_order = int(header[index]), self.posted_in_order
        while last < seq:
            self._committed()
            if self.gone():
                raise StaleGeneration(RESTARTED)
            with self.lock:
                self._waiters += 1
                header[WAITING_AT // 8] = 1
            try:
                full_barrier()  # `waiting` stored before `committed` is looked at again
                committed = int(header[COMMITTED_AT // 8])  # the futex word (consumed moves with it)
                if int(header[index]) < seq:
                    futex.wait(self._committed_address, committed & 0xFFFFFFFF, WAIT_SLICE_S)
            finally:
                with self.lock:
                    self._waiters -= 1
                    if not self._waiters:
                        header[WAITING_AT // 8] = 0
            now = int(header[index])
            if now != last or self.posted_in_order != in_order:  # (another thread posting is progress too)
                last, in_order, deadline = now, self.posted_in_order, time.monotonic() + timeout
            elif time.monotonic() > deadline:
                if in_order <= last and in_order < seq:
                    raise DaemonUnavailable(f"record {seq} waits {timeout:g}s for record {in_order + 1}, placed "
                                            "by another thread of this process and not posted yet")
                raise DaemonUnavailable(f"the daemon committed no put record within {timeout:g}s "
                                        f"(record {seq} waits; {last} committed)")
            else:
                self.ring()  # a slice without progress: ring again (another client may have read the eventfd)
        self._committed()
        if self.stale():  # what was read may be a new run's, for another session: not believed
            raise StaleGeneration(RESTARTED)

    def pending(self, keys: Sequence[str] | None = None) -> bool:
        """Whether puts posted (or held back for their device copies) are not settled yet: any of
        them, or (`keys`) any of these keys' (in any namespace: at worst a wait too many)."""
        if not self._deferred and self.posted <= self._committed():
            return False
        if keys is None:
            return True
        wanted = set(keys)
        with self.lock:
            if any(key in wanted for key in self._keys.values()):
                return True
        return any(put.key in wanted for _, placed, _, _ in list(self._deferred) for put in placed)

    def flush(self, timeout: float, raise_refused: bool = True, in_order: bool = False) -> None:
        """Wait until every record posted so far is committed or refused; raise the first refusal
        not yet raised (`raise_refused`), else keep it for the next flush. Across a daemon restart:
        StaleGeneration saying how many puts may have been dropped (or kept, likewise).
        `in_order`: only those posted before any this process's threads are still placing (a
        caller holding the client's lock, which such a put may be waiting for, must not wait
        for it: the two would wait on each other)."""
        self.post_deferred(block=not in_order)  # (in order: those held back are not waited for)
        target = self.posted_in_order if in_order else self.posted
        if self.gone():
            return self._drop_lost(raise_refused)
        if target > self._committed():
            self.ring()
            try:
                self.wait_for(target, timeout, deferred=not in_order)
            except StaleGeneration:
                return self._drop_lost(raise_refused)
        self._collect(target)
        if raise_refused and self._unreported:
            (_, code, message), more = self._unreported[0], len(self._unreported) - 1
            self._unreported.clear()
            raise error_from_code(code, message + (f" (and {more} more refused)" if more else ""))

    def _raise_refused(self, seqs: list[int]) -> None:
        """Refusals of these records (a waited put): raised now, not at the next flush."""
        self._collect(seqs[-1])
        first, last = seqs[0], seqs[-1]
        mine = [e for e in self._unreported if first <= e[0] <= last]
        if mine:
            self._unreported = [e for e in self._unreported if not first <= e[0] <= last]
            raise error_from_code(mine[0][1], mine[0][2])

    def _collect(self, through: int) -> None:
        """Read the page's refusals, each named by its key; forget settled records' keys."""
        with self.lock:
            count = int(self.header[ERRORS_COUNT_AT // 8])
            if count - self._errors_seen > ERRORS:
                lost = count - ERRORS - self._errors_seen
                self._unreported.append((0, Code.INVALID, f"{lost} put record(s) refused by the daemon; the reasons "
                                                       "were overwritten before they were read"))
                self._errors_seen = count - ERRORS
            raw = self.header.data.cast("B")
            while self._errors_seen < count:
                if barrier is not None:
                    barrier()
                seq, code, length, text = ERROR.unpack_from(raw, ERRORS_AT + (self._errors_seen % ERRORS) * ERROR.size)
                self._errors_seen += 1
                key = self._keys.get(seq, "?")
                message = text[:length].decode(errors="replace")
                self._unreported.append((seq, code, message.replace(f"record {seq}:", f"record {seq}: key {key!r}:", 1)
                                         if key != "?" else message))
            for seq in [s for s in self._keys if s <= through]:
                del self._keys[seq]
