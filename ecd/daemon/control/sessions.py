"""Client sessions: opened by a Hello on one connection, ended by Bye, by the connection closing,
by the client's process exiting, or (for sessions nothing can watch) by heartbeat silence.

Who a local client is comes from the kernel, never from Hello: the connection's SO_PEERCRED
pid, uid and gid, and a pidfd of that very process (SO_PEERPIDFD). SO_PEERPIDFD works whatever
pid namespace the client is in: a client in another container (SO_PEERCRED pid 0) is watched by
its pidfd like a host process, so its leases come back the moment its process exits, also when
a child it forked keeps the connection open. Hello.pid and Hello.pid_ns are only logged (and
pid_ns shown where the kernel will not say). A session whose process the kernel cannot name (a
tcp peer; a process outside the daemon's pid namespace before Linux 6.5) must heartbeat and is
reclaimed after `leases.session_ttl` of silence.

Sessions are capped in all (`limits.max_clients`) and per process (`limits.max_clients_per_pid`);
the excess is refused in Welcome's place, so a client can never take the daemon's file
descriptors. A process is told apart by its pidfs inode (Linux 6.9+: one per process, whatever
its pid namespace), else by its pid; a process that has neither (pid 0 on an older kernel)
counts in one bucket per uid. A local peer must also be admitted (admission.py).
"""
from __future__ import annotations

import collections
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ...errors import Code
from ...protocol import Hello, SessionInfo
from .admission import Refusals, admit, tenant_of
from .connections import Connection, Connections, Credentials, peer_pidfd, pid_namespace, process_inode
from ..registry.entries import RequestError, Session
from ..registry.store import Store

log = logging.getLogger("ecd.daemon")

NAME_SHOWN = 64  # characters of Hello.name kept for `ecd status`
Key = tuple[str, int]  # ("pidfs", inode), ("pid", pid), ("uid", uid), ("session", id)


@dataclass
class WatchedProcess:
    """One pidfd per client process, shared by all its sessions (a process may open several)."""
    pidfd: int
    pid_ns: int  # inode of its pid namespace, 0 when the kernel would not say
    sessions: set[Session] = field(default_factory=set)


@dataclass
class Peer:
    """What the daemon knows of the client behind one session."""
    creds: Credentials | None  # None: tcp
    process: Key | None  # its key in Sessions._processes (None: heartbeat-watched)
    bucket: Key | None  # its key in Sessions._per_process (None: not capped per process)
    pid_ns: int
    pid_ns_claimed: bool
    name: str

    def describe(self, session: Session) -> str:
        """'pid 123' or, for a process outside the daemon's pid namespace, 'uid 1000 in pid
        namespace 4026532178' for the log."""
        if session.pid or self.creds is None:
            return f"pid {session.pid}" if session.pid else "a remote client"
        claimed = " claimed" if self.pid_ns_claimed else ""
        return f"uid {self.creds.uid} in{claimed} pid namespace {self.pid_ns or '?'}"


