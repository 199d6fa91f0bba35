"""What the request handlers (handlers.py) read of the daemon, and nothing else: server.Daemon
builds a HandlerContext once it serves (the store and the sessions exist) and hands it over, so
the handlers never see the daemon's lifecycle, sockets or signals.

What changes at runtime is read through a callable (the config SIGHUP replaces); the rest is
fixed for the daemon's run. The daemon's parts are typed by TYPE_CHECKING imports only: the peer
plane and the disk tier are imported by no control module at import time (tests/unit/test_layout.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from ...config import Config
    from ...memory.host import ShmFile
    from ...memory.ring import RingWriter
    from ...protocol import ArenaInfo, EventsStats, RestartStats
    from ..ops.security import CurveAuth
    from ..peer.cluster import Cluster
    from ..registry.store import Store
    from ..tiers.base import LowerTier
    from ..writes.areas import SubmissionAreas
    from .sessions import Sessions


@dataclass(frozen=True)
class HandlerContext:
    node: str  # this daemon's node name (Welcome, Stats)
    epoch: int  # this run's epoch (Welcome, Pong, Stats)
    started: float  # time.monotonic() at start (Stats.uptime_s)
    config: Callable[[], "Config"]  # the config in force: SIGHUP replaces it
    store: "Store"
    sessions: "Sessions"
    segments: Sequence["ShmFile"]  # the host pool's segments: Welcome lists them, inline puts are copied in
    ring_file: "ShmFile"  # the event ring's file (Welcome)
    ring: "RingWriter"  # its writer (Stats counts the events written)
    arenas: list["ArenaInfo"]  # Welcome.arenas: the CUDA arenas, numbered after the host segments
    fd_socket: str  # Welcome.fd_socket: where a memfd pool's descriptors are handed out ("": named files)
    lower_tier: "LowerTier"  # the tier below the host pool: the disk tier ([pool.disk]) or the null tier
    peers: "Cluster | None"  # the peer plane ([cluster] listen): Fetch goes to it; None without one
    curve: "CurveAuth | None"  # the control socket's CURVE authenticator (Stats counts its refusals)
    restart: Callable[[], "RestartStats"]  # how this start went: adopted or cold (Stats.restart)
    events: Callable[[], "EventsStats | None"] = lambda: None  # [events] (Stats.events); None: off
    submissions: "SubmissionAreas | None" = None  # puts without a message (Welcome, LeaseSpace); None: off
    tenant_rings: Mapping[str, "ShmFile"] = field(default_factory=dict)  # a sized tenant's own ring's file, by name
