"""What the operational parts read of the daemon, and nothing else: metrics.py a MetricsSource,
reload.py a ReloadTarget. server.Daemon builds them and hands them over, so neither imports the
lifecycle it serves (no import circle), and each says in one place what it depends on.

What changes at runtime is read through a callable (limits.max_connections after SIGHUP, the
config itself); the rest is fixed for the daemon's run. The daemon's parts are typed by
TYPE_CHECKING imports only: ops sits below control, the tiers and the peer plane
(tests/unit/test_layout.py), so none of them is imported here at import time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # pragma: no cover
    from ...protocol import EventsStats, RestartStats
    from ...config import Config
    from ...memory.cuda import CudaArenas
    from ...memory.ring import RingWriter
    from ..control.connections import Connections
    from ..control.fd_server import FdServer
    from ..control.sessions import Sessions
    from ..peer.cluster import Cluster
    from ..registry.store import Store
    from ..tiers.base import LowerTier
    from .metrics import MetricsServer, ServeCounters
    from .security import CurveAuth


@dataclass
class MetricsSource:
    """Everything /metrics exports, read at scrape time (metrics.DaemonCollector)."""
    node: str  # ecd_build's node label
    start_wall_time: float  # ecd_start_time_seconds
    store: "Store"  # entries, leases, pools, namespaces, evictions, lookups
    counters: "ServeCounters"  # the control loop's requests, errors, drops, client reports
    ring: "RingWriter"  # ecd_ring_events
    pool_labels: list[str]  # the `pool` label of each of the store's pools, in order
    arenas: "CudaArenas | None"  # [pool.cuda]: ecd_cuda_arena_info
    connections: "Connections"  # control connections, and those closed to keep within limits
    max_connections: Callable[[], int]  # limits.max_connections in force (SIGHUP, the fd limit)
    sessions: "Sessions"  # sessions by watch, hellos refused
    fd_server: "FdServer | None"  # backing = "memfd": the fd socket's handouts
    lower_tier: "LowerTier"  # the tier below the host pool (its metrics, its own sessions)
    peers: "Cluster | None"  # [cluster] listen: the peer plane's metrics
    curve: "CurveAuth | None"  # the control socket's CURVE handshakes refused
    restart: Callable[[], "RestartStats"]  # how this start went ([restart]): ecd_restart_*, ecd_journal_*
    events: Callable[[], "EventsStats | None"] = lambda: None  # [events]: ecd_events_*
    # puts without a message (daemon/writes): (leases held, bytes not yet carved, pages in use)
    submissions: Callable[[], tuple[int, int, int]] = lambda: (0, 0, 0)
    http: "MetricsServer | None" = None  # the endpoint serving these (made with them: set once it exists)


@dataclass(frozen=True)
class ReloadTarget:
    """What SIGHUP (reload.reload_config) reads and changes: it decides what of the new file
    applies, and `install` puts that config in force in the daemon."""
    config_path: str | None  # the file to re-read (None: started without one)
    config: Callable[[], "Config"]  # the config in force
    install: Callable[["Config"], None]  # make a config the one in force (the store's limits and
    # namespaces, the control socket's message size and connection limits follow it)
    curve: "CurveAuth | None"  # the control socket's CURVE authenticator: its allowed keys are re-read
    peers: "Cluster | None"  # the peer plane: its peers and peer keys are re-read
