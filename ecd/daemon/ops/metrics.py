"""Prometheus metrics and the health endpoint.

The hot path only bumps plain ints (a request costs the daemon ~30 µs; prometheus_client's
labelled counters and histograms would add several µs to each), and a custom collector turns
them, and the store's state, into metric families when Prometheus scrapes. The HTTP endpoint is
a tiny asyncio server on the daemon's own loop: GET /metrics and GET /healthz, nothing else.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily,
                                    InfoMetricFamily)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from ... import __version__
from ...listeners import bind_tcp_listener
from ..registry.entries import State
from .histogram import Histogram
from ..registry.reservations import RESERVATION_OUTCOMES
from ..writes.leases import LEASE_OUTCOMES

if TYPE_CHECKING:  # pragma: no cover
    from ...protocol import EventsStats, RestartStats
    from ..peer.cluster import Cluster
    from ..registry.store import Store
    from ..tiers.base import LowerTier
    from .context import MetricsSource

log = logging.getLogger("ecd.metrics")

# Why a request or a reply went nowhere (ServeCounters.dropped); every reason is exported, 0 or not.
DROP_REASONS = ("refused", "unanswerable", "send_failed", "client_backlog")


def client_sessions(store: "Store", peers: "Cluster | None", lower_tier: "LowerTier") -> int:
    """Connected clients (ecd_clients, Stats.clients): the store's sessions less those the peer
    plane and the lower tier opened for themselves."""
    return store.sessions - (peers.internal_sessions if peers is not None else 0) - lower_tier.internal_sessions


def counter_by(name: str, documentation: str, label: str, counts: Iterable[tuple[str, float]]) -> CounterMetricFamily:
    """A counter family with one label: a sample per (label value, count), in the order given."""
    family = CounterMetricFamily(name, documentation, labels=[label])
    for value, n in counts:
        family.add_metric([value], n)
    return family

# Why the HTTP endpoint closed a connection to stay under its cap (MetricsServer.shed).
SHED_REASONS = ("oldest_closed", "refused")

# 10 µs .. 1 s: a round trip is tens of µs, a parked request's handling is no different
LATENCY_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
                   0.1, 0.25, 0.5, 1.0)


class RequestStats:
    """Requests by (op, outcome) and handling-latency histograms by op, as plain ints."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = {}
        self._hist: dict[str, Histogram] = {}  # by op

    def observe(self, op: str, outcome: str, seconds: float) -> None:
        key = (op, outcome)
        self.counts[key] = self.counts.get(key, 0) + 1
        hist = self._hist.get(op)
        if hist is None:
            hist = self._hist[op] = Histogram(LATENCY_BUCKETS)
        hist.observe(seconds)

    def by_op(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for (op, _), n in self.counts.items():
            totals[op] = totals.get(op, 0) + n
        return totals

    def histograms(self) -> Iterator[tuple[str, list[tuple[str, int]], float]]:
        for op, hist in self._hist.items():
            yield op, hist.buckets(), hist.sum


@dataclass
class ServeCounters:
    """What the control loop (control/loop.py) and the handlers count, for /metrics and Stats."""
    requests: RequestStats = field(default_factory=RequestStats)
    errors: dict[str, int] = field(default_factory=dict)  # error replies by code, and send failures
    dropped: dict[str, int] = field(default_factory=dict)  # requests and replies nobody could be told about
    ring_overruns: int = 0  # reported by clients
    # reads that did not match their stored checksum (reported by clients), and inline puts
    # whose data did not match the checksum sent with it (seen here)
    integrity_failures: dict[str, int] = field(default_factory=lambda: {"read": 0, "inline_put": 0})


class DaemonCollector:
    """Reads the daemon's counters and the store's state at scrape time."""

    def __init__(self, source: "MetricsSource") -> None:
        self.source = source  # what the daemon exports (context.py)

    def collect(self):
        d = self.source
        store = d.store
        if store is None:
            return
        c = store.counters

        requests = CounterMetricFamily("ecd_requests", "Requests handled, by operation and outcome",
                                       labels=["op", "outcome"])
        for (op, outcome), n in sorted(d.counters.requests.counts.items()):
            requests.add_metric([op, outcome], n)
        yield requests

        latency = HistogramMetricFamily("ecd_request_duration_seconds",
                                        "Time the daemon spent handling a request (not time parked)",
                                        labels=["op"])
        for op, buckets, total in sorted(d.counters.requests.histograms()):
            latency.add_metric([op], buckets, total)
        yield latency

        yield CounterMetricFamily("ecd_written_bytes", "Bytes of entries published", value=c["written_bytes"])
        yield CounterMetricFamily("ecd_read_bytes", "Bytes of entries read: handed out under read leases, or "
                                  "copied by clients without a round trip (as they report them)",
                                  value=c["read_bytes"])
        yield CounterMetricFamily("ecd_local_reads", "Gets that clients made without a round trip, as they "
                                  "report them (batched, after the reads; also counted in ecd_lookups)",
                                  value=c["local_reads"])

        states = store.count_states()
        reservations, reserved_bytes = store.reservation_totals()
        entries = GaugeMetricFamily("ecd_entries", "Entries by state", labels=["state"])
        for state, n in (("ready", states[State.READY]),
                         ("writing", store.writes_in_progress()),
                         ("retired", states[State.RETIRED]), ("reserved", reservations)):
            entries.add_metric([state], n)
        yield entries
        yield GaugeMetricFamily("ecd_reserved_bytes", "Bytes held by clients' reservations for their next "
                                "put (one per client; never evicted, never evicting)", value=reserved_bytes)
        yield counter_by("ecd_reservations", "Reservations for a client's next put, by outcome: granted or "
                         "refused (quota or no free extent: the put takes Alloc), then published, aborted, "
                         "expired or reclaimed (its client went)", "outcome",
                         ((outcome, c[f"reservations_{outcome}"]) for outcome in RESERVATION_OUTCOMES))
        leases, leased_bytes, pages = d.submissions()
        yield GaugeMetricFamily("ecd_put_leases", "Put leases clients hold (pool space they place puts in "
                                "without a message)", value=leases)
        yield GaugeMetricFamily("ecd_leased_bytes", "Bytes of put leases not yet carved into entries (counted "
                                "in their namespace's use)", value=leased_bytes)
        yield GaugeMetricFamily("ecd_submission_pages", "Sessions with a submission page", value=pages)
        yield counter_by("ecd_put_leases", "Put leases by outcome: granted or refused, then filled, retired "
                         "(its client moved to a newer one), expired or reclaimed", "outcome",
                         ((outcome, c[f"put_leases_{outcome}"]) for outcome in LEASE_OUTCOMES))
        yield counter_by("ecd_submission_records", "Submission records read, by outcome: committed, refused "
                         "(the reason goes to the client's page), aborted (its put failed)", "outcome",
                         (("committed", c["submission_records"] - c["submission_refused"] - c["submission_aborts"]),
                          ("refused", c["submission_refused"]), ("aborted", c["submission_aborts"])))

        used = GaugeMetricFamily("ecd_pool_used_bytes", "Bytes allocated in each pool: host<n> segments, "
                                 "cuda<ordinal> arenas", labels=["pool"])
        capacity = GaugeMetricFamily("ecd_pool_capacity_bytes", "Size of each pool: host<n> segments, "
                                     "cuda<ordinal> arenas", labels=["pool"])
        for label, allocator in zip(d.pool_labels, store.host.allocators):
            used.add_metric([label], allocator.used)
            capacity.add_metric([label], allocator.capacity)
        yield used
        yield capacity
        if d.arenas is not None and len(d.arenas):
            arenas = GaugeMetricFamily("ecd_cuda_arena_info", "A daemon-owned CUDA arena ([pool.cuda]): its "
                                       "pool label and the device's UUID (always 1)",
                                       labels=["pool", "device_uuid"])
            for arena in d.arenas:
                arenas.add_metric([arena.label, arena.uuid], 1)
            yield arenas

        yield counter_by("ecd_evictions", "Entries removed, by reason", "reason",
                         ((reason, c[key]) for reason, key in (
                             ("capacity", "evictions"), ("quota", "evicted_quota"), ("deleted", "evicted_deleted"),
                             ("replaced", "evicted_replaced"), ("truncated", "evicted_truncated"))))
        yield CounterMetricFamily("ecd_pool_truncations", "Times a host pool file was found truncated by another "
                                  "process (restored; the entries it cut: ecd_evictions_total{reason=\"truncated\"})",
                                  value=c["pool_truncations"])
        yield CounterMetricFamily("ecd_pool_truncated_writes_refused", "Puts refused because a pool truncation took "
                                  "their bytes while they were written", value=c["truncated_writes_refused"])

        # Configured namespaces only: clients choose namespace names, so unconfigured ones would
        # make the label set unbounded.
        ns_used = GaugeMetricFamily("ecd_namespace_used_bytes", "Bytes held by a configured "
                                    "namespace's entries (being written, ready, or replaced while read) and "
                                    "its clients' reservations for their next put",
                                    labels=["namespace"])
        ns_quota = GaugeMetricFamily("ecd_namespace_quota_bytes", "A configured namespace's byte quota "
                                     "(0: none)", labels=["namespace"])
        ns_guaranteed = GaugeMetricFamily("ecd_namespace_guaranteed_bytes", "Bytes of a configured "
                                          "namespace other namespaces never evict", labels=["namespace"])
        ns_refused = CounterMetricFamily("ecd_namespace_quota_exceeded", "Items refused QuotaExceeded",
                                         labels=["namespace"])
        # A tenant with a size: its namespaces together (registry/placement.py, scope TENANT NUL)
        tenant_used = GaugeMetricFamily("ecd_tenant_used_bytes", "Bytes held by a tenant's namespaces "
                                        "(counted as ecd_namespace_used_bytes)", labels=["tenant"])
        tenant_size = GaugeMetricFamily("ecd_tenant_size_bytes", "A tenant's size: its quota and its "
                                        "guaranteed share", labels=["tenant"])
        tenant_refused = CounterMetricFamily("ecd_tenant_quota_exceeded", "Items refused QuotaExceeded for "
                                             "the tenant's size", labels=["tenant"])
        for name, (quota, guaranteed) in sorted(store.policies.items()):
            used, refused = store.ns_used.get(name, 0), store.quota_refusals.get(name, 0)
            tenant = store.placement.tenant_of_scope(name)
            if tenant:
                for family, value in ((tenant_used, used), (tenant_size, quota), (tenant_refused, refused)):
                    family.add_metric([tenant], value)
                continue
            for family, value in ((ns_used, used), (ns_quota, quota), (ns_guaranteed, guaranteed),
                                  (ns_refused, refused)):
                family.add_metric([name], value)
        yield from (ns_used, ns_quota, ns_guaranteed, ns_refused, tenant_used, tenant_size, tenant_refused)

        lookups = CounterMetricFamily("ecd_lookups", "Key lookups (get, view, exists)", labels=["result"])
        lookups.add_metric(["hit"], c["hits"])
        lookups.add_metric(["miss"], c["misses"])
        yield lookups

        read, pins, waiters = store.lease_totals()
        writes = store.writes_in_progress()
        leases = GaugeMetricFamily("ecd_leases", "Active leases", labels=["kind"])
        for kind, n in (("read", read), ("pin", pins), ("write", writes)):
            leases.add_metric([kind], n)
        yield leases

        pinned = GaugeMetricFamily("ecd_pinned_bytes", "Bytes of pinned entries, against their budget "
                                   "([limits] pinned_share, less what guaranteed shares lack)", labels=["pool", "of"])
        for group, held in sorted(store.deadlines.pinned.items()):
            name = "host" if group == -1 else f"host{-1 - group}" if group < 0 else f"arena{group}"
            pinned.add_metric([name, "held"], held)
            pinned.add_metric([name, "budget"], store.deadlines.budget(group))
        yield pinned
        yield CounterMetricFamily("ecd_pins_refused", "Pins not taken for want of room in the pin budget (the "
                                  "key answered not found)", value=c["pins_refused"])
        yield counter_by("ecd_leases_reclaimed", "Leases taken back from clients", "reason",
                         ((reason, c[f"reclaimed_{reason}"]) for reason in
                          ("client_exit", "connection_closed", "session_ttl", "write_ttl", "pin_expired")))
        yield counter_by("ecd_frames_dropped", "Requests and replies dropped unanswered, by reason: refused (a "
                         "fire-and-forget request, id 0, was refused), unanswerable (id 0 on a request that "
                         "wants a reply), send_failed (the reply could not be queued to its peer), client_backlog "
                         "(its peer was closed for not reading its replies)", "reason",
                         ((reason, d.counters.dropped.get(reason, 0)) for reason in DROP_REASONS))

        http = d.http
        if http is not None:
            yield GaugeMetricFamily("ecd_http_connections", "Open connections to this HTTP endpoint",
                                    value=http.open_connections)
            shed = CounterMetricFamily("ecd_http_connections_shed", "Connections to this HTTP endpoint "
                                       "closed to stay under its cap ([metrics] max_connections), by reason: "
                                       "oldest_closed (the oldest one still waiting for its request, for a "
                                       "new one), refused (a new one, while every open one was mid-response)",
                                       labels=["reason"])
            for reason in SHED_REASONS:
                shed.add_metric([reason], http.shed[reason])
            yield shed

        yield GaugeMetricFamily("ecd_clients", "Connected client sessions",
                                value=client_sessions(store, d.peers, d.lower_tier))
        if d.peers is not None:
            yield from peer_metrics(d.peers)
        yield from d.lower_tier.metric_families()
        yield from connection_metrics(d)
        yield GaugeMetricFamily("ecd_waiters", "Requests parked waiting for a key", value=waiters)
        yield CounterMetricFamily("ecd_ring_events", "Events written to the event ring",
                                  value=d.ring.events_written)
        yield CounterMetricFamily("ecd_ring_reader_overruns", "Times a client's ring reader was lapped "
                                  "(reported by clients)", value=d.counters.ring_overruns)
        if d.curve is not None:
            yield CounterMetricFamily("ecd_auth_rejected", "CURVE handshakes refused (unknown client key)",
                                      value=d.curve.rejected)
        integrity = CounterMetricFamily("ecd_integrity_failures", "Bytes that did not match their checksum: "
                                        "reads reported by verifying clients, inline puts seen by the daemon",
                                        labels=["where"])
        for where, n in sorted(d.counters.integrity_failures.items()):
            integrity.add_metric([where], n)
        for where, n in d.lower_tier.integrity_failures().items():  # the lower tier's records found corrupt
            integrity.add_metric([where], n)
        yield integrity
        yield GaugeMetricFamily("ecd_start_time_seconds", "Daemon start, seconds since the Unix epoch",
                                value=d.start_wall_time)
        yield from restart_metrics(d.restart())
        yield from events_metrics(d.events())
        info = InfoMetricFamily("ecd_build", "ecd build information")
        info.add_metric([], {"version": __version__, "python": sys.version.split()[0], "node": d.node})
        yield info


def restart_metrics(restart: "RestartStats") -> Iterator:
    """[restart]: what this start adopted of the previous run's pool, and the journal that lets
    the next one adopt this run's."""
    yield GaugeMetricFamily("ecd_restart_adopted_entries", "Entries adopted from the previous run's pool at "
                            "start (0: a cold start)", value=restart.entries)
    yield GaugeMetricFamily("ecd_restart_adopted_bytes", "Bytes of the entries adopted at start", value=restart.bytes)
    yield GaugeMetricFamily("ecd_restart_adopt_seconds", "Time adopting the previous run's pool took",
                            value=restart.seconds)
    yield GaugeMetricFamily("ecd_journal_records", "Records in the restart journal (entries and writes in progress)",
                            value=restart.journal_records)
    yield CounterMetricFamily("ecd_journal_full", "Entries not journaled for want of journal space: "
                              "not adopted after a restart ([restart] journal_size)", value=restart.journal_full)


def events_metrics(events: "EventsStats | None") -> Iterator:
    """[events]: the KV events published (none while it is off)."""
    if events is None:
        return
    for name, value, what in (
            ("batches", events.batches, "KV event batches published (both topics)"),
            ("events", events.events, "KV events published in them"),
            ("dropped", events.dropped, "KV events dropped because the publisher fell behind (a resync follows)"),
            ("resyncs", events.resyncs, "AllBlocksCleared-and-snapshot sequences published (the start's included)"),
            ("replays", events.replays, "Replay requests served"),
            ("bad_replay_requests", events.bad_replay_requests, "Malformed replay requests ignored"),
            ("curve_rejected", events.rejected, "CURVE handshakes refused on the events sockets")):
        yield CounterMetricFamily(f"ecd_events_{name}", what, value=value)
    yield GaugeMetricFamily("ecd_events_waiting", "KV events not yet published", value=events.waiting)


def peer_metrics(cluster) -> Iterator:
    """The peer plane ([cluster]): bytes and entries fetched and served by peer, fetch latency,
    peers up, transfer leases, failures by reason."""
    stats = cluster.stats
    for name, table, what in (("ecd_peer_fetched", stats.fetched_by, "pulled from"),
                              ("ecd_peer_served", stats.served_by, "sent to")):
        entries = CounterMetricFamily(f"{name}_entries", f"Entries {what} a peer daemon, by its node name",
                                      labels=["peer"])
        nbytes = CounterMetricFamily(f"{name}_bytes", f"Bytes of entries {what} a peer daemon, by its node name",
                                     labels=["peer"])
        for peer, (n, b) in sorted(table.items()):
            entries.add_metric([peer], n)
            nbytes.add_metric([peer], b)
        yield entries
        yield nbytes
    latency = HistogramMetricFamily("ecd_fetch_duration_seconds", "Time a fetch that pulled from peers took, "
                                    "lookup to commit")
    latency.add_metric([], stats.fetch_latency.buckets(), stats.fetch_latency.sum)
    yield latency
    up = GaugeMetricFamily("ecd_peer_up", "1 when the peer answered its last ping (or request), else 0",
                           labels=["peer", "endpoint"])
    for state in cluster.peer_states():
        up.add_metric([state.node or state.endpoint, state.endpoint], 1 if state.state == "up" else 0)
    yield up
    yield GaugeMetricFamily("ecd_transfer_leases", "Entries held leased for peers' fetches",
                            value=cluster.transfer_leases())
    from ..peer.cluster import FAILURE_REASONS
    yield counter_by("ecd_transfer_failures", "Fetches that failed, by reason; serve_*: the owner's side (sends "
                     "to peers that failed, serve_backlog: peers cut off for unread replies, serve_lease_limit "
                     "and serve_lookup_invalid: lookups refused)", "reason",
                     ((reason, stats.failures.get(reason, 0))
                      for reason in sorted(set(FAILURE_REASONS) | set(stats.failures))))
    directory = cluster.directory_stats()
    if directory is not None:
        yield from directory_metrics(directory)


def directory_metrics(d) -> Iterator:
    """The fleet directory ([cluster] directory)."""
    c = d.counts
    yield GaugeMetricFamily("ecd_directory_up", "1 when the directory's last command answered", value=int(d.up))
    yield CounterMetricFamily("ecd_directory_commands", "Commands sent to the directory", value=c.get("commands", 0))
    yield CounterMetricFamily("ecd_directory_errors", "Directory commands that failed or timed out",
                              value=c.get("errors", 0))
    yield GaugeMetricFamily("ecd_directory_peers", "Live nodes the directory listed last, this one included",
                            value=len(d.nodes))
    yield CounterMetricFamily("ecd_directory_lookups", "Directory lookups (fetches with no peer)",
                              value=c.get("lookups", 0))
    lookups = CounterMetricFamily("ecd_directory_lookup_keys", "Keys looked up in the directory, by whether it "
                                  "named a live holder", labels=["found"])
    lookups.add_metric(["yes"], c.get("found", 0))
    lookups.add_metric(["no"], c.get("unknown", 0))
    yield lookups


def make_registry(source: "MetricsSource") -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DaemonCollector(source))
    return registry


