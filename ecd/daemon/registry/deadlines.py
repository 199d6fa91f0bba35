"""Pins and deadlines: a pin from exists(pin_s) keeps an entry from eviction until its deadline
and follows the key across replacement; an uncommitted write is aborted at its write TTL. Both
kinds of deadline live on one heap, swept by expire(). A part the Store owns (store.deadlines).

Pins have a budget (issue 40, attack 5: one client re-pinning every key of every namespace made
other namespaces' puts fail, a guaranteed share's included). The bytes of pinned entries may fill
at most `[limits] pinned_share` of each pool (each part of the host pool: a sized tenant's own, each CUDA arena), and in the host pool
never what the namespaces' guaranteed shares still lack; a pin past it is not taken (the lookup
answers that key as not found: nothing promises it stays loadable). An entry counts once however
many sessions pin it."""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, cast

from ...memory.allocator import align_up
from .entries import Entry, Session, State

if TYPE_CHECKING:  # pragma: no cover
    from .state import RecordSet


class Deadlines:
    def __init__(self, records: "RecordSet") -> None:
        self.r = records
        self._heap: list[tuple[float, int, int]] = []  # (when, generation, session id or 0)
        self._compact_at = 4096  # heap size at which stale deadlines are swept out
        self._capacity: dict[int, int] = {}  # bytes of each pool group (budget)
        # bytes of pinned entries per pool group: a part of the host pool (-1 - its first segment: -1 the
        # default tenant's, a sized tenant's own apart: another's pins never take its budget), or an arena
        self.pinned: dict[int, int] = {-1: 0}

    def __len__(self) -> int:
        """Deadlines on the heap, live or not yet swept."""
        return len(self._heap)

    def pin(self, session: Session, entry: Entry, deadline: float) -> bool:
        """Keep `entry` from eviction until `deadline` (a later deadline extends the pin). False
        when the pin budget has no room for it (nothing changes then)."""
        previous = session.pins.get(entry.generation)
        if previous is None:
            if not entry.pins:
                group, size = self.group(entry.pool), align_up(max(entry.nbytes, 1))
                if self.pinned.get(group, 0) + size > self.budget(group):
                    self.r.counters["pins_refused"] += 1
                    return False
                self.pinned[group] = self.pinned.get(group, 0) + size
            entry.pins += 1
            self.r.placement.make_unevictable(entry)
        elif previous >= deadline:
            return True
        session.pins[entry.generation] = deadline
        self.push(deadline, entry.generation, session.id)
        return True

    def release(self, entry: Entry) -> None:
        """One pin of `entry` ends (its entry leaves the budget with its last pin)."""
        entry.pins -= 1
        if entry.pins == 0:
            self._unbudget(entry)

    def forget(self, entry: Entry) -> None:
        """`entry` is freed with pins on it (an operator's forced eviction): its bytes leave the
        budget; the sessions' pins of it lapse at their deadlines."""
        if entry.pins:
            entry.pins = 0
            self._unbudget(entry)

    def _unbudget(self, entry: Entry) -> None:
        self.pinned[self.group(entry.pool)] -= align_up(max(entry.nbytes, 1))

    def budget(self, group: int) -> int:
        """Bytes the pins of a pool group may hold."""
        r = self.r
        capacity = self._capacity.get(group)
        if capacity is None:  # pools never change size: summed once per group, not per pin
            pools = r.host.part(-1 - group) if group < 0 else (group,)
            capacity = self._capacity[group] = sum(r.host.allocators[p].capacity for p in pools)
        budget = int(capacity * r.limits.pinned_share)
        if group == -1:  # what namespaces' guaranteed shares still lack must stay evictable or free
            # (not tenants' sizes: those may add up to the whole pool, and would leave no pins at all)
            budget -= sum(max(0, share - r.guaranteed_ready.get(ns, 0)) for ns, share in r.guarantees.items()
                          if not r.placement.tenant_of_scope(ns))
        return budget

    def group(self, pool: int) -> int:
        host = self.r.host
        return pool if pool in host.arena_pools else -1 - host.part_of(pool)

    def push(self, deadline: float, generation: int, session_id: int) -> None:
        """Deadlines are deleted lazily (a commit or unpin leaves its tuple in the heap), so at
        thousands of puts per second the heap would hold a write TTL's worth of dead tuples.
        Sweeping them whenever the heap doubles keeps it proportional to the live ones, O(1)
        amortized per push."""
        heapq.heappush(self._heap, (deadline, generation, session_id))
        if len(self._heap) >= self._compact_at:
            self._heap = [d for d in self._heap if self._is_live(*d)]
            heapq.heapify(self._heap)
            self._compact_at = max(4096, 2 * len(self._heap))

    def _is_live(self, deadline: float, generation: int, session_id: int) -> bool:
        r = self.r
        if session_id == 0:  # a write deadline: the write (or reservation) has not been committed
            entry = r.by_generation.get(generation)
            if entry is None:
                reservation = r.reservations.get(generation)
                return reservation is not None and reservation.deadline == deadline
            return entry.state is State.WRITING and entry.write_deadline == deadline
        session = r.session(session_id)
        return session is not None and session.pins.get(generation) == deadline

    def move_pins(self, old: Entry, new: Entry) -> None:
        """A pin promises the key stays loadable: it moves to the generation that replaced it."""
        for session in self.r.each_session():
            deadline = session.pins.pop(old.generation, None)
            if deadline is not None:
                self.release(old)
                self.pin(session, new, deadline)  # a bigger value may find no room: the pin lapses

    def unpin(self, session: Session, ns: str, keys: list[str]) -> list[bool]:
        r = self.r
        r.check_batch(len(keys))
        result = []
        for key in keys:
            entry = r.index.get((ns, key))
            pinned = entry is not None and session.pins.pop(entry.generation, None) is not None
            if pinned:
                self.release(cast(Entry, entry))  # pinned: entry is not None
                r.after_unhold(cast(Entry, entry))
            result.append(pinned)
        return result

    def expire(self) -> None:
        """Abort writes past their TTL and drop pins past their deadline (called periodically)."""
        r = self.r
        now = r.clock()
        while self._heap and self._heap[0][0] <= now:
            deadline, generation, session_id = heapq.heappop(self._heap)
            entry = r.by_generation.get(generation)
            if session_id == 0:  # a write deadline
                reservation = r.reservations.get(generation)
                if reservation is not None and reservation.deadline == deadline:
                    r.reserving.expired(reservation)
                elif entry is not None and entry.state is State.WRITING and entry.write_deadline == deadline:
                    entry.owner.writes.pop(generation, None)
                    r.free(entry)
                    r.counters["expired_writes"] += 1
                    r.counters["reclaimed_write_ttl"] += 1
                continue
            session = r.session(session_id)
            if session is not None and session.pins.get(generation) == deadline:
                del session.pins[generation]
                r.counters["reclaimed_pin_expired"] += 1
                if entry is not None:
                    self.release(entry)
                    r.after_unhold(entry)
