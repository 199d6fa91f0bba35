"""The control socket's serving loop: drain the ROUTER, decode each request, check who sent it,
hand it to its handler (handlers.py) and queue the reply; typed errors for everything malformed.

libzmq's FD is edge-triggered, so every wake-up drains the socket until EAGAIN, and any send made
outside that drain (timers, client exits, parked gets completing) schedules another drain.
Replies are sent with NOBLOCK through Connections.send: a client that stopped reading loses its
replies (and past its budget its connection), the daemon never waits for it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, cast

import msgspec
import zmq

from ...errors import Code
from ...protocol import (Alloc, Bye, Error, Exists, Fetch, Hello, LeaseSpace, Ping, Publish, PutInline, Release, Report, Unpin, encoder,
                        request_decoder)
from .connections import Connection, Connections
from ..registry.entries import RequestError
from .handlers import Handlers
from ..ops.metrics import ServeCounters

if TYPE_CHECKING:  # pragma: no cover
    from .context import HandlerContext

log = logging.getLogger("ecd.daemon")

# Requests a client may send with id 0 and no reply wanted: a read lease given back, a heartbeat,
# and the pins a vLLM scheduler takes and drops off its critical path (Client.send_pin/send_unpin;
# an Exists with id 0 means something only with a pin).
_FIRE_AND_FORGET = (Release, Ping, Exists, Unpin)


def _fire_and_forget(request: Any) -> bool:
    if isinstance(request, Exists):
        return request.pin_s > 0
    return isinstance(request, _FIRE_AND_FORGET)


DRAIN_BATCH = 512  # messages handled per wake-up before yielding to timers
SETTLE_AFTER_S = 0.02  # a connection closed this recently may still have messages on their way in
# zmq's constants are enums: `&` on them runs Python enum code, a microsecond a message here
ZMQ_EVENTS, POLLIN, SRCFD, NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.SRCFD), int(zmq.NOBLOCK)


class ControlLoop:
    """The ROUTER `sock`'s loop on the daemon's event `loop`; `connections` knows who is on the
    other end of each message, `daemon_state` says the daemon's (starting, serving, draining), the
    handlers get `context`, what they read of the daemon."""

    def __init__(self, context: "HandlerContext", loop: asyncio.AbstractEventLoop, sock: zmq.Socket,
                 connections: Connections, daemon_state: Callable[[], str], counters: ServeCounters) -> None:
        self.loop = loop
        self._settle_scheduled = False
        self.sock: zmq.Socket | None = sock  # None once the daemon closed it: nothing left to drain
        self.connections = connections
        self.daemon_state = daemon_state
        self.store = context.store
        self.sessions = context.sessions
        self.counters = counters
        self.handlers = Handlers(context, counters, self.send, self.reply_error, self.count_error, self.count_drop)
        self._decoder = request_decoder()
        self._drain_scheduled = False
        self._draining = False
        self._curve = bool(sock.getsockopt(zmq.CURVE_SERVER))  # its clients are known by their public keys

    def stop(self) -> None:
        """The daemon is closing the socket: a drain still scheduled (a reply sent at shutdown
        schedules one) finds nothing to do."""
        self.sock = None

    def schedule_drain(self) -> None:
        if not self._drain_scheduled:
            self._drain_scheduled = True
            self.loop.call_soon(self.drain)

    def _settle_later(self) -> None:
        self._settle_scheduled = False
        self.schedule_drain()

    def drain(self) -> None:
        self._drain_scheduled = False
        sock = self.sock
        if sock is None:
            return
        self._draining = True
        connections = self.connections
        # ZMQ_EVENTS is an int option (pyzmq's stubs say int | bytes for every option)
        monitor_events = cast("Callable[[int], int]", connections.monitor.getsockopt)
        events = cast("Callable[[int], int]", sock.getsockopt)
        try:
            for _ in range(DRAIN_BATCH):
                # Connection events first, before every message: a connection's end must be known
                # before a message of one that reuses its fd or routing id is handled.
                if monitor_events(ZMQ_EVENTS) & POLLIN:
                    connections.handle_events()
                # Asking ZMQ_EVENTS (not receiving until zmq.Again, which costs an exception) is
                # also what re-arms the edge-triggered FD after the sends made while handling.
                if not events(ZMQ_EVENTS) & POLLIN:
                    if connections.closing:  # every message they sent has been handled ...
                        # ... unless the I/O thread is still passing a just-closed one's last
                        # messages on (a Bye; seen under load): only those closed a moment ago
                        connections.settle(older_than=SETTLE_AFTER_S)
                        if connections.closing and not self._settle_scheduled:
                            self._settle_scheduled = True
                            self.loop.call_later(SETTLE_AFTER_S, self._settle_later)
                    return
                conn, frames = self._recv_request(sock)
                try:
                    self.handle(conn, frames)
                except Exception:  # never let one message stop the drain (and stall the socket)
                    log.exception("unhandled error on a request")
                    self.count_error("unhandled")
            self.schedule_drain()  # more may be queued: let timers run first
        finally:
            self._draining = False

    def _recv_request(self, sock: zmq.Socket) -> tuple[Connection, list[bytes]]:
        """(the connection it came on, [identity, payload, *extra]); like recv_multipart but with
        no getsockopt(RCVMORE) at all (the daemon's per-request CPU is what bounds ops/s)."""
        # A ROUTER message always carries the identity and at least one (maybe empty) frame, and
        # multipart messages arrive whole, so the second recv cannot block or fail. Frames (not
        # bytes) because a Frame knows the fd it came on and whether more follow: `.more` is read
        # in C by recv itself, where getsockopt(RCVMORE) costs a Python enum lookup (~0.3 us).
        identity = sock.recv(NOBLOCK, copy=False)
        frame = sock.recv(NOBLOCK, copy=False)
        frames = [identity.bytes, frame.bytes]
        while frame.more:
            frame = sock.recv(NOBLOCK, copy=False)
            frames.append(frame.bytes)
        conn = self.connections.of(frames[0], identity.get(SRCFD))
        if self._curve and not conn.user_id:  # the key the ZAP handler vetted ([tenants.NAME] curve_keys)
            conn.user_id = str(identity.get("User-Id") or "")
        return conn, frames

    def send(self, identity: bytes, reply: Any) -> None:
        failure = self.connections.send(identity, encoder.encode(reply))
        if failure is not None:  # peer gone or not reading; never block on it
            self.count_error("send_dropped")
            self.count_drop(failure)
        if not self._draining:  # a send from a timer or a client exit: re-check the edge
            self.schedule_drain()

    def count_error(self, what: str) -> None:
        self.counters.errors[what] = self.counters.errors.get(what, 0) + 1

    def count_drop(self, reason: str) -> None:
        self.counters.dropped[reason] = self.counters.dropped.get(reason, 0) + 1

    def _refuse(self, identity: bytes, request: Any, code: Code, message: str) -> str:
        """Error for a decoded request; one with id 0 (fire-and-forget) is never answered: an
        Error(0) would be taken by that client as the reply to whatever it asks next. A Report is
        fire-and-forget whatever its id."""
        if request.id == 0 or isinstance(request, Report):
            outcome = code.name.lower()
            self.count_error(outcome)
            self.count_drop("refused")
            return outcome
        return self.reply_error(identity, request.id, code, message)

    def reply_error(self, identity: bytes, request_id: int, code: Code, message: str) -> str:
        """Send a typed error; returns the outcome label metrics record for the request."""
        outcome = code.name.lower()
        self.count_error(outcome)
        self.send(identity, Error(request_id, int(code), message))
        return outcome

    def handle(self, conn: Connection, frames: list[bytes]) -> None:
        started = time.perf_counter()
        op, outcome = "malformed", "internal"
        try:
            op, outcome = self._handle_request(conn, frames)
        finally:
            self.store.slot_holds.plan_over()  # an eviction it planned has appended its events
            self.counters.requests.observe(op, outcome, time.perf_counter() - started)

    def _handle_request(self, conn: Connection, frames: list[bytes]) -> tuple[str, str]:
        """Decode, check, dispatch and answer one request; returns (op, outcome) for metrics."""
        identity = frames[0]
        if len(frames) != 2:
            return "malformed", self.reply_error(identity, 0, Code.PROTOCOL,
                                                  f"expected one frame per request, got {len(frames) - 1}")
        payload = frames[1]
        try:
            request = self._decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return "malformed", self.reply_error(identity, salvage_request_id(payload), Code.PROTOCOL,
                                                  f"malformed request: {exc}")
        except Exception as exc:  # e.g. RecursionError, UnicodeDecodeError from hostile bytes
            return "malformed", self.reply_error(identity, 0, Code.PROTOCOL,
                                                  f"malformed request: {type(exc).__name__}: {exc}")
        op = request.__struct_config__.tag
        session = conn.session
        try:
            if isinstance(request, Hello):
                return op, self.handlers.hello(identity, conn, request)
            if isinstance(request, Bye):
                if session is not None:
                    self.sessions.end(session)
                else:
                    self.count_drop("refused")
                return op, "ok"
            if session is None:
                return op, self._refuse(identity, request, Code.NOT_REGISTERED,
                                        "unknown client: say Hello first (the daemon may have restarted)")
            if not session.watched:
                session.last_seen = time.monotonic()
            if self.daemon_state() == "draining" and isinstance(request, (Alloc, PutInline, Publish, Fetch, LeaseSpace)):
                return op, self._refuse(identity, request, Code.SHUTTING_DOWN,
                                        "daemon is shutting down: no new writes")
            refused = self.store.quota_refused
            reply = self.handlers.dispatch(identity, session, request)
            if reply is not None:
                if request.id != 0:
                    self.send(identity, reply)
                elif not _fire_and_forget(request):
                    self.count_drop("unanswerable")  # a request that wants a reply, sent with id 0
            # an item refused for its namespace's quota labels the whole request (metrics)
            return op, "ok" if self.store.quota_refused == refused else "quota_exceeded"
        except RequestError as exc:
            return op, self._refuse(identity, request, exc.code, str(exc))
        except Exception as exc:  # a bug must cost one request, never the daemon
            log.exception("internal error handling %s", op)
            return op, self._refuse(identity, request, Code.INTERNAL, f"internal error: {exc!r}")


def salvage_request_id(frame: bytes) -> int:
    """Best-effort id of a request that failed to decode, so its Error reply can be matched."""
    try:
        raw = msgspec.msgpack.decode(frame)
    except Exception:  # DecodeError, UnicodeDecodeError, RecursionError, ...: no id to salvage
        return 0
    if isinstance(raw, list) and len(raw) > 1 and type(raw[1]) is int and 0 <= raw[1] < 2**63:
        return raw[1]
    return 0
