"""The fd socket: hands the host pool's memfds, the ring's read-only descriptor, the CUDA arenas
exported as file descriptors (`[pool.cuda] export = "fd"`) and the submission area's doorbell (an
eventfd clients write to wake the daemon: daemon/writes/consumer.py) to local clients. A client of
a tenant with a size gets that tenant's own segments, ring and doorbell instead (and the arenas):
no descriptor of another tenant's part (docs/SECURITY.md, Tenants).

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

Unread handouts (issue 40, attack 4). A reply the client leaves unread keeps the pool's descriptors
in flight, and the kernel counts those against the daemon's user: past its open-file limit (for
a daemon without CAP_SYS_RESOURCE) every further send fails, every new client's included. The
kernel cannot take back descriptors queued to a reader that does not read, so the daemon keeps
each connection open until its reply is read (the client closes, or the queue it sent is empty:
SIOCOUTQ) and sends no more to a peer that leaves too many unread: at most MAX_UNREAD_PER_PID per
process, a quarter of the budget per uid, and the budget in all (three quarters of the open-file
limit, in descriptors, at most MAX_UNREAD connections). Past a bound the connection gets one
batch without descriptors saying which bound and what to do, counted as
`ecd_pool_fd_handouts{outcome="unread_limit"}`. So one flooding uid holds at most a quarter of
what the kernel allows and other uids' clients keep being served; clients of the flooding uid
share its quarter (separate tenants by uid).
"""
from __future__ import annotations

import array
import asyncio
import errno
import fcntl
import logging
import os
import socket
import struct
import termios
from collections import Counter
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import msgspec

from ...fd_passing import FD_WIRE_VERSION, FDS_PER_MESSAGE, FdBatch, FdItem
from ...listeners import SocketFiles
from ..registry.entries import RequestError
from .admission import MAX_LOGGED_UIDS, admit as admit_ids, tenant_of
from .connections import peer_credentials
from ...memory.host import ShmFile
from ...memory.memfd import MemfdFile

log = logging.getLogger("ecd.daemon")

ACCEPTS_PER_WAKE = 64  # then let the loop serve others; the listener stays readable
EMFILE_PAUSE_S = 0.1  # out of descriptors: stop accepting this long instead of spinning
BACKLOG = 128
MAX_UNREAD_PER_PID = 8  # a client reads its one handout at once; a few threads may connect together
MAX_UNREAD = 256  # connections kept open until read: each is one of the daemon's descriptors
UID_SHARE = 4  # one uid may leave unread at most 1/UID_SHARE of the budget


@dataclass(eq=False)
class Handout:
    """A reply sent and not yet read: the connection stays open until it is."""
    conn: socket.socket
    uid: int
    pid: int  # 0: in another pid namespace (then only its uid's bound applies)


