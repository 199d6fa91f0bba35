"""POSIX shared-memory files under /dev/shm: create (daemon), attach (clients), unlink, stale cleanup.

Names derive from the node name: `ecd.<node>.<n>` for pool segments, `ecd.<node>.ring` for the
event ring, `ecd.<node>.lock` for the one-daemon-per-node lock. Files are created 0660 (owner
and group only) and fully allocated up front with posix_fallocate, so a /dev/shm that is too
small fails at start with a clear message instead of SIGBUS-ing a client mid-copy later.

A pool file is 0660, so any member of the group can also ftruncate it; the daemon keeps each
file it created open to notice that (`current_size`, one fstat), to give it back its size and
memory (`restore`), and to copy in and out of it without faulting on a page that is gone
(`write_at`, `read_into`): ecd/daemon/tiers/host.py says what the daemon does about the lost bytes.
"""
from __future__ import annotations

import errno
import fcntl
import mmap
import os
from dataclasses import dataclass, field
from typing import Sequence

from ..config_types import format_size
from . import kernel_copy

SHM_DIR = "/dev/shm"
FILE_MODE = 0o660
RING_FILE_MODE = 0o640  # the event ring: only the daemon writes it


def segment_name(node: str, index: int) -> str:
    return f"ecd.{node}.{index}"


def ring_name(node: str) -> str:
    return f"ecd.{node}.ring"


def lock_name(node: str) -> str:
    return f"ecd.{node}.lock"


def shm_path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


class ShmError(Exception):
    """Shared memory could not be created or attached; the message says why."""


