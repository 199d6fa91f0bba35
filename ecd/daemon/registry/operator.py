"""Operator requests on the registry: list keys (paged by the handler), evict keys, a namespace
or everything (forced: also what is leased or pinned), and ask which generations are still held.
A part the Store owns (store.operator); keys the lower tier holds are listed and evicted too."""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Any

from ...memory.ring import EventKind, split_namespace
from .entries import Entry

if TYPE_CHECKING:  # pragma: no cover
    from .state import RecordSet

EVICT_ECHO_MAX = 1000  # keys an Evicted reply lists as refused or missing, at most


def _of(tenant: str | None, stored: str) -> bool:
    """Whether a stored namespace is `tenant`'s (None: any is)."""
    return tenant is None or split_namespace(stored)[0] == tenant


class OperatorRequests:
    def __init__(self, records: "RecordSet") -> None:
        self.r = records

    def list_keys(self, ns: str, limit: int, after: tuple[str, str] | None = None,
                  tenant: str | None = None) -> tuple[int, list[Any]]:
        """(how many keys match, the first `limit` of them by namespace and key, after `after`
        when given): READY entries, and the lower tier's records (disk.DiskRecord) of keys with none.
        `ns` "": every namespace of `tenant` (None: of every tenant)."""
        index = self.r.index
        matching: list[Any] = [e for e in index.values() if e.ns == ns or not ns and _of(tenant, e.ns)]
        matching += [r for r in self.r.lower_tier.listing(ns or None) if (r.ns, r.key) not in index
                     and (ns or _of(tenant, r.ns))]
        if after is not None:
            later = [e for e in matching if (e.ns, e.key) > after]
            return len(matching), heapq.nsmallest(limit, later, key=lambda e: (e.ns, e.key))
        return len(matching), heapq.nsmallest(limit, matching, key=lambda e: (e.ns, e.key))

    def evict(self, ns: str, keys: list[str], whole_namespace: bool, everything: bool,
              force: bool, tenant: str | None = None) -> tuple[int, list[str], list[str], list[int]]:
        """(evicted, refused because leased/pinned, missing, generations still draining readers);
        `everything`: every namespace of `tenant` (None: of every tenant)."""
        r = self.r
        index, lower = r.index, r.lower_tier
        if everything or whole_namespace:
            targets = [e for e in index.values()
                       if e.ns == ns or everything and _of(tenant, e.ns)]
            missing: list[str] = []
        else:
            r.check_batch(len(keys))
            # a key named twice is evicted once (a second removal of the same entry would fail)
            targets = list({k: index[(ns, k)] for k in keys if (ns, k) in index}.values())
            # capped like `refused`: the request's own keys echoed back could make a huge reply
            missing = [k for k in keys if (ns, k) not in index][:EVICT_ECHO_MAX]
        evicted = 0
        refused: list[str] = []
        draining: list[int] = []
        slotted = r.slot_holds.kept() if targets else frozenset()  # views and pins held by slots: like leases, pins
        for entry in targets:
            read = entry.readers or entry.generation in slotted
            if (read or entry.pins) and not force:
                if len(refused) < EVICT_ECHO_MAX:
                    refused.append(entry.key if not everything else f"{entry.ns}/{entry.key}")
                continue
            if read:
                self._revoke_unwatched_leases(entry)
            r.remove(entry)
            evicted += 1
            if entry.generation in r.by_generation:  # retired: a watched reader's lease or slot still reads it
                draining.append(entry.generation)
        # keys only the lower tier holds go too (their records and files)
        if everything or whole_namespace:
            below = [(record.ns, record.key) for record in lower.listing(None if everything else ns)
                     if not everything or _of(tenant, record.ns)]
        else:
            below = [(ns, k) for k in dict.fromkeys(keys) if (ns, k) not in index and lower.holds(ns, k)]
            missing = [k for k in missing if not lower.holds(ns, k)]
        for record_ns, key in below:
            if (record_ns, key) not in index:
                lower.drop(record_ns, key, EventKind.EVICTED)
                evicted += 1
        return evicted, refused, missing, draining

    def _revoke_unwatched_leases(self, entry: Entry) -> None:
        """A forced eviction takes back the read leases of sessions the daemon cannot watch (tcp
        peers, processes whose identity the kernel could not vouch for): nothing tells the daemon
        such a holder is still alive, and its lease must not keep the bytes forever. A watched
        session's process is alive and may be reading: its lease drains normally."""
        for session in self.r.each_session():
            if not session.watched:
                count = session.leases.pop(entry.generation, 0)
                entry.readers -= count
                self.r.slot_holds.revoke(session, entry.generation)  # and its read slots (views) of it

    def held(self, generations: list[int]) -> list[bool]:
        """Whether each generation still holds its extent (an entry in any state, or a reservation)."""
        self.r.check_batch(len(generations))
        return [g in self.r.by_generation or g in self.r.reservations for g in generations]
