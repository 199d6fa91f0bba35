"""Gets without a round trip: a copy out of the pool, validated against the event ring afterwards.

A client that put or read an entry keeps where it lives (its `Location`, in the location cache,
kept current by ring events). A later `get` of it asks the daemon nothing:

    1. sync: apply the ring's unread events; take the cached location (any doubt: step 0 below)
    2. copy the bytes out of the pool mapping into a new tensor
    3. fence (loads of the copy before the load of write_seq; free on x86, see memory/fence.py)
    4. sync again: if the ring is still live and of the same epoch, nothing was lost (no overrun),
       and the location is still cached (no EVICTED/DELETED/replacing event named the entry),
       the copy is the entry's bytes.

Why a copy that passes step 4 is right (the seqlock argument, with write_seq as the sequence):
the daemon appends an entry's EVICTED or DELETED event (Store.unindex) before it frees the
extent (Store.retire_or_free), and the extent reaches a new writer only through a later reply
to an Alloc, a chain of syscalls. So any byte a new writer stored there is ordered after the
store of write_seq that published the event. If the copy (2) read such a byte, the load of
write_seq in (4), ordered after the copy by (3), sees that event, which drops the location:
the copy is thrown away. An adopting restart reuses extents without an event on the old ring;
it marks the old ring closed before it serves (restart/memory.py: `close_old_ring`), and a
closed ring fails step 4 the same way.

Step 0, the fallback, is today's route: Acquire (a read lease), copy, Release. It is taken for
any key not cached with its location, a ring that is not usable (silent daemon, closed,
scribbled), an overrun, and a batch larger than limits.max_batch.

A copy made by a GPU (an arena entry, or any copy to a GPU) runs asynchronously, so it cannot be
validated afterwards: it holds read slots instead (`hold_slots`, as views do), cleared only once
the copy's event has completed (Client._copy_out waits for its CopyBatch before letting go).

The daemon does not see these reads, so the client tells it in batches (`LocalReads`): a
fire-and-forget Report of the generations read, which counts them as hits and moves them to the
recently used end of the eviction order. It goes before this client's next request (so its own
put after a get evicts as if the get had been a round trip), and at least every REPORT_EVERY_S
or REPORT_BATCH reads while reads go on: another client's put may see the order up to that late.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Sequence, TypeVar

import torch

from ..errors import IntegrityError
from ..integrity import checksum as entry_checksum, describe
from ..memory.entry_index import SLOT_BYTES, SlotPage
from ..memory.fence import barrier as memory_barrier, full_barrier
from ..protocol import Location, Report, Welcome
from .control import _check_encodable
from .tensors import copy_many_out, copy_out_checked

if TYPE_CHECKING:  # pragma: no cover
    from .client import Client, OpenView
    from .mapping import EpochMapping

T = TypeVar("T")
REPORT_BATCH = 512  # local reads told to the daemon in one Report (protocol.MAX_LOCAL_READS at most)
REPORT_EVERY_S = 0.5  # and at least this often while reads go on


def copy_from_pools(mapping: "EpochMapping", locations: Sequence[Location]) -> list[torch.Tensor]:
    """New tensors holding the bytes at host `locations`: one compiled copy per pool segment."""
    out: list[torch.Tensor | None] = [None] * len(locations)
    by_pool: dict[int, list[int]] = {}
    for i, loc in enumerate(locations):
        by_pool.setdefault(loc.pool, []).append(i)
    for pool, places in by_pool.items():
        locs = [locations[i] for i in places]
        src = mapping.rw_for(pool, max(loc.offset + loc.nbytes for loc in locs), 0)
        copies = copy_many_out(src, [loc.offset for loc in locs], [loc.nbytes for loc in locs],
                               [loc.dtype for loc in locs], [loc.shape for loc in locs])
        for i, tensor in zip(places, copies):
            out[i] = tensor
    return out  # type: ignore[return-value]  # every place is filled


def cached_locations(c: "Client", ns: str, keys: list[str], mapping: "EpochMapping",
                     same_as: list[Location] | None = None, arenas: bool = False) -> list[Location] | None:
    """Under the client's lock: apply the ring's unread events, then each key's cached location
    (in a host pool, or with `arenas` also in a CUDA arena), else the one the ring's entry index
    shows (cached from now on, so the ring's events keep it current); with `same_as`, the very
    objects it holds. None at any doubt."""
    ring, cache = mapping.ring, c._cache
    trusted, overrun = cache.sync(ring)
    if overrun:  # operators see overruns in ecd_ring_reader_overruns_total
        c._send_quietly(Report(0, 1))
    if not trusted:
        return None
    found = []
    for i, key in enumerate(keys):
        keyhash = cache.keyhash(ns, key)
        loc = cache.located(keyhash, ns, key)
        if loc is None and same_as is None:
            loc = indexed_location(ring, mapping, keyhash, cache.stored(ns), key)
            if loc is not None:
                cache.remember(keyhash, ns, key, loc.generation, loc)
        if loc is None or (not arenas and mapping.is_arena(loc.pool)) or (same_as is not None and loc is not same_as[i]):
            return None
        found.append(loc)
    return found


def _locate(c: "Client", keys: list[str], arenas: bool = False) -> tuple["EpochMapping", list[Location]] | None:
    """Step 1, for get_cached, read_cached and hold_slots: the mapping and each key's location, or
    None (take the round trip)."""
    if not c.local_reads or not keys or len(keys) > c.limits.max_batch:
        return None
    _check_encodable("key", keys)  # as the round trip would: InvalidRequest, not UnicodeEncodeError
    with c._lock:
        mapping = c._map
        if mapping is None or not mapping.local or c._res.sock is None:
            return None
        locations = cached_locations(c, c.namespace, keys, mapping, arenas=arenas)
    return None if locations is None else (mapping, locations)


def _confirmed(c: "Client", keys: list[str], mapping: "EpochMapping", locations: list[Location],
               fence: Callable[[], None] | None = memory_barrier) -> bool:
    """Steps 3 and 4: after the fence, whether the ring still shows every location in place (then
    the reads are noted for the daemon)."""
    if fence is not None:
        fence()  # the copy's loads (a slot's stores) before the ring's write_seq is read again
    with c._lock:
        # same_as: each location must be the very one taken, which was taken in an allowed pool
        if c._map is not mapping or cached_locations(c, c.namespace, keys, mapping, locations, arenas=True) is None:
            return False
        if c._local_reads is not None:
            c._local_reads.add([loc.generation for loc in locations], c)
    return True


def get_cached(c: "Client", keys: list[str], verify: bool) -> list[torch.Tensor] | None:
    """Copies of `keys` made without a round trip, or None: take the round trip (nothing was
    told to anyone, nothing is held). Raises IntegrityError for a validated copy whose bytes do
    not match the checksum its producer stored (with `verify`)."""
    located = _locate(c, keys)
    if located is None:
        return None
    mapping, locations = located
    try:
        if verify:
            copied = [copy_out_checked(mapping.rw_for(loc.pool, loc.offset, loc.nbytes), loc.offset, loc.nbytes,
                                       loc.dtype, loc.shape, with_checksum=bool(loc.checksum)) for loc in locations]
            out = [tensor for tensor, _ in copied]
        else:
            out = copy_from_pools(mapping, locations)
    except IntegrityError:  # a pool file another process truncated: the daemon knows what is left
        return None
    if not _confirmed(c, keys, mapping, locations):
        return None  # evicted, replaced, deleted, a restart, or a ring in doubt: ask
    if verify:
        for key, loc, (_, actual) in zip(keys, locations, copied):
            if loc.checksum and actual != loc.checksum:
                raise corrupt_error(c, key, loc, actual)
    return out


def indexed_location(ring, mapping: "EpochMapping", keyhash: int, ns: str, key: str) -> Location | None:
    """The location the ring's entry index shows for exactly (ns, key), if it lies in a host pool
    or CUDA arena of this mapping (a record that points elsewhere was not written by the daemon:
    None)."""
    found = ring.index.lookup(keyhash, ns, key)
    if found is None:
        return None
    generation, pool, offset, nbytes, dtype, shape, checksum = found
    size = mapping.arena_sizes.get(pool) if mapping.is_arena(pool) else (mapping.sizes[pool] or None)
    if size is None or offset + nbytes > size:  # (0: a segment not mapped here, another tenant's)
        return None
    return Location(generation, pool, offset, nbytes, dtype, shape, checksum)


def read_cached(c: "Client", keys: list[str], consume: Callable[[list], T], verify: bool) -> tuple[bool, T | None]:
    """Client.read_many's route without a round trip: (True, what `consume` returned) when it
    ran on views taken without a lease and the ring, read after it returned, confirms every
    entry was still in place; (False, None): take the leased route (`consume` may have run; its
    result is dropped). With `verify`, a view whose bytes do not match its stored checksum is not
    consumed: IntegrityError once the ring confirms the entry, else the leased route."""
    located = _locate(c, keys)
    if located is None:
        return False, None
    mapping, locations = located
    if not _reach(mapping, locations):
        return False, None
    corrupt = _first_corrupt(keys, mapping, locations) if verify else None
    result = None
    if corrupt is None:
        result = consume(_views(mapping, locations))
    if not _confirmed(c, keys, mapping, locations):
        return False, None
    if corrupt is not None:
        raise corrupt_error(c, *corrupt)
    return True, result


def _reach(mapping: "EpochMapping", locations: list[Location]) -> bool:
    """Whether each host pool file reaches past its entries (named files someone may truncate;
    memfds are sealed). False: truncated, the daemon knows what is left."""
    if not mapping.sealed:
        try:
            for loc in locations:
                if not mapping.is_arena(loc.pool):
                    mapping.ro_for(loc.pool, loc.offset, loc.nbytes)
        except IntegrityError:
            return False
    return True


def _first_corrupt(keys: list[str], mapping: "EpochMapping", locations: list[Location]) -> tuple | None:
    """(key, location, actual checksum) of the first entry whose mapped bytes do not match its stored checksum."""
    for key, loc in zip(keys, locations):
        actual = checksum_of(mapping.ro, loc) if loc.checksum else loc.checksum
        if actual != loc.checksum:
            return key, loc, actual
    return None


def _views(mapping: "EpochMapping", locations: list[Location]) -> list[torch.Tensor]:
    views = mapping.views
    return [views.view(loc.pool, loc.offset, loc.nbytes, loc.dtype, loc.shape) for loc in locations]


def checksum_of(pools: list, loc: Location) -> int:
    return entry_checksum(pools[loc.pool], loc.offset, loc.nbytes)


class LocalReads:
    """Generations this client read without asking, until they are told to the daemon."""

    __slots__ = ("_generations", "_told_at")

    def __init__(self, pending: list[int]) -> None:
        """`pending`: the list they wait in (the client's Resources.unreported, which the
        goodbye flushes even when the client is never closed)."""
        self._generations = pending
        self._told_at = time.monotonic()

    def add(self, generations: list[int], c: "Client") -> None:
        """Under the client's lock."""
        self._generations += generations
        if len(self._generations) >= REPORT_BATCH or time.monotonic() - self._told_at >= REPORT_EVERY_S:
            self.tell(c)

    def __bool__(self) -> bool:
        return bool(self._generations)

    def tell(self, c: "Client") -> None:
        """Send what is pending (fire-and-forget; under the client's lock)."""
        pending = self._generations[:]
        self._generations.clear()
        self._told_at = time.monotonic()
        for first in range(0, len(pending), REPORT_BATCH):
            c._send_quietly(Report(0, local_reads=pending[first:first + REPORT_BATCH]))

    def drop(self) -> None:
        """A new daemon run: these generations named the old one's entries."""
        self._generations.clear()



def hold_slots(c: "Client", keys: list[str]) -> "tuple[EpochMapping, list[Location], OpenView] | None":
    """Read slots (memory/entry_index.py) instead of read leases over `keys`, for views and for
    copies made by a GPU: (the mapping, each key's location, the OpenView that names the slots);
    None: take the leased route (nothing is held). Every key must be located, in a host pool or a
    CUDA arena, and this session must have a page with a free slot for each. The slots are
    stored, then a full fence, then the ring must still show every location in place: from then
    on the daemon sees the slots before it frees any of those extents."""
    from .client import OpenView
    located = _locate(c, keys, arenas=True)
    if located is None:
        return None
    mapping, locations = located
    generations = [loc.generation for loc in locations]
    with c._lock:
        page = c._slots
        slots = page.hold(generations) if page is not None and c._map is mapping else None
    if slots is None:
        return None
    held = OpenView(c.namespace, keys, generations, c._session, mapping.epoch, slots, page)
    try:
        if not _confirmed(c, keys, mapping, locations, full_barrier) or not _reach(mapping, locations):
            c._let_go(held)
            return None
    except BaseException:
        c._let_go(held)
        raise
    return mapping, locations, held


def slot_page(welcome: Welcome, mapping: "EpochMapping | None") -> SlotPage | None:
    """The session's page of read slots the Welcome names, if it lies in a pool this process
    maps (else none: views ask the daemon)."""
    page = welcome.ring.read_slots
    if len(page) != 3 or mapping is None or not mapping.local or not 0 <= page[0] < len(mapping.rw):
        return None
    pool, offset, count = page
    if offset < 0 or count <= 0 or offset + count * SLOT_BYTES > mapping.sizes[pool]:
        return None
    return SlotPage(mapping.rw[pool], offset, count)


def slots_released(c: "Client", held: "OpenView") -> None:
    """After a view's read slots are cleared (under the client's lock): when the ring shows one of
    its entries gone meanwhile, the daemon keeps that extent until it sees the slot clear, at its
    next expiry tick; a Report (no reply) makes it look now."""
    mapping = c._map
    if mapping is None or c._res.sock is None:
        return
    trusted, _ = c._cache.sync(mapping.ring)
    for key, generation in zip(held.keys, held.generations):
        loc = c._cache.located(c._cache.keyhash(held.ns, key), held.ns, key) if trusted else None
        if loc is None or loc.generation != generation:
            c._send_quietly(Report(0))
            return


def corrupt_error(c: "Client", key: str, loc: Location, actual: int) -> IntegrityError:
    """Count a failed verification with the daemon (ecd_integrity_failures_total) and build
    the error; the caller releases the lease."""
    c._send_quietly(Report(0, integrity_failures=1))
    with c._lock:
        c._cache.forget(c._cache.keyhash(c.namespace, key))
    return IntegrityError(
        f"{key!r} in namespace {c.namespace!r} (generation {loc.generation}, {loc.nbytes} bytes) "
        f"failed verification: its producer stored checksum {describe(loc.checksum)}, the bytes "
        f"read hash to {describe(actual)}", key=key, expected=loc.checksum, actual=actual)
