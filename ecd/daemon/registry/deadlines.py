"""Pins and deadlines: a pin from exists(pin_s) keeps an entry from eviction until its deadline
and follows the key across replacement; an uncommitted write is aborted at its write TTL. Both
kinds of deadline live on one heap, swept by expire(). A part the Store owns (store.deadlines)."""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, cast

from .entries import Entry, Session, State

if TYPE_CHECKING:  # pragma: no cover
    from .state import RecordSet


class Deadlines:
    def __init__(self, records: "RecordSet") -> None:
        self.r = records
        self._heap: list[tuple[float, int, int]] = []  # (when, generation, session id or 0)
        self._compact_at = 4096  # heap size at which stale deadlines are swept out

    def __len__(self) -> int:
        """Deadlines on the heap, live or not yet swept."""
        return len(self._heap)

    def pin(self, session: Session, entry: Entry, deadline: float) -> None:
        """Keep `entry` from eviction until `deadline` (a later deadline extends the pin)."""
        previous = session.pins.get(entry.generation)
        if previous is None:
            entry.pins += 1
            self.r.placement.make_unevictable(entry)
        elif previous >= deadline:
            return
        session.pins[entry.generation] = deadline
        self.push(deadline, entry.generation, session.id)

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
                old.pins -= 1
                self.pin(session, new, deadline)

    def unpin(self, session: Session, ns: str, keys: list[str]) -> list[bool]:
        r = self.r
        r.check_batch(len(keys))
        result = []
        for key in keys:
            entry = r.index.get((ns, key))
            pinned = entry is not None and session.pins.pop(entry.generation, None) is not None
            if pinned:
                entry.pins -= 1
                r.after_unhold(cast(Entry, entry))  # pinned: entry is not None
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
                    entry.pins -= 1
                    r.after_unhold(entry)
