"""A hardware memory barrier callable from Python, for memory shared with other processes (the
event ring, ring.py).

Neither the Python language nor numpy has a memory model: a numpy scalar store is one plain
machine store and a load one plain load, and on a weakly ordered CPU (aarch64: Grace,
Graviton; POWER; RISC-V) other cores may see plain stores in another order than they were made,
and a core may satisfy plain loads out of order. Code that needs one access ordered before another
puts `barrier()` between them (and the other side its own: barriers work in pairs).

`barrier` is None where the CPU already keeps the order the ring needs, which is stores with
stores and loads with loads: x86 (TSO: "stores are not reordered with other stores, loads are
not reordered with other loads"; only a store followed by a load may be). Callers skip it there
and pay nothing. Elsewhere it is a full fence (`dmb ish` on aarch64), found in this order:
  libatomic  GCC's libatomic.so.1 exports C11's atomic_thread_fence as a function; called with
             memory_order_seq_cst it executes the CPU's full fence.
  code       the fence and a return, three instructions of machine code (aarch64 and x86-64
             only), mapped read+execute from a memfd (never writable and executable at once): for
             a system without libatomic.
  lock       the acquire and release of a threading lock: what vLLM's shm_broadcast relies on.
             Not a guaranteed full fence (in the C11 model and on aarch64 an acquire followed by
             a release lets accesses on either side move between them, and past each other), so
             it is the last resort, logged once as a warning.
Measured on x86-64 (Python 3.11, 2 shared vCPUs): a ctypes call to either fence ~90-150 ns, the
lock ~70-150 ns, os.sched_yield (a syscall, no architectural barrier either) ~450 ns, the None
check ~5 ns. Forced on the ring there: +0.25-0.3 us per append (two barriers), as much per poll
that finds events.
Each ctypes call is also an opaque function call, so no C compiler moves memory accesses across
it, and neither does the interpreter (each numpy access is a call of its own).
"""
from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import platform
from collections.abc import Callable

log = logging.getLogger("ecd.fence")

# CPUs whose memory model keeps store->store and load->load order without a fence.
_ORDERED = frozenset({"x86_64", "amd64", "i386", "i486", "i586", "i686", "x86"})
MACHINE = platform.machine().lower()
STRONGLY_ORDERED = MACHINE in _ORDERED

_SEQ_CST = 5  # C11 memory_order_seq_cst
# A landing pad for indirect calls (a no-op on CPUs without branch protection), a full fence, a
# return: no arguments, no register a caller must keep is touched.
_AARCH64 = bytes.fromhex("5f2403d5" "bf3b03d5" "c0035fd6")  # bti c; dmb ish; ret
_X86_64 = bytes.fromhex("f30f1efa" "0faef0" "c3")  # endbr64; mfence; ret
_CODE = {"aarch64": _AARCH64, "arm64": _AARCH64, "x86_64": _X86_64, "amd64": _X86_64}
STRATEGIES = ("libatomic", "code", "lock")
_code_pages: list = []


def _libatomic() -> Callable[[], None]:
    fence = ctypes.CDLL("libatomic.so.1").atomic_thread_fence  # OSError / AttributeError if absent
    fence.restype = None
    return functools.partial(fence, _SEQ_CST)  # no Python frame in between


def _code() -> Callable[[], None]:
    code = _CODE.get(MACHINE)
    if code is None or ctypes.sizeof(ctypes.c_void_p) != 8:  # (a 32-bit process on a 64-bit kernel)
        raise OSError(f"no fence instruction known for this process on {MACHINE}")
    import numpy as np  # for the address of a read-only mapping (ctypes wants a writable one)
    fd = os.memfd_create("ecd-fence", os.MFD_CLOEXEC)
    try:
        os.write(fd, code)
        page = mmap.mmap(fd, len(code), mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_EXEC)
    finally:
        os.close(fd)
    view = np.frombuffer(page, np.uint8)
    _code_pages.append((page, view))  # mapped for as long as the process may call it
    return ctypes.CFUNCTYPE(None)(view.ctypes.data)


def _lock() -> Callable[[], None]:
    import _thread
    lock = _thread.allocate_lock()
    acquire, release = lock.acquire, lock.release

    def barrier() -> None:
        acquire()
        release()

    return barrier


def make(strategy: str) -> Callable[[], None]:
    """The barrier of one strategy (see the module docstring); raises OSError where unavailable."""
    build = {"libatomic": _libatomic, "code": _code, "lock": _lock}.get(strategy)
    if build is None:
        raise ValueError(f"unknown memory barrier strategy {strategy!r}: one of {', '.join(STRATEGIES)}")
    try:
        barrier = build()
        barrier()  # once here: a strategy that cannot work fails at import, not in the ring
    except (OSError, AttributeError, ValueError) as exc:
        raise OSError(f"memory barrier {strategy!r} unavailable: {exc}") from None
    return barrier


def _pick() -> tuple[Callable[[], None], str]:
    for strategy in ("libatomic", "code"):
        try:
            return make(strategy), strategy
        except OSError:
            pass
    return make("lock"), "lock"


if STRONGLY_ORDERED:
    barrier: Callable[[], None] | None = None
    STRATEGY = "none"
else:
    barrier, STRATEGY = _pick()
    if STRATEGY == "lock":
        log.warning("no hardware memory barrier callable on %s (libatomic.so.1 missing, executable "
                    "mappings refused): the event ring orders its accesses with a lock, which works "
                    "in practice but is not guaranteed to", MACHINE)

# A store followed by a load of another location is the one order x86 does not keep, and it is the
# order read slots need (memory/entry_index.py: a reader stores its slot, then loads the ring; the
# daemon stores its event, then loads the slots): `full_barrier` is a hardware fence on every CPU.
full_barrier, FULL_STRATEGY = (barrier, STRATEGY) if barrier is not None else _pick()
