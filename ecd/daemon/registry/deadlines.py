"""Pins and deadlines: a pin from exists(pin_s) keeps an entry from eviction until its deadline
and follows the key across replacement; an uncommitted write is aborted at its write TTL. Both
kinds of deadline live on one heap, swept by expire(). Mixed into Store."""
from __future__ import annotations

import heapq
from typing import cast

from .entries import Entry, Session, State
from .state import RegistryState


class Deadlines(RegistryState):
    def _pin(self, session: Session, entry: Entry, deadline: float) -> None:
        previous = session.pins.get(entry.generation)
        if previous is None:
            entry.pins += 1
            self._make_unevictable(entry)
        elif previous >= deadline:
            return
        session.pins[entry.generation] = deadline
        self._push_deadline(deadline, entry.generation, session.id)


    def _push_deadline(self, deadline: float, generation: int, session_id: int) -> None:
        """Deadlines are deleted lazily (a commit or unpin leaves its tuple in the heap), so at
        thousands of puts per second the heap would hold a write TTL's worth of dead tuples.
        Sweeping them whenever the heap doubles keeps it proportional to the live ones, O(1)
        amortized per push."""
        heapq.heappush(self._deadlines, (deadline, generation, session_id))
        if len(self._deadlines) >= self._compact_deadlines_at:
            self._deadlines = [d for d in self._deadlines if self._deadline_is_live(*d)]
            heapq.heapify(self._deadlines)
            self._compact_deadlines_at = max(4096, 2 * len(self._deadlines))


    def _deadline_is_live(self, deadline: float, generation: int, session_id: int) -> bool:
        if session_id == 0:  # a write deadline: the write (or reservation) has not been committed
            entry = self.by_generation.get(generation)
            if entry is None:
                reservation = self.reservations.get(generation)
                return reservation is not None and reservation.deadline == deadline
            return entry.state is State.WRITING and entry.write_deadline == deadline
        session = self._sessions.get(session_id)
        return session is not None and session.pins.get(generation) == deadline


    def _move_pins(self, old: Entry, new: Entry) -> None:
        """A pin promises the key stays loadable: it moves to the generation that replaced it."""
        for session in self._sessions.values():
            deadline = session.pins.pop(old.generation, None)
            if deadline is not None:
                old.pins -= 1
                self._pin(session, new, deadline)


    def unpin(self, session: Session, ns: str, keys: list[str]) -> list[bool]:
        self.check_batch(len(keys))
        result = []
        for key in keys:
            entry = self.index.get((ns, key))
            pinned = entry is not None and session.pins.pop(entry.generation, None) is not None
            if pinned:
                entry.pins -= 1
                self._after_unhold(cast(Entry, entry))  # pinned: entry is not None
            result.append(pinned)
        return result


    def expire(self) -> None:
        """Abort writes past their TTL and drop pins past their deadline (called periodically)."""
        now = self.clock()
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, generation, session_id = heapq.heappop(self._deadlines)
            entry = self.by_generation.get(generation)
            if session_id == 0:  # a write deadline
                reservation = self.reservations.get(generation)
                if reservation is not None and reservation.deadline == deadline:
                    self._reservation_expired(reservation)
                elif entry is not None and entry.state is State.WRITING and entry.write_deadline == deadline:
                    entry.owner.writes.pop(generation, None)
                    self._free(entry)
                    self.counters["expired_writes"] += 1
                    self.counters["reclaimed_write_ttl"] += 1
                continue
            session = self._sessions.get(session_id)
            if session is not None and session.pins.get(generation) == deadline:
                del session.pins[generation]
                self.counters["reclaimed_pin_expired"] += 1
                if entry is not None:
                    entry.pins -= 1
                    self._after_unhold(entry)
