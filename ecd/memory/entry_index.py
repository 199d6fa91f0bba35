"""What the daemon and its readers share to read without asking: the entry index (where READY
entries live, written by the daemon) and the read slots (what readers are reading, written by them).

It follows the event ring in the ring's file (`[ring] index_records` records; 0: none), so it is
mapped, sealed and handed out with the ring, and a client finds a committed entry's location
without asking, including one it never put or read before (client/local_read.py). It is only a
hint, like the presence table: a reader validates every copy it makes from a location against
the ring's events afterwards, and an entry that is not here (its bucket full, its key too long,
more than MAX_DIMS dimensions) is asked of the daemon.

Layout: `records` records of RECORD_WORDS u64 words, in buckets of WAYS records (the bucket is the
low bits of the key hash); an entry goes in any free record of its bucket, else it is not indexed.
A record:
  0  seq         even when whole, odd while the daemon rewrites it (a sequence lock)
  1  keyhash     ecd.memory.ring.key_hash(namespace, key)
  2  generation  0: the record is free
  3  pool, 4 offset, 5 nbytes, 6 checksum (0: none stored)
  7  dtype code | ndim << 8 | namespace length << 16 | key length << 32
  8-15   the shape (MAX_DIMS dimensions)
  16-31  namespace bytes then key bytes (KEY_BYTES at most; UTF-8): the exact key, so a 64-bit
         hash collision is never a hit

The sequence lock: the writer makes `seq` odd, (barrier) writes words 1-31, (barrier) makes it
even again. A reader copies the bucket's seq words, (barrier) the bucket, (barrier) the seq words
again, and uses a record only if its seq was even and unchanged; else it asks the daemon. On x86
the barriers are no instructions (memory/fence.py). The daemon keeps its own copy of every record
and never reads the mapping for its work: each heartbeat compares AUDIT_RECORDS records with that
copy and rewrites what another process changed (the named ring is writable by the daemon's user).
Garbage fails a reader's checks (key bytes, dtype, shape against size, bounds); a well-formed
forgery (another entry's offset under this key) does not: like forged ring events, it is outside
what a reader can check (docs/protocol.md).
"""
from __future__ import annotations

import heapq
import math
import struct

import numpy as np

from ..protocol import DTYPE_ITEMSIZE
from .fence import barrier as memory_barrier, full_barrier

RECORD_WORDS = 32
RECORD_BYTES = RECORD_WORDS * 8
WAYS = 4
MAX_DIMS = 8
KEY_BYTES = 16 * 8
_SHAPE, _KEY = 8, 16
# A bucket's seq words in one call (a record's word 0, then its other 31 skipped; struct reads a
# native-endian u64 with one 8-byte load, as the ring relies on); a record's words 0-7;
# its shape of 0..MAX_DIMS dimensions
_BUCKET_SEQS = struct.Struct("<" + f"Q{RECORD_BYTES - 8}x" * (WAYS - 1) + "Q")
_HEAD = struct.Struct("<8Q")
_SEQ = struct.Struct("<Q")
_EMPTY_RECORD = bytes(RECORD_BYTES)
_SHAPES = [struct.Struct(f"<{n}Q") for n in range(MAX_DIMS + 1)]
AUDIT_RECORDS = 4096  # records a heartbeat compares with the daemon's copy (1 MiB, ~0.1 ms)
# Stable codes for the dtypes (the position; never reorder, only append)
DTYPES = ("bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64", "float16", "bfloat16",
          "float32", "float64", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
          "float8_e5m2fnuz")
_DTYPE_CODE = {name: code for code, name in enumerate(DTYPES)}
assert set(DTYPES) == set(DTYPE_ITEMSIZE)


def index_bytes(records: int) -> int:
    return records * RECORD_BYTES


