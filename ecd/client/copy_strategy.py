"""Which routine ecd._copy uses for large copies on this machine, chosen once per process.

A hand-written copy must never lose to the platform's memcpy, and what wins depends on the CPU:
non-temporal stores copy 16 MiB in 0.75-0.85x memcpy's time on an AMD EPYC (Zen 5) but lose to it
below ~16 MiB there, and a streaming routine with a non-temporal source prefetch ran 2.6x slower
than memcpy on an Intel Xeon. Cache sizes cannot predict it (a VM here reports a 384 MiB L3 to
glibc and 32 MiB to lscpu). So the first copy of STREAM_MIN bytes or more in a process measures:

- the CPU's widest streaming routine is timed against memcpy at 4, 8, 16 and 32 MiB of scratch
  memory, in ABBA order (memcpy, routine, routine, memcpy: drift and cache warm-up cancel), ROUNDS
  times per size; the first size whose median ratio is below WIN (a clear win, not noise) becomes
  the threshold, and the routine with the non-temporal source prefetch is tried there too;
- copies from that threshold up use the winner, every smaller copy memcpy; if no size wins, every
  copy is memcpy. A streaming routine is only ever used where it beat memcpy on this machine.

It costs 50-150 ms once (the GIL released while each timed copy runs), and 64 MiB of scratch
memory for that time. ECD_COPY_ROUTINE forces a choice instead (tests, operators, the CI guard):
"auto" (the default), "memcpy", "stream" (the widest streaming stores, no prefetch),
"stream-prefetch", or one of ecd._copy.ROUTINES; an unknown name fails the import, saying why.
Without ecd._copy (no C compiler at install) nothing here runs: numpy copies with memcpy.
"""
from __future__ import annotations

import logging
import mmap
import os
import statistics
import threading
import time
from dataclasses import dataclass, field

import numpy as np

try:
    from .. import _copy as compiled_copy
except ImportError:
    compiled_copy = None

ENV = "ECD_COPY_ROUTINE"
MIB = 1 << 20
STREAM_MIN = compiled_copy.STREAM_MIN if compiled_copy is not None else 4 * MIB
CALIBRATION_SIZES = (4 * MIB, 8 * MIB, 16 * MIB, 32 * MIB)
ROUNDS = 7
WIN = 0.93  # a routine must take under 93% of memcpy's time (median of ROUNDS paired ratios)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Strategy:
    """What copies of `from_bytes` or more use (smaller ones: memcpy), and why."""
    routine: str
    from_bytes: int
    decided_by: str
    # size -> routine -> median time ratio to memcpy, as the calibration measured them
    ratios: dict[int, dict[str, float]] = field(default_factory=dict)

    def describe(self) -> str:
        measured = "; ".join(f"{size // MIB} MiB: " + ", ".join(f"{r} {x:.2f}x" for r, x in by.items())
                             for size, by in self.ratios.items())
        target = "memcpy at every size" if self.routine == "memcpy" else \
            f"{self.routine} from {self.from_bytes // MIB} MiB, memcpy below"
        return f"{target} ({self.decided_by}{': ' + measured if measured else ''})"


def _streaming_routines() -> tuple[str, str] | None:
    """(the widest streaming routine, its prefetching twin), or None where there is none."""
    for isa in ("avx2", "sse2"):
        if f"nt-{isa}" in compiled_copy.ROUTINES:
            return f"nt-{isa}", f"nt-{isa}-prefetch"
    return None


def forced_strategy(value: str | None) -> Strategy | None:
    """The Strategy ECD_COPY_ROUTINE=value forces, None for auto; ValueError for a bad value."""
    if value is None or value in ("", "auto"):
        return None
    names = _streaming_routines()
    aliases = {"stream": names[0], "stream-prefetch": names[1]} if names else {}
    routine = aliases.get(value, value)
    if compiled_copy is None or routine not in compiled_copy.ROUTINES:
        have = ", ".join(compiled_copy.ROUTINES) if compiled_copy is not None else "none: ecd._copy is not built"
        raise ValueError(f"{ENV}={value!r}: expected auto, memcpy, stream, stream-prefetch or a routine of "
                         f"this CPU ({have})")
    return Strategy(routine, STREAM_MIN, f"forced by {ENV}={value}")


def paired_ratio(routine: str, dst, src, rounds: int) -> float:
    """Median over `rounds` of (routine twice) / (memcpy twice), timed ABBA on the same buffers."""
    def timed(name: str) -> int:
        t = time.perf_counter_ns()
        compiled_copy.copy(dst, 0, src, stream_min=0, routine=name)
        return time.perf_counter_ns() - t

    timed(routine), timed("memcpy")  # warm-up: the first copy pays for what the last one left
    ratios = []
    for _ in range(rounds):
        ref = timed("memcpy")
        candidate = timed(routine) + timed(routine)
        ref += timed("memcpy")
        ratios.append(candidate / max(ref, 1))
    return statistics.median(ratios)


def calibrate(sizes: tuple[int, ...] = CALIBRATION_SIZES, rounds: int = ROUNDS) -> Strategy:
    """Measures which routine wins from which size on this machine (see the module's docstring)."""
    names = _streaming_routines()
    if names is None:
        return Strategy("memcpy", STREAM_MIN, "no streaming routine on this CPU")
    ratios: dict[int, dict[str, float]] = {}
    biggest = max(sizes)
    with mmap.mmap(-1, biggest) as src_map, mmap.mmap(-1, biggest) as dst_map:
        np.frombuffer(src_map, np.uint8).fill(0x5A)  # touched pages: the pool's are prefaulted before use
        np.frombuffer(dst_map, np.uint8).fill(0xA5)
        with memoryview(src_map) as src, memoryview(dst_map) as dst:
            for size in sorted(sizes):
                ratios[size] = {names[0]: paired_ratio(names[0], dst, src[:size], rounds)}
                if ratios[size][names[0]] >= WIN:
                    continue
                ratios[size][names[1]] = paired_ratio(names[1], dst, src[:size], rounds)
                best = min(ratios[size], key=ratios[size].__getitem__)
                return Strategy(best, size, f"calibrated: under {WIN:.2f}x memcpy from here", ratios)
    return Strategy("memcpy", STREAM_MIN, f"calibrated: no streaming routine under {WIN:.2f}x memcpy", ratios)


_lock = threading.Lock()
# a child forked while another thread calibrated would find the lock held for ever
os.register_at_fork(after_in_child=lambda: globals().update(_lock=threading.Lock()))
_chosen: Strategy | None = None
# True until a strategy is set: the copy paths call choose() before a copy of STREAM_MIN or more
pending = compiled_copy is not None


def apply(strategy: Strategy) -> Strategy:
    """Makes ecd._copy use `strategy` from now on."""
    global _chosen, pending
    compiled_copy.set_large(strategy.routine, strategy.from_bytes)
    _chosen, pending = strategy, False
    return strategy


def choose() -> None:
    """Calibrates and applies, once per process. Another thread's copies meanwhile use memcpy
    (the compiled copy's setting until then): they neither wait nor copy wrong."""
    if not _lock.acquire(blocking=False):
        return
    try:
        if pending:
            started = time.perf_counter()
            strategy = apply(calibrate())
            log.info("ecd copy: %s, chosen in %.0f ms", strategy.describe(), (time.perf_counter() - started) * 1e3)
    finally:
        _lock.release()


def current() -> Strategy | None:
    """The strategy in use, None before the first large copy chose one."""
    return _chosen


if compiled_copy is not None:
    _forced = forced_strategy(os.environ.get(ENV))
    if _forced is not None:
        apply(_forced)
