"""Where a new extent goes, and what is evicted to make room for it: placement in a tier, LRU
eviction planned before anything is evicted (nothing goes unless the hole it opens is big
enough), namespace quotas (a namespace over its quota evicts its own LRU entries) and guaranteed
shares (never evicted below them for another namespace). Mixed into Store: it works on the
Store's allocators, index and LRU order (store.py says what they hold)."""
from __future__ import annotations

from typing import Callable

from ...errors import Code
from ...memory.allocator import ALIGNMENT, align_up
from ...memory.ring import EventKind
from ...protocol import Failure
from .entries import Entry
from .state import RegistryState


# a promotion's preference for entries already on disk looks this far into the LRU order (~1 ms)
CLEAN_FIRST_WALK = 4096


class Placement(RegistryState):
    def _quota_victims(self, ns: str, size: int) -> list[Entry] | Failure:
        """The namespace's own LRU entries that must go for `size` more bytes to fit under its
        quota ([] when it fits or has no quota), or QUOTA_EXCEEDED when they cannot make it fit."""
        quota = self.quotas.get(ns)
        if quota is None:
            return []
        used = self.ns_used.get(ns, 0)
        over = used + size - quota
        if over <= 0:
            return []
        evictable = self._quota_evictable_bytes[ns]
        if size > quota or evictable < over:
            self.quota_refusals[ns] += 1
            self.quota_refused += 1
            if size > quota:
                why = f"an entry of {size} bytes (whole {ALIGNMENT}-byte units) is larger than the quota itself"
            else:
                why = (f"{used - evictable} bytes of it are held (leased, pinned, being written, "
                       f"reserved or replaced while still read) and only {evictable} may be evicted")
            return Failure(Code.QUOTA_EXCEEDED, f"namespace {ns!r} is at its quota of {quota} bytes: "
                                                f"{used} bytes in use, {size} more requested; {why}")
        victims = []
        for entry in self._quota_lru[ns].values():
            victims.append(entry)
            over -= align_up(max(entry.nbytes, 1))
            if over <= 0:
                break
        return victims


    def _largest_in(self, pools: tuple[int, ...]) -> int:
        if pools == self.host_pools:
            return self.largest_segment
        return max(self.allocators[p].capacity for p in pools)


    def _too_large(self, nbytes: int, pools: tuple[int, ...]) -> str | None:
        largest = self._largest_in(pools)
        if nbytes <= largest:
            return None
        where = ("the largest pool segment" if pools == self.host_pools
                 else f"CUDA arena {pools[0]}")
        return f"{nbytes} bytes is larger than {where} ({largest} bytes)"


    def _place(self, nbytes: int, ns: str | None, required: list[Entry] | tuple = (),
               evict: bool = True, pools: tuple[int, ...] | None = None,
               clean_first: bool = False) -> tuple[int, int] | None:
        """(pool, offset) of a new extent in one of `pools` (default the host pool), evicting
        `required` (the namespace's own entries its quota demands, in any tier) and, when no hole
        is big enough, what else in `pools` may be evicted for room; None (and nothing evicted)
        when that cannot make a big enough contiguous hole. `clean_first` (a promotion from the
        disk tier): entries whose bytes are on disk already (disk_tier.DiskTier.clean: dropped
        without a write) are evicted in preference to any other, when they alone can make the
        room: a promotion then never shares the disk with a spill of its own making."""
        pools = self.host_pools if pools is None else pools
        allocators = self.allocators
        size = align_up(max(nbytes, 1))
        if required and any(allocators[p].largest_free >= size for p in pools):
            self._evict_all(required, ())
            required = ()
        if not required:  # the common path: O(log n) per pool, no eviction
            for pool in pools:
                offset = allocators[pool].alloc(size)
                if offset is not None:
                    return pool, offset
        if not evict:
            return None
        victims = None
        if clean_first and self.disk is not None:
            victims = self._plan_room(size, ns, required, pools, self.disk.clean)
        if victims is None:
            victims = self._plan_room(size, ns, required, pools)
        if victims is None:
            return None
        self._evict_all(required, victims)
        for pool in pools:
            offset = allocators[pool].alloc(size)
            if offset is not None:
                return pool, offset
        raise AssertionError("eviction plan did not make the room it promised")


    def _evict_all(self, required, victims) -> None:
        for victim in required:
            self._evict(victim, "evicted_quota")
        for victim in victims:
            self._evict(victim, "evictions")  # for room: "capacity" in metrics


    def _evict(self, victim: Entry, counter: str) -> None:
        if self.disk is not None:
            self.disk.spill(victim)  # first: a record that keeps its bytes keeps the key present
        self._unindex(victim, EventKind.EVICTED)
        self._free(victim)
        self.counters[counter] += 1


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
        self._protected = 0
        allocators = self.allocators
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
            candidates[pool] = allocators[pool].free + self.evictable_bytes[pool] >= size
        if not any(candidates):
            return None
        skip = {e.generation for e in required}
        guarantees = self.guarantees
        planned: dict[str, int] = {}  # namespace -> bytes this plan takes from it
        walked: list[Entry] = []
        for walked_n, entry in enumerate(self.evictable.values()):
            if only is not None:
                if walked_n >= CLEAN_FIRST_WALK:
                    return None
                if not only(entry):
                    continue
            if not candidates[entry.pool] or entry.generation in skip:
                continue
            if guarantees and entry.ns != ns:
                share = guarantees.get(entry.ns)
                if share is not None:
                    nbytes = align_up(max(entry.nbytes, 1))
                    taken = planned.get(entry.ns, 0) + nbytes
                    if self.guaranteed_ready[entry.ns] - taken < share:
                        self._protected += 1
                        continue
                    planned[entry.ns] = taken
            walked.append(entry)
            start, end = free_on_paper(entry)
            if end - start >= size:
                return in_run(entry.pool, start, end, walked)
        return None


    def _pool_full_message(self, nbytes: int, pools: tuple[int, ...]) -> str:
        # O(pools): this runs on every refused put, and a full pool can hold millions of entries.
        tier = [self.allocators[p] for p in pools]
        capacity = sum(a.capacity for a in tier)
        used = sum(a.used for a in tier)
        largest = max(a.largest_free for a in tier)
        where = "" if pools == self.host_pools else f" in CUDA arena {pools[0]}"
        held = len(self.index) - len(self.evictable)
        writing = self.writes_in_progress()
        # Bytes nothing may evict: leased/pinned entries, writes, reservations, retired bytes.
        held_bytes = used - sum(self.evictable_bytes[p] for p in pools)
        protected = (f", {self._protected} kept for their namespace's guaranteed share"
                     if self._protected else "")
        return (f"no room for {nbytes} bytes{where}: {used} of {capacity} bytes in use, largest free extent "
                f"{largest}; evicting what may be evicted cannot make a big enough contiguous hole "
                f"({held_bytes} bytes held: {held} entries leased or pinned, {writing} being written{protected})")
