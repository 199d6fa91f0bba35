"""What the store keeps: entries and their states, client sessions, parked waiters.

Plain records with no behaviour beyond describing themselves; `store.Store` owns and changes
them on the daemon's event loop (see its docstring for the entry life cycle).
"""
from __future__ import annotations

import collections
import enum
from dataclasses import dataclass, field
from typing import Callable, Protocol

from ...errors import Code
from ...memory.ring import key_hash
from ...protocol import EntryMeta, Failure, Location


class State(enum.IntEnum):
    WRITING = 1
    READY = 2
    RETIRED = 3


@dataclass(slots=True, eq=False)
class Entry:
    generation: int
    ns: str
    key: str
    dtype: str  # interned, as is ns: one string per distinct value, not one per entry
    shape: tuple[int, ...]  # shared by the entries of one shape (Store.shared_shape)
    nbytes: int
    pool: int
    offset: int
    state: State = State.WRITING
    owner: "Session | None" = None  # the writer, while WRITING
    readers: int = 0
    pins: int = 0
    last_access: float = 0.0
    # While WRITING, when the write is aborted; from READY on, when it was published. One slot
    # for the two (8 B per entry): no entry needs both at once.
    when: float = 0.0
    checksum: int = 0  # xxh3-64 of the bytes, as the producer computed it (0: none)
    journal: int = -1  # its record in the restart journal (memory/journal.py): intent, then entry
    meta: "EntryMeta | None" = None  # what the put said it is (KV events, the directory); never read here

    @property
    def write_deadline(self) -> float:
        return self.when if self.state is State.WRITING else 0.0

    @property
    def published_at(self) -> float:
        return self.when if self.state is not State.WRITING else 0.0

    @property
    def keyhash(self) -> int:
        """The ring's hash of (ns, key): computed when an event needs it (publish, removal),
        not stored: 44 bytes per entry saved for ~1 µs per event."""
        return key_hash(self.ns, self.key)

    def location(self) -> Location:
        return Location(self.generation, self.pool, self.offset, self.nbytes, self.dtype, list(self.shape),
                        self.checksum)


@dataclass(slots=True, eq=False)
class Reservation:
    """An anonymous extent a client holds for its next put (reservations.Reserving): the
    client copies into it first and names it after (Publish), which makes it an Entry. It has no
    key, is never indexed, read or evicted; its bytes count toward `ns` (the namespace of the
    client's last commit) until it is published, handed back, expired or its client goes."""
    generation: int  # from the entries' counter: Publish and Abort name it by this
    pool: int
    offset: int
    size: int  # the extent's bytes (aligned): what the pool and `ns` are charged
    ns: str
    owner: "Session"
    deadline: float  # the write TTL (a watched client's reservation outlives it)
    journal: int = -1  # its intent record in the restart journal (memory/journal.py)


@dataclass(eq=False)
class Waiter:
    """A parked Acquire: completes when every key is READY or when its timer fires."""

    session: "Session"
    ns: str
    keys: list[str]
    missing: set[str]
    on_done: Callable[[list[Location | Failure]], None]
    timer: "Cancellable | None" = None
    # False: asked with no wait, parked only while its keys come back from the disk tier
    patient: bool = True
    failures: dict[str, Failure] = field(default_factory=dict)  # keys whose promotion failed


@dataclass(eq=False)
class Session:
    id: int
    pid: int = 0
    leases: collections.Counter = field(default_factory=collections.Counter)  # generation -> n
    writes: dict[int, Entry] = field(default_factory=dict)  # named puts between Alloc and Commit
    reservation: "Reservation | None" = None  # an anonymous extent for the next put
    # Namespace of the last entry this client committed: a reservation asked for with a commit
    # counts toward it (until Publish names it, perhaps in another namespace). None: nothing yet.
    reserve_ns: str | None = None
    watched: bool = False  # the daemon learns at once when this client's process exits
    last_seen: float = 0.0  # monotonic time of the last request (kept for unwatched sessions only)
    pins: dict[int, float] = field(default_factory=dict)  # generation -> deadline
    waiters: set[Waiter] = field(default_factory=set)
    parked_keys: int = 0  # keys named by `waiters` (what their memory grows with)
    # requests of this client answered later, once work goes on after their handler (a fetch, a
    # persist, a removal): meanwhile it waits on the daemon, it is not silent
    replies_pending: int = 0
    closed: bool = False
    slot_page: tuple[int, int] | None = None  # its page of read slots (pool, page: memory/entry_index.py), if any
    # its tenant ("": the default): the namespaces it names are its tenant's (TENANT_SEP, handlers.py)
    tenant: str = ""


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class Scheduler(Protocol):
    def call_later(self, delay: float, callback: Callable[[], None]) -> Cancellable: ...


class RequestError(Exception):
    """A whole request is refused (batch too large, unknown session); the server answers Error."""

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code = code
