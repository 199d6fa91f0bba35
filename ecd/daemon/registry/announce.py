"""What the index gains and loses, told to whoever follows it: the event ring's entry (the local
clients' presence table) and the node's holdings feed (daemon/holdings.py: the KV events routers
read, the fleet directory). Store.commit and Store.unindex call it for every entry; the lower
tier calls it for its records (stored when a record is whole on disk, removed when it goes)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...memory.ring import TENANT_SEP, EventKind, RingWriter

if TYPE_CHECKING:  # pragma: no cover
    from ..holdings import Holdings
    from ..tiers.base import LowerTier
    from .entries import Entry


class Announcer:
    __slots__ = ("ring", "tenant_rings", "lower_tier", "holdings", "host_pools", "_host", "_cuda", "_disk")

    def __init__(self, ring: RingWriter, lower_tier: "LowerTier", host_pools: tuple[int, ...]) -> None:
        # at run time, not import time: holdings.py sits above the registry in the daemon's layers
        from ..holdings import Holdings, Medium
        self.ring, self.lower_tier, self.host_pools = ring, lower_tier, frozenset(host_pools)
        # a sized tenant's own ring, by its scope (TENANT\0): its clients map it instead of `ring`
        self.tenant_rings: dict[str, RingWriter] = {}
        self.holdings: "Holdings" = Holdings()
        self._host, self._cuda, self._disk = Medium.HOST, Medium.CUDA, Medium.DISK

    def announce(self, kind: EventKind, entry: "Entry", keyhash: int | None = None) -> None:
        """The ring event of `entry` being published, evicted or deleted (`keyhash`: its key's, if
        known). While the lower tier holds the key (spilled, or promoted from it), its record keeps
        the key present: only the event is written, the presence table stays as it is."""
        keyhash = entry.keyhash if keyhash is None else keyhash
        ring = self.ring_of(entry.ns)
        if kind is EventKind.PUBLISHED:
            self.index(entry, keyhash)
        else:  # out of the entry index before the event, and both before the extent is freed
            ring.index.remove(entry.generation)
        if self.lower_tier.holds(entry.ns, entry.key):
            ring.append(kind, keyhash, entry.generation)
        elif kind is EventKind.PUBLISHED:
            ring.publish(keyhash, entry.generation)
        else:
            ring.unpublish(kind, keyhash, entry.generation)
        if self.holdings.listeners:
            medium = self._host if entry.pool in self.host_pools else self._cuda
            if kind is EventKind.PUBLISHED:
                self.holdings.stored(entry.ns, entry.key, medium, entry.meta)
            else:
                self.holdings.removed(entry.ns, entry.key, medium, entry.meta)

    def index(self, entry: "Entry", keyhash: int) -> None:
        """A READY entry into the ring's entry index: a host pool's, or a CUDA arena's (a client
        on that device reads it through its CUDA plane, under a read slot)."""
        self.ring_of(entry.ns).index.put(keyhash, entry.ns, entry.key, entry.generation, entry.pool, entry.offset,
                            entry.nbytes, entry.dtype, entry.shape, entry.checksum)

    def seq(self) -> int:
        """Grows with every event appended to any ring."""
        return self.ring.seq + sum(ring.seq for ring in self.tenant_rings.values()) if self.tenant_rings else self.ring.seq

    def plan_begin(self) -> None:
        """An eviction plan is under way (every ring: its readers' pin slots look at its plan word)."""
        self.ring.plan_begin()
        for ring in self.tenant_rings.values():
            ring.plan_begin()

    def plan_end(self) -> None:
        self.ring.plan_end()
        for ring in self.tenant_rings.values():
            ring.plan_end()

    def ring_of(self, ns: str) -> RingWriter:
        """The ring that announces `ns`'s entries: its sized tenant's own, else the node's."""
        if self.tenant_rings and TENANT_SEP in ns:
            return self.tenant_rings.get(ns[:ns.index(TENANT_SEP) + 1], self.ring)
        return self.ring

    def medium_of(self, entry: "Entry") -> Any:
        return self._host if entry.pool in self.host_pools else self._cuda

    def disk_stored(self, ns: str, key: str, meta: Any) -> None:
        """A lower-tier record is whole on disk (spilled, persisted, re-indexed at start)."""
        if self.holdings.listeners:
            self.holdings.stored(ns, key, self._disk, meta)

    def disk_removed(self, ns: str, key: str, meta: Any) -> None:
        """A whole lower-tier record goes (deleted, replaced, evicted from disk, found bad)."""
        if self.holdings.listeners:
            self.holdings.removed(ns, key, self._disk, meta)
