"""The host tier: the pools entries live in and their integrity. The host pool's segments
(pools 0..n-1) and, with `[pool.cuda]`, one CUDA arena per device (pools n, n+1, ...), each with
its own extent allocator; an allocation names its tier (store.tier: the host pool, or exactly one
arena) and is placed only there. What goes where, and what is evicted for room, is the registry's
policy (registry/placement.py); the allocators, the tiers' sizes and the truncation defence are
here. The daemon builds it (server.py) and hands it to the Store.

A host pool file truncated under the daemon: find it, give the file its size back, and drop
every entry whose bytes the cut took. (The named mode only: sealed memfds cannot be truncated.)

The pool files are 0660: any member of node.group can ftruncate /dev/shm/ecd.<node>.<n>. A page
past the new end faults (SIGBUS) in whoever touches it next through the mapping, the daemon
included, and what the file held there is gone for good: a restored size reads as zeros. So:

- `check_pools` compares a segment's size and page count (one fstat) with what the daemon
  created (a file grown back after a cut has its size but not its pages): for the segments a
  request touches (an Alloc's extents, a Commit's or Publish's writes, a get's entries; an
  inline put's copy just comes up short), and for all of them on a timer (a shrink is found
  even when no request comes). The daemon's own copies do not fault meanwhile
  (ShmFile.write_at / read_into: through the kernel, a short count instead of a signal).
- A shrunk segment is restored (ftruncate back, its pages allocated again) and every entry whose
  extent reaches past where the cut may start is dropped (the file's size; its start, when the
  file was grown back with pages missing below its end: nothing says which):
  a READY one leaves the index with an EVICTED ring event (clients drop cached locations; a clean copy on the disk tier keeps the key,
  a read brings it back from there), a write or reservation in progress is marked so its commit
  is refused with CORRUPT and a reason, never published with zeros. Readers that hold a lease
  keep it (their bytes are already what they are). Counted: `pool_truncations`,
  `evicted_truncated` (ecd_evictions_total{reason="truncated"}), `truncated_writes_refused`.

A truncation undone before the daemon looks is seen as long as its pages are still missing; once
clients have written into every one of them again, it is what a write of zeros is, which a group
member may do to the pool anyway (`verify` catches both).
"""
from __future__ import annotations

import logging
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from ...errors import Code
from ...memory.allocator import ExtentAllocator
from ...memory.ring import tenant_namespace
from ...protocol import Extent, Failure
from ..registry.entries import RequestError, State

if TYPE_CHECKING:  # pragma: no cover
    from ..registry.store import Store

log = logging.getLogger("ecd.daemon")


