"""The front door of transport "tcp"'s data port: one thread that accepts data connections and
holds each one, unauthenticated, until its first request shows a live token.

Why: anyone who can reach the data port can connect, and before a token is checked a connection
proves nothing. A connection that took a served slot (a thread, one of `max_conns`) on accept
could hold it for the whole I/O timeout with one byte, and 24-40 of them from one process failed
every honest fetch (issue 23). So a new connection costs only a descriptor and a few bytes here:
the gate waits on all of them at once with a selector (no thread per connection, so threads
cannot be exhausted either), and within `timeout` of its accept a connection must finish the TLS
handshake (when `cluster.tls`) and send its first request's head and first token. Then:

- the head is not an ecd data request: closed ("protocol");
- the first token is not a live grant: answered status 1 ("refused", as a served connection
  would) and closed. The puller stops reading at the first refused token, so a request whose
  first token is dead can carry no transfer anyone reads: deciding on it keeps what the gate
  buffers per connection at 40 bytes;
- the first token is live: handed to the transport (`admit`), which serves it on a thread of its
  own (taking the tokens there) or, when every served connection is busy, declines ("busy").

At most `max_pending` connections wait here; a new one past that closes the oldest ("shed"),
and one whose deadline passes is closed ("handshake_timeout"). Each is reported through `count`.
Nothing about an honest pull changes: its request goes out in one send right after connect (and
the TLS handshake), so the gate reads it at once, with no extra round trip; a pooled connection,
once served, never comes back through here.
"""
from __future__ import annotations

import errno
import logging
import selectors
import socket
import ssl
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..peer_protocol import TOKEN_BYTES
from .base import GrantTable
from .tls import TlsConfig

log = logging.getLogger("ecd.transport")

# The wire (see tcp.py): a request, then per token an answer head (and its bytes)
MAGIC = b"ECD2"
REQUEST_HEAD = struct.Struct("!4sI")  # magic, token count
ITEM_HEAD = struct.Struct("!BQ")  # status, nbytes
STATUS_OK, STATUS_BAD_TOKEN = 0, 1
MAX_TOKENS = 16384  # limits.max_batch's default: a request head the owner reads is bounded
FIRST_BYTES = REQUEST_HEAD.size + TOKEN_BYTES  # what the gate reads: the head and the first token
ACCEPTS_PER_WAKE = 64  # then the waiting connections get a turn
TICK_S = 0.25  # the longest the gate sleeps: deadlines are checked at least this often
WARN_EVERY_S = 10.0  # a refused TLS handshake is logged at most this often (a flood is counted)


@dataclass(eq=False)
class _Pending:
    sock: socket.socket  # an SSLSocket (handshake not done yet) with TLS
    deadline: float
    first: bytearray = field(default_factory=lambda: bytearray(FIRST_BYTES))
    got: int = 0
    handshaken: bool = False
    events: int = selectors.EVENT_READ


