"""Processes for tests/security/test_ring_corruption.py.

  ring_attack.py attack RING_PATH PATTERN SECONDS SLOTS BUCKETS
      A group member gone wrong: maps the daemon's event ring read-write and scribbles PATTERN
      over it again and again (every few ms) for SECONDS, while the daemon keeps writing it.
      Imports numpy only (no torch, no ecd client): it starts in a fraction of a second.

  ring_attack.py consume ENDPOINT PRESENT ABSENT
      A consumer that knows the truth: keys k0..k{PRESENT-1} hold payload(i), a0..a{ABSENT-1}
      were never put. Reads one command per line on stdin, answers one JSON line on stdout:
        check SECONDS -> {"calls", "wrong": [...], "errors": [...], "slow": [...], "max_call_s"}
        status        -> {"usable", "overruns", "corruptions"} of its ring readers
"""
from __future__ import annotations

import json
import mmap
import os
import sys
import time

import numpy as np

HEADER_BYTES, SLOT_WORDS = 4096, 4
WRITE_SEQ, HEARTBEAT, CLOSED = 8, 16, 17
SLOW_CALL_S = 2.0  # a call slower than this counts as a hang (round trips take ~1 ms here)


def payload(i: int):
    import torch
    return torch.arange(1000 + 37 * i, dtype=torch.int64) * (i + 1) - 7 * i


# ---- the attacker ----------------------------------------------------------------------------

def scribble(pattern: str, buf: mmap.mmap, slots: int, buckets: int, rng: np.random.Generator, n: int) -> None:
    header = np.frombuffer(buf, np.uint64, count=HEADER_BYTES // 8)
    presence = np.frombuffer(buf, np.uint64, count=buckets, offset=HEADER_BYTES)
    ring = np.frombuffer(buf, np.uint64, count=slots * SLOT_WORDS,
                         offset=HEADER_BYTES + buckets * 8).reshape(slots, SLOT_WORDS)
    head = int(header[WRITE_SEQ])
    if pattern == "header_random":
        header[:] = rng.integers(0, 2**64, header.size, dtype=np.uint64)
    elif pattern == "seq_huge":  # "negative" (as a signed number) or just enormous
        choices = [2**64 - 1, 2**63, 2**64 - 1000, rng.integers(2**62, 2**64, dtype=np.uint64)]
        header[WRITE_SEQ] = np.uint64(choices[n % 4])
    elif pattern == "seq_back":
        header[WRITE_SEQ] = np.uint64(max(0, head - int(rng.integers(1, 100))) if n % 3 else 0)
    elif pattern == "seq_ahead":
        header[WRITE_SEQ] = np.uint64(head + int(rng.integers(1, slots + 1)))
    elif pattern == "slots_random":
        ring[:] = rng.integers(0, 2**64, ring.shape, dtype=np.uint64)
    elif pattern == "slots_forged_kinds":
        # stamps left as the daemon wrote them, kinds and key hashes garbage: every check on the
        # sequence numbers passes
        ring[:, 1] = rng.integers(0, 2**64, slots, dtype=np.uint64)
        ring[:, 2] = rng.integers(0, 2**64, slots, dtype=np.uint64)
    elif pattern == "presence_zero":
        presence[:] = 0
    elif pattern == "presence_random":
        presence[:] = rng.integers(0, 2**64, buckets, dtype=np.uint64)
    elif pattern == "presence_ones":
        presence[:] = np.uint64(2**64 - 1)
    elif pattern == "header_fields":  # one field at a time: magic, version, geometry, epoch, closed, heartbeat
        word = [0, 1, 2, 3, 4, CLOSED, HEARTBEAT, HEARTBEAT][n % 8]
        header[word] = np.uint64([rng.integers(0, 2**64, dtype=np.uint64), 0, 2**64 - 1][n % 3])
    elif pattern.startswith("index_"):  # the entry index after the ring (ecd/memory/entry_index.py)
        start = HEADER_BYTES + buckets * 8 + slots * SLOT_WORDS * 8
        index = np.frombuffer(buf, np.uint64, offset=start).reshape(-1, 32)
        if pattern == "index_random":  # garbage with even sequence words: read as whole records
            index[:] = rng.integers(0, 2**64, index.shape, dtype=np.uint64) & ~np.uint64(1)
        else:  # one field of every record at a time: generation, pool, offset, size, dtype/lengths, shape, key
            word = [2, 3, 4, 5, 7, 8, 16][n % 7]
            index[:, word] = rng.integers(0, 2**64, index.shape[0], dtype=np.uint64)
    elif pattern == "everything":
        whole = np.frombuffer(buf, np.uint8)
        whole[:] = rng.integers(0, 256, whole.size, dtype=np.uint8)
    else:
        raise SystemExit(f"unknown pattern {pattern}")


def attack(path: str, pattern: str, seconds: float, slots: int, buckets: int) -> None:
    fd = os.open(path, os.O_RDWR)
    buf = mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)
    rng = np.random.default_rng(abs(hash((pattern, os.getpid()))))
    deadline, n = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        scribble(pattern, buf, slots, buckets, rng, n)
        n += 1
        time.sleep(float(rng.uniform(0.0, 0.004)))
    print(json.dumps({"scribbles": n}), flush=True)


