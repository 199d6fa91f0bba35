"""The holder: a small process that keeps the host pool's descriptors while no daemon runs.

    ecd hold --node NAME --runtime-dir DIR [--hold SECONDS]
    python -m ecd.daemon.restart.holder --node NAME --runtime-dir DIR [--hold SECONDS] [--spawned]

It listens on `<runtime_dir>/ecd.<node>.keeper/holder` (SOCK_SEQPACKET, mode 0600, in a directory
of mode 0700 that it refuses to use when another user owns it or may write to it; peers of another
uid than its own or root are refused: the descriptors give write access to every entry). The wire is
restart/holder_wire.py's. A daemon takes what the holder holds at its start and keeps its pool
with it; its connection stays open as its lease. When the lease closes (the daemon exited, was
killed) the holder waits `hold` seconds for the next daemon, then closes every descriptor,
unlinks the named files it was given (only where the path is still the file it holds) and exits 0:
the memory returns to the machine. `release` or SIGTERM/SIGINT lets go at once.

A holder someone else runs (a sidecar, a unit of its own) waits without a deadline until a daemon
first connects; one a daemon spawned (`--spawned`) starts its clock at once, so a daemon that died
before reaching it leaves no process behind. One holder per node: a lock file beside the socket (its log is there too).

Only the standard library and msgspec: it starts in milliseconds and never imports torch, zmq or
numpy. Nothing a client sends can make it lose the pool: a bad message gets a reply with the
reason (or the connection is dropped) and the holder goes on holding.
"""
from __future__ import annotations

import argparse
import fcntl
import os
import resource
import selectors
import signal
import socket
import stat
import sys
import time
from dataclasses import dataclass, field

import msgspec

from .holder_wire import (HOLDER_WIRE_VERSION, OPS, HolderReply, HolderRequest, WireError, close_all,
                          make_private_dir, name_problem, path_problem, peer_ids, receive, request_decoder, send,
                          socket_path)
from ...fd_passing import FDS_PER_MESSAGE

MAX_HELD = 65536  # descriptors (16 TiB of pool in 1 GiB segments is 16384)
MAX_CONNECTIONS = 64  # at once; more are turned away with a reason
SILENCE_S = 5.0  # a connection without the lease must say something (and finish a keep) within this
SEND_TIMEOUT_S = 5.0  # a take's batches: a peer that does not read them loses its connection


