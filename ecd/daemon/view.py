"""What the daemon's parts read of it: metrics, reload, the control loop and the request handlers
depend on this Protocol, not on server.Daemon, so no module imports the lifecycle it serves (no
import circles), and a peer plane or a disk tier can plug in beside them the same way."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # pragma: no cover
    import zmq

    from ..config import Config
    from ..memory.host import HostPool, ShmFile
    from ..memory.ring import RingWriter
    from ..protocol import ArenaInfo
    from .control.connections import Connections
    from .control.loop import ServeCounters
    from .ops.security import CurveAuth
    from .control.sessions import Sessions
    from .tiers.base import LowerTier
    from .registry.store import Store


class DaemonView(Protocol):
    node: str
    epoch: int
    started: float  # monotonic
    start_wall_time: float
    state: str  # starting -> serving -> draining
    config: "Config"
    config_path: str | None
    loop: asyncio.AbstractEventLoop | None
    sock: "zmq.Socket | None"
    pool: "HostPool | None"  # a MemfdPool with backing = "memfd"
    fd_server: Any  # fd_server.FdServer with backing = "memfd", else None
    fd_socket_name: str  # Welcome.fd_socket
    ring: "RingWriter | None"
    ring_file: "ShmFile | None"
    arenas: Any
    store: "Store | None"
    sessions: "Sessions | None"
    connections: "Connections | None"
    counters: "ServeCounters"
    curve: "CurveAuth | None"
    metrics_server: Any
    cluster: Any  # the peer plane (cluster.Cluster) or None
    disk: "LowerTier"  # below the host pool: the disk tier (tiers/disk.DiskTier), or a NullTier
    max_connections: int

    def arena_infos(self) -> list["ArenaInfo"]: ...
    def pool_labels(self) -> list[str]: ...
    def apply_connection_limits(self) -> None: ...
