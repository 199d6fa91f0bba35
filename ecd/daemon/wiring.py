"""How server.Daemon wires its parts: the narrow contexts they read instead of the daemon. Each
consumer declares its own (the handlers control/context.HandlerContext, the peer plane
peer/context.PeerContext, metrics and reload ops/context.MetricsSource and ReloadTarget); this
module fills them from the daemon, in one place, once the daemon serves (its store, sessions and
event loop exist only then).

What changes while the daemon runs (the config after SIGHUP, limits.max_connections) is passed
as a callable reading the daemon's current value, never copied.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..protocol import ArenaInfo
from .control.context import HandlerContext
from .ops.context import MetricsSource, ReloadTarget
from .peer.context import PeerContext
from .restart.adopt import submission_bytes
from .writes.consumer import SubmissionArea
from .writes.leases import Leasing

if TYPE_CHECKING:  # pragma: no cover
    from .server import Daemon


def arena_infos(d: "Daemon") -> list[ArenaInfo]:
    """Welcome.arenas: pool indices follow the host segments."""
    if d.arenas is None:
        return []
    first = len(d.pool.segments)
    return [ArenaInfo(first + i, a.uuid, a.size, a.handle, a.export) for i, a in enumerate(d.arenas)]


def arena_fds(d: "Daemon") -> list[tuple[int, int, int]]:
    """(pool index, size, descriptor) of each arena exported as a file descriptor (the fd socket's)."""
    return [(info.index, info.size, arena.fd) for info, arena in zip(arena_infos(d), d.arenas or [])
            if arena.export == "fd"]


def pool_labels(d: "Daemon") -> list[str]:
    """The `pool` label of each pool's metrics: host<n> for segments, cuda<ordinal> for arenas."""
    labels = [f"host{i}" for i in range(len(d.pool.segments) if d.pool is not None else 0)]
    if d.arenas is not None:
        labels += [a.label for a in d.arenas]
    return labels


def handler_context(d: "Daemon") -> HandlerContext:
    assert d.store is not None and d.sessions is not None and d.ring is not None and d.ring_file is not None
    assert d.memory is not None
    return HandlerContext(
        node=d.node, epoch=d.epoch, started=d.started, config=lambda: d.config, store=d.store,
        sessions=d.sessions, segments=d.pool.segments, ring_file=d.ring_file, ring=d.ring, arenas=arena_infos(d),
        fd_socket=d.fd_socket_name, lower_tier=d.lower_tier, peers=d.cluster, curve=d.curve,
        restart=d.memory.stats, events=d.events_stats, submissions=d.submissions,
        tenant_rings={name: ring_file for name, (ring_file, _) in d.memory.tenant_rings.items()})


def peer_context(d: "Daemon") -> PeerContext:
    assert d.loop is not None and d.store is not None
    return PeerContext(loop=d.loop, store=d.store, segments=d.pool.segments, config=lambda: d.config,
                       holdings=d.store.holdings)


def metrics_source(d: "Daemon") -> MetricsSource:
    """Its `http` is set once the endpoint exists (it is made with this source's registry)."""
    assert d.store is not None and d.sessions is not None and d.ring is not None and d.connections is not None
    assert d.memory is not None
    return MetricsSource(
        node=d.node, start_wall_time=d.start_wall_time, store=d.store, counters=d.counters, ring=d.ring,
        pool_labels=pool_labels(d), arenas=d.arenas, connections=d.connections,
        max_connections=lambda: d.max_connections, sessions=d.sessions, fd_server=d.fd_server, lower_tier=d.lower_tier,
        peers=d.cluster, curve=d.curve, restart=d.memory.stats, events=d.events_stats,
        submissions=lambda: d.submissions.totals() if d.submissions is not None else (0, 0, 0))


def reload_target(d: "Daemon") -> ReloadTarget:
    return ReloadTarget(config_path=d.config_path, config=lambda: d.config, install=d.install_config,
                        curve=d.curve, peers=d.cluster)


def submission_area(d: "Daemon", tail: int) -> SubmissionArea | None:
    """The submission area at the start of segment 0's `tail` (None when it has no bytes:
    restart.adopt.submission_bytes), its leases' keeper, and its doorbell (the fd server's eventfd) watched."""
    leases, store = d.config.leases, d.store
    assert store is not None and d.loop is not None
    if not submission_bytes(d.config) or d.fd_server is None or d.fd_server.doorbell < 0:
        return None
    segment = d.pool.segments[0]
    area = SubmissionArea(d.pool.segments, segment.size - tail, leases.slot_sessions, leases.submit_records, store,
                          Leasing(store, int(leases.put_slab)), d.epoch,
                          float(leases.write_ttl), d.fd_server.doorbell)
    store.session_closers.append(area.close)
    area.start(d.loop)
    return area
