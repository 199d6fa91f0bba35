"""The pool's descriptors on their way to a client: the fd socket's wire and the client's end.

ZeroMQ's ipc transport cannot carry descriptors, so a daemon whose pool is memfds
(`[pool.host] backing = "memfd"`) also listens on a SOCK_SEQPACKET unix socket beside its control
socket: `<control socket>.fds` (ecd/daemon/control/fd_server.py). A client connects and sends nothing;
the daemon answers with one or more messages, each an `FdBatch` header (msgspec msgpack) with up to
FDS_PER_MESSAGE descriptors attached (SCM_RIGHTS), and closes. The last batch has `last` set. A
refusal is one batch with `error` set and no descriptors.

Welcome names the fd socket by its basename only: a client joins it to the directory of its own
control socket path, so a pod that mounts the socket directory elsewhere still finds it.
"""
from __future__ import annotations

import array
import errno
import os
import socket
import time

import msgspec

FD_SOCKET_SUFFIX = ".fds"
FD_WIRE_VERSION = 1
FDS_PER_MESSAGE = 200  # the kernel takes at most 253 (SCM_MAX_FD) in one message
MAX_HEADER_BYTES = 64 << 10


class FdItem(msgspec.Struct, array_like=True):
    kind: str  # "ring" (read-only), "pool" (read-write), "arena" (a CUDA VMM export) or "doorbell" (an eventfd)
    index: int  # the pool segment's or arena's pool number (0 for the ring)
    size: int


class FdBatch(msgspec.Struct, array_like=True):
    version: int
    epoch: int  # the daemon run: a client matches it with its Welcome's
    items: list[FdItem]  # one per attached descriptor, in order
    last: bool = True
    error: str = ""  # a refusal: why, and no descriptors


class FdFetchError(Exception):
    """The descriptors could not be fetched; the message says why."""


def fd_socket_path(control_socket_path: str) -> str:
    return control_socket_path + FD_SOCKET_SUFFIX


CONNECT_RETRY_S = 0.005  # the first wait for room in a full listen queue; doubles up to 0.1 s


def _connect_within(sock: socket.socket, path: str, timeout: float) -> None:
    """Connect within `timeout`. A unix socket with a timeout is non-blocking, and its connect
    fails at once (EAGAIN) while the daemon's listen queue is full, as under a burst of clients:
    that is a wait, not an answer."""
    deadline = time.monotonic() + timeout
    pause = CONNECT_RETRY_S
    while True:
        try:
            sock.connect(path)
            return
        except OSError as exc:
            if exc.errno == errno.EAGAIN and time.monotonic() + pause < deadline:
                time.sleep(pause)
                pause = min(pause * 2, 0.1)
                continue
            why = exc.strerror or exc
            if exc.errno == errno.EAGAIN:
                why = f"its listen queue stayed full for {timeout:g} s"
            raise FdFetchError(f"cannot connect to the daemon's fd socket {path}: {why}") from None


def receive(path: str, timeout: float) -> tuple[FdBatch, list[tuple[FdItem, int]]]:
    """Connect to the fd socket at `path` and collect every batch: the first header (epoch) and
    each item with its descriptor (the caller closes them). FdFetchError with the reason."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    got: list[tuple[FdItem, int]] = []
    try:
        sock.settimeout(timeout)
        _connect_within(sock, path, timeout)
        first: FdBatch | None = None
        decoder = msgspec.msgpack.Decoder(FdBatch)
        while True:
            try:
                data, fds = _recv_batch(sock)
            except (OSError, TimeoutError) as exc:
                raise FdFetchError(f"no descriptors from the daemon's fd socket {path}: "
                                   f"{getattr(exc, 'strerror', None) or exc or 'timed out'}") from None
            try:
                if not data:
                    raise FdFetchError(f"the daemon's fd socket {path} closed before its last batch")
                try:
                    batch = decoder.decode(data)
                except msgspec.DecodeError as exc:
                    raise FdFetchError(f"a malformed batch from the daemon's fd socket {path}: {exc}") from None
                if batch.error:
                    raise FdFetchError(f"the daemon's fd socket {path} refused this client: {batch.error}")
                if batch.version != FD_WIRE_VERSION or len(batch.items) != len(fds):
                    raise FdFetchError(f"the daemon's fd socket {path} sent version {batch.version} with "
                                       f"{len(fds)} descriptor(s) for {len(batch.items)} item(s)")
                if first is not None and batch.epoch != first.epoch:
                    raise FdFetchError(f"the daemon's fd socket {path} changed epoch mid-transfer")
            except BaseException:
                for fd in fds:
                    os.close(fd)
                raise
            first = first or batch
            got.extend(zip(batch.items, fds))
            if batch.last:
                return first, got
    except BaseException:
        for _, fd in got:
            os.close(fd)
        raise
    finally:
        sock.close()


def _recv_batch(sock: socket.socket) -> tuple[bytes, list[int]]:
    fds = array.array("i")
    data, ancdata, flags, _ = sock.recvmsg(MAX_HEADER_BYTES, socket.CMSG_SPACE(253 * fds.itemsize),
                                              socket.MSG_CMSG_CLOEXEC)
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    received = list(fds)
    if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
        for fd in received:
            os.close(fd)
        raise OSError(0, "a batch arrived truncated")
    return data, received
