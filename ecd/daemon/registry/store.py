"""The registry: entries, their state machine, leases, pins, waiters and LRU eviction.

Single-threaded by design (the daemon's event loop owns it), so there are no locks. It knows
nothing of sockets: the server hands it a Session per client and gets plain results back;
a parked Acquire completes through the callback it registered.

Entry life:  alloc -> WRITING --commit--> READY --(replace | delete)--> RETIRED -> freed
                        |                   |                           (when readers drain)
                        +--abort/TTL/death--+--evict (no readers, no pins)--> freed
WRITING and RETIRED entries are invisible to lookups; a READY entry with a reader or a pin is
never evicted. Generations come from one counter, so a generation names exactly one entry.

Namespaces (`[namespaces.NAME]` in node.toml): every entry (WRITING, READY or RETIRED) counts its
extent's bytes toward its namespace until it is freed; a reservation (reservations.py) counts
toward the namespace of the commit it was asked for with and moves to the one Publish names. A
namespace with a quota that would go over it evicts its own least recently used entries first,
and gets QUOTA_EXCEEDED when they cannot make room; it never evicts another namespace for its
quota. Eviction for room (no hole big enough) never takes an entry of another namespace below
that namespace's guaranteed share (of READY bytes), and evicts nothing at all
unless it first finds that evicting what it may would open a big enough contiguous hole.

Tiers: the host tier (tiers/host.py: the host pool's segments, pools 0..n-1, and with
`[pool.cuda]` one CUDA arena per device, pools n, n+1, ..., each with its own allocator) and the
lower tier below it (tiers/base.py's LowerTier: the disk tier with `[pool.disk]`, else a NullTier),
both handed to the Store by the daemon. An allocation names its pools (Alloc.arena): it is placed,
and evicts for room, only there; host placement never spills into an arena nor an arena into the
host pool. A reservation lives in the pools it was asked for (those of the commit it rides on).
Namespace quotas and guaranteed shares count an entry's bytes wherever it lives. The lower tier
is asked on every eviction (spill), read miss (promote), replacing put and delete.
"""
from __future__ import annotations

import collections
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from ...errors import Code
from ...memory.allocator import align_up
from ...memory.ring import EventKind, RingWriter
from ...protocol import (AllocItem, Extent, Failure, Location)
from ...memory.journal import NullJournal
from .announce import Announcer
from .entries import Entry, Reservation, Scheduler, Session, State, Waiter
from .checks import RequestChecks
from .deadlines import Deadlines
from .key_index import KeyIndex
from .operator import OperatorRequests
from .reclaim import SlotHolds, reclaim
from .placement import Placement
from .reservations import Reserving
from .waiting import Waiting

if TYPE_CHECKING:  # pragma: no cover
    from ...config import LeasesSection, LimitsSection
    from ...memory.entry_index import SlotArea
    from ...memory.journal import Journal
    from ..tiers.base import LowerTier
    from ..tiers.host import HostTier


SHARED_SHAPES = 4096  # distinct shapes whose tuple entries share (_shared_shape)
# Entries stamped (published, read) within this of each other share one float object (24 B
# per entry saved for the entries of a batch); the stamps are for `ecd keys`, not for deadlines.
STAMP_RESOLUTION_S = 0.001


