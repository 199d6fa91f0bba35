"""The daemon's side of the submission area: pages for sessions, and the records read from them.

Each session with a page (Welcome's RingInfo.submissions) posts one record per put it placed in a
put lease (leases.py). The daemon reads records in sequence order, each as untrusted input: the
lease must be this session's, the bytes inside its uncarved part and in order, the dtype, shape,
size and key must pass the checks an Alloc's item passes. A good record becomes a READY entry
exactly as an Alloc + Commit would make it (journal, events, index, replace, quota); a bad one
is refused with a reason on the page's error slots and the bytes it named go back to the pool.
After a batch the daemon stores `committed` and wakes a client waiting on it (flush, put with
wait=True).

When it runs (all on the event loop, between requests):
- awake: every POLL_S while records keep coming, and at once when a client rings;
- asleep after IDLE_S without a record: it stores `sleeping`, fences, looks once more (a record
  posted before the client saw `sleeping` is found here), and then only the doorbell wakes it.
  The doorbell is an eventfd the fd socket hands every client: the loop watches it like any
  socket, so a ring reaches the daemon in one wake-up, with no thread between. Any client can
  also read it (and so swallow another's ring): a client waiting for its commit rings again
  every WAIT_SLICE_S, and the daemon looks at every page each DOORBELL_POLL_S regardless.
Pages are read in place (the pool is a sealed memfd: no load can fault): the sequence numbers
first, to find the run stored, then, after a barrier where the CPU needs one, each record's
fields, copied before they are checked.
"""
from __future__ import annotations

import heapq
import logging
import os
import struct
import time
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from ...errors import Code
from ...memory import kernel_copy
from ...memory.allocator import ALIGNMENT, align_up
from ...memory.fence import barrier, full_barrier
from ...protocol import AllocItem, EntryMeta, Failure
from ...writes import futex
from ...writes.submission import (AREA_HEADER, COMMITTED_AT, CONSUMED_AT, DTYPES, EPOCH_AT, ERROR, ERRORS, ERRORS_AT,
                                  ERRORS_COUNT_AT, FLAG_ABORT, FLAG_CHECKSUM, FLAGS_KNOWN, GRANT, GRANTS, GRANTS_AT,
                                  GRANTS_COUNT_AT, MAX_KEY, MAX_META, MAX_NDIM, RECORD, RECORD_BODY, REVOKED_AT, SEQ,
                                  SLEEPING_AT, WAITING_AT, area_bytes, page_bytes, page_offset,
                                  record_offset)
from ..registry.entries import Session
from .leases import LIVE_LEASES, TIER_HOST, Leasing, PutLease

if TYPE_CHECKING:  # pragma: no cover
    import asyncio

    from ..registry.store import Store

log = logging.getLogger("ecd.daemon")

POLL_S = 0.001
IDLE_S = 0.05
DOORBELL_POLL_S = 1.0
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")


class _Page:
    __slots__ = ("page", "at", "session", "expected", "errors", "grants")

    def __init__(self, page: int, at: int, session: Session) -> None:
        self.page, self.at, self.session = page, at, session
        self.expected = 1  # the next record's sequence number (the daemon's count, never the page's)
        self.errors = self.grants = 0


