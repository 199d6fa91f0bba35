"""The owner's side of the peer plane: the ROUTER on `[cluster] listen`, served on the daemon's
event loop, and the transfer leases it grants to pulling daemons.

A peer says `peer_hello` and gets a peer session, backed by a store Session of its own (a negative
id, never a client's): its `lookup`s take read leases through `Store.acquire`, so eviction and
replacement treat an entry leased for a transfer exactly like one a local reader holds (never
evicted; a replacement retires it until the lease goes). Each leased entry gets a one-time token
(`secrets.token_bytes(32)`) filed in the transport's GrantTable; a data connection that presents it
gets the bytes once. A lease ends, whichever comes first:
- when its bytes were sent (or the send failed): the transport reports on the loop (`on_sent`);
- when the puller releases it (`peer_release`), e.g. for keys another peer won, or says it READ
  the bytes (`peer_done`: transport "nixl", whose one-sided READs the owner never sees);
- when its TTL (`lookup.ttl_s`, at most `cluster.transfer_ttl`) passes unused;
- when the peer session ends: a new hello from the same routing id, or `cluster.peer_ttl` of
  silence (a SIGKILLed puller stops pinging). Leases whose bytes are being sent at that moment
  stay until the send ends: the transport thread is reading that extent.

What one peer can make the owner hold or do is bounded (a peer is a neighbour, not a friend):
- unread replies: a reply is a tracked zero-copy frame when large or once per CHECKPOINT_BYTES
  (as for clients), so the bytes queued to a peer's connection are known, never under-counted;
  past `cluster.peer_queue_bytes` (or PEER_SNDHWM replies) the connection is shut down (libzmq
  frees what it queued) and the session ends, its leases going back;
- requests read ahead: ZMQ_RCVHWM (set by Cluster.prepare) holds what libzmq takes from one peer
  before the owner handles it to about the same bytes;
- leases: a lookup that could take a session past `cluster.max_leases_per_peer` pending leases
  is refused whole (Code.LIMIT, with the numbers), and one naming a key twice is refused
  (Code.INVALID: the puller never does, and a key is leased once per lookup);
- the loop: a lookup leases LOOKUP_CHUNK keys per turn of the event loop, the server yields after
  every message, and a lookup's leases share one TTL timer (LeaseBatch), not one per key.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import zmq

from ...errors import Code
from ...peer_protocol import (PEER_PROTOCOL_VERSION, Leased, Lookup, Offer, PeerAcked, PeerDone, PeerError,
                             PeerHello, PeerPing, PeerPong, PeerRelease, PeerWelcome, encoder,
                             peer_request_decoder)
from ...protocol import Location
from ...transport import Grant, Transport
from ..control.connections import (CHECKPOINT_BYTES, TRACK_ALWAYS_BYTES, Connection, shut_down_socket,
                                   socket_inode)
from ..registry.entries import RequestError, Session

if TYPE_CHECKING:  # pragma: no cover
    from ..registry.store import Store
    from .cluster import Cluster

log = logging.getLogger("ecd.peers")

REAP_INTERVAL_S = 0.5
LOOKUP_CHUNK = 1024  # keys a lookup leases per turn of the event loop (~1-2 ms of work)
# Replies queued to one peer by count, besides bytes: far above what a puller has in flight (its
# requests are answered as they come), far below what would matter in memory.
PEER_SNDHWM = 1000
WARN_INTERVAL_S = 10.0  # refused lookups are logged at most this often
SRCFD, NOBLOCK, SNDMORE_NOBLOCK = int(zmq.SRCFD), int(zmq.NOBLOCK), int(zmq.SNDMORE | zmq.NOBLOCK)
ZMQ_EVENTS, POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


@dataclass(eq=False)
class LeaseBatch:
    """The leases one lookup granted: one TTL timer for them all (a TimerHandle per key cost
    ~200 bytes and a heap entry each)."""
    tokens: list[bytes]
    timer: asyncio.TimerHandle | None = None


@dataclass(eq=False)
class PeerSession:
    identity: bytes
    node: str
    store_session: Session
    last_seen: float
    conn: Connection  # the connection its hello came on: the bytes of replies queued to it
    grants: dict[bytes, Grant] = field(default_factory=dict)  # pending, by token
    sending: set[Grant] = field(default_factory=set)  # taken by a data connection
    batches: set[LeaseBatch] = field(default_factory=set)  # whose TTL has not passed
    ended: bool = False

    def leases(self) -> int:
        return len(self.grants) + len(self.sending)


class PeerServer:
    def __init__(self, cluster: "Cluster", sock: Any, transport: Transport) -> None:
        self.cluster = cluster
        self.sock = sock  # a zmq.asyncio ROUTER, bound (and made a CURVE server) by Cluster; served raw
        self.transport = transport
        self.sessions: dict[bytes, PeerSession] = {}
        self._decoder = peer_request_decoder()
        self._last_warning = -WARN_INTERVAL_S
        self._raw: zmq.Socket = zmq.Socket.shadow(sock.underlying)  # the same socket, without asyncio's futures
        self._drain_scheduled = False
        self._busy = False  # a long lookup is running: the next message waits for it
        self._stopped = False  # closed: nothing more is read (the socket closes next)
        self._fd = -1

    @property
    def store(self) -> "Store":
        return self.cluster.context.store

    async def run(self) -> None:
        """Serve the ROUTER until cancelled: its FD's reader callback (drain) handles what came.
        Not the asyncio socket's recv: its future and the task's wake-up cost each request a
        turn of the loop and ~30 us (measured on a DEALER: 101 vs 73 us a round trip)."""
        loop = self.cluster.context.loop
        self._fd = cast(int, self._raw.getsockopt(zmq.FD))
        loop.add_reader(self._fd, self.drain)
        self.drain()  # what came before
        try:
            await loop.create_future()  # until cancelled (Cluster.close)
        finally:
            self._stop_reading()

    def _stop_reading(self) -> None:
        if not self._stopped:
            self._stopped = True
            if self._fd >= 0:
                self.cluster.context.loop.remove_reader(self._fd)

    def schedule_drain(self) -> None:
        if not self._drain_scheduled:
            self._drain_scheduled = True
            self.cluster.context.loop.call_soon(self.drain)

    def drain(self) -> None:
        """One message per turn of the loop, in order: a peer that keeps the socket busy must not
        keep the loop from clients, timers and /metrics. The FD is edge-triggered: asking
        ZMQ_EVENTS (here, on the turn after every message and so after every send) re-arms it.
        A lookup of more than LOOKUP_CHUNK keys runs as a task over several turns, and the next
        message waits for it: requests are handled one at a time, as the lease bound
        (max_leases_per_peer, checked when a lookup starts) assumes."""
        self._drain_scheduled = False
        if self._busy or self._stopped or not cast(int, self._raw.getsockopt(ZMQ_EVENTS)) & POLLIN:
            return
        try:
            frames = self._raw.recv_multipart(NOBLOCK, copy=False)  # POLLIN: a whole message is there
        except zmq.Again:  # pragma: no cover - POLLIN says otherwise
            return
        identity = frames[0].bytes
        try:
            reply = self.handle(identity, frames[0].get(SRCFD), [f.buffer for f in frames[1:]])
        except Exception:  # one bad message must never stop the peer plane
            log.exception("unhandled error on a peer request")
            reply = None
        if asyncio.iscoroutine(reply):
            self._busy = True
            task = self.cluster.context.loop.create_task(reply)
            task.add_done_callback(lambda task: self._answer_later(identity, task))
            return
        if reply is not None:
            self.send(identity, encoder.encode(reply))
        self.schedule_drain()  # the next message, if any, on the loop's next turn

    def _answer_later(self, identity: bytes, task: "asyncio.Task") -> None:
        self._busy = False
        if self._stopped:
            return
        if not task.cancelled():
            if task.exception() is not None:
                log.error("unhandled error on a peer lookup: %r", task.exception())
            elif task.result() is not None:
                self.send(identity, encoder.encode(task.result()))
        self.schedule_drain()

    def send(self, identity: bytes, payload: bytes) -> None:
        """Queue one reply, never blocking; a peer with too much unread is cut off instead."""
        session = self.sessions.get(identity)
        if session is not None:
            queued, budget = session.conn.queued_bytes(), int(self.cluster.config.peer_queue_bytes)
            if queued + len(payload) > budget:
                self.cut_off(session, f"{queued} bytes of replies unread, cluster.peer_queue_bytes={budget}")
                return
        try:
            # NOBLOCK: done at once (drain's ZMQ_EVENTS afterwards re-arms the edge-triggered FD)
            self._raw.send(identity, SNDMORE_NOBLOCK)
            if session is None:  # an error to a peer without a session: small, bounded by count
                self._raw.send(payload, NOBLOCK)
                return
            # As the control plane does (connections.py): a reply is tracked (zero-copy, its tracker
            # says when libzmq is done with it, and so with every reply queued before it: a
            # connection drains in order) when large or once per CHECKPOINT_BYTES; the rest are
            # copied and count as queued until a later checkpoint drains, so queued_bytes() never
            # under-counts. A tracked frame per small reply cost the lookup's answer its time.
            conn = session.conn
            track = len(payload) >= TRACK_ALWAYS_BYTES or conn.sent_bytes + len(payload) >= conn.next_checkpoint
            tracker = None
            if track:
                tracker = self._raw.send(zmq.Frame(payload, track=True, copy=False), NOBLOCK, copy=False, track=True)
            else:
                self._raw.send(payload, NOBLOCK)
        except zmq.Again:  # ROUTER_MANDATORY: its pipe holds PEER_SNDHWM unread replies
            if session is not None:
                self.cut_off(session, f"{PEER_SNDHWM} replies unread")
            else:
                self.cluster.stats.count_failure("reply_dropped")
            return
        except zmq.ZMQError:  # EHOSTUNREACH: the peer is gone; it will time out
            self.cluster.stats.count_failure("reply_dropped")
            return
        conn.sent_bytes += len(payload)
        if tracker is not None:
            conn.checkpoints.append((tracker, conn.sent_bytes))
            conn.next_checkpoint = conn.sent_bytes + CHECKPOINT_BYTES

    def cut_off(self, session: PeerSession, detail: str) -> None:
        """Close a peer's connection (shutdown(2): libzmq frees what it queued for it) and end its
        session: a peer that does not read its replies costs the owner a bounded amount."""
        log.warning("closing the peer connection of node %r: %s", session.node, detail)
        self.cluster.stats.count_failure("serve_backlog")
        shut_down_socket(session.conn.fd, session.conn.inode)
        self.end(session, "unread replies")

    def handle(self, identity: bytes, fd: int, frames: list[Any]) -> Any:
        """The reply (None: none), or for a lookup of more than LOOKUP_CHUNK keys a coroutine
        that returns it."""
        if len(frames) != 1:
            return PeerError(0, int(Code.PROTOCOL), f"expected one frame, got {len(frames)}")
        try:
            request = self._decoder.decode(frames[0])
        except Exception as exc:  # msgspec errors, and whatever hostile bytes raise
            return PeerError(0, int(Code.PROTOCOL), f"malformed peer request: {exc}")
        if isinstance(request, PeerHello):
            return self.hello(identity, fd, request)
        session = self.sessions.get(identity)
        if session is None:
            return PeerError(request.id, int(Code.NOT_REGISTERED), "unknown peer: say peer_hello first")
        session.last_seen = time.monotonic()
        try:
            match request:
                case PeerPing(id=rid):
                    return PeerPong(rid, self.cluster.epoch)
                case Lookup():
                    if len(request.keys) > LOOKUP_CHUNK:
                        return self._lookup_in_turns(session, request)
                    return self.lookup_now(session, request)
                case PeerRelease(id=rid, tokens=tokens):
                    for token in tokens[:self.store.limits.max_batch]:
                        self.revoke(session, token)
                    return PeerAcked(rid)
                case PeerDone(id=rid, tokens=tokens):
                    for token in tokens[:self.store.limits.max_batch]:
                        grant = session.grants.get(token)
                        if grant is not None:
                            self.cluster.stats.served(session.node, grant.nbytes)
                            self.revoke(session, token)
                    return PeerAcked(rid)
        except RequestError as exc:
            return PeerError(request.id, int(exc.code), str(exc))
        return PeerError(request.id, int(Code.PROTOCOL), f"unexpected {type(request).__name__}")

    def hello(self, identity: bytes, fd: int, hello: PeerHello) -> Any:
        if hello.version != PEER_PROTOCOL_VERSION:
            return PeerError(hello.id, int(Code.VERSION), f"peer protocol version {hello.version} not "
                                                          f"supported; this daemon speaks {PEER_PROTOCOL_VERSION}")
        old = self.sessions.get(identity)
        conn = Connection(fd, socket_inode(fd))
        if old is not None:
            self.end(old, "rehello")
            if old.conn.fd == fd and old.conn.inode == conn.inode:
                conn = old.conn  # same connection: what is queued to it still counts
        if len(self.sessions) >= self.cluster.config.max_peers:
            return PeerError(hello.id, int(Code.LIMIT), f"too many peer sessions: cluster.max_peers="
                                                        f"{self.cluster.config.max_peers}")
        store_session = self.store.open_session(self.cluster.internal_session_id(), 0)
        self.sessions[identity] = PeerSession(identity, hello.node[:64], store_session, time.monotonic(), conn)
        log.info("peer %s (node %r) said hello", identity.hex()[:8], hello.node)
        host, port = self.cluster.data_address
        return PeerWelcome(hello.id, PEER_PROTOCOL_VERSION, self.cluster.node, self.cluster.epoch,
                           self.transport.name, host, port, self.transport.metadata())

    def lookup_now(self, session: PeerSession, request: Lookup) -> Leased:
        """A lookup of at most LOOKUP_CHUNK keys, leased in this turn of the loop."""
        batch = self._lookup_checks(session, request)
        try:
            offers = self._lease_chunk(session, request.ns, request.keys, batch)
        except RequestError:  # e.g. a bad key further on: nothing of this lookup stays leased
            self._revoke_all(session, batch.tokens)
            raise
        return self._leased(session, request, batch, offers)

    async def _lookup_in_turns(self, session: PeerSession, request: Lookup) -> Any:
        try:
            return await self.lookup(session, request)
        except RequestError as exc:
            return PeerError(request.id, int(exc.code), str(exc))

    async def lookup(self, session: PeerSession, request: Lookup) -> Leased | None:
        """Lease the keys the owner holds, LOOKUP_CHUNK at a time; None when the session ended
        meanwhile (its leases went back with it, and there is no one to answer)."""
        batch = self._lookup_checks(session, request)
        keys = request.keys
        offers: list[Offer | None] = []
        try:
            for start in range(0, len(keys), LOOKUP_CHUNK):
                if start:
                    await asyncio.sleep(0)  # the rest on the loop's next turn
                    if session.ended:  # end() gave back what this lookup had leased so far
                        return None
                offers += self._lease_chunk(session, request.ns, keys[start:start + LOOKUP_CHUNK], batch)
        except RequestError:  # e.g. a bad key further on: nothing of this lookup stays leased
            self._revoke_all(session, batch.tokens)
            raise
        return self._leased(session, request, batch, offers)

    def _lookup_checks(self, session: PeerSession, request: Lookup) -> LeaseBatch:
        """RequestError for a lookup refused whole; else the (empty) batch its leases go to."""
        keys, cfg = request.keys, self.cluster.config
        self.store.check_batch(len(keys))
        distinct = len(set(keys))
        if distinct != len(keys):
            raise self._refuse(session, "serve_lookup_invalid", Code.INVALID,
                               f"lookup names a key more than once ({len(keys)} keys, {distinct} distinct): "
                               "a key is leased once per lookup")
        held, bound = session.leases(), cfg.max_leases_per_peer
        if held + len(keys) > bound:
            raise self._refuse(session, "serve_lease_limit", Code.LIMIT,
                               f"this peer holds {held} transfer leases; {len(keys)} more keys could pass "
                               f"cluster.max_leases_per_peer={bound} (use or release them first)")
        return LeaseBatch([])

    def _leased(self, session: PeerSession, request: Lookup, batch: LeaseBatch, offers: list[Offer | None]) -> Leased:
        ttl = min(request.ttl_s, float(self.cluster.config.transfer_ttl))
        if batch.tokens:
            batch.timer = self.cluster.context.loop.call_later(ttl, self._expire, session, batch)
            session.batches.add(batch)
        return Leased(request.id, offers, ttl)

    def _refuse(self, session: PeerSession, reason: str, code: Code, message: str) -> RequestError:
        """Count a refused lookup and say why in the log, at most every WARN_INTERVAL_S: a flood
        of them must not flood the log too."""
        self.cluster.stats.count_failure(reason)
        now = time.monotonic()
        if now - self._last_warning >= WARN_INTERVAL_S:
            self._last_warning = now
            log.warning("refused a lookup of peer node %r: %s", session.node, message)
        return RequestError(code, message)

    def _lease_chunk(self, session: PeerSession, ns: str, keys: list[str], batch: LeaseBatch) -> list[Offer | None]:
        # not parked for keys on the disk tier: they start coming back for the peer's next lookup
        results = self.store.acquire(session.store_session, ns, keys, 0.0, _never, park_for_disk=False)
        assert results is not None  # wait 0: answered now
        segments = self.cluster.context.segments
        offers: list[Offer | None] = []
        for key, result in zip(keys, results):
            if not isinstance(result, Location):
                offers.append(None)
                continue
            token = secrets.token_bytes(32)
            grant = Grant(token, result.pool, result.offset, result.nbytes, session, result.generation)
            self.transport.grants.add(grant)
            session.grants[token] = grant
            batch.tokens.append(token)
            addr = (self.transport.address_of(segments[result.pool].buf, result.offset)
                    if result.pool < len(segments) else 0)  # host pool entries only (nixl reads DRAM)
            entry = self.store.index.get((ns, key))
            offers.append(Offer(key, result.nbytes, result.dtype, list(result.shape), result.checksum, token, addr,
                                entry.meta if entry is not None else None))
        return offers

    def _expire(self, session: PeerSession, batch: LeaseBatch) -> None:
        """A lookup's TTL passed: its leases still pending go back, a chunk per turn of the loop."""
        session.batches.discard(batch)
        if batch.tokens and not session.ended:
            self.cluster.context.loop.create_task(self._revoke_in_chunks(session, batch.tokens))

    async def _revoke_in_chunks(self, session: PeerSession, tokens: list[bytes]) -> None:
        for start in range(0, len(tokens), LOOKUP_CHUNK):
            if start:
                await asyncio.sleep(0)
            self._revoke_all(session, tokens[start:start + LOOKUP_CHUNK])

    def _revoke_all(self, session: PeerSession, tokens: list[bytes]) -> None:
        for token in tokens:
            self.revoke(session, token)

    def revoke(self, session: PeerSession, token: bytes) -> None:
        """Withdraw a token not yet taken (TTL, release, session end) and give its lease back."""
        grant = session.grants.pop(token, None)
        if grant is None:
            return
        if self.transport.grants.revoke(token) is None:
            session.sending.add(grant)  # a data connection took it first: on_sent gives it back
            return
        self.store.release(session.store_session, grant.generation)

    def on_sent(self, grants: list[Grant], sent: int, failure: str | None) -> None:
        """On the loop, from the transport: these grants' bytes are sent, or their send failed."""
        for grant in grants:
            session: PeerSession = grant.owner
            session.grants.pop(grant.token, None)
            session.sending.discard(grant)
            grant.state = "done"
            if not session.store_session.closed:
                self.store.release(session.store_session, grant.generation)
            if failure is None:
                self.cluster.stats.served(session.node, grant.nbytes)
            if session.ended and not session.sending:
                self.store.close_session(session.store_session)
        if failure is not None:
            self.cluster.stats.count_failure(f"serve_{failure}")

    def end(self, session: PeerSession, reason: str) -> None:
        """The peer said hello again, went silent, or the daemon stops: its leases go back, but
        those being sent only when their send ends."""
        if self.sessions.get(session.identity) is session:
            del self.sessions[session.identity]
        session.ended = True
        for batch in session.batches:
            if batch.timer is not None:
                batch.timer.cancel()
        session.batches.clear()
        self._revoke_all(session, list(session.grants))
        if not session.sending:
            self.store.close_session(session.store_session)
        log.info("peer session of node %r ended (%s)", session.node, reason)

    def reap(self) -> None:
        cutoff = time.monotonic() - float(self.cluster.config.peer_ttl)
        for session in [s for s in self.sessions.values() if s.last_seen < cutoff]:
            self.end(session, "peer_ttl: silent")

    def transfer_leases(self) -> int:
        return sum(s.leases() for s in self.sessions.values())

    def close(self) -> None:
        self._stop_reading()  # before Cluster closes the socket
        for session in list(self.sessions.values()):
            self.end(session, "shutdown")


def _never(_results: Any) -> None:  # pragma: no cover - acquire with wait 0 never parks
    raise AssertionError("a lookup never parks")

