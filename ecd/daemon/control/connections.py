"""The daemon's control connections: who is on the other end, how many there are, and how much
the daemon holds for each.

libzmq hides connections behind routing identities; ecd needs four things it does not give:
- the kernel's word on who connected: every message carries the fd it arrived on (ZMQ_SRCFD),
  and an ipc connection's fd tells the peer's pid, uid and groups as the kernel recorded them at
  connect() (SO_PEERCRED, SO_PEERGROUPS), and gives a pidfd of that very process
  (SO_PEERPIDFD), also when its pid namespace is not the daemon's (SO_PEERCRED's pid is 0
  then). A client cannot name another process as its own;
- notice that a connection is gone (a socket monitor's DISCONNECTED), so its session is
  reclaimed at once instead of when its process exits;
- a cap on connections: past it the oldest connection that never said Hello is closed (or the
  new one, when every connection has a session), so no neighbour can take the daemon's fds;
- a byte budget per connection for the replies it has not read. A peer's pipe drains in order,
  so one tracked frame (zero-copy: its tracker says when libzmq handed the bytes to the kernel)
  vouches for every reply sent before it. Every large reply is tracked, and one small reply per
  CHECKPOINT_BYTES; what is queued is at most what was sent after the newest tracked frame
  that is done. Tracking costs ~15 us a frame, so small replies almost never pay it. A peer past
  the budget (or past the pipe's message HWM) is disconnected.

Closing a connection libzmq owns is done with shutdown(2), never close(2): libzmq sees the end of
the stream, tears the connection down and closes the fd itself, and the fd number is never
freed under its feet. The fd's inode is checked first, so a number reused for another
connection is never shut down by mistake.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import fcntl
import functools
import logging
import os
import resource
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, cast

import zmq

log = logging.getLogger("ecd.daemon")

SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux 6.5; older kernels: pidfd_open(pid)
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux 4.13: the peer's supplementary groups
PIDFD_GET_PID_NAMESPACE = 0xFF05  # _IO(PIDFS_IOCTL_MAGIC, 5), Linux 6.11: a pidfd's pid namespace
PIDFS_MAGIC = 0x50494446  # statfs f_type of a pidfd on Linux 6.9+ (pidfs: one inode per process)
# File descriptors kept back from connections and sessions: pools, ring, lock, libzmq's own
# eventfds and epoll, the metrics listener, logs, and the head-room for a burst of connects that
# libzmq accepts before the monitor lets the daemon shed them (libzmq aborts on EMFILE).
FD_RESERVE = 256
TRACK_ALWAYS_BYTES = 64 << 10  # replies this large are always tracked (pyzmq's zero-copy size)
CHECKPOINT_BYTES = 256 << 10  # smaller ones: one tracked per this many bytes sent to a peer
# Replies queued to one peer by count, besides bytes: above the waiters one client may have
# parked (limits.max_waiters_per_client) that a single put_many could wake at once.
SNDHWM = 10_000
SWEEP_INTERVAL_S = 5.0  # re-check that every connection the monitor reported is still open
CLOSING_GRACE_S = 1.0  # a closed connection's session ends by then even if the ROUTER is never idle
_EVENT = struct.Struct("=HI")  # a monitor event's first frame: event number, value (the fd)
MONITORED = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
NOBLOCK, SNDMORE_NOBLOCK = int(zmq.NOBLOCK), int(zmq.SNDMORE | zmq.NOBLOCK)  # plain ints: cheaper per send
# pyzmq's Cython send, unbound: the Python wrapper zmq.Socket.send puts around it (routing_id and
# group, for draft sockets) costs ~0.2 us a call, and every reply is two sends.
_send_frame = zmq.backend.Socket.send


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (systemd's LimitNOFILE=, or the shell's);
    returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft if soft != resource.RLIM_INFINITY else 1 << 20
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return target
    except (ValueError, OSError) as exc:  # e.g. above fs.nr_open
        log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
        return soft


def connection_budget(fd_limit: int, max_connections: int, http_connections: int) -> int:
    """How many control connections fit in `fd_limit`: each may hold its fd and its session's
    pidfd, after the reserve and the HTTP connections. At least 16 so a tiny limit still serves."""
    return max(16, min(max_connections, (fd_limit - FD_RESERVE - http_connections) // 2))


@dataclass
class Credentials:
    """A local peer as the kernel recorded it when it connected (ids in the daemon's namespaces:
    pid 0 when its process is not visible from the daemon's pid namespace)."""
    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...] = ()  # supplementary groups (SO_PEERGROUPS; empty where unreadable)


