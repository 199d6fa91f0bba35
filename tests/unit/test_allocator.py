"""ExtentAllocator: best fit, alignment, coalescing, and invariants under random alloc/free."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ecd.memory.allocator import ALIGNMENT, ExtentAllocator, align_up

A = ALIGNMENT


def check_invariants(alloc: ExtentAllocator, live: dict[int, int]) -> None:
    """`live` maps offset -> requested bytes of every extent the test still holds."""
    free = alloc.free_extents()
    # every free extent is aligned, non-empty and inside the segment
    for offset, size in free:
        assert size > 0 and offset % A == 0 and size % A == 0
        assert 0 <= offset and offset + size <= alloc.capacity
    # free extents are sorted, disjoint and coalesced (never touching)
    for (o1, s1), (o2, _) in zip(free, free[1:]):
        assert o1 + s1 < o2, f"free extents {(o1, s1)} and {o2} overlap or are adjacent"
    # live extents: aligned, at least as big as asked, disjoint from each other and from free ones
    spans = [(o, o + s, "free") for o, s in free]
    for offset, nbytes in live.items():
        size = align_up(max(nbytes, 1))
        assert offset % A == 0
        assert size == align_up(max(nbytes, 1))
        spans.append((offset, offset + size, "live"))
    spans.sort()
    for (s1, e1, k1), (s2, e2, k2) in zip(spans, spans[1:]):
        assert e1 <= s2, f"{k1} [{s1},{e1}) overlaps {k2} [{s2},{e2})"
    # accounting
    used = sum(align_up(max(n, 1)) for n in live.values())
    assert alloc.used == used
    assert alloc.used + sum(s for _, s in free) == alloc.capacity
    assert alloc.free == alloc.capacity - alloc.used
    assert alloc.largest_free == max((s for _, s in free), default=0)
    # free and live together tile the segment exactly
    assert sum(e - s for s, e, _ in spans) == alloc.capacity


# ---- basics -----------------------------------------------------------------------------------

def test_align_up():
    assert align_up(0) == 0
    assert align_up(1) == A
    assert align_up(A) == A
    assert align_up(A + 1) == 2 * A


@pytest.mark.parametrize("capacity", [0, -A, A + 1, 100])
def test_capacity_must_be_positive_multiple_of_alignment(capacity):
    with pytest.raises(ValueError):
        ExtentAllocator(capacity)


def test_fresh_allocator_is_one_free_extent():
    alloc = ExtentAllocator(16 * A)
    assert alloc.free_extents() == [(0, 16 * A)]
    assert alloc.used == 0
    assert alloc.largest_free == 16 * A


def test_alloc_and_free_basics():
    alloc = ExtentAllocator(16 * A)
    a = alloc.alloc(100)
    b = alloc.alloc(A)
    c = alloc.alloc(A + 1)
    assert (a, b, c) == (0, A, 2 * A)
    assert alloc.used == 4 * A
    assert alloc.free_extents() == [(4 * A, 12 * A)]
    alloc.free_extent(b, A)
    assert alloc.used == 3 * A
    assert alloc.free_extents() == [(A, A), (4 * A, 12 * A)]
    check_invariants(alloc, {a: 100, c: A + 1})


def test_alignment_of_every_offset():
    alloc = ExtentAllocator(64 * A)
    offsets = [alloc.alloc(n) for n in (1, 3, 255, 257, 511, 1000, 7)]
    assert all(o is not None and o % A == 0 for o in offsets)
    assert offsets == [0, A, 2 * A, 3 * A, 5 * A, 7 * A, 11 * A]  # each extent as big as asked, rounded up


def test_zero_byte_alloc_gets_a_distinct_extent():
    alloc = ExtentAllocator(4 * A)
    a = alloc.alloc(0)
    b = alloc.alloc(0)
    assert a is not None and b is not None and a != b
    assert abs(a - b) == A
    assert alloc.used == 2 * A
    assert alloc.fits(0)


def test_none_when_full():
    alloc = ExtentAllocator(4 * A)
    assert alloc.alloc(4 * A) == 0
    assert alloc.alloc(1) is None
    assert not alloc.fits(1)
    assert alloc.largest_free == 0
    alloc.free_extent(0, 4 * A)
    assert alloc.alloc(4 * A + 1) is None  # bigger than the segment
    assert alloc.used == 0


def test_none_when_fragmented():
    alloc = ExtentAllocator(4 * A)
    offs = [alloc.alloc(A) for _ in range(4)]
    alloc.free_extent(offs[0], A)
    alloc.free_extent(offs[2], A)
    assert alloc.free == 2 * A
    assert not alloc.fits(2 * A)
    assert alloc.alloc(2 * A) is None
    assert alloc.free_extents() == [(0, A), (2 * A, A)]


def test_best_fit_picks_smallest_hole_that_fits():
    alloc = ExtentAllocator(32 * A)
    # carve holes of 4A (at 0), 2A (at 5A), 3A (at 8A), separated by live 1A spacers
    x = [alloc.alloc(n * A) for n in (4, 1, 2, 1, 3, 1)]
    assert x == [0, 4 * A, 5 * A, 7 * A, 8 * A, 11 * A]
    alloc.free_extent(0, 4 * A)
    alloc.free_extent(5 * A, 2 * A)
    alloc.free_extent(8 * A, 3 * A)
    # tail: [12A, 32A) of 20A
    assert alloc.alloc(2 * A) == 5 * A  # exact fit
    assert alloc.alloc(A + 1) == 8 * A  # 3A hole beats 4A and 20A
    assert alloc.free_extents() == [(0, 4 * A), (10 * A, A), (12 * A, 20 * A)]
    assert alloc.alloc(A) == 10 * A  # the 1A remainder is the best fit now
    assert alloc.alloc(5 * A) == 12 * A  # only the tail fits


def test_best_fit_ties_prefer_lowest_offset():
    alloc = ExtentAllocator(8 * A)
    offs = [alloc.alloc(A) for _ in range(8)]
    for o in (offs[1], offs[3], offs[5]):
        alloc.free_extent(o, A)
    assert alloc.alloc(A) == offs[1]


def test_coalesce_with_left_neighbour():
    alloc = ExtentAllocator(4 * A)
    a, b, c, d = (alloc.alloc(A) for _ in range(4))
    alloc.free_extent(a, A)
    alloc.free_extent(b, A)
    assert alloc.free_extents() == [(0, 2 * A)]
    assert alloc.alloc(2 * A) == 0


def test_coalesce_with_right_neighbour():
    alloc = ExtentAllocator(4 * A)
    a, b, c, d = (alloc.alloc(A) for _ in range(4))
    alloc.free_extent(c, A)
    alloc.free_extent(b, A)
    assert alloc.free_extents() == [(A, 2 * A)]
    assert alloc.largest_free == 2 * A


def test_coalesce_with_both_neighbours():
    alloc = ExtentAllocator(5 * A)
    a, b, c, d, e = (alloc.alloc(A) for _ in range(5))
    alloc.free_extent(b, A)
    alloc.free_extent(d, A)
    assert alloc.free_extents() == [(A, A), (3 * A, A)]
    alloc.free_extent(c, A)
    assert alloc.free_extents() == [(A, 3 * A)]
    assert alloc.alloc(3 * A) == A
    check_invariants(alloc, {a: A, A: 3 * A, e: A})


def test_coalesce_with_tail():
    alloc = ExtentAllocator(8 * A)
    a = alloc.alloc(A)
    b = alloc.alloc(A)
    alloc.free_extent(b, A)
    assert alloc.free_extents() == [(A, 7 * A)]
    alloc.free_extent(a, A)
    assert alloc.free_extents() == [(0, 8 * A)]


def test_double_free_raises():
    alloc = ExtentAllocator(4 * A)
    a = alloc.alloc(A)
    alloc.free_extent(a, A)
    with pytest.raises(ValueError):
        alloc.free_extent(a, A)
    assert alloc.used == 0
    assert alloc.free_extents() == [(0, 4 * A)]


def test_free_of_unallocated_or_interior_offset_raises():
    alloc = ExtentAllocator(4 * A)
    a = alloc.alloc(2 * A)
    with pytest.raises(ValueError):
        alloc.free_extent(a + A, A)  # inside a live extent
    with pytest.raises(ValueError):
        alloc.free_extent(3 * A, A)  # inside the free tail
    with pytest.raises(ValueError):
        alloc.free_extent(a + 1, A)  # not aligned
    with pytest.raises(ValueError):
        alloc.free_extent(a, 3 * A)  # reaches into the free tail
    with pytest.raises(ValueError):
        alloc.free_extent(8 * A, A)  # beyond the segment
    assert alloc.used == 2 * A
    check_invariants(alloc, {a: 2 * A})


# ---- randomized property test -----------------------------------------------------------------

CAPACITY = 64 * A

ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(min_value=0, max_value=20 * A)),
        st.tuples(st.just("free"), st.integers(min_value=0, max_value=10_000)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_random_alloc_free_keeps_invariants(sequence):
    alloc = ExtentAllocator(CAPACITY)
    live: dict[int, int] = {}
    for op, arg in sequence:
        if op == "alloc":
            largest_before = alloc.largest_free
            offset = alloc.alloc(arg)
            need = align_up(max(arg, 1))
            if need > largest_before:
                assert offset is None
            else:
                assert offset is not None and offset not in live
                live[offset] = arg
        elif live:
            offset = sorted(live)[arg % len(live)]
            alloc.free_extent(offset, live.pop(offset))
        check_invariants(alloc, live)
    for offset in list(live):
        alloc.free_extent(offset, live.pop(offset))
        check_invariants(alloc, live)
    assert alloc.free_extents() == [(0, CAPACITY)]
    assert alloc.used == 0


def test_alloc_run_places_extents_back_to_back_each_freed_on_its_own():
    """alloc_run: one search for a batch; each extent is an ordinary one afterwards (freed and
    coalesced one by one), and a run that fits nowhere takes nothing."""
    a = ExtentAllocator(64 * ALIGNMENT)
    first = a.alloc(2 * ALIGNMENT)  # something before the run
    sizes = [ALIGNMENT, 3 * ALIGNMENT, ALIGNMENT]
    offsets = a.alloc_run(sizes)
    assert offsets == [first + 2 * ALIGNMENT, first + 3 * ALIGNMENT, first + 6 * ALIGNMENT]
    assert a.used == 7 * ALIGNMENT
    assert a.alloc_run([64 * ALIGNMENT]) is None and a.used == 7 * ALIGNMENT  # no room: nothing taken
    assert a.alloc_run([]) is None
    a.free_extent(offsets[1], 3 * ALIGNMENT)  # the middle one alone: a hole between its neighbours
    assert (offsets[1], 3 * ALIGNMENT) in a.free_extents()
    with pytest.raises(ValueError):
        a.free_extent(offsets[0], 2 * ALIGNMENT)  # not its size: the next extent does not start there
    for offset, size in [(offsets[0], ALIGNMENT), (offsets[2], ALIGNMENT), (first, 2 * ALIGNMENT)]:
        a.free_extent(offset, size)
    assert a.used == 0 and a.free_extents() == [(0, 64 * ALIGNMENT)]