class Store:
    """The registry. Its jobs beside the entry state machine are parts it owns, each in a module
    of its own and each given the store's records (state.RecordSet): placement and eviction
    (store.placement, placement.py), reservations for a client's next put (store.reserving,
    reservations.py), parked gets (store.waiting, waiting.py), pins and write deadlines
    (store.deadlines, deadlines.py), operator requests (store.operator, operator.py). Where entries
    live is the host tier's (`host`, tiers/host.py: the pools, their allocators, a pool file
    truncated under it); what goes below the host pool is the lower tier's (`lower_tier`).
    `limits` and `leases` are the config's own sections ([limits], [leases])."""

    def __init__(self, host: "HostTier", lower_tier: "LowerTier", ring: RingWriter, scheduler: Scheduler,
                 limits: "LimitsSection", leases: "LeasesSection", clock: Callable[[], float] = time.monotonic,
                 namespaces: Mapping[str, Any] | None = None, slots: "Mapping[str, tuple[int, SlotArea]] | None" = None,
                 tenants: Mapping[str, Any] | None = None) -> None:
        self.host = host
        self.lower_tier = lower_tier
        self.ring = ring
        # the ring's events and the holdings feed (`announcer.holdings`: KV events, the directory)
        self.announcer = Announcer(ring, lower_tier, host.host_pools)
        self.holdings = self.announcer.holdings
        self.scheduler = scheduler
        self.limits = limits
        self.leases = leases
        self.clock = clock
        self._next_generation = 1
        self.index = KeyIndex()  # READY entries only, by (namespace, key)
        self.by_generation: dict[int, Entry] = {}  # every entry that holds an extent
        self.reservations: dict[int, Reservation] = {}  # by generation (reservations.py)
        self.reserved_bytes = 0
        self._shapes: dict[tuple[int, ...], tuple[int, ...]] = {}
        self._last_stamp = float("-inf")
        self.evictable: collections.OrderedDict[int, Entry] = collections.OrderedDict()  # LRU first
        self.evictable_bytes = [0] * len(host.allocators)  # per pool, kept with `evictable`
        self.waiters: dict[tuple[str, str], set[Waiter]] = {}  # parked gets by missing key
        self._sessions: dict[int, Session] = {}
        self.counters: collections.Counter[str] = collections.Counter()
        # Namespaces: bytes held by each one's named entries, and the configured policies.
        self.ns_used: dict[str, int] = {}
        self.policies: dict[str, tuple[int, int]] = {}  # configured namespace -> (quota, guaranteed)
        self.quotas: dict[str, int] = {}  # only namespaces with a quota
        self.guarantees: dict[str, int] = {}  # only namespaces with a guaranteed share
        # Bytes of READY entries of each namespace with a guaranteed share: what the share protects
        # (ns_used also counts writes that may be aborted and replaced entries about to be freed).
        self.guaranteed_ready: dict[str, int] = {}
        self.quota_refusals: collections.Counter[str] = collections.Counter()  # namespace -> items refused QUOTA_EXCEEDED
        self.quota_refused = 0  # all of them: the server compares it to label a request's outcome
        self.verify_namespaces: frozenset[str] = frozenset()  # commits into these need a checksum
        self.checks = RequestChecks(self)
        self.placement = Placement(self)
        self.reserving = Reserving(self)
        self.waiting = Waiting(self)
        self.deadlines = Deadlines(self)
        self.operator = OperatorRequests(self)
        # what a restarted daemon adopts (memory/journal.py); NullJournal: nothing is recorded
        self.journal: "Journal | NullJournal" = NullJournal()
        self.slot_holds = SlotHolds(self, slots or {})  # extents a reader's read slot names (reclaim.py)
        self.session_closers: list[Callable[[Session], None]] = []  # parts above with a session's things (reclaim)
        host.attach(self)
        self.set_namespaces(namespaces or {}, tenants)

    # ---- namespaces ---------------------------------------------------------------------

    def set_namespaces(self, namespaces: Mapping[str, Any], tenants: Mapping[str, Any] | None = None) -> None:
        """`[namespaces.NAME]` policies and `[tenants.NAME]` sizes (Placement.set_policies)."""
        self.placement.set_policies(namespaces, tenants or {})

    def set_limits(self, limits: "LimitsSection", leases: "LeasesSection") -> None:
        """`[limits]` and `[leases]` (at start, and again on SIGHUP): requests from now on are held to them."""
        self.limits, self.leases = limits, leases

    # ---- sessions -----------------------------------------------------------------------

    def open_session(self, session_id: int, pid: int, tenant: str = "") -> Session:
        session = Session(session_id, pid, tenant=tenant)
        self._sessions[session_id] = session
        return session

    def session(self, session_id: int) -> Session | None:
        return self._sessions.get(session_id)

    def close_session(self, session: Session, reclaimed: bool = False, reason: str = "client_exit") -> None:
        """Reclaim everything a departed client held (reclaim.py)."""
        if not session.closed:
            self._sessions.pop(session.id, None)
        reclaim(self, session, reclaimed, reason)

    @property
    def sessions(self) -> int:
        return len(self._sessions)

    def each_session(self) -> Iterable[Session]:
        """The open sessions (clients', and the peer plane's and lower tier's own)."""
        return self._sessions.values()

    # ---- validation (checks.py) ----------------------------------------------------------

    def check_batch(self, n: int) -> None:
        self.checks.batch(n)

    def check_key(self, ns: str, key: str) -> Failure | None:
        return self.checks.key(ns, key)

    def tier(self, arena: int, ns: str = "") -> tuple[int, ...]:
        """The pools an Alloc into `ns` with this `arena` may use (HostTier.tier: `ns`'s tenant's segments)."""
        return self.host.tier(arena, self.placement.scope(ns))

    def holder(self, generation: int) -> Entry | Reservation | None:
        """The entry (in any state) or reservation that holds this generation's extent."""
        return self.by_generation.get(generation) or self.reservations.get(generation)

    def tier_of(self, generation: int) -> tuple[int, ...] | None:
        """The CUDA arena of an entry or reservation; None for the host pool (or none named: a
        reservation then goes in the host segments of its session's part, Reserving.reserve)."""
        held = self.holder(generation)
        return (held.pool,) if held is not None and held.pool in self.host.arena_pools else None

    # ---- put ----------------------------------------------------------------------------

    def alloc(self, session: Session, ns: str, item: AllocItem,
              pools: tuple[int, ...] | None = None, clean_first: bool = False) -> Extent | Failure:
        """Place a new WRITING entry in `pools` (a tier(): default the host pool); `clean_first`: see Placement.place."""
        pools = self.tier(-1, ns) if pools is None else pools
        placement, failure = self.placement, self.checks.item(ns, item, pools)
        if failure is not None:
            self.counters["alloc_refused"] += 1
            return failure
        victims = placement.quota_victims(ns, align_up(max(item.nbytes, 1)))
        if isinstance(victims, Failure):
            return victims
        placed = placement.place(item.nbytes, ns, victims, pools=pools, clean_first=clean_first)
        if placed is None:
            self.counters["pool_full"] += 1
            return Failure(Code.POOL_FULL, placement.pool_full_message(item.nbytes, pools))
        return self.open_write(session, ns, item, placed)

    def open_write(self, session: Session, ns: str, item: AllocItem, placed: tuple[int, int]) -> Extent:
        """A WRITING entry for a checked item at `placed` (pool, offset), owned by `session`."""
        generation = self.take_generation()
        now = self.clock()
        # Namespaces and dtypes interned (they repeat across entries; the interpreter drops an
        # interned string nothing refers to, so client-chosen names cannot pile up).
        ns = sys.intern(ns)
        entry = Entry(generation, ns, item.key, sys.intern(item.dtype), self.shared_shape(item.shape),
                      item.nbytes, placed[0], placed[1], owner=session, last_access=now,
                      when=now + self.leases.write_ttl, meta=item.meta)
        entry.journal = self.journal.entry(generation, placed[0], placed[1], item.nbytes, entry.dtype, entry.shape,
                                           ns, entry.key)
        self.by_generation[generation] = entry
        self.charge(ns, align_up(max(item.nbytes, 1)))
        session.writes[generation] = entry
        self.deadlines.push(entry.write_deadline, generation, 0)
        return Extent(generation, entry.pool, entry.offset)

    def generations_after(self, generation: int) -> None:
        """Generations from now on are above `generation` (an adopted pool's: restart/adopt.py)."""
        self._next_generation = max(self._next_generation, generation + 1)

    def take_generation(self) -> int:
        """The next generation (entries and reservations share the counter)."""
        generation = self._next_generation
        self._next_generation += 1
        return generation

    def shared_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """One tuple per distinct shape, shared by its entries (a list per entry cost 72 bytes;
        KV blocks and embeddings come in a few shapes). Bounded: clients choose shapes."""
        shape = tuple(shape)
        shared = self._shapes.get(shape)
        if shared is not None:
            return shared
        if len(self._shapes) < SHARED_SHAPES:
            self._shapes[shape] = shape
        return shape

    def _stamp(self) -> float:
        """The clock for last_access and publication stamps, to STAMP_RESOLUTION_S."""
        now = self.clock()
        if now - self._last_stamp >= STAMP_RESOLUTION_S:
            self._last_stamp = now
        return self._last_stamp

    def commit(self, session: Session, generation: int, checksum: int = 0) -> Failure | None:
        """Publish a written entry; `checksum` (0: none) is stored with it and handed to readers."""
        entry = self.by_generation.get(generation)
        if entry is None or entry.state is not State.WRITING:
            reservation = self.reservations.get(generation)
            if reservation is not None and reservation.owner is not session:
                return Failure(Code.NOT_OWNER, f"generation {generation} is another client's reservation")
            if reservation is not None:
                return Failure(Code.INVALID, f"generation {generation} is a reservation: Publish it with a key")
            return Failure(Code.STALE, f"generation {generation} is not an entry being written "
                                       "(aborted, expired or already committed)")
        if entry.owner is not session:
            return Failure(Code.NOT_OWNER, f"generation {generation} is being written by another client")
        del session.writes[generation]
        refused = self.host.refuse_cut_write(generation)
        if refused is not None:
            self.free(entry)  # its bytes are zeros now: never published
            return refused
        if not checksum and entry.ns in self.verify_namespaces:
            self.free(entry)  # refused, not left WRITING until its TTL
            self.counters["unchecksummed_refused"] += 1
            return Failure(Code.INVALID, f"namespace {entry.ns!r} is configured with verify = true: a put "
                                         f"into it must carry a checksum (key {entry.key!r} not stored)")
        entry.checksum = checksum
        entry.owner = None
        entry.state = State.READY
        session.reserve_ns = entry.ns  # a reservation asked for with this commit counts toward it
        entry.last_access = entry.when = self._stamp()  # `when` is now its publication time
        self.lower_tier.replaced(entry)  # a new value: older bytes below must never be served
        old = self.index.get((entry.ns, entry.key))
        keyhash = entry.keyhash  # hashed once for both events of a replace, and the journal's
        self.journal.commit(entry.journal, checksum, keyhash)  # before the answer: a put that returned is adopted
        if old is not None:  # an atomic replace: current readers keep the old bytes
            self.unindex(old, EventKind.DELETED, keyhash)
            self.counters["evicted_replaced"] += 1
            if old.pins:
                self.deadlines.move_pins(old, entry)
            self.slot_holds.move_pins(old, entry)  # and the pins slots hold
            self.retire_or_free(old)
        self.index[(entry.ns, entry.key)] = entry
        if self.guaranteed_ready:
            self.guarantee(entry, align_up(max(entry.nbytes, 1)))
        if not entry.pins:
            self.placement.make_evictable(entry)
        self.announcer.announce(EventKind.PUBLISHED, entry, keyhash)
        self.counters["puts"] += 1
        self.counters["written_bytes"] += entry.nbytes
        self.waiting.wake(entry.ns, entry.key)
        return None

    def abort(self, session: Session, generation: int) -> Failure | None:
        """Give back a write (or this client's reservation) before it is committed."""
        reservation = self.reservations.get(generation)
        if reservation is not None:
            if reservation.owner is not session:
                return Failure(Code.NOT_OWNER, f"generation {generation} is another client's reservation")
            self.reserving.end(reservation, "aborted")
            return None
        entry = session.writes.pop(generation, None)
        if entry is None:
            entry = self.by_generation.get(generation)
            if entry is not None and entry.state is State.WRITING:
                return Failure(Code.NOT_OWNER, f"generation {generation} is being written by another client")
            return Failure(Code.STALE, f"generation {generation} is not an entry being written")
        self.free(entry)
        return None

    # ---- get ----------------------------------------------------------------------------

    def acquire(self, session: Session, ns: str, keys: list[str], wait_s: float,
                on_done: Callable[[list[Location | Failure]], None],
                park_for_disk: bool = True) -> list[Location | Failure] | None:
        """Read-lease every key. Returns the results now, or None after parking the request
        (on_done fires when every key is READY or wait_s passes, whichever comes first).
        `park_for_disk` False (a peer's lookup, answered at once): keys on disk are missing now,
        and start coming back for the next ask."""
        self.checks.get(session, ns, keys)
        # entries a pool truncation cut are dropped before they could be leased
        ready = self.index.namespace(ns)
        self.host.check_pools(entry.pool for key in keys if (entry := ready.get(key)) is not None)
        missing = {key for key in keys if key not in ready}
        # keys the lower tier holds come back into the host pool first (LowerTier.promote): the
        # request parks until they are READY, however short its wait (a promotion failure
        # answers it at once)
        lower = self.lower_tier
        promotable = {key for key in missing if lower.holds(ns, key)} if missing else ()
        if promotable and not park_for_disk:
            for key in promotable:
                lower.promote(ns, key)
            promotable = ()
        if missing and (wait_s > 0 or promotable):
            self.waiting.park(session, ns, keys, missing, promotable, wait_s, on_done)
            return None
        return self.lease_all(session, ns, keys)

    def lease_all(self, session: Session, ns: str, keys: list[str]) -> list[Location | Failure]:
        """Read-lease the keys that are READY now; the others are KEY_NOT_FOUND."""
        results: list[Location | Failure] = []
        now, ready, leases, placement = self._stamp(), self.index.namespace(ns), session.leases, self.placement
        hits = read_bytes = 0  # counted once for the batch
        for key in keys:
            entry = ready.get(key)
            if entry is None:
                results.append(Failure(Code.KEY_NOT_FOUND, f"no entry {key!r} in namespace {ns!r}"))
                continue
            hits += 1
            read_bytes += entry.nbytes
            entry.readers += 1
            entry.last_access = now
            placement.make_unevictable(entry)
            leases[entry.generation] += 1
            results.append(entry.location())
        self.counters.update(hits=hits, misses=len(keys) - hits, read_bytes=read_bytes)
        return results

    def release(self, session: Session, generation: int) -> Failure | None:
        if session.leases.get(generation, 0) <= 0:
            return Failure(Code.NOT_OWNER, f"this client holds no read lease on generation {generation}")
        session.leases[generation] -= 1
        if session.leases[generation] == 0:
            del session.leases[generation]
        entry = self.by_generation[generation]
        entry.readers -= 1
        self.slot_holds.lease_released(generation)
        self.after_unhold(entry)
        return None

    # ---- exists / pins / delete ---------------------------------------------------------

    def is_local(self, ns: str, key: str) -> bool:
        """READY here, or held by this node's lower tier (a read brings it back): no peer needed."""
        return (ns, key) in self.index or self.lower_tier.holds(ns, key)

    def exists(self, session: Session, ns: str, keys: list[str], pin_s: float) -> list[bool]:
        self.checks.lookup(session, keys, pin_s)
        now = self.clock()
        found = []
        lower = self.lower_tier
        for key in keys:
            entry = self.index.get((ns, key))
            if entry is None and lower.holds(ns, key):
                found.append(True)
                self.counters["hits"] += 1
                if pin_s > 0:
                    lower.promote(ns, key)  # a load follows a pinned lookup (vLLM): bring it back now
                else:
                    lower.touch(ns, key)
                continue
            found.append(entry is not None)
            if entry is None:
                self.counters["misses"] += 1
                continue
            self.counters["hits"] += 1
            entry.last_access = now
            if pin_s > 0:
                if not self.deadlines.pin(session, entry, now + min(pin_s, self.leases.max_pin)):
                    found[-1] = False  # no room for the pin: nothing promises it stays loadable
            elif entry.generation in self.evictable:
                self.placement.make_evictable(entry)  # to the most recently used end
        return found

    def delete(self, ns: str, keys: list[str]) -> list[bool]:
        self.check_batch(len(keys))
        result = []
        for key in keys:
            entry = self.index.get((ns, key))
            if entry is not None:
                self.remove(entry)
            below = self.lower_tier.drop(ns, key)
            result.append(entry is not None or below)
        return result

    def remove(self, entry: Entry) -> None:
        """Delete a READY entry (Delete, an operator's Evict): from the lower tier too."""
        self.lower_tier.drop(entry.ns, entry.key)  # first: its record must not keep the key present
        self.unindex(entry, EventKind.DELETED)
        self.counters["evicted_deleted"] += 1
        self.retire_or_free(entry)

    def drop_cut(self, entry: Entry) -> None:
        """A READY entry whose bytes a pool truncation took (HostTier): out of the index (an
        EVICTED event), freed once no reader holds it. A whole copy below keeps the key; one still
        being made from the pool may have read zeros and goes too (LowerTier.cut)."""
        self.lower_tier.cut(entry)
        self.unindex(entry, EventKind.EVICTED)
        self.counters["evicted_truncated"] += 1
        self.retire_or_free(entry)

    # ---- the parts' requests, as the handlers make them ---------------------------------

    def reserve(self, session: Session, nbytes: int, pools: tuple[int, ...] | None = None) -> Extent | Failure:
        return self.reserving.reserve(session, nbytes, pools)

    def publish(self, session: Session, ns: str, generation: int, item: AllocItem,
                checksum: int = 0) -> Failure | None:
        return self.reserving.publish(session, ns, generation, item, checksum)

    def unpin(self, session: Session, ns: str, keys: list[str]) -> list[bool]:
        return self.deadlines.unpin(session, ns, keys)

    def expire(self) -> None:
        self.slot_holds.plan_over()  # a plan made outside a request (a promotion) is over too
        self.deadlines.expire()
        self.slot_holds.recheck()

    def list_keys(self, ns: str, limit: int, after: tuple[str, str] | None = None,
                  tenant: str | None = None) -> tuple[int, list[Any]]:
        return self.operator.list_keys(ns, limit, after, tenant)

    def evict(self, ns: str, keys: list[str], whole_namespace: bool, everything: bool,
              force: bool, tenant: str | None = None) -> tuple[int, list[str], list[str], list[int]]:
        return self.operator.evict(ns, keys, whole_namespace, everything, force, tenant)

    def held(self, generations: list[int]) -> list[bool]:
        return self.operator.held(generations)

    def fail_waiters(self, code: Code, message: str) -> None:
        self.waiting.fail_all(code, message)

    # ---- the entry life, as the parts take it -------------------------------------------

    def after_unhold(self, entry: Entry) -> None:
        """A reader or pin went away: free a retired entry once no reader is left (pins only
        guard against eviction), or make an unheld READY entry evictable again."""
        if entry.state is State.RETIRED:
            if not entry.readers:
                self.slot_holds.free_unheld([entry])
        elif entry.state is State.READY and not entry.readers and not entry.pins:
            self.placement.make_evictable(entry)

    def unindex(self, entry: Entry, kind: EventKind, keyhash: int | None = None) -> None:
        """A READY entry leaves the index (evicted, deleted, replaced): a ring event says so."""
        del self.index[(entry.ns, entry.key)]
        if entry.readers:  # retired, its bytes still read: kept out of use a while after a restart
            self.journal.uncommit(entry.journal)
        else:  # not adopted any more: its extent may be reused
            self.journal.forget(entry.journal)
            entry.journal = -1
        if self.guaranteed_ready:
            self.guarantee(entry, -align_up(max(entry.nbytes, 1)))
        self.placement.make_unevictable(entry)
        self.announcer.announce(kind, entry, keyhash)

    def retire_or_free(self, entry: Entry) -> None:
        """An unindexed entry: kept (RETIRED) while readers hold it, else freed."""
        if entry.readers:
            entry.state = State.RETIRED
        else:
            self.slot_holds.free_unheld([entry])

    def free(self, entry: Entry) -> None:
        """Give an entry's extent back to its pool and its bytes back to its namespace."""
        if entry.journal >= 0:  # a write's record, or a retired entry's
            self.journal.forget(entry.journal)
        self.host.free(entry.pool, entry.offset, entry.nbytes)
        if entry.pins:  # freed with pins on it (a forced eviction): they hold nothing any more
            self.deadlines.forget(entry)
        del self.by_generation[entry.generation]
        self.slot_holds.retired.pop(entry.generation, None)
        self.uncharge(entry.ns, align_up(max(entry.nbytes, 1)))

    def charge(self, ns: str, nbytes: int) -> None:
        """`ns_used` is by policy scope (Placement.scope: the namespace, or its sized tenant)."""
        ns = self.placement.scope(ns)
        self.ns_used[ns] = self.ns_used.get(ns, 0) + nbytes

    def uncharge(self, ns: str, nbytes: int) -> None:
        ns = self.placement.scope(ns)
        left = self.ns_used[ns] - nbytes
        if left:
            self.ns_used[ns] = left
        else:
            del self.ns_used[ns]

    def guarantee(self, entry: Entry, nbytes: int) -> None:
        """A READY entry's bytes in (or out of) its scope's guaranteed share, if it has one."""
        scope = self.placement.scope(entry.ns)
        if scope in self.guaranteed_ready:
            self.guaranteed_ready[scope] += nbytes

    # ---- introspection ------------------------------------------------------------------

    def count_states(self) -> dict[State, int]:
        counts = collections.Counter(e.state for e in self.by_generation.values())
        return {state: counts.get(state, 0) for state in State}

    def writes_in_progress(self) -> int:
        """Named puts between alloc and commit. O(sessions)."""
        return sum(len(s.writes) for s in self._sessions.values())

    def lease_totals(self) -> tuple[int, int, int]:
        """(read leases and entries read slots hold, pins, parked waiters) over all sessions."""
        sessions = self._sessions.values()
        viewed, pinned = self.slot_holds.snapshot()  # one scan of the read slots for both
        return (sum(sum(s.leases.values()) for s in sessions) + len(viewed),
                sum(len(s.pins) for s in sessions) + sum(pinned.values()),
                sum(len(s.waiters) for s in sessions))

    def reservation_totals(self) -> tuple[int, int]:
        """(reservations, bytes they hold). O(1)."""
        return self.reserving.totals()
