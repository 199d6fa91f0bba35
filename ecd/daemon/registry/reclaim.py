"""What readers hold, given back: a departed client's writes, reservation, read leases, pins, read
slots and parked gets (Store.close_session: a client that said goodbye, died or went silent), and
the extents read slots held at their free (SlotHolds)."""
from __future__ import annotations

import collections
import time
from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping

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
    for closer in store.session_closers:  # first: its posted puts are committed (daemon/writes)
        closer(session)
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
    (each expiry tick) finds no slot naming it. One slot area per part of the pool (the default
    tenant's, each sized tenant's: its clients get pages there); a page is (area's pool, page)."""

    def __init__(self, store: "Store", areas: "Mapping[str, tuple[int, SlotArea]]" = MappingProxyType({})) -> None:
        """`areas`: (pool whose tail holds it, the area) by tenant ("": the default tenant's and
        every unsized tenant's)."""
        self.store, self.by_tenant = store, dict(areas)
        self.areas = {pool: area for pool, area in areas.values()}
        self.retired: dict[int, Entry] = {}  # generation -> entry a slot held at its free
        self.sessions: dict[tuple[int, int], Session] = {}  # page -> the session it was assigned to
        self._last: tuple | None = None  # (ring seq, the scan made then), within one request
        leases = store.leases
        for area in self.areas.values():  # a kept pool's slots: the previous run's readers
            store.counters["slot_ghosts"] += area.adopt(time.monotonic_ns(), int(float(leases.session_ttl) * 1e9),
                                                        self._max_pin_ns())

    def _max_pin_ns(self) -> int:
        return int(float(self.store.leases.max_pin) * 1e9) + 1_000_000_000  # a second of slack for clocks read apart

    def assign(self, session: Session) -> list[int]:
        """[pool, offset, slots] of the page the session's Welcome names (empty: none), in its
        tenant's part of the pool."""
        pool, area = self.by_tenant.get(session.tenant) or self.by_tenant.get("") or (0, None)
        page = area.assign() if area is not None else None
        if page is None:
            return []
        session.slot_page = (pool, page)
        self.sessions[pool, page] = session
        return [pool, *area.location(page)]  # type: ignore[union-attr]  # a page implies an area

    def release(self, session: Session) -> int:
        """The session ended: its page is zeroed and free again; the number of slots it held."""
        held = 0
        if session.slot_page is not None:
            pool, page = session.slot_page
            held = self.areas[pool].release(page)
            self.sessions.pop(session.slot_page, None)
            session.slot_page = None
        self.recheck()  # what its slots held may go now
        return held

    def revoke(self, session: Session, generation: int) -> int:
        """Clear `session`'s slots naming `generation` (Operator: a forced eviction)."""
        if session.slot_page is None:
            return 0
        pool, page = session.slot_page
        return self.areas[pool].revoke(page, generation)

    def lease_released(self, generation: int) -> None:
        """A read lease ended: if a previous run's slot held this generation, its reader came back
        (Client._restarted leased it again) and is done with it."""
        for area in self.areas.values():
            area.drop_ghost(generation)

    def held(self) -> set[int] | frozenset[int]:
        """Generations a read slot (a view) names now: their extents are not freed (empty without slots)."""
        if not self.areas:
            return frozenset()
        return self._scan(reuse=True)[0]

    def _scan(self, reuse: bool = False) -> tuple:
        """Every slot area's scan (SlotArea.scan; pins' pages as (pool, page)). `reuse`: the last
        one, if no event was appended since and this request (or tick) made it: a free needs a
        scan made after its entry's event, and a replace's pin move and free then share one."""
        seq = self.store.announcer.seq()
        if reuse and self._last is not None and self._last[0] == seq:
            return self._last[1]
        now_ns, max_pin_ns = time.monotonic_ns(), self._max_pin_ns()
        # with sized tenants a part's slots hold only that part's entries (and the arenas'): a
        # client of one tenant naming another's generations holds nothing of it
        parts = len(self.areas) > 1
        held: set[int] | frozenset[int] = frozenset()
        pins: list = []
        for pool, area in self.areas.items():
            area_held, area_pins = area.scan(now_ns, max_pin_ns)
            if parts:
                area_held = {generation for generation in area_held if self._in_part(generation, pool)}
                area_pins = [pin for pin in area_pins if self._in_part(pin[1], pool)]
            held = held | area_held if held else area_held
            pins += [((pool, page), generation, deadline) for page, generation, deadline in area_pins]
        scanned = held, pins
        self._last = (seq, scanned)
        return scanned

    def _in_part(self, generation: int, first: int) -> bool:
        """Whether `generation` is an entry of the part whose first segment is `first` (or of a CUDA arena)."""
        entry = self.store.by_generation.get(generation) or self.retired.get(generation)
        if entry is None:
            return False  # (names nothing: holds nothing)
        host = self.store.host
        return entry.pool in host.arena_pools or host.part_of(entry.pool) == first

    def kept(self, plan: bool = True) -> set[int] | frozenset[int]:
        """Generations no eviction may take: what read slots hold and what pin slots keep within the
        pin budget. `plan`: an eviction follows (the rings' plan words go odd until it is over)."""
        if not self.areas:
            return frozenset()
        if plan:
            self.store.announcer.plan_begin()
        held, pins = self._scan()  # a fresh one: after the plan word went odd
        return held | self._within_budget(pins) if pins else held

    def snapshot(self) -> tuple[set[int] | frozenset[int], collections.Counter]:
        """(generations read slots hold, live pin slots per generation): what `ecd keys` shows."""
        if not self.areas:
            return frozenset(), collections.Counter()
        held, pins = self._scan()
        return held, collections.Counter(generation for _, generation, _ in pins)

    def _within_budget(self, pins: list[tuple[tuple[int, int], int, int]]) -> set[int]:
        """The pinned generations the budget (Deadlines.budget, less what daemon pins hold) keeps:
        each session's smallest first, a round at a time, so that no session's pins crowd out
        another's. A pin slot past the budget keeps nothing; a daemon pin is kept anyway."""
        store = self.store
        deadlines, by_generation = store.deadlines, store.by_generation
        per_page: dict[tuple[int, int], list[Entry]] = {}
        for page, generation, _ in pins:
            entry = by_generation.get(generation)
            if entry is not None and entry.state is State.READY and not entry.pins:
                per_page.setdefault(page, []).append(entry)
        ranked = []
        for entries in per_page.values():
            entries.sort(key=lambda e: e.nbytes)
            ranked += [(rank, entry.nbytes, entry.generation, entry) for rank, entry in enumerate(entries)]
        ranked.sort(key=lambda r: r[:3])
        left: dict[int, int] = {}
        kept: set[int] = set()
        for _, nbytes, generation, entry in ranked:
            group = deadlines.group(entry.pool)
            if group not in left:
                left[group] = deadlines.budget(group) - deadlines.pinned.get(group, 0)
            size = align_up(max(nbytes, 1))
            if generation not in kept and size <= left[group]:
                kept.add(generation)
                left[group] -= size
        return kept

    def plan_over(self) -> None:
        """After a request or an expiry tick: any eviction plan's events are out."""
        self.store.announcer.plan_end()
        self._last = None  # a later request scans again

    def move_pins(self, old: Entry, new: Entry) -> None:
        """A pin promises the key stays loadable: a pin slot naming the replaced generation becomes
        a daemon pin of the new one for its session, until the slot's deadline (as
        Deadlines.move_pins does for daemon pins; the client's unpin sees the new generation and
        tells the daemon)."""
        if not self.areas:
            return
        now_ns = time.monotonic_ns()
        for page, generation, deadline_ns in self._scan(reuse=True)[1]:
            session = self.sessions.get(page)
            if generation == old.generation and session is not None and not session.closed:
                self.store.deadlines.pin(session, new, self.store.clock() + (deadline_ns - now_ns) / 1e9)

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
        held = self._scan()[0]  # fresh: slots cleared since the last scan free their entries now
        for generation, entry in list(self.retired.items()):
            if generation not in held and not entry.readers:
                self.store.free(entry)  # pops it from `retired`
