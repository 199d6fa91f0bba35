"""The disk tier's files: one self-describing record per entry, and the blocking I/O on them.

Every function here blocks and is called on a worker thread (ecd/daemon/tiers/disk.py runs them in
its executor), except `open_directory`, run once at start-up.

A record is one file, `<keyhash>-<epoch>-<sequence>.ecd` (the key's ring hash, the daemon run
that wrote it and the number of records that run wrote before it, all hex: no two writes share a
name, so a write never races the removal of an older record of the same key): a header of HEADER_UNIT-aligned length,
then the entry's bytes padded with zeros to a multiple of HEADER_UNIT (O_DIRECT moves whole
blocks). The header carries what the entry is (namespace, key, dtype, shape, nbytes), the xxh3-64
of its bytes, whether it was persisted, and its own xxh3-64 over everything before it, so a
record describes itself completely: a restart re-indexes the directory by reading headers only,
with no journal to replay, compact or lose (see docs/operating.md, "The disk tier").

Torn writes: a record is written to `<name>.tmp`, (fsync'd when it must be durable), then renamed
into place, so its final name only ever names a whole file; a crash leaves a `.tmp` that the next
start removes. Bytes that rot after that are caught by the data checksum on every read.

O_DIRECT (where the filesystem takes it): buffers handed to the kernel must be aligned to the
block size in address and length. Pool extents whose address is page-aligned (large entries
usually are: the allocator packs them from segment starts) are read and written in place; the
unaligned rest, the header and the last partial block go through a per-thread aligned bounce
buffer (an anonymous mmap: page-aligned).
"""
from __future__ import annotations

import errno
import fcntl
import mmap
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import xxhash

from ..integrity import finish

HEADER_UNIT = 4096  # the block every O_DIRECT transfer is a multiple of (covers 512-byte devices too)
MAGIC = b"ECDREC01"
VERSION = 1
FLAG_PERSISTED = 1
SUFFIX = ".ecd"
TEMP_SUFFIX = ".tmp"
BOUNCE_BYTES = 8 << 20  # per worker thread: the unaligned parts of a transfer go through it
CHUNK = 64 << 20  # largest single pread/pwrite (the kernel caps one call near 2 GiB anyway)
# magic, version, flags, header_len, reserved, nbytes, checksum, epoch, sequence, written_ns,
# ns_len, key_len, dtype_len, ndim; then ndim u64 dimensions, the three strings, zeros, and the
# header's own xxh3-64 in its last 8 bytes.
_FIXED = struct.Struct("<8sIIIIQQQQQHHHH")
_U64 = struct.Struct("<Q")


