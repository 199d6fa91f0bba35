"""The journal: what the host pool holds, written as it changes, in shared memory that outlives the
daemon (a memfd or /dev/shm file the keeper holds, ecd/daemon/restart/keeper.py), so that the
next daemon of the node adopts the pool instead of starting cold (ecd/daemon/restart/adopt.py).

One record per extent in use. A named put's extent gets an ENTRY record at its Alloc (generation,
pool, offset, nbytes, dtype, shape, namespace, key), in state WRITING; its commit writes the
checksum and the key's ring hash and flips the state to COMMITTED (small stores: the record is
written once per put), before the commit is answered, so every put that returned is in the
journal. A reservation's anonymous extent has an INTENT record (generation, pool, offset, size)
until Publish names it. After a restart a WRITING entry's or an intent's extent is kept out of use
for a write TTL (the old daemon's client may still be copying into it) and never served. A record
is zeroed when its extent stops holding it (the entry leaves the index, the write is aborted):
before the extent can be handed out again, since the daemon is single-threaded. An entry that
leaves the index while readers still hold it goes back to WRITING until it is freed.

Trust: every record carries a MAC (keyed BLAKE2b-64) over all of it but the state, checksum and
key-hash words. The key is a secret of 32 random bytes that is never written beside what it
authenticates: the daemon keeps it in a sealed memfd of its own ("journal.key": restart/adopt.py)
and hands that to the keeper with the pool (issue 40: a journal that carried its own key could
be forged by anyone who could write one, a fake holder's in particular). Clients never get the
journal nor the key. A record torn by a kill in the middle of its write, or bytes a bug
left behind, fail it and are skipped, never adopted; a client-chosen key cannot smuggle a record
in. The commit stores the checksum and key hash first, the state last (one byte): a kill between
them leaves a WRITING record, never a COMMITTED one without its checksum. The header names the
layout (node, backing, the segments' sizes, the format): a journal of another layout is refused
as a whole.

Space: 64-byte granules; a record takes a power-of-two run aligned to its size, from a stack of
free runs per size (O(1)), split from a bigger free run when none of its size is free. When a
record finds no run at all, the free runs are merged with their neighbours and cut again (rare,
O(free runs)): records of changing sizes never strand the space. Entry records fill at most
ENTRY_SHARE of it: a put whose entry does not fit gets a one-granule INTENT instead, so its
extent is still quarantined after a restart (the entry is stored as usual, it just is not
adopted: counted).
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from typing import Any, Sequence

from .allocator import ALIGNMENT, align_up

GRANULE = 64
HEADER_BYTES = 4096
FORMAT = 2  # the records' layout: a daemon that reads another refuses the journal (a cold start)
# (1: its MAC key was in its header)
KEY_BYTES = 32
MAGIC = b"ECDJRNL\x00"
_PREFIX = b"\xecJ\x01"  # records start with _PREFIX + a kind byte
ENTRY_MAGIC = _PREFIX + b"E"
INTENT_MAGIC = _PREFIX + b"I"
_HEAD = struct.Struct("<4sHH")  # magic, granules, payload bytes (the MAC follows: 8 bytes)
_ENTRY = struct.Struct("<QIQQBBHH")  # generation, pool, offset, nbytes, ndim, dtype, ns, key lengths
# generation, pool, offset and size in ALIGNMENT units (extents are aligned): one granule in all
_INTENT = struct.Struct("<QHII")
_HEADER = struct.Struct("<8sII32sQ8s")  # magic, format, layout bytes, 32 reserved (zero), size, MAC
_RESERVED = bytes(32)
ENTRY_SHARE = 0.875  # entry records may fill this much of the journal; the rest is the intents'
MAX_CLASS = 8  # records of up to 2**8 granules (16 KiB): a 1 KiB namespace and a 1 KiB key fit easily
_ZEROS = [bytes(GRANULE << cls) for cls in range(MAX_CLASS + 1)]  # what a forgotten record's run becomes
SHAPES_CACHED = 4096  # packed shapes kept (entries come in a few shapes; clients choose them)
STATE_AT = _HEAD.size + 8  # one byte, outside the MAC: WRITING (0) or COMMITTED (1)
CHECKSUM_AT = STATE_AT + 8  # the entry's checksum (u64), outside the MAC: written by the commit
KEYHASH_AT = CHECKSUM_AT + 8  # the ring's hash of its key (u64), also the commit's: adoption needs no hashing
PAYLOAD_AT = KEYHASH_AT + 8
WRITING, COMMITTED = 0, 1
_COMMIT = struct.Struct("<QQ")  # checksum, keyhash
_UNCOMMITTED = bytes(PAYLOAD_AT - STATE_AT)  # state WRITING, checksum 0


class JournalRefused(Exception):
    """The journal cannot be adopted as a whole; the message is the log line's reason."""