# ---- the consumer ----------------------------------------------------------------------------

def consume(endpoint: str, present: int, absent: int) -> None:
    import torch
    from ecd import Client, KeyNotFound

    truth = {f"k{i}": payload(i) for i in range(present)}
    missing = [f"a{i}" for i in range(absent)]
    # One client reads (its location cache is full: it follows the ring's events), one only asks
    # exists (its cache stays empty: it answers negatives from the presence table alone).
    reader, asker = Client(endpoint, timeout=5.0), Client(endpoint, timeout=5.0)
    everything = list(truth) + missing
    expected = [True] * len(truth) + [False] * len(missing)

    def check(seconds: float) -> dict:
        out = {"calls": 0, "wrong": [], "errors": [], "slow": [], "max_call_s": 0.0}

        def call(what: str, fn):
            started = time.monotonic()
            try:
                problem = fn()
            except Exception as exc:  # anything but the expected answers is a failure
                problem = None
                if len(out["errors"]) < 5:
                    out["errors"].append(f"{what}: {type(exc).__name__}: {exc}")
            took = time.monotonic() - started
            out["calls"] += 1
            out["max_call_s"] = max(out["max_call_s"], took)
            if took > SLOW_CALL_S and len(out["slow"]) < 5:
                out["slow"].append(f"{what}: {took:.2f}s")
            if problem and len(out["wrong"]) < 5:
                out["wrong"].append(f"{what}: {problem}")

        def same(got, key) -> str | None:
            return None if torch.equal(got, truth[key]) else "bytes differ"

        def viewed(key) -> str | None:
            with reader.view(key) as t:
                return None if torch.equal(t, truth[key]) else "view bytes differ"

        def not_found(key) -> str | None:
            try:
                reader.get(key)
            except KeyNotFound:
                return None
            return "get of a never-put key returned something"

        def answers(client, keys, want) -> str | None:
            got = client.exists(keys)
            bad = [k for k, g, w in zip(keys, got, want) if g != w]
            return f"exists wrong for {bad}" if bad else None

        deadline, i = time.monotonic() + seconds, 0
        while time.monotonic() < deadline:
            key, gone = f"k{i % len(truth)}", missing[i % len(missing)]
            call(f"get {key}", lambda: same(reader.get(key), key))
            call(f"view {key}", lambda: viewed(key))
            call(f"get {gone}", lambda: not_found(gone))
            for name, client in (("reader", reader), ("asker", asker)):
                call(f"{name}.exists all", lambda: answers(client, everything, expected))
                call(f"{name}.exists {key}", lambda: answers(client, [key], [True]))
                call(f"{name}.exists {gone}", lambda: answers(client, [gone], [False]))
            i += 1
        return out

    def status() -> dict:
        rings = [c.mapping.ring for c in (reader, asker)]
        usable = [bool(r.usable(1.0)) if hasattr(r, "usable") else bool(r.alive(1.0)) for r in rings]
        return {"usable": usable, "overruns": [r.overruns for r in rings],
                "corruptions": [getattr(r, "corruptions", None) for r in rings]}

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "check":
            print(json.dumps(check(float(args[0]))), flush=True)
        elif cmd == "status":
            print(json.dumps(status()), flush=True)
        elif cmd == "quit":
            break


if __name__ == "__main__":
    if sys.argv[1] == "attack":
        attack(sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
    else:
        consume(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
