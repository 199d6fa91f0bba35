"""Client sessions: opened by a Hello on one connection, ended by Bye, by the connection closing,
by the client's process exiting, or (for sessions nothing can watch) by heartbeat silence.

Who a local client is comes from the kernel, never from Hello: the connection's SO_PEERCRED pid
and a pidfd of that very process (SO_PEERPIDFD). Hello.pid is only logged. A session whose
process the kernel cannot name (a tcp peer, a process outside the daemon's pid namespace) must
heartbeat and is reclaimed after `leases.session_ttl` of silence. Sessions are capped in all
(`limits.max_clients`) and per process (`limits.max_clients_per_pid`); the excess is refused in
Welcome's place, so a client can never take the daemon's file descriptors.
"""
from __future__ import annotations

import collections
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import Code
from .connections import Connection, Connections, peer_pidfd
from .entries import RequestError, Session
from .store import Store

log = logging.getLogger("ecd.daemon")


@dataclass
class WatchedProcess:
    """One pidfd per client process, shared by all its sessions (a process may open several)."""
    pidfd: int
    sessions: set[Session] = field(default_factory=set)


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
        self._processes: dict[int, WatchedProcess] = {}  # pid -> its pidfd and sessions
        self._per_pid: collections.Counter = collections.Counter()  # verified pid -> sessions
        self._connection_of: dict[int, Connection] = {}  # session id -> its connection
        self.unwatched: dict[int, Session] = {}  # sessions kept alive by heartbeats (session_ttl)
        self.refused: dict[str, int] = {}  # hellos refused, by limit

    def __len__(self) -> int:
        return len(self._connection_of)

    def open(self, conn: Connection, claimed_pid: int) -> Session:
        """A session for this connection (replacing the one it had), or RequestError(LIMIT)."""
        if conn.session is not None:
            self.end(conn.session)
        creds = self.connections.credentials(conn) if self.local else None
        pid = creds.pid if creds is not None and creds.pid > 0 else 0
        limits = self._limits()
        if len(self) >= limits.max_clients:
            self._refuse("max_clients", f"the daemon serves limits.max_clients={limits.max_clients} "
                                        f"sessions already")
        if pid and self._per_pid[pid] >= limits.max_clients_per_pid:
            self._refuse("max_clients_per_pid", f"process {pid} holds limits.max_clients_per_pid="
                                                f"{limits.max_clients_per_pid} sessions already")
        session = self.store.open_session(self._next_id, pid)
        self._next_id += 1
        self._connection_of[session.id] = conn
        self.connections.bind_session(conn, session)
        if pid:
            self._per_pid[pid] += 1
            self._watch(session, conn)
        if claimed_pid != pid:
            log.debug("session %d: hello says pid %d, the kernel says %d", session.id, claimed_pid, pid)
        if not session.watched:
            session.last_seen = time.monotonic()
            self.unwatched[session.id] = session
        return session

    def _refuse(self, limit: str, message: str) -> None:
        self.refused[limit] = self.refused.get(limit, 0) + 1
        raise RequestError(Code.LIMIT, f"too many sessions: {message}")

    def _watch(self, session: Session, conn: Connection) -> None:
        """Reclaim the session the moment its process exits (its pidfd turns readable)."""
        process = self._processes.get(session.pid)
        if process is None:
            pidfd = peer_pidfd(conn.fd, session.pid)
            if pidfd < 0:
                log.debug("session %d: cannot watch pid %d", session.id, session.pid)
                return
            process = self._processes[session.pid] = WatchedProcess(pidfd)
            self.loop.add_reader(pidfd, self._on_process_exit, session.pid)
        process.sessions.add(session)
        session.watched = True

    def _on_process_exit(self, pid: int) -> None:
        process = self._processes.get(pid)
        if process is None:
            return
        for session in list(process.sessions):
            log.info("client pid %d exited: reclaiming session %d", pid, session.id)
            self.end(session, reclaimed=True)

    def end(self, session: Session, reclaimed: bool = False, reason: str = "client_exit") -> None:
        self.unwatched.pop(session.id, None)
        conn = self._connection_of.pop(session.id, None)
        if conn is None:
            return  # ended already
        if conn.session is session:
            self.connections.bind_session(conn, None)
        if session.pid:
            self._per_pid[session.pid] -= 1
            if not self._per_pid[session.pid]:
                del self._per_pid[session.pid]
        process = self._processes.get(session.pid)
        if process is not None and session in process.sessions:
            process.sessions.discard(session)
            if not process.sessions:
                del self._processes[session.pid]
                self.loop.remove_reader(process.pidfd)
                os.close(process.pidfd)
        self.store.close_session(session, reclaimed, reason)
        self._on_change()

    def on_connection_gone(self, conn: Connection, reason: str) -> None:
        """Its connection closed (or the daemon closed it): the session cannot be answered again."""
        if conn.session is not None:
            log.info("session %d (pid %d): connection %s, reclaiming it", conn.session.id,
                     conn.session.pid, "closed" if reason == "disconnected" else f"closed ({reason})")
            self.end(conn.session, reclaimed=True, reason="connection_closed")

    def reap_silent(self, session_ttl: float) -> None:
        """Reclaim unwatched sessions silent for session_ttl. A session with a parked get is
        waiting on the daemon, not silent: its clock restarts."""
        if not self.unwatched:
            return
        now = time.monotonic()
        cutoff = now - session_ttl
        for session in [s for s in self.unwatched.values() if s.last_seen < cutoff]:
            if session.waiters or session.fetching:
                session.last_seen = now
                continue
            log.info("session %d (pid %d, not watchable) silent for %gs: reclaiming it", session.id,
                     session.pid, now - session.last_seen)
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
