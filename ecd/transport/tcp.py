"""transport = "tcp": TCP streams straight from pool to pool, one per peer reused across
transfers (optionally TLS 1.3: `cluster.tls`, see tls.py).

Wire (length-framed): the puller opens a data connection to the owner's data port (with TLS: the
mutual handshake first) and, per transfer, sends `b"ECD2" | u32 count | count x 32-byte token`;
for each token, in order, the owner answers `u8 status | u64 nbytes` and then (status 0) exactly
nbytes of the entry, `sendall` from a memoryview of its pool mapping; the puller `recv_into`s a
memoryview of the extent it allocated. Status 1: the token is unknown, used or expired (nbytes 0).
Then the owner waits for the next request on the same connection (up to IDLE_TIMEOUT_S, then it
closes it). The connection carries no authority of its own: every transfer presents its tokens,
each admits one send, ever (GrantTable.take), so reusing a connection never lets a token be used
twice. The puller puts a connection back in its per-peer pool only after a transfer that went
through whole (every status 0, every byte read); after anything else it closes it. Before reusing
one it checks the socket (the owner closed it: readable at EOF) and, when a reused connection
fails before the owner answered a byte, retries once on a fresh one (a token the owner had
already taken then answers status 1: a clean failure, never a second send).

Why not ZeroMQ for the bytes: measured on this machine, a bare socket moves 16 MiB at ~3 GB/s and
sees a dead peer in 0.04 s, pyzmq reached half of that and hung 30 s on a SIGKILLed peer. Dead
peers: every blocking call has a timeout (no progress for `io_timeout`, and the transfer's
deadline), TCP keepalive is on, and a peer that dies shows as EOF or a reset.

Who gets served (the data port is open to anyone who can reach it; tokens are the only key): a
new connection is held by the gate (tcp_gate.py: one thread, a selector, no thread per
connection) until, within HANDSHAKE_TIMEOUT_S (1 s, or the I/O timeout if shorter) of its
accept, it has finished the TLS handshake (with `cluster.tls`) and sent its first request's head
and first token. Only a connection whose first token is live takes a served slot; one that
stalls, sends garbage or a dead token is closed (a dead token answered status 1 first), and at
most `max_handshaking` wait at once (the oldest goes for a new one). So connections that never
present a token cannot take the slots honest transfers need (issue 23: one byte per connection
used to hold a slot for the whole I/O timeout). The honest puller is unchanged: it sends its
request in one piece right after connecting, so the gate costs it no round trip. What is turned
away is counted (`refusals`, and the daemon's ecd_transfer_failures{reason="serve_<reason>"}:
serve_handshake_timeout, serve_refused, serve_protocol, serve_shed, serve_busy).

Threads: the gate (accepts too), one thread per data connection served, which lives as long as
the connection and so serves all its transfers (at most `max_conns` at once; past it an idle
connection is closed to make room, else the new one is: pullers retry through the control
plane), and an executor of `max_inflight` threads for pulls that connect, use TLS or are large; a
small pull over a pooled plain connection runs on the daemon's event loop instead (tcp_loop.py).
close() shuts every socket down and joins them, so no thread touches a pool mapping after it
returns.
"""
from __future__ import annotations

import logging
import select
import socket
import ssl
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from ..listeners import bind_tcp_listener
from ..peer_protocol import TOKEN_BYTES
from .base import Grant, GrantTable, OnSent, PullItem, Transport, TransferError
from .tcp_gate import ITEM_HEAD, MAGIC, MAX_TOKENS, REQUEST_HEAD, STATUS_BAD_TOKEN, STATUS_OK, DataGate, tune
from .tcp_loop import pull_on_loop
from .tls import TlsConfig, raw_shutdown

log = logging.getLogger("ecd.transport")

__all__ = ["ITEM_HEAD", "MAGIC", "REQUEST_HEAD", "STATUS_BAD_TOKEN", "STATUS_OK", "TcpTransport"]

CHUNK = 8 << 20  # sendall in pieces, so the timeout bounds a stall, not a whole large entry
HANDSHAKE_TIMEOUT_S = 1.0  # a new connection's TLS handshake and first request head, from accept
IDLE_TIMEOUT_S = 60.0  # the owner closes a data connection idle this long
POOL_IDLE_S = 30.0  # the puller reuses a pooled connection idle at most this long (< the owner's)