class DataGate:
    """The gate's thread and the connections it holds (see the module's docstring)."""

    def __init__(self, listener: socket.socket, grants: GrantTable, tls: TlsConfig | None, timeout: float,
                 max_pending: int, admit: Callable[[socket.socket, bytes], bool],
                 count: Callable[[str], None], stop: threading.Event) -> None:
        self.listener = listener
        self.grants = grants
        self.tls = tls
        self.timeout = timeout
        self.max_pending = max_pending
        self.admit = admit  # (connection, its first FIRST_BYTES) -> whether the transport took it
        self.count = count  # (reason) -> None: what was turned away
        self.stop = stop
        self._pending: dict[_Pending, None] = {}  # oldest first: deadlines are in this order too
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._run, name="ecd-data-gate", daemon=True)
        self._warned_at = 0.0
        self._unwarned = 0

    def start(self) -> None:
        self.listener.setblocking(False)
        self._wake_r.setblocking(False)
        self._selector.register(self.listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread.start()

    def close(self) -> None:
        """After `stop` is set: the thread leaves, closing every connection still waiting here."""
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread.is_alive():
            self._thread.join(5.0)
        self._wake_w.close()

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                wait = TICK_S
                if self._pending:
                    wait = min(wait, max(0.0, next(iter(self._pending)).deadline - time.monotonic()))
                for key, _ in self._selector.select(wait):
                    if key.fileobj is self.listener:
                        self._accept()
                    elif key.data in self._pending:  # (not one shed earlier in this batch)
                        try:
                            self._advance(key.data)
                        except Exception:  # noqa: BLE001 - a bug costs this connection, not the port
                            log.exception("data connection dropped: the gate failed on it")
                            self._drop(key.data, None)
                now = time.monotonic()
                while self._pending and next(iter(self._pending)).deadline <= now:
                    self._drop(next(iter(self._pending)), "handshake_timeout")
        except Exception:  # noqa: BLE001 - logged; the listener is closed below, so pullers fail fast
            log.exception("the data port's gate failed; no new data connections are served")
        finally:
            for pending in list(self._pending):
                self._drop(pending, None)
            self._selector.close()
            self._wake_r.close()
            self.listener.close()  # after a failure too: pullers see a refused connect, not a hang

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_WAKE):
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("data port: cannot accept (%s); shedding the oldest waiting connection", exc)
                    if self._pending:
                        self._drop(next(iter(self._pending)), "shed")
                    else:
                        time.sleep(0.05)  # the listener stays readable: do not spin on it
                return  # ECONNABORTED and the like: the next wake tries again
            if len(self._pending) >= self.max_pending:
                self._drop(next(iter(self._pending)), "shed")
            sock = conn
            try:
                tune(conn)
                conn.setblocking(False)
                if self.tls is not None:
                    sock = self.tls.server.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
                pending = _Pending(sock, time.monotonic() + self.timeout, handshaken=self.tls is None)
                self._selector.register(sock, selectors.EVENT_READ, pending)
            except (OSError, ValueError) as exc:
                log.debug("data connection dropped on accept: %s", exc)
                sock.close()
                conn.close()  # detached by wrap_socket (a no-op then), else the same socket
                continue
            self._pending[pending] = None

    def _advance(self, pending: _Pending) -> None:
        """Read what has come: on to the TLS handshake's next step, the head, the first token."""
        sock = pending.sock
        try:
            if not pending.handshaken:
                sock.do_handshake()  # type: ignore[attr-defined]
                assert self.tls is not None
                self.tls.check_peer(sock)  # type: ignore[arg-type]
                pending.handshaken = True
            while pending.got < FIRST_BYTES:  # with TLS, bytes may wait decrypted: read until none
                n = sock.recv_into(memoryview(pending.first)[pending.got:])
                if n == 0:
                    self._drop(pending, None)  # the peer went away before asking for anything
                    return
                pending.got += n
                if pending.got >= REQUEST_HEAD.size and not _is_request(pending.first):
                    self._drop(pending, "protocol")
                    return
        except ssl.SSLWantWriteError:
            self._want(pending, selectors.EVENT_WRITE)
            return
        except (ssl.SSLWantReadError, BlockingIOError, InterruptedError):
            self._want(pending, selectors.EVENT_READ)
            return
        except ssl.SSLError as exc:  # not a certificate we pin, or not TLS at all
            self._warn_tls(exc)
            self._drop(pending, "refused")
            return
        except OSError as exc:  # reset by the peer
            log.debug("data connection failed before its request: %s", exc)
            self._drop(pending, None)
            return
        self._decide(pending)

    def _decide(self, pending: _Pending) -> None:
        token = bytes(pending.first[REQUEST_HEAD.size:])
        if token not in self.grants:
            try:  # status 1, nbytes 0: what a served connection answers for a dead token
                pending.sock.send(ITEM_HEAD.pack(STATUS_BAD_TOKEN, 0))
            except OSError:
                pass
            self._drop(pending, "refused")
            return
        del self._pending[pending]
        self._selector.unregister(pending.sock)
        if not self.admit(pending.sock, bytes(pending.first)):
            pending.sock.close()
            if not self.stop.is_set():
                self.count("busy")  # every served connection is mid-transfer: the puller retries

    def _want(self, pending: _Pending, events: int) -> None:
        if pending.events != events:
            pending.events = events
            self._selector.modify(pending.sock, events, pending)

    def _drop(self, pending: _Pending, reason: str | None) -> None:
        self._pending.pop(pending, None)
        try:
            self._selector.unregister(pending.sock)
        except (KeyError, ValueError):
            pass
        pending.sock.close()
        if reason is not None:
            self.count(reason)

    def _warn_tls(self, exc: Exception) -> None:
        now = time.monotonic()
        if now - self._warned_at < WARN_EVERY_S:
            self._unwarned += 1
            return
        more = f" (and {self._unwarned} more since the last warning)" if self._unwarned else ""
        log.warning("data connection refused: %s%s", exc, more)
        self._warned_at, self._unwarned = now, 0


def _is_request(first: bytearray) -> bool:
    magic, count = REQUEST_HEAD.unpack_from(first)
    return magic == MAGIC and 0 < count <= MAX_TOKENS


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # request and heads go out at once
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    # keepalive probes after 5 s idle, every 2 s, 3 tries: a vanished host is seen in ~11 s
    for opt, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