@dataclass(frozen=True)
class Layout:
    """What a journal's records mean only together with: refused when it differs."""

    node: str
    backing: str
    segments: tuple[int, ...]  # the host pool's segment sizes, in order
    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)  # sized tenant -> its segments

    def encode(self) -> bytes:
        layout: dict = {"format": FORMAT, "node": self.node, "backing": self.backing, "segments": list(self.segments)}
        if self.groups:  # (a pool without sized tenants reads as it did before they existed)
            layout["groups"] = {name: list(pools) for name, pools in self.groups.items()}
        return json.dumps(layout, sort_keys=True).encode()


@dataclass(slots=True)
class EntryRecord:
    at: int  # the record's offset in the journal
    committed: bool  # False: a put the old daemon had not committed (its extent is quarantined)
    keyhash: int  # the ring's hash of (ns, key), as the commit recorded it (0: not committed)
    generation: int
    pool: int
    offset: int
    nbytes: int
    checksum: int
    dtype: str
    shape: tuple[int, ...]
    ns: str
    key: str


@dataclass(slots=True)
class IntentRecord:
    at: int
    generation: int
    pool: int
    offset: int
    size: int


class Journal:
    """Records in `buf` (a writable mapping of `size` bytes); `key` (KEY_BYTES, secret) keys
    their MACs and the header's."""

    def __init__(self, buf: Any, size: int, key: bytes, pools: int) -> None:
        if size < HEADER_BYTES + (GRANULE << MAX_CLASS):
            raise ValueError(f"a journal needs at least {HEADER_BYTES + (GRANULE << MAX_CLASS)} bytes, got {size}")
        self.buf = buf
        self.size = size
        if len(key) != KEY_BYTES:
            raise ValueError(f"a journal key is {KEY_BYTES} bytes, got {len(key)}")
        self._keyed = hashlib.blake2b(key=key, digest_size=8)  # copied per record: half a keyed init's cost
        self._shapes: dict[Any, bytes] = {}  # shape -> its packed bytes
        self.pools = pools  # host pool segments: extents in other pools (CUDA arenas) die with the process
        # per class: a stack of its free runs' offsets (runs aligned to their size from
        # HEADER_BYTES, the lowest on top at first: records start packed, and so do their pages)
        self._free: list[list[int]] = [[] for _ in range(MAX_CLASS + 1)]
        self._merged = True  # nothing was freed since the free runs were last merged
        self._release_gap(HEADER_BYTES, size)
        self._lowest_on_top()
        self.records = 0
        self.used = 0  # bytes of the runs records take
        self.full = 0  # entries not recorded for want of space (not adopted; their extents quarantined)

    # ---- creating and opening -----------------------------------------------------------

    @classmethod
    def create(cls, buf: Any, size: int, layout: Layout, key: bytes) -> "Journal":
        """A new journal for `layout` in fresh (zeroed) memory, its MACs keyed by `key`
        (new_key()): its header written."""
        layout_bytes = layout.encode()
        if _HEADER.size + len(layout_bytes) > HEADER_BYTES:
            raise ValueError("the pool has too many segments for the journal's header")
        journal = cls(buf, size, key, len(layout.segments))
        head = _HEADER.pack(MAGIC, FORMAT, len(layout_bytes), _RESERVED, size, b"\0" * 8)
        buf[:_HEADER.size] = head[:-8] + journal._sign(head[:-8] + layout_bytes)
        buf[_HEADER.size:_HEADER.size + len(layout_bytes)] = layout_bytes
        return journal

    @classmethod
    def open(cls, buf: Any, size: int, layout: Layout,
             key: bytes) -> "tuple[Journal, list[EntryRecord], list[IntentRecord], int]":
        """Adopt the journal in `buf`, keyed by `key`: its valid records, and how many were
        skipped (torn or stray). JournalRefused when the header is not a journal of `layout`
        signed with `key`."""
        head = bytes(buf[:_HEADER.size])
        magic, fmt, layout_len, _reserved, recorded_size, mac = _HEADER.unpack(head)
        if magic != MAGIC:
            raise JournalRefused("the journal has no valid header")
        if fmt != FORMAT:
            raise JournalRefused(f"the journal is of format {fmt}, this ecd reads format {FORMAT} "
                                 "(an incompatible version of ecd wrote it)")
        if recorded_size != size or _HEADER.size + layout_len > HEADER_BYTES:
            raise JournalRefused(f"the journal is {size} bytes, its header says {recorded_size}")
        layout_bytes = bytes(buf[_HEADER.size:_HEADER.size + layout_len])
        journal = cls(buf, size, key, len(layout.segments))
        if journal._sign(head[:-8] + layout_bytes) != mac:
            raise JournalRefused("the journal's header fails its MAC: it was not written with the key kept beside "
                                 "it (forged, or corrupted)")
        theirs, ours = json.loads(layout_bytes), json.loads(layout.encode())
        for name in ("node", "backing", "segments"):
            if theirs.get(name) != ours[name]:
                raise JournalRefused(f"the pool was made with {name} = {theirs.get(name)!r}, the config now "
                                     f"gives {ours[name]!r}")
        if theirs.get("groups", {}) != ours.get("groups", {}):  # a segment of one tenant's is not another's
            raise JournalRefused(f"the pool's tenants' segments were {theirs.get('groups', {})}, the config now "
                                 f"gives {ours.get('groups', {})} (a [tenants.NAME] size or name changed)")
        entries, intents, skipped = journal._scan()
        return journal, entries, intents, skipped

    def _scan(self) -> tuple[list[EntryRecord], list[IntentRecord], int]:
        """Every valid record; the space between them zeroed and made free again."""
        buf, end = self.buf, self.size
        entries: list[EntryRecord] = []
        intents: list[IntentRecord] = []
        used: list[tuple[int, int]] = []  # (offset, bytes) of the valid records, in order
        skipped = torn_until = 0
        at = buf.find(_PREFIX, HEADER_BYTES)
        while 0 <= at < end:
            if at % GRANULE:
                at = buf.find(_PREFIX, at + 1)
                continue
            record = self._parse(at)
            if record is None:
                skipped += 1
                torn_until = at + (GRANULE << MAX_CLASS)  # as far as a record that starts here reaches
                at = buf.find(_PREFIX, at + GRANULE)
                continue
            run = GRANULE * _HEAD.unpack_from(buf, at)[1]
            if isinstance(record, EntryRecord):
                entries.append(record)
            else:
                intents.append(record)
            used.append((at, run))
            at = buf.find(_PREFIX, at + run)
        self._rebuild_free(used, torn_until)
        self.records = len(used)
        self.used = sum(run for _, run in used)
        return entries, intents, skipped

    def _parse(self, at: int) -> "EntryRecord | IntentRecord | None":
        magic, granules, payload = _HEAD.unpack_from(self.buf, at)
        run = GRANULE * granules
        if (magic not in (ENTRY_MAGIC, INTENT_MAGIC) or granules == 0 or granules & (granules - 1)
                or granules > 1 << MAX_CLASS or at + run > self.size or PAYLOAD_AT + payload > run):
            return None
        record = self.buf[at:at + PAYLOAD_AT + payload]  # one copy out of the mapping
        body = record[PAYLOAD_AT:]
        if self._sign(record[:_HEAD.size] + body) != record[_HEAD.size:STATE_AT]:
            return None
        try:
            if magic == INTENT_MAGIC:
                generation, pool, units, size_units = _INTENT.unpack(body)
                return IntentRecord(at, generation, pool, units * ALIGNMENT, size_units * ALIGNMENT)
            generation, pool, offset, nbytes, ndim, dtype_len, ns_len, key_len = _ENTRY.unpack_from(body)
            pos = _ENTRY.size
            shape = struct.unpack_from(f"<{ndim}q", body, pos)
            pos += 8 * ndim
            dtype = body[pos:pos + dtype_len].decode()
            pos += dtype_len
            ns = body[pos:pos + ns_len].decode()
            key = body[pos + ns_len:pos + ns_len + key_len].decode()
        except (struct.error, UnicodeDecodeError, ValueError):
            return None  # a valid MAC over a body this format cannot read: not ours to trust
        committed = record[STATE_AT] == COMMITTED
        checksum, keyhash = _COMMIT.unpack_from(record, CHECKSUM_AT)
        return EntryRecord(at, committed, keyhash, generation, pool, offset, nbytes, checksum, dtype, tuple(shape), ns, key)

    def _rebuild_free(self, used: Sequence[tuple[int, int]], torn_until: int) -> None:
        """After a scan: the gaps between the records cut into free runs, and zeroed as far as
        something torn was seen (`torn_until`: nothing torn stays behind to be half-overwritten
        later); the rest was never written or was zeroed when forgotten, and writing it would
        fault in every page of a large journal."""
        self._free = [[] for _ in range(MAX_CLASS + 1)]
        position = HEADER_BYTES
        for at, run in [*used, (self.size, 0)]:
            if position < at:
                zero_end = min(at, torn_until)
                if position < zero_end:
                    self.buf[position:zero_end] = bytes(zero_end - position)
                self._release_gap(position, at)
            position = at + run
        self._lowest_on_top()

    def _release_gap(self, start: int, end: int) -> None:
        """[start, end) as free runs: the largest aligned ones that fit."""
        while start + GRANULE <= end:
            index = (start - HEADER_BYTES) // GRANULE
            cls = MAX_CLASS
            while cls and (index & ((1 << cls) - 1) or start + (GRANULE << cls) > end):
                cls -= 1
            self._free[cls].append(start)
            start += GRANULE << cls

    def _lowest_on_top(self) -> None:
        for runs in self._free:
            runs.reverse()

    def _merge_free(self) -> None:
        """Every free run merged with its free neighbours and cut again into the largest aligned
        runs: what forgetting records of one size leaves becomes room for records of another.
        O(free runs); done only when a record finds no run, and not again until one is freed."""
        runs = sorted((at, GRANULE << cls) for cls, stack in enumerate(self._free) for at in stack)
        self._free = [[] for _ in range(MAX_CLASS + 1)]
        start = end = -1
        for at, run in runs:
            if at != end:
                if start >= 0:
                    self._release_gap(start, end)
                start = at
            end = at + run
        if start >= 0:
            self._release_gap(start, end)
        self._lowest_on_top()
        self._merged = True

    # ---- writing ------------------------------------------------------------------------

    def intent(self, generation: int, pool: int, offset: int, size: int) -> int:
        """Record an extent being written; its record's offset (-1: the journal is full, or the
        extent is in a CUDA arena, which no restart adopts)."""
        if pool >= self.pools:
            return -1
        return self._intent(generation, pool, offset, size)

    def entry(self, generation: int, pool: int, offset: int, nbytes: int, dtype: str, shape: Sequence[int],
              ns: str, key: str, checksum: int = 0, keyhash: int = 0, committed: bool = False) -> int:
        """Record a named put's extent (WRITING until `commit`, or COMMITTED at once); its record's
        offset (-1: full, too large to record, or in a CUDA arena)."""
        if pool >= self.pools:
            return -1
        dtype_b, ns_b, key_b = dtype.encode(), ns.encode(), key.encode()
        packed = self._shapes.get(shape)
        if packed is None:
            packed = struct.pack(f"<{len(shape)}q", *shape)
            if len(self._shapes) < SHAPES_CACHED:
                self._shapes[tuple(shape)] = packed
        body = (_ENTRY.pack(generation, pool, offset, nbytes, len(shape), len(dtype_b), len(ns_b), len(key_b))
                + packed + dtype_b + ns_b + key_b)
        at = self._write(ENTRY_MAGIC, body, ENTRY_SHARE)
        if at < 0:  # no room for the entry (not adopted): its extent is still kept out of use
            self.full += 1
            return self._intent(generation, pool, offset, align_up(max(nbytes, 1)))
        if committed:
            self.commit(at, checksum, keyhash)
        return at

    def commit(self, at: int, checksum: int, keyhash: int) -> None:
        """The put recorded at `at` is committed (a no-op for -1): its checksum and key hash, then
        its state."""
        if at < 0:
            return
        _COMMIT.pack_into(self.buf, at + CHECKSUM_AT, checksum, keyhash)
        self.buf[at + STATE_AT] = COMMITTED

    def uncommit(self, at: int) -> None:
        """The entry recorded at `at` left the index while readers still hold its bytes (deleted,
        replaced): never adopted again, but its extent stays out of use for a write TTL after a
        restart, as an unfinished write's does (a no-op for -1)."""
        if at >= 0:
            self.buf[at + STATE_AT] = WRITING

    def _intent(self, generation: int, pool: int, offset: int, size: int) -> int:
        return self._write(INTENT_MAGIC, _INTENT.pack(generation, pool, offset // ALIGNMENT,
                                                      align_up(size) // ALIGNMENT))

    def forget(self, at: int) -> None:
        """Zero the record at `at` (a no-op for -1) and free its run."""
        if at < 0:
            return
        cls = _HEAD.unpack_from(self.buf, at)[1].bit_length() - 1
        self.buf[at:at + (GRANULE << cls)] = _ZEROS[cls]
        self.used -= GRANULE << cls
        self._free[cls].append(at)
        self._merged = False
        self.records -= 1

    def _write(self, magic: bytes, body: bytes, share: float = 1.0) -> int:
        """A record in a free run (-1: none, or it would take the records past `share` of the
        journal: entries leave the rest to intents, so that a full journal still quarantines the
        extents of the writes it could not record)."""
        need = -(-(PAYLOAD_AT + len(body)) // GRANULE)
        cls = (need - 1).bit_length()
        if cls > MAX_CLASS or self.used + (GRANULE << cls) > share * (self.size - HEADER_BYTES):
            return -1
        at = self._take(cls)
        if at < 0:
            return -1
        self.used += GRANULE << cls
        head = _HEAD.pack(magic, 1 << cls, len(body))
        self.buf[at:at + PAYLOAD_AT + len(body)] = head + self._sign(head + body) + _UNCOMMITTED + body
        self.records += 1
        return at

    def _sign(self, data: bytes) -> bytes:
        mac = self._keyed.copy()
        mac.update(data)
        return mac.digest()

    def _take(self, cls: int) -> int:
        """A free run of class `cls` (the last freed first), split from a bigger one when there is
        none, after merging the free runs when that may help; -1 when none can be had."""
        at = self._pop(cls)
        if at < 0 and not self._merged:
            self._merge_free()
            at = self._pop(cls)
        return at

    def _pop(self, cls: int) -> int:
        free = self._free
        for bigger in range(cls, MAX_CLASS + 1):
            if free[bigger]:
                at = free[bigger].pop()
                while bigger > cls:  # keep the lower half, free the upper
                    bigger -= 1
                    free[bigger].append(at + (GRANULE << bigger))
                return at
        return -1


class NullJournal:
    """No adoption (`[restart] adopt = false`): records cost nothing and are not kept."""

    records = full = 0

    def intent(self, generation: int, pool: int, offset: int, size: int) -> int:
        return -1

    def entry(self, generation: int, pool: int, offset: int, nbytes: int, dtype: str, shape: Sequence[int],
              ns: str, key: str, checksum: int = 0, keyhash: int = 0, committed: bool = False) -> int:
        return -1

    def commit(self, at: int, checksum: int, keyhash: int) -> None:
        pass

    def uncommit(self, at: int) -> None:
        pass

    def forget(self, at: int) -> None:
        pass


def default_size(pool_size: int) -> int:
    """`[restart] journal_size = 0`: pool.host.size / 256, at least 16 MiB, rounded to 4 KiB."""
    return max(16 << 20, -(-(pool_size // 256) // 4096) * 4096)


def new_key() -> bytes:
    """A fresh secret for a new journal's MACs."""
    return os.urandom(KEY_BYTES)
