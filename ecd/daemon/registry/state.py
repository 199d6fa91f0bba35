"""The registry's shared record set, as the Store's parts (placement, reserving, waiting,
deadlines, operator) see it: the records Store.__init__ makes (the store's public attributes) and
the entry-life steps every part takes (the store's public methods). Each part gets the store as
this Protocol, so a reader of a part sees what it may touch, and mypy checks it: no part reaches
into the store's or another part's private state."""
from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Callable, Iterable, Protocol, Sequence

from ...memory.ring import EventKind, RingWriter
from ...protocol import Failure, Location
from .entries import Entry, Reservation, Scheduler, Session, Waiter
from .key_index import KeyIndex

if TYPE_CHECKING:  # pragma: no cover
    from ...config import LeasesSection, LimitsSection
    from ...memory.journal import Journal, NullJournal
    from ..tiers.base import LowerTier
    from ..tiers.host import HostTier
    from .checks import RequestChecks
    from .deadlines import Deadlines
    from .placement import Placement
    from .reclaim import SlotHolds
    from .reservations import Reserving
    from .waiting import Waiting


class RecordSet(Protocol):
    host: "HostTier"  # the pools and their allocators (tiers/host.py)
    lower_tier: "LowerTier"  # below the host pool: the disk tier, or a NullTier
    ring: RingWriter
    scheduler: Scheduler
    limits: "LimitsSection"
    leases: "LeasesSection"
    clock: Callable[[], float]
    index: KeyIndex  # READY entries only, by (namespace, key)
    by_generation: dict[int, Entry]  # every entry that holds an extent
    reservations: dict[int, Reservation]  # by generation: extents held for a client's next put
    reserved_bytes: int
    evictable: collections.OrderedDict[int, Entry]  # LRU first
    evictable_bytes: list[int]  # per pool, kept with `evictable`
    waiters: dict[tuple[str, str], set[Waiter]]  # parked gets by the keys they wait for
    counters: collections.Counter[str]
    journal: "Journal | NullJournal"  # the restart journal (memory/journal.py)
    ns_used: dict[str, int]  # by policy scope (placement.py)
    policies: dict[str, tuple[int, int]]
    verify_namespaces: frozenset[str]
    quotas: dict[str, int]
    guarantees: dict[str, int]
    guaranteed_ready: dict[str, int]
    quota_refusals: collections.Counter[str]
    quota_refused: int
    # the parts that others call
    checks: "RequestChecks"
    placement: "Placement"
    reserving: "Reserving"
    waiting: "Waiting"
    deadlines: "Deadlines"
    slot_holds: "SlotHolds"

    def each_session(self) -> Iterable[Session]: ...
    def session(self, session_id: int) -> Session | None: ...
    def check_batch(self, n: int) -> None: ...
    def writes_in_progress(self) -> int: ...
    def take_generation(self) -> int: ...
    def shared_shape(self, shape: Sequence[int]) -> tuple[int, ...]: ...
    def charge(self, ns: str, nbytes: int) -> None: ...
    def uncharge(self, ns: str, nbytes: int) -> None: ...
    def free(self, entry: Entry) -> None: ...
    def unindex(self, entry: Entry, kind: EventKind) -> None: ...
    def remove(self, entry: Entry) -> None: ...
    def after_unhold(self, entry: Entry) -> None: ...
    def lease_all(self, session: Session, ns: str, keys: list[str]) -> list[Location | Failure]: ...
    def commit(self, session: Session, generation: int, checksum: int = 0) -> Failure | None: ...
