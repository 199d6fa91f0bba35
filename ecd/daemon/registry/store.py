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

Tiers: the host pool (its segments, pools 0..n-1) and, with `[pool.cuda]`, one CUDA arena per
device (pools n, n+1, ...), each with its own allocator. An allocation names its tier (Alloc.arena):
it is placed, and evicts for room, only there; host placement never spills into an arena nor an
arena into the host pool. A reservation lives in the tier it was asked for (that of the commit it
rides on). Namespace quotas and guaranteed shares count an entry's bytes whatever its tier.
"""
from __future__ import annotations

import collections
import sys
import time
from typing import Any, Callable, Mapping, Sequence, cast

from ...errors import Code
from ...memory.allocator import ExtentAllocator, align_up
from ...memory.ring import EventKind, RingWriter
from ...protocol import (DTYPE_ITEMSIZE, AllocItem, Extent, Failure, Location, expected_nbytes)
from .entries import Entry, RequestError, Reservation, Scheduler, Session, State, StoreLimits, Waiter
from .deadlines import Deadlines
from .key_index import KeyIndex
from .operator import OperatorRequests
from .placement import Placement
from ..tiers.host_integrity import PoolIntegrity
from .reservations import Reservations
from .waiting import Waiting


SHARED_SHAPES = 4096  # distinct shapes whose tuple entries share (_shared_shape)
PROMOTE_WAIT_S = 30.0  # the longest a get waits for its keys to come back from the disk tier
# Entries stamped (published, read) within this of each other share one float object (24 B
# per entry saved for the entries of a batch); the stamps are for `ecd keys`, not for deadlines.
STAMP_RESOLUTION_S = 0.001


class Store(Placement, Reservations, Waiting, Deadlines, OperatorRequests, PoolIntegrity):
    """The registry. Its jobs beside the entry state machine live in mixins of their own modules:
    placement and eviction (placement.py), reservations for a client's next put
    (reservations.py), parked gets (waiting.py), pins and write deadlines (deadlines.py),
    operator requests (operator.py), a pool file truncated under it (tiers/host_integrity.py)."""

    def __init__(self, pool_sizes: list[int], ring: RingWriter, scheduler: Scheduler,
                 limits: StoreLimits, clock: Callable[[], float] = time.monotonic,
                 namespaces: Mapping[str, Any] | None = None, arena_sizes: list[int] | tuple = ()) -> None:
        self.allocators = [ExtentAllocator(size) for size in [*pool_sizes, *arena_sizes]]
        self.host_pools = tuple(range(len(pool_sizes)))  # the host tier: every shm segment
        self.arena_pools = tuple(range(len(pool_sizes), len(self.allocators)))  # one per CUDA arena
        self.largest_segment = max(pool_sizes)  # no host entry can be bigger than this
        self.ring = ring
        self.scheduler = scheduler
        self.limits = limits
        self.clock = clock
        self._next_generation = 1
        self.index = KeyIndex()  # READY entries only, by (namespace, key)
        self.by_generation: dict[int, Entry] = {}  # every entry that holds an extent
        self.reservations: dict[int, Reservation] = {}  # by generation (reservations.py)
        self.reserved_bytes = 0
        self._shapes: dict[tuple[int, ...], tuple[int, ...]] = {}
        self._last_stamp = float("-inf")
        self.evictable: collections.OrderedDict[int, Entry] = collections.OrderedDict()  # LRU first
        self.evictable_bytes = [0] * len(self.allocators)  # per pool, kept with `evictable`
        self.waiters: dict[tuple[str, str], set[Waiter]] = {}
        self._deadlines: list[tuple[float, int, int]] = []  # (when, generation, session id or 0)
        self._compact_deadlines_at = 4096  # heap size at which stale deadlines are swept out
        self._sessions: dict[int, Session] = {}
        self.counters = collections.Counter()
        # Namespaces: bytes held by each one's named entries, and the configured policies.
        self.ns_used: dict[str, int] = {}
        self.policies: dict[str, tuple[int, int]] = {}  # configured namespace -> (quota, guaranteed)
        self.quotas: dict[str, int] = {}  # only namespaces with a quota
        self.guarantees: dict[str, int] = {}  # only namespaces with a guaranteed share
        # Bytes of READY entries of each namespace with a guaranteed share: what the share protects
        # (ns_used also counts writes that may be aborted and replaced entries about to be freed).
        self.guaranteed_ready: dict[str, int] = {}
        # Each quota'd namespace's evictable entries in LRU order, kept with `evictable`.
        self._quota_lru: dict[str, collections.OrderedDict[int, Entry]] = {}
        self._quota_evictable_bytes: dict[str, int] = {}
        self.quota_refusals = collections.Counter()  # namespace -> items refused QUOTA_EXCEEDED
        self.quota_refused = 0  # all of them: the server compares it to label a request's outcome
        self._protected = 0  # entries the last failed eviction plan left for their guaranteed share
        self.verify_namespaces: frozenset[str] = frozenset()  # commits into these need a checksum
        self.disk: Any = None  # the disk tier (disk_tier.DiskTier) with [pool.disk]; it sets itself here
        self.cut_writes: dict[int, Failure] = {}  # writes a pool truncation took (tiers/host_integrity.py)
        self._unallocated: dict[int, int] = {}
        self.set_namespaces(namespaces or {})

    # ---- namespaces ---------------------------------------------------------------------

    def set_namespaces(self, namespaces: Mapping[str, Any]) -> None:
        """Apply `[namespaces.NAME]` policies (objects with .quota and .guaranteed, in bytes; 0:
        none; and .verify: commits need a checksum). Also used by SIGHUP: a namespace already over a lowered quota is not evicted now;
        its next allocation evicts its own entries. O(entries)."""
        self.policies = {name: (int(ns.quota), int(ns.guaranteed)) for name, ns in namespaces.items()}
        self.verify_namespaces = frozenset(name for name, ns in namespaces.items() if getattr(ns, "verify", False))
        self.quotas = {name: q for name, (q, _) in self.policies.items() if q > 0}
        self.guarantees = {name: g for name, (_, g) in self.policies.items() if g > 0}
        self._quota_lru = {name: collections.OrderedDict() for name in self.quotas}
        self._quota_evictable_bytes = dict.fromkeys(self.quotas, 0)
        self.guaranteed_ready = dict.fromkeys(self.guarantees, 0)
        for entry in self.index.values():
            if entry.ns in self.guaranteed_ready:
                self.guaranteed_ready[entry.ns] += align_up(max(entry.nbytes, 1))
        for entry in self.evictable.values():  # LRU first, so each namespace's order is kept
            lru = self._quota_lru.get(entry.ns)
            if lru is not None:
                lru[entry.generation] = entry
                self._quota_evictable_bytes[entry.ns] += align_up(max(entry.nbytes, 1))

    # ---- sessions -----------------------------------------------------------------------

    def open_session(self, session_id: int, pid: int) -> Session:
        session = Session(session_id, pid)
        self._sessions[session_id] = session
        return session

    def session(self, session_id: int) -> Session | None:
        return self._sessions.get(session_id)

    def close_session(self, session: Session, reclaimed: bool = False, reason: str = "client_exit") -> None:
        """Reclaim everything a departed client held: writes, read leases, pins, waiters.
        `reclaimed`: the client died (`reason` client_exit) or went silent (session_ttl) rather
        than said goodbye (counted for operators by reason)."""
        if session.closed:
            return
        session.closed = True
        if reclaimed:
            self.counters["reclaimed_sessions"] += 1
            self.counters[f"reclaimed_{reason}"] += (sum(session.leases.values()) + len(session.pins)
                                                     + len(session.writes))
        self._sessions.pop(session.id, None)
        for waiter in list(session.waiters):
            self._drop_waiter(waiter)
        for written in list(session.writes.values()):
            self._free(written)
        session.writes.clear()
        if session.reservation is not None:
            self.end_reservation(session.reservation, "reclaimed")
        for generation, count in session.leases.items():
            entry = self.by_generation.get(generation)
            if entry is not None:
                entry.readers -= count
                self._after_unhold(entry)
        session.leases.clear()
        for generation in session.pins:
            entry = self.by_generation.get(generation)
            if entry is not None:
                entry.pins -= 1
                self._after_unhold(entry)
        session.pins.clear()

    @property
    def sessions(self) -> int:
        return len(self._sessions)

    # ---- validation ---------------------------------------------------------------------

    def check_batch(self, n: int) -> None:
        if n > self.limits.max_batch:
            raise RequestError(Code.LIMIT, f"batch of {n} items exceeds limits.max_batch={self.limits.max_batch}")

    def check_key(self, ns: str, key: str) -> Failure | None:
        limit = self.limits.max_key_bytes
        if len(key) == 0:
            return Failure(Code.INVALID, "empty key")
        if len(key) > limit or len(key.encode()) > limit:
            return Failure(Code.LIMIT, f"key of {len(key.encode())} bytes exceeds limits.max_key_bytes={limit}")
        if len(ns) > limit or len(ns.encode()) > limit:
            return Failure(Code.LIMIT, f"namespace longer than limits.max_key_bytes={limit}")
        return None

    def tier(self, arena: int) -> tuple[int, ...]:
        """The pools an Alloc with this `arena` may use: -1 the host pool's segments, else exactly
        that arena (RequestError INVALID when `arena` is not an arena's pool index)."""
        if arena == -1:
            return self.host_pools
        if arena in self.arena_pools:
            return (arena,)
        arenas = (f"pools {self.arena_pools[0]}..{self.arena_pools[-1]} are CUDA arenas"
                  if self.arena_pools else "this daemon has no CUDA arenas ([pool.cuda])")
        raise RequestError(Code.INVALID, f"arena={arena} is not a CUDA arena: {arenas}; -1 is the host pool")

    def tier_of(self, generation: int) -> tuple[int, ...]:
        """The tier of an entry or reservation (the host pool when the generation names none)."""
        held = self.by_generation.get(generation) or self.reservations.get(generation)
        return (held.pool,) if held is not None and held.pool in self.arena_pools else self.host_pools

    def _check_item(self, ns: str, item: AllocItem, pools: tuple[int, ...] | None = None) -> Failure | None:
        failure = self.check_key(ns, item.key)
        if failure is not None:
            return failure
        if item.dtype not in DTYPE_ITEMSIZE:
            return Failure(Code.INVALID, f"unknown dtype {item.dtype!r}")
        if len(item.shape) > self.limits.max_ndim:
            return Failure(Code.LIMIT, f"{len(item.shape)} dimensions exceed limits.max_ndim={self.limits.max_ndim}")
        want = expected_nbytes(item.dtype, item.shape)
        if want != item.nbytes:
            return Failure(Code.INVALID, f"nbytes={item.nbytes} but shape {list(item.shape)} of "
                                         f"{item.dtype} needs {want}")
        too_large = self._too_large(item.nbytes, self.host_pools if pools is None else pools)
        if too_large:
            return Failure(Code.INVALID, too_large)
        return None

    # ---- put ----------------------------------------------------------------------------

    def alloc(self, session: Session, ns: str, item: AllocItem,
              pools: tuple[int, ...] | None = None, clean_first: bool = False) -> Extent | Failure:
        """Place a new WRITING entry in `pools` (a tier(): default the host pool); `clean_first`:
        see Placement._place."""
        pools = self.host_pools if pools is None else pools
        failure = self._check_item(ns, item, pools)
        if failure is not None:
            self.counters["alloc_refused"] += 1
            return failure
        victims = self._quota_victims(ns, align_up(max(item.nbytes, 1)))
        if isinstance(victims, Failure):
            return victims
        placed = self._place(item.nbytes, ns, victims, pools=pools, clean_first=clean_first)
        if placed is None:
            self.counters["pool_full"] += 1
            return Failure(Code.POOL_FULL, self._pool_full_message(item.nbytes, pools))
        entry = self._new_write(session, placed, ns, item.key, item.dtype, item.shape, item.nbytes)
        return Extent(entry.generation, entry.pool, entry.offset)

    def _take_generation(self) -> int:
        generation = self._next_generation
        self._next_generation += 1
        return generation

    def _shared_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
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
        if now - self._last_stamp < STAMP_RESOLUTION_S:
            return self._last_stamp
        self._last_stamp = now
        return now

    def _new_write(self, session: Session, placed: tuple[int, int], ns: str, key: str, dtype: str,
                   shape: Sequence[int], nbytes: int) -> Entry:
        generation = self._take_generation()
        now = self.clock()
        # Namespaces and dtypes interned (they repeat across entries; the interpreter drops an
        # interned string nothing refers to, so client-chosen names cannot pile up).
        ns, dtype = sys.intern(ns), sys.intern(dtype)
        entry = Entry(generation, ns, key, dtype, self._shared_shape(shape), nbytes,
                      placed[0], placed[1], owner=session, last_access=now,
                      when=now + self.limits.write_ttl)
        self.by_generation[generation] = entry
        self.ns_used[ns] = self.ns_used.get(ns, 0) + align_up(max(nbytes, 1))
        session.writes[generation] = entry
        self._push_deadline(entry.write_deadline, generation, 0)
        return entry

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
        refused = self.refuse_cut_write(generation)
        if refused is not None:
            self._free(entry)  # its bytes are zeros now: never published
            return refused
        if not checksum and entry.ns in self.verify_namespaces:
            self._free(entry)  # refused, not left WRITING until its TTL
            self.counters["unchecksummed_refused"] += 1
            return Failure(Code.INVALID, f"namespace {entry.ns!r} is configured with verify = true: a put "
                                         f"into it must carry a checksum (key {entry.key!r} not stored)")
        entry.checksum = checksum
        entry.owner = None
        entry.state = State.READY
        session.reserve_ns = entry.ns  # a reservation asked for with this commit counts toward it
        entry.last_access = entry.when = self._stamp()  # `when` is now its publication time
        disk = self.disk
        if disk is not None:
            record = disk.record(entry.ns, entry.key)
            if record is not None and record.generation != entry.generation:
                disk.drop(entry.ns, entry.key)  # a new value: the old bytes on disk must never be served
        old = self.index.get((entry.ns, entry.key))
        if old is not None:  # an atomic replace: current readers keep the old bytes
            self._unindex(old, EventKind.DELETED)
            self.counters["evicted_replaced"] += 1
            if old.pins:
                self._move_pins(old, entry)
            self._retire_or_free(old)
        self.index[(entry.ns, entry.key)] = entry
        if entry.ns in self.guaranteed_ready:
            self.guaranteed_ready[entry.ns] += align_up(max(entry.nbytes, 1))
        if not entry.pins:
            self._make_evictable(entry)
        self._announce(EventKind.PUBLISHED, entry)
        self.counters["puts"] += 1
        self.counters["written_bytes"] += entry.nbytes
        self._wake_waiters(entry.ns, entry.key)
        return None

    def abort(self, session: Session, generation: int) -> Failure | None:
        """Give back a write (or this client's reservation) before it is committed."""
        reservation = self.reservations.get(generation)
        if reservation is not None:
            if reservation.owner is not session:
                return Failure(Code.NOT_OWNER, f"generation {generation} is another client's reservation")
            self.end_reservation(reservation, "aborted")
            return None
        entry = session.writes.pop(generation, None)
        if entry is None:
            entry = self.by_generation.get(generation)
            if entry is not None and entry.state is State.WRITING:
                return Failure(Code.NOT_OWNER, f"generation {generation} is being written by another client")
            return Failure(Code.STALE, f"generation {generation} is not an entry being written")
        self._free(entry)
        return None

    # ---- get ----------------------------------------------------------------------------

    def acquire(self, session: Session, ns: str, keys: list[str], wait_s: float,
                on_done: Callable[[list[Location | Failure]], None],
                park_for_disk: bool = True) -> list[Location | Failure] | None:
        """Read-lease every key. Returns the results now, or None after parking the request
        (on_done fires when every key is READY or wait_s passes, whichever comes first).
        `park_for_disk` False (a peer's lookup, answered at once): keys on disk are missing now,
        and start coming back for the next ask."""
        self.check_batch(len(keys))
        for key in keys:
            failure = self.check_key(ns, key)
            if failure is not None:
                raise RequestError(cast(Code, failure.code), failure.message)  # check_key gives Code values
        if len(session.leases) + len(keys) > self.limits.max_leases_per_client:
            raise RequestError(Code.LIMIT, f"client holds {len(session.leases)} read leases; "
                                           f"limits.max_leases_per_client={self.limits.max_leases_per_client}")
        # entries a pool truncation cut are dropped before they could be leased
        self.check_pools(entry.pool for key in keys if (entry := self.index.get((ns, key))) is not None)
        missing = {key for key in keys if (ns, key) not in self.index}
        # keys on disk come back into the host pool first (disk_tier.promote): the request parks
        # until they are READY, however short its wait (a promotion failure answers it at once)
        promotable = {key for key in missing if self.disk.holds(ns, key)} if self.disk is not None and missing else ()
        if promotable and not park_for_disk:
            for key in promotable:
                self.disk.promote(ns, key)
            promotable = ()
        if missing and (wait_s > 0 or promotable):
            if len(session.waiters) >= self.limits.max_waiters_per_client:
                raise RequestError(Code.LIMIT, f"client has {len(session.waiters)} parked requests; "
                                               f"limits.max_waiters_per_client={self.limits.max_waiters_per_client}")
            # A parked key costs the daemon a few hundred bytes: without a bound on keys, the
            # request limit times max_batch would let one client park tens of GB.
            max_keys = self.max_parked_keys
            if session.parked_keys + len(keys) > max_keys:
                raise RequestError(Code.LIMIT, f"client has {session.parked_keys} keys parked in "
                                               f"{len(session.waiters)} requests; {len(keys)} more would pass "
                                               f"{max_keys}, the most one client may wait for (the larger of "
                                               f"limits.max_batch and limits.max_waiters_per_client)")
            patient = wait_s > 0
            waiter = Waiter(session, ns, keys, missing if patient else set(promotable), on_done, patient=patient)
            for key in waiter.missing:
                self.waiters.setdefault((ns, key), set()).add(waiter)
            session.waiters.add(waiter)
            session.parked_keys += len(keys)
            wait = min(wait_s, self.limits.max_wait)
            if promotable:
                wait = max(wait, PROMOTE_WAIT_S)
                for key in promotable:
                    self.disk.promote(ns, key)
            waiter.timer = self.scheduler.call_later(wait, lambda: self._expire_waiter(waiter))
            return None
        return self._lease_all(session, ns, keys)

    def _lease_all(self, session: Session, ns: str, keys: list[str]) -> list[Location | Failure]:
        results: list[Location | Failure] = []
        now = self._stamp()
        for key in keys:
            entry = self.index.get((ns, key))
            if entry is None:
                self.counters["misses"] += 1
                results.append(Failure(Code.KEY_NOT_FOUND, f"no entry {key!r} in namespace {ns!r}"))
                continue
            self.counters["hits"] += 1
            self.counters["read_bytes"] += entry.nbytes
            entry.readers += 1
            entry.last_access = now
            self._make_unevictable(entry)
            session.leases[entry.generation] += 1
            results.append(entry.location())
        return results

    def release(self, session: Session, generation: int) -> Failure | None:
        if session.leases.get(generation, 0) <= 0:
            return Failure(Code.NOT_OWNER, f"this client holds no read lease on generation {generation}")
        session.leases[generation] -= 1
        if session.leases[generation] == 0:
            del session.leases[generation]
        entry = self.by_generation[generation]
        entry.readers -= 1
        self._after_unhold(entry)
        return None

    # ---- exists / pins / delete ---------------------------------------------------------

    def is_local(self, ns: str, key: str) -> bool:
        """READY here, or on this node's disk tier (a read brings it back): no peer needed."""
        return (ns, key) in self.index or (self.disk is not None and self.disk.holds(ns, key))

    def exists(self, session: Session, ns: str, keys: list[str], pin_s: float) -> list[bool]:
        self.check_batch(len(keys))
        if pin_s > 0 and len(session.pins) + len(keys) > self.limits.max_pins_per_client:
            raise RequestError(Code.LIMIT, f"client holds {len(session.pins)} pins; "
                                           f"limits.max_pins_per_client={self.limits.max_pins_per_client}")
        now = self.clock()
        found = []
        disk = self.disk
        for key in keys:
            entry = self.index.get((ns, key))
            if entry is None and disk is not None and disk.holds(ns, key):
                found.append(True)
                self.counters["hits"] += 1
                if pin_s > 0:
                    disk.promote(ns, key)  # a load follows a pinned lookup (vLLM): bring it back now
                else:
                    disk.touch(ns, key)
                continue
            found.append(entry is not None)
            if entry is None:
                self.counters["misses"] += 1
                continue
            self.counters["hits"] += 1
            entry.last_access = now
            if pin_s > 0:
                self._pin(session, entry, now + min(pin_s, self.limits.max_pin))
            elif entry.generation in self.evictable:
                self._make_evictable(entry)  # to the most recently used end
        return found

    def delete(self, ns: str, keys: list[str]) -> list[bool]:
        self.check_batch(len(keys))
        result = []
        for key in keys:
            entry = self.index.get((ns, key))
            if entry is not None:
                self._remove(entry)
            on_disk = self.disk is not None and self.disk.drop(ns, key)
            result.append(entry is not None or on_disk)
        return result

    def _remove(self, entry: Entry) -> None:
        if self.disk is not None:
            self.disk.drop(entry.ns, entry.key)  # first: its record must not keep the key present
        self._unindex(entry, EventKind.DELETED)
        self.counters["evicted_deleted"] += 1
        self._retire_or_free(entry)

    # ---- operator requests --------------------------------------------------------------

    # ---- internals ----------------------------------------------------------------------

    def _after_unhold(self, entry: Entry) -> None:
        """A reader or pin went away: free a retired entry once no reader is left (pins only
        guard against eviction), or make an unheld READY entry evictable again."""
        if entry.state is State.RETIRED:
            if not entry.readers:
                self._free(entry)
        elif entry.state is State.READY and not entry.readers and not entry.pins:
            self._make_evictable(entry)

    def _make_evictable(self, entry: Entry) -> None:
        lru = self._quota_lru.get(entry.ns) if self._quota_lru else None
        if entry.generation in self.evictable:
            self.evictable.move_to_end(entry.generation)
            if lru is not None:
                lru.move_to_end(entry.generation)
        else:
            nbytes = align_up(max(entry.nbytes, 1))
            self.evictable_bytes[entry.pool] += nbytes
            self.evictable[entry.generation] = entry  # the most recently used end
            if lru is not None:
                lru[entry.generation] = entry
                self._quota_evictable_bytes[entry.ns] += nbytes

    def _make_unevictable(self, entry: Entry) -> None:
        if self.evictable.pop(entry.generation, None) is not None:
            nbytes = align_up(max(entry.nbytes, 1))
            self.evictable_bytes[entry.pool] -= nbytes
            lru = self._quota_lru.get(entry.ns) if self._quota_lru else None
            if lru is not None:
                del lru[entry.generation]
                self._quota_evictable_bytes[entry.ns] -= nbytes

    def _unindex(self, entry: Entry, kind: EventKind) -> None:
        del self.index[(entry.ns, entry.key)]
        if entry.ns in self.guaranteed_ready:
            self.guaranteed_ready[entry.ns] -= align_up(max(entry.nbytes, 1))
        self._make_unevictable(entry)
        self._announce(kind, entry)

    def _announce(self, kind: EventKind, entry: Entry) -> None:
        """The ring event of `entry` being published, evicted or deleted. While the disk tier
        holds a record of the key (spilled, or promoted from it), the record keeps the key
        present: only the event is written, the presence table stays as it is."""
        if self.disk is not None and self.disk.holds(entry.ns, entry.key):
            self.ring.append(kind, entry.keyhash, entry.generation)
        elif kind is EventKind.PUBLISHED:
            self.ring.publish(entry.keyhash, entry.generation)
        else:
            self.ring.unpublish(kind, entry.keyhash, entry.generation)

    def _retire_or_free(self, entry: Entry) -> None:
        if entry.readers:
            entry.state = State.RETIRED
        else:
            self._free(entry)

    def _free(self, entry: Entry) -> None:
        self.allocators[entry.pool].free_extent(entry.offset, entry.nbytes)
        del self.by_generation[entry.generation]
        self._uncharge(entry.ns, align_up(max(entry.nbytes, 1)))

    def _uncharge(self, ns: str, nbytes: int) -> None:
        left = self.ns_used[ns] - nbytes
        if left:
            self.ns_used[ns] = left
        else:
            del self.ns_used[ns]

    # ---- introspection ------------------------------------------------------------------

    def count_states(self) -> dict[State, int]:
        counts = collections.Counter(e.state for e in self.by_generation.values())
        return {state: counts.get(state, 0) for state in State}

    def writes_in_progress(self) -> int:
        """Named puts between alloc and commit. O(sessions)."""
        return sum(len(s.writes) for s in self._sessions.values())

    def lease_totals(self) -> tuple[int, int, int]:
        """(read leases, pins, parked waiters) over all sessions."""
        sessions = self._sessions.values()
        return (sum(sum(s.leases.values()) for s in sessions), sum(len(s.pins) for s in sessions),
                sum(len(s.waiters) for s in sessions))
