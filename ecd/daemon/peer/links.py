"""The puller's side of the peer plane's control: one DEALER per peer daemon, on the event loop.

A PeerLink says `peer_hello` on first use (and again when the owner answers NOT_REGISTERED: it
restarted, or reaped this node's session), matches replies to requests by id, and gives every
request a timeout, so a peer that stopped answering (SIGSTOP, a dead host) costs its callers at
most that timeout and never the loop. A ping every `cluster.peer_ttl / 3` keeps this node's
session at the owner alive and tells up from down (`ecd status`, the ecd_peer_up gauge). With
CURVE, the DEALER is a CURVE client with this node's key pair and the peer's public key
(`cluster.peer_keys`); a refused handshake (seen on the socket monitor) marks the link
"refused" and fails its requests at once rather than at their timeout.

PeerLinks holds the configured peers (`cluster.peers`, re-read on SIGHUP) and the ones fetches
named by endpoint, at most `cluster.max_peers`, and resolves a fetch's `peer` (an endpoint or a
node name) to a link.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import TYPE_CHECKING, Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from ...config_types import split_tcp_endpoint
from ...errors import Code
from ...peer_protocol import (PEER_PROTOCOL_VERSION, PeerError, PeerHello, PeerPing, PeerWelcome, encoder,
                             peer_reply_decoder)
from ..registry.entries import RequestError

if TYPE_CHECKING:  # pragma: no cover
    from .cluster import Cluster

log = logging.getLogger("ecd.peers")

_HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_SUCCEEDED)


REFUSED_RETRY_S = 1.0  # a refused link tries a fresh handshake this often, at most


class PeerUnavailable(Exception):
    """No answer from a peer in time, or it refused us; `reason` labels the metrics."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class PeerLink:
    def __init__(self, cluster: "Cluster", endpoint: str, configured: bool, server_key: bytes | None) -> None:
        self.closed = False
        self.cluster = cluster
        self.endpoint = endpoint
        self.host = split_tcp_endpoint(endpoint)[0]  # type: ignore[index]
        self.configured = configured
        self.discovered = False  # a live node of the fleet directory (directory.py)
        self.node = ""
        self.state = "connecting"
        self.refused: str | None = None  # why the security handshake failed, if it did
        self.data_address: tuple[str, int] | None = None
        self.misdirected: str | None = None  # the data host it announced, when not its own
        self.last_used = time.monotonic()
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._welcomed = False
        self._hello_lock = asyncio.Lock()
        self._decoder = peer_reply_decoder()
        self._server_key = server_key
        if cluster.curve is not None and server_key is None:
            raise RequestError(Code.INVALID, f"no CURVE public key for peer {endpoint}: add it to "
                                             "cluster.peer_keys")
        self.refused_at = 0.0
        self._io_tasks: list[asyncio.Task] = []
        self._open()
        self._tasks = [cluster.context.loop.create_task(self._ping_every(float(cluster.config.peer_ttl) / 3))]

    def _open(self) -> None:
        """A fresh DEALER (and its reader and handshake watcher). After a refused handshake
        libzmq would retry the same one forever: the link opens a new socket instead, at most
        once per REFUSED_RETRY_S, so a key allowed later (SIGHUP at the peer) is picked up."""
        cluster = self.cluster
        sock = cluster.zmq_context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only on a live connection
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        if cluster.curve is not None:
            sock.curve_publickey, sock.curve_secretkey = cluster.curve.public, cluster.curve.secret
            sock.curve_serverkey = self._server_key
        self._monitor = sock.get_monitor_socket(_HANDSHAKE_EVENTS)
        sock.connect(self.endpoint)
        self.sock = sock
        self.refused = None
        self._welcomed = False
        loop = cluster.context.loop
        self._io_tasks = [loop.create_task(self._read()), loop.create_task(self._watch_handshakes())]

    def _close_socket(self) -> None:
        for task in self._io_tasks:
            task.cancel()
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(0)
        self.sock.close(0)

    @property
    def server_key(self) -> bytes | None:
        """The peer's CURVE public key this link checks (the socket option is write-only)."""
        return self._server_key

    @property
    def label(self) -> str:
        return self.node or self.endpoint

    async def _read(self) -> None:
        while True:
            frame = await self.sock.recv()
            try:
                reply = self._decoder.decode(frame)
            except Exception as exc:
                log.warning("peer %s sent a malformed reply: %s", self.endpoint, exc)
                continue
            future = self._pending.pop(reply.id, None)
            if future is not None and not future.done():
                future.set_result(reply)

    async def _watch_handshakes(self) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.refused = None
                continue
            self.refused = ("it refused this node's CURVE key (is it in the peer's cluster.curve_allowed_keys?)"
                            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH else
                            "security handshake failed (CURVE on one side only, or a wrong cluster.peer_keys entry)")
            if self.state != "refused":
                log.warning("peer %s: %s", self.endpoint, self.refused)
            self.state = "refused"
            self.refused_at = time.monotonic()
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(PeerUnavailable("refused", f"peer {self.endpoint}: {self.refused}"))
            self._pending.clear()

    async def _ping_every(self, interval: float) -> None:
        while True:
            try:
                await self.request(PeerPing(0), float(self.cluster.config.request_timeout))
            except PeerUnavailable:
                pass  # request() has set the state
            except Exception:
                log.exception("pinging peer %s", self.endpoint)
            await asyncio.sleep(interval)

    async def request(self, message: Any, timeout: float) -> Any:
        """Send one peer request and return its reply; PeerUnavailable after `timeout` seconds
        (all of it: the hello on a fresh link included)."""
        deadline = time.monotonic() + timeout
        for attempt in range(2):
            if not self._welcomed:
                await self._hello(deadline)
            reply = await self._roundtrip(message, deadline)
            if isinstance(reply, PeerError) and reply.code == Code.NOT_REGISTERED and attempt == 0:
                self._welcomed = False  # the owner restarted or reaped us: greet it again, once
                continue
            return reply
        return reply

    async def _hello(self, deadline: float) -> None:
        async with self._hello_lock:
            if self._welcomed:
                return
            reply = await self._roundtrip(PeerHello(0, PEER_PROTOCOL_VERSION, self.cluster.node, self.cluster.epoch),
                                          deadline)
            if isinstance(reply, PeerError):
                self.state = "down"
                raise PeerUnavailable("refused", f"peer {self.endpoint} refused the handshake: {reply.message}")
            if not isinstance(reply, PeerWelcome):
                raise PeerUnavailable("protocol", f"peer {self.endpoint} answered hello with {type(reply).__name__}")
            if reply.transport != self.cluster.transport.name:
                self.state = "down"
                raise PeerUnavailable("refused", f"peer {self.endpoint} uses transport {reply.transport!r}, "
                                                 f"this node {self.cluster.transport.name!r}")
            if reply.data_host and reply.data_host.strip("[]").lower() != self.host.lower():
                # Only the host this node dialled for control: a peer must not steer this daemon
                # into connecting elsewhere (another host, a port on this node's loopback).
                self.state = "refused"
                if self.misdirected != reply.data_host:  # a ping greets it again: log once
                    log.warning("peer %s announced its data port at host %r, not the host it was dialled "
                                "at (%s): refused, nothing is fetched from it", self.endpoint,
                                reply.data_host, self.host)
                self.misdirected = reply.data_host
                raise PeerUnavailable("data_host", f"peer {self.endpoint} announced data host "
                                                   f"{reply.data_host!r}, not {self.host!r}: refused")
            self.misdirected = None
            if self.node and self.node != reply.node:
                log.info("peer %s is now node %r (was %r)", self.endpoint, reply.node, self.node)
            self.node = reply.node
            self.data_address = (reply.data_host or self.host, reply.data_port)
            if reply.agent:  # nixl: the owner's agent metadata, loaded on the first pull
                self.cluster.transport.learn_peer(self.data_address, reply.agent)
            self._welcomed = True

    async def _roundtrip(self, message: Any, deadline: float) -> Any:
        if self.refused is not None and time.monotonic() - self.refused_at >= REFUSED_RETRY_S:
            self._close_socket()
            self._open()
        if self.refused is not None:
            raise PeerUnavailable("refused", f"peer {self.endpoint}: {self.refused}")
        rid = next(self._ids)
        future = self.cluster.context.loop.create_future()
        self._pending[rid] = future
        message.id = rid
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                await self.sock.send(encoder.encode(message))
                reply = await future
        except TimeoutError:
            self._pending.pop(rid, None)
            if self.refused is not None:  # the send waited for a connection the peer refused
                self.state = "refused"
                raise PeerUnavailable("refused", f"peer {self.endpoint}: {self.refused}") from None
            if self.state != "down":
                log.warning("peer %s did not answer within the timeout: marked down", self.endpoint)
            self.state = "down"
            raise PeerUnavailable("timeout", f"no answer from peer {self.endpoint} in time") from None
        except asyncio.CancelledError:
            # Closing the link (the peer left the directory, a reload dropped it) cancels the
            # send still waiting for a connection: this request failed, the caller (a client's
            # fetch) was not cancelled, so say so rather than end its task as cancelled.
            self._pending.pop(rid, None)
            task = asyncio.current_task()
            if self.closed and task is not None and not task.cancelling():
                raise PeerUnavailable("connection", f"peer {self.endpoint}: the link was closed") from None
            raise
        if self.misdirected is not None:  # answered, but refused until it greets us properly
            return reply
        if self.state != "up":
            log.info("peer %s (node %r) is up", self.endpoint, self.node)
        self.state = "up"
        return reply

    def close(self) -> None:
        self.closed = True
        for task in self._tasks:
            task.cancel()
        for future in self._pending.values():
            if not future.done():
                future.set_exception(PeerUnavailable("shutdown", "the peer link was closed"))
                future.exception()  # its request may be waiting on the send instead: never "unretrieved"
        self._pending.clear()
        self._close_socket()


