"""Processes for the local-read chaos test (test_local_reads.py), and the mutants it runs them with.

Values encode (key, generation): every int64 word of key K's value number V is (K << 32) | V, so
a copy that mixes two values, or read another key's extent, or a half-written one, is caught.

  writer ENDPOINT KEYS SECONDS SEED
      puts random keys (a new value number each time) and deletes some, until SECONDS are up;
      prints {"puts": N, "deletes": N}
  reader ENDPOINT KEYS SECONDS SEED MUTANT
      reads random keys (get; read_many copying the view into a buffer; a view, read at its start
      and again after a pause inside the block, which must see the same value) with delays
      injected between every step of the local read (before the location is taken, between it
      and the copy or the read slots, after the copy, before the ring is read again), until
      SECONDS are up; prints {"reads", "local", "thrown", "views", "slotted", "wrong", "first_wrong"}
  pinner ENDPOINT KEYS SECONDS SEED MUTANT
      pins random keys (exists(pin_s=30)), waits a little, gets each key it pinned (the writers
      of this run never delete, so a pinned key must still be there), unpins it; delays injected
      between the steps of a slot pin; prints {"pinned", "slotted", "lost", "wrong", "first_wrong"}
  daemon MUTANT [--after FILE] -- PYTHON -m ecd serve ...
      the daemon, with MUTANT applied (`DaemonProcess.start(prefix=...)`); with --after, its
      modules are imported first, FILE.ready is made, and it serves once FILE exists (a restart
      faster than Python's imports allow)

Mutants (each must make the test fail; `none` is the real build):
  no-recheck   the client returns the copy without reading the ring again after it
  late-event   the daemon announces an eviction/deletion/replacement 20 ms after it frees the
               extent (the order the protocol forbids: free, then event)
  no-ring-wait an adopting daemon serves at once, while clients still trust the previous run's ring
               (test_local_read_restart.py)
  no-slot-scan the daemon frees an extent without looking at the read slots (views only: gets and
               read_many do not hold slots)
  no-pin-scan  the daemon's eviction plans do not look at pin slots
  no-plan-word the client ignores the ring's plan word (a pin taken while a plan that did not see
               it is under way counts as taken); the pins test runs every daemon with `slow-plan`
               (a 2 ms pause between a plan's scan of the slots and its evictions) so the window
               is wide enough to be hit
  no-fence     the client skips the fence between the copy and the ring read. On x86 (TSO) that
               fence is no instruction at all (memory/fence.py), so this mutant cannot fail there:
               the test runs it only on weakly ordered CPUs.
"""
from __future__ import annotations

import json
import random
import runpy
import sys
import time

import torch

NUMEL = 8192  # 64 KiB of int64 words
CHURN_SCRIPT = __file__


def value(key_id: int, number: int) -> torch.Tensor:
    return torch.full((NUMEL,), (key_id << 32) | number, dtype=torch.int64)


def wrong_bytes(key_id: int, got: torch.Tensor) -> str:
    """"" when `got` is one whole value of key `key_id`, else what is wrong with it."""
    if got.dtype != torch.int64 or got.numel() != NUMEL:
        return f"{got.dtype} x {got.numel()}"
    words = got.unique()
    if words.numel() != 1:
        return f"{words.numel()} different words: {[hex(w) for w in words[:4].tolist()]}"
    word = int(words[0])
    return "" if word >> 32 == key_id else f"key {word >> 32}'s value {word & 0xFFFFFFFF}"


