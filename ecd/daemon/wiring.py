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
from ..memory.entry_index import SlotArea, slot_area_at_end
from .restart.adopt import slot_tail_bytes, submission_bytes, tail_pools
from .tiers.host import HostTier
from .writes.areas import SubmissionAreas
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


def host_tier(d: "Daemon") -> HostTier:
    """The pools' allocators: each part's first segment less its tail (restart/adopt.py's
    pool_layout), sized tenants' segments apart, then the CUDA arenas; truncation checks for named files."""
    assert d.memory is not None
    tail, tails = slot_tail_bytes(d.config), set(tail_pools(d.memory.groups).values())
    return HostTier([seg.size - (tail if i in tails else 0) for i, seg in enumerate(d.pool.segments)],
                    [a.size for a in d.arenas] if d.arenas is not None else [],
                    segments=d.pool.segments if d.config.pool.host.backing == "named" else (), groups=d.memory.groups)


def slot_areas(d: "Daemon") -> dict[str, tuple[int, SlotArea]]:
    """Each part's read slots, by tenant (as tail_pools): the last bytes of its tail's segment."""
    assert d.memory is not None
    leases, areas = d.config.leases, {}
    for tenant, pool in tail_pools(d.memory.groups).items():
        area = slot_area_at_end(d.pool.segments[pool], leases.slot_sessions, leases.read_slots)
        if area is not None:
            areas[tenant] = (pool, area)
    return areas


def submission_areas(d: "Daemon") -> SubmissionAreas | None:
    """Each part's submission area, at the start of its tail (None when they have no bytes:
    restart.adopt.submission_bytes), one keeper of their leases, and their doorbells (the fd
    server's eventfds) watched."""
    leases, store = d.config.leases, d.store
    assert store is not None and d.loop is not None and d.memory is not None
    if not submission_bytes(d.config) or d.fd_server is None or d.fd_server.doorbell < 0:
        return None
    leasing, tail = Leasing(store, int(leases.put_slab)), slot_tail_bytes(d.config)
    areas = SubmissionAreas({
        tenant: SubmissionArea(d.pool.segments, d.pool.segments[pool].size - tail, leases.slot_sessions,
                               leases.submit_records, store, leasing, d.epoch, float(leases.write_ttl),
                               d.fd_server.doorbells[tenant], pool)
        for tenant, pool in tail_pools(d.memory.groups).items()})
    store.session_closers.append(areas.close)
    areas.start(d.loop)
    return areas