def _set_io_timeout(sock: socket.socket, seconds: float) -> None:
    """A blocking socket with kernel timeouts (SO_RCVTIMEO/SO_SNDTIMEO): Python's own socket
    timeouts poll() before every send and recv, which at GB/s costs about half the throughput.
    A TLS socket takes Python's timeout: its blocking read retries a kernel timeout forever."""
    if isinstance(sock, ssl.SSLSocket):
        sock.settimeout(max(seconds, 0.001))
        return
    sock.settimeout(None)
    whole = int(seconds)
    micros = max(int((seconds - whole) * 1e6), 0 if whole else 1000)  # 0 would mean "never"
    tv = struct.pack("ll", whole, micros)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def _recv_exact(sock: socket.socket, view: memoryview, deadline: float, io_timeout: float) -> None:
    """Fill `view` from a socket set up by _set_io_timeout; TransferError (with `progress`, the
    bytes that did come) when no byte comes for io_timeout, the deadline passes or the peer
    closes. Near the deadline the timeout is lowered, so that no single call waits past it."""
    got = 0
    try:
        while got < len(view):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferError("timeout", f"transfer deadline passed after {got} of {len(view)} bytes")
            if left < io_timeout:
                io_timeout = left
                _set_io_timeout(sock, left)
            try:
                n = sock.recv_into(view[got:])
            except (BlockingIOError, socket.timeout):  # the timeout passed with nothing received
                raise TransferError("timeout", f"no data for {io_timeout:.1f}s ({got} of {len(view)} bytes)") from None
            except InterruptedError:
                continue
            except ssl.SSLError as exc:  # TLS 1.3: the owner's verdict on our certificate comes here
                reason = "refused" if "ALERT" in str(exc).upper() else "connection"
                raise TransferError(reason, f"TLS on the data connection failed: {exc}") from None
            except OSError as exc:
                raise TransferError("connection", f"data connection failed: {exc.strerror or exc}") from None
            if n == 0:
                raise TransferError("connection", f"peer closed the data connection after {got} of "
                                                  f"{len(view)} bytes")
            got += n
    except TransferError as exc:
        exc.progress = got  # type: ignore[attr-defined]
        raise


