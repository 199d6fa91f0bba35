"""Put leases: pool space a session holds so that its puts need no Alloc (issue 43, item 1).

A lease is one extent of the host pool, granted to a session in one namespace: 64 KiB at first,
twice the last with each grant up to a slab (`[leases] put_slab`, at most 1/128 of the pool), or
exactly one put's size when that is larger or nothing larger fits without evicting. The
client places its puts in it from the front, in order, and names each in a submission record
(submission.py); the daemon carves the record's bytes off the front as an entry, and gives back
what a failed put skipped. So the pool's allocator holds the lease as one extent until carving
splits it (ExtentAllocator.split), and what is left at the lease's end returns to the pool.

Invariants:
- Quota: a lease is charged to its namespace when granted (its whole size); a carved entry's
  bytes move from the lease to the entry and what is given back is uncharged, so leased +
  committed bytes never pass the quota at any instant. A lease a client asks for (LeaseSpace)
  evicts as an Alloc of its size would (the namespace's own entries first when its quota
  demands; then for room): for just the put, or, for a session that used at least half of its
  last lease in the tier (a streaming producer), for its next size (up to one slab: pool/128),
  so a producer into a full pool asks once per slab while a client that puts once per
  namespace evicts no more than its puts. One granted ahead evicts nothing and is not granted
  past the quota.
- Restart: a lease is journaled as an intent for [front, end); a carve writes the new intent
  before the entry's record and forgets the old one after, so a kill at any point leaves every
  byte of it owned by exactly one record (an adopting restart skips an intent that starts
  where an entry does, and refuses the later of two overlapping ones) and quarantines the rest.
- The one being filled and the next, granted ahead (refill: up to LIVE_LEASES) once the daemon
  sees a record in the current one, so a steady producer never waits; a client may ask for more
  (LeaseSpace, up to MAX_LEASES: a put larger than what its leases have left). A record naming a
  lease retires every older one (the client places in sequence order and never goes back, so
  every record of an older lease came before).
- A lease ends with its session, when fully carved, when its client moves on, or when revoked:
  once none of its session's leases was used for the write TTL, the consumer marks them revoked
  on the page (REVOKED_AT) and `expire` frees them LEASE_GRACE x the TTL later. A client looks
  at the mark before each placement and copies at most COPY_WINDOW x the TTL after it, so no
  copy is still landing when the bytes go back (submission.py).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ...errors import Code
from ...memory.allocator import align_up
from ...protocol import Failure
from ...writes.submission import LEASE_GRACE, slab_bytes
from ..registry.entries import Session

if TYPE_CHECKING:  # pragma: no cover
    from ..registry.store import Store

TIER_HOST = -1  # a lease in the host pool (else: in the CUDA arena of that pool index)
LIVE_LEASES = 2  # the daemon refills ahead up to this many per tier
MAX_LEASES = 8  # a client may ask for more (LeaseSpace: a put larger than its leases' room)
MIN_LEASE = 64 << 10  # a session's first lease; each next one twice the last, up to the slab
LEASE_OUTCOMES = ("granted", "refused", "filled", "retired", "expired", "reclaimed")


@dataclass(slots=True, eq=False)
class PutLease:
    generation: int  # from the entries' counter: records name the lease by it
    pool: int
    start: int
    end: int
    front: int  # below it: carved into entries or given back
    ns: str
    owner: Session
    last_used: float
    journal: int = -1  # its intent record for [front, end)
    revoked_at: float = 0.0  # when marked revoked on its page (0: not); freed LEASE_GRACE x the TTL later


@dataclass(slots=True)
class Leasing:
    """The daemon's put leases, for the submission consumer (consumer.py). A session's leases are
    of one tier each: the host pool (TIER_HOST) or one CUDA arena (its pool index); a session
    fills one lease per tier at a time, its puts in each tier in order."""

    store: "Store"
    put_slab: int  # [leases] put_slab: a lease's bytes, at most 1/128 of its tier (slab_bytes)
    by_session: dict[int, list[PutLease]] = field(default_factory=dict)  # session id -> oldest first
    _next_size: dict[tuple[int, int], int] = field(default_factory=dict)  # (session id, tier) -> next size
    # (session id, tier) -> whether its last lease ended at least half used: a producer streaming
    # into the tier, for whom a lease asked for may evict for its next size
    _streaming: dict[tuple[int, int], bool] = field(default_factory=dict)
    _slabs: dict[tuple[int, ...], int] = field(default_factory=dict)  # pools (a tier of a part) -> its slab
    leased_bytes: int = 0  # not yet carved

    def tier_of(self, lease: PutLease) -> int:
        return lease.pool if lease.pool in self.store.host.arena_pools else TIER_HOST

    def slab(self, pools: tuple[int, ...]) -> int:
        """The largest lease in `pools` (a tier of one part of the pool: a sized tenant's own)."""
        slab = self._slabs.get(pools)
        if slab is None:
            host = self.store.host
            slab = self._slabs[pools] = slab_bytes(self.put_slab, sum(host.allocators[p].capacity for p in pools))
        return slab

    def live(self, session: Session, tier: int) -> list[PutLease]:
        """The session's leases in `tier`, oldest first."""
        return [lease for lease in self.by_session.get(session.id, ()) if self.tier_of(lease) == tier]

    def find(self, session: Session, generation: int) -> PutLease | None:
        for lease in self.by_session.get(session.id, ()):
            if lease.generation == generation:
                return lease
        return None

    def grant(self, session: Session, ns: str, nbytes: int = 0, evict: bool = True,
              tier: int = -1) -> PutLease | Failure:
        """A new lease for `session` in `ns` and `tier` (TIER_HOST, or a CUDA arena's pool index:
        RequestError INVALID for another) of at least `nbytes`: of its next size (MIN_LEASE,
        doubling with each grant up to the slab: a session that puts little holds little) where
        that fits without evicting; else, with `evict`, evicting for it as an Alloc of it would
        (_evicting). `evict` False: a lease granted ahead, for puts that may never come (a refill)
        takes free space only."""
        store = self.store
        pools = store.tier(tier, ns)  # first: a bad tier raises before anything is kept
        leases = self.by_session.setdefault(session.id, [])
        if len(leases) >= MAX_LEASES:
            return Failure(Code.LIMIT, f"this client holds {MAX_LEASES} put leases already")
        failure = store.check_key(ns, "lease")
        if failure is not None:
            return failure
        scope = store.placement.scope(ns)
        quota, used = store.quotas.get(scope), store.ns_used.get(scope, 0)
        need, slab = align_up(max(nbytes, 1)), self.slab(pools)
        size = max(need, align_up(min(slab, self._next_size.get((session.id, tier), MIN_LEASE))))
        placed = None
        if not store.host.too_large(size, pools) and (quota is None or used + size <= quota):
            placed = store.placement.place(size, ns, (), evict=False, pools=pools)
        if placed is None and evict:
            wanted = size if self._streaming.get((session.id, tier)) else need
            evicted, size = self._evicting(ns, pools, wanted, need, nbytes)
            if isinstance(evicted, Failure):
                return self._refused(evicted)
            placed = evicted
        if placed is None:
            return self._refused(Failure(Code.POOL_FULL, "no put lease ahead: no free extent without evicting"))
        self._next_size[(session.id, tier)] = min(slab, 2 * size)
        pool, offset = placed
        lease = PutLease(store.take_generation(), pool, offset, offset + size, offset, sys.intern(ns), session,
                         store.clock())
        lease.journal = store.journal.intent(lease.generation, pool, offset, size)
        store.charge(lease.ns, size)
        leases.append(lease)
        self.leased_bytes += size
        store.counters["put_leases_granted"] += 1
        return lease

    def _evicting(self, ns: str, pools: tuple[int, ...], wanted: int, need: int,
                  nbytes: int) -> tuple[tuple[int, int] | Failure, int]:
        """A place for a lease of `wanted` bytes (its next size), evicting as an Alloc would (the
        namespace's own entries first where its quota demands, then the coldest for room); where
        that cannot be, for just the put's `need`. So a producer into a full pool evicts a slab
        at a time, one LeaseSpace per slab, not one per put."""
        store = self.store
        failure: Failure | None = None
        size = need
        for size in dict.fromkeys((wanted, need)):  # the larger first; `need` alone when they are equal
            too_large = store.host.too_large(size, pools)
            if too_large:
                failure = Failure(Code.INVALID, f"no put lease: {too_large}")
                continue
            victims = store.placement.quota_victims(ns, size)
            if isinstance(victims, Failure):
                failure = victims
                continue
            placed = store.placement.place(size, ns, victims, pools=pools)
            if placed is not None:
                return placed, size
            store.counters["pool_full"] += 1
            failure = Failure(Code.POOL_FULL, store.placement.pool_full_message(nbytes, pools))
        assert failure is not None
        return failure, size

    def _refused(self, failure: Failure) -> Failure:
        self.store.counters["put_leases_refused"] += 1
        return failure

    def carve(self, lease: PutLease, offset: int, nbytes: int) -> int:
        """Take [offset, offset + aligned nbytes) off the lease's front for an entry (checked by the
        caller: offset >= front, aligned, its end within the lease), giving back the bytes before
        it. The extent is now one of its own, still charged to the lease's namespace (the caller
        moves the charge to the entry it makes, writes the entry's record, then calls `carved`
        with the old intent this returns)."""
        store = self.store
        allocator = store.host.allocators[lease.pool]
        end = offset + align_up(max(nbytes, 1))
        if offset > lease.front:
            self._give_back(lease, offset)
        if end < lease.end:
            allocator.split(end)
        old = lease.journal
        # the new intent first, the entry's record next (the caller), the old intent last
        lease.journal = store.journal.intent(lease.generation, lease.pool, end, lease.end - end) if end < lease.end else -1
        self.leased_bytes -= end - lease.front
        lease.front = end
        lease.last_used = store.clock()
        return old

    def carved(self, lease: PutLease, old_intent: int) -> None:
        """After the entry's record: the old intent goes; a lease with nothing left ends."""
        self.store.journal.forget(old_intent)
        if lease.front >= lease.end:
            self._drop(lease, "filled")

    def skip_to(self, lease: PutLease, offset: int) -> None:
        """A failed or refused put: the bytes up to `offset` go back to the pool."""
        if lease.front < offset <= lease.end:
            self._give_back(lease, offset)
            old = lease.journal
            lease.journal = (self.store.journal.intent(lease.generation, lease.pool, offset, lease.end - offset)
                             if offset < lease.end else -1)
            self.store.journal.forget(old)
            self.leased_bytes -= offset - lease.front
            lease.front = offset
            if lease.front >= lease.end:
                self._drop(lease, "filled")

    def _give_back(self, lease: PutLease, offset: int) -> None:
        """Free [front, offset) (a split extent of its own) and uncharge it."""
        if offset < lease.end:
            self.store.host.allocators[lease.pool].split(offset)
        size = offset - lease.front
        self.store.host.free(lease.pool, lease.front, size)
        self.store.uncharge(lease.ns, size)

    def retire_older(self, lease: PutLease) -> None:
        """A record named `lease`: the client has moved on from every lease of its tier granted
        before it."""
        for older in self.live(lease.owner, self.tier_of(lease)):
            if older is lease:
                break
            self.end(older, "retired")

    def end(self, lease: PutLease, outcome: str) -> None:
        """Give the uncarved rest back to the pool and its namespace."""
        store = self.store
        self._streaming[(lease.owner.id, self.tier_of(lease))] = 2 * (lease.front - lease.start) >= lease.end - lease.start
        if lease.front < lease.end:
            size = lease.end - lease.front
            store.host.free(lease.pool, lease.front, size)
            store.uncharge(lease.ns, size)
            self.leased_bytes -= size
        store.journal.forget(lease.journal)
        lease.journal = -1
        lease.front = lease.end
        self._drop(lease, outcome)

    def _drop(self, lease: PutLease, outcome: str) -> None:
        leases = self.by_session.get(lease.owner.id)
        if leases is not None and lease in leases:
            leases.remove(lease)
            if not leases:
                del self.by_session[lease.owner.id]
        if outcome == "filled":
            self._streaming[(lease.owner.id, self.tier_of(lease))] = True
        self.store.counters[f"put_leases_{outcome}"] += 1

    def end_session(self, session: Session) -> None:
        for lease in list(self.by_session.get(session.id, ())):
            self.end(lease, "reclaimed")
        for tier in [t for s, t in self._next_size if s == session.id]:
            del self._next_size[(session.id, tier)]
            self._streaming.pop((session.id, tier), None)

    def idle(self, session: Session, write_ttl: float) -> int:
        """0, or (none of the session's leases used for the write TTL, none revoked yet) the
        generation below which its page's mark revokes them all: they are marked revoked now."""
        leases, now = self.by_session.get(session.id, []), self.store.clock()
        if not leases or leases[-1].revoked_at or now - max(lease.last_used for lease in leases) <= write_ttl:
            return 0
        for lease in leases:
            lease.revoked_at = now
        return leases[-1].generation + 1

    def expire(self, write_ttl: float) -> None:
        """Leases marked revoked more than LEASE_GRACE x the TTL ago go back to the pool."""
        now = self.store.clock()
        for leases in list(self.by_session.values()):
            for lease in list(leases):
                if lease.revoked_at and now - lease.revoked_at > LEASE_GRACE * write_ttl:
                    self.end(lease, "expired")

    def totals(self) -> tuple[int, int]:
        """(leases, bytes not yet carved)."""
        return sum(map(len, self.by_session.values())), self.leased_bytes