class SubmissionArea:
    def __init__(self, segments: Any, offset: int, pages: int, records: int, store: "Store", leasing: Leasing,
                 epoch: int, quarantine_s: float, doorbell: int, pool: int = 0) -> None:
        """`segments`: the host pool's (ShmFiles); the area is segment `pool`'s bytes from `offset`
        (0: the default tenant's; a sized tenant's first segment: areas.py). A
        kept pool's area is the previous run's: records it had not read are dropped (their bytes
        lie in its leases' intents, quarantined by the adoption), and the pages its sessions used
        are quarantined too, for `quarantine_s`: a client of that run stopped between its epoch
        check and its record would write into a page handed to a new session (clobbering that
        session's record), so no new session gets one until the old run's writes cannot be in
        progress. The rest of the area is cleared and carries this run's epoch. `doorbell`: the
        eventfd clients write to wake the daemon (the caller's: it closes it)."""
        segment, self.pool = segments[pool], pool
        self.segment, self.segments, self.offset, self.pages, self.records = segment, segments, offset, pages, records
        self._meta_decoder = msgspec.msgpack.Decoder(EntryMeta)
        self.store, self.leasing = store, leasing
        self.page_bytes = page_bytes(records)
        self.nbytes = area_bytes(pages, records)
        self._quarantined = self._previous_run_pages()
        self._quarantine_s = quarantine_s
        self._free = [page for page in range(pages) if page not in self._quarantined]
        self._by_session: dict[int, _Page] = {}
        self._base = kernel_copy.address_of(segment.buf)  # for the futex words' addresses
        # The area read in place: the pool is a sealed memfd (restart.adopt.submission_bytes gives
        # none to a named file), so no load from it can fault
        if not getattr(segment, "sealed", False):
            raise ValueError("a submission area needs a sealed memfd pool ([pool.host] backing = \"memfd\")")
        self._view = memoryview(segment.buf)[offset:offset + self.nbytes]
        self._words = np.frombuffer(segment.buf, np.uint64, count=self.nbytes // 8, offset=offset)
        self._loop: "asyncio.AbstractEventLoop | None" = None
        self._timer: Any = None
        self._asleep = False
        self._last_record = self._last_expiry = 0.0
        self._stopping = False
        self.doorbell = doorbell
        self._poller: Any = None
        if self._quarantined:
            segment.write_at(offset, bytes(AREA_HEADER))
            for page in self._free:
                segment.write_at(self._page_at(page), bytes(self.page_bytes))
        else:
            segment.write_at(offset, bytes(self.nbytes))
        segment.write_at(offset + EPOCH_AT, _U64.pack(epoch))
        self._set_sleeping(True)  # nothing to do until a client rings

    def _page_at(self, page: int) -> int:
        return page_offset(self.offset, page, self.records)

    def _previous_run_pages(self) -> set[int]:
        """Pages of a previous run's area (its epoch set) that are not all zeros."""
        raw = bytearray(self.nbytes)
        if self.segment.read_into(self.offset, memoryview(raw)) < self.nbytes or not _U64.unpack_from(raw, EPOCH_AT)[0]:
            return set()
        pages = np.frombuffer(raw, np.uint64, offset=AREA_HEADER).reshape(self.pages, self.page_bytes // 8)
        return set(np.flatnonzero(pages.any(axis=1)).tolist())

    def _end_quarantine(self) -> None:
        for page in self._quarantined:
            self.segment.write_at(self._page_at(page), bytes(self.page_bytes))
            heapq.heappush(self._free, page)
        log.info("restart: %d submission page(s) the previous run used are free again", len(self._quarantined))
        self._quarantined = set()

    # ---- sessions -------------------------------------------------------------------------

    def assign(self, session: Session) -> list[int]:
        """[pool, page offset, records, area offset] for the session's Welcome (empty: none free)."""
        if not self._free:
            return []
        page = heapq.heappop(self._free)
        state = _Page(page, self._page_at(page), session)
        self.segment.write_at(state.at, bytes(self.page_bytes))
        self._by_session[session.id] = state
        return [self.pool, state.at, self.records, self.offset]

    def close(self, session: Session) -> None:
        """The session ends: what it posted completely is committed (its copies were done), then
        its leases end and its page is free again."""
        state = self._by_session.pop(session.id, None)
        if state is not None:
            self._consume(state)
            self.segment.write_at(state.at, bytes(self.page_bytes))
            heapq.heappush(self._free, state.page)
        self.leasing.end_session(session)

    def grant(self, session: Session, ns: str, nbytes: int, tier: int = TIER_HOST) -> Failure | None:
        """LeaseSpace: a lease for this session's next puts in `tier` (the host pool, or a CUDA
        arena's pool index), written to its page."""
        state = self._by_session.get(session.id)
        if state is None:
            return Failure(Code.INVALID, "this client has no submission page (leases.slot_sessions are all taken, "
                                         "or leases.submit_records = 0): put the ordinary way")
        self._consume(state)  # its records first: they retire the leases it has moved on from
        lease = self.leasing.grant(session, ns, nbytes, tier=tier)
        if isinstance(lease, Failure):
            return lease
        self._write_grant(state, lease)
        return None

    # ---- reading records ------------------------------------------------------------------

    def drain(self) -> int:
        """Read every page's new records; how many."""
        done = 0
        for state in list(self._by_session.values()):
            done += self._consume(state)
        return done

    def _consume(self, state: _Page) -> int:
        words, view, records = self._words, self._view, self.records
        first = last = state.expected
        while last - first < records and words[self._slot_at(state, last) // 8] == last:
            last += 1  # (one load each from the mapping: no system call while nothing came)
        if last == first:
            return 0
        if barrier is not None:
            barrier()  # the sequence numbers' loads before the fields' (the client stored them after)
        for seq in range(first, last):
            at = self._slot_at(state, seq)
            fields = bytes(view[at:at + RECORD])  # a copy: a hostile client cannot change it under the checks
            if SEQ.unpack_from(fields)[0] != seq:
                last = seq  # rewritten since: a hostile client; read again next time
                break
            try:
                self.settle(state, seq, RECORD_BODY.unpack_from(fields, 8))
            except Exception as exc:  # a bug of ours: this record is refused, the daemon goes on
                log.exception("submission record %d of session %d", seq, state.session.id)
                self._refuse(state, seq, Code.INTERNAL, f"record {seq}: the daemon failed on it: {exc!r}")
        state.expected = last
        if last > first:
            self.store.counters["submission_records"] += last - first
            header = (state.at - self.offset) // 8
            words[header + CONSUMED_AT // 8] = last - 1
            words[header + COMMITTED_AT // 8] = last - 1
            full_barrier()  # committed's store before waiting's load (the client: the reverse)
            if words[header + WAITING_AT // 8] & 0xFFFFFFFF:
                futex.wake(self._base + state.at + COMMITTED_AT)
        return last - first

    def _slot_at(self, state: _Page, seq: int) -> int:
        """Record `seq`'s offset in the area (its page's offset is the segment's)."""
        return record_offset(state.at, self.records, seq) - self.offset

    def settle(self, state: _Page, seq: int, fields: tuple) -> None:
        """One record: an entry, or a refusal on the page."""
        lease_generation, offset, nbytes, checksum, flags, dtype_code, ndim, key_length, meta_length = fields[:9]
        shape, key_bytes = fields[9:9 + MAX_NDIM], fields[9 + MAX_NDIM]
        store, session = self.store, state.session
        lease = self.leasing.find(session, lease_generation)
        if lease is None:
            return self._refuse(state, seq, Code.STALE, f"record {seq} names put lease {lease_generation}, which "
                                                        "this client does not hold (ended, or never granted)")
        size = align_up(max(nbytes, 1))
        if offset % ALIGNMENT:
            return self._refuse(state, seq, Code.INVALID, f"record {seq}: offset {offset} is not aligned to "
                                                          f"{ALIGNMENT} bytes")
        end = offset + size + align_up(meta_length) if meta_length else offset + size
        if meta_length and lease.pool >= len(self.segments):
            return self._refuse(state, seq, Code.INVALID, f"record {seq}: a meta in a CUDA arena's lease (put it "
                                                          "the ordinary way)")
        if not lease.front <= offset < end <= lease.end or meta_length > MAX_META:
            return self._refuse(state, seq, Code.INVALID, f"record {seq}: bytes [{offset}, {offset + size}) are not "
                                                          f"in the free part [{lease.front}, {lease.end}) of put "
                                                          f"lease {lease_generation} (records go in order)")
        self.leasing.retire_older(lease)
        lease.last_used = store.clock()
        if flags & ~FLAGS_KNOWN or flags & FLAG_ABORT:
            self.leasing.skip_to(lease, end)
            if flags & ~FLAGS_KNOWN:
                return self._refuse(state, seq, Code.INVALID, f"record {seq}: unknown flags {flags:#x}")
            store.counters["submission_aborts"] += 1
            return None
        item = self._item(lease, dtype_code, ndim, key_length, shape, key_bytes, nbytes)
        if not isinstance(item, Failure) and meta_length:
            item.meta = self._meta(lease, offset + size, meta_length)
            if isinstance(item.meta, Failure):
                item = item.meta
        if isinstance(item, Failure):
            self.leasing.skip_to(lease, end)
            return self._refuse(state, seq, item.code, f"record {seq}: {item.message}")
        old_intent = self.leasing.carve(lease, offset, nbytes)
        store.uncharge(lease.ns, size)  # the entry charges its namespace (the lease's) again
        extent = store.open_write(session, lease.ns, item, (lease.pool, offset))
        self.leasing.carved(lease, old_intent)
        if meta_length:
            self.leasing.skip_to(lease, end)  # the meta's bytes go back
        refused = store.commit(session, extent.generation, checksum if flags & FLAG_CHECKSUM else 0)
        if refused is not None:
            return self._refuse(state, seq, refused.code, f"record {seq}: {refused.message}")
        self._refill(state, lease)
        return None

    def _item(self, lease: PutLease, dtype_code: int, ndim: int, key_length: int, shape: tuple, key_bytes: bytes,
              nbytes: int) -> AllocItem | Failure:
        if dtype_code >= len(DTYPES) or ndim > MAX_NDIM or key_length > MAX_KEY:
            return Failure(Code.INVALID, f"dtype code {dtype_code}, {ndim} dimensions or a key of {key_length} "
                                         "bytes is out of range")
        try:
            key = key_bytes[:key_length].decode()
        except UnicodeDecodeError:
            return Failure(Code.INVALID, "the key is not UTF-8")
        item = AllocItem(key, DTYPES[dtype_code], list(shape[:ndim]), nbytes)
        failure = self.store.checks.item(lease.ns, item, (lease.pool,))
        return item if failure is None else failure

    def _meta(self, lease: PutLease, at: int, length: int) -> Any:
        """The EntryMeta a record's meta bytes encode (read from the pool), or a Failure."""
        raw = bytearray(length)
        if self.segments[lease.pool].read_into(at, memoryview(raw)) < length:
            return Failure(Code.INVALID, "its meta lies past the end of a truncated pool file")
        try:
            return self._meta_decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return Failure(Code.INVALID, f"its meta is not an EntryMeta: {exc}")

    def _refuse(self, state: _Page, seq: int, code: int, message: str) -> None:
        text = message.encode()[:ERROR.size - 16]
        slot = state.errors % ERRORS
        self.segment.write_at(state.at + ERRORS_AT + slot * ERROR.size, ERROR.pack(seq, int(code), len(text), text))
        if barrier is not None:
            barrier()  # the error before its count
        state.errors += 1
        self.segment.write_at(state.at + ERRORS_COUNT_AT, _U64.pack(state.errors))
        self.store.counters["submission_refused"] += 1
        log.debug("submission refused: session %d %s", state.session.id, message)

    def _refill(self, state: _Page, lease: PutLease) -> None:
        """Keep one lease granted ahead of the one being filled, so the client never waits for one.
        Not for a client the daemon cannot watch: its leases expire unused, and it can only know
        how old one is when it asked for it itself (LeaseSpace)."""
        if not state.session.watched:
            return
        tier = self.leasing.tier_of(lease)
        live = self.leasing.live(state.session, tier)
        if len(live) >= LIVE_LEASES or not live or live[-1] is not lease:
            return
        granted = self.leasing.grant(state.session, lease.ns, evict=False, tier=tier)
        if isinstance(granted, PutLease):
            self._write_grant(state, granted)

    def _write_grant(self, state: _Page, lease: PutLease) -> None:
        slot = state.grants % GRANTS
        self.segment.write_at(state.at + GRANTS_AT + slot * GRANT.size,
                              GRANT.pack(lease.generation, lease.pool, lease.start, lease.end - lease.start))
        if barrier is not None:
            barrier()
        state.grants += 1
        self.segment.write_at(state.at + GRANTS_COUNT_AT, _U64.pack(state.grants))

    # ---- when it runs ---------------------------------------------------------------------

    def start(self, loop: "asyncio.AbstractEventLoop") -> None:
        self._loop = loop
        if self._quarantined:
            loop.call_later(self._quarantine_s, self._end_quarantine)
        loop.add_reader(self.doorbell, self._on_doorbell)
        self._poller = loop.call_later(DOORBELL_POLL_S, self._poll)

    def stop(self) -> None:
        self._stopping = True
        for timer in (self._timer, self._poller):
            if timer is not None:
                timer.cancel()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.doorbell)

    def _on_doorbell(self) -> None:
        try:
            os.eventfd_read(self.doorbell)  # back to 0: the next ring wakes the loop again
        except BlockingIOError:
            pass  # another client read it first (a hostile one): it rang all the same
        self._rung()

    def _poll(self) -> None:
        """The safety net: a ring swallowed by another client is found here, and leases expire."""
        if self._stopping or self._loop is None:
            return
        self._rung()
        self._poller = self._loop.call_later(DOORBELL_POLL_S, self._poll)

    def _rung(self) -> None:
        if self._stopping:
            return
        now = time.monotonic()
        if now - self._last_expiry >= DOORBELL_POLL_S:
            self._last_expiry = now
            self._revoke_idle(float(self.store.leases.write_ttl))
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._tick()

    def _revoke_idle(self, write_ttl: float) -> None:
        """Mark revoked the leases of sessions that used none for the write TTL; free those marked
        long enough ago (leases.py)."""
        for state in self._by_session.values():
            below = self.leasing.idle(state.session, write_ttl)
            if below:
                self.segment.write_at(state.at + REVOKED_AT, _U64.pack(below))
        self.leasing.expire(write_ttl)

    def _tick(self) -> None:
        self._timer = None
        if self._stopping:
            return
        now = time.monotonic()
        if self.drain():
            self._last_record = now
        elif now - self._last_record >= IDLE_S:
            self._set_sleeping(True)
            full_barrier()  # `sleeping` stored before the last look (a client: its record, then `sleeping`)
            if not self.drain():
                return  # asleep: the doorbell wakes it
            self._last_record = now
        if self._asleep:
            self._set_sleeping(False)
        if self._loop is not None:
            self._timer = self._loop.call_later(POLL_S, self._tick)

    def _set_sleeping(self, asleep: bool) -> None:
        self._asleep = asleep
        self.segment.write_at(self.offset + SLEEPING_AT, _U32.pack(int(asleep)))

    def totals(self) -> tuple[int, int, int]:
        """(put leases, bytes they hold not yet carved, pages in use): for /metrics."""
        return (*self.leasing.totals(), len(self._by_session))