def connection_is_stale(sock: socket.socket) -> bool:
    """A pooled connection must have nothing to read: readable means EOF, a reset, or bytes the
    owner should never have sent."""
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, host: str, port: int, max_inflight: int = 4, io_timeout: float = 5.0,
                 loop: Any = None, tls: TlsConfig | None = None, instance: str = "") -> None:
        self.grants = GrantTable()
        self.executor = ThreadPoolExecutor(max_inflight, thread_name_prefix="ecd-pull")
        self.io_timeout = io_timeout
        self.max_conns = max_inflight * 4  # served connections (threads), idle ones included
        self.max_handshaking = max(64, self.max_conns * 8)  # connections the gate holds, unauthenticated
        self.handshake_timeout = min(HANDSHAKE_TIMEOUT_S, io_timeout)
        self.max_pooled = max_inflight  # idle connections kept per peer
        self.idle_timeout = IDLE_TIMEOUT_S
        self.pool_idle = POOL_IDLE_S
        self.tls = tls
        self.loop = loop
        # Test-support hook: the check a pooled connection passes before it is reused. A test
        # replaces it (on one puller) to reuse a connection whose close has not shown yet: the
        # race between the check and the owner closing, which the retry in pull() covers.
        self.connection_is_stale: Callable[[socket.socket], bool] = connection_is_stale
        self._listener: socket.socket | None = None
        self._bind = (host, port)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._active: set[socket.socket] = set()  # every data socket open, both ways
        self._waiting: set[socket.socket] = set()  # served connections between requests
        self._pool: dict[tuple[str, int], list[tuple[socket.socket, float]]] = {}  # idle, by owner
        self._threads: set[threading.Thread] = set()
        self._gate: DataGate | None = None
        self.refusals: dict[str, int] = {}  # connections the owner turned away, by reason (tests, stats)
        self._unreported: dict[str, int] = {}  # of those, not yet passed to on_sent
        self._report_posted = False
        self._segments: Callable[[int], Any] | None = None
        self._on_sent: OnSent | None = None
        self.connections_opened = 0  # data connections this puller opened (tests, stats)

    # ---- owner side ---------------------------------------------------------------------

    def bind(self) -> tuple[str, int]:
        """Bind now (start-up errors are reported before READY); serve() starts accepting."""
        listener = bind_tcp_listener(*self._bind, 128)
        self._listener = listener
        return listener.getsockname()[:2]

    @property
    def bound_address(self) -> tuple[str, int]:
        """Where the data listener is bound (host, port) once bind() or serve() ran; ("", 0) before."""
        try:
            return self._listener.getsockname()[:2] if self._listener is not None else ("", 0)
        except OSError:  # closed
            return ("", 0)

    @property
    def serving_threads(self) -> int:
        """Threads serving data connections now (one per connection, idle ones included; at most
        max_conns): for stats and tests."""
        with self._lock:
            return len(self._threads)

    def waiting_connections(self) -> list[socket.socket]:
        """The served connections parked between requests now (their thread waits for the next
        one, up to idle_timeout): what the cap closes first to make room. For tests."""
        with self._lock:
            return list(self._waiting)

    def serve(self, segments: Callable[[int], Any], on_sent: OnSent) -> tuple[str, int]:
        if self._listener is None:
            self.bind()
        assert self._listener is not None
        self._segments, self._on_sent = segments, on_sent
        self._gate = DataGate(self._listener, self.grants, self.tls, self.handshake_timeout, self.max_handshaking,
                              self._admit, self._refused, self._stop)
        address = self._listener.getsockname()[:2]
        self._gate.start()
        return address

    def _admit(self, conn: socket.socket, first: bytes) -> bool:
        """From the gate: a new connection whose first request's first token is live. It gets a
        served slot (a thread), making room by closing an idle served connection at the cap;
        False when every served connection is mid-transfer (the gate closes it: the puller sees
        EOF at once and retries through the control plane)."""
        with self._lock:
            if self._stop.is_set():
                return False
            if len(self._threads) >= self.max_conns:
                if not self._waiting:
                    return False
                raw_shutdown(self._waiting.pop())  # an idle one goes (its thread exits)
            self._active.add(conn)
            thread = threading.Thread(target=self._serve_conn, args=(conn, first), name="ecd-data-send",
                                      daemon=True)
            self._threads.add(thread)
        try:
            thread.start()
        except RuntimeError:  # no thread to be had: the gate closes the connection
            with self._lock:
                self._threads.discard(thread)
                self._active.discard(conn)
            return False
        return True

    def _refused(self, reason: str) -> None:
        """From the gate: a connection turned away before any token was taken. Counted here and,
        through on_sent with no grants, in the daemon's transfer failures as serve_<reason>. One
        wake-up of the loop at a time carries all counted since: a flood of connections must not
        become a flood of callbacks on the loop that serves every client."""
        with self._lock:
            self.refusals[reason] = self.refusals.get(reason, 0) + 1
            self._unreported[reason] = self._unreported.get(reason, 0) + 1
            if self._report_posted or self._on_sent is None or self.loop is None:
                return
            self._report_posted = True
        try:
            self.loop.call_soon_threadsafe(self._report_refusals)
        except RuntimeError:  # the loop is closed: the daemon is gone
            pass

    def _report_refusals(self) -> None:
        """On the loop: what the gate turned away since the last report."""
        with self._lock:
            counts, self._unreported, self._report_posted = self._unreported, {}, False
        assert self._on_sent is not None
        for reason, n in counts.items():
            for _ in range(n):
                self._on_sent([], 0, reason)

    def _serve_conn(self, conn: socket.socket, first: bytes) -> None:
        """One data connection, all its transfers, until the puller closes it or it idles out.
        `first`: its first request's head and first token, which the gate read."""
        try:
            _set_io_timeout(conn, self.io_timeout)
            head = bytearray(first[:REQUEST_HEAD.size])
            if not self._serve_request(conn, head, first[REQUEST_HEAD.size:]):
                return
            while not self._stop.is_set():
                with self._lock:
                    self._waiting.add(conn)
                _set_io_timeout(conn, self.idle_timeout)
                try:
                    n = conn.recv_into(head, 1)  # the next request's first byte, or EOF/idle: done
                except OSError:
                    return
                finally:
                    with self._lock:
                        self._waiting.discard(conn)
                if n == 0:
                    return
                _set_io_timeout(conn, self.io_timeout)
                if not self._serve_request(conn, head):
                    return
        except OSError as exc:
            log.debug("data connection failed: %s", exc)
        finally:
            with self._lock:
                self._active.discard(conn)
                self._waiting.discard(conn)
                self._threads.discard(threading.current_thread())
            conn.close()

    def _serve_request(self, conn: socket.socket, head: bytearray, first_token: bytes = b"") -> bool:
        """One transfer; True when the connection may serve another. `head`: its first byte read
        (on a reused connection), or the whole head with `first_token` (from the gate)."""
        taken: list[Grant] = []
        sent, failure = 0, None
        try:
            deadline = time.monotonic() + self.io_timeout
            if not first_token:
                _recv_exact(conn, memoryview(head)[1:], deadline, self.io_timeout)
            magic, count = REQUEST_HEAD.unpack(head)
            if magic != MAGIC or not 0 < count <= MAX_TOKENS:
                raise TransferError("protocol", "not an ecd data request")
            tokens = bytearray(count * TOKEN_BYTES)
            tokens[:len(first_token)] = first_token
            _recv_exact(conn, memoryview(tokens)[len(first_token):], deadline, self.io_timeout)
            grants = [self.grants.take(bytes(tokens[i:i + TOKEN_BYTES]))
                      for i in range(0, len(tokens), TOKEN_BYTES)]
            taken = [g for g in grants if g is not None]
            for grant in grants:
                if grant is None:
                    conn.sendall(ITEM_HEAD.pack(STATUS_BAD_TOKEN, 0))
                    continue
                # MSG_MORE: the head leaves with the entry's first bytes, one segment, so the puller
                # wakes once for both, not once for 9 bytes and again for the data (TLS: flags refused)
                more = socket.MSG_MORE if grant.nbytes and not isinstance(conn, ssl.SSLSocket) else 0
                conn.sendall(ITEM_HEAD.pack(STATUS_OK, grant.nbytes), more)
                assert self._segments is not None
                with memoryview(self._segments(grant.pool)) as seg:
                    with seg[grant.offset:grant.offset + grant.nbytes] as src:
                        for start in range(0, grant.nbytes, CHUNK):
                            conn.sendall(src[start:start + CHUNK])  # timeout: per chunk, not per entry
                sent += grant.nbytes
        except TransferError as exc:
            failure = exc.reason
            log.debug("data connection: %s", exc)
        except (socket.timeout, BlockingIOError):  # the puller stopped reading
            failure = "timeout"
        except OSError as exc:
            failure = "connection"
            log.debug("data connection failed: %s", exc)
        finally:
            if taken and self._on_sent is not None:
                self._report(taken, sent, failure)
        return failure is None

    def _report(self, taken: list[Grant], sent: int, failure: str | None) -> None:
        # The bytes are in the kernel's hands (or the send failed): the loop gives the leases back.
        try:
            self.loop.call_soon_threadsafe(self._on_sent, taken, sent, failure)
        except RuntimeError:  # the loop is closed: the daemon is gone, and its leases with it
            pass

    # ---- puller side --------------------------------------------------------------------

    def pull(self, host: str, port: int, items: list[PullItem], deadline: float) -> int:
        for attempt in range(2):
            if self._stop.is_set():
                raise TransferError("shutdown", "the daemon is shutting down")
            sock, reused = self._checkout((host, port), deadline)
            try:
                received = self._exchange(sock, host, port, items, deadline, reused)
            except TransferError as exc:
                self._drop(sock)
                if reused and attempt == 0 and exc.reason == "connection" and not getattr(exc, "progress", 0):
                    log.debug("pooled data connection to %s:%d was gone (%s): a fresh one", host, port, exc)
                    continue  # the owner closed it before answering: nothing of this transfer happened
                raise
            except BaseException:
                self._drop(sock)
                raise
            self._checkin((host, port), sock)
            return received
        raise AssertionError("unreachable")  # pragma: no cover

    async def pull_on_loop(self, host: str, port: int, items: list[PullItem], deadline: float) -> int | None:
        """On the event loop, over a pooled plain connection (tcp_loop.py); None: use pull()."""
        return await pull_on_loop(self, host, port, items, deadline)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def _checkout(self, where: tuple[str, int], deadline: float) -> tuple[socket.socket, bool]:
        """An idle pooled connection to `where` that is still open, else a new one."""
        sock = self.checkout_pooled(where)
        if sock is not None:
            return sock, True
        return self._connect(*where, deadline), False

    def checkout_pooled(self, where: tuple[str, int]) -> socket.socket | None:
        """An idle pooled connection to `where` that is still open, or None."""
        now = time.monotonic()
        while True:
            with self._lock:
                idle = self._pool.get(where)
                if not idle:
                    return None
                sock, since = idle.pop()
            if now - since < self.pool_idle and not self.connection_is_stale(sock):
                return sock
            self._drop(sock)

    def checkin(self, where: tuple[str, int], sock: socket.socket) -> None:
        """Back to the pool after a transfer that went through whole (else drop it)."""
        self._checkin(where, sock)

    def drop(self, sock: socket.socket) -> None:
        self._drop(sock)

    def _checkin(self, where: tuple[str, int], sock: socket.socket) -> None:
        with self._lock:
            idle = self._pool.setdefault(where, [])
            if not self._stop.is_set() and len(idle) < self.max_pooled:
                idle.append((sock, time.monotonic()))
                return
        self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        with self._lock:
            self._active.discard(sock)
        sock.close()

    def _connect(self, host: str, port: int, deadline: float) -> socket.socket:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferError("timeout", "the fetch's deadline passed before its transfer started")
        wait = min(self.io_timeout, left)
        try:
            sock = socket.create_connection((host, port), timeout=wait)
        except socket.timeout:
            raise TransferError("timeout", f"cannot connect to {host}:{port} within {wait:.1f}s") from None
        except OSError as exc:
            raise TransferError("connection", f"cannot connect to {host}:{port}: {exc.strerror or exc}") from None
        try:
            tune(sock)
            if self.tls is not None:
                sock.settimeout(wait)
                try:
                    sock = self.tls.client.wrap_socket(sock)
                    self.tls.check_peer(sock)  # type: ignore[arg-type]
                except (ssl.SSLError, ssl.CertificateError) as exc:
                    sock.close()
                    raise TransferError("refused", f"TLS handshake with {host}:{port} failed: {exc}") from None
                except socket.timeout:
                    sock.close()
                    raise TransferError("timeout", f"TLS handshake with {host}:{port} timed out") from None
        except OSError as exc:
            sock.close()
            raise TransferError("connection", f"data connection to {host}:{port} failed: {exc}") from None
        with self._lock:
            self._active.add(sock)
            self.connections_opened += 1
        return sock

    def _exchange(self, sock: socket.socket, host: str, port: int, items: list[PullItem], deadline: float,
                  reused: bool) -> int:
        """One transfer on `sock`: the request, then every item into its extent."""
        received = 0
        _set_io_timeout(sock, min(self.io_timeout, max(0.001, deadline - time.monotonic())))
        try:
            sock.sendall(REQUEST_HEAD.pack(MAGIC, len(items)) + b"".join(i.token for i in items))
        except ssl.SSLError as exc:  # on a fresh TLS connection: the owner refused our certificate
            raise TransferError("connection" if reused else "refused",
                                f"data request to {host}:{port} failed (TLS): {exc}") from None
        except OSError as exc:
            raise TransferError("connection", f"data request to {host}:{port} failed: {exc}") from None
        head = bytearray(ITEM_HEAD.size)
        answered = 0  # bytes of the owner's answer read so far
        try:
            for item in items:
                _recv_exact(sock, memoryview(head), deadline, self.io_timeout)
                answered += ITEM_HEAD.size
                status, nbytes = ITEM_HEAD.unpack(head)
                if status == STATUS_BAD_TOKEN:
                    raise TransferError("refused", "the owner did not accept the token (expired or used)")
                if status != STATUS_OK or nbytes != item.nbytes:
                    raise TransferError("protocol", f"owner announced {nbytes} bytes (status {status}), "
                                                    f"expected {item.nbytes}")
                with memoryview(item.buf) as seg:
                    with seg[item.offset:item.offset + item.nbytes] as dest:
                        _recv_exact(sock, dest, deadline, self.io_timeout)
                answered += nbytes
                received += nbytes
        except TransferError as exc:
            exc.progress = answered + getattr(exc, "progress", 0)  # type: ignore[attr-defined]
            raise
        return received

    # ---- shutdown -----------------------------------------------------------------------

    def close(self) -> None:
        self._stop.set()
        if self._gate is not None:
            self._gate.close()  # no new connection is admitted after this
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            for sock in self._active:
                raw_shutdown(sock)  # wakes a thread blocked in send/recv
            pooled = [sock for idle in self._pool.values() for sock, _ in idle]
            self._pool.clear()
            threads = list(self._threads)
        for sock in pooled:
            self._drop(sock)
        for thread in threads:
            thread.join(5.0)
        self.executor.shutdown(wait=True, cancel_futures=True)
