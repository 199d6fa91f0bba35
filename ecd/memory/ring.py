"""The event ring: one shared-memory file the daemon alone writes and every client reads.

Layout (little-endian, all fields naturally aligned):
  header page (4096 B): magic, version, slot count, bucket count, epoch, three zero words (the
                         64 bytes that never change), write_seq, heartbeat (CLOCK_MONOTONIC ns),
                         closed flag, eviction plans (RingWriter.plan_begin)
  presence table:       `buckets` x u64 - ABSENT where no READY entry's key hashes to the bucket;
                         the key hash itself where every READY entry in the bucket has that one
                         hash (one key, or generations of it); SHARED where keys of two hashes
                         met there (until the bucket empties). So clients answer exists() locally:
                         ABSENT means "certainly absent", a word equal to the key's own hash
                         "present" (see "What a presence word promises")
  event slots:          `slots` x [seq, kind, keyhash, generation] (4 x u64)

The writer never waits for readers. It fills a slot (its sequence number and the event), then
advances write_seq. A reader copies the slots between its position and write_seq, then reads
write_seq again: if the writer may have started to overwrite one of them meanwhile, the reader
was overrun and throws the copy away; it drops what it cached and resyncs. It never returns an
event whose words come from two appends, on any CPU (see "Memory ordering" below).

Nothing here is trusted, by either side. The file is 0640 and clients map it read-only, but a
process of the daemon's user (or root) can still scribble over it (a buggy tool; a hostile one). So:
- the daemon keeps the truth (sequence, per-bucket counts, the fixed header words) in private
  memory and never reads the mapping back except to compare it with that truth; every heartbeat
  it rewrites what differs (the header at once, the presence table a slice at a time);
- a reader checks what it reads in O(1) per poll (the fixed header words as one bytes compare,
  write_seq against its own position, the slot stamps and kinds it reads anyway), and each
  presence word is ABSENT, SHARED or a key hash whose low bits are its own bucket number, so a
  zeroed or garbled table reads as none of them, and only ABSENT means "absent". Whatever fails
  a check is handled like an
  overrun: drop what was derived from the ring, resync, ask the daemon; it is counted and
  logged once. Corruption costs round trips, not answers.
What the checks cannot catch is a writer that forges well-formed content (see docs/protocol.md).

What a presence word promises. ABSENT: at the moment the daemon wrote it, no READY entry's key
hashed to the bucket. A key's own 64-bit hash: every READY entry hashing there had that hash,
so the key was present (another (namespace, key) with the same 64-bit hash is a 2^-64 event per
pair; unpinned exists() is advisory anyway: an entry may be evicted right after any answer).
SHARED, or another key's hash: the ring cannot tell; the client asks. The daemon keeps a bucket
SHARED until it empties rather than finding out which hash is left (that would take an index by
bucket); a replaced key publishes its new generation before the old one goes, which the rules
above keep as the key's own hash.

Memory ordering. The protocol is a sequence lock whose sequence is write_seq: "write_seq = X"
announces that slot X % slots may be rewritten from now on. Each u64 word is naturally aligned
and stored or loaded with one 8-byte access (a numpy scalar, struct on a native-endian host),
which x86-64 and aarch64 make single-copy atomic: write_seq is never seen half-written. (Slot
words may be; nothing depends on it.) The accesses and the barriers (B) between them:

    writer, append(X)                         reader, poll() from `start`
      W1  B                                     R1  end = write_seq
      W2  slot[X % slots] = X, kind, key, gen   R2  B
      W3  B                                     R3  copy the slots of start .. end-1
      W4  write_seq = X + 1                     R4  B
                                                R5  head = write_seq
                                                    accept the copy iff head - start < slots

(a) Whole events: W3 orders each slot's words before the write_seq that covers it, R2 orders the
    load of `end` before the loads of the slots. A reader that read end = E therefore sees in
    every slot below E the words of its append, or of a later one.
(b) Not overwritten during the copy: the first append that overwrites a slot of start .. end-1 is
    that of X = start + slots, and its stores (W2) follow, by W1, the store write_seq = X (W4 of
    the append before). R4 orders the copy before the load of head. So if the copy saw any word
    of append X, head >= X and head - start >= slots: the copy is discarded as an overrun. An
    accepted copy saw words of no append >= start + slots: by (a), exactly events start .. end-1.
Both are the message-passing pattern with a barrier on each side, which every CPU Linux runs on
forbids to reorder. Nothing else needs ordering: the writer never reads the mapping and the
reader never writes it (no store->load or load->store pair), the stamps only catch a writer
that is not the daemon, and the heartbeat, closed flag and presence words are single words read
on their own. (A presence word may be older or newer than the events polled just before it;
exists() promises only what a message establishes: the daemon updates the table before it
replies, and a message is a release/acquire pair, so whoever learnt of a put from its reply reads
a word that is not ABSENT, and whoever learnt of its removal one that is not the key's hash.)
Each presence word is one aligned 8-byte store and load: never seen half-written. x86 keeps stores in program order and loads in program order (TSO), so there the
barriers are skipped: `memory_barrier` is None (ecd.memory.fence). Elsewhere each is a full fence
(`dmb ish` on aarch64) through ctypes, ~0.15 us: two per append, two per poll that finds events,
none per poll that finds none.
"""
from __future__ import annotations

