"""The host pool and the event ring as sealed memfds (`[pool.host] backing = "memfd"`, the default).

A memfd has no name in any filesystem: a client reaches it only through a descriptor the daemon
passes it (ecd/daemon/control/fd_server.py, SCM_RIGHTS), so a client in a container with its own IPC
namespace and its own /dev/shm maps the same pages as one on the host. Each segment is sealed
against shrinking and growing (F_SEAL_SHRINK | F_SEAL_GROW), then against further seals
(F_SEAL_SEAL): ftruncate by anyone, the daemon included, fails with EPERM, so the SIGBUS that a
truncated /dev/shm file deals (ecd/daemon/tiers/host.py) cannot happen. The ring is also sealed against
future writes (F_SEAL_FUTURE_WRITE, Linux 5.1) once the daemon has mapped it: the read-only
descriptor clients get cannot be re-opened writable through /proc/self/fd (a memfd's inode is
mode 0777), nor mapped PROT_WRITE, nor written.

What a client holding a pool descriptor can still do is what a pool mapping allows anyway: write
bytes (zeros included; fallocate(PUNCH_HOLE) is a write of zeros here), never make a page vanish:
the memfd lives on the kernel's internal tmpfs, which has no size limit, so a page that was
punched out is allocated again on the next touch, and memory short of that is the OOM killer's,
not a SIGBUS.
"""
from __future__ import annotations

import errno
import fcntl
import mmap
import os

from ..config_types import format_size
from .host import HostPool, ShmError, ShmFile, allocate_whole

# Linux's values (include/uapi/linux/fcntl.h); Python 3.11's fcntl lacks F_SEAL_FUTURE_WRITE.
F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
F_SEAL_SEAL = 0x0001
F_SEAL_SHRINK = 0x0002
F_SEAL_GROW = 0x0004
F_SEAL_WRITE = 0x0008
F_SEAL_FUTURE_WRITE = 0x0010
MFD_NOEXEC_SEAL = 0x0008  # Linux 6.3: not executable, said explicitly (else the kernel logs a warning)

POOL_SEALS = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL
SECRET_SEALS = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL  # no change of any kind
RING_SEALS = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL


def _memfd(name: str) -> int:
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
    try:
        return os.memfd_create(name, flags | MFD_NOEXEC_SEAL)
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # EINVAL: a kernel before 6.3
            raise
    return os.memfd_create(name, flags)


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where it cannot be read)."""
    try:
        with open("/proc/meminfo", "rb") as meminfo:
            for line in meminfo:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def sealed_secret(name: str, data: bytes) -> int:
    """A memfd holding `data`, sealed against every change (the journal's key: whoever holds the
    descriptor can read it, no one can alter it); the caller owns the descriptor."""
    fd = _memfd(name)
    try:
        os.write(fd, data)
        fcntl.fcntl(fd, F_ADD_SEALS, SECRET_SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def seals_of(fd: int) -> int:
    """The seals on `fd` (0 for a descriptor that is no memfd, or cannot be asked)."""
    try:
        return fcntl.fcntl(fd, F_GET_SEALS)
    except OSError:
        return 0


def check_memory_room(size: int) -> None:
    """ShmError when the node has less memory available (MemAvailable) than a new pool of `size`
    bytes: `ecd serve` refuses such a pool, and `ecd doctor` says so first (the same check)."""
    free = available_memory()
    if free is not None and size > free:
        raise ShmError(f"the node has {format_size(free)} ({free} bytes) of memory available, the host pool "
                       f"needs {format_size(size)} ({size} bytes): shrink pool.host.size")


class MemfdFile(ShmFile):
    """A ShmFile whose file is a sealed memfd: the same interface for the daemon's copies
    (write_at, read_into, current_size), no name to unlink, and a size nobody can change."""

    sealed = True  # pool_integrity and clients: a truncation cannot happen

    @classmethod
    def create_sealed(cls, name: str, size: int, *, seals: int = POOL_SEALS) -> "MemfdFile":
        """A memfd of `size` bytes, every page allocated now (posix_fallocate: memory short
        fails here, with a reason, not later in a client's copy), mapped read-write, sealed."""
        try:
            fd = _memfd(name)
        except OSError as exc:
            raise ShmError(f"cannot create memfd {name}: {exc.strerror}") from None
        try:
            os.ftruncate(fd, size)
            allocate_whole(fd, size, holder="memory", name=name, what=f"memfd {name}")
            buf = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            # After the writable mapping: F_SEAL_FUTURE_WRITE refuses new ones, not this one.
            fcntl.fcntl(fd, F_ADD_SEALS, seals)
        except OSError as exc:
            os.close(fd)
            raise ShmError(f"cannot set up memfd {name}: {exc.strerror}") from None
        except BaseException:
            os.close(fd)
            raise
        return cls(name, size, buf, fd)

    def read_only_fd(self) -> int:
        """A new descriptor of this memfd opened O_RDONLY (the caller closes it): what the
        clients get for the ring, so none of them can map it writable."""
        return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)

    def seals(self) -> int:
        return fcntl.fcntl(self.fd, F_GET_SEALS)

    def unlink(self) -> None:
        """No name to remove: the pages go when the last descriptor and mapping do."""
        self.close_fd()

    def current_size(self) -> int:
        return self.size  # sealed: no fstat needed, no one can change it

    def write_at(self, offset: int, data: bytes) -> int:
        """A plain store through the mapping: sealed against shrinking, no page of it can go, so
        the kernel copy the named files need (ShmFile.write_at, ~3 us more per inline put) is not."""
        self.buf[offset:offset + len(data)] = data
        return len(data)


def map_fd(fd: int, size: int, *, writable: bool, populate: bool = False) -> mmap.mmap:
    """A client's mapping of a descriptor the daemon passed (the caller still closes `fd`),
    after checking that it is as big as the daemon said."""
    actual = os.fstat(fd).st_size
    if actual != size:
        raise ShmError(f"a descriptor the daemon passed is {actual} bytes, it announced {size}")
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    # MAP_POPULATE: see ShmFile.attach
    return mmap.mmap(fd, size, mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0), prot)


class MemfdPool(HostPool):
    """The daemon's host pool as sealed memfds (segments of the sizes the config cuts)
    (named like the files of the named mode, for /proc/PID/maps and the logs; no group: a memfd
    has no path for a permission to guard, its descriptors are what is handed out)."""

    def check_room(self, size: int) -> None:
        check_memory_room(size)

    def create_segment(self, name: str, size: int, group: int) -> ShmFile:
        return MemfdFile.create_sealed(name, size)
