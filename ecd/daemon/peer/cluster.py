"""The peer plane (`[cluster]`): daemons fetch entries from each other. This module assembles it
and counts what it does; the parts are siblings:

- owner.py       the owner's side: the ROUTER on `cluster.listen`, peer sessions, transfer leases
- links.py  the puller's side of control: one DEALER per peer, handshakes, pings, up/down
- directory.py   the fleet directory (`directory = "redis://..."`): registration, the peers it
                 learns, the key map, lookups (its layout in the store: directory_store.py)
- fetch.py       the fetch flow: lookup, pull-once, local extents, verify, commit or abort
- ../transport/  the bulk bytes, on their own threads or, for small pulls over a pooled tcp
                 connection, on the loop (one interface, transports registered by name)

Everything ZeroMQ here lives in its own context (zmq.asyncio, on the daemon's event loop) with
its own ZAP handler, so `[control]` and `[cluster]` keys never mix. prepare() binds (start-up
errors before READY, exit 2); start() runs it on the loop; close() stops the transport's threads
before the daemon unmaps its pools.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from ...cluster_config import INSECURE_CLUSTER_OPENS, ClusterSection
from ...config_types import split_tcp_endpoint
from ...errors import ConfigError
from ...protocol import DirectoryStats, PeerState
from ...transport import Transport, TransportUnavailable
from ...transport.registry import make_transport
from .directory import Directory, DirectoryPeer
from .fetch import LOCAL, Fetcher, check_fetch
from .links import PeerLink, PeerLinks
from .owner import PEER_SNDHWM, REAP_INTERVAL_S, PeerServer
from ..ops.histogram import Histogram
from ..ops.security import CurveAuth, cluster_curve, cluster_tls

if TYPE_CHECKING:  # pragma: no cover
    from ...config import Config
    from .context import PeerContext

log = logging.getLogger("ecd.peers")

# 1 ms .. 60 s: a fetch is a few round trips plus the bytes (16 MiB ~ 5-10 ms on loopback)
FETCH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
FAILURE_REASONS = ("timeout", "connection", "refused", "protocol", "checksum", "pool_full", "invalid",
                   "lookup_refused", "lookup_failed", "commit_refused", "shutdown", "data_host",
                   # the owner's side: a peer cut off for its unread replies, lookups refused, and
                   # data connections turned away before any token was taken (transport/tcp_gate.py)
                   "serve_backlog", "serve_lease_limit", "serve_lookup_invalid", "serve_handshake_timeout",
                   "serve_refused", "serve_protocol", "serve_shed", "serve_busy")
MAX_LABELS = 256  # peer labels kept in counters: node names are the peers' claims


class PeerStats:
    """Plain counters for /metrics and Stats, by peer label (node name, else endpoint)."""

    def __init__(self) -> None:
        self.fetched_by: dict[str, list[int]] = {}  # label -> [entries, bytes]
        self.served_by: dict[str, list[int]] = {}
        self.failures: dict[str, int] = {}  # by reason (serve_* for the owner's side)
        self.failures_by: dict[str, int] = {}  # by peer label (fetches only)
        self.fetch_latency = Histogram(FETCH_BUCKETS)

    @staticmethod
    def _bump(table: dict[str, list[int]], label: str, nbytes: int) -> None:
        if label not in table and len(table) >= MAX_LABELS:
            label = "other"
        row = table.setdefault(label, [0, 0])
        row[0] += 1
        row[1] += nbytes

    def fetched(self, link: PeerLink, nbytes: int) -> None:
        self._bump(self.fetched_by, link.label, nbytes)

    def served(self, node: str, nbytes: int) -> None:
        self._bump(self.served_by, node or "unknown", nbytes)

    def count_failure(self, reason: str, link: PeerLink | None = None) -> None:
        self.failures[reason] = self.failures.get(reason, 0) + 1
        if link is not None:
            label = link.label if link.label in self.failures_by or len(self.failures_by) < MAX_LABELS else "other"
            self.failures_by[label] = self.failures_by.get(label, 0) + 1


class Cluster:
    # what it reads of the daemon once it serves: given to start()
    context: "PeerContext"

    def __init__(self, config: "Config", node: str, epoch: int) -> None:
        """`config`: the daemon's at start, what binds and secures the peer plane (SIGHUP
        changes only its peers: reload); `node` and `epoch`: this daemon's, told to peers."""
        self.startup_config = config
        self.node = node
        self.epoch = epoch
        self.config: ClusterSection = config.cluster
        self.stats = PeerStats()
        self.zmq_context = zmq.asyncio.Context(io_threads=1)  # the peer plane's own (see above)
        loaded = cluster_curve(config)
        self.curve: CurveAuth | None = loaded[0] if loaded else None
        peer_keys = loaded[1] if loaded else {}
        self._ids = itertools.count(1)
        self.transport: Transport = self._make_transport()
        self.data_address: tuple[str, int] = ("", 0)  # what peers are told (peer_welcome)
        self.data_bound: tuple[str, int] = ("", 0)  # where the data listener is bound
        self.listen = self.config.listen
        self.advertised = self.config.advertise or self.listen
        self._router: Any = None
        self.server: PeerServer | None = None
        self.links = PeerLinks(self, peer_keys)
        self.fetcher: Fetcher | None = None
        self.directory: Directory | None = None
        self.directory_nodes: dict[str, str] = {}  # the directory's live nodes: name -> endpoint
        self._tasks: list[asyncio.Task] = []

    def _make_transport(self) -> Transport:
        host, port = split_tcp_endpoint(self.config.data_listen)  # type: ignore[misc]
        name = self.config.transport
        tls = cluster_tls(self.startup_config)  # None without cluster.tls (config refuses it where it does not apply)
        try:  # instance: a name no other daemon, nor this node's next run, ever had (nixl names its agent so)
            return make_transport(name, host=host, port=port, max_inflight=self.config.max_inflight,
                                  io_timeout=float(self.config.request_timeout), tls=tls,
                                  instance=f"ecd:{self.node}:{self.epoch}")
        except TransportUnavailable as exc:
            raise ConfigError(f"cluster.transport: \"{name}\" is configured but {exc}") from None

    def internal_session_id(self) -> int:
        """Store sessions of the peer plane take negative ids: never a client's."""
        return -next(self._ids)

    @property
    def internal_sessions(self) -> int:
        return len(self.server.sessions) + 1 if self.server is not None else 0

    def prepare(self) -> None:
        """Bind the peer ROUTER and the data listener (ConfigError naming the key on failure)."""
        if self.config.directory:
            self._make_directory()
        if self.curve is not None:
            self.curve.start(zmq.Context.shadow(self.zmq_context.underlying))  # ZAP for this context
        sock = self.zmq_context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        max_message = int(self.startup_config.limits.max_message_bytes)
        sock.setsockopt(zmq.MAXMSGSIZE, max_message)
        # What one peer can make this daemon hold (see owner.py): replies by count here and by
        # bytes in PeerServer.send (ROUTER_MANDATORY: a full pipe is EAGAIN, not a silent drop);
        # requests libzmq reads ahead by count times their largest size, within peer_queue_bytes.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, PEER_SNDHWM)
        sock.setsockopt(zmq.RCVHWM, max(2, min(1000, int(self.config.peer_queue_bytes) // max_message)))
        if self.curve is not None:
            self.curve.apply(sock)
        try:
            sock.bind(self.config.listen)
        except zmq.ZMQError as exc:
            sock.close(0)
            raise ConfigError(f"cluster.listen: cannot bind {self.config.listen}: {exc}") from None
        self._router = sock
        self.listen = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.advertised = self.config.advertise or self.listen  # what clients are told
        try:
            host, port = self.transport.bind()
        except OSError as exc:
            raise ConfigError(f"cluster.data_listen: cannot bind {self.config.data_listen}: "
                              f"{exc.strerror or exc}") from None
        self.data_bound = (host, port)
        # Announce "": peers dial the data port at the host they dialled for control, and refuse
        # any other host (links.py). The config keeps data_listen on listen's host or a
        # wildcard, so that host reaches the data listener.
        self.data_address = ("", port)
        if not self.transport.has_data_listener:
            # It listens by itself (nixl: UCX, its address in the agent metadata): what peers get
            # only names this daemon, as the key of its metadata; the control port is unique on its host.
            self.data_address = ("", split_tcp_endpoint(self.listen)[1])  # type: ignore[index]

    def start(self, context: "PeerContext") -> None:
        self.context = context
        loop = context.loop
        self.transport.loop = loop  # completions come back here
        self.server = PeerServer(self, self._router, self.transport)
        self.fetcher = Fetcher(self)
        self.transport.serve(lambda pool: context.segments[pool].buf, self.server.on_sent)
        self.links.configure(list(self.config.peers), self.links.peer_keys)
        self._tasks = [loop.create_task(self.server.run()), loop.create_task(self._reap())]
        if self.directory is not None:
            self._start_directory(self.directory)
        log.info("peer plane on %s (data: %s:%d, transport %s), %d configured peer(s)", self.listen,
                 self.data_bound[0] or "*", self.data_bound[1], self.transport.name, len(self.config.peers))
        if self.curve is None:  # check_cluster_policy admitted it only with insecure = true
            log.warning("cluster.insecure = true: the peer plane on %s has no authentication: %s",
                        self.listen, INSECURE_CLUSTER_OPENS)

    def _make_directory(self) -> None:
        """At prepare(): the directory's credentials read (ConfigError before READY)."""
        try:
            self.directory = Directory(self.config, self.node, self.epoch, self._directory_record,
                                       self.directory_peers)
        except ValueError as exc:
            raise ConfigError(f"cluster.directory_password_file: {exc}") from None

    def _start_directory(self, directory: Directory) -> None:
        if self.context.holdings is not None and self.config.directory_keys != "none":
            directory.seed((e.ns, e.key, e.meta) for e in self.context.store.index.values())  # adopted ones
            self.context.holdings.listen(directory)
        directory.start(self.context.loop)
        log.info("fleet directory %s (prefix %r, ttl %.0fs, keys: %s)", self.config.directory,
                 self.config.directory_prefix, float(self.config.directory_ttl), self.config.directory_keys)

    def _directory_record(self) -> dict[str, str]:
        """This node's record in the directory (called on its thread: plain reads)."""
        pools = [(a.capacity, a.used) for a in self.context.store.host.allocators]
        host = split_tcp_endpoint(self.advertised)[0]  # type: ignore[index]
        host = f"[{host}]" if ":" in host else host
        return {"endpoint": self.advertised, "data": f"tcp://{host}:{self.data_address[1]}",
                "transport": self.transport.name, "curve": self.curve.public.decode() if self.curve else "",
                "capacity": str(sum(p[0] for p in pools)), "used": str(sum(p[1] for p in pools)), "health": "ok"}

    def directory_peers(self, peers: list[DirectoryPeer]) -> None:
        """On the loop, after each renewal: the directory's live nodes become (or stop being) peers.
        With CURVE a node's key must be in curve_allowed_keys too (or cluster.peer_keys name it)."""
        admitted: dict[str, bytes | None] = {}
        nodes = {}
        for peer in peers:
            if peer.endpoint in (self.listen, self.advertised) or split_tcp_endpoint(peer.endpoint) is None:
                continue
            key: bytes | None = None
            if self.curve is not None:
                key = self.links.peer_keys.get(peer.endpoint)
                if key is None:
                    if peer.curve.encode() not in self.curve.allowed:
                        if self.directory_nodes.get(peer.node) != peer.endpoint:  # log once
                            log.warning("directory: node %r (%s) has a CURVE key not in cluster.curve_allowed_keys: "
                                        "not a peer", peer.node, peer.endpoint)
                        nodes[peer.node] = peer.endpoint
                        continue
                    key = peer.curve.encode()
            admitted[peer.endpoint] = key
            nodes[peer.node] = peer.endpoint
        self.directory_nodes = nodes
        self.links.discovered(admitted)

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            if self.server is not None:
                self.server.reap()

    def fetch(self, ns: str, keys: list[str], peer: str, timeout_s: float) -> "asyncio.Task[list[str]]":
        """Start a client's Fetch: its task's result is per key "" (local now) or why not (a
        FAILURE_REASONS label or "not_found"). RequestError now for a bad request or an unknown peer."""
        assert self.fetcher is not None
        check_fetch(self.context.store, ns, keys)
        if not peer and self.directory is not None:  # down: every peer known asked (none: not_found)
            deadline = self.fetcher.deadline_for(timeout_s)
            return self.context.loop.create_task(self._fetch_by_directory(ns, keys, deadline))
        links = self.links.resolve(peer)
        deadline = self.fetcher.deadline_for(timeout_s)
        return self.context.loop.create_task(self.fetcher.fetch(ns, keys, links, deadline))

    async def _fetch_by_directory(self, ns: str, keys: list[str], deadline: float) -> list[str]:
        """One directory lookup, then each key from a live holder (the keys grouped by holder);
        keys it does not know, or that their holder no longer had, the old way: every peer asked.
        The directory down or failing: the old way for all."""
        assert self.directory is not None and self.fetcher is not None
        fetcher = self.fetcher
        found = await self.directory.lookup(ns, keys)
        groups: dict[PeerLink, list[int]] = {}
        rest: list[int] = []
        by_endpoint = self.links.links
        for i, holders in enumerate(found or [[] for _ in keys]):
            link = next((by_endpoint[e] for e in (self.directory_nodes.get(n, "") for n in holders if n != self.node)
                         if e in by_endpoint), None)
            if link is None:
                rest.append(i)
            else:
                groups.setdefault(link, []).append(i)
        result = ["not_found"] * len(keys)

        async def one(link: PeerLink, index: list[int]) -> None:
            got = await fetcher.fetch(ns, [keys[i] for i in index], [link], deadline)
            for i, answer in zip(index, got):
                result[i] = answer
                if answer == "not_found":
                    rest.append(i)  # the directory was behind: ask everyone below
            self.directory.routed(link.label, sum(1 for x in got if x == LOCAL))  # type: ignore[union-attr]

        if groups:
            await asyncio.gather(*(one(link, index) for link, index in groups.items()))
        links = self.links.configured()
        if rest and links:
            rest.sort()
            got = await fetcher.fetch(ns, [keys[i] for i in rest], links, deadline)
            for i, answer in zip(rest, got):
                result[i] = answer
        return result

    def reload(self, new: ClusterSection) -> None:
        """SIGHUP: cluster.peers and cluster.peer_keys; the allowed peer keys are re-read."""
        from ..ops.security import load_peer_keys
        if self.curve is not None:
            self.curve.reload()
        try:
            keys = load_peer_keys(new.peer_keys) if self.curve is not None else {}
        except ConfigError as exc:
            log.error("SIGHUP: keeping the peers: %s", exc)
            return
        self.config.peers, self.config.peer_keys = list(new.peers), dict(new.peer_keys)
        self.links.configure(list(new.peers), keys)
        if self.directory is not None:
            self.directory.reload()

    def peer_states(self) -> list[PeerState]:
        out = []
        served = self.stats.served_by
        for link in self.links.links.values():
            fetched = self.stats.fetched_by.get(link.label, [0, 0])
            serve = served.get(link.node, [0, 0]) if link.node else [0, 0]
            out.append(PeerState(link.endpoint, link.node, link.state, link.configured, fetched[0], fetched[1],
                                 serve[0], serve[1], self.stats.failures_by.get(link.label, 0)))
        return out

    def directory_stats(self) -> "DirectoryStats | None":
        d = self.directory
        if d is None:
            return None
        c = d.counters
        return DirectoryStats(self.config.directory, c.up, list(c.nodes),
                              {"commands": c.commands, "errors": c.errors, "lookups": c.lookups,
                               "found": c.lookup_keys_found, "unknown": c.lookup_keys_unknown,
                               "resyncs": c.resyncs, "overflows": c.overflows}, dict(c.routed))

    def transfer_leases(self) -> int:
        return self.server.transfer_leases() if self.server is not None else 0

    def fetches_in_flight(self) -> int:
        return len(self.fetcher.inflight) if self.fetcher is not None else 0

    def close(self) -> None:
        """At shutdown: after this no thread touches a pool mapping."""
        for task in self._tasks:
            task.cancel()
        if self.directory is not None:
            self.directory.close()
        self.links.close()
        self.transport.close()  # joins the data threads
        if self.server is not None:
            self.server.close()
        if self.fetcher is not None:
            self.fetcher.close()
        if self._router is not None:
            self._router.close(0)
        if self.curve is not None:
            self.curve.stop()
        self.zmq_context.term()