@contextlib.contextmanager
def _borrowed(fd: int) -> Iterator[socket.socket]:
    """A socket object over a descriptor libzmq owns: detached on the way out, never closed."""
    sock = socket.socket(fileno=fd)
    try:
        yield sock
    finally:
        sock.detach()


def peer_credentials(fd: int) -> Credentials | None:
    """The kernel's record of who opened this unix-socket connection; None for tcp or when the
    peer is already gone. The pid is translated into the daemon's pid namespace (0: the peer's
    process is not visible from it)."""
    try:
        with _borrowed(fd) as sock:
            if sock.family != socket.AF_UNIX:
                return None
            pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            return Credentials(pid, uid & 0xFFFFFFFF, gid & 0xFFFFFFFF, _peer_groups(sock))
    except OSError:
        return None


def _peer_groups(sock: socket.socket) -> tuple[int, ...]:
    """The peer's supplementary groups at connect(): a pod's fsGroup and supplementalGroups are
    these, not its primary gid. A small buffer first; ERANGE means it has more groups."""
    for count in (64, 65536):  # NGROUPS_MAX is 65536
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * count)
        except OSError as exc:
            if exc.errno == errno.ERANGE:
                continue
            return ()  # before Linux 4.13
        return struct.unpack(f"{len(raw) // 4}I", raw[:len(raw) // 4 * 4])
    return ()


def peer_pidfd(fd: int, pid: int) -> int:
    """A pidfd of the process that opened this connection (SO_PEERPIDFD: exactly that process,
    whatever pid namespace it is in; pid may be 0); before Linux 6.5, pidfd_open(pid) (nothing
    for pid 0), with the usual pid-reuse window. -1 when it is gone or cannot be named."""
    try:
        with _borrowed(fd) as sock:
            return sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError:
        pass
    if pid <= 0:
        return -1
    try:
        return os.pidfd_open(pid)
    except OSError:
        return -1


@functools.cache
def pidfs() -> bool:
    """Whether pidfds live in pidfs (Linux 6.9+), where a pidfd's inode number names its process
    (every pidfd of one process has it, no two processes share it during a boot). Before, every
    pidfd shares one anonymous inode."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(256)  # struct statfs: f_type is its first field (a long)
        pidfd = os.pidfd_open(os.getpid())
        try:
            if libc.fstatfs(pidfd, buf) != 0:
                return False
        finally:
            os.close(pidfd)
        return bool(struct.unpack_from("l", buf.raw)[0] == PIDFS_MAGIC)
    except (OSError, AttributeError):
        return False


def process_inode(pidfd: int) -> int:
    """The pidfs inode of the process behind pidfd: an identity that holds across pid namespaces
    (0 when pidfds are not in pidfs, or pidfd is -1)."""
    if pidfd < 0 or not pidfs():
        return 0
    try:
        return os.fstat(pidfd).st_ino
    except OSError:
        return 0


def pid_namespace(pidfd: int) -> int:
    """Inode of the pid namespace of the process behind pidfd, as /proc/PID/ns/pid names it (0 when
    the kernel does not say: before Linux 6.11, or a daemon that may not ptrace-read that process,
    e.g. one of another uid, or a process already gone)."""
    if pidfd < 0:
        return 0
    try:
        nsfd = fcntl.ioctl(pidfd, PIDFD_GET_PID_NAMESPACE)
    except OSError:
        return 0
    try:
        return os.fstat(nsfd).st_ino
    except OSError:
        return 0
    finally:
        os.close(nsfd)


def socket_inode(fd: int) -> int:
    """The inode of the socket behind fd (-1 if closed): tells a reused fd number apart."""
    try:
        return os.fstat(fd).st_ino
    except OSError:
        return -1


def shut_down_socket(fd: int, inode: int) -> None:
    """shutdown(2) a libzmq connection by its fd: libzmq sees it closed and frees what it queued."""
    if inode < 0 or socket_inode(fd) != inode:
        return  # already closed, or the number belongs to another socket now
    with contextlib.suppress(OSError), _borrowed(fd) as sock:
        sock.shutdown(socket.SHUT_RDWR)


@dataclass(eq=False)
class Connection:
    fd: int
    inode: int  # of the socket behind fd when first seen: tells a reused fd number apart
    identity: bytes | None = None  # the ROUTER routing id of its messages, once one arrived
    session: Any = None  # the store Session opened by this connection's Hello
    credentials: Credentials | None = None  # looked up once, at its first Hello
    user_id: str = ""  # a CURVE client's public key (Z85), as the ZAP handler named it; tcp only
    closing: bool = False  # its DISCONNECTED came; its last messages may still be in the ROUTER
    sent_bytes: int = 0  # every reply byte queued to this peer
    drained_bytes: int = 0  # of which libzmq is known to have handed to the kernel
    next_checkpoint: int = 0  # sent_bytes past which the next reply is tracked
    # tracked replies not yet known drained: (tracker, sent_bytes once it was queued), oldest first
    checkpoints: collections.deque = field(default_factory=collections.deque)

    def queued_bytes(self) -> int:
        """At most this many reply bytes are still queued in the daemon for this peer."""
        while self.checkpoints and self.checkpoints[0][0].done:
            self.drained_bytes = self.checkpoints.popleft()[1]
        return self.sent_bytes - self.drained_bytes


class Connections:
    """Every connection of the daemon's ROUTER socket, from its monitor's ACCEPTED/DISCONNECTED
    events and the ZMQ_SRCFD of its messages. `on_gone(connection, reason)` is called once when a
    connection that carried messages ends (its session, if any, must be reclaimed)."""

    def __init__(self, sock: zmq.Socket, max_connections: int, queue_bytes: int,
                 on_gone: Callable[[Connection, str], None]) -> None:
        self.sock = sock
        # Before bind, so no ACCEPTED is missed.
        self.monitor = sock.get_monitor_socket(MONITORED)
        self.max_connections = max_connections
        self.queue_bytes = queue_bytes
        self._on_gone = on_gone
        self.by_fd: dict[int, Connection] = {}
        self.by_identity: dict[bytes, Connection] = {}
        # connections without a session, oldest first: the ones shed when the cap is reached
        self._idle: dict[int, None] = {}
        self.closing: list[tuple[Connection, float]] = []  # closed by their peer (when), ended by settle()
        self.closed: collections.Counter = collections.Counter()  # connections the daemon closed, by reason
        self._last_warning = 0.0
        self._next_sweep = time.monotonic() + SWEEP_INTERVAL_S

    @property
    def open(self) -> int:
        return len(self.by_fd)

    def monitor_fd(self) -> int:
        return cast(int, self.monitor.getsockopt(zmq.FD))  # an int option (the stubs say int | bytes)

    # ---- the monitor's events -----------------------------------------------------------

    def pending_events(self) -> bool:
        # Also what re-arms the monitor's edge-triggered FD.
        return bool(cast(int, self.monitor.getsockopt(zmq.EVENTS)) & zmq.POLLIN)

    def handle_events(self) -> None:
        """Apply every queued event. Called before each message is handled, so that a new
        connection's ACCEPTED is known before any of its messages.

        A DISCONNECTED is queued after the last messages of its connection, which may still wait
        in the ROUTER (a Bye sent just before close). So the connection is only marked closing:
        settle() ends it once the ROUTER holds no message, and a new connection on the same fd
        number (its ACCEPTED comes first) or the same routing id ends it at once."""
        while self.pending_events():
            frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            event, fd = _EVENT.unpack_from(frames[0])
            if event == zmq.EVENT_ACCEPTED:
                self._accepted(fd)
            elif event == zmq.EVENT_DISCONNECTED:
                conn = self.by_fd.get(fd)
                if conn is not None:
                    conn.closing = True
                    self.closing.append((conn, time.monotonic()))

    def settle(self, older_than: float = 0.0) -> None:
        """End the connections that closed: with older_than 0 when the ROUTER holds no message
        (none of theirs can be waiting), or those closed that many seconds ago when the ROUTER
        is never empty (fair queueing has long handed out their last messages)."""
        cutoff = time.monotonic() - older_than
        done = [conn for conn, since in self.closing if since <= cutoff]
        self.closing = [(conn, since) for conn, since in self.closing if since > cutoff]
        for conn in done:
            self._forget(conn, "disconnected")

    def _accepted(self, fd: int) -> None:
        stale = self.by_fd.get(fd)
        if stale is not None:  # closing (or its DISCONNECTED never came): the fd number is reused
            self._forget(stale, "disconnected")
        if len(self.by_fd) >= self.max_connections:
            victim = next(iter(self._idle), None)
            if victim is None:  # every connection has a session: refuse the new one
                self._warn(f"control connections at limits.max_connections={self.max_connections}, every "
                           f"one with a session: refusing new connections")
                shut_down_socket(fd, socket_inode(fd))
                self.closed["over_capacity"] += 1
                return
            self._warn(f"control connections at limits.max_connections={self.max_connections}: closing "
                       f"the oldest that never said hello")
            self.close(self.by_fd[victim], "over_capacity")
        self._track(fd)

    def _track(self, fd: int) -> Connection:
        """A connection first seen on this fd: no session yet, so the newest to shed."""
        conn = self.by_fd[fd] = Connection(fd, socket_inode(fd))
        self._idle[fd] = None
        return conn

    def _forget(self, conn: Connection, reason: str) -> None:
        """The connection is gone: drop it from the tables and end its session (on_gone)."""
        if self.by_fd.get(conn.fd) is not conn:
            return  # forgotten already
        del self.by_fd[conn.fd]
        self._idle.pop(conn.fd, None)
        if conn.identity is not None and self.by_identity.get(conn.identity) is conn:
            del self.by_identity[conn.identity]
        conn.checkpoints.clear()
        if conn.identity is not None:
            self._on_gone(conn, reason)

    def sweep(self) -> None:
        """Connections closed a while ago, and insurance against a lost DISCONNECTED: a connection
        whose fd no longer holds its socket is gone (one fstat each, every few seconds)."""
        if self.closing:
            self.settle(older_than=CLOSING_GRACE_S)
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_INTERVAL_S
        self.handle_events()
        for fd, conn in list(self.by_fd.items()):
            if not conn.closing and socket_inode(fd) != conn.inode:
                self._forget(conn, "disconnected")

    # ---- messages -----------------------------------------------------------------------

    def of(self, identity: bytes, fd: int) -> Connection:
        """The connection a message with this routing id arrived on (ZMQ_SRCFD)."""
        conn = self.by_fd.get(fd)
        if conn is None:  # accepted before the monitor was listening (cannot happen), or a lost event
            conn = self._track(fd)
        if conn.identity == identity:
            return conn
        if conn.identity is not None:  # the fd number now carries another connection
            self._forget(conn, "disconnected")
            conn = self._track(fd)
        other = self.by_identity.get(identity)
        if other is not None:  # the routing id was taken over by a new connection
            self._forget(other, "identity_reused")
        conn.identity = identity
        self.by_identity[identity] = conn
        return conn

    def bind_session(self, conn: Connection, session: Any) -> None:
        conn.session = session
        if session is None:
            self._idle[conn.fd] = None
        else:
            self._idle.pop(conn.fd, None)

    def credentials(self, conn: Connection) -> Credentials | None:
        if conn.credentials is None:
            conn.credentials = peer_credentials(conn.fd)
        return conn.credentials

    # ---- replies ------------------------------------------------------------------------

    def send(self, identity: bytes, payload: bytes) -> str | None:
        """Queue one reply; None when queued, else why it was not (the peer may be closed)."""
        conn = self.by_identity.get(identity)
        size = len(payload)
        track = False
        if conn is not None:
            queued = conn.queued_bytes()
            if queued + size > self.queue_bytes:
                self.close(conn, "client_backlog", f"{queued} bytes of replies unread, "
                                                   f"limits.client_queue_bytes={self.queue_bytes}")
                return "client_backlog"
            track = size >= TRACK_ALWAYS_BYTES or conn.sent_bytes + size >= conn.next_checkpoint
        try:
            _send_frame(self.sock, identity, SNDMORE_NOBLOCK)
            if track:
                tracker = self.sock.send(payload, zmq.NOBLOCK, copy=False, track=True)
                conn.sent_bytes += size
                conn.checkpoints.append((tracker, conn.sent_bytes))
                conn.next_checkpoint = conn.sent_bytes + CHECKPOINT_BYTES
            else:
                _send_frame(self.sock, payload, NOBLOCK)
                if conn is not None:
                    conn.sent_bytes += size
        except zmq.Again:  # ROUTER_MANDATORY: its pipe holds SNDHWM unread replies
            if conn is not None:
                self.close(conn, "client_backlog", f"{SNDHWM} replies unread")
            return "client_backlog"
        except zmq.ZMQError:  # EHOSTUNREACH: the peer is gone
            return "send_failed"
        return None

    # ---- closing ------------------------------------------------------------------------

    def close(self, conn: Connection, reason: str, detail: str = "") -> None:
        """Disconnect a peer: libzmq drops what it queued for it, its session is reclaimed."""
        if detail:
            creds = conn.credentials
            who = f"pid {creds.pid}" if creds is not None and creds.pid > 0 else \
                f"uid {creds.uid}, fd {conn.fd}" if creds is not None else f"fd {conn.fd}"
            log.warning("closing the connection of %s (%s): %s", who, reason, detail)
        self.closed[reason] += 1
        shut_down_socket(conn.fd, conn.inode)
        self._forget(conn, reason)

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last_warning >= 10.0:  # an attack must not also flood the log
            self._last_warning = now
            log.warning("%s (%d closed so far)", message, sum(self.closed.values()) + 1)

    def close_monitor(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(0)