import enum
import hashlib
import logging
import struct
import time
from typing import Sequence

import numpy as np

# The barrier the writer and readers run, read at each use: None where the CPU keeps the order
# itself (x86). Tests replace it (a counting hook, another fence strategy, none) by this name.
from .entry_index import IndexReader, IndexWriter
from .fence import barrier as memory_barrier

log = logging.getLogger("ecd.ring")

MAGIC = int.from_bytes(b"ECDRING1", "little")
VERSION = 3  # 2: presence words are constants, not counts; 3: 64-bit words naming the key
HEADER_BYTES = 4096
SLOT_WORDS = 4
_INVALID = np.uint64(0xFFFF_FFFF_FFFF_FFFF)
_SLOT = struct.Struct("<4Q")  # one slot, written with one call: the barriers order it as a whole

# header word indices (u64); write_seq and heartbeat sit on cache lines of their own
_MAGIC, _VERSION, _SLOTS, _BUCKETS, _EPOCH = 0, 1, 2, 3, 4
_FIXED_WORDS = 8  # words 0-7: written once at start (5-7 zero), compared in one go by readers
_FIXED_BYTES = _FIXED_WORDS * 8
_WRITE_SEQ = 8
_HEARTBEAT = 16
_CLOSED = 17
_PLANS = 24  # eviction plans begun and ended: odd while one is under way (a pin slot's check)
# heartbeat and closed flag, adjacent: struct reads each u64 with one 8-byte load (native order)
_LIVENESS = struct.Struct("<QQ")

# Presence words besides key hashes (key_hash never returns these, nor 0 or all ones, so a table
# that was zeroed or filled reads as "overwritten"); random bytes hit ABSENT with odds of 2^-64.
ABSENT = int.from_bytes(b"ecd:gone", "little")
SHARED = int.from_bytes(b"ecd:many", "little")
_ALL_ONES = (1 << 64) - 1
_NOT_KEY_HASHES = frozenset((0, _ALL_ONES, ABSENT, SHARED))
_ABSENT, _SHARED = np.uint64(ABSENT), np.uint64(SHARED)

# What RingReader.lookup says of one key
NOT_HERE, HERE, ASK = 0, 1, 2

# A real write_seq stays far below this (2^62 events is a century at a billion a second): a
# larger one was written by someone else, and resyncing to it would leave the reader stuck there.
MAX_SEQ = 1 << 62
# A heartbeat this far in the future of the reader's clock was not written by the daemon (the
# slack leaves room for clients in a time namespace a little behind the daemon's).
FUTURE_SLACK_NS = 1_000_000_000
# How long a ring whose heartbeat stopped is still believed by its readers (RingReader.usable):
# an adopting restart waits this long after the old ring's last beat before it serves
# (`old_ring_silent_in`), so that no reader validates a copy against a ring no one writes.
READER_TRUST_S = 1.0
# Presence buckets the daemon compares with its own counts per heartbeat: 64 Ki buckets (256 KiB)
# cost ~0.1 ms every 0.1 s; the default 1 Mi buckets are swept every 1.6 s.
AUDIT_BUCKETS = 1 << 16


def old_ring_silent_in(buf) -> float:
    """Seconds until no reader trusts the ring in `buf` (a previous run's, mapped read-only) any
    more: 0 when it was closed or beat long enough ago; at most READER_TRUST_S + slack for a
    header that is not a ring's, or a beat in the future (not the daemon's: wait it out)."""
    trust_ns = int(READER_TRUST_S * 1e9) + 50_000_000  # readers compare with their own clock: slack
    words = np.frombuffer(buf, np.uint64, count=_CLOSED + 1)
    if int(words[_MAGIC]) == MAGIC and int(words[_CLOSED]) == 1:
        return 0.0
    age_ns = time.monotonic_ns() - int(words[_HEARTBEAT])
    if int(words[_MAGIC]) != MAGIC or age_ns < 0:
        return trust_ns / 1e9
    return max(0, trust_ns - age_ns) / 1e9