class HostTier:
    """The pools and their allocators (host segments first, then CUDA arenas), and the named
    mode's truncation checks (`segments`: the host pool's ShmFiles; none with backing = "memfd")."""

    def __init__(self, pool_sizes: Sequence[int], arena_sizes: Sequence[int] = (),
                 segments: Sequence[Any] = (), groups: Mapping[str, tuple[int, ...]] = MappingProxyType({})) -> None:
        """`groups`: each sized tenant's own segments (restart/adopt.py's pool_layout), by tenant name."""
        self.allocators = [ExtentAllocator(size) for size in [*pool_sizes, *arena_sizes]]
        self.host_pools = tuple(range(len(pool_sizes)))  # the host pool: every shm segment, every tenant's
        self.arena_pools = tuple(range(len(pool_sizes), len(self.allocators)))  # one per CUDA arena
        # A sized tenant's entries live in its segments alone (by its scope: Placement.scope), every
        # other namespace's in the rest: the default tenant's part, with segment 0 and its tail.
        self.groups = {tenant_namespace(name, ""): tuple(pools) for name, pools in groups.items()}
        owned = {pool for pools in groups.values() for pool in pools}
        self.shared_pools = tuple(pool for pool in self.host_pools if pool not in owned)
        self._owners = {tuple(pools): name for name, pools in groups.items()}  # for too_large's reason
        self._parts = {pools[0]: tuple(pools) for pools in groups.values()}  # first segment -> its part
        self._first = {pool: pools[0] for pools in groups.values() for pool in pools}
        self._largest: dict[tuple[int, ...], int] = {}  # pools -> their largest extent, for too_large
        # the host pool's named ShmFiles (memory.host), checked for truncation; none with
        # backing = "memfd": sealed memfds cannot be truncated, so there is nothing to check
        self.segments: Sequence[Any] = segments
        self.cut_writes: dict[int, Failure] = {}  # generation -> its commit's answer, once
        self._unallocated: dict[int, int] = {}  # segment -> offset from which a restore still owes pages
        self.store: "Store | None" = None

    def attach(self, store: "Store") -> None:
        """The store whose entries live here (Store.__init__): a cut drops them through it."""
        self.store = store

    # ---- tiers and allocation -------------------------------------------------------------

    def pools_for(self, scope: str) -> tuple[int, ...]:
        """The host segments a namespace of this scope (Placement.scope) places its entries in."""
        return self.groups.get(scope, self.shared_pools)

    def pools_of_tenant(self, tenant: str) -> tuple[int, ...]:
        """The host segments a client of `tenant` ("": the default) maps: its own part, or the default's."""
        return self.pools_for(tenant_namespace(tenant, ""))

    def part_of(self, pool: int) -> int:
        """The first segment of host segment `pool`'s part (0: the default tenant's)."""
        return self._first.get(pool, 0)

    def part(self, first: int) -> tuple[int, ...]:
        """The host segments of the part whose first segment is `first` (part_of)."""
        return self._parts.get(first, self.shared_pools)

    def tier(self, arena: int, scope: str = "") -> tuple[int, ...]:
        """The pools an Alloc with this `arena` may use: -1 the host segments of `scope`'s tenant
        (pools_for), else exactly that arena (RequestError INVALID when `arena` is not an arena's
        pool index)."""
        if arena == -1:
            return self.pools_for(scope)
        if arena in self.arena_pools:
            return (arena,)
        arenas = (f"pools {self.arena_pools[0]}..{self.arena_pools[-1]} are CUDA arenas"
                  if self.arena_pools else "this daemon has no CUDA arenas ([pool.cuda])")
        raise RequestError(Code.INVALID, f"arena={arena} is not a CUDA arena: {arenas}; -1 is the host pool")

    def too_large(self, nbytes: int, pools: tuple[int, ...]) -> str | None:
        """Why no extent of `nbytes` can ever fit in `pools` (None when one can)."""
        largest = self._largest.get(pools)
        if largest is None:  # (hundreds of segments: worked out once per tier, not per put)
            largest = self._largest[pools] = max(self.allocators[p].capacity for p in pools)
        if nbytes <= largest:
            return None
        owner = self._owners.get(pools)
        where = (f"CUDA arena {pools[0]}" if pools[0] in self.arena_pools else
                 f"the largest of tenant '{owner}''s segments" if owner else "the largest pool segment")
        return f"{nbytes} bytes is larger than {where} ({largest} bytes)"

    def alloc(self, size: int, pools: tuple[int, ...]) -> tuple[int, int] | None:
        """(pool, offset) of a free extent of `size` (aligned) bytes in the first of `pools` with
        room, or None. O(log n) per pool."""
        for pool in pools:
            offset = self.allocators[pool].alloc(size)
            if offset is not None:
                return pool, offset
        return None

    def free(self, pool: int, offset: int, size: int) -> None:
        self.allocators[pool].free_extent(offset, size)

    # ---- truncation -----------------------------------------------------------------------

    def check_pools(self, pools: Iterable[int] | None = None) -> None:
        """The host segments `pools` (every one when None: the timer's check), one fstat each: a
        request checks only those it touches (a big pool has hundreds of segments)."""
        if not self.segments:
            return  # sealed memfds: nothing to look at, not even the keys a get names
        for index in range(len(self.segments)) if pools is None else set(pools):
            self.check_pool(index)

    def check_generations(self, generations: Iterable[int]) -> None:
        """Before a Commit or Publish: the segments of the writes (or reservation) it names."""
        if not self.segments:
            return
        pools = set()
        assert self.store is not None
        for generation in generations:
            held = self.store.holder(generation)
            if held is not None:
                pools.add(held.pool)
        self.check_pools(pools)

    def check_fresh(self, placed: Iterable[Any]) -> None:
        """After an Alloc, before its answer: the segments of its extents. A cut found now came
        before any byte of them was written, and the file is whole again: they stay usable."""
        if not self.segments:
            return  # sealed memfds: no cut to look for, and none recorded (cut_writes stays empty)
        fresh = [extent for extent in placed if isinstance(extent, Extent)]
        self.check_pools(extent.pool for extent in fresh)
        if self.cut_writes:
            for extent in fresh:
                self.cut_writes.pop(extent.generation, None)

    def check_pool(self, index: int) -> bool:
        """False when segment `index` was found truncated (now restored, its cut entries dropped)."""
        if index >= len(self.segments):
            return True  # a CUDA arena: not a file anyone can truncate
        if self.segments[index].whole():
            if index in self._unallocated:
                self._allocate(index, self._unallocated[index])
            return True
        self._pool_cut(index)
        return False

    def refuse_cut_write(self, generation: int) -> Failure | None:
        """Store.commit: the reason a write the cut took must not be published, once."""
        refused = self.cut_writes.pop(generation, None) if self.cut_writes else None
        if refused is not None:
            assert self.store is not None
            self.store.counters["truncated_writes_refused"] += 1
        return refused

    def forget_cut(self, generation: int) -> None:
        """A write whose extent was cut is written again from its start (an inline put's or a
        peer fetch's copy, retried after the restore): its commit is not to be refused."""
        if self.cut_writes:
            self.cut_writes.pop(generation, None)

    def _pool_cut(self, index: int) -> None:
        store = self.store
        assert store is not None
        segment = self.segments[index]
        store.counters["pool_truncations"] += 1
        size, first = segment.current_size(), segment.cut_from()
        how = (f"truncated to {size} of its {segment.size} bytes" if first == size else
               f"truncated{'' if size < segment.size else ' and grown again'} ({segment.size - first} bytes "
               f"from {first} may be zeros: pages are missing below its end)")
        cut = f"host pool segment {index} ({segment.name}) was {how} by another process: its bytes are gone"
        dropped = written = 0

        def cut_off(offset: int, nbytes: int) -> bool:
            return offset + nbytes > first

        for entry in [e for e in store.by_generation.values() if e.pool == index and cut_off(e.offset, e.nbytes)]:
            if entry.state is State.READY:
                store.drop_cut(entry)
                dropped += 1
            elif entry.state is State.WRITING:
                refused = Failure(Code.CORRUPT, f"{entry.key!r} not stored: {cut}; put it again")
                self.cut_writes[entry.generation] = refused
                written += 1
        # Kept until its Publish (a watched client may be copying into it now: freeing it would let
        # another entry's bytes be overwritten); STALE sends that client's put the Alloc way, anew.
        for reservation in store.reservations.values():
            if reservation.pool == index and cut_off(reservation.offset, reservation.size):
                self.cut_writes[reservation.generation] = Failure(Code.STALE, f"the reservation was cut: {cut}")
                written += 1
        # a generation freed meanwhile (aborted, expired) never commits: do not keep its reason
        for generation in [g for g in self.cut_writes if store.holder(g) is None]:
            del self.cut_writes[generation]
        log.error("%s (a member of node.group): size and pages restored; %d entr%s whose bytes were cut dropped, "
                  "%d write(s) in progress will be refused", cut, dropped, "y" if dropped == 1 else "ies", written)
        start = self._unallocated.get(index, first)
        self._allocate(index, min(start, first))

    def _allocate(self, index: int, start: int) -> None:
        """Restore segment `index` from `start`; what could not be allocated is tried again at
        the next check (a sparse hole faults a client's store into a full /dev/shm)."""
        problem = self.segments[index].restore(start)
        if problem is None:
            if self._unallocated.pop(index, None) is not None:
                log.info("host pool segment %d: its pages are allocated again", index)
            return
        if index not in self._unallocated:
            log.error("host pool segment %d: %s; retried every check until it succeeds", index, problem)
        self._unallocated[index] = start
