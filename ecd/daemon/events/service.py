"""`Events`: [events] tied to the daemon: opened (bound) at prepare, attached to the store once it
serves, its stats, SIGHUP and close. The parts: wire.py, publisher.py, feed.py (docs/events.md)."""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Iterable

import zmq

from ...config import DEFAULT_TENANT
from ...errors import ConfigError
from ...protocol import EventsStats
from .feed import EventsFeed
from .publisher import Publisher

if TYPE_CHECKING:  # pragma: no cover
    from ...events_config import EventsSection
    from ..registry.store import Store

__all__ = ["Events"]

log = logging.getLogger("ecd.daemon")


class Events:
    def __init__(self, config: "EventsSection", gid: int = -1, tenants: Iterable[str] = ()) -> None:
        """`tenants`: [tenants]' names (each has topics of its own; the default tenant's are the configured ones)."""
        from ..ops.security import CurveAuth
        self.config = config
        self.curve = (CurveAuth.from_files(config.curve_secret_key, config.curve_allowed_keys, "events")
                      if config.curve else None)
        self.publisher = Publisher(config, self.curve, gid, [t for t in tenants if t != DEFAULT_TENANT])
        self.feed: EventsFeed | None = None

    def open(self) -> None:
        """Bind the sockets and start the thread; ConfigError naming the key when a bind fails."""
        try:
            self.publisher.open()
        except zmq.ZMQError as exc:
            key = "replay" if self.publisher.pub is not None or self.publisher.endpoints else "publish"
            raise ConfigError(f"events.{key}: cannot bind {getattr(self.config, key)}: {exc}") from None
        self.publisher.start()
        open_tcp = [e for e in self.publisher.endpoints if e.startswith("tcp://")]
        if open_tcp and self.curve is None:  # the config admitted it only with insecure = true
            log.warning("events.insecure = true: %s publish(es) without authentication: every process that reaches "
                        "the port (any local user on loopback) reads the token ids and key names of what this node "
                        "holds", ", ".join(open_tcp))

    def attach(self, store: "Store", loop: asyncio.AbstractEventLoop) -> None:
        """Follow the store's holdings; the daemon calls store.holdings.cleared() once it serves."""
        self.feed = EventsFeed(self.config, self.publisher, store, loop)
        store.holdings.listen(self.feed)

    def reload(self) -> None:
        """SIGHUP: re-read the allowed subscriber keys."""
        if self.curve is not None:
            self.curve.reload()

    def stats(self) -> EventsStats:
        p, f = self.publisher, self.feed
        return EventsStats(endpoints=list(p.endpoints), batches=p.batches, events=p.events,
                           dropped=f.dropped if f else 0, resyncs=f.resyncs if f else 0, replays=p.replays,
                           bad_replay_requests=p.bad_requests, waiting=f.waiting if f else 0,
                           rejected=self.curve.rejected if self.curve is not None else 0)

    def close(self) -> None:
        if self.feed is not None:
            self.feed.close()
        self.publisher.close()
