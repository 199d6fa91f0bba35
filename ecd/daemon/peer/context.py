"""What the peer plane reads of its daemon once it serves, and nothing else: server.Daemon hands a
PeerContext to Cluster.start (the store and the event loop exist only then; what binds the peer
plane at start-up, the config and the node's identity, Cluster takes when it is made).

The config SIGHUP replaces is read through a callable; the rest is fixed for the daemon's run.
The daemon's parts are typed by TYPE_CHECKING imports only.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from ...config import Config
    from ...memory.host import ShmFile
    from ..holdings import Holdings
    from ..registry.store import Store


@dataclass(frozen=True)
class PeerContext:
    loop: asyncio.AbstractEventLoop  # the daemon's event loop: the peer plane's sockets and timers run on it
    store: "Store"  # fetched entries are committed into it; served entries are leased from it
    segments: Sequence["ShmFile"]  # the host pool's segments: fetched bytes land in them, served bytes leave them
    config: Callable[[], "Config"]  # the config in force (leases.write_ttl bounds a fetch)
    holdings: "Holdings | None" = None  # what this node holds, as it changes: the directory's key map follows it
