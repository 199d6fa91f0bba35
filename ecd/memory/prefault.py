"""Prefaulting a client's pool mappings in the background instead of in mmap (MAP_POPULATE).

A process's first store into, or load from, a page of the pool takes a page fault: about as
much as copying the page. MAP_POPULATE builds every page table entry when the pool is mapped,
in the calling thread: ~0.2 s per GiB and per mapping on the development VM (a Client maps the
pool twice, read-write and read-only), paid by whatever call makes the Client, which for an
engine is its first request (ecd.integrations.vllm.lazy_client). Here the mappings are made
without it, and a daemon thread asks the kernel for the same with madvise(MADV_POPULATE_WRITE
or MADV_POPULATE_READ, Linux 5.14), a chunk at a time, the GIL released (ctypes): the first
copies run meanwhile, and a page they reach first faults as it would have, nothing more.

Where the kernel lacks these advices, `supported()` is False and callers keep MAP_POPULATE. A
populate that fails (a named /dev/shm file someone truncated: EFAULT, never a SIGBUS) stops
quietly: the pages fault in on first use. The thread holds each mapping only while it
populates a chunk of it (a weak reference otherwise), so a client that goes away is not kept
mapped by it, and it stops there.
"""
from __future__ import annotations

import ctypes
import mmap
import threading
import weakref
from typing import Sequence

MADV_POPULATE_READ = 22
MADV_POPULATE_WRITE = 23
CHUNK = 64 << 20  # per madvise call: the thread checks between chunks that the mapping is still wanted

_libc: ctypes.CDLL | None = None
_supported: bool | None = None


def _madvise():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    return _libc.madvise


def supported() -> bool:
    """Whether this kernel populates on request (tried once, on a page of our own)."""
    global _supported
    if _supported is None:
        probe = mmap.mmap(-1, mmap.PAGESIZE)
        try:
            _supported = _madvise()(address_of(probe), mmap.PAGESIZE, MADV_POPULATE_WRITE) == 0
        except (OSError, AttributeError):  # no libc to call
            _supported = False
        finally:
            probe.close()
    return _supported


class _PyBuffer(ctypes.Structure):
    """Python's Py_buffer (Include/pybuffer.h)."""
    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]


def address_of(buf: mmap.mmap) -> int:
    """The address of a mapping's first byte, read-only mappings included (ctypes' from_buffer
    wants a writable one). The export ends at once; the address stays valid while it is mapped."""
    view = _PyBuffer()
    if _get_buffer(buf, ctypes.byref(view), 0) != 0:  # PyBUF_SIMPLE
        raise BufferError("the mapping exports no buffer")
    try:
        return int(view.buf or 0)
    finally:
        _release_buffer(ctypes.byref(view))


def start(writable: Sequence[mmap.mmap], read_only: Sequence[mmap.mmap]) -> threading.Thread:
    """Populate these mappings in a daemon thread (the read-write ones first: puts write them)."""
    jobs = [(weakref.ref(buf), address_of(buf), len(buf), MADV_POPULATE_WRITE) for buf in writable]
    jobs += [(weakref.ref(buf), address_of(buf), len(buf), MADV_POPULATE_READ) for buf in read_only]
    thread = threading.Thread(target=_populate, args=(jobs,), name="ecd-prefault", daemon=True)
    thread.start()
    return thread


def _populate(jobs: list[tuple[weakref.ref, int, int, int]]) -> None:
    madvise = _madvise()
    for ref, address, size, advice in jobs:
        for offset in range(0, size, CHUNK):
            buf = ref()  # held while the kernel works on it: it cannot be unmapped meanwhile
            if buf is None or buf.closed:
                return  # the client let go of its mappings (closed, or a new daemon run)
            failed = madvise(address + offset, min(CHUNK, size - offset), advice) != 0
            del buf
            if failed:
                return  # a truncated named file (EFAULT), memory short: pages fault in on use
