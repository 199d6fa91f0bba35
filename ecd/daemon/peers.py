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
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq

from ..errors import Code
from ..peer_protocol import (PEER_PROTOCOL_VERSION, Leased, Lookup, Offer, PeerAcked, PeerDone, PeerError,
                             PeerHello, PeerPing, PeerPong, PeerRelease, PeerWelcome, encoder,
                             peer_request_decoder)
from ..protocol import Location
from ..transport import Grant, Transport
from .entries import RequestError, Session

if TYPE_CHECKING:  # pragma: no cover
    from .cluster import Cluster

log = logging.getLogger("ecd.peers")

REAP_INTERVAL_S = 0.5


@dataclass(eq=False)
class PeerSession:
    identity: bytes
    node: str
    store_session: Session
    last_seen: float
    grants: dict[bytes, tuple[Grant, asyncio.TimerHandle]] = field(default_factory=dict)  # pending
    sending: set[Grant] = field(default_factory=set)  # taken by a data connection
    ended: bool = False


class PeerServer:
    def __init__(self, cluster: "Cluster", sock: Any, transport: Transport) -> None:
        self.cluster = cluster
        self.sock = sock  # a zmq.asyncio ROUTER, bound (and made a CURVE server) by Cluster
        self.transport = transport
        self.sessions: dict[bytes, PeerSession] = {}
        self._decoder = peer_request_decoder()

    @property
    def store(self):
        return self.cluster.d.store

    async def run(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            try:
                reply = self.handle(frames)
            except Exception:  # one bad message must never stop the peer plane
                log.exception("unhandled error on a peer request")
                continue
            if reply is not None:
                try:
                    self.sock.send_multipart([frames[0], encoder.encode(reply)], zmq.NOBLOCK)
                except zmq.ZMQError:  # the peer is gone or not reading: it will time out
                    self.cluster.stats.count_failure("reply_dropped")

    def handle(self, frames: list[bytes]) -> Any:
        identity = frames[0]
        if len(frames) != 2:
            return PeerError(0, int(Code.PROTOCOL), f"expected one frame, got {len(frames) - 1}")
        try:
            request = self._decoder.decode(frames[1])
        except Exception as exc:  # msgspec errors, and whatever hostile bytes raise
            return PeerError(0, int(Code.PROTOCOL), f"malformed peer request: {exc}")
        if isinstance(request, PeerHello):
            return self.hello(identity, request)
        session = self.sessions.get(identity)
        if session is None:
            return PeerError(request.id, int(Code.NOT_REGISTERED), "unknown peer: say peer_hello first")
        session.last_seen = time.monotonic()
        try:
            match request:
                case PeerPing(id=rid):
                    return PeerPong(rid, self.cluster.d.epoch)
                case Lookup():
                    return self.lookup(session, request)
                case PeerRelease(id=rid, tokens=tokens):
                    for token in tokens[:self.store.limits.max_batch]:
                        self.revoke(session, token)
                    return PeerAcked(rid)
                case PeerDone(id=rid, tokens=tokens):
                    for token in tokens[:self.store.limits.max_batch]:
                        held = session.grants.get(token)
                        if held is not None:
                            self.cluster.stats.served(session.node, held[0].nbytes)
                            self.revoke(session, token)
                    return PeerAcked(rid)
        except RequestError as exc:
            return PeerError(request.id, int(exc.code), str(exc))
        return PeerError(request.id, int(Code.PROTOCOL), f"unexpected {type(request).__name__}")

    def hello(self, identity: bytes, hello: PeerHello) -> Any:
        if hello.version != PEER_PROTOCOL_VERSION:
            return PeerError(hello.id, int(Code.VERSION), f"peer protocol version {hello.version} not "
                                                          f"supported; this daemon speaks {PEER_PROTOCOL_VERSION}")
        old = self.sessions.get(identity)
        if old is not None:
            self.end(old, "rehello")
        if len(self.sessions) >= self.cluster.config.max_peers:
            return PeerError(hello.id, int(Code.LIMIT), f"too many peer sessions: cluster.max_peers="
                                                        f"{self.cluster.config.max_peers}")
        store_session = self.store.open_session(self.cluster.internal_session_id(), 0)
        self.sessions[identity] = PeerSession(identity, hello.node[:64], store_session, time.monotonic())
        log.info("peer %s (node %r) said hello", identity.hex()[:8], hello.node)
        host, port = self.cluster.data_address
        return PeerWelcome(hello.id, PEER_PROTOCOL_VERSION, self.cluster.d.node, self.cluster.d.epoch,
                           self.transport.name, host, port, self.transport.metadata())

    def lookup(self, session: PeerSession, request: Lookup) -> Leased:
        ttl = min(request.ttl_s, float(self.cluster.config.transfer_ttl))
        # not parked for keys on the disk tier: they start coming back for the peer's next lookup
        results = self.store.acquire(session.store_session, request.ns, request.keys, 0.0, _never, park_for_disk=False)
        assert results is not None  # wait 0: answered now
        loop = self.cluster.d.loop
        segments = self.cluster.d.pool.segments
        offers: list[Offer | None] = []
        for key, result in zip(request.keys, results):
            if not isinstance(result, Location):
                offers.append(None)
                continue
            token = secrets.token_bytes(32)
            grant = Grant(token, result.pool, result.offset, result.nbytes, session, result.generation)
            self.transport.grants.add(grant)
            session.grants[token] = (grant, loop.call_later(ttl, self.revoke, session, token))
            addr = (self.transport.address_of(segments[result.pool].buf, result.offset)
                    if result.pool < len(segments) else 0)  # host pool entries only (nixl reads DRAM)
            offers.append(Offer(key, result.nbytes, result.dtype, list(result.shape), result.checksum, token, addr))
        return Leased(request.id, offers, ttl)

    def revoke(self, session: PeerSession, token: bytes) -> None:
        """Withdraw a token not yet taken (TTL, release, session end) and give its lease back."""
        held = session.grants.pop(token, None)
        if held is None:
            return
        grant, timer = held
        timer.cancel()
        if self.transport.grants.revoke(token) is None:
            session.sending.add(grant)  # a data connection took it first: on_sent gives it back
            return
        self.store.release(session.store_session, grant.generation)

    def on_sent(self, grants: list[Grant], sent: int, failure: str | None) -> None:
        """On the loop, from the transport: these grants' bytes are sent, or their send failed."""
        for grant in grants:
            session: PeerSession = grant.owner
            held = session.grants.pop(grant.token, None)
            if held is not None:
                held[1].cancel()
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
        for token in list(session.grants):
            self.revoke(session, token)
        if not session.sending:
            self.store.close_session(session.store_session)
        log.info("peer session of node %r ended (%s)", session.node, reason)

    def reap(self) -> None:
        cutoff = time.monotonic() - float(self.cluster.config.peer_ttl)
        for session in [s for s in self.sessions.values() if s.last_seen < cutoff]:
            self.end(session, "peer_ttl: silent")

    def transfer_leases(self) -> int:
        return sum(len(s.grants) + len(s.sending) for s in self.sessions.values())

    def close(self) -> None:
        for session in list(self.sessions.values()):
            self.end(session, "shutdown")


def _never(_results: Any) -> None:  # pragma: no cover - acquire with wait 0 never parks
    raise AssertionError("a lookup never parks")

