"""The event ring: one shared-memory file the daemon alone writes and every client reads.

Layout (little-endian, all fields naturally aligned):
  header page (4096 B): magic, version, slot count, bucket count, epoch, write_seq,
                         heartbeat (CLOCK_MONOTONIC ns), closed flag
  presence table:       `buckets` x u32 - number of READY entries whose key hashes to the bucket;
                         0 means "certainly absent", so clients answer exists() negatives locally
  event slots:          `slots` x [seq, kind, keyhash, generation] (4 x u64)

The writer never waits for readers. It marks a slot invalid, fills it, stamps its sequence
number, then advances write_seq. A reader that finds write_seq more than `slots` ahead of its
own position, or a slot whose stamp is not the sequence it expected, was overrun: it drops what
it cached and resyncs (x86 keeps stores in program order, which is what makes this sound).
"""
from __future__ import annotations

import enum
import hashlib
import time

import numpy as np

MAGIC = int.from_bytes(b"ECDRING1", "little")
VERSION = 1
HEADER_BYTES = 4096
SLOT_WORDS = 4
_INVALID = np.uint64(0xFFFF_FFFF_FFFF_FFFF)

# header word indices (u64); write_seq and heartbeat sit on cache lines of their own
_MAGIC, _VERSION, _SLOTS, _BUCKETS, _EPOCH = 0, 1, 2, 3, 4
_WRITE_SEQ = 8
_HEARTBEAT = 16
_CLOSED = 17


class EventKind(enum.IntEnum):
    PUBLISHED = 1  # entry became READY (a replaced key publishes the new generation)
    EVICTED = 2  # removed to make room
    DELETED = 3  # removed by a delete, a replacement or a shutdown
    EPOCH = 4  # daemon (re)started; keyhash 0, generation = epoch


def key_hash(namespace: str, key: str) -> int:
    """64-bit hash of (namespace, key), identical in every process (unlike hash())."""
    digest = hashlib.blake2b(f"{namespace}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def ring_bytes(slots: int, buckets: int) -> int:
    return HEADER_BYTES + buckets * 4 + slots * SLOT_WORDS * 8


class _RingView:
    def __init__(self, buf, slots: int, buckets: int) -> None:
        self.header = np.frombuffer(buf, np.uint64, count=HEADER_BYTES // 8, offset=0)
        self.presence = np.frombuffer(buf, np.uint32, count=buckets, offset=HEADER_BYTES)
        self.slots = np.frombuffer(buf, np.uint64, count=slots * SLOT_WORDS,
                                   offset=HEADER_BYTES + buckets * 4).reshape(slots, SLOT_WORDS)
        self.slot_mask = slots - 1
        self.bucket_mask = buckets - 1


class RingWriter(_RingView):
    """The daemon's side. Not thread-safe: the daemon's event loop is the only writer."""

    def __init__(self, buf, slots: int, buckets: int, epoch: int) -> None:
        super().__init__(buf, slots, buckets)
        self.header[:] = 0
        self.presence[:] = 0
        self.slots[:, 0] = _INVALID
        h = self.header
        h[_VERSION], h[_SLOTS], h[_BUCKETS], h[_EPOCH] = VERSION, slots, buckets, epoch
        self.seq = 0
        self.heartbeat()
        h[_MAGIC] = MAGIC  # last: a reader that sees the magic sees a formatted ring
        self.append(EventKind.EPOCH, 0, epoch)

    def append(self, kind: EventKind, keyhash: int, generation: int) -> None:
        seq = self.seq
        row = self.slots[seq & self.slot_mask]
        row[0] = _INVALID
        row[1] = kind
        row[2] = keyhash
        row[3] = generation
        row[0] = seq
        self.seq = seq + 1
        self.header[_WRITE_SEQ] = seq + 1

    def publish(self, keyhash: int, generation: int) -> None:
        self.presence[keyhash & self.bucket_mask] += 1
        self.append(EventKind.PUBLISHED, keyhash, generation)

    def unpublish(self, kind: EventKind, keyhash: int, generation: int) -> None:
        self.presence[keyhash & self.bucket_mask] -= 1
        self.append(kind, keyhash, generation)

    def heartbeat(self) -> None:
        self.header[_HEARTBEAT] = time.monotonic_ns()

    def close(self) -> None:
        self.header[_CLOSED] = 1

    @property
    def events_written(self) -> int:
        return self.seq


class RingReader(_RingView):
    """A client's side: reads without syscalls and never blocks the writer."""

    def __init__(self, buf, slots: int, buckets: int) -> None:
        super().__init__(buf, slots, buckets)
        if int(self.header[_MAGIC]) != MAGIC or int(self.header[_VERSION]) != VERSION:
            raise ValueError("not an ecd event ring (bad magic or version)")
        if int(self.header[_SLOTS]) != slots or int(self.header[_BUCKETS]) != buckets:
            raise ValueError("event ring geometry differs from what the daemon announced")
        self.nslots = slots
        self.next_seq = int(self.header[_WRITE_SEQ])
        self.overruns = 0

    @property
    def epoch(self) -> int:
        return int(self.header[_EPOCH])

    def alive(self, max_silence_s: float) -> bool:
        """The writer is running: not closed and its heartbeat is recent."""
        if self.header[_CLOSED]:
            return False
        age_ns = time.monotonic_ns() - int(self.header[_HEARTBEAT])
        return age_ns < max_silence_s * 1e9

    def maybe_present(self, keyhash: int) -> bool:
        return bool(self.presence[keyhash & self.bucket_mask])

    def pending(self) -> int:
        return int(self.header[_WRITE_SEQ]) - self.next_seq

    def skip_to_head(self) -> None:
        self.next_seq = int(self.header[_WRITE_SEQ])

    def poll(self, max_events: int | None = None) -> np.ndarray | None:
        """Events since the last poll as an (n, 3) array of [kind, keyhash, generation].

        Returns None when the reader was overrun (events were lost): the caller must drop
        whatever it derived from events and resync; the reader has already jumped to the head.
        """
        start, end = self.next_seq, int(self.header[_WRITE_SEQ])
        if end - start > self.nslots or (max_events is not None and end - start > max_events):
            self.overruns += 1
            self.next_seq = end
            return None
        if end == start:
            return np.empty((0, 3), np.uint64)
        seqs = np.arange(start, end, dtype=np.uint64)
        rows = self.slots[seqs & np.uint64(self.slot_mask)].copy()
        # Whatever the writer is writing now (seq >= head) may overwrite the slot of seq - nslots.
        head = int(self.header[_WRITE_SEQ])
        if (rows[:, 0] != seqs).any() or head - start >= self.nslots:
            self.overruns += 1
            self.next_seq = head
            return None
        self.next_seq = end
        return rows[:, 1:]