class FdServer:
    """Bound at start (errors are start-up errors), served on the loop from `start`."""

    def __init__(self, path: str, files: SocketFiles, epoch: int, ring: MemfdFile, segments: Sequence[ShmFile],
                 config: Callable[[], Any], arenas: Sequence[tuple[int, int, int]] = (),
                 fd_limit: int = 1024, doorbell: bool = False,
                 tenants: Mapping[str, tuple[Sequence[int], MemfdFile]] = {}) -> None:
        """`config`: the daemon's Config as it is now (after any SIGHUP); `arenas`:
        (pool index, size, descriptor) of the CUDA arenas exported as file descriptors; `fd_limit`:
        the daemon's open-file limit (the kernel's bound on its descriptors in flight); `doorbell`:
        make the submission area's eventfd (`self.doorbell`) and hand it out too; `tenants`: each
        sized tenant's segments and ring (by tenant name), handed to its clients instead of the
        rest (and a doorbell of its own): no other tenant's segment, ring or doorbell."""
        self.path = path
        self._config = config  # the daemon's current Config (its [control] lists and tenants' ids)
        self._logged_uids: set[int] = set()  # a refused uid is logged once (a retry loop must not flood the log)
        self.counts = {"sent": 0, "refused": 0, "failed": 0, "unread_limit": 0}
        self._unread: dict[int, Handout] = {}  # by the connection's descriptor
        self._unread_uids: Counter[int] = Counter()
        self._unread_pids: Counter[int] = Counter()
        self._limited_uids: set[int] = set()  # logged once each
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ring_fd = self.doorbell = -1
        self._tenant_ring_fds: dict[str, int] = {}  # read-only, as the node's ring's
        self.doorbells: dict[str, int] = {}  # by tenant ("": the default tenant's, every unsized one's)
        self._epoch = epoch
        self._warned_emfile = False
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        try:
            with suppress(FileNotFoundError):
                os.unlink(path)  # a socket file left by a daemon that died (the node lock is held)
            with files.bind(path):  # node.group's, and the allowed uids' (ACL)
                sock.bind(path)
            sock.listen(BACKLOG)
            self._ring_fd = ring.read_only_fd()
            for tenant, (_, tenant_ring) in tenants.items():
                self._tenant_ring_fds[tenant] = tenant_ring.read_only_fd()
            if doorbell:  # non-blocking for every holder: a client's ring never waits; a sized tenant's own
                for tenant in ["", *tenants]:
                    self.doorbells[tenant] = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
                self.doorbell = self.doorbells[""]
        except BaseException:
            sock.close()
            self._close_own()
            raise
        self.sock = sock
        owned = {pool for pools, _ in tenants.values() for pool in pools}
        arena_items = [(FdItem("arena", index, size), fd) for index, size, fd in arenas]  # (every tenant's)
        items = [(FdItem("ring", 0, ring.size), self._ring_fd)]
        items += [(FdItem("pool", i, seg.size), seg.fd) for i, seg in enumerate(segments) if i not in owned]
        items += arena_items + ([(FdItem("doorbell", 0, 0), self.doorbell)] if doorbell else [])
        handouts = {"": items}  # by tenant ("": the default tenant's, and every unsized tenant's)
        for tenant, (pools, tenant_ring) in tenants.items():
            handouts[tenant] = [(FdItem("ring", 0, tenant_ring.size), self._tenant_ring_fds[tenant])]
            handouts[tenant] += [(FdItem("pool", i, segments[i].size), segments[i].fd) for i in pools] + arena_items
            handouts[tenant] += [(FdItem("doorbell", 0, 0), self.doorbells[tenant])] if doorbell else []
        self._batches = {tenant: _batches(epoch, got) for tenant, got in handouts.items()}
        # unread handouts the kernel's in-flight limit allows
        budget = fd_limit * 3 // 4 // max(1, *(len(got) for got in handouts.values()))
        self.max_unread = max(UID_SHARE, min(MAX_UNREAD, budget))
        self.max_unread_per_uid = max(1, self.max_unread // UID_SHARE)

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
            if not self._serve(conn):
                conn.close()

    def _batches_for(self, creds: Any) -> tuple[str | None, list]:
        """(None, the batches of the peer's tenant's descriptors), or (why not, []): a peer whose
        hello is refused for its tenants (none with `[tenants] default = false`, or two by its
        groups) gets no pool either, whatever the allowed lists say."""
        try:
            tenant = tenant_of(self._config(), creds.uid, creds.gid, creds.groups)
        except RequestError as exc:
            return str(exc), []
        return None, self._batches.get(tenant, self._batches[""])

    def _serve(self, conn: socket.socket) -> bool:
        """Answer `conn`; True when it is kept open until its reply is read."""
        conn.setblocking(False)
        try:
            creds = peer_credentials(conn.fileno())
            if creds is None:
                raise OSError(0, "the peer is gone")
            batches: list[tuple[bytes, array.array]] = []
            why = admit_ids(creds.uid, creds.gid, self._config(), creds.groups)
            if why is None:
                why, batches = self._batches_for(creds)
            if why is not None:
                self.counts["refused"] += 1
                if creds.uid not in self._logged_uids and len(self._logged_uids) < MAX_LOGGED_UIDS:
                    self._logged_uids.add(creds.uid)
                    log.warning("fd socket: refused the pool to pid %d: %s", creds.pid, why)
                self._refuse(conn, why)
                return False
            why = self._unread_bound(creds.uid, creds.pid)
            if why:
                self.counts["unread_limit"] += 1
                if creds.uid not in self._limited_uids and len(self._limited_uids) < MAX_LOGGED_UIDS:
                    self._limited_uids.add(creds.uid)
                    log.warning("fd socket: no pool for pid %d (uid %d): %s", creds.pid, creds.uid, why)
                self._refuse(conn, why)
                return False
            for header, fds in batches:
                conn.sendmsg([header], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        except OSError as exc:
            self.counts["failed"] += 1
            log.debug("fd socket: a handout failed: %s", exc)
            return False
        self.counts["sent"] += 1
        self._track(Handout(conn, creds.uid, creds.pid))
        return True

    def _refuse(self, conn: socket.socket, why: str) -> None:
        conn.send(msgspec.msgpack.encode(FdBatch(FD_WIRE_VERSION, self._epoch, [], error=why)))

    # ---- handouts not yet read ----

    def _unread_bound(self, uid: int, pid: int) -> str:
        """Why this peer gets no handout now ("" when it does), after letting go of the handouts
        that were read meanwhile."""
        def over() -> str:
            if pid and self._unread_pids[pid] >= MAX_UNREAD_PER_PID:
                return (f"pid {pid} has {self._unread_pids[pid]} pool handouts unread (at most {MAX_UNREAD_PER_PID} "
                        "per process): read or close its fd-socket connections")
            if self._unread_uids[uid] >= self.max_unread_per_uid:
                return (f"uid {uid} has {self._unread_uids[uid]} pool handouts unread (at most "
                        f"{self.max_unread_per_uid} per uid): read or close its fd-socket connections")
            if len(self._unread) >= self.max_unread:
                return f"{len(self._unread)} pool handouts are unread (at most {self.max_unread}): try again"
            return ""
        if not over():
            return ""
        self._finish_read(uid if len(self._unread) < self.max_unread else None)
        return over()

    def _track(self, handout: Handout) -> None:
        fd = handout.conn.fileno()
        self._unread[fd] = handout
        self._unread_uids[handout.uid] += 1
        if handout.pid:
            self._unread_pids[handout.pid] += 1
        if self._loop is not None:  # the client closing (after reading) makes it readable: EOF
            self._loop.add_reader(fd, self._finish, fd)

    def _finish(self, fd: int) -> None:
        handout = self._unread.pop(fd, None)
        if handout is None:
            return
        for counts, key in ((self._unread_uids, handout.uid), (self._unread_pids, handout.pid)):
            counts[key] -= 1
            if counts[key] <= 0:
                del counts[key]
        if self._loop is not None:
            with suppress(Exception):
                self._loop.remove_reader(fd)
        handout.conn.close()

    def _finish_read(self, uid: int | None) -> None:
        """Let go of the handouts (of `uid`; None: all) whose reply was read though the client
        keeps its connection open: nothing of ours is left in its queue."""
        for fd, handout in list(self._unread.items()):
            if uid is None or handout.uid == uid:
                try:
                    queued = struct.unpack("i", fcntl.ioctl(fd, termios.TIOCOUTQ, b"\0" * 4))[0]
                except OSError:
                    queued = 0
                if queued == 0:
                    self._finish(fd)

    @property
    def unread(self) -> int:
        return len(self._unread)

    def close(self) -> None:
        if self._loop is not None:
            with suppress(Exception):
                self._loop.remove_reader(self.sock.fileno())
        for fd in list(self._unread):
            self._finish(fd)
        self.sock.close()
        with suppress(FileNotFoundError):
            os.unlink(self.path)
        self._close_own()

    def _close_own(self) -> None:
        for fd in (self._ring_fd, *self.doorbells.values(), *self._tenant_ring_fds.values()):
            if fd >= 0:
                os.close(fd)
        self._ring_fd = self.doorbell = -1
        self._tenant_ring_fds, self.doorbells = {}, {}


def _batches(epoch: int, items: list[tuple[FdItem, int]]) -> list[tuple[bytes, array.array]]:
    """One handout's messages (header, descriptors), at most FDS_PER_MESSAGE descriptors each."""
    batches = []
    for first in range(0, len(items), FDS_PER_MESSAGE):
        chunk = items[first:first + FDS_PER_MESSAGE]
        header = FdBatch(FD_WIRE_VERSION, epoch, [item for item, _ in chunk], last=first + FDS_PER_MESSAGE >= len(items))
        batches.append((msgspec.msgpack.encode(header), array.array("i", [fd for _, fd in chunk])))
    return batches