class EventKind(enum.IntEnum):
    PUBLISHED = 1  # entry became READY (a replaced key publishes the new generation)
    EVICTED = 2  # removed to make room
    DELETED = 3  # removed by a delete, a replacement or a shutdown
    EPOCH = 4  # daemon (re)started; keyhash 0, generation = epoch


_KINDS = len(EventKind)  # valid kinds are 1.._KINDS
_KIND_SET = frozenset(int(kind) for kind in EventKind)


# A tenant's namespace as the daemon stores it: "TENANT\0NAME" (config.TENANT_NAME has no NUL,
# and while tenants are configured no client may name a namespace with one: handlers.py refuses
# it), so two tenants' same name are two namespaces and the default tenant's names stay as said.
TENANT_SEP = "\0"


def tenant_namespace(tenant: str, namespace: str) -> str:
    return f"{tenant}{TENANT_SEP}{namespace}" if tenant else namespace


def split_namespace(stored: str) -> tuple[str, str]:
    """(tenant, namespace as its clients name it) of a stored namespace."""
    tenant, sep, name = stored.partition(TENANT_SEP)
    return (tenant, name) if sep else ("", stored)


def key_hash(namespace: str, key: str) -> int:
    """64-bit hash of (namespace, key), identical in every process (unlike hash()).

    The namespace's length leads, so no two (namespace, key) pairs hash the same input
    (("a\0", "x") and ("a", "\0x") did with a bare separator): a presence word naming this hash
    answers "present" for exactly one pair."""
    digest = hashlib.blake2b(f"{len(namespace)}:{namespace}\0{key}".encode(), digest_size=8).digest()
    keyhash = int.from_bytes(digest, "little")
    if keyhash in _NOT_KEY_HASHES:  # 4 in 2^64: keep the bucket (low bits), leave the word free
        keyhash ^= 1 << 63
    return keyhash


def ring_bytes(slots: int, buckets: int) -> int:
    return HEADER_BYTES + buckets * 8 + slots * SLOT_WORDS * 8