def apply_client_mutant(name: str, rng: random.Random) -> dict[str, int]:
    """Delays between the read protocol's steps (always), and the client mutant `name`. Returns
    counters the patched steps keep: copies made, copies returned."""
    from ecd.client import client as client_module, local_read
    from ecd.memory.entry_index import SlotPage
    counts = {"copies": 0, "returned": 0, "slotted": 0}

    def pause() -> None:
        time.sleep(rng.choice((0.0, 0.0, 0.0001, 0.0005, 0.002)))

    real_copy, real_get, real_locations = local_read.copy_from_pools, local_read.get_cached, \
        local_read.cached_locations

    def slow_copy(mapping, locations):
        pause()  # between taking the location and the copy: an eviction and a new write fit here
        counts["copies"] += 1
        out = real_copy(mapping, locations)
        pause()  # between the copy and the ring read
        return out

    def counted_get(c, keys, verify):
        out = real_get(c, keys, verify)
        counts["returned"] += out is not None
        return out

    real_read = local_read.read_cached

    def counted_read(c, keys, consume, verify):
        def slow_consume(views):
            pause()  # between taking the location and the copy
            counts["copies"] += 1
            out = consume(views)
            pause()  # between the copy and the ring read
            return out
        done, out = real_read(c, keys, slow_consume, verify)
        counts["returned"] += done
        return done, out

    def locations(c, ns, keys, mapping, same_as=None, arenas=False):
        if same_as is not None and name == "no-recheck":
            return same_as
        pause()
        return real_locations(c, ns, keys, mapping, same_as, arenas)

    real_hold = SlotPage.hold

    def slow_hold(self, generations, deadline_ns=0):
        pause()  # between taking the location and storing the read slots
        return real_hold(self, generations, deadline_ns)

    real_hold_slots = local_read.hold_slots

    def counted_hold_slots(c, keys):
        out = real_hold_slots(c, keys)
        counts["slotted"] += out is not None
        return out

    from ecd.client import pins
    real_take = pins.SlotPins.take

    def counted_take(self, c, ns, found, pin_s):
        pinned = real_take(self, c, ns, found, pin_s)
        counts["slotted"] += len(pinned)
        return pinned

    pins.SlotPins.take = counted_take
    if name == "no-plan-word":
        from ecd.memory.ring import RingReader
        RingReader.plans = property(lambda self: 0)
    SlotPage.hold = slow_hold
    local_read.hold_slots = client_module.hold_slots = counted_hold_slots
    local_read.copy_from_pools = slow_copy
    local_read.get_cached = counted_get
    client_module.get_cached = counted_get
    local_read.read_cached = client_module.read_cached = counted_read
    local_read.cached_locations = locations
    if name == "no-fence":
        local_read.memory_barrier = None
    return counts


def apply_daemon_mutant(names: str) -> None:
    for name in names.split("+"):
        _daemon_mutant(name)


def _daemon_mutant(name: str) -> None:
    if name in ("slow-plan", "no-pin-scan"):
        from ecd.daemon.registry.reclaim import SlotHolds
        real_kept = SlotHolds.kept

        def kept(self, plan=True):
            if name == "no-pin-scan":
                return self.held()
            out = real_kept(self, plan)
            if plan:
                time.sleep(0.002)  # between the scan and the evictions it allows
            return out

        SlotHolds.kept = kept
        return
    if name == "no-slot-scan":
        from ecd.daemon.registry.reclaim import SlotHolds
        SlotHolds.held = lambda self: frozenset()  # every free goes ahead, slots or not
        return
    if name == "no-ring-wait":
        from ecd.daemon.restart import adopt
        real_silent_in = adopt.old_ring_silent_in_fd
        adopt.old_ring_silent_in_fd = lambda fd: real_silent_in(fd) * 0
        return
    if name != "late-event":
        return
    import asyncio

    from ecd.daemon.registry import announce
    from ecd.memory.ring import EventKind
    real = announce.Announcer.announce

    def late(self, kind, entry, keyhash=None):
        if kind is EventKind.PUBLISHED:
            return real(self, kind, entry, keyhash)
        asyncio.get_running_loop().call_later(0.02, real, self, kind, entry, keyhash)

    announce.Announcer.announce = late


def random_keys(endpoint: str, keys: int, seconds: float, rng: random.Random):
    """(a client, a random key number) until SECONDS are up: each process's loop."""
    import ecd
    with ecd.Client(endpoint, timeout=30) as c:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            yield c, rng.randrange(keys)


class Wrong:
    """Wrong results of a reader: how many, and the first one said."""

    def __init__(self) -> None:
        self.count, self.first = 0, ""

    def note(self, k: int, problem: str) -> None:
        if problem:
            self.count += 1
            self.first = self.first or f"k{k}: {problem}"


