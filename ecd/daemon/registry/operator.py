"""Operator requests on the registry: list keys (paged by the handler), evict keys, a namespace
or everything (forced: also what is leased or pinned), and ask which generations are still held.
Mixed into Store."""
from __future__ import annotations

import heapq
from typing import Any

from ...memory.ring import EventKind
from .entries import Entry
from .state import RegistryState

EVICT_ECHO_MAX = 1000  # keys an Evicted reply lists as refused or missing, at most


class OperatorRequests(RegistryState):
    def list_keys(self, ns: str, limit: int, after: tuple[str, str] | None = None) -> tuple[int, list[Any]]:
        """(how many keys match, the first `limit` of them by namespace and key, after `after`
        when given): READY entries, and disk-tier records (disk_tier.DiskRecord) of keys with none."""
        matching: list[Any] = [e for e in self.index.values() if not ns or e.ns == ns]
        if self.disk is not None:
            matching += [r for k, r in self.disk.records.items() if (not ns or k[0] == ns) and k not in self.index]
        if after is not None:
            later = [e for e in matching if (e.ns, e.key) > after]
            return len(matching), heapq.nsmallest(limit, later, key=lambda e: (e.ns, e.key))
        return len(matching), heapq.nsmallest(limit, matching, key=lambda e: (e.ns, e.key))


    def evict(self, ns: str, keys: list[str], whole_namespace: bool, everything: bool,
              force: bool) -> tuple[int, list[str], list[str], list[int]]:
        """(evicted, refused because leased/pinned, missing, generations still draining readers)."""
        if everything or whole_namespace:
            targets = [e for e in self.index.values() if everything or e.ns == ns]
            missing: list[str] = []
        else:
            self.check_batch(len(keys))
            # a key named twice is evicted once (a second removal of the same entry would fail)
            targets = list({k: self.index[(ns, k)] for k in keys if (ns, k) in self.index}.values())
            # capped like `refused`: the request's own keys echoed back could make a huge reply
            missing = [k for k in keys if (ns, k) not in self.index][:EVICT_ECHO_MAX]
        evicted = 0
        refused: list[str] = []
        draining: list[int] = []
        for entry in targets:
            if (entry.readers or entry.pins) and not force:
                if len(refused) < EVICT_ECHO_MAX:
                    refused.append(entry.key if not everything else f"{entry.ns}/{entry.key}")
                continue
            if entry.readers:
                self._revoke_unwatched_leases(entry)
            self._remove(entry)
            evicted += 1
            if entry.readers:
                draining.append(entry.generation)
        if self.disk is not None:  # keys only on the disk tier go too (their records and files)
            if everything or whole_namespace:
                on_disk = [k for k in self.disk.records if everything or k[0] == ns]
            else:
                on_disk = [(ns, k) for k in dict.fromkeys(keys) if (ns, k) not in self.index and self.disk.holds(ns, k)]
                missing = [k for k in missing if not self.disk.holds(ns, k)]
            for record_ns, key in on_disk:
                if (record_ns, key) not in self.index:
                    self.disk.drop(record_ns, key, EventKind.EVICTED)
                    evicted += 1
        return evicted, refused, missing, draining


    def _revoke_unwatched_leases(self, entry: Entry) -> None:
        """A forced eviction takes back the read leases of sessions the daemon cannot watch (tcp
        peers, processes whose identity the kernel could not vouch for): nothing tells the daemon
        such a holder is still alive, and its lease must not keep the bytes forever. A watched
        session's process is alive and may be reading: its lease drains normally."""
        for session in self._sessions.values():
            if not session.watched:
                count = session.leases.pop(entry.generation, 0)
                entry.readers -= count


    def held(self, generations: list[int]) -> list[bool]:
        self.check_batch(len(generations))
        """Whether each generation still holds its extent (an entry in any state, or a reservation)."""
        return [g in self.by_generation or g in self.reservations for g in generations]