@dataclass
class ShmFile:
    """One mapped /dev/shm file. `buf` is the mmap object (a writable buffer). `fd`: the file,
    kept open by the daemon that created it (-1 in clients)."""

    name: str
    size: int
    buf: mmap.mmap = field(repr=False)
    fd: int = -1
    _base: int = field(default=0, repr=False)  # buf's address, for kernel_copy

    @classmethod
    def create(cls, name: str, size: int, group: int = -1, mode: int = FILE_MODE) -> "ShmFile":
        """`mode`: 0660 for what engines write (pools), 0640 for what they only read (the ring)."""
        path = shm_path(name)
        free = _shm_free_bytes()
        if free is not None and size > free:
            raise ShmError(f"{SHM_DIR} has {format_size(free)} free, {name} needs {format_size(size)}"
                           f" ({size} bytes): shrink pool.host.size or grow {SHM_DIR}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        except OSError as exc:
            raise ShmError(f"cannot create {path}: {exc.strerror}") from None
        try:
            os.fchmod(fd, mode)  # the umask must not widen or narrow what clients need
            if group >= 0:
                os.fchown(fd, -1, group)  # node.group: the engines' group
            allocate_whole(fd, size, holder=SHM_DIR, name=name, what=path)
            buf = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            _unlink_quietly(path)
            raise
        return cls(name, size, buf, fd)

    @classmethod
    def attach(cls, name: str, size: int, *, writable: bool = True, populate: bool = False) -> "ShmFile":
        path = shm_path(name)
        try:
            fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as exc:
            raise ShmError(f"cannot open {path}: {exc.strerror}") from None
        try:
            actual = os.fstat(fd).st_size
            if actual != size:
                raise ShmError(f"{path} is {actual} bytes, the daemon announced {size}")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            # MAP_POPULATE builds the page tables now, so the first copy into a fresh mapping does
            # not pay one minor fault per 4 KiB page (about as much as the copy itself).
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
            buf = mmap.mmap(fd, size, flags, prot)
        finally:
            os.close(fd)
        return cls(name, size, buf)

    def unlink(self) -> None:
        """The daemon's end of a file it created: the name goes, and its descriptor."""
        _unlink_quietly(shm_path(self.name))
        self.close_fd()

    def close_fd(self) -> None:
        """Only the descriptor goes: the name stays (a keeper holds the file for the next daemon)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # ---- a shrink by another process (daemon side: needs `fd`) -----------------------------

    def current_size(self) -> int:
        """The file's size now (one fstat, ~1 us): below `size` when someone truncated it, and
        any access of the mapping past it faults."""
        return os.fstat(self.fd).st_size

    def whole(self) -> bool:
        """One fstat: the file has its size and all its pages. A truncation undone by growing the
        file again (ftruncate up) leaves the size right but the cut pages gone: they read as
        zeros from then on, and only the page count (st_blocks, which the up-front allocation
        made the full size) shows it."""
        st = os.fstat(self.fd)
        return st.st_size >= self.size and st.st_blocks * 512 >= self.size

    def cut_from(self) -> int:
        """Where the bytes a truncation took may start: the file's size when it is short and all
        its pages below that are there, else 0. A file grown back after a cut has pages missing
        below its end, and nothing cheap and reliable says which (mincore reports a page that was
        allocated but never written as absent too): everything in it may be zeros."""
        st = os.fstat(self.fd)
        below = min(st.st_size, self.size)
        return below if st.st_blocks * 512 >= below else 0

    def restore(self, start: int) -> str | None:
        """Give a truncated file its size back and allocate its pages from `start` (the lowest
        size seen): not a sparse hole that a store into a full /dev/shm would fault on later.
        The bytes that were cut off read as zeros. None, or why the pages could not be allocated
        (the size is back all the same; `restore` again later)."""
        if os.fstat(self.fd).st_size != self.size:
            os.ftruncate(self.fd, self.size)
        try:
            os.posix_fallocate(self.fd, start, self.size - start)
        except OSError as exc:
            return f"{SHM_DIR} could not allocate {format_size(self.size - start)} of {self.name} ({exc.strerror})"
        return None

    def write_at(self, offset: int, data: bytes) -> int:
        """Copy `data` into the mapping at `offset`; the bytes copied, fewer when the file no
        longer reaches that far. Never faults where kernel_copy is available."""
        if kernel_copy.available():
            if not self._base:
                self._base = kernel_copy.address_of(self.buf)
            return kernel_copy.write(self._base, offset, data)
        return kernel_copy.copy_checked(self.buf, offset, data, self.current_size)

    def read_into(self, offset: int, dst: memoryview) -> int:
        """pread(2) the file's bytes at `offset` into `dst` (the same pages the mapping shows):
        the bytes read, fewer when the file was truncated. Never faults."""
        done = 0
        while done < dst.nbytes:
            got = os.preadv(self.fd, [dst[done:]], offset + done)
            if got <= 0:
                break
            done += got
        return done


def allocate_whole(fd: int, size: int, *, holder: str, name: str, what: str) -> None:
    """Every page of the file now (posix_fallocate): memory short fails here, with a reason
    (`holder` cannot hold `name`), not later as SIGBUS in a client's copy."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM):
            raise ShmError(f"{holder} cannot hold {name}: {format_size(size)} ({size} bytes) requested, "
                           f"{exc.strerror}") from None
        raise ShmError(f"cannot allocate {what}: {exc.strerror}") from None


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _shm_free_bytes() -> int | None:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def remove_stale(node: str, keep: frozenset[str] = frozenset()) -> list[str]:
    """Unlink every shm file a previous run of this node left behind (not the lock, nor `keep`:
    the files of a pool being adopted)."""
    prefix, lock = f"ecd.{node}.", lock_name(node)
    removed = []
    for name in os.listdir(SHM_DIR):
        if name.startswith(prefix) and name != lock and name not in keep:
            _unlink_quietly(shm_path(name))
            removed.append(name)
    return sorted(removed)


class NodeLock:
    """flock on /dev/shm/ecd.<node>.lock: one daemon per node name, released by the kernel on death."""

    def __init__(self, node: str, group: int = -1) -> None:
        self.path = shm_path(lock_name(node))
        self.group = group
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ShmError(f"another ecd daemon (pid {holder}) is serving this node") from None
        os.fchmod(fd, FILE_MODE)
        if self.group >= 0:
            os.fchown(fd, -1, self.group)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            _unlink_quietly(self.path)
            os.close(self._fd)
            self._fd = None


class HostPool:
    """The daemon's host pool: segments of the sizes the config cuts (restart/adopt.py's pool_layout)."""

    def __init__(self, node: str, sizes: Sequence[int], group: int = -1) -> None:
        self.segments: list[ShmFile] = []
        # Check the whole pool up front: filling memory segment by segment before failing would
        # take the node's memory with it (tmpfs and memfd pages are RAM) and invite the OOM killer.
        self.check_room(sum(sizes))
        try:
            for index, size in enumerate(sizes):
                self.segments.append(self.create_segment(segment_name(node, index), size, group))
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_segments(cls, segments: list[ShmFile]) -> "HostPool":
        """A pool over segments that already exist (adopted after a restart: ecd/daemon/restart/)."""
        pool = cls.__new__(cls)
        pool.segments = segments
        return pool

    def check_room(self, size: int) -> None:
        free = _shm_free_bytes()
        if free is not None and size > free:
            raise ShmError(f"{SHM_DIR} has {format_size(free)} ({free} bytes) free, the host pool needs "
                           f"{format_size(size)} ({size} bytes): shrink pool.host.size or grow {SHM_DIR}")

    def create_segment(self, name: str, size: int, group: int) -> ShmFile:
        return ShmFile.create(name, size, group)

    def close(self, keep_names: bool = False) -> None:
        """Unmap nothing (the mappings go with their last user); close the descriptors and remove
        the named files, or, with `keep_names`, leave the files for the next daemon to adopt."""
        for seg in self.segments:
            if keep_names:
                seg.close_fd()
            else:
                seg.unlink()
        self.segments.clear()