class PeerLinks:
    def __init__(self, cluster: "Cluster", peer_keys: dict[str, bytes]) -> None:
        self.cluster = cluster
        self.peer_keys = peer_keys
        self.links: dict[str, PeerLink] = {}  # by endpoint

    def configure(self, peers: list[str], peer_keys: dict[str, bytes]) -> None:
        """Start, or on SIGHUP: links to configured peers; peers no longer listed are dropped
        (a fetch may still name them, as any endpoint)."""
        self.peer_keys = peer_keys
        for endpoint, link in list(self.links.items()):
            if endpoint not in peers:
                if not link.discovered:  # the directory's stay while it lists them
                    link.close()
                    del self.links[endpoint]
            elif peer_keys.get(endpoint) != (link.server_key if self.cluster.curve else None):
                link.close()
                del self.links[endpoint]
        for endpoint in peers:
            if endpoint not in self.links:
                self.links[endpoint] = PeerLink(self.cluster, endpoint, True, peer_keys.get(endpoint))
        for link in self.links.values():
            link.configured = link.endpoint in peers

    def configured(self) -> list[PeerLink]:
        """The links a fetch with no peer asks: the configured peers and the directory's."""
        return [link for link in self.links.values() if link.configured or link.discovered]

    def discovered(self, peers: dict[str, bytes | None]) -> None:
        """The directory's live nodes (endpoint -> public key, None without CURVE): links to the
        new ones, and those that left dropped (a configured peer stays)."""
        for endpoint, old in list(self.links.items()):
            if old.discovered and endpoint not in peers:
                old.discovered = False
                if not old.configured:
                    old.close()
                    del self.links[endpoint]
        for endpoint, key in peers.items():
            link: PeerLink | None = self.links.get(endpoint)
            if link is not None and not link.configured and self.cluster.curve is not None \
                    and link.server_key != key:
                link.close()  # another key now (a new node at the endpoint): a fresh link
                del self.links[endpoint]
                link = None
            if link is None:
                if len(self.links) >= self.cluster.config.max_peers:
                    log.warning("directory: not adding peer %s: cluster.max_peers=%d peers known", endpoint,
                                self.cluster.config.max_peers)
                    continue
                link = PeerLink(self.cluster, endpoint, False, self.peer_keys.get(endpoint, key))
                self.links[endpoint] = link
            link.discovered = True

    def resolve(self, peer: str) -> list[PeerLink]:
        """The links a fetch asks: its named peer (endpoint or node name), else every configured
        one. RequestError INVALID for a name no link knows or a bad endpoint."""
        if not peer:
            links = self.configured()
            if not links:
                raise RequestError(Code.INVALID, "no peer named and cluster.peers is empty")
            return links
        if peer.startswith("tcp://"):
            if split_tcp_endpoint(peer) is None:
                raise RequestError(Code.INVALID, f"peer {peer!r} is not tcp://HOST:PORT")
            link = self.links.get(peer)
            if link is None:
                link = self._add(peer)
            link.last_used = time.monotonic()
            return [link]
        named = [link for link in self.links.values() if link.node == peer]
        if not named:
            raise RequestError(Code.INVALID, f"no known peer is node {peer!r} (known: "
                               f"{', '.join(sorted(x.node for x in self.links.values() if x.node)) or 'none yet'})")
        return named[:1]

    def _add(self, endpoint: str) -> PeerLink:
        if len(self.links) >= self.cluster.config.max_peers:
            # drop the least recently used link a fetch named (configured ones stay)
            adhoc = sorted((x for x in self.links.values() if not x.configured and not x.discovered), key=lambda x: x.last_used)
            if not adhoc:
                raise RequestError(Code.LIMIT, f"cluster.max_peers={self.cluster.config.max_peers} peers known")
            adhoc[0].close()
            del self.links[adhoc[0].endpoint]
        link = PeerLink(self.cluster, endpoint, False, self.peer_keys.get(endpoint))
        self.links[endpoint] = link
        return link

    def close(self) -> None:
        for link in self.links.values():
            link.close()
        self.links.clear()