def bind_listener(host: str, port: int) -> socket.socket:
    """Bind now (start-up errors are reported before READY); serve later on the loop."""
    sock = bind_tcp_listener(host, port, 64)
    sock.setblocking(False)
    return sock


def connection_metrics(d: "MetricsSource"):
    """Control connections and what the daemon refused or closed to keep within its limits."""
    yield GaugeMetricFamily("ecd_connections", "Open control connections (with or without a session)",
                            value=d.connections.open)
    yield GaugeMetricFamily("ecd_connections_max", "limits.max_connections in force (lowered when the "
                            "open-file limit cannot hold the configured value)", value=d.max_connections())
    yield counter_by("ecd_connections_closed", "Control connections the daemon closed, by reason: over_capacity "
                     "(past limits.max_connections), client_backlog (its unread replies passed "
                     "limits.client_queue_bytes)", "reason",
                     ((reason, d.connections.closed.get(reason, 0)) for reason in ("over_capacity", "client_backlog")))
    refused = CounterMetricFamily("ecd_sessions_refused", "Hellos refused by a session limit (max_clients, "
                                  "max_clients_per_pid: LIMIT) or because control.allowed_uids / allowed_gids "
                                  "do not admit the client's uid (allowed_uids: NOT_ALLOWED)", labels=["limit"])
    for limit in ("max_clients", "max_clients_per_pid", "allowed_uids"):
        refused.add_metric([limit], d.sessions.refused.get(limit, 0))
    yield refused
    watched = GaugeMetricFamily("ecd_sessions", "Client sessions by how the daemon learns their client is gone: "
                                "pidfd (the moment its process exits, in any pid namespace), heartbeat (after "
                                "leases.session_ttl of silence: tcp clients, or no pidfd on this kernel)",
                                labels=["watch"])
    for mode, count in d.sessions.watch_counts().items():
        watched.add_metric([mode], count)
    yield watched
    if d.fd_server is not None:  # backing = "memfd"
        handouts = CounterMetricFamily("ecd_pool_fd_handouts", "Connections to the fd socket, by outcome: sent "
                                       "(the pool's descriptors), refused (by admission), unread_limit (its "
                                       "process or uid left too many handouts unread), failed (the send "
                                       "failed: see docs/SECURITY.md)", labels=["outcome"])
        for outcome, count in d.fd_server.counts.items():
            handouts.add_metric([outcome], count)
        yield handouts
        yield GaugeMetricFamily("ecd_pool_fd_handouts_unread", "Handouts sent on the fd socket whose client has "
                                "not read them yet (their descriptors are in flight)", value=d.fd_server.unread)


