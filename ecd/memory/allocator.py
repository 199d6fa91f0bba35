"""Extent allocator for one shared-memory segment: best-fit, O(log n), coalescing.

Free extents live in two places: a SortedList of (size, offset) for best-fit lookup and two
dicts (start -> size, end -> start) so a freed extent merges with both neighbours in O(1).
Every size is rounded up to ALIGNMENT so offsets stay aligned for vectorised copies and DMA.
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
        self._allocated: dict[int, int] = {}  # offset -> size

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
        i = self._by_size.bisect_left((size, -1))
        if i == len(self._by_size):
            return None
        block_size, offset = self._by_size.pop(i)
        del self._free_start[offset]
        del self._free_end[offset + block_size]
        if block_size > size:
            self._add_free(offset + size, block_size - size)
        self._allocated[offset] = size
        self.used += size
        return offset

    def free_extent(self, offset: int) -> None:
        size = self._allocated.pop(offset, None)
        if size is None:
            raise ValueError(f"offset {offset} is not an allocated extent")
        self.used -= size
        end = offset + size
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

    def _add_free(self, offset: int, size: int) -> None:
        self._by_size.add((size, offset))
        self._free_start[offset] = size
        self._free_end[offset + size] = offset

    def _remove_free(self, offset: int, size: int) -> None:
        self._by_size.remove((size, offset))
        del self._free_start[offset]
        del self._free_end[offset + size]

    def extent_size(self, offset: int) -> int:
        return self._allocated[offset]

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
