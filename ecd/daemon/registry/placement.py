"""Where a new extent goes, and what is evicted to make room for it: placement in a tier, LRU
eviction planned before anything is evicted (nothing goes unless the hole it opens is big
enough), namespace quotas (a namespace over its quota evicts its own LRU entries) and guaranteed
shares (never evicted below them for another namespace), and the LRU order itself. A part the
Store owns (store.placement): it works on the store's records (state.RecordSet: the index, the LRU
order, the namespaces' bytes) and allocates through the host tier (tiers/host.py).

A policy's scope is a namespace ([namespaces.NAME]) or, for a tenant with a size ([tenants.NAME]
size), all of that tenant's namespaces together, named TENANT NUL (`scope`): a tenant's size is
its scope's quota and guaranteed share at once, so it evicts only its own entries for its size,
and no other tenant's put evicts it below that."""
from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, Callable, Mapping

from ...errors import Code
from ...memory.allocator import ALIGNMENT, align_up
from ...memory.ring import TENANT_SEP, EventKind, tenant_namespace
from ...protocol import AllocItem, Failure
from .entries import Entry, State

if TYPE_CHECKING:  # pragma: no cover
    from .state import RecordSet


# a promotion's preference for entries already on disk looks this far into the LRU order (~1 ms)
CLEAN_FIRST_WALK = 4096
PLAN_TRIES = 3  # plans a put may make when readers' new slots keep a plan's victims (a rare race)