class MetricsServer:
    """GET /metrics and GET /healthz over HTTP/1.1 (one request per connection).

    Anyone on the host can connect, so open connections are capped: every one holds a descriptor
    of the daemon's, and a daemon at its fd limit is aborted by libzmq when the next engine
    connects to the control socket. At the cap a new connection pushes out the oldest one still
    waiting for its request (idle connections held open by a slowloris go first; a scrape sends
    its request at once and is answered in milliseconds); when every open one is mid-response,
    the new one is refused instead.
    """

    MAX_HEADER_BYTES = 8192
    READ_TIMEOUT_S = 2.0  # for the request head: Prometheus sends it as soon as it connects
    WRITE_TIMEOUT_S = 5.0  # for the response to drain: a peer that stops reading is cut off

    def __init__(self, listener: socket.socket, registry: CollectorRegistry,
                 health: Callable[[], str], *, max_connections: int = 64) -> None:
        self.listener = listener
        self.registry = registry
        self.health = health  # "serving" -> 200, anything else -> 503
        self.max_connections = max_connections
        self.shed = {reason: 0 for reason in SHED_REASONS}
        self._waiting: dict[asyncio.StreamWriter, None] = {}  # waiting for the request head, oldest first
        self._responding = 0
        self._server: asyncio.AbstractServer | None = None

    @property
    def port(self) -> int:
        return self.listener.getsockname()[1]

    @property
    def open_connections(self) -> int:
        return len(self._waiting) + self._responding

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, sock=self.listener,
                                                  limit=self.MAX_HEADER_BYTES)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def _make_room(self) -> bool:
        """Whether a new connection may stay: at the cap the oldest waiting one is closed for it."""
        if self.open_connections < self.max_connections:
            return True
        if not self._waiting:
            self.shed["refused"] += 1
            return False
        oldest = next(iter(self._waiting))
        del self._waiting[oldest]
        # abort, not close: the descriptor is freed now, and its handler's read ends with EOF
        oldest.transport.abort()
        self.shed["oldest_closed"] += 1
        return True

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._make_room():
            writer.transport.abort()
            return
        self._waiting[writer] = None
        method = "GET"
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.READ_TIMEOUT_S)
            parts = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            if len(parts) != 3 or not parts[2].startswith("HTTP/") or not parts[1].startswith("/"):
                raise ValueError("not an HTTP request line")
            method, path = parts[0], parts[1].split("?", 1)[0]
            status, ctype, body = self._respond(method, path)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ConnectionError, ValueError):
            status, ctype, body = "400 Bad Request", "text/plain", b"bad request\n"
        finally:
            self._waiting.pop(writer, None)
        if writer.transport.is_closing():
            return  # shed for a newer connection, or reset by the peer: no one to answer
        self._responding += 1
        try:
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                         f"Connection: close\r\n\r\n".encode() + (body if method != "HEAD" else b""))
            writer.close()  # after the response is flushed
            await asyncio.wait_for(writer.wait_closed(), self.WRITE_TIMEOUT_S)
        except (asyncio.TimeoutError, OSError):
            writer.transport.abort()
        finally:
            self._responding -= 1

    def _respond(self, method: str, path: str) -> tuple[str, str, bytes]:
        if path not in ("/metrics", "/healthz"):
            return "404 Not Found", "text/plain", b"not found: only /metrics and /healthz are served\n"
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", "text/plain", b"only GET\n"
        if path == "/healthz":
            state = self.health()
            return ("200 OK" if state == "serving" else "503 Service Unavailable", "text/plain",
                    b"ok\n" if state == "serving" else f"{state}\n".encode())
        return "200 OK", CONTENT_TYPE_LATEST, generate_latest(self.registry)