class DiskIOError(Exception):
    """A disk operation failed; `kind` labels it in metrics (enospc, eio, readonly, missing,
    truncated, corrupt, header, io)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def error_kind(exc: OSError) -> str:
    return {errno.ENOSPC: "enospc", errno.EDQUOT: "enospc", errno.EIO: "eio", errno.EROFS: "readonly",
            errno.ENOENT: "missing"}.get(exc.errno or 0, "io")


@dataclass(slots=True)
class RecordHeader:
    ns: str
    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    checksum: int  # xxh3-64 of the entry's bytes (never 0)
    epoch: int  # the daemon run that wrote it
    sequence: int  # records that run wrote before it: (epoch, sequence) orders a key's records
    written_ns: int  # wall clock at the write (restart order: newest last)
    persisted: bool

    def encode(self) -> bytes:
        strings = self.ns.encode() + self.key.encode() + self.dtype.encode()
        body = 8 * len(self.shape) + len(strings)
        header_len = -(-(_FIXED.size + body + 8) // HEADER_UNIT) * HEADER_UNIT
        fixed = _FIXED.pack(MAGIC, VERSION, FLAG_PERSISTED if self.persisted else 0, header_len, 0, self.nbytes,
                            self.checksum, self.epoch, self.sequence, self.written_ns,
                            len(self.ns.encode()), len(self.key.encode()), len(self.dtype.encode()), len(self.shape))
        raw = bytearray(header_len)
        raw[:_FIXED.size] = fixed
        at = _FIXED.size
        for dim in self.shape:
            _U64.pack_into(raw, at, dim)
            at += 8
        raw[at:at + len(strings)] = strings
        _U64.pack_into(raw, header_len - 8, finish(xxhash.xxh3_64_intdigest(bytes(raw[:header_len - 8]))))
        return bytes(raw)

    @property
    def header_len(self) -> int:
        return header_length(self.ns, self.key, self.dtype, len(self.shape))

    @property
    def file_size(self) -> int:
        return self.header_len + padded(self.nbytes)


def header_length(ns: str, key: str, dtype: str, ndim: int) -> int:
    body = 8 * ndim + len(ns.encode()) + len(key.encode()) + len(dtype.encode())
    return -(-(_FIXED.size + body + 8) // HEADER_UNIT) * HEADER_UNIT


def padded(nbytes: int) -> int:
    return -(-nbytes // HEADER_UNIT) * HEADER_UNIT


def record_size(ns: str, key: str, dtype: str, ndim: int, nbytes: int) -> int:
    """Bytes a record of this entry takes on disk (what the budget counts)."""
    return header_length(ns, key, dtype, ndim) + padded(nbytes)


def decode_header(raw: bytes) -> RecordHeader:
    """Parse and check a header (raw: at least its header_len bytes); DiskIOError("header")."""
    if len(raw) < _FIXED.size or raw[:8] != MAGIC:
        raise DiskIOError("header", "not an ecd record (bad magic)")
    (_, version, flags, header_len, _, nbytes, checksum, epoch, sequence, written_ns, ns_len, key_len,
     dtype_len, ndim) = _FIXED.unpack_from(raw)
    if version != VERSION:
        raise DiskIOError("header", f"record version {version}, this ecd reads {VERSION}")
    if header_len % HEADER_UNIT or header_len > len(raw) or _FIXED.size + 8 * ndim + ns_len + key_len + dtype_len + 8 > header_len:
        raise DiskIOError("header", f"header length {header_len} does not fit its fields")
    stored = _U64.unpack_from(raw, header_len - 8)[0]
    if finish(xxhash.xxh3_64_intdigest(raw[:header_len - 8])) != stored:
        raise DiskIOError("header", "header checksum does not match")
    at = _FIXED.size
    shape = tuple(_U64.unpack_from(raw, at + 8 * i)[0] for i in range(ndim))
    at += 8 * ndim
    try:
        ns = raw[at:at + ns_len].decode()
        key = raw[at + ns_len:at + ns_len + key_len].decode()
        dtype = raw[at + ns_len + key_len:at + ns_len + key_len + dtype_len].decode()
    except UnicodeDecodeError:
        raise DiskIOError("header", "names are not UTF-8") from None
    return RecordHeader(ns, key, dtype, shape, nbytes, checksum, epoch, sequence, written_ns,
                        bool(flags & FLAG_PERSISTED))


def record_name(keyhash: int, epoch: int, sequence: int) -> str:
    return f"{keyhash:016x}-{epoch:x}-{sequence:x}{SUFFIX}"


def header_record_name(header: RecordHeader) -> str:
    """The name a record of this header is written under."""
    return record_name(_keyhash(header), header.epoch, header.sequence)


# ---- aligned buffers ----------------------------------------------------------------------

_local = threading.local()


def _bounce() -> mmap.mmap:
    buf = getattr(_local, "bounce", None)
    if buf is None:
        buf = _local.bounce = mmap.mmap(-1, BOUNCE_BYTES)  # page-aligned, per thread
    return buf


def address_of(view: memoryview) -> int:
    return int(np.frombuffer(view, np.uint8).ctypes.data) if view.nbytes else 0


# ---- the directory ------------------------------------------------------------------------

def probe_direct_io(path: str) -> bool:
    """Whether files in `path` take O_DIRECT, having checked that they take a write at all: one
    aligned block written (O_DIRECT where the open and the write take it, else buffered), fsync'd
    (a delayed-allocation filesystem may report ENOSPC only then) and removed. OSError other than
    O_DIRECT's EINVAL (full, read-only, permission) propagates. Leaves nothing behind."""
    probe = os.path.join(path, f".ecd-direct-probe-{os.getpid()}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    direct = True
    try:
        fd = os.open(probe, flags | os.O_DIRECT, 0o600)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        direct = False  # the write below still checks the filesystem takes one
        fd = os.open(probe, flags, 0o600)
    try:
        block = mmap.mmap(-1, HEADER_UNIT)  # page-aligned
        try:
            try:
                os.pwrite(fd, block, 0)
            except OSError as exc:
                if exc.errno != errno.EINVAL or not direct:
                    raise
                direct = False
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                os.pwrite(fd, block, 0)
            os.fsync(fd)
        finally:
            block.close()
        return direct
    finally:
        os.close(fd)
        _unlink_quietly(probe)


def _open_write(path: str, direct: bool) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (os.O_DIRECT if direct else 0), 0o640)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < view.nbytes:
        n = os.pwrite(fd, view[done:done + CHUNK], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        done += n


def _pread_all(fd: int, view: memoryview, offset: int) -> int:
    done = 0
    while done < view.nbytes:
        n = os.preadv(fd, [view[done:done + CHUNK]], offset + done)
        if n <= 0:
            break
        done += n
    return done


class WriteGuard:
    """Orders a record's rename into place with its cancellation (the key deleted or replaced
    while its write runs): the writer renames only under the lock and only if not cancelled, so
    once `cancel()` returns, either no file of the record will ever appear (a crash cannot bring
    it back at the next start) or it is in place now and the canceller removes it. The lock is
    held across one rename(2) at most."""

    __slots__ = ("lock", "cancelled", "renamed")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cancelled = False
        self.renamed = False

    def cancel(self) -> bool:
        """Cancel the write; True when its file was renamed into place already (remove it)."""
        with self.lock:
            self.cancelled = True
            return self.renamed


def write_record(directory: str, dirfd: int, header: RecordHeader, src: memoryview, direct: bool,
                 sync: bool, expect: int = 0, guard: WriteGuard | None = None) -> str:
    """Write `src` (header.nbytes bytes) as a record named after the header; returns its name.
    The bytes are hashed as they are written (header.checksum is set to it); `expect` (0: none):
    the checksum they must have, else DiskIOError("corrupt") and nothing is kept (bytes that went
    bad in memory are never written as good). `sync`: durable before returning (fsync of the file,
    then of the directory after the rename). `guard` cancelled before the rename:
    DiskIOError("cancelled"), nothing kept. DiskIOError (the temporary file removed) on failure."""
    name = header_record_name(header)
    final = os.path.join(directory, name)
    temp = final + TEMP_SUFFIX
    try:
        fd = _open_write(temp, direct)
    except OSError as exc:
        raise DiskIOError(error_kind(exc), f"cannot create {temp}: {exc.strerror}") from None
    renamed = False
    try:
        try:
            _write_body(fd, header, src, direct, expect)
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if guard is None:
            os.rename(temp, final)
        else:
            with guard.lock:
                if guard.cancelled:
                    raise DiskIOError("cancelled", f"{header.key!r} was deleted or replaced while written")
                os.rename(temp, final)
                guard.renamed = True
        renamed = True
        if sync:
            os.fsync(dirfd)  # the rename itself must survive a power cut
    except BaseException as exc:
        # nothing of a failed write may stay: not the temporary file, nor (a directory fsync
        # that failed after the rename) the record, which a restart would otherwise serve
        _unlink_quietly(final if renamed else temp)
        if isinstance(exc, OSError):
            raise DiskIOError(error_kind(exc), f"cannot write {temp}: {exc.strerror}") from None
        raise
    return name


def _check_digest(header: RecordHeader, digest: int, expect: int) -> None:
    if expect and digest != expect:
        raise DiskIOError("corrupt", f"{header.key!r}: bytes in memory no longer match their checksum")
    header.checksum = digest


def _write_body(fd: int, header: RecordHeader, src: memoryview, direct: bool, expect: int) -> None:
    """The data first (hashed while it is written), the header (with that hash) last: the file
    is a temporary one until renamed, so the order costs nothing and saves a second pass."""
    header_len = header.header_len
    nbytes = src.nbytes
    if not direct:
        hasher = xxhash.xxh3_64()
        _pipelined_write(fd, src, header_len, hasher)
        _check_digest(header, finish(hasher.intdigest()), expect)
        os.pwrite(fd, header.encode(), 0)
        os.ftruncate(fd, header_len + padded(nbytes))
        return
    bounce = _bounce()
    with memoryview(bounce) as b:
        if address_of(src) % HEADER_UNIT == 0:  # in place, but for the last partial block
            # the data goes in one write on a helper thread; this one hashes it meanwhile, then
            # writes the last partial block and the header (it needs the hash) while the data
            # is still on its way: no device round trip of its own after the data's
            hasher = xxhash.xxh3_64()
            whole = nbytes // HEADER_UNIT * HEADER_UNIT
            pending = _helper_pool().submit(_pwrite_all, fd, src[:whole], header_len) if whole else None
            try:
                hasher.update(src[:whole])
                if whole < nbytes:
                    tail = nbytes - whole
                    b[:tail] = src[whole:]
                    b[tail:HEADER_UNIT] = bytes(HEADER_UNIT - tail)
                    hasher.update(b[:tail])
                    _pwrite_all(fd, b[:HEADER_UNIT], header_len + whole)
                _check_digest(header, finish(hasher.intdigest()), expect)
                raw = b[HEADER_UNIT:HEADER_UNIT + header_len]
                raw[:] = header.encode()
                _pwrite_all(fd, raw, 0)
            finally:
                if pending is not None:
                    pending.result()  # never returns (nor raises) while the helper still writes
            return
        else:  # everything through the bounce buffer: hash first, in one pass
            _check_digest(header, finish(xxhash.xxh3_64_intdigest(src)), expect)
            done = 0
            while done < nbytes:
                n = min(nbytes - done, BOUNCE_BYTES)
                b[:n] = src[done:done + n]
                total = padded(n)
                b[n:total] = bytes(total - n)
                _pwrite_all(fd, b[:total], header_len + done)
                done += n
        b[:header_len] = header.encode()
        _pwrite_all(fd, b[:header_len], 0)


# Helper threads for the pipelines below: a read or write (the GIL released in the syscall) on
# one, the hash of the previous or same chunk on the caller's, so hashing costs no extra time.
PIPE_CHUNK = 4 << 20
_helpers: ThreadPoolExecutor | None = None
_helpers_lock = threading.Lock()


def _helper_pool() -> ThreadPoolExecutor:
    global _helpers
    with _helpers_lock:
        if _helpers is None:
            _helpers = ThreadPoolExecutor(8, thread_name_prefix="ecd-disk-pipe")
        return _helpers


def _pipelined_write(fd: int, src: memoryview, offset: int, hasher) -> None:
    """One write of it all on a helper (the device sees requests as large as dd's) while this
    thread hashes the same bytes (neither changes them)."""
    if not src.nbytes:
        return
    pending = _helper_pool().submit(_pwrite_all, fd, src, offset)
    try:
        hasher.update(src)
    finally:
        pending.result()


def _start_reads(fd: int, dst: memoryview, offset: int) -> list:
    """Ask for dst.nbytes bytes at `offset` in PIPE_CHUNK pieces, all at once (the device sees
    several requests in flight, as a single large read, dd's, gives it; one chunk at a time left
    promotions at ~0.6x dd): [(at, n, future of the bytes read)]."""
    pool = _helper_pool()
    return [(at, n, pool.submit(_pread_all, fd, dst[at:at + n], offset + at))
            for at, n in ((at, min(PIPE_CHUNK, dst.nbytes - at)) for at in range(0, dst.nbytes, PIPE_CHUNK))]


def _finish_reads(reads: list, dst: memoryview, hasher) -> bool:
    """Wait for _start_reads' pieces, hashing each (in order) as soon as it is in while the later
    ones are still being read. False: short. Returns (or raises) only once no read writes into dst."""
    whole, failure = True, None
    for at, n, read in reads:
        try:
            got = read.result()
        except BaseException as exc:  # re-raised once every read has finished
            failure = failure or exc
            continue
        if got != n:
            whole = False
        elif whole and failure is None:
            hasher.update(dst[at:at + n])
    if failure is not None:
        raise failure
    return whole


def read_record(directory: str, name: str, want: RecordHeader, dst: memoryview, direct: bool) -> None:
    """Read a record into `dst` (want.nbytes bytes) and check it: its header must describe `want`
    and its bytes must hash to want.checksum. DiskIOError: missing, truncated, header, corrupt,
    eio... `dst` may hold anything after a failure."""
    path = os.path.join(directory, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct else 0))
    except OSError as exc:
        raise DiskIOError(error_kind(exc), f"cannot open {path}: {exc.strerror}") from None
    reads: list = []
    try:
        size = os.fstat(fd).st_size
        header_len = want.header_len
        if size != header_len + padded(want.nbytes):
            raise DiskIOError("truncated", f"{path} is {size} bytes, its record needs {header_len + padded(want.nbytes)}")
        nbytes = want.nbytes
        in_place = not direct or address_of(dst) % HEADER_UNIT == 0  # (O_DIRECT: all but the last block)
        whole = 0
        if in_place:
            # the data is asked for before the header is read and checked (its place is known from
            # `want`): the header's read costs no extra trip to the device
            whole = nbytes if not direct else nbytes // HEADER_UNIT * HEADER_UNIT
            reads = _start_reads(fd, dst[:whole], header_len)
        hasher = xxhash.xxh3_64()
        bounce = _bounce()
        with memoryview(bounce) as b:
            if _pread_all(fd, b[:header_len], 0) != header_len:
                raise DiskIOError("truncated", f"{path}: short header")
            got = decode_header(bytes(b[:header_len]))
            if (got.ns, got.key, got.dtype, got.shape, got.nbytes, got.checksum) != (
                    want.ns, want.key, want.dtype, tuple(want.shape), want.nbytes, want.checksum):
                raise DiskIOError("header", f"{path}: header describes another entry")
            running, reads = reads, []
            if not _finish_reads(running, dst, hasher):
                raise DiskIOError("truncated", f"{path}: short read")
            done = whole
            while done < nbytes:
                n = min(nbytes - done, BOUNCE_BYTES)
                span = padded(n) if direct else n
                if _pread_all(fd, b[:span], header_len + done) < n:
                    raise DiskIOError("truncated", f"{path}: short read")
                dst[done:done + n] = b[:n]
                hasher.update(b[:n])
                done += n
    except OSError as exc:
        raise DiskIOError(error_kind(exc), f"cannot read {path}: {exc.strerror}") from None
    finally:
        for _, _, read in reads:  # a failure before they were waited for: none may outlive fd
            try:
                read.result()
            except BaseException:
                pass
        os.close(fd)
    if finish(hasher.intdigest()) != want.checksum:
        raise DiskIOError("corrupt", f"{path}: bytes do not match the record's checksum")


