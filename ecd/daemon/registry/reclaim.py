"""What a departed client held, given back: its writes, reservation, read leases, pins and
parked gets (Store.close_session: a client that said goodbye, died or went silent)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .entries import Session

if TYPE_CHECKING:  # pragma: no cover
    from .store import Store


def reclaim(store: "Store", session: Session, reclaimed: bool, reason: str) -> None:
    """`reclaimed`: the client died (`reason` client_exit) or went silent (session_ttl) rather
    than said goodbye (counted for operators by reason)."""
    if session.closed:
        return
    session.closed = True
    if reclaimed:
        store.counters["reclaimed_sessions"] += 1
        store.counters[f"reclaimed_{reason}"] += (sum(session.leases.values()) + len(session.pins)
                                                 + len(session.writes))
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
