"""exists() and pins without a round trip: the ring's presence table answers, read slots pin.

Unpinned, `exists` reads the event ring's presence table and the location cache (a key certainly
absent, or one this client knows present) and asks the daemon only what they cannot answer.

A pin (exists(keys, pin_s)) promises that a present entry stays loadable until its
deadline or unpin. The daemon keeps pins of its own (registry/deadlines.py); a client with a page
of read slots (memory/entry_index.py) keeps them itself: a slot naming the entry's generation and
the deadline (CLOCK_MONOTONIC ns), which every eviction plan reads (SlotHolds.kept). Taking one:

    1. sync the ring; locate the key (the location cache, then the ring's entry index);
       read the ring's plan word: odd (a plan under way) -> ask the daemon
    2. store the slot (a new one, or a later deadline in the one this session holds for it)
    3. full fence (the slot's stores before the loads below)
    4. sync again and read the plan word: the ring trusted, the location still cached (no event
       named the entry), the word unchanged -> pinned. Else the slot is cleared and the daemon
       is asked (Exists with pin_s), as before.

Why a pin that passed step 4 is seen by every eviction that could take the entry: the daemon
makes the plan word odd, full fence, scans the slots, evicts (appends the events), makes the word
even (RingWriter.plan_begin). If a scan missed the slot, the two fences order the client's load of
the word in step 4 after the daemon's odd store (store->fence->load on both sides: one of the two
loads sees the other's store), so the word read there is that plan's odd value or later, and
unchanged since step 1 only if step 1 already read the plan's even end, which follows its events:
step 4's sync then saw the eviction. Either way the check fails.

How it differs from a daemon pin (docs/protocol.md, "Pins in read slots"):
- The budget ([limits] pinned_share) is applied when a plan reads the slots: past it a slot pin
  keeps nothing, though exists() said True (a daemon pin past it answers False). The load that
  follows then misses, as it does for an entry evicted before any pin landed.
- A replace moves the pin to the new generation as a daemon pin of this session (SlotHolds.move_pins);
  unpin() then finds the key at another generation and tells the daemon (no reply awaited).
- A new session (a reconnect) gets a new page: the old page's live pins are sent as daemon pins for
  the time they have left.
Slots are shared with views (client.view_many): a full page, an unlocated key, or
`local_reads=False` take the daemon's route. `send_pin` (vLLM's step pins) stays a message: nobody
waits for it, and one message costs its caller less than locating and pinning each of a request's
keys here (bench-scheduler: 127 keys, +290 us a request that way).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..memory.entry_index import SlotPage
from ..memory.fence import full_barrier
from ..memory.ring import HERE, NOT_HERE
from ..protocol import Exists, Flags, Location, Report, Unpin
from .local_read import indexed_location

if TYPE_CHECKING:  # pragma: no cover
    from .client import Client


class SlotPins:
    """The pins this session holds in its read slots (used under the client's lock)."""

    __slots__ = ("page", "held")

    def __init__(self, page: SlotPage) -> None:
        self.page = page
        self.held: dict[tuple[str, str], tuple[int, int, int]] = {}  # (ns, key) -> (slot, generation, deadline_ns)

    def _sweep(self, now_ns: int) -> None:
        """Free the slots of pins past their deadline (they keep nothing any more)."""
        gone = [name for name, (_, _, deadline) in self.held.items() if deadline <= now_ns]
        if gone:
            self.page.clear([self.held.pop(name)[0] for name in gone])

    def take(self, c: "Client", ns: str, found: dict[str, tuple[int, Location]], pin_s: float) -> set[str]:
        """Steps 1-4 for `found` (key -> (keyhash, location), synced and located): the keys now
        pinned by a slot. The others hold no slot: the caller asks the daemon."""
        ring = c._map.ring
        plans = ring.plans
        if plans & 1:  # an eviction plan is under way
            return set()
        now = time.monotonic_ns()
        deadline = now + int(min(pin_s, c.limits.max_pin_s) * 1e9)
        page, held = self.page, self.held
        slot_of: dict[str, tuple[int, int]] = {}  # key -> (slot, its deadline)
        fresh: list[str] = []
        for key, (_, loc) in found.items():
            mine = held.pop((ns, key), None)
            if mine is not None and mine[1] == loc.generation:
                page.extend(mine[0], deadline)
                slot_of[key] = (mine[0], max(mine[2], deadline))
                continue
            if mine is not None:  # an older generation's pin: the daemon moved it (SlotHolds.move_pins)
                page.clear([mine[0]])
            fresh.append(key)
        if len(fresh) > page.available:
            self._sweep(now)
        fresh = fresh[:page.available]
        slots = page.hold([found[key][1].generation for key in fresh], deadline) or []
        slot_of.update((key, (slot, deadline)) for key, slot in zip(fresh, slots))
        full_barrier()
        if ring.pending() == 0:  # no event since step 1's sync: every location is as it was
            unchanged = ring.plans == plans
        else:
            trusted, overrun = c._cache.sync(ring)
            if overrun:
                c._send_quietly(Report(0, 1))
            unchanged = trusted and ring.plans == plans
        pinned = set()
        for key, (slot, deadline_of) in slot_of.items():
            keyhash, loc = found[key]
            if unchanged and c._cache.located(keyhash, ns, key) is loc:
                pinned.add(key)
                held[(ns, key)] = (slot, loc.generation, deadline_of)
            else:
                page.clear([slot])
        return pinned

    def release(self, c: "Client", ns: str, keys: list[str]) -> tuple[list[bool | None], list[str]]:
        """Clear the slot pins of `keys`: per key True (a live pin was cleared) or None (no slot
        pin: the daemon may hold one), and the keys whose pin the daemon may have taken over
        (replaced since: SlotHolds.move_pins)."""
        if not self.held:
            return [None] * len(keys), []
        now = time.monotonic_ns()
        answers: list[bool | None] = []
        moved: list[str] = []
        trusted, _ = c._cache.sync(c._map.ring)
        for key in keys:
            mine = self.held.pop((ns, key), None)
            if mine is None:
                answers.append(None)
                continue
            self.page.clear([mine[0]])
            answers.append(mine[2] > now)
            current = c._cache.located(c._cache.keyhash(ns, key), ns, key) if trusted else None
            if current is None or current.generation != mine[1]:
                moved.append(key)
        return answers, moved

    def handed_over(self) -> dict[str, dict[float, list[str]]]:
        """A new session (the page goes): the live pins, by namespace and whole seconds left, for
        the daemon to take (Client._new_session)."""
        now = time.monotonic_ns()
        left: dict[str, dict[float, list[str]]] = {}
        for (ns, key), (_, _, deadline) in self.held.items():
            if deadline > now:
                left.setdefault(ns, {}).setdefault(float(-(-(deadline - now) // 10**9)), []).append(key)
        self.held.clear()
        return left


def answer_exists(c: "Client", keys: list[str], pin_s: float) -> list[bool | None]:
    """Client.exists under the client's lock (connected): the ring and the slots answer what they
    can, the daemon the rest."""
    ns, mapping, cache = c.namespace, c.mapping, c._cache
    ring = mapping.ring
    trusted, overrun = cache.sync(ring)
    if overrun:  # operators see overruns in ecd_ring_reader_overruns_total
        c._send_quietly(Report(0, 1))
    pins = c._pins if pin_s > 0 and c.local_reads else None
    answers: list[bool | None] = [None] * len(keys)
    ask: list[int] = []
    to_pin: dict[str, tuple[int, Location]] = {}
    is_cached, lookup = cache.known, ring.lookup
    for i, key in enumerate(keys):
        keyhash = cache.keyhash(ns, key)
        if trusted:
            said = lookup(keyhash)
            if said == NOT_HERE:
                if not is_cached(keyhash, ns, key):
                    answers[i] = False
                    continue
            elif pin_s <= 0:
                if said == HERE or is_cached(keyhash, ns, key):
                    # the bucket names this key, or this client put or read it and has not seen
                    # it go: present, as far as an unpinned (advisory) answer goes
                    answers[i] = True
                    continue
            elif pins is not None:
                loc = cache.located(keyhash, ns, key) or indexed_location(ring, mapping, keyhash, cache.stored(ns), key)
                if loc is not None:
                    cache.remember(keyhash, ns, key, loc.generation, loc)
                    to_pin[key] = (keyhash, loc)
                    continue
        # Not trusted, a pin the slots cannot take, or the ring and this client's cache disagree
        # (an eviction whose event is not read yet, or a presence word someone overwrote with a
        # well-formed ABSENT): the daemon knows.
        ask.append(i)
    if to_pin:
        pinned = pins.take(c, ns, to_pin, pin_s)  # type: ignore[union-attr]  # to_pin implies pins
        for i, key in enumerate(keys):
            if key in to_pin:
                if key in pinned:
                    answers[i] = True
                else:
                    ask.append(i)
    if ask:
        reply: Flags = c._call_locked(Exists(next(c._ids), ns, [keys[i] for i in ask], float(pin_s)))
        for i, found in zip(ask, reply.values):
            answers[i] = found
            if not found:  # whatever generation was cached is gone
                cache.forget(cache.keyhash(ns, keys[i]))
    return answers


def unpin_keys(c: "Client", keys: list[str], wait: bool = True) -> list[bool | None]:
    """Client.unpin under the client's lock (connected): slot pins are cleared here, the rest are
    the daemon's (answered with `wait`, else told by a message nobody waits for: None)."""
    ns = c.namespace
    answers, moved = c._pins.release(c, ns, keys) if c._pins is not None else ([None] * len(keys), [])
    ask = [i for i, answer in enumerate(answers) if answer is None]
    if moved:  # their pins moved to a new generation, held by the daemon now
        c._send_quietly(Unpin(0, ns, moved))
    if ask and not wait:  # keys come limits.max_batch at a time (ControlClient._chunks)
        c._send_quietly(Unpin(0, ns, [keys[i] for i in ask]))
    elif ask:
        reply: Flags = c._call_locked(Unpin(next(c._ids), ns, [keys[i] for i in ask]))
        for i, was in zip(ask, reply.values):
            answers[i] = was
    return answers