def checksum_of(view: memoryview) -> int:
    return finish(xxhash.xxh3_64_intdigest(view))


def _keyhash(header: RecordHeader) -> int:
    from .ring import key_hash
    return key_hash(header.ns, header.key)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def remove(directory: str, name: str) -> None:
    """Unlink a record; one already gone is not an error."""
    try:
        os.unlink(os.path.join(directory, name))
    except FileNotFoundError:
        pass


def remove_durably(directory: str, dirfd: int, names: list[str]) -> list[tuple[str, DiskIOError]]:
    """Unlink records, then fsync the directory once (the removals survive a power cut); the
    failures: (name, error) per name that failed, ("", error) for the fsync."""
    errors = []
    for name in names:
        try:
            remove(directory, name)
        except OSError as exc:
            errors.append((name, DiskIOError(error_kind(exc), f"cannot remove {name}: {exc.strerror}")))
    try:
        os.fsync(dirfd)
    except OSError as exc:
        errors.append(("", DiskIOError(error_kind(exc), f"cannot sync {len(names)} removal(s): {exc.strerror}")))
    return errors


# ---- re-indexing at start ----------------------------------------------------------------

def read_header(directory: str, name: str) -> tuple[RecordHeader, int]:
    """(header, file size) of one record, buffered (headers only: no data is read)."""
    path = os.path.join(directory, name)
    try:
        with open(path, "rb", buffering=0) as f:
            raw = f.read(HEADER_UNIT)
            size = os.fstat(f.fileno()).st_size
            if len(raw) >= _FIXED.size and raw[:8] == MAGIC:
                header_len = _FIXED.unpack_from(raw)[3]
                if HEADER_UNIT < header_len <= 64 * HEADER_UNIT:
                    raw += f.read(header_len - HEADER_UNIT)
    except OSError as exc:
        raise DiskIOError(error_kind(exc), f"cannot read {path}: {exc.strerror}") from None
    header = decode_header(raw)
    if size != header.file_size:
        raise DiskIOError("truncated", f"{path} is {size} bytes, its record needs {header.file_size}")
    return header, size


def list_directory(directory: str) -> tuple[list[str], list[str]]:
    """(record names, leftover temporary files) in `directory`; other files are not ecd's."""
    records, temps = [], []
    with os.scandir(directory) as it:
        for entry in it:
            if entry.name.endswith(SUFFIX + TEMP_SUFFIX):
                temps.append(entry.name)
            elif entry.name.endswith(SUFFIX) and entry.is_file(follow_symlinks=False):
                records.append(entry.name)
    return records, temps


def scan(directory: str, names: Iterable[str], executor) -> list[tuple[str, RecordHeader | DiskIOError, int]]:
    """Read every record's header on `executor`'s threads: (name, header or the error, size)."""
    def one(name: str) -> tuple[str, RecordHeader | DiskIOError, int]:
        try:
            header, size = read_header(directory, name)
            return name, header, size
        except DiskIOError as exc:
            return name, exc, 0
    return list(executor.map(one, names))
