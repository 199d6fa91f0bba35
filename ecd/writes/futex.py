"""Linux futexes on shared memory, from Python: the submission area's doorbell and commit waits.

A futex is a 32-bit word any process mapping the same memory can wait on: FUTEX_WAIT sleeps only
while the word still holds the value the caller saw (so a wake between the check and the sleep is
never lost), FUTEX_WAKE wakes the sleepers. The shared (not FUTEX_PRIVATE) operations key the
word by its file and offset, so it works between processes, containers included, that map the
pool's memfd or /dev/shm file. One ctypes call each (~1-2 us with the syscall); the wait releases
the GIL. On a word the kernel cannot reach (a truncated named file) the call fails with EFAULT,
never a fault in the caller.
"""
from __future__ import annotations

import ctypes
import errno
import os
import platform

_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98, "ppc64le": 221, "s390x": 238,
              "riscv64": 98}.get(platform.machine().lower())
FUTEX_WAIT, FUTEX_WAKE = 0, 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long

available = _SYS_FUTEX is not None


def wait(address: int, expected: int, timeout_s: float) -> bool:
    """Sleep until woken, while the u32 at `address` is `expected`, for at most `timeout_s`.
    False on a timeout; True otherwise (woken, the word already changed, a signal)."""
    if _SYS_FUTEX is None:
        raise OSError(errno.ENOSYS, f"no futex syscall number known for {platform.machine()}")
    seconds = max(0.0, timeout_s)
    spec = _Timespec(int(seconds), int((seconds % 1) * 1e9))
    rc = _syscall(_SYS_FUTEX, ctypes.c_void_p(address), FUTEX_WAIT, ctypes.c_uint32(expected & 0xFFFFFFFF),
                  ctypes.byref(spec), None, 0)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.ETIMEDOUT:
        return False
    if err in (errno.EAGAIN, errno.EINTR):
        return True
    raise OSError(err, f"futex wait: {os.strerror(err)}")


def wake(address: int, waiters: int = 2**31 - 1) -> int:
    """Wake up to `waiters` sleepers on the word at `address`; how many woke (0 on EFAULT)."""
    if _SYS_FUTEX is None:
        return 0
    rc = _syscall(_SYS_FUTEX, ctypes.c_void_p(address), FUTEX_WAKE, waiters, None, None, 0)
    return max(rc, 0)