class _IndexView:
    def __init__(self, buf, offset: int, records: int) -> None:
        if records and (records < WAYS or records & (records - 1)):
            raise ValueError(f"index records must be 0 or a power of two >= {WAYS}, got {records}")
        self.records = records
        self.words = np.frombuffer(buf, np.uint64, count=records * RECORD_WORDS, offset=offset).reshape(
            records, RECORD_WORDS)
        self.bucket_mask = max(records // WAYS - 1, 0)
        self._raw = memoryview(buf)[offset:offset + records * RECORD_BYTES]  # the records as bytes (struct)


class IndexWriter(_IndexView):
    """The daemon's side (its event loop is the only writer). Records are packed with struct and
    written as bytes (a commit indexes one, an eviction clears one: numpy's per-call cost made
    that ~5 us a put)."""

    def __init__(self, buf, offset: int, records: int) -> None:
        super().__init__(buf, offset, records)
        self.words[:] = 0
        self._truth = np.zeros((records, RECORD_WORDS), np.uint64)  # what the mapping should hold
        self._truth_raw = memoryview(self._truth.reshape(-1).view(np.uint8).data)
        self._generations = [0] * records  # each record's generation (0: free), for the free-record search
        self._record_of: dict[int, int] = {}  # generation -> record
        self._audit_at = 0  # the next record a heartbeat compares
        self.repairs = 0
        self.skipped = 0  # entries not indexed: a full bucket, a long key, too many dimensions

    def put(self, keyhash: int, namespace: str, key: str, generation: int, pool: int, offset: int, nbytes: int,
            dtype: str, shape, checksum: int) -> bool:
        """Index a READY entry (False: not indexed; readers then ask the daemon)."""
        if not self.records:
            return False
        ns_bytes, key_bytes = namespace.encode(), key.encode()
        names = ns_bytes + key_bytes
        code = _DTYPE_CODE.get(dtype)
        if len(names) > KEY_BYTES or len(shape) > MAX_DIMS or code is None:
            self.skipped += 1
            return False
        first = (keyhash & self.bucket_mask) * WAYS
        try:
            record = self._generations.index(0, first, first + WAYS)
        except ValueError:
            self.skipped += 1
            return False
        row = bytearray(RECORD_BYTES)
        _HEAD.pack_into(row, 0, 0, keyhash, generation, pool, offset, nbytes, checksum,
                        code | len(shape) << 8 | len(ns_bytes) << 16 | len(key_bytes) << 32)
        _SHAPES[len(shape)].pack_into(row, _SHAPE * 8, *shape)
        row[_KEY * 8:_KEY * 8 + len(names)] = names
        self._write(record, row)
        self._generations[record] = generation
        self._record_of[generation] = record
        return True

    def record_of(self, generation: int) -> int | None:
        """The record an indexed generation was written to (None: not indexed)."""
        return self._record_of.get(generation)

    def remove(self, generation: int) -> None:
        """The entry leaves the index (before its event is appended and its extent freed)."""
        record = self._record_of.pop(generation, None)
        if record is None:
            return
        self._generations[record] = 0
        self._write(record, _EMPTY_RECORD)

    def _write(self, record: int, row) -> None:
        """`row`'s bytes 8-255 (words 1-31) into the record under its sequence lock (a seq past
        whatever the mapping shows, so a reader that copied a scribbled record sees it change)."""
        at = record * RECORD_BYTES
        seq = _SEQ.unpack_from(self._truth_raw, at)[0] + 1
        raw, barrier = self._raw, memory_barrier
        _SEQ.pack_into(raw, at, seq)  # odd: readers leave it alone
        if barrier is not None:
            barrier()
        raw[at + 8:at + RECORD_BYTES] = row[8:]
        if barrier is not None:
            barrier()
        _SEQ.pack_into(raw, at, seq + 1)
        self._truth_raw[at + 8:at + RECORD_BYTES] = row[8:]
        _SEQ.pack_into(self._truth_raw, at, seq + 1)

    def repair(self, records: int = AUDIT_RECORDS) -> bool:
        """Rewrite the records another process changed among the next `records` (True if any),
        from the daemon's own copy: the ring's heartbeat audits the index a slice at a time."""
        if not self.records:
            return False
        lo = self._audit_at
        hi = min(lo + records, self.records)
        damaged = np.flatnonzero((self.words[lo:hi] != self._truth[lo:hi]).any(axis=1)) + lo
        for record in damaged.tolist():
            self._write(record, self._truth[record].tobytes())
        self._audit_at = hi if hi < self.records else 0
        self.repairs += bool(damaged.size)
        return bool(damaged.size)


class IndexReader(_IndexView):
    """A client's side: bounded time, raises nothing, believes nothing it cannot check. Read with
    struct from a memoryview (a lookup is on every first read of an entry another process put:
    ~2 us, where numpy's per-call cost made it ~9)."""

    def lookup(self, keyhash: int, namespace: str, key: str) -> tuple | None:
        """(generation, pool, offset, nbytes, dtype, shape, checksum) of the entry under exactly
        (namespace, key) as the index shows it now, or None (not indexed, mid-write, odd)."""
        if not self.records:
            return None
        raw, base = self._raw, (keyhash & self.bucket_mask) * WAYS * RECORD_BYTES
        seqs = _BUCKET_SEQS.unpack_from(raw, base)
        barrier = memory_barrier
        if barrier is not None:
            barrier()
        bucket = raw[base:base + WAYS * RECORD_BYTES].tobytes()
        if barrier is not None:
            barrier()
        after = _BUCKET_SEQS.unpack_from(raw, base)
        names = b""
        for way in range(WAYS):
            at = way * RECORD_BYTES
            seq, hashed, generation, pool, offset, nbytes, checksum, packed = _HEAD.unpack_from(bucket, at)
            if hashed != keyhash or seq & 1 or seq != seqs[way] or seq != after[way]:
                continue
            names = names or namespace.encode() + key.encode()
            code, ndim, ns_len, key_len = packed & 0xFF, packed >> 8 & 0xFF, packed >> 16 & 0xFFFF, packed >> 32
            if (generation == 0 or code >= len(DTYPES) or ndim > MAX_DIMS or ns_len + key_len != len(names)
                    or len(names) > KEY_BYTES or ns_len != len(namespace.encode())
                    or bucket[at + _KEY * 8:at + _KEY * 8 + len(names)] != names):
                continue
            shape = list(_SHAPES[ndim].unpack_from(bucket, at + _SHAPE * 8))
            dtype = DTYPES[code]
            if math.prod(shape) * DTYPE_ITEMSIZE[dtype] != nbytes:
                continue  # not what the daemon writes: ask
            return generation, pool, offset, nbytes, dtype, shape, checksum
        return None


# ---- read slots ------------------------------------------------------------------------------
#
# A read lease without a message (hazard pointers). The daemon keeps pages of slots after host pool
# segment 0's share of the pool (so they are mapped, handed out and kept across restarts with it) and
# gives each session one page in its Welcome. A slot is two u64 words: the generation read (0: the
# slot is free) and a deadline in CLOCK_MONOTONIC nanoseconds (0: held until cleared, a view; else
# a pin, held until then).
#
# Reader: store the slot, full fence, then re-check the ring (the location must still be cached:
# no EVICTED/DELETED/replacing event named it). Daemon: append the entry's event, full fence, then
# scan the slots, and free the extent only if no slot names its generation (else it keeps it
# RETIRED and looks again each expiry tick). One of the two sees the other: a reader that passed its
# re-check is seen by every scan that follows the event, so the extent is not reused under it.
# Release is a store of 0. A slot costs its writer nothing but bounds: `[leases] read_slots` per
# session, a pin's deadline at most max_pin ahead (a later one is ignored: it protects nothing),
# and the page goes (zeroed) with the session.
#
# A pin slot (deadline > 0: exists(pin_s), client/pins.py) keeps its entry out of eviction plans
# until the deadline, within the pin budget; it never defers a free (a deleted or replaced entry's
# pin moves to the new generation as a daemon pin, Deadlines.pin). Its order: the client reads the
# ring's plan word, stores the slot, full fence, re-checks the ring and the plan word; the daemon
# makes the word odd, full fence, scans, evicts (events), makes it even (ring.py plan_begin).
SLOT_WORDS = 2
SLOT_BYTES = SLOT_WORDS * 8


def slot_area_bytes(pages: int, slots: int) -> int:
    """Bytes of the slot area, a whole number of 4 KiB pages (0: read slots are off)."""
    return -(-pages * slots * SLOT_BYTES // 4096) * 4096 if pages and slots else 0


def slot_area_at_end(segment, pages: int, slots: int) -> "SlotArea | None":
    """The slot area: the last bytes of `segment` (host pool segment 0, made that much longer than
    its share of the pool: HostPool's `tail`); None when read slots are off."""
    size = slot_area_bytes(pages, slots)
    return SlotArea(segment, segment.size - size, pages, slots) if size else None


class SlotArea:
    """The daemon's side: assigns pages to sessions and scans them before an extent is freed."""

    def __init__(self, segment, offset: int, pages: int, slots: int) -> None:
        """`segment`: host pool segment 0 (its ShmFile; read with pread, so a truncated named
        file reads as zeros instead of faulting); the area is its bytes from `offset`."""
        self.segment, self.offset, self.pages, self.slots = segment, offset, pages, slots
        self.page_bytes = slots * SLOT_BYTES
        self.nbytes = slot_area_bytes(pages, slots)  # what segment 0's allocator leaves out
        self._free = list(range(pages))  # a heap: the lowest page first, so scans read a short prefix
        self._assigned: set[int] = set()
        self._scan_pages = 0  # pages a scan reads: up to the highest one assigned
        self._raw = bytearray(pages * slots * SLOT_BYTES)  # what a scan reads (a bytearray: == is a memcmp)
        self._buf = np.frombuffer(self._raw, np.uint64).reshape(pages * slots, SLOT_WORDS)
        self._zeros = bytes(len(self._raw))
        self._ghosts: frozenset[int] = frozenset()  # a previous run's slots, honoured until _ghosts_until
        self._ghosts_until = 0
        self.scans = 0

    def assign(self) -> int | None:
        """A free page for a new session (None: all are taken; that session asks the daemon)."""
        if not self._free:
            return None
        page = heapq.heappop(self._free)
        self._assigned.add(page)
        self._scan_pages = max(self._scan_pages, page + 1)
        return page

    def location(self, page: int) -> tuple[int, int]:
        """(offset in segment 0, slots) of a page."""
        return self.offset + page * self.page_bytes, self.slots

    def _page(self, page: int) -> np.ndarray:
        words = np.zeros((self.slots, SLOT_WORDS), np.uint64)
        self.segment.read_into(self.offset + page * self.page_bytes, words.data.cast("B"))
        return words

    def release(self, page: int) -> int:
        """The session ended: its slots are dropped (zeroed) and the page is free again. The
        number of slots it held."""
        held = int(np.count_nonzero(self._page(page)[:, 0]))
        self.segment.write_at(self.offset + page * self.page_bytes, bytes(self.page_bytes))
        heapq.heappush(self._free, page)
        self._assigned.discard(page)
        self._scan_pages = max(self._assigned) + 1 if self._assigned else 0
        return held

    def revoke(self, page: int, generation: int) -> int:
        """Clear the page's slots that name `generation` (a forced eviction of an entry a session
        the daemon cannot watch holds); how many."""
        slots = np.flatnonzero(self._page(page)[:, 0] == np.uint64(generation)).tolist()
        for slot in slots:
            self.segment.write_at(self.offset + page * self.page_bytes + slot * SLOT_BYTES, bytes(SLOT_BYTES))
        return len(slots)

    def held(self, now_ns: int, max_pin_ns: int) -> frozenset[int] | set[int]:
        """The generations a read slot (a view) holds now. Called after the events of what is
        about to be freed are appended: the fence orders those stores before these loads."""
        return self.scan(now_ns, max_pin_ns)[0]

    def scan(self, now_ns: int, max_pin_ns: int, pages: int | None = None) -> tuple[frozenset[int] | set[int], list]:
        """(generations read slots hold, [(page, generation, deadline_ns)] of live pin slots)."""
        pages = self._scan_pages if pages is None else pages
        if not pages and not self._ghosts:
            return frozenset(), []
        full_barrier()
        self.scans += 1
        buf = self._buf[:pages * self.slots]
        got = self.segment.read_into(self.offset, buf.data.cast("B")) if pages else 0
        if got < buf.nbytes:  # truncated: what is gone holds nothing (its readers fault anyway)
            buf.view(np.uint8)[got:] = 0
        held: set[int] = set()
        pins: list = []
        if self._raw[:buf.nbytes] != self._zeros[:buf.nbytes]:  # the usual case, nothing held: one memcmp
            generations, deadlines = buf[:, 0], buf[:, 1]
            named = generations != 0
            held = set(generations[named & (deadlines == 0)].tolist())
            pinned = np.flatnonzero(named & (deadlines > np.uint64(now_ns))
                                    & (deadlines <= np.uint64(now_ns + max_pin_ns)))
            pins = [(slot // self.slots, int(generations[slot]), int(deadlines[slot])) for slot in pinned.tolist()]
        if self._ghosts:
            if now_ns < self._ghosts_until:
                held |= self._ghosts
            else:
                self._ghosts = frozenset()
        return held, pins

    def drop_ghost(self, generation: int) -> None:
        if generation in self._ghosts:
            self._ghosts = self._ghosts - {generation}

    def adopt(self, now_ns: int, quarantine_ns: int, max_pin_ns: int) -> int:
        """At start, over a kept pool: what the previous run's readers' slots held stays held for
        `quarantine_ns` (their clients reconnect and take new slots or leases by then); then the
        area is cleared for this run's sessions. The number of generations held."""
        ghosts = self.scan(now_ns, max_pin_ns, self.pages)[0]  # reads: a pin holds nothing across a restart
        self._ghosts, self._ghosts_until = frozenset(ghosts), now_ns + quarantine_ns
        self.segment.write_at(self.offset, bytes(self._buf.nbytes))
        return len(ghosts)


class SlotPage:
    """A client's side: its session's page, written only by this client (under its lock)."""

    def __init__(self, buf, offset: int, slots: int) -> None:
        self.words = np.frombuffer(buf, np.uint64, count=slots * SLOT_WORDS, offset=offset).reshape(slots, SLOT_WORDS)
        self.words[:] = 0  # a fresh session's page (the daemon zeroed it; a reconnect may reuse ours)
        self._free = list(range(slots))

    @property
    def available(self) -> int:
        return len(self._free)

    def hold(self, generations: list[int], deadline_ns: int = 0) -> list[int] | None:
        """Slots naming `generations` (None: not enough free; nothing written). The caller
        fences (full_barrier) and re-checks the ring before it reads."""
        if len(generations) > len(self._free):
            return None
        taken = self._free[-len(generations):] if generations else []
        del self._free[len(self._free) - len(generations):]
        words = self.words
        for slot, generation in zip(taken, generations):
            words[slot, 1] = deadline_ns
            words[slot, 0] = generation
        return taken

    def extend(self, slot: int, deadline_ns: int) -> None:
        """A later deadline for a pin slot (the same generation: no fence needed)."""
        if deadline_ns > int(self.words[slot, 1]):
            self.words[slot, 1] = deadline_ns

    def clear(self, slots: list[int]) -> None:
        words = self.words
        for slot in slots:
            words[slot, 0] = 0
            words[slot, 1] = 0
        self._free += slots
