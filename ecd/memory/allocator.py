"""Extent allocator for one shared-memory segment: best-fit, O(log n), coalescing.

Free extents live in two places: a SortedList of (size, offset) for best-fit lookup and two
dicts (start -> size, end -> start) so a freed extent merges with both neighbours in O(1).
Every size is rounded up to ALIGNMENT so offsets stay aligned for vectorised copies and DMA.

Allocated extents are recorded as one bit per ALIGNMENT bytes of the segment (set where an
extent starts: 0.05% of the segment, 32 KiB per 64 MiB), not as an offset -> size dict (~52 B
per entry, a tenth of the daemon's memory per entry): their owners (the store's entries and
reservations) know the size and hand it back to `free_extent`, which refuses an offset where no
extent starts (a double free, an interior offset) and a size that does not end where the next
extent begins.
"""
from __future__ import annotations

from sortedcontainers import SortedList

ALIGNMENT = 256


def align_up(nbytes: int) -> int:
    return (nbytes + ALIGNMENT - 1) & ~(ALIGNMENT - 1)


class ExtentAllocator:
    def __init__(self, capacity: int) -> None:
        if capacity <= 0 or capacity % ALIGNMENT:
            raise ValueError(f"capacity must be a positive multiple of {ALIGNMENT}, got {capacity}")
        self.capacity = capacity
        self.used = 0
        self._by_size: SortedList = SortedList([(capacity, 0)])
        self._free_start: dict[int, int] = {0: capacity}  # offset -> size
        self._free_end: dict[int, int] = {capacity: 0}  # end offset -> offset
        self._starts = bytearray(-(-capacity // ALIGNMENT) // 8 + 1)  # bit i: an extent starts at i * ALIGNMENT

    @property
    def free(self) -> int:
        return self.capacity - self.used

    @property
    def largest_free(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    def fits(self, nbytes: int) -> bool:
        return self.largest_free >= align_up(max(nbytes, 1))

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a new extent of at least `nbytes`, or None when no free extent is big enough."""
        size = align_up(max(nbytes, 1))  # a zero-byte tensor still gets a distinct extent
        offset = self._take(size)
        if offset is None:
            return None
        self._mark_start(offset, True)
        self.used += size
        return offset

    def _take(self, size: int) -> int | None:
        """Cut `size` bytes from the start of the smallest free extent that holds them (best
        fit), the rest staying free; None when none does."""
        i = self._by_size.bisect_left((size, -1))
        if i == len(self._by_size):
            return None
        block_size, offset = self._by_size.pop(i)
        del self._free_start[offset]
        del self._free_end[offset + block_size]
        if block_size > size:
            self._add_free(offset + size, block_size - size)
        return offset

    def alloc_run(self, sizes: list[int]) -> list[int] | None:
        """Offsets of new extents of `sizes` (aligned) bytes, one after the other in the best-fitting
        free extent that holds them all: one search for a batch instead of one per extent. Each is
        an extent of its own (freed, and coalesced, by free_extent like any other); None when no
        free extent is big enough for the run."""
        if not sizes:
            return None
        total = sum(sizes)
        offset = self._take(total)
        if offset is None:
            return None
        offsets = []
        starts = self._starts
        for size in sizes:
            slot = offset // ALIGNMENT
            starts[slot >> 3] |= 1 << (slot & 7)
            offsets.append(offset)
            offset += size
        self.used += total
        return offsets

    def claim(self, extents: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """A fresh allocator takes `extents` (offset, bytes) as allocated, in one pass (an adopted
        pool: ecd/daemon/restart/adopt.py): the gaps between them are its free extents. Those
        that do not fit (past the end, misaligned, overlapping one before them in offset order)
        are not taken and are returned."""
        if self.used or len(self._free_start) != 1:
            raise ValueError("claim() is for a fresh allocator")
        refused: list[tuple[int, int]] = []
        taken: list[tuple[int, int]] = []
        position = 0
        for offset, nbytes in sorted(extents):
            size = align_up(max(nbytes, 1))
            if offset % ALIGNMENT or offset < position or offset + size > self.capacity:
                refused.append((offset, nbytes))
                continue
            taken.append((offset, size))
            position = offset + size
        self._by_size.clear()
        self._free_start.clear()
        self._free_end.clear()
        free, position = [], 0
        for offset, size in taken:
            if offset > position:
                free.append((offset - position, position))
            self._mark_start(offset, True)
            self.used += size
            position = offset + size
        if position < self.capacity:
            free.append((self.capacity - position, position))
        self._by_size.update(free)
        for size, offset in free:
            self._free_start[offset] = size
            self._free_end[offset + size] = offset
        return refused

    def split(self, at: int) -> None:
        """Cut the allocated extent that holds `at` in two there, each freed on its own from now on
        (a put lease carved into entries: daemon/writes/leases.py). The caller owns that extent
        and knows `at` lies strictly inside it; an offset where an extent already starts, or
        one no extent can hold, is refused."""
        if at % ALIGNMENT or not 0 < at < self.capacity or self._starts_extent(at) or at in self._free_start:
            raise ValueError(f"cannot split at offset {at}")
        self._mark_start(at, True)

    def free_extent(self, offset: int, nbytes: int) -> None:
        """Give back the extent `alloc(nbytes)` returned at `offset`."""
        size = align_up(max(nbytes, 1))
        end = offset + size
        if not self._starts_extent(offset):
            raise ValueError(f"no allocated extent starts at offset {offset}")
        # where it ends, the next extent (allocated or free) or the segment must begin
        if not (end == self.capacity or end in self._free_start or self._starts_extent(end)):
            raise ValueError(f"the extent at offset {offset} is not {size} bytes long")
        self._mark_start(offset, False)
        self.used -= size
        left = self._free_end.get(offset)
        if left is not None:  # merge with the free extent that ends where this one starts
            left_size = self._free_start[left]
            self._remove_free(left, left_size)
            offset, size = left, size + left_size
        right_size = self._free_start.get(end)
        if right_size is not None:  # and with the one that starts where this one ends
            self._remove_free(end, right_size)
            size += right_size
        self._add_free(offset, size)

    def _starts_extent(self, offset: int) -> bool:
        """Whether an allocated extent starts at `offset` (False for any offset alloc never gave)."""
        slot, rem = divmod(offset, ALIGNMENT)
        return not rem and 0 <= offset < self.capacity and bool(self._starts[slot >> 3] & (1 << (slot & 7)))

    def _mark_start(self, offset: int, allocated: bool) -> None:
        slot = offset // ALIGNMENT
        if allocated:
            self._starts[slot >> 3] |= 1 << (slot & 7)
        else:
            self._starts[slot >> 3] &= ~(1 << (slot & 7))

    def _add_free(self, offset: int, size: int) -> None:
        self._by_size.add((size, offset))
        self._free_start[offset] = size
        self._free_end[offset + size] = offset

    def _remove_free(self, offset: int, size: int) -> None:
        self._by_size.remove((size, offset))
        del self._free_start[offset]
        del self._free_end[offset + size]

    def free_ending_at(self, end: int) -> int | None:
        """Start of the free extent that ends at `end`, if there is one (O(1))."""
        return self._free_end.get(end)

    def free_starting_at(self, offset: int) -> int | None:
        """End of the free extent that starts at `offset`, if there is one (O(1))."""
        size = self._free_start.get(offset)
        return None if size is None else offset + size

    def free_extents(self) -> list[tuple[int, int]]:
        """(offset, size) of every free extent, by offset (for tests and invariant checks)."""
        return sorted(self._free_start.items())
