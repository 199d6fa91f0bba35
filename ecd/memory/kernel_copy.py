"""Copies into a shared mapping that a truncation of its file cannot turn into SIGBUS.

A store through a MAP_SHARED mapping to a page past the end of its (shrunk) file raises SIGBUS,
which no Python code can catch: the process dies. The pool files are 0660, so any member of the
daemon's group can ftruncate one while the daemon copies into it. The kernel's own copies fail
cleanly instead: process_vm_writev(2) on this very process copies through the kernel, and a page
it cannot reach ends the copy with a short count (EFAULT), never a signal. It costs ~3 us more
than a store through the mapping (the syscall's own cost: it looks up and pins the pages), so the
daemon uses it for its own small copies into the pool (inline puts); reads go through pread(2) on
the file itself (ShmFile.read_into).

Where process_vm_writev is refused (a seccomp filter, a kernel without it), `write` falls back to
a plain copy after a size check of the file: a truncation in the microseconds between the two
still kills the process, and `available()` says so for the start-up log.
"""
from __future__ import annotations

import ctypes
import errno
import os
import sys
import threading
from typing import Callable


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _load() -> Callable | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.process_vm_writev
    except (OSError, AttributeError):
        return None
    # the iovecs go by address (c_void_p): no per-call conversion of Structure arguments
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_ssize_t
    # probe once: a filter that refuses it (EPERM, ENOSYS) refuses it for good
    src, dst = ctypes.create_string_buffer(b"x", 1), ctypes.create_string_buffer(1)
    pair = (_IoVec * 2)(_IoVec(ctypes.addressof(src), 1), _IoVec(ctypes.addressof(dst), 1))
    if fn(os.getpid(), ctypes.addressof(pair), 1, ctypes.addressof(pair) + ctypes.sizeof(_IoVec), 1, 0) != 1 \
            or dst.raw != b"x":
        return None
    return fn


_writev = _load()
# One (local, remote) iovec pair per thread, filled in place for each copy: building ctypes
# objects per call cost more than the syscall itself (~7 us vs ~3 us for a 4 KiB inline put).
_iovecs = threading.local()
# Where a bytes object's data starts, from its address (CPython's PyBytesObject: the header, then
# the bytes): the address of the source without creating a ctypes object around it.
_BYTES_DATA_OFFSET = sys.getsizeof(b"") - 1


def available() -> bool:
    """Whether copies into the pool are safe from a truncation racing them."""
    return _writev is not None


def address_of(buf) -> int:
    """The address of a writable buffer's first byte (an mmap). The export ends at once, so
    the mapping can still be closed; the address stays valid while it is mapped."""
    holder = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(holder)
    finally:
        del holder


def write(base: int, offset: int, data: bytes) -> int:
    """Copy `data` to base + offset through the kernel: the bytes copied (fewer than len(data)
    when a page of the destination is gone: its file was truncated). `base`: address_of(mapping).
    Callers without process_vm_writev use copy_checked instead."""
    assert _writev is not None
    pair = getattr(_iovecs, "pair", None)
    if pair is None:
        pair = _iovecs.pair = (_IoVec * 2)()
        _iovecs.addresses = (ctypes.addressof(pair), ctypes.addressof(pair) + ctypes.sizeof(_IoVec))
    local_addr, remote_addr = _iovecs.addresses
    local, remote = pair[0], pair[1]
    if type(data) is not bytes:  # a bytes subclass or another buffer: a plain copy first
        data = bytes(data)
    src = id(data) + _BYTES_DATA_OFFSET  # `data` stays alive (and unmoved) for the whole call
    n, pid, done = len(data), os.getpid(), 0
    while done < n:
        local.base, local.len = src + done, n - done
        remote.base, remote.len = base + offset + done, n - done
        got = _writev(pid, local_addr, 1, remote_addr, 1, 0)
        if got < 0:
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            if err == errno.EFAULT:  # the destination page is past the file's end now
                return done
            raise OSError(err, os.strerror(err))
        if got == 0:
            return done
        done += got
    return done


def copy_checked(buf, offset: int, data: bytes, file_size: Callable[[], int]) -> int:
    """The fallback: a plain copy into `buf` once the file is seen to reach past every byte it
    touches (0 copied otherwise). Only a truncation between the check and the copy can fault."""
    end = offset + len(data)
    if file_size() < end:
        return 0
    buf[offset:end] = data
    return len(data)