def view_twice(c, k: int, rng: random.Random) -> tuple[torch.Tensor, str]:
    """A view of key k read at its start and again after a pause: (the first read, "" or how the
    bytes changed under the open view)."""
    with c.view(f"k{k}") as view:
        got = view.clone()
        time.sleep(rng.choice((0.0, 0.001, 0.003)))  # puts evict and reuse extents meanwhile
        again = view.clone()
    return got, "" if torch.equal(got, again) else f"changed under an open view: {wrong_bytes(k, again)}"


def writer(endpoint: str, keys: int, seconds: float, seed: int, delete_share: float = 0.1) -> None:
    import ecd
    rng = random.Random(seed)
    numbers = [0] * keys
    puts = deletes = 0
    for c, k in random_keys(endpoint, keys, seconds, rng):
        if rng.random() < delete_share:
            c.delete(f"k{k}")
            deletes += 1
            continue
        numbers[k] += 1
        try:
            c.put(f"k{k}", value(k, numbers[k] * 1000 + seed))
            puts += 1
        except ecd.PoolFull:  # every extent read-leased for a moment
            time.sleep(0.001)
    print(json.dumps({"puts": puts, "deletes": deletes}), flush=True)


def reader(endpoint: str, keys: int, seconds: float, seed: int, mutant: str) -> None:
    import ecd
    rng = random.Random(seed)
    counts = apply_client_mutant(mutant, rng)
    reads = views = 0
    wrong = Wrong()
    for c, k in random_keys(endpoint, keys, seconds, rng):
        changed = ""
        try:
            if reads % 3 == 1:  # a get, a read_many that copies the view into a buffer of its own, a view
                got = c.get(f"k{k}")
            elif reads % 3 == 2:
                got = c.read_many([f"k{k}"], lambda views: torch.empty(NUMEL, dtype=torch.int64).copy_(views[0]))
            else:
                got, changed = view_twice(c, k, rng)
                views += 1
        except ecd.KeyNotFound:
            continue
        reads += 1
        wrong.note(k, wrong_bytes(k, got) or changed)
    print(json.dumps({"reads": reads, "local": counts["returned"], "thrown": counts["copies"] - counts["returned"],
                      "views": views, "slotted": counts["slotted"], "wrong": wrong.count, "first_wrong": wrong.first}),
          flush=True)


def pinner(endpoint: str, keys: int, seconds: float, seed: int, mutant: str) -> None:
    import ecd
    rng = random.Random(seed)
    counts = apply_client_mutant(mutant, rng)
    pinned = lost = 0
    wrong = Wrong()
    for c, k in random_keys(endpoint, keys, seconds, rng):
        if not c.exists(f"k{k}", pin_s=30):
            continue
        pinned += 1
        time.sleep(rng.choice((0.0, 0.001, 0.005, 0.02)))  # the writers evict meanwhile
        try:
            problem = wrong_bytes(k, c.get(f"k{k}"))
        except ecd.KeyNotFound:
            problem = "evicted while pinned"
            lost += 1
        wrong.note(k, problem)
        c.unpin(f"k{k}")
    print(json.dumps({"pinned": pinned, "slotted": counts["slotted"], "lost": lost, "wrong": wrong.count,
                      "first_wrong": wrong.first}), flush=True)


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "writer":
        writer(args[0], int(args[1]), float(args[2]), int(args[3]), float(args[4]) if len(args) > 4 else 0.1)
    elif mode == "pinner":
        pinner(args[0], int(args[1]), float(args[2]), int(args[3]), args[4])
    elif mode == "reader":
        reader(args[0], int(args[1]), float(args[2]), int(args[3]), args[4])
    elif mode == "daemon":
        apply_daemon_mutant(args[0])
        if args[1] == "--after":  # a warm standby: imported, then started the moment FILE appears
            import importlib
            import os
            for module in ("ecd.cli.commands", "ecd.daemon.server", "ecd.daemon.wiring"):
                importlib.import_module(module)
            open(args[2] + ".ready", "w").close()
            while not os.path.exists(args[2]):
                time.sleep(0.001)
        command = args[args.index("--") + 1:]
        sys.argv = ["ecd", *command[command.index("ecd") + 1:]]  # after PYTHON -m ecd
        runpy.run_module("ecd", run_name="__main__", alter_sys=True)
    else:
        raise SystemExit(f"unknown mode {mode}")
