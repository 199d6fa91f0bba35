"""Processes for the arena read chaos test (test_arena_reads.py): a daemon with CUDA arenas on the
fake driver, a writer that puts into an arena as an engine on that device would (Alloc in the arena,
the bytes written into the arena's memory, Commit), and readers whose client copies and views arena
entries through tests/fake_gpu_plane.py (copies that run later, on a stream, as a GPU's do).
Values encode (key, value number) as in local_read_churn.py.

  writer ENDPOINT KEYS SECONDS SEED
      raw protocol session: puts random keys into the first arena (a new value number each
      time), deletes some; prints {"puts", "deletes", "full"}
  reader ENDPOINT KEYS SECONDS SEED MUTANT
      gets (copied by the fake stream) and views (read at the start and again after a pause)
      random keys, with delays between the steps of taking the read slots; prints {"reads",
      "views", "missing", "slotted", "wrong", "first_wrong"}
  daemon MUTANT -- serve --config FILE
      the fake-driver daemon (tests/fake_cuda.py) with local_read_churn's daemon MUTANT applied

Mutants (each must make the test fail; `none` is the real build):
  early-release the client clears its read slots before its copies complete (then waits for them):
                the daemon may give the extent to a new put while the stream still copies out of it
  no-slot-scan  (daemon) frees an extent without looking at the read slots
"""
from __future__ import annotations

import json
import random
import runpy
import sys
import time
from pathlib import Path


TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS), str(TESTS / "chaos")]
from local_read_churn import (Wrong, apply_client_mutant, apply_daemon_mutant, random_keys, value,  # noqa: E402
                              view_twice, wrong_bytes)


def writer(endpoint: str, keys: int, seconds: float, seed: int) -> None:
    from fake_gpu_plane import ArenaWriter
    arena = ArenaWriter(endpoint)
    rng = random.Random(seed)
    numbers = [0] * keys
    puts = deletes = full = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        k = rng.randrange(keys)
        if rng.random() < 0.1:
            arena.delete(f"k{k}")
            deletes += 1
            continue
        numbers[k] += 1
        if arena.put(f"k{k}", value(k, numbers[k] * 1000 + seed)):
            puts += 1
        else:  # every extent held by a reader for a moment
            full += 1
            time.sleep(0.001)
    arena.close()
    print(json.dumps({"puts": puts, "deletes": deletes, "full": full}), flush=True)


def reader(endpoint: str, keys: int, seconds: float, seed: int, mutant: str) -> None:
    import ecd
    import fake_gpu_plane
    fake_gpu_plane.install()
    if mutant == "early-release":
        from ecd.memory.entry_index import SlotPage
        pages: set = set()
        real_hold, real_wait = SlotPage.hold, fake_gpu_plane.StreamBatch.wait

        def hold(self, generations, deadline_ns=0):
            pages.add(self)
            return real_hold(self, generations, deadline_ns)

        def early(self) -> None:
            for page in pages:
                page.words[:] = 0  # every read slot of the session cleared, then the copies awaited
            real_wait(self)

        SlotPage.hold = hold  # type: ignore[method-assign]
        fake_gpu_plane.StreamBatch.wait = early  # type: ignore[method-assign]
    rng = random.Random(seed)
    counts = apply_client_mutant("none", rng)  # delays before the read slots are stored; counts them
    reads = views = missing = 0
    wrong = Wrong()
    for c, k in random_keys(endpoint, keys, seconds, rng):
        changed = ""
        try:
            if reads % 2:
                got = c.get(f"k{k}")  # queued on the stream: done some time before get returns
            else:
                got, changed = view_twice(c, k, rng)
                views += 1
        except ecd.KeyNotFound:
            missing += 1
            continue
        reads += 1
        wrong.note(k, wrong_bytes(k, got) or changed)
    print(json.dumps({"reads": reads, "views": views, "missing": missing, "slotted": counts["slotted"], "wrong": wrong.count,
                      "first_wrong": wrong.first}), flush=True)


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "writer":
        writer(args[0], int(args[1]), float(args[2]), int(args[3]))
    elif mode == "reader":
        reader(args[0], int(args[1]), float(args[2]), int(args[3]), args[4])
    elif mode == "daemon":
        apply_daemon_mutant(args[0])
        sys.argv = [str(TESTS / "fake_cuda.py"), *args[args.index("--") + 1:]]
        runpy.run_path(sys.argv[0], run_name="__main__")
    else:
        raise SystemExit(f"unknown mode {mode}")