def log(message: str) -> None:
    try:
        print(f"ecd hold[{os.getpid()}]: {message}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass  # stderr gone (the daemon's pipe closed): holding the pool matters more than the log


@dataclass
class Held:
    fd: int
    size: int
    inode: tuple[int, int]


@dataclass
class Connection:
    sock: socket.socket
    pid: int
    uid: int
    deadline: float | None  # silence: dropped at this monotonic time (None: the lease's own)
    pending: list[tuple[str, int]] = field(default_factory=list)  # a keep's batches so far
    pending_unlink: list[str] = field(default_factory=list)
    refused: str = ""  # refused at accept: the reason, answered to its first message (or on close)


class Holder:
    def __init__(self, node: str, runtime_dir: str, hold: float, spawned: bool = False) -> None:
        self.node = node
        self.path = socket_path(runtime_dir, node)
        self.hold = hold
        self.held: dict[str, Held] = {}
        self.unlink: list[str] = []
        self.lease: Connection | None = None
        self.connections: dict[int, Connection] = {}
        # the clock: a spawned holder's runs from the start, another's from the first lease's end
        self.expires: float | None = time.monotonic() + hold if spawned else None
        self.uid = os.getuid()
        self.selector = selectors.DefaultSelector()
        self.listener: socket.socket | None = None
        self.lock_fd = -1
        self.done = False
        self.max_held = MAX_HELD

    # ---- start and end ----

    def bind(self) -> None:
        """Take the node's lock and its socket. SystemExit(1) when another holder runs, (2) when
        the socket cannot be made."""
        directory = os.path.dirname(self.path)
        if len(self.path.encode()) > 107:
            raise SystemExit(self.fail(f"the holder socket path {self.path} is longer than 107 bytes", 2))
        try:
            os.makedirs(os.path.dirname(directory), mode=0o770, exist_ok=True)
        except OSError as exc:
            raise SystemExit(self.fail(f"cannot use {os.path.dirname(directory)}: {exc.strerror}", 2)) from None
        problem = make_private_dir(directory)
        if problem:
            raise SystemExit(self.fail(f"the holder's directory is not private: {problem}", 2))
        try:
            self.lock_fd = os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise SystemExit(self.fail(f"cannot use {directory}: {exc.strerror}", 2)) from None
        try:
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise SystemExit(self.fail(f"another holder already holds node {self.node!r} ({self.path}): "
                                       f"one holder per node", 1)) from None
        if self.answers():  # a holder of an older version without the lock, say
            raise SystemExit(self.fail(f"another holder answers on {self.path} for node {self.node!r}", 1))
        try:
            os.unlink(self.path)  # a stale socket: its holder is gone (we hold the lock)
            log(f"replaced a stale holder socket {self.path}")
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise SystemExit(self.fail(f"cannot remove the stale socket {self.path}: {exc.strerror}", 2)) from None
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        old_umask = os.umask(0o177)  # 0600 from the start: no moment where others may connect
        try:
            listener.bind(self.path)
            os.chmod(self.path, 0o600)
            listener.listen(MAX_CONNECTIONS)
        except OSError as exc:
            listener.close()
            raise SystemExit(self.fail(f"cannot listen on {self.path}: {exc.strerror}", 2)) from None
        finally:
            os.umask(old_umask)
        listener.setblocking(False)
        self.listener = listener
        self.selector.register(listener, selectors.EVENT_READ, None)
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        with_suppressed(lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard)))  # room for a big pool
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        room = MAX_HELD if soft == resource.RLIM_INFINITY else soft - 4 * MAX_CONNECTIONS
        self.max_held = max(0, min(MAX_HELD, room))

    def answers(self) -> bool:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            probe.settimeout(1.0)
            probe.connect(self.path)
            return True
        except OSError:
            return False
        finally:
            probe.close()

    def fail(self, message: str, code: int) -> int:
        log(message)
        return code

    def let_go(self, why: str) -> None:
        """Close every descriptor, unlink the named files that are still the files held, stop."""
        count, size = len(self.held), self.held_bytes()
        inodes = {h.inode for h in self.held.values()}
        removed = 0
        for path in self.unlink:
            try:
                st = os.lstat(path)
                if (st.st_dev, st.st_ino) in inodes:  # a newer file of the same name is not ours
                    os.unlink(path)
                    removed += 1
            except OSError:
                pass
        close_all([h.fd for h in self.held.values()])
        self.held.clear()
        self.unlink = []
        log(f"{why}: let go of {count} descriptor(s) of {size} bytes, unlinked {removed} file(s); exiting")
        self.done = True

    def shut(self) -> None:
        self.lease = None  # let go already: no "daemon gone" clock for the closes below
        for conn in list(self.connections.values()):
            self.drop(conn)
        if self.listener is not None:
            self.selector.unregister(self.listener)
            self.listener.close()
            self.listener = None
            try:
                os.unlink(self.path)
            except OSError:
                pass
        self.selector.close()

    # ---- the loop ----

    def serve(self) -> int:
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        wake_w.setblocking(False)
        self.selector.register(wake_r, selectors.EVENT_READ, "signal")
        signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
        stop: list[int] = []
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda number, frame: stop.append(number))
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closed terminal is no reason to let go
        log(f"holding for node {self.node!r} on {self.path} (hold {self.hold:g} s once no daemon holds the lease)")
        try:
            while not self.done:
                for key, _ in self.selector.select(self.next_timeout()):
                    if key.data == "signal":
                        with_suppressed(lambda: wake_r.recv(64))
                    elif key.data is None:
                        for _ in range(MAX_CONNECTIONS):  # a burst of connects: empty the backlog
                            if not self.accept():
                                break
                    else:
                        conn: Connection = key.data
                        if self.connections.get(conn.sock.fileno()) is conn:  # not dropped in this round
                            self.serve_connection(conn)
                    if self.done:
                        break
                if stop and not self.done:
                    self.let_go(f"{signal.Signals(stop[0]).name}")
                self.check_clocks()
        finally:
            signal.set_wakeup_fd(-1)
            wake_r.close()
            wake_w.close()
            if not self.done:  # an exception: still let go, nothing held may outlive the process unseen
                self.let_go("stopped by an error")
            self.shut()
        return 0

    def next_timeout(self) -> float | None:
        deadlines = [c.deadline for c in self.connections.values() if c.deadline is not None]
        if self.expires is not None and self.lease is None:
            deadlines.append(self.expires)
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def check_clocks(self) -> None:
        now = time.monotonic()
        for conn in list(self.connections.values()):
            if conn.deadline is not None and now >= conn.deadline:
                self.refuse(conn, conn.refused or "said nothing (or left a keep unfinished) for "
                                                  f"{SILENCE_S:g} s: dropped", close=True)
        if self.lease is None and self.expires is not None and now >= self.expires and not self.done:
            self.let_go(f"no daemon took the pool within {self.hold:g} s: expired")

    def accept(self) -> bool:
        """One connection from the backlog (False: none waiting, or no descriptor left for it)."""
        assert self.listener is not None
        try:
            sock, _ = self.listener.accept()
        except OSError:
            return False  # EAGAIN, EMFILE: the pool is not at stake, try at the next wake
        sock.setblocking(False)
        pid, uid, _gid = peer_ids(sock)
        conn = Connection(sock, pid, uid, time.monotonic() + SILENCE_S)
        if uid not in (self.uid, 0):
            # Answered once its first message is read (or its silence ends): a unix socket closed
            # with a message unread resets the connection, and the reason would never arrive.
            log(f"refused pid {pid}: uid {uid} is neither the holder's ({self.uid}) nor root")
            conn.refused = f"uid {uid} may not use the holder of node {self.node!r}: only uid {self.uid} and root may"
            conn.deadline = time.monotonic() + 1.0
            self.connections[sock.fileno()] = conn
            self.selector.register(sock, selectors.EVENT_READ, conn)
            return True
        if len(self.connections) >= MAX_CONNECTIONS:
            self.reply(conn, HolderReply(version=HOLDER_WIRE_VERSION, op="refused",
                                         error=f"the holder has {MAX_CONNECTIONS} connections open: try again"))
            sock.close()
            return True
        self.connections[sock.fileno()] = conn
        self.selector.register(sock, selectors.EVENT_READ, conn)
        return True

    def drop(self, conn: Connection) -> None:
        close_all([fd for _, fd in conn.pending])
        conn.pending.clear()
        self.connections.pop(conn.sock.fileno(), None)
        with_suppressed(lambda: self.selector.unregister(conn.sock))
        conn.sock.close()
        if conn is self.lease:
            self.lease = None
            if not self.held:  # a daemon that failed before it kept anything: nothing to wait with
                self.let_go(f"daemon gone (pid {conn.pid}) before it kept a pool")
                return
            self.expires = time.monotonic() + self.hold
            log(f"daemon gone (pid {conn.pid}): holding {len(self.held)} descriptor(s) of "
                f"{self.held_bytes()} bytes for {self.hold:g} s")

    def reply(self, conn: Connection, message: HolderReply, fds: list[int] | None = None) -> bool:
        message.node, message.pid = self.node, os.getpid()
        message.held, message.bytes = len(self.held), self.held_bytes()
        message.lease_pid = self.lease.pid if self.lease is not None else 0
        try:
            send(conn.sock, message, fds or [])
            return True
        except WireError:
            return False

    def refuse(self, conn: Connection, error: str, close: bool = False, busy: bool = False) -> None:
        """A bad request: say why. A connection without the lease is closed after it."""
        log(f"pid {conn.pid}: {error}")
        close_all([fd for _, fd in conn.pending])
        conn.pending.clear()
        conn.pending_unlink.clear()
        self.reply(conn, HolderReply(version=HOLDER_WIRE_VERSION, op="refused", error=error, busy=busy))
        if close or conn is not self.lease:
            self.drop(conn)
        else:
            conn.deadline = None

    def serve_connection(self, conn: Connection) -> None:
        try:
            self.readable(conn)
        except Exception as exc:  # a bug a request found: that connection goes, the pool stays
            log(f"pid {conn.pid}: dropped after an error in the holder: {exc!r}")
            self.drop(conn)

    def readable(self, conn: Connection) -> None:
        try:
            data, fds = receive(conn.sock, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except (OSError, WireError) as exc:
            self.refuse(conn, conn.refused or (str(exc) if isinstance(exc, WireError) else
                                               f"cannot read: {exc.strerror}"), close=bool(conn.refused))
            return
        if conn.refused:  # whatever it asked: the reason it was refused, then the connection goes
            close_all(fds)
            self.refuse(conn, conn.refused, close=True)
            return
        if not data and not fds:
            self.drop(conn)  # the peer closed
            return
        try:
            self.handle(conn, data, fds)
        except BaseException:
            close_all(fds)
            raise

    def handle(self, conn: Connection, data: bytes, fds: list[int]) -> None:
        try:
            request = request_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            close_all(fds)
            self.refuse(conn, f"a malformed request: {exc}")
            return
        if request.version != HOLDER_WIRE_VERSION:
            close_all(fds)
            self.refuse(conn, f"speaks holder wire version {request.version}; this holder speaks {HOLDER_WIRE_VERSION}")
            return
        if request.op not in OPS:
            close_all(fds)
            self.refuse(conn, f"unknown op {request.op!r:.80}: one of {', '.join(OPS)}")
            return
        if request.op != "keep" and (fds or conn.pending):
            close_all(fds)
            self.refuse(conn, f"{request.op} carries no descriptors"
                        if fds else f"{request.op} in the middle of a keep: the keep is dropped")
            return
        if request.op == "status":
            self.reply(conn, HolderReply(version=HOLDER_WIRE_VERSION, op="status"))
            return
        if self.lease is not None and conn is not self.lease:
            close_all(fds)
            self.refuse(conn, f"a daemon (pid {self.lease.pid}) holds the pool of node {self.node!r}: "
                              f"{request.op} is refused until its connection closes", busy=True)
            return
        if request.op == "take":
            self.take_lease(conn)
            self.send_take(conn)
        elif request.op == "keep":
            self.receive_keep(conn, request, fds)
        else:
            self.let_go(f"release asked by pid {conn.pid}")
            self.reply(conn, HolderReply(version=HOLDER_WIRE_VERSION, op="release"))

    def take_lease(self, conn: Connection) -> None:
        if self.lease is None:
            self.lease, self.expires = conn, None
            conn.deadline = None
            log(f"daemon pid {conn.pid} took over: {len(self.held)} descriptor(s) of {self.held_bytes()} bytes")

    def send_take(self, conn: Connection) -> None:
        items = list(self.held.items())
        chunks = [items[i:i + FDS_PER_MESSAGE] for i in range(0, len(items), FDS_PER_MESSAGE)] or [[]]
        conn.sock.settimeout(SEND_TIMEOUT_S)  # a peer that does not read its batches cannot stall us longer
        try:
            for n, chunk in enumerate(chunks):
                message = HolderReply(version=HOLDER_WIRE_VERSION, op="take", names=[name for name, _ in chunk],
                                      last=n == len(chunks) - 1)
                if not self.reply(conn, message, [h.fd for _, h in chunk]):
                    log(f"pid {conn.pid} did not read its descriptors: connection dropped")
                    self.drop(conn)
                    return
        finally:
            if conn.sock.fileno() >= 0:
                conn.sock.setblocking(False)

    def receive_keep(self, conn: Connection, request: HolderRequest, fds: list[int]) -> None:
        problem = ""
        if len(fds) > FDS_PER_MESSAGE:
            problem = f"{len(fds)} descriptors in one message: at most {FDS_PER_MESSAGE}"
        elif len(request.names) != len(fds):
            problem = f"{len(request.names)} name(s) for {len(fds)} descriptor(s)"
        elif len(conn.pending) + len(fds) > self.max_held:
            problem = f"more than {self.max_held} descriptors: this holder keeps at most that many"
        else:
            problem = next(filter(None, map(name_problem, request.names)), "") or \
                next(filter(None, map(path_problem, request.unlink)), "")
        if not problem:
            for fd in fds:
                mode = os.fstat(fd).st_mode
                if not stat.S_ISREG(mode):
                    problem = "a descriptor that is not a regular file (a memfd or a /dev/shm file): not kept"
                    break
        if problem:
            close_all(fds)  # and refuse() closes the earlier batches'
            self.refuse(conn, f"keep refused, nothing changed: {problem}")
            return
        conn.pending.extend(zip(request.names, fds))
        conn.pending_unlink.extend(request.unlink)
        if not request.last:
            conn.deadline = time.monotonic() + SILENCE_S  # the rest of the keep is due soon
            return
        names = [name for name, _ in conn.pending]
        if len(set(names)) != len(names):
            self.refuse(conn, "keep refused, nothing changed: a name appears twice")
            return
        new = {name: Held(fd, *self.describe(fd)) for name, fd in conn.pending}
        conn.pending.clear()
        old, self.held = self.held, new
        self.unlink, conn.pending_unlink = conn.pending_unlink, []
        close_all([h.fd for h in old.values()])  # the daemon re-sent those it still wants
        self.take_lease(conn)
        conn.deadline = None
        log(f"kept {len(new)} descriptor(s) of {self.held_bytes()} bytes for pid {conn.pid}"
            + (f" ({len(self.unlink)} named file(s) to unlink at the end)" if self.unlink else ""))
        self.reply(conn, HolderReply(version=HOLDER_WIRE_VERSION, op="keep"))

    @staticmethod
    def describe(fd: int) -> tuple[int, tuple[int, int]]:
        st = os.fstat(fd)
        return st.st_size, (st.st_dev, st.st_ino)

    def held_bytes(self) -> int:
        return sum(h.size for h in self.held.values())


def with_suppressed(action) -> None:  # type: ignore[no-untyped-def]
    try:
        action()
    except (OSError, KeyError, ValueError):
        pass


def run(node: str, runtime_dir: str, hold: float, spawned: bool = False) -> int:
    """`ecd hold`: 0 when the pool was let go (release, expiry, SIGTERM), 1 when another holder
    runs for the node, 2 on a usage or socket error."""
    if not node or "/" in node or not 0 <= hold <= 7 * 86400:
        log(f"usage: --node must be a name without '/' and --hold between 0 and 7 days (got {node!r}, {hold})")
        return 2
    holder = Holder(node, runtime_dir, hold, spawned)
    try:
        holder.bind()
    except SystemExit as exc:
        if holder.lock_fd >= 0:
            os.close(holder.lock_fd)
        return int(exc.code or 0)
    return holder.serve()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ecd.daemon.restart.holder", description=__doc__.splitlines()[0])
    parser.add_argument("--node", required=True, help="the node name (node.name in node.toml)")
    parser.add_argument("--runtime-dir", required=True, help="node.runtime_dir: where the holder socket goes")
    parser.add_argument("--hold", type=float, default=300.0, help="seconds to keep the pool once no daemon holds it")
    parser.add_argument("--spawned", action="store_true", help="started by a daemon: the clock runs from the start")
    args = parser.parse_args(argv)
    return run(args.node, os.path.abspath(args.runtime_dir), args.hold, args.spawned)


if __name__ == "__main__":
    sys.exit(main())