class _RingView:
    def __init__(self, buf, slots: int, buckets: int) -> None:
        self.header = np.frombuffer(buf, np.uint64, count=HEADER_BYTES // 8, offset=0)
        self.presence = np.frombuffer(buf, np.uint64, count=buckets, offset=HEADER_BYTES)
        self.slots = np.frombuffer(buf, np.uint64, count=slots * SLOT_WORDS,
                                   offset=HEADER_BYTES + buckets * 8).reshape(slots, SLOT_WORDS)
        self.slot_mask = slots - 1
        self.bucket_mask = buckets - 1


class RingWriter(_RingView):
    """The daemon's side. Not thread-safe: the daemon's event loop is the only writer.

    The mapping is write-only for it: sequence, counts and header live in private memory, so
    nothing a client scribbles there can make the daemon misbehave or raise. `index`: the entry
    index that follows the ring in the same file (memory/entry_index.py; `index_records` = 0:
    none, an index of no records)."""

    def __init__(self, buf, slots: int, buckets: int, epoch: int, index_records: int = 0) -> None:
        super().__init__(buf, slots, buckets)
        self.index = IndexWriter(buf, ring_bytes(slots, buckets), index_records)
        self.header[:] = 0
        self.counts = np.zeros(buckets, np.uint32)  # READY entries per bucket: the truth ...
        self.words = np.full(buckets, _ABSENT, np.uint64)  # ... and the words it implies
        self.presence[:] = _ABSENT
        self.slots[:, 0] = _INVALID
        h = self.header
        h[_VERSION], h[_SLOTS], h[_BUCKETS], h[_EPOCH] = VERSION, slots, buckets, epoch
        self._fixed = h[:_FIXED_WORDS].copy()
        self._fixed[_MAGIC] = MAGIC
        self.seq = 0
        self.plans = 0  # see plan_begin
        self.closed = False
        self.repairs = 0  # heartbeats that found the mapping overwritten (and rewrote it)
        self._audit_at = 0  # the next presence bucket a heartbeat compares
        h[_HEARTBEAT] = time.monotonic_ns()
        barrier = memory_barrier
        if barrier is not None:
            barrier()  # everything above before the magic
        h[_MAGIC] = MAGIC  # last: a reader that sees the magic sees a formatted ring
        self._buf = buf
        self._slot_offset = HEADER_BYTES + buckets * 8
        self.append(EventKind.EPOCH, 0, epoch)

    def append(self, kind: EventKind, keyhash: int, generation: int) -> None:
        """W1-W4 of "Memory ordering" in the module docstring."""
        seq = self.seq
        barrier = memory_barrier
        if barrier is not None:
            barrier()  # W1: write_seq = seq (the last append's W4) before this slot's words
        _SLOT.pack_into(self._buf, self._slot_offset + (seq & self.slot_mask) * SLOT_WORDS * 8,
                        seq, kind, keyhash, generation)
        self.seq = seq + 1
        if barrier is not None:
            barrier()  # W3: this slot's words before the write_seq that covers them
        self.header[_WRITE_SEQ] = seq + 1

    def plan_begin(self) -> None:
        """An eviction plan is about to read the pin slots (odd until plan_end). A client taking
        a pin slot reads this word before its store and again after its fence: unchanged and even
        means no plan read the slots without its pin, and none that did evicted it unseen (its
        events precede plan_end). The reader's full fence and the scan's (SlotArea) pair up."""
        if not self.plans & 1:
            self.plans += 1
            self.header[_PLANS] = self.plans

    def plan_end(self) -> None:
        """The plan's evictions are appended (after every request and expiry tick)."""
        if self.plans & 1:
            if memory_barrier is not None:
                memory_barrier()  # the plan's events before the even word
            self.plans += 1
            self.header[_PLANS] = self.plans

    def publish(self, keyhash: int, generation: int) -> None:
        self.mark_present(keyhash)  # a second hash in a bucket: its word cannot name both (SHARED)
        self.append(EventKind.PUBLISHED, keyhash, generation)

    def mark_all_present(self, keyhashes: Sequence[int]) -> None:
        """Keys present from the start (an adopted pool's entries: ecd/daemon/restart/adopt.py),
        in one vectorized pass: the presence table says so, no event is written (no reader has
        seen this run's ring yet). The same words mark_present would leave, bucket by bucket."""
        if not keyhashes:
            return
        hashes = np.fromiter(keyhashes, np.uint64, len(keyhashes))
        buckets = (hashes & np.uint64(self.bucket_mask)).astype(np.int64)
        order = np.argsort(buckets, kind="stable")
        buckets, hashes = buckets[order], hashes[order]
        starts = np.flatnonzero(np.r_[True, buckets[1:] != buckets[:-1]])
        where = buckets[starts]
        added = np.diff(np.r_[starts, buckets.size]).astype(np.uint32)
        one_hash = np.minimum.reduceat(hashes, starts) == np.maximum.reduceat(hashes, starts)
        first = hashes[starts]
        before = self.counts[where]
        # one hash in the bucket, and the bucket empty or already naming that very hash
        alone = one_hash & ((before == 0) | (self.words[where] == first))
        words = np.where(alone, first, _SHARED).astype(np.uint64)
        self.counts[where] = before + added
        self.words[where] = words
        self.presence[where] = words

    def mark_present(self, keyhash: int) -> None:
        """A key now present: its bucket's count, and its word (the hash, or SHARED by two)."""
        bucket = keyhash & self.bucket_mask
        count = int(self.counts[bucket])
        self.counts[bucket] = count + 1
        if count == 0:
            self._set_word(bucket, np.uint64(keyhash))
        elif int(self.words[bucket]) != keyhash:
            self._set_word(bucket, _SHARED)

    def unpublish(self, kind: EventKind, keyhash: int, generation: int) -> None:
        bucket = keyhash & self.bucket_mask
        left = max(int(self.counts[bucket]) - 1, 0)  # never wraps to "present for ever"
        self.counts[bucket] = left
        if left == 0:
            self._set_word(bucket, _ABSENT)
        # else: the word stays what it was, the hash every entry left shares, or SHARED
        self.append(kind, keyhash, generation)

    def _set_word(self, bucket: int, word: np.uint64) -> None:
        self.words[bucket] = word
        self.presence[bucket] = word

    def heartbeat(self) -> None:
        self.header[_HEARTBEAT] = time.monotonic_ns()
        self._repair()

    def _repair(self) -> None:
        """Rewrite whatever another process changed: the header words readers check on every
        poll, and one slice of the presence table (compared with the private counts)."""
        h, damaged = self.header, []
        if not np.array_equal(h[:_FIXED_WORDS], self._fixed):
            h[:_FIXED_WORDS] = self._fixed
            damaged.append("header")
        if int(h[_WRITE_SEQ]) != self.seq:
            h[_WRITE_SEQ] = self.seq
            damaged.append("write_seq")
        if int(h[_CLOSED]) != int(self.closed):
            h[_CLOSED] = int(self.closed)
            damaged.append("closed flag")
        if int(h[_PLANS]) != self.plans:
            h[_PLANS] = self.plans
            damaged.append("plans")
        if self.index.repair():
            damaged.append("entry index records")
        lo = self._audit_at
        hi = min(lo + AUDIT_BUCKETS, self.counts.size)
        expected = self.words[lo:hi]
        if not np.array_equal(self.presence[lo:hi], expected):
            self.presence[lo:hi] = expected
            damaged.append(f"presence buckets {lo}-{hi - 1}")
        self._audit_at = hi if hi < self.counts.size else 0
        if damaged:
            self.repairs += 1
            # Once at WARNING (a group member is writing the daemon's ring), then quietly.
            log.log(logging.WARNING if self.repairs == 1 else logging.DEBUG,
                    "event ring overwritten by another process (%s): rewritten; clients ask the daemon "
                    "meanwhile (repair #%d)", ", ".join(damaged), self.repairs)

    def close(self) -> None:
        self.closed = True
        self.header[_CLOSED] = 1

    @property
    def events_written(self) -> int:
        return self.seq


class RingReader(_RingView):
    """A client's side: reads without syscalls, never blocks the writer, and never believes the
    mapping blindly (see the module docstring): every method returns in bounded time and raises
    nothing whatever the bytes are, once the constructor has accepted the header."""

    def __init__(self, buf, slots: int, buckets: int, index_records: int = 0) -> None:
        super().__init__(buf, slots, buckets)
        self.index = IndexReader(buf, ring_bytes(slots, buckets), index_records)
        fixed = bytes(buf[:_FIXED_BYTES])  # one copy, so the words checked are the words kept
        if memory_barrier is not None:
            memory_barrier()  # the magic before the rest (the writer stores it last)
        words = np.frombuffer(fixed, np.uint64)
        if int(words[_MAGIC]) != MAGIC or int(words[_VERSION]) != VERSION:
            raise ValueError("not an ecd event ring (bad magic or version)")
        if int(words[_SLOTS]) != slots or int(words[_BUCKETS]) != buckets:
            raise ValueError("event ring geometry differs from what the daemon announced")
        if words[_EPOCH + 1:].any():
            raise ValueError("event ring header is damaged (reserved words are not zero)")
        self._buf = buf
        self._fixed = fixed
        self.nslots = slots
        head = int(self.header[_WRITE_SEQ])
        self.next_seq = head if head <= MAX_SEQ else 0
        self.overruns = 0
        self.late_overruns = 0  # of which found by the second look at write_seq (during the copy)
        self.corruptions = 0  # checks that failed: the ring was written by someone else
        self.last_problem: str | None = None

    @property
    def epoch(self) -> int:
        return int(self.header[_EPOCH])

    def _corrupt(self, problem: str) -> None:
        """Count a failed check and say so once; callers then treat it like an overrun."""
        self.corruptions += 1
        self.last_problem = problem
        if self.corruptions == 1:
            log.warning("the ecd event ring was overwritten by another process (%s): asking the daemon "
                        "instead until it has repaired it", problem)

    def _header_damaged(self) -> None:
        self._corrupt("header words: magic, version, geometry or epoch")

    def alive(self, max_silence_s: float) -> bool:
        """The writer is running: not closed and its heartbeat is recent."""
        if self.header[_CLOSED]:
            return False
        age_ns = time.monotonic_ns() - int(self.header[_HEARTBEAT])
        return -FUTURE_SLACK_NS < age_ns < max_silence_s * 1e9

    def usable(self, max_silence_s: float) -> bool:
        """Whether the ring may answer for the daemon now: header intact, writer alive. O(1)."""
        if self._buf[:_FIXED_BYTES] != self._fixed:  # one bytes compare (~50 ns)
            self._header_damaged()
            return False
        beat, closed = _LIVENESS.unpack_from(self._buf, _HEARTBEAT * 8)  # one call for both words
        if closed:
            if closed != 1:
                self._corrupt(f"closed flag {closed:#x}")
            return False
        age_ns = time.monotonic_ns() - beat
        if age_ns <= -FUTURE_SLACK_NS:
            self._corrupt("heartbeat in the future")
            return False
        return age_ns < max_silence_s * 1e9

    def lookup(self, keyhash: int) -> int:
        """What the presence table says of the key with this hash: HERE (the bucket's word is
        this very hash), NOT_HERE (the word is ABSENT) or ASK (SHARED, another key's hash, or a
        word that is none of these: an overwritten one, counted)."""
        bucket = keyhash & self.bucket_mask
        word = int(self.presence[bucket])
        if word == keyhash:
            return HERE
        if word == ABSENT:
            return NOT_HERE
        if word != SHARED and (word & self.bucket_mask != bucket or word in _NOT_KEY_HASHES):
            self._corrupt(f"presence word {word:#x} in bucket {bucket}")
        return ASK

    def pending(self) -> int:
        return int(self.header[_WRITE_SEQ]) - self.next_seq

    @property
    def plans(self) -> int:
        """The writer's eviction plan word (RingWriter.plan_begin)."""
        return int(self.header[_PLANS])

    def skip_to_head(self) -> None:
        head = int(self.header[_WRITE_SEQ])
        if head <= MAX_SEQ:
            self.next_seq = head

    def poll(self, max_events: int | None = None) -> np.ndarray | None:
        """Events since the last poll as an (n, 3) array of [kind, keyhash, generation].

        Returns None when the reader was overrun (events were lost) or found the ring overwritten
        (counted in `corruptions`): the caller must drop whatever it derived from events and
        resync; the reader has already moved on. At most min(slots, max_events) events are read.
        """
        start, end = self.next_seq, int(self.header[_WRITE_SEQ])  # R1
        if end == start:
            return np.empty((0, 3), np.uint64)
        barrier = memory_barrier
        if barrier is not None:
            barrier()  # R2: write_seq before the slots it covers
        if self._buf[:_FIXED_BYTES] != self._fixed:
            self._header_damaged()  # read nothing from a ring that is not what the daemon wrote
            return None
        if end < start or end > MAX_SEQ:
            # write_seq only ever grows, and never gets near MAX_SEQ: someone else wrote it. The
            # daemon rewrites it on its next event or heartbeat; start again from a plausible one.
            if end <= MAX_SEQ:
                self.next_seq = end
            self._corrupt(f"write_seq {end:#x} at reader position {start:#x}")
            return None
        count = end - start
        if count > self.nslots or (max_events is not None and count > max_events):
            self.overruns += 1
            self.next_seq = end
            return None
        first = start & self.slot_mask
        if first + count <= self.nslots:  # R3; one slice (a fancy-indexed gather costs ~1 us more)
            rows = self.slots[first:first + count].copy()
        else:
            rows = np.concatenate((self.slots[first:], self.slots[:first + count - self.nslots]))
        if barrier is not None:
            barrier()  # R4: the copy before the second look at write_seq
        head = int(self.header[_WRITE_SEQ])  # R5
        if head < end or head > MAX_SEQ:
            self.next_seq = end
            self._corrupt(f"write_seq went from {end:#x} to {head:#x}")
            return None
        if head - start >= self.nslots:
            # The writer may have been rewriting (seq >= start + slots) a slot while it was
            # copied: whatever the copy holds, stamps included, may be torn.
            self.next_seq = head
            self.overruns += 1
            self.late_overruns += 1
            return None
        # A whole copy of events start .. end-1 (see "Memory ordering"), so every stamp is its
        # sequence number, unless someone else wrote the slots: an earlier stamp (write_seq
        # claimed events that were never written) or a later one (a lap write_seq does not show).
        # A few events (the usual poll): Python ints are cheaper than numpy's per-call cost.
        stamps = rows[:, 0]
        if (stamps.tolist() != list(range(start, end)) if count <= 16
                else (stamps != np.arange(start, end, dtype=np.uint64)).any()):
            self.next_seq = head
            behind = (stamps < np.arange(start, end, dtype=np.uint64)).any()
            self._corrupt(f"slot stamps {'behind' if behind else 'ahead of'} write_seq")
            return None
        kinds = rows[:, 1]
        if (not _KIND_SET.issuperset(kinds.tolist()) if count <= 16
                else (kinds - np.uint64(1)).max() >= _KINDS):  # kind 0 wraps to 2^64 - 1
            self.next_seq = end
            self._corrupt("event of unknown kind")
            return None
        self.next_seq = end
        return rows[:, 1:]