class Placement:
    def __init__(self, records: "RecordSet") -> None:
        self.r = records
        # Each quota'd namespace's evictable entries in LRU order, and their bytes: kept with the
        # store's `evictable` (make_evictable / make_unevictable), so a quota finds its victims
        # without walking other namespaces' entries.
        self.quota_lru: dict[str, collections.OrderedDict[int, Entry]] = {}
        self.quota_evictable_bytes: dict[str, int] = {}
        self.protected = 0  # entries the last failed eviction plan left for their guaranteed share
        self.tenant_scopes = False  # a tenant has a size: its namespaces count toward its scope

    # ---- policies -------------------------------------------------------------------------

    def set_policies(self, namespaces: Mapping[str, Any], tenants: Mapping[str, Any]) -> None:
        """`[namespaces.NAME]` (.quota, .guaranteed in bytes, 0: none; .verify: commits need a
        checksum) and each tenant's .size (its scope's quota and guaranteed share). At start, and
        on SIGHUP (tenants' sizes are the running daemon's then: the scopes entries were charged to
        stay): a namespace already over a lowered quota is not evicted now; its next allocation
        evicts its own entries. O(entries)."""
        r = self.r
        r.policies = {name: (int(ns.quota), int(ns.guaranteed)) for name, ns in namespaces.items()}
        r.verify_namespaces = frozenset(name for name, ns in namespaces.items() if getattr(ns, "verify", False))
        sized = {tenant_namespace(name, ""): int(t.size) for name, t in tenants.items() if int(t.size)}
        self.tenant_scopes = bool(sized)
        r.policies.update((scope, (size, size)) for scope, size in sized.items())
        r.quotas = {name: q for name, (q, _) in r.policies.items() if q > 0}
        r.guarantees = {name: g for name, (_, g) in r.policies.items() if g > 0}
        r.guaranteed_ready = dict.fromkeys(r.guarantees, 0)
        for entry in r.index.values():
            scope = self.scope(entry.ns)
            if scope in r.guaranteed_ready:
                r.guaranteed_ready[scope] += align_up(max(entry.nbytes, 1))
        self.reset_quotas()

    def scope(self, ns: str) -> str:
        """The policy scope an entry of `ns` counts toward (see the module's docstring)."""
        if self.tenant_scopes and TENANT_SEP in ns:
            return ns[:ns.index(TENANT_SEP) + 1]
        return ns

    @staticmethod
    def tenant_of_scope(scope: str) -> str:
        """The tenant whose size `scope` is ("" for a namespace's scope)."""
        return scope[:-1] if scope.endswith(TENANT_SEP) else ""

    def scope_name(self, scope: str) -> str:
        """How a refusal names a scope."""
        tenant = self.tenant_of_scope(scope)
        return f"tenant {tenant!r}" if tenant else f"namespace {scope!r}"

    # ---- the LRU order --------------------------------------------------------------------

    def reset_quotas(self) -> None:
        """The namespaces' quotas changed (Store.set_namespaces): their LRU orders rebuilt. O(entries)."""
        r = self.r
        self.quota_lru = {name: collections.OrderedDict() for name in r.quotas}
        self.quota_evictable_bytes = dict.fromkeys(r.quotas, 0)
        for entry in r.evictable.values():  # LRU first, so each namespace's order is kept
            scope = self.scope(entry.ns)
            lru = self.quota_lru.get(scope)
            if lru is not None:
                lru[entry.generation] = entry
                self.quota_evictable_bytes[scope] += align_up(max(entry.nbytes, 1))

    def read_locally(self, generations: list[int]) -> None:
        """Entries a client copied without a round trip (client/local_read.py): hits, and the
        recently used end of the eviction order. Generations that are gone or not READY are
        skipped: the report comes after the reads, and a client may name anything."""
        r = self.r
        now, by_generation, evictable = r.clock(), r.by_generation, r.evictable
        hits = read_bytes = 0
        for generation in generations:
            entry = by_generation.get(generation)
            if entry is None or entry.state is not State.READY:
                continue
            hits += 1
            read_bytes += entry.nbytes
            entry.last_access = now
            if generation in evictable:
                self.make_evictable(entry)  # to the most recently used end
        r.counters.update(hits=hits, read_bytes=read_bytes, local_reads=hits)

    def make_evictable(self, entry: Entry) -> None:
        """An unheld READY entry (or one just used: to the most recently used end)."""
        r = self.r
        lru, scope = None, ""
        if self.quota_lru:  # (no quotas: no scope to work out on this path, every read's)
            scope = self.scope(entry.ns)
            lru = self.quota_lru.get(scope)
        if entry.generation in r.evictable:
            r.evictable.move_to_end(entry.generation)
            if lru is not None:
                lru.move_to_end(entry.generation)
        else:
            nbytes = align_up(max(entry.nbytes, 1))
            r.evictable_bytes[entry.pool] += nbytes
            r.evictable[entry.generation] = entry  # the most recently used end
            if lru is not None:
                lru[entry.generation] = entry
                self.quota_evictable_bytes[scope] += nbytes

    def make_unevictable(self, entry: Entry) -> None:
        """A leased, pinned or unindexed entry: out of the LRU order."""
        r = self.r
        if r.evictable.pop(entry.generation, None) is not None:
            nbytes = align_up(max(entry.nbytes, 1))
            r.evictable_bytes[entry.pool] -= nbytes
            if self.quota_lru:
                scope = self.scope(entry.ns)
                lru = self.quota_lru.get(scope)
                if lru is not None:
                    del lru[entry.generation]
                    self.quota_evictable_bytes[scope] -= nbytes

    # ---- quotas and room ------------------------------------------------------------------

    def quota_victims(self, ns: str, size: int) -> list[Entry] | Failure:
        """The scope's own LRU entries that must go for `size` more bytes of `ns` to fit under its
        quota ([] when it fits or has no quota), or QUOTA_EXCEEDED when they cannot make it fit."""
        r = self.r
        ns = self.scope(ns)
        quota = r.quotas.get(ns)
        if quota is None:
            return []
        used = r.ns_used.get(ns, 0)
        over = used + size - quota
        if over <= 0:
            return []
        lru = self.quota_lru[ns]
        viewed = [lru[g] for g in r.slot_holds.kept() & lru.keys()]  # views and pins held by slots stay
        evictable = self.quota_evictable_bytes[ns] - sum(align_up(max(e.nbytes, 1)) for e in viewed)
        if size > quota or evictable < over:
            r.quota_refusals[ns] += 1
            r.quota_refused += 1
            if size > quota:
                why = f"an entry of {size} bytes (whole {ALIGNMENT}-byte units) is larger than the quota itself"
            else:
                why = (f"{used - evictable} bytes of it are held (leased, pinned, being written, "
                       f"reserved or replaced while still read) and only {evictable} may be evicted")
            return Failure(Code.QUOTA_EXCEEDED, f"{self.scope_name(ns)} is at its quota of {quota} bytes: "
                                                f"{used} bytes in use, {size} more requested; {why}")
        victims, kept = [], {e.generation for e in viewed}
        for entry in lru.values():
            if entry.generation in kept:
                continue
            victims.append(entry)
            over -= align_up(max(entry.nbytes, 1))
            if over <= 0:
                break
        return victims

    def place_run(self, ns: str, items: list[AllocItem], pools: tuple[int, ...]) -> list[tuple[int, int]] | None:
        """(pool, offset) of each of an Alloc's items, one after the other in a single free extent
        of one of `pools` (ExtentAllocator.alloc_run: one search for the batch), when every item
        passes its checks, the namespace has no quota, and a hole holds them all without evicting
        anything; else None (nothing taken), and the items go one by one (Store.alloc)."""
        r = self.r
        if len(items) < 2 or self.scope(ns) in r.quotas:
            return None
        item_failure = r.checks.item
        sizes = []
        for item in items:
            if item_failure(ns, item, pools) is not None:
                return None  # refused in its own slot, one by one
            sizes.append(align_up(max(item.nbytes, 1)))
        for pool in pools:
            offsets = r.host.allocators[pool].alloc_run(sizes)
            if offsets is not None:
                return [(pool, offset) for offset in offsets]
        return None

    def place(self, nbytes: int, ns: str | None, required: list[Entry] | tuple = (),
               evict: bool = True, pools: tuple[int, ...] | None = None,
               clean_first: bool = False) -> tuple[int, int] | None:
        """(pool, offset) of a new extent in one of `pools` (default the host pool), evicting
        `required` (the namespace's own entries its quota demands, in any tier) and, when no hole
        is big enough, what else in `pools` may be evicted for room; None (and nothing evicted)
        when that cannot make a big enough contiguous hole. `clean_first` (a promotion from the
        disk tier): entries whose bytes are there already (LowerTier.clean: dropped
        without a write) are evicted in preference to any other, when they alone can make the
        room: a promotion then never shares the disk with a spill of its own making."""
        host = self.r.host
        pools = host.pools_for(self.scope(ns) if ns else "") if pools is None else pools
        size = align_up(max(nbytes, 1))
        if required and any(host.allocators[p].largest_free >= size for p in pools):
            self._evict_all(required, ())
            required = ()
        if not required:  # the common path: O(log n) per pool, no eviction
            placed = host.alloc(size, pools)
            if placed is not None:
                return placed
        if not evict:
            return None
        for _ in range(PLAN_TRIES):
            victims = None
            if clean_first:
                victims = self._plan_room(size, ns, required, pools, self.r.lower_tier.clean)
            if victims is None:
                victims = self._plan_room(size, ns, required, pools)
            if victims is None:
                return None
            self._evict_all(required, victims)
            required = ()
            placed = host.alloc(size, pools)
            if placed is not None:
                return placed
            # a reader took a read slot on a victim after the plan looked: it stays until released
        return None

    def _evict_all(self, required, victims) -> None:
        gone = [self.evict(victim, "evicted_quota") for victim in required]
        gone += [self.evict(victim, "evictions") for victim in victims]  # for room: "capacity" in metrics
        self.r.slot_holds.free_unheld(gone)  # once every event is out: one scan of the read slots

    def evict(self, victim: Entry, counter: str) -> Entry:
        """Evict a READY entry nothing holds: to the lower tier (which may keep its bytes), out of
        the index; counted under `counter`. The caller frees it (SlotHolds.free_unheld)."""
        r = self.r
        r.lower_tier.spill(victim)  # first: a record that keeps its bytes keeps the key present
        r.unindex(victim, EventKind.EVICTED)
        r.counters[counter] += 1
        return victim

    def _plan_room(self, size: int, ns: str | None, required, pools: tuple[int, ...],
                   only: Callable[[Entry], bool] | None = None) -> list[Entry] | None:
        """The entries to evict for a contiguous hole of `size` bytes, found without evicting:
        walk the LRU order (after `required`), freeing each victim on paper and merging it with
        its free or already-freed neighbours, until one run is big enough. Only the victims in
        that run are returned, so entries elsewhere are not thrown away for nothing. An entry of
        another namespace is skipped when evicting it would take that namespace's READY bytes
        below its guaranteed share (bytes being written or replaced-but-still-read do not count:
        they may be gone soon); `ns`'s own entries may always go. `only`: the entries that may go
        (all evictable ones when None), looked for among the CLEAN_FIRST_WALK least recently used
        only (a preference must not cost a walk of millions). O(entries walked)."""
        self.protected = 0
        r = self.r
        allocators = r.host.allocators
        run_end: list[dict[int, int]] = [{} for _ in allocators]  # per pool: start -> end of runs freed on paper
        run_start: list[dict[int, int]] = [{} for _ in allocators]  # end -> start

        def free_on_paper(entry: Entry) -> tuple[int, int]:
            allocator, ends, starts = allocators[entry.pool], run_end[entry.pool], run_start[entry.pool]
            start = entry.offset
            end = start + align_up(max(entry.nbytes, 1))
            left = starts.pop(start, None)
            if left is not None:
                del ends[left]
            else:
                left = allocator.free_ending_at(start)
            if left is not None:
                start = left
            right = ends.pop(end, None)
            if right is not None:
                del starts[right]
            else:
                right = allocator.free_starting_at(end)
            if right is not None:
                end = right
            ends[start] = end
            starts[end] = start
            return start, end

        def in_run(pool: int, start: int, end: int, walked) -> list[Entry]:
            return [v for v in walked if v.pool == pool and start <= v.offset < end]

        for entry in required:  # they go whatever happens: the quota needs them gone
            start, end = free_on_paper(entry)
            if end - start >= size and entry.pool in pools:
                return []
        # Only segments of the tier whose free plus evictable bytes could hold it are worth a look.
        candidates = [False] * len(allocators)
        for pool in pools:
            candidates[pool] = allocators[pool].free + r.evictable_bytes[pool] >= size
        if not any(candidates):
            return None
        skip = {e.generation for e in required} | r.slot_holds.kept()  # what readers' slots hold stays
        guarantees, scope = r.guarantees, self.scope
        own = scope(ns) if ns is not None else None
        planned: dict[str, int] = {}  # scope -> bytes this plan takes from it
        walked: list[Entry] = []
        for walked_n, entry in enumerate(r.evictable.values()):
            if only is not None:
                if walked_n >= CLEAN_FIRST_WALK:
                    return None
                if not only(entry):
                    continue
            if not candidates[entry.pool] or entry.generation in skip:
                continue
            if guarantees:
                theirs = scope(entry.ns)
                share = guarantees.get(theirs) if theirs != own else None
                if share is not None:
                    nbytes = align_up(max(entry.nbytes, 1))
                    taken = planned.get(theirs, 0) + nbytes
                    if r.guaranteed_ready[theirs] - taken < share:
                        self.protected += 1
                        continue
                    planned[theirs] = taken
            walked.append(entry)
            start, end = free_on_paper(entry)
            if end - start >= size:
                return in_run(entry.pool, start, end, walked)
        return None

    def pool_full_message(self, nbytes: int, pools: tuple[int, ...]) -> str:
        """POOL_FULL's message: why no room could be made. O(pools): this runs on every refused
        put, and a full pool can hold millions of entries."""
        r = self.r
        tier = [r.host.allocators[p] for p in pools]
        capacity = sum(a.capacity for a in tier)
        used = sum(a.used for a in tier)
        largest = max(a.largest_free for a in tier)
        where = f" in CUDA arena {pools[0]}" if pools[0] in r.host.arena_pools else ""
        slotted = [r.evictable[g] for g in r.slot_holds.kept(plan=False) & r.evictable.keys()]  # views, pins by slots
        held = len(r.index) - len(r.evictable) + len(slotted)
        writing = r.writes_in_progress()
        # Bytes nothing may evict: leased/pinned/viewed entries, writes, reservations, retired bytes.
        held_bytes = used - sum(r.evictable_bytes[p] for p in pools) + sum(
            align_up(max(e.nbytes, 1)) for e in slotted if e.pool in pools)
        protected = (f", {self.protected} kept for their namespace's guaranteed share"
                     if self.protected else "")
        return (f"no room for {nbytes} bytes{where}: {used} of {capacity} bytes in use, largest free extent "
                f"{largest}; evicting what may be evicted cannot make a big enough contiguous hole "
                f"({held_bytes} bytes held: {held} entries leased or pinned, {writing} being written{protected})")
