"""The tier below the host pool, as the store and the request handlers ask it: one Protocol
(`LowerTier`) and the tier a daemon without `[pool.disk]` runs with (`NullTier`: it holds nothing,
keeps nothing, makes nothing durable). The disk tier (disk.DiskTier) is the one implementation
today; a later tier (another node's pool, an object store) plugs in the same way. Nothing asks
whether such a tier exists: the store asks the one it was given.

What flows through it (ecd/daemon/tiers/disk.py describes the disk tier's side of each):
- eviction: `spill(entry)` as the entry leaves the host pool (first: a record that keeps its bytes
  keeps the key present), `clean(entry)` to prefer victims whose bytes it holds already;
- a read miss: `holds` the key? then `promote` brings it back into the host pool (the store parks
  the read until it is READY, or `promotion_failed` answers it); `touch` on a plain lookup;
- a put: `replaced(entry)` drops a record of the key's old bytes; `persist` writes committed
  entries through (`persists` says whether it can);
- removal: `drop` (delete, operator eviction), `cut` (the entry's host bytes were truncated away);
- restart: the tier re-indexes what it kept at start (its own business) and `attach` makes those
  keys present once the store serves; `listing` shows them to `ecd keys` and operator evictions;
- operations: `writes` in flight (a drain waits for them), `stats`, `metric_families`,
  `integrity_failures`, `internal_sessions` (its own store session), removal marks (a request that
  dropped records is answered once their files are gone), `close`.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Protocol

from ...errors import Code
from ...memory.ring import EventKind
from ...protocol import DiskStats, Failure

if TYPE_CHECKING:  # pragma: no cover
    from ..registry.entries import Entry
    from ..registry.store import Store


class LowerTier(Protocol):
    @property
    def persists(self) -> bool:
        """Whether a put may ask to be made durable here (put(persist=True); Welcome.disk)."""
        ...

    @property
    def writes(self) -> int:
        """Writes in flight (spills, write-throughs): a draining daemon waits for them."""
        ...

    @property
    def internal_sessions(self) -> int:
        """Store sessions the tier opened for itself (not clients: Stats and /metrics leave them out)."""
        ...

    def attach(self, store: "Store", loop: asyncio.AbstractEventLoop, segments: list[Any]) -> None:
        """Serve: the store consults the tier from now on; what it re-indexed at start is present."""

    def holds(self, ns: str, key: str) -> bool:
        """Whether the tier keeps the key (a read brings it back into the host pool)."""
        ...

    def clean(self, entry: "Entry") -> bool:
        """Whether `entry`'s bytes are here already: evicting it costs no write."""
        ...

    def touch(self, ns: str, key: str) -> None:
        """A lookup found the key here: it is recently used."""

    def promote(self, ns: str, key: str) -> bool:
        """Start bringing the key back into the host pool (once, however many ask); the store's
        commit (or promotion_failed) ends it. False when the tier does not hold the key."""
        ...

    def spill(self, entry: "Entry") -> None:
        """`entry` is evicted from the host pool now: keep its bytes if the tier will."""

    def replaced(self, entry: "Entry") -> None:
        """`entry` was committed as its key's new value: bytes the tier holds of another
        generation must never be served again."""

    def cut(self, entry: "Entry") -> None:
        """`entry`'s host bytes were truncated away: a copy still being made from them goes."""

    def drop(self, ns: str, key: str, kind: EventKind = EventKind.DELETED) -> bool:
        """Forget the key (delete, replacement, operator eviction). False when it held none."""
        ...

    def listing(self, ns: str | None = None) -> Iterable[Any]:
        """The records the tier holds (all, or `ns`'s), each with .ns, .key and .header."""
        ...

    def persist(self, entries: list["Entry | None"]) -> "asyncio.Future[list[Failure | None]]":
        """Write committed entries through, durably: per entry None once done, else why not."""
        ...

    def removal_mark(self) -> int:
        """A mark for removals_since()."""
        ...

    def removals_since(self, mark: int) -> "asyncio.Future[None] | None":
        """Done once every removal started since `mark` is durable; None when there was none."""
        ...

    def stats(self) -> DiskStats | None:
        """Stats.disk (None: nothing to report)."""
        ...

    def metric_families(self) -> Iterator[Any]:
        """Its /metrics families (prometheus_client metric families)."""
        ...

    def integrity_failures(self) -> dict[str, int]:
        """Records found corrupt, by where (the `where` label of ecd_integrity_failures_total)."""
        ...

    def close(self) -> None:
        """Stop its threads (before the host pool is unmapped)."""


class NullTier:
    """The lower tier of a daemon without one: holds nothing, so an evicted entry is simply gone,
    a read miss is a miss, and a put asking for durability is refused (persists is False)."""

    persists = False
    writes = 0
    internal_sessions = 0

    def attach(self, store: "Store", loop: asyncio.AbstractEventLoop, segments: list[Any]) -> None:
        pass

    def holds(self, ns: str, key: str) -> bool:
        return False

    def clean(self, entry: "Entry") -> bool:
        return False

    def touch(self, ns: str, key: str) -> None:
        pass

    def promote(self, ns: str, key: str) -> bool:
        return False

    def spill(self, entry: "Entry") -> None:
        pass

    def replaced(self, entry: "Entry") -> None:
        pass

    def cut(self, entry: "Entry") -> None:
        pass

    def drop(self, ns: str, key: str, kind: EventKind = EventKind.DELETED) -> bool:
        return False

    def listing(self, ns: str | None = None) -> Iterable[Any]:
        return ()

    def persist(self, entries: list["Entry | None"]) -> "asyncio.Future[list[Failure | None]]":
        done: asyncio.Future[list[Failure | None]] = asyncio.get_running_loop().create_future()
        done.set_result([None if entry is None else Failure(Code.NOT_DURABLE, f"{entry.key!r} not persisted: "
                                                             "this daemon has no disk tier") for entry in entries])
        return done

    def removal_mark(self) -> int:
        return 0

    def removals_since(self, mark: int) -> "asyncio.Future[None] | None":
        return None

    def stats(self) -> DiskStats | None:
        return None

    def metric_families(self) -> Iterator[Any]:
        return iter(())

    def integrity_failures(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass
