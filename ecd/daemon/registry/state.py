"""The registry's state as the Store's mixins (placement, waiting, deadlines, operator) see it:
the attributes Store.__init__ sets, and the few Store methods they call. Declared once here so
each mixin is checked against it (mypy) and a reader of a mixin sees what it may touch."""
from __future__ import annotations

import collections
from typing import Any, Callable, Sequence

from ...memory.allocator import ExtentAllocator
from ...memory.ring import EventKind, RingWriter
from ...protocol import AllocItem, Failure, Location
from .key_index import KeyIndex
from .entries import Entry, Reservation, Scheduler, Session, StoreLimits, Waiter


class RegistryState:
    allocators: list[ExtentAllocator]
    host_pools: tuple[int, ...]
    arena_pools: tuple[int, ...]
    largest_segment: int
    ring: RingWriter
    scheduler: Scheduler
    limits: StoreLimits
    clock: Callable[[], float]
    index: KeyIndex  # READY entries only, by (namespace, key)
    by_generation: dict[int, Entry]  # every entry that holds an extent
    reservations: dict[int, Reservation]  # by generation: extents held for a client's next put
    reserved_bytes: int
    evictable: collections.OrderedDict[int, Entry]  # LRU first
    evictable_bytes: list[int]
    waiters: dict[tuple[str, str], set[Waiter]]
    counters: collections.Counter
    ns_used: dict[str, int]
    quotas: dict[str, int]
    guarantees: dict[str, int]
    guaranteed_ready: dict[str, int]
    quota_refusals: collections.Counter
    quota_refused: int
    _deadlines: list[tuple[float, int, int]]
    _compact_deadlines_at: int
    _sessions: dict[int, Session]
    _quota_lru: dict[str, collections.OrderedDict[int, Entry]]
    _quota_evictable_bytes: dict[str, int]
    _protected: int
    disk: Any  # disk_tier.DiskTier with [pool.disk], else None

    # Store methods the mixins call (Store defines them; it comes first in its own MRO).
    def check_batch(self, n: int) -> None: raise NotImplementedError
    def writes_in_progress(self) -> int: raise NotImplementedError
    def _lease_all(self, session: Session, ns: str, keys: list[str]) -> list[Location | Failure]:
        raise NotImplementedError
    def _after_unhold(self, entry: Entry) -> None: raise NotImplementedError
    def _make_unevictable(self, entry: Entry) -> None: raise NotImplementedError
    def _unindex(self, entry: Entry, kind: EventKind) -> None: raise NotImplementedError
    def _remove(self, entry: Entry) -> None: raise NotImplementedError
    def _free(self, entry: Entry) -> None: raise NotImplementedError
    def _uncharge(self, ns: str, nbytes: int) -> None: raise NotImplementedError
    def _take_generation(self) -> int: raise NotImplementedError
    def _shared_shape(self, shape: Sequence[int]) -> tuple[int, ...]: raise NotImplementedError
    def _check_item(self, ns: str, item: AllocItem, pools: tuple[int, ...] | None = None) -> Failure | None:
        raise NotImplementedError
    def commit(self, session: Session, generation: int, checksum: int = 0) -> Failure | None:
        raise NotImplementedError
    # Placement's and Reservations' methods the other mixins call.
    def _too_large(self, nbytes: int, pools: tuple[int, ...]) -> str | None: raise NotImplementedError
    def _place(self, nbytes: int, ns: str | None, required: list[Entry] | tuple = (), evict: bool = True,
               pools: tuple[int, ...] | None = None) -> tuple[int, int] | None: raise NotImplementedError
    def _quota_victims(self, ns: str, size: int) -> list[Entry] | Failure: raise NotImplementedError
    def _evict(self, victim: Entry, counter: str) -> None: raise NotImplementedError
    def _push_deadline(self, deadline: float, generation: int, session_id: int) -> None: raise NotImplementedError
    def _reservation_expired(self, reservation: Reservation) -> None: raise NotImplementedError

