"""Futex wait and wake on a word of a shared mapping, for consumers waiting on the event ring.

A consumer waiting for a key (`get(key, timeout=...)`) sleeps in FUTEX_WAIT on the low 32 bits
of the ring's write_seq; the daemon does FUTEX_WAKE after each PUBLISHED event. The futex key of
a shared mapping is its file and offset, so a client's read-only mapping and the daemon's
read-write one of the same ring meet (waiting needs only read access). The usual pattern keeps
wakeups from being lost: the waiter reads the word, then checks what it waits for, then waits
"while the word still holds what I read"; an append in between changes the word and the wait
returns at once.

Through ctypes (libc's syscall(2)), which releases the GIL while it sleeps. Where the syscall
number is unknown (not x86-64 or aarch64) `available` is False and callers wait the old way.
"""
from __future__ import annotations

import ctypes
import errno
import platform
from typing import Any

_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine().lower())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_WAKE_ALL = 2**31 - 1

_syscall: Any
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _syscall = _libc.syscall
    _syscall.restype = ctypes.c_long
except (OSError, AttributeError):  # pragma: no cover - every Linux libc has syscall(2)
    _syscall = None

available = _SYS_FUTEX is not None and _syscall is not None


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def wait(address: int, expected: int, timeout_s: float) -> bool:
    """Sleep while the u32 at `address` holds `expected`, at most `timeout_s`. True when woken
    or the word had changed already; False on a timeout (or an interruption: callers re-check)."""
    if not available:
        return False
    whole = max(timeout_s, 0.0)
    ts = _Timespec(int(whole), int((whole - int(whole)) * 1e9))
    rc = _syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT, ctypes.c_uint32(expected & 0xFFFFFFFF),
                  ctypes.byref(ts), None, 0)
    return rc == 0 or ctypes.get_errno() == errno.EAGAIN


def wake(address: int) -> None:
    """Wake every process sleeping on the u32 at `address` (a cheap syscall when none does)."""
    if available:
        _syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, _WAKE_ALL, None, None, 0)
