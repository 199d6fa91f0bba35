"""Processes for the event-ring torture test (test_ring_reader.py): one writer appending as fast
as it can, readers polling concurrently and checking every event they get.

Every event's words are derived from its sequence number (kind, keyhash and generation below), so
a reader that knows which sequence numbers a poll returned (its position before the poll) can
tell an event that is whole from one whose words come from two different appends (a slot the
writer overwrote while the reader copied it) or from no append at all.

The ring file is followed by a control page: word 0 is "go" (the parent sets it once every reader
is attached), word 1 is "stop". Each process prints one line, "ready", when attached, and one
JSON line with its counts when stopped.

  python ring_torture.py writer PATH SLOTS BARRIER
  python ring_torture.py reader PATH SLOTS BARRIER SEED

BARRIER: "default" (what ecd.memory.fence picks for this CPU), "none", or a strategy of
ecd.memory.fence ("libatomic", "code", "lock") to force that barrier on a CPU that needs none.
"""
from __future__ import annotations

import json
import mmap
import os
import random
import sys
import time

import numpy as np

from ecd.memory import ring as ring_mod
from ecd.memory.ring import RingReader, RingWriter, ring_bytes

BUCKETS = 64
CONTROL = 4096  # bytes after the ring: [go, stop] as u64
_M1 = np.uint64(0x9E37_79B9_7F4A_7C15)
_M2 = np.uint64(0xD6E8_FEB8_6659_FD93)


def expected(seqs: np.ndarray) -> np.ndarray:
    """[kind, keyhash, generation] of the events with these sequence numbers."""
    with np.errstate(over="ignore"):
        return np.stack([seqs % np.uint64(3) + np.uint64(1), seqs * _M1, (seqs ^ _M2) * _M2], axis=1)


def file_bytes(slots: int) -> int:
    return ring_bytes(slots, BUCKETS) + CONTROL


def _map(path: str, slots: int) -> tuple[mmap.mmap, np.ndarray]:
    fd = os.open(path, os.O_RDWR)
    try:
        buf = mmap.mmap(fd, file_bytes(slots))
    finally:
        os.close(fd)
    control = np.frombuffer(buf, np.uint64, count=2, offset=ring_bytes(slots, BUCKETS))
    return buf, control


def _set_barrier(name: str) -> str:
    if name == "none":
        ring_mod.memory_barrier = None
        return name
    from ecd.memory import fence
    if name != "default":
        ring_mod.memory_barrier = fence.make(name)
    return "none" if ring_mod.memory_barrier is None else name if name != "default" else fence.STRATEGY


def _wait_go(control: np.ndarray) -> None:
    print("ready", flush=True)
    while not control[0]:
        time.sleep(0.001)


def writer(path: str, slots: int) -> dict:
    buf, control = _map(path, slots)
    w = RingWriter(buf, slots, BUCKETS, epoch=1)
    first = w.events_written  # the EPOCH event
    _wait_go(control)
    started = time.monotonic()
    append, n = w.append, first
    while not control[1]:
        # computed a thousand at a time, so that appending is what this loop spends its time on
        for kind, keyhash, generation in expected(np.arange(n, n + 1000, dtype=np.uint64)).tolist():
            append(kind, keyhash, generation)
        n += 1000
    elapsed = time.monotonic() - started
    return {"role": "writer", "events": n - first, "seconds": round(elapsed, 3),
            "per_s": round((n - first) / elapsed)}


def reader(path: str, slots: int, seed: int) -> dict:
    buf, control = _map(path, slots)
    r = RingReader(buf, slots, BUCKETS)
    rng = random.Random(seed)
    checked = torn = polls = empty = 0
    _wait_go(control)
    while not control[1]:
        # Random pauses: sometimes keep up, sometimes fall some tens of events behind (at ~1 M
        # events/s: the writer then reaches the oldest slots of the range while they are copied),
        # sometimes far behind (lapped before the poll).
        pause = rng.random()
        if pause < 0.4:
            pass
        elif pause < 0.9:
            t = time.perf_counter() + rng.uniform(5e-6, 60e-6)
            while time.perf_counter() < t:
                pass
        else:
            time.sleep(rng.uniform(0, 2e-4))
        pos = r.next_seq
        events = r.poll()
        polls += 1
        if events is None:
            continue
        if not len(events):
            empty += 1
            continue
        assert r.next_seq == pos + len(events), (pos, len(events), r.next_seq)
        want = expected(np.arange(pos, pos + len(events), dtype=np.uint64))
        bad = (events != want).any(axis=1)
        torn += int(bad.sum())
        checked += len(events)
        if bad.any():
            i = int(np.argmax(bad))
            print(f"TORN seq {pos + i}: got {events[i].tolist()} want {want[i].tolist()}", file=sys.stderr,
                  flush=True)
    return {"role": "reader", "checked": checked, "torn": torn, "overruns": r.overruns,
            "late_overruns": r.late_overruns, "corruptions": r.corruptions, "polls": polls, "empty": empty}


def main(argv: list[str]) -> None:
    role, path, slots, barrier = argv[0], argv[1], int(argv[2]), argv[3]
    used = _set_barrier(barrier)
    if role == "writer":
        result = writer(path, slots)
    else:
        result = reader(path, slots, int(argv[4]))
    result["barrier"] = used
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
