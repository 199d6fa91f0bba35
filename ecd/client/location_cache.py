"""The client's location cache: which generation of which keys this client last put or read.

What it is for: `Client.exists` answers a key from the event ring without a round trip when it
can. The ring's presence table only says "certainly absent" or "maybe present"; a "maybe" becomes
a local `True` only for a key whose generation this client itself put or read, and whose eviction,
deletion or replacement it has not read from the ring since. It also keeps a ring "absent" from
being believed for such a key: a presence word someone overwrote with a well-formed ABSENT, or an
eviction whose event is not read yet, is then asked about.

It also holds where the entry lives (a `Location`: pool, offset, size, dtype, shape, checksum)
when the put or reply told it, so a repeated `get` copies without asking (Client._get_cached):
the copy is validated afterwards against the ring (the seqlock pattern: the daemon announces an
eviction, deletion or replacement on the ring before the extent can be reused, so a copy that
saw reused bytes finds that event when it reads the ring after the copy, and is thrown away).

So an entry here is only ever a shortcut. Dropping one (or all: `clear`) never changes an answer;
it costs the next unpinned `exists` of that key one round trip. Keeping one is safe only while
every ring event since the reply it came from is applied (`apply`), which the client ensures.

Bounded: a least-recently-used map of at most `capacity` entries (LOCATION_CACHE_ENTRIES by
default, ~0.3 KiB each), so a long-lived engine that puts and reads millions of distinct keys
keeps a flat footprint (before issue 12 the map only shrank through exists(): +26 MiB RssAnon per
100k keys of a client that never called it). Remembering or answering from an entry makes it the
most recent; the least recent goes when a new key would exceed the capacity.

Kept current from the event ring by `sync` (before exists() answers from it) and `catch_up`
(after a put or get, so a client that never calls exists() does not fall behind).

Not thread-safe: the Client calls it under its lock. Torch-free.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

from ..memory.ring import READER_TRUST_S, EventKind, key_hash, tenant_namespace
from ..protocol import Location

# Locations kept per Client: enough for the unpinned exists() an engine asks of what it handled
# recently (a step's embeddings or blocks: thousands at most); ~2.5 MiB when full.
LOCATION_CACHE_ENTRIES = 8192

_PUBLISHED = int(EventKind.PUBLISHED)

RING_SILENCE_S = READER_TRUST_S  # a ring whose heartbeat is older than this is not trusted
RING_MAX_BACKLOG = 4096  # more unread events than this: drop the location cache instead
# A put or get that finds this many unread ring events applies them to the location cache, so a
# client that never calls exists() keeps its cached locations current (pruned of evictions)
# instead of falling RING_MAX_BACKLOG behind and losing them all at its next exists().
RING_SYNC_BACKLOG = 1024


class LocationCache:
    """keyhash -> (namespace, key, generation, location or None), least recently used first."""

    __slots__ = ("capacity", "_entries", "tenant")

    def __init__(self, capacity: int = LOCATION_CACHE_ENTRIES) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity!r}")
        self.capacity = capacity
        self._entries: OrderedDict[int, tuple[str, str, int, Location | None]] = OrderedDict()
        self.tenant = ""  # the client's tenant (Welcome.tenant): its namespaces are stored as the tenant's

    def stored(self, namespace: str) -> str:
        """This client's `namespace` as the daemon stores it (its tenant's), as the ring and its
        entry index name it."""
        return tenant_namespace(self.tenant, namespace) if self.tenant else namespace

    def keyhash(self, namespace: str, key: str) -> int:
        """The key hash the daemon publishes for `key` of this client's `namespace` (ring.key_hash
        of the namespace as the daemon stores it)."""
        return key_hash(self.stored(namespace), key)

    def remember(self, keyhash: int, namespace: str, key: str, generation: int,
                 location: Location | None = None) -> None:
        """This client put or read `generation` of (namespace, key) (at `location`, if known):
        it is the most recent entry."""
        entries = self._entries
        entries[keyhash] = (namespace, key, generation, location)
        entries.move_to_end(keyhash)
        if len(entries) > self.capacity:
            entries.popitem(last=False)

    def remember_reply(self, ring, ring_pos: int, namespace: str, keys: list[str], keyhashes: list[int],
                       generations: list[int], *, catch_up: bool,
                       locations: list[Location] | None = None) -> None:
        """Locations a reply brought, unless ring events were consumed while its request was out
        (`ring.next_seq` moved on from `ring_pos`, where it stood before the request): one of
        them may have been this entry's eviction, read before it was cached. Then, with
        `catch_up` (a ring that is mapped), `catch_up` on it."""
        if ring.next_seq != ring_pos:
            return
        places = locations if locations is not None else [None] * len(keys)
        for keyhash, key, generation, location in zip(keyhashes, keys, generations, places):
            self.remember(keyhash, namespace, key, generation, location)
        if catch_up:
            self.catch_up(ring)

    def known(self, keyhash: int, namespace: str, key: str) -> bool:
        """Whether a location of exactly (namespace, key) is cached (a 64-bit hash collision with
        another key is not); a hit becomes the most recent entry."""
        cached = self._entries.get(keyhash)
        if cached is None or cached[0] != namespace or cached[1] != key:
            return False
        self._entries.move_to_end(keyhash)
        return True

    def located(self, keyhash: int, namespace: str, key: str) -> Location | None:
        """Where exactly (namespace, key) was, as of the ring events applied so far (None: not
        known); a hit becomes the most recent entry. The caller validates what it copies."""
        cached = self._entries.get(keyhash)
        if cached is None or cached[3] is None or cached[0] != namespace or cached[1] != key:
            return None
        self._entries.move_to_end(keyhash)
        return cached[3]

    def forget(self, keyhash: int) -> None:
        self._entries.pop(keyhash, None)

    def clear(self) -> None:
        self._entries.clear()

    def apply(self, events: Iterable[tuple[int, int, int]]) -> None:
        """Ring events (kind, keyhash, generation): drop what was evicted, deleted, or replaced
        by another generation. `events` as RingReader.poll returns them (.tolist() of it)."""
        entries = self._entries
        if not entries:
            return
        for kind, keyhash, generation in events:
            cached = entries.get(keyhash)
            if cached is not None and (kind != _PUBLISHED or cached[2] != generation):
                del entries[keyhash]

    def sync(self, ring) -> tuple[bool, bool]:
        """Apply the ring's unread events (a RingReader). Returns (whether the ring may answer
        negatives now, whether this reader was overrun: to be reported to the daemon)."""
        # usable: the writer is alive and the header (epoch included) is as the daemon wrote it;
        # a ring another group member scribbled over is not, until the daemon has repaired it.
        if not ring.usable(RING_SILENCE_S):
            self.clear()
            return False, False
        if not self._entries:
            ring.skip_to_head()
            return True, False
        corruptions = ring.corruptions
        events = ring.poll(RING_MAX_BACKLOG)
        if events is None:  # overrun, or events overwritten: an eviction may have been missed
            self.clear()
            return ring.corruptions == corruptions, True  # overwritten: ask the daemon this time
        self.apply(events.tolist())  # drops what was evicted, deleted, or replaced
        return True, False

    def catch_up(self, ring) -> None:
        """After a put or get: when the ring has RING_SYNC_BACKLOG unread events (half the ring
        if smaller), apply them, so a client that only puts and gets keeps up."""
        if ring.pending() < min(RING_SYNC_BACKLOG, ring.nslots // 2):
            return
        events = ring.poll(RING_MAX_BACKLOG) if ring.usable(RING_SILENCE_S) else None
        if events is None:
            # Too far behind (idle while others wrote), lapped, or the ring is not usable: what
            # is still valid cannot be told. Start again from the head, quietly: no answer
            # depended on it, so it is not reported as an overrun.
            self.clear()
            ring.skip_to_head()
        else:
            self.apply(events.tolist())

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __contains__(self, keyhash: object) -> bool:
        return keyhash in self._entries
