"""The loop's side of [events]: a HoldingsListener (daemon/holdings.py) that only appends to a
bounded backlog and returns. Events wait per topic (KV entries and those without meta on `topic`,
EncoderMeta entries on `encoder_topic`; a tenant's entries on its own pair, "@TENANT/" and those:
publisher.py) until `batch_events` of them or `batch_interval` has
passed since the last batch, then go to the publisher thread as one batch (a change after a quiet
interval goes at once, with whatever the same request changed).

Never blocking a put has a price, paid here: when the events waiting (here and not yet taken by
the thread) pass `queue_events`, they are dropped and counted, and the feed RESYNCS: once the
thread has caught up it publishes AllBlocksCleared on each topic and then a snapshot of
everything held (BlockStored per host entry and per whole disk record), `batch_events` entries a
turn of the loop, each looked up as it is at that moment, so events that happen meanwhile stay
in order with it. A start is a resync too (`cleared()`: the daemon calls it once it serves):
AllBlocksCleared, then what an adopting restart adopted and the disk tier re-indexed.
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from ...memory.ring import split_namespace
from ...protocol import EncoderMeta
from ..registry.entries import State
from .publisher import CLEARED, Publisher

if TYPE_CHECKING:  # pragma: no cover
    from ...events_config import EventsSection
    from ..holdings import Medium
    from ..registry.store import Store

log = logging.getLogger("ecd.events")


class EventsFeed:
    def __init__(self, config: "EventsSection", publisher: Publisher, store: "Store",
                 loop: asyncio.AbstractEventLoop) -> None:
        self.config, self.publisher, self.store, self.loop = config, publisher, store, loop
        self.topics_of = publisher.topics_of  # (kv, ec) topics by tenant
        self.tenant_topics = len(self.topics_of) > 1
        self.pending: dict[bytes, list[Any]] = {topic: [] for topic in publisher.topics}
        self.put_events = 0  # handed to the publisher (it counts what it took: the difference waits)
        self.dropped = 0
        self.resyncs = 0
        self.dropping = False  # overflowed: events are dropped until the resync starts
        self.snapshot: list[Any] | None = None  # a resync's entries and records still to publish
        self.timer: asyncio.TimerHandle | None = None
        self.last_flush = float("-inf")  # loop time of the last timed flush

    # ---- HoldingsListener ---------------------------------------------------------------

    def stored(self, ns: str, key: str, medium: "Medium", meta: Any) -> None:
        self._add((True, key, medium, meta), meta, ns)  # Medium is a str enum: msgspec encodes its value

    def removed(self, ns: str, key: str, medium: "Medium", meta: Any) -> None:
        self._add((False, key, medium, meta), meta, ns)

    def cleared(self) -> None:
        """Start (or a resync): what subscribers knew of this node is void."""
        self._drop_pending()
        self._resync()

    # ---- batching -----------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return sum(map(len, self.pending.values())) + self.put_events - self.publisher.taken

    def _drop_pending(self) -> int:
        """Forget the events not handed on yet: how many."""
        lost = sum(map(len, self.pending.values()))
        self.pending = {topic: [] for topic in self.pending}
        return lost

    def _add(self, event: tuple[Any, ...], meta: Any, ns: str) -> None:
        if self.dropping:
            self.dropped += 1
            return
        tenant = split_namespace(ns)[0] if self.tenant_topics else ""  # (no tenants: a NUL is just a character)
        topics = self.topics_of.get(tenant)
        if topics is None:
            return  # a tenant no longer configured (adopted entries): on no one's topics
        topic = topics[1] if type(meta) is EncoderMeta else topics[0]
        pending = self.pending[topic]
        pending.append(event)
        if len(pending) >= self.config.batch_events:
            if self.waiting > self.config.queue_events:
                self._overflow()
                return
            self._flush(topic)
        elif self.timer is None:
            # at once when the last batch went out an interval ago or more (a lone put's event does
            # not wait; the events of one request still share a batch: the callback runs after
            # it), else when the interval since it ends
            delay = self.last_flush + float(self.config.batch_interval) - self.loop.time()
            self.timer = self.loop.call_later(max(0.0, delay), self._tick)

    def _flush(self, topic: bytes) -> None:
        events = self.pending[topic]
        if events:
            self.pending[topic] = []
            self.put_events += len(events)
            self.publisher.put(topic, events)

    def _flush_all(self) -> None:
        for topic in self.pending:
            self._flush(topic)

    def _tick(self) -> None:
        self.timer = None
        if self.dropping:
            if self.waiting > self.config.queue_events // 2:
                self._arm()  # the thread is still behind: wait for it
                return
            self._resync()
            return
        if self.waiting > self.config.queue_events:
            self._overflow()
            return
        self.last_flush = self.loop.time()
        self._flush_all()
        if self.snapshot is not None:
            self._snapshot_chunk()

    def _arm(self) -> None:
        if self.timer is None:
            self.timer = self.loop.call_later(float(self.config.batch_interval), self._tick)

    # ---- overflow and resync ------------------------------------------------------------

    def _overflow(self) -> None:
        waiting, lost = self.waiting, self._drop_pending()
        self.dropped += lost
        if not self.dropping:
            log.warning("events: %d event(s) waiting for the publisher (events.queue_events = %d): dropped %d; "
                        "subscribers get AllBlocksCleared and a snapshot once it catches up",
                        waiting, self.config.queue_events, lost)
        self.dropping = True
        self.snapshot = None
        self._arm()

    def _resync(self) -> None:
        self.dropping = False
        self.resyncs += 1
        for topic in self.pending:
            self.put_events += 1
            self.publisher.put(topic, [CLEARED])
        store = self.store
        held: list[Any] = list(store.index.values())
        held += list(store.lower_tier.listing())
        self.snapshot = held
        self._arm()

    def _snapshot_chunk(self) -> None:
        """Publish the next `batch_events` of the snapshot, each as it is now."""
        assert self.snapshot is not None
        chunk = self.snapshot[-self.config.batch_events:]
        del self.snapshot[-self.config.batch_events:]
        store, announcer = self.store, self.store.announcer
        for held in chunk:
            if hasattr(held, "state"):  # a host (or CUDA) entry
                entry = store.index.get((held.ns, held.key))
                if entry is held and entry.state is State.READY:
                    self._add((True, entry.key, announcer.medium_of(entry), entry.meta), entry.meta, entry.ns)
            elif held.ready and not held.dropped:  # a disk record
                self._add((True, held.key, "STORAGE", held.meta), held.meta, held.ns)
            if self.dropping:
                return
        if not self.snapshot:
            self.snapshot = None
        self._flush_all()
        if self.snapshot is not None and self.timer is None:
            # the next chunk at once while the thread keeps up, else after it caught up a little
            delay = 0.0 if self.waiting < self.config.queue_events // 2 else float(self.config.batch_interval)
            self.timer = self.loop.call_later(delay, self._tick)

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