class Sessions:
    def __init__(self, store: Store, loop: Any, connections: Connections, local: bool,
                 limits: Callable[[], Any], on_change: Callable[[], None]) -> None:
        self.store = store
        self.loop = loop
        self.connections = connections
        self.local = local  # an ipc endpoint: peers are processes on this host
        self._limits = limits  # the current [limits] (SIGHUP may replace them)
        self._on_change = on_change  # a session ended: replies may have been queued
        self._next_id = 1
        self._processes: dict[Key, WatchedProcess] = {}  # process key -> its pidfd and sessions
        self._per_process: collections.Counter = collections.Counter()  # bucket -> sessions (max_clients_per_pid)
        self._connection_of: dict[int, Connection] = {}  # session id -> its connection
        self._peers: dict[int, Peer] = {}  # session id -> who opened it
        self.unwatched: dict[int, Session] = {}  # sessions kept alive by heartbeats (session_ttl)
        self.refused: dict[str, int] = {}  # hellos refused, by limit
        self.not_allowed = Refusals()  # hellos refused by control.allowed_uids / allowed_gids

    def __len__(self) -> int:
        return len(self._connection_of)

    def admit(self, conn: Connection, config: Any) -> str:
        """The tenant of the peer ("": the default tenant; admission.tenant_of), or
        RequestError(NOT_ALLOWED) for a local peer `[control] allowed_uids` / `allowed_gids` do not
        admit, or one of no tenant (or two) that tenants refuse (its session, if it had one, ends:
        it is no longer allowed)."""
        creds = self.connections.credentials(conn) if self.local else None
        if creds is None:
            return tenant_of(config, None, curve_key=conn.user_id)
        why = admit(creds.uid, creds.gid, config, creds.groups)
        if why is None:
            try:
                return tenant_of(config, creds.uid, creds.gid, creds.groups)
            except RequestError as exc:
                why = str(exc)
        if conn.session is not None:
            self.end(conn.session)
        self.not_allowed.refused(creds.uid, creds.gid, creds.pid, why)
        self.refused["allowed_uids"] = self.not_allowed.count
        raise RequestError(Code.NOT_ALLOWED, why)

    def open(self, conn: Connection, hello: Hello, tenant: str = "") -> Session:
        """A session of `tenant` for this connection (replacing the one it had), or RequestError(LIMIT)."""
        if conn.session is not None:
            self.end(conn.session)
        creds = self.connections.credentials(conn) if self.local else None
        pid = creds.pid if creds is not None and creds.pid > 0 else 0
        limits = self._limits()
        if len(self) >= limits.max_clients:
            self._refuse("max_clients", f"the daemon serves limits.max_clients={limits.max_clients} "
                                        f"sessions already")
        pidfd = peer_pidfd(conn.fd, pid) if creds is not None else -1
        try:
            process, bucket = self._identify(creds, pid, pidfd)
            if bucket is not None and self._per_process[bucket] >= limits.max_clients_per_pid:
                who = f"the processes of uid {bucket[1]} outside the daemon's pid namespace (not told apart " \
                      f"on this kernel) hold" if bucket[0] == "uid" else \
                      f"process {pid or '(of another pid namespace)'} holds"
                self._refuse("max_clients_per_pid", f"{who} limits.max_clients_per_pid="
                                                    f"{limits.max_clients_per_pid} sessions already")
        except BaseException:
            if pidfd >= 0:
                os.close(pidfd)
            raise
        session = self.store.open_session(self._next_id, pid, tenant)
        self._next_id += 1
        self._connection_of[session.id] = conn
        self.connections.bind_session(conn, session)
        peer = self._peers[session.id] = Peer(creds, None, bucket, 0, False, hello.name[:NAME_SHOWN])
        if bucket is not None:
            self._per_process[bucket] += 1
        if process is not None:
            self._watch(session, peer, process, pidfd)
        if not peer.pid_ns and creds is not None:  # the kernel would not say: show the claim
            peer.pid_ns, peer.pid_ns_claimed = hello.pid_ns, bool(hello.pid_ns)
        if hello.pid != pid:
            log.debug("session %d: hello says pid %d, the kernel says %d", session.id, hello.pid, pid)
        if not session.watched:
            session.last_seen = time.monotonic()
            self.unwatched[session.id] = session
        log.debug("session %d opened by %s, %s", session.id, peer.describe(session),
                  "watched by pidfd" if session.watched else "kept by heartbeats")
        return session

    def _identify(self, creds: Credentials | None, pid: int, pidfd: int) -> tuple[Key | None, Key | None]:
        """(the key its pidfd is shared under, the key its sessions are counted under).
        None, None: a tcp client (capped by max_clients alone)."""
        if creds is None:
            return None, None
        inode = process_inode(pidfd)
        if inode:
            return ("pidfs", inode), ("pidfs", inode)
        if pid:
            return ("pid", pid), ("pid", pid)
        # pid 0 and no pidfs: nothing tells two such processes apart; its own pidfd, if any
        return (("session", self._next_id) if pidfd >= 0 else None), ("uid", creds.uid)

    def _refuse(self, limit: str, message: str) -> None:
        self.refused[limit] = self.refused.get(limit, 0) + 1
        raise RequestError(Code.LIMIT, f"too many sessions: {message}")

    def _watch(self, session: Session, peer: Peer, key: Key, pidfd: int) -> None:
        """Reclaim the session the moment its process exits (its pidfd turns readable)."""
        process = self._processes.get(key)
        if process is None:
            if pidfd < 0:
                log.debug("session %d: cannot watch %s", session.id, peer.describe(session))
                return
            process = self._processes[key] = WatchedProcess(pidfd, pid_namespace(pidfd))
            self.loop.add_reader(pidfd, self._on_process_exit, key)
        elif pidfd >= 0:
            os.close(pidfd)  # the process is watched already
        peer.process, peer.pid_ns = key, process.pid_ns
        process.sessions.add(session)
        session.watched = True

    def _on_process_exit(self, key: Key) -> None:
        process = self._processes.get(key)
        if process is None:
            return
        for session in list(process.sessions):
            log.info("client %s exited: reclaiming session %d", self._peers[session.id].describe(session),
                     session.id)
            self.end(session, reclaimed=True)

    def operator(self, session: Session) -> bool:
        """A local session of the daemon's own uid in the default tenant (`ecd status`): its Stats
        list every tenant's sessions."""
        peer = self._peers.get(session.id)
        creds = peer.creds if peer is not None else None
        return not session.tenant and creds is not None and creds.uid == os.geteuid()

    def listing(self, tenant: str | None = None) -> list[SessionInfo]:
        """Every client session (of `tenant`: None, every tenant's) for Stats, oldest first."""
        out = []
        for sid in self._connection_of:
            session, peer = self.store.session(sid), self._peers[sid]
            if tenant is not None and (session is None or session.tenant != tenant):
                continue
            creds = peer.creds
            out.append(SessionInfo(sid, peer.name, session.pid if session is not None else 0, peer.pid_ns,
                                   peer.pid_ns_claimed, creds.uid if creds is not None else -1,
                                   creds.gid if creds is not None else -1,
                                   "pidfd" if session is not None and session.watched else "heartbeat",
                                   session.tenant if session is not None else ""))
        return out

    def watch_counts(self) -> dict[str, int]:
        """Sessions by how the daemon learns they are gone: pidfd, heartbeat."""
        return {"pidfd": len(self) - len(self.unwatched), "heartbeat": len(self.unwatched)}

    def end(self, session: Session, reclaimed: bool = False, reason: str = "client_exit") -> None:
        self.unwatched.pop(session.id, None)
        conn = self._connection_of.pop(session.id, None)
        if conn is None:
            return  # ended already
        if conn.session is session:
            self.connections.bind_session(conn, None)
        peer = self._peers.pop(session.id)
        if peer.bucket is not None:
            self._per_process[peer.bucket] -= 1
            if not self._per_process[peer.bucket]:
                del self._per_process[peer.bucket]
        key = peer.process
        process = self._processes.get(key) if key is not None else None
        if key is not None and process is not None and session in process.sessions:
            process.sessions.discard(session)
            if not process.sessions:
                del self._processes[key]
                self.loop.remove_reader(process.pidfd)
                os.close(process.pidfd)
        self.store.close_session(session, reclaimed, reason)
        self._on_change()

    def on_connection_gone(self, conn: Connection, reason: str) -> None:
        """Its connection closed (or the daemon closed it): the session cannot be answered again."""
        if conn.session is not None:
            log.info("session %d (%s): connection %s, reclaiming it", conn.session.id,
                     self._peers[conn.session.id].describe(conn.session),
                     "closed" if reason == "disconnected" else f"closed ({reason})")
            self.end(conn.session, reclaimed=True, reason="connection_closed")

    def reap_silent(self, session_ttl: float) -> None:
        """Reclaim unwatched sessions silent for session_ttl. A session with a parked get, or a
        request answered later (a fetch, a persist), is waiting on the daemon, not silent: its
        clock restarts."""
        if not self.unwatched:
            return
        now = time.monotonic()
        cutoff = now - session_ttl
        for session in [s for s in self.unwatched.values() if s.last_seen < cutoff]:
            if session.waiters or session.replies_pending:
                session.last_seen = now
                continue
            log.info("session %d (%s, not watchable) silent for %gs: reclaiming it", session.id,
                     self._peers[session.id].describe(session), now - session.last_seen)
            self.end(session, reclaimed=True, reason="session_ttl")

    def close(self) -> None:
        """At shutdown: stop watching processes (the store goes with the daemon)."""
        for process in self._processes.values():
            try:
                self.loop.remove_reader(process.pidfd)
            except Exception:  # the loop may already be closed
                pass
            os.close(process.pidfd)
        self._processes.clear()
