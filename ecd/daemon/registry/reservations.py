"""Reservations: the extent a client holds for its next put, so that put is one round trip.

A Commit (or Publish) may ask for `reserve` bytes: the daemon answers with an anonymous extent
(a `Reservation`, not an Entry) that the client copies its next tensor into before naming it with
Publish, which turns it into a READY entry. A reservation never evicts anything (a put that may
never come must not cost the cache), is refused quietly under quota or pool pressure (the client
falls back to Alloc), counts its bytes toward the namespace of the commit it rode on until Publish
moves them to the one it names (else a client could hold pool bytes outside its quota by
reserving, from as many sessions as it likes), and lives in that commit's tier. One per client.

It ends by Publish, by Abort (the client found it unusable), by the write TTL (only for a
client the daemon cannot watch: a watched client may start copying at any moment, and its
reservation goes with its process), or with its session. Counted by outcome in
`counters["reservations_<outcome>"]` (ecd_reservations_total) and held in `reservations` /
`reserved_bytes` (ecd_reserved_bytes), records of the store. A part the Store owns
(store.reserving)."""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from ...errors import Code
from ...memory.allocator import align_up
from ...protocol import AllocItem, Extent, Failure
from .entries import Entry, Reservation, Session

if TYPE_CHECKING:  # pragma: no cover
    from .state import RecordSet

# Every way a reservation ends, plus "granted" and "refused": the labels of ecd_reservations_total.
RESERVATION_OUTCOMES = ("granted", "refused", "published", "aborted", "expired", "reclaimed")


class Reserving:
    def __init__(self, records: "RecordSet") -> None:
        self.r = records

    def reserve(self, session: Session, nbytes: int, pools: tuple[int, ...] | None = None) -> Extent | Failure:
        """An anonymous extent of `nbytes` for this client's next put, placed in `pools` (a tier:
        the one of the commit it rides on; default the host pool), without evicting."""
        r = self.r
        if session.reservation is not None:
            return Failure(Code.LIMIT, "this client already holds a reservation")
        ns = session.reserve_ns
        if ns is None:
            return Failure(Code.INVALID, "a reservation is asked for with a commit: this client has committed nothing")
        pools = r.host.pools_for(r.placement.scope(ns)) if pools is None else pools
        too_large = r.host.too_large(nbytes, pools)
        if too_large:
            return Failure(Code.INVALID, f"cannot reserve: {too_large}")
        size = align_up(max(nbytes, 1))
        scope = r.placement.scope(ns)
        quota = r.quotas.get(scope)
        if quota is not None and r.ns_used.get(scope, 0) + size > quota:
            r.counters["reservations_refused"] += 1  # not a refused put: the next put takes Alloc
            return Failure(Code.QUOTA_EXCEEDED, f"no reservation of {nbytes} bytes: it would take "
                                                f"{r.placement.scope_name(scope)} over its quota of {quota} bytes")
        placed = r.placement.place(nbytes, None, (), evict=False, pools=pools)
        if placed is None:
            r.counters["reservations_refused"] += 1
            return Failure(Code.POOL_FULL, f"no free extent of {nbytes} bytes without evicting")
        pool, offset = placed
        reservation = Reservation(r.take_generation(), pool, offset, size, ns, session,
                                  r.clock() + r.leases.write_ttl)
        reservation.journal = r.journal.intent(reservation.generation, pool, offset, size)
        r.reservations[reservation.generation] = reservation
        r.reserved_bytes += size
        r.charge(ns, size)
        session.reservation = reservation
        r.deadlines.push(reservation.deadline, reservation.generation, 0)
        r.counters["reservations_granted"] += 1
        return Extent(reservation.generation, pool, offset)

    def publish(self, session: Session, ns: str, generation: int, item: AllocItem,
                checksum: int = 0) -> Failure | None:
        """Name this client's reservation `ns`/`item.key` and commit it (its bytes are written).
        A reservation Publish refuses is freed: the client's put failed, its extent is not kept."""
        r = self.r
        reservation = session.reservation
        if reservation is None or reservation.generation != generation:
            return Failure(Code.STALE, f"generation {generation} is not this client's reservation "
                                       "(expired, aborted or already published)")
        host = r.host
        pools = (reservation.pool,) if reservation.pool in host.arena_pools else host.pools_for(r.placement.scope(ns))
        failure = (r.checks.item(ns, item, pools) if reservation.pool in pools else  # (never: a session's
                   Failure(Code.INVALID, "the reservation lies in another tenant's segments"))  # tenant is one)
        if failure is None and align_up(max(item.nbytes, 1)) != reservation.size:
            failure = Failure(Code.INVALID, f"{item.nbytes} bytes do not match the reservation of {reservation.size}")
        victims: list[Entry] | Failure = []
        moves = r.placement.scope(ns) != r.placement.scope(reservation.ns)  # (a sized tenant's namespaces: one)
        if failure is None and moves:  # its bytes move to `ns`'s scope: that quota decides
            victims = r.placement.quota_victims(ns, reservation.size)
            if isinstance(victims, Failure):
                failure = victims
        if failure is not None:
            self.end(reservation, "aborted")
            return failure
        r.slot_holds.free_unheld([r.placement.evict(victim, "evicted_quota") for victim in victims])
        self._forget(reservation, "published")
        if ns != reservation.ns:
            r.uncharge(reservation.ns, reservation.size)
            r.charge(ns, reservation.size)
        ns = sys.intern(ns)
        entry = Entry(generation, ns, item.key, sys.intern(item.dtype),
                      r.shared_shape(item.shape), item.nbytes, reservation.pool, reservation.offset, owner=session,
                      last_access=r.clock(), when=reservation.deadline, meta=item.meta)
        # the put's record before the intent goes: a kill in between leaves the extent quarantined
        entry.journal = r.journal.entry(generation, entry.pool, entry.offset, entry.nbytes, entry.dtype, entry.shape,
                                        ns, entry.key)
        r.journal.forget(reservation.journal)
        reservation.journal = -1
        r.by_generation[generation] = entry
        session.writes[generation] = entry
        return r.commit(session, generation, checksum)

    def end(self, reservation: Reservation, outcome: str) -> None:
        """Free a reservation's extent and give its bytes back to its namespace."""
        self._forget(reservation, outcome)
        self.r.journal.forget(reservation.journal)
        self.r.host.free(reservation.pool, reservation.offset, reservation.size)
        self.r.uncharge(reservation.ns, reservation.size)

    def _forget(self, reservation: Reservation, outcome: str) -> None:
        r = self.r
        del r.reservations[reservation.generation]
        r.reserved_bytes -= reservation.size
        if reservation.owner.reservation is reservation:
            reservation.owner.reservation = None
        r.counters[f"reservations_{outcome}"] += 1

    def expired(self, reservation: Reservation) -> None:
        """Its write TTL passed (deadlines.expire): kept while its client's process is watched."""
        if not reservation.owner.watched:
            self.end(reservation, "expired")

    def totals(self) -> tuple[int, int]:
        """(reservations, bytes they hold). O(1)."""
        return len(self.r.reservations), self.r.reserved_bytes
