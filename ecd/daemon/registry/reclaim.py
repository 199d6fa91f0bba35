"""What readers hold, given back: a departed client's writes, reservation, read leases, pins, read
slots and parked gets (Store.close_session: a client that said goodbye, died or went silent), and
the extents read slots held at their free (SlotHolds)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ...memory.allocator import align_up
from .entries import Entry, Session, State

if TYPE_CHECKING:  # pragma: no cover
    from ...memory.entry_index import SlotArea
    from .store import Store


def reclaim(store: "Store", session: Session, reclaimed: bool, reason: str) -> None:
    """`reclaimed`: the client died (`reason` client_exit) or went silent (session_ttl) rather
    than said goodbye (counted for operators by reason)."""
    if session.closed:
        return
    session.closed = True
    holds = sum(session.leases.values()) + len(session.pins) + len(session.writes)
    store._sessions.pop(session.id, None)
    for waiter in list(session.waiters):
        store.waiting.drop(waiter)
    for written in list(session.writes.values()):
        store.free(written)
    session.writes.clear()
    if session.reservation is not None:
        store.reserving.end(session.reservation, "reclaimed")
    for generation, count in session.leases.items():
        entry = store.by_generation.get(generation)
        if entry is not None:
            entry.readers -= count
            store.after_unhold(entry)
    session.leases.clear()
    for generation in session.pins:
        entry = store.by_generation.get(generation)
        if entry is not None:
            store.deadlines.release(entry)
            store.after_unhold(entry)
    session.pins.clear()
    holds += store.slot_holds.release(session)  # its read slots (views)
    if reclaimed:
        store.counters["reclaimed_sessions"] += 1
        store.counters[f"reclaimed_{reason}"] += holds


class SlotHolds:
    """Extents out of the index that a reader's slot may still name (read slots, memory/entry_index.py):
    every free of an unindexed entry comes here after its event is appended; what a slot names
    stays RETIRED, journaled as an intent (so a restart quarantines it too), until a later scan
    (each expiry tick) finds no slot naming it."""

    def __init__(self, store: "Store", area: "SlotArea | None") -> None:
        self.store, self.area = store, area
        self.retired: dict[int, Entry] = {}  # generation -> entry a slot held at its free
        if area is not None:  # a kept pool's slots: the previous run's readers
            leases = store.leases
            store.counters["slot_ghosts"] = area.adopt(time.monotonic_ns(), int(float(leases.session_ttl) * 1e9),
                                                       self._max_pin_ns())

    def _max_pin_ns(self) -> int:
        return int(float(self.store.leases.max_pin) * 1e9) + 1_000_000_000  # a second of slack for clocks read apart

    def assign(self, session: Session) -> list[int]:
        """[pool, offset, slots] of the page the session's Welcome names (empty: none)."""
        page = self.area.assign() if self.area is not None else None
        if page is None:
            return []
        session.slot_page = page
        return [0, *self.area.location(page)]  # type: ignore[union-attr]  # a page implies an area

    def release(self, session: Session) -> int:
        """The session ended: its page is zeroed and free again; the number of slots it held."""
        held = 0
        if session.slot_page is not None and self.area is not None:
            held = self.area.release(session.slot_page)
            session.slot_page = None
        self.recheck()  # what its slots held may go now
        return held

    def revoke(self, session: Session, generation: int) -> int:
        """Clear `session`'s slots naming `generation` (Operator: a forced eviction)."""
        if session.slot_page is None or self.area is None:
            return 0
        return self.area.revoke(session.slot_page, generation)

    def lease_released(self, generation: int) -> None:
        """A read lease ended: if a previous run's slot held this generation, its reader came back
        (Client._restarted leased it again) and is done with it."""
        if self.area is not None:
            self.area.drop_ghost(generation)

    def held(self) -> set[int] | frozenset[int]:
        """Generations a slot names now (empty without slots)."""
        if self.area is None:
            return frozenset()
        return self.area.held(time.monotonic_ns(), self._max_pin_ns())

    def free_unheld(self, entries: list[Entry]) -> None:
        """Free each unindexed, unleased entry that no slot names; keep the others."""
        store = self.store
        held = self.held() if entries else frozenset()
        for entry in entries:
            if entry.generation not in held:
                store.free(entry)
                continue
            if entry.generation not in self.retired:
                entry.state = State.RETIRED
                self.retired[entry.generation] = entry
                if entry.journal < 0:
                    entry.journal = store.journal.intent(entry.generation, entry.pool, entry.offset,
                                                         align_up(max(entry.nbytes, 1)))
                store.counters["slot_deferred_frees"] += 1

    def recheck(self) -> None:
        """Free what no slot names any more (the expiry tick, a session's end)."""
        if not self.retired:
            return
        held = self.held()
        for generation, entry in list(self.retired.items()):
            if generation not in held and not entry.readers:
                self.store.free(entry)  # pops it from `retired`
