"""A host pool file truncated under the daemon: find it, give the file its size back, and drop
every entry whose bytes the cut took. Mixed into Store.

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
from typing import Any, Iterable, Sequence

from ...errors import Code
from ...memory.ring import EventKind
from ...protocol import Extent, Failure
from ..registry.entries import State
from ..registry.state import RegistryState

log = logging.getLogger("ecd.daemon")


class PoolIntegrity(RegistryState):
    # the host pool's named ShmFiles (memory.host), set by the daemon at start; none with
    # backing = "memfd": sealed memfds cannot be truncated, so there is nothing to check
    segments: Sequence[Any] = ()
    cut_writes: dict[int, Failure]  # generation -> its commit's answer (Store.__init__ makes it)
    _unallocated: dict[int, int]  # segment -> offset from which a restore still owes pages

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
        for generation in generations:
            held = self.by_generation.get(generation) or self.reservations.get(generation)
            if held is not None:
                pools.add(held.pool)
        self.check_pools(pools)

    def check_fresh(self, placed: Iterable[Any]) -> None:
        """After an Alloc, before its answer: the segments of its extents. A cut found now came
        before any byte of them was written, and the file is whole again: they stay usable."""
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
            self.counters["truncated_writes_refused"] += 1
        return refused

    def _pool_cut(self, index: int) -> None:
        segment = self.segments[index]
        self.counters["pool_truncations"] += 1
        size, first = segment.current_size(), segment.cut_from()
        how = (f"truncated to {size} of its {segment.size} bytes" if first == size else
               f"truncated{'' if size < segment.size else ' and grown again'} ({segment.size - first} bytes "
               f"from {first} may be zeros: pages are missing below its end)")
        cut = f"host pool segment {index} ({segment.name}) was {how} by another process: its bytes are gone"
        dropped = written = 0

        def cut_off(offset: int, nbytes: int) -> bool:
            return offset + nbytes > first

        for entry in [e for e in self.by_generation.values() if e.pool == index and cut_off(e.offset, e.nbytes)]:
            if entry.state is State.READY:
                self._drop_cut(entry)
                dropped += 1
            elif entry.state is State.WRITING:
                refused = Failure(Code.CORRUPT, f"{entry.key!r} not stored: {cut}; put it again")
                self.cut_writes[entry.generation] = refused
                written += 1
        # Kept until its Publish (a watched client may be copying into it now: freeing it would let
        # another entry's bytes be overwritten); STALE sends that client's put the Alloc way, anew.
        for reservation in self.reservations.values():
            if reservation.pool == index and cut_off(reservation.offset, reservation.size):
                self.cut_writes[reservation.generation] = Failure(Code.STALE, f"the reservation was cut: {cut}")
                written += 1
        # a generation freed meanwhile (aborted, expired) never commits: do not keep its reason
        for generation in [g for g in self.cut_writes if g not in self.by_generation and g not in self.reservations]:
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

    def _drop_cut(self, entry: Any) -> None:
        """A READY entry whose bytes are gone: out of the index (an EVICTED event), freed once no
        reader holds it. A disk record of the same generation keeps the key if it is whole; one
        still being written from the pool (persist) may have read zeros and goes too."""
        disk = self.disk
        if disk is not None:
            record = disk.record(entry.ns, entry.key)
            if record is not None and record.generation == entry.generation and not record.ready:
                disk.drop(entry.ns, entry.key, EventKind.EVICTED)
        self._unindex(entry, EventKind.EVICTED)
        self.counters["evicted_truncated"] += 1
        if entry.readers:
            entry.state = State.RETIRED
        else:
            self._free(entry)
