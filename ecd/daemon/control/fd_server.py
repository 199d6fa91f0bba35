"""The fd socket: hands the host pool's memfds, the ring's read-only descriptor and the CUDA arenas
exported as file descriptors (`[pool.cuda] export = "fd"`) to local clients.

Beside the control socket, `<control socket>.fds` (a tcp control endpoint: `<runtime_dir>/ecd.<node>.fds`),
a SOCK_SEQPACKET unix socket with the control socket's group and mode (0660). The wire is
ecd/fd_passing.py's: the client sends nothing, the daemon answers every connection at once with
its batches and closes it. So nothing a client does can hold the daemon: no request is read, no
connection outlives the callback that accepted it, and the sends cannot block (a fresh
connection's buffer is empty; a send that would block anyway fails that connection alone).

Admission: the socket's file permissions (the same group as the control socket) and the control
socket's `[control] allowed_uids` / `allowed_gids` (admission.py, on the kernel's record of the
peer: SO_PEERCRED, SO_PEERGROUPS), both re-read at each connection so a SIGHUP applies; a refused
peer gets one batch naming its uid and what to set, and no descriptor. The batches are built once: the
descriptors are the daemon's own, valid for its whole run, and the kernel duplicates them into
each receiver.

What a client can still do: connect again and again without reading. Each reply it leaves unread
keeps the pool's descriptors in flight (the kernel counts them against the daemon's user, up to its
open-file limit), bounded by how many sockets that client can hold open; sends that fail then are
counted (`ecd_pool_fd_handouts{outcome="failed"}`) and affect only fd handouts, never the pool.
"""
from __future__ import annotations

import array
import asyncio
import errno
import logging
import os
import socket
from contextlib import suppress
from typing import Any, Callable, Sequence

import msgspec

from ...fd_passing import FD_WIRE_VERSION, FDS_PER_MESSAGE, FdBatch, FdItem
from .admission import MAX_LOGGED_UIDS, admit as admit_ids
from .connections import peer_credentials
from ...memory.host import ShmFile
from ...memory.memfd import MemfdFile

log = logging.getLogger("ecd.daemon")

ACCEPTS_PER_WAKE = 64  # then let the loop serve others; the listener stays readable
EMFILE_PAUSE_S = 0.1  # out of descriptors: stop accepting this long instead of spinning
BACKLOG = 128


class FdServer:
    """Bound at start (errors are start-up errors), served on the loop from `start`."""

    def __init__(self, path: str, gid: int, epoch: int, ring: MemfdFile, segments: Sequence[ShmFile],
                 control: Callable[[], Any], arenas: Sequence[tuple[int, int, int]] = ()) -> None:
        """`control`: the daemon's `[control]` section as it is now (after any SIGHUP); `arenas`:
        (pool index, size, descriptor) of the CUDA arenas exported as file descriptors."""
        self.path = path
        self._control = control
        self._logged_uids: set[int] = set()  # a refused uid is logged once (a retry loop must not flood the log)
        self.counts = {"sent": 0, "refused": 0, "failed": 0}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ring_fd = -1
        self._epoch = epoch
        self._warned_emfile = False
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        try:
            with suppress(FileNotFoundError):
                os.unlink(path)  # a socket file left by a daemon that died (the node lock is held)
            old_umask = os.umask(0o007)  # owner and group only, from birth
            try:
                sock.bind(path)
            finally:
                os.umask(old_umask)
            os.chown(path, -1, gid)
            os.chmod(path, 0o660)
            sock.listen(BACKLOG)
            self._ring_fd = ring.read_only_fd()
        except BaseException:
            sock.close()
            if self._ring_fd >= 0:
                os.close(self._ring_fd)
            raise
        self.sock = sock
        items = [(FdItem("ring", 0, ring.size), self._ring_fd)]
        items += [(FdItem("pool", i, seg.size), seg.fd) for i, seg in enumerate(segments)]
        items += [(FdItem("arena", index, size), fd) for index, size, fd in arenas]
        self._batches = []
        for first in range(0, len(items), FDS_PER_MESSAGE):
            chunk = items[first:first + FDS_PER_MESSAGE]
            header = FdBatch(FD_WIRE_VERSION, epoch, [item for item, _ in chunk],
                             last=first + FDS_PER_MESSAGE >= len(items))
            self._batches.append((msgspec.msgpack.encode(header), array.array("i", [fd for _, fd in chunk])))

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        loop.add_reader(self.sock.fileno(), self._on_readable)

    def _on_readable(self) -> None:
        for _ in range(ACCEPTS_PER_WAKE):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE) and self._loop is not None:
                    if not self._warned_emfile:
                        log.warning("fd socket: out of descriptors (%s): accepts paused", exc.strerror)
                        self._warned_emfile = True
                    self._loop.remove_reader(self.sock.fileno())
                    self._loop.call_later(EMFILE_PAUSE_S, self.start, self._loop)
                return
            with conn:
                self._serve(conn)

    def _serve(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        try:
            creds = peer_credentials(conn.fileno())
            if creds is None:
                raise OSError(0, "the peer is gone")
            why = admit_ids(creds.uid, creds.gid, self._control(), creds.groups)
            if why is not None:
                self.counts["refused"] += 1
                if creds.uid not in self._logged_uids and len(self._logged_uids) < MAX_LOGGED_UIDS:
                    self._logged_uids.add(creds.uid)
                    log.warning("fd socket: refused the pool to pid %d: %s", creds.pid, why)
                conn.send(msgspec.msgpack.encode(FdBatch(FD_WIRE_VERSION, self._epoch, [], error=why)))
                return
            for header, fds in self._batches:
                conn.sendmsg([header], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        except OSError as exc:
            self.counts["failed"] += 1
            log.debug("fd socket: a handout failed: %s", exc)
            return
        self.counts["sent"] += 1

    def close(self) -> None:
        if self._loop is not None:
            with suppress(Exception):
                self._loop.remove_reader(self.sock.fileno())
        self.sock.close()
        with suppress(FileNotFoundError):
            os.unlink(self.path)
        if self._ring_fd >= 0:
            os.close(self._ring_fd)
            self._ring_fd = -1

