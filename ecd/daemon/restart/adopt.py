"""A restarted daemon adopts the host pool its predecessor left with the keeper (keeper.py):
the same memory, mapped again, and the registry rebuilt from the journal (ecd/memory/journal.py),
without copying a byte. Anything that does not check out starts the daemon cold, with one log
line saying why: no pool kept, another layout (node, backing, segment sizes), another journal
format, a descriptor that is not what it claims.

What is adopted: every entry whose commit the journal recorded (the newest generation of a key,
where a kill between a replace's two records left two), READY, evictable, in the index and on
the event ring, with its namespace, generation, size, dtype, shape and checksum. What is not:
writes in progress (their extents are kept out of use for a write TTL, since the old daemon's
client may still be copying into them, then freed), reservations, leases and pins (their
sessions died with the old daemon), CUDA arenas (device memory dies with its process).
"""
from __future__ import annotations

import contextlib
import gc
import logging
import mmap
import os
import stat
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

from ...memory.allocator import align_up
from ...memory.entry_index import slot_area_bytes
from ...memory.host import HostPool, ShmError, ShmFile, segment_name, shm_path
from ...memory.journal import (KEY_BYTES, EntryRecord, IntentRecord, Journal, JournalRefused, Layout, default_size,
                               new_key)
from ...memory.memfd import (F_SEAL_GROW, F_SEAL_SEAL, F_SEAL_SHRINK, POOL_SEALS, SECRET_SEALS, MemfdFile,
                             sealed_secret, seals_of)
from ...memory.ring import HEADER_BYTES, READER_TRUST_S, old_ring_silent_in
from ...protocol import RestartStats
from ...writes.submission import area_bytes
from ..registry.entries import Entry, State

if TYPE_CHECKING:  # pragma: no cover
    from ...config import Config
    from ..registry.store import Store

log = logging.getLogger("ecd.daemon")

JOURNAL_FD = "journal"
JOURNAL_KEY_FD = "journal.key"  # the journal's MAC key (memory/journal.py): a sealed memfd, never a file
# The run's event ring: the next run reads its last heartbeat, and serves only once no reader
# trusts that ring any more (client/local_read.py validates copies against it). Optional: a
# keeper of an older ecd holds none, and the next run then waits the whole READER_TRUST_S.
RING_FD = "ring"


def pool_fd_name(index: int) -> str:
    return f"pool.{index}"


def journal_name(node: str) -> str:
    return f"ecd.{node}.journal"


def pool_layout(config: "Config") -> tuple[tuple[int, ...], dict[str, tuple[int, ...]]]:
    """The host pool's segment sizes and the segments of each tenant with a size: the default
    tenant's part first (what the sized tenants leave), then each sized tenant's own, by name. A
    sized tenant's segments hold its entries alone and are handed to its clients alone
    (docs/SECURITY.md). Each part's first segment has a tail after its share: the submission
    area and the read slots of that part's clients (tail_pools)."""
    segment, tail = int(config.pool.host.segment_size), slot_tail_bytes(config)
    parts = {name: int(tenant.size) for name, tenant in sorted(config.tenants.items()) if tenant.size}
    sizes = _cut(int(config.pool.host.size) - sum(parts.values()), segment)
    sizes[0] += tail
    groups: dict[str, tuple[int, ...]] = {}
    for name, size in parts.items():
        first = len(sizes)
        sizes += _cut(size, segment)
        sizes[first] += tail
        groups[name] = tuple(range(first, len(sizes)))
    return tuple(sizes), groups


def _cut(size: int, segment: int) -> list[int]:
    return [min(segment, size - start) for start in range(0, size, segment)]


def segment_sizes(config: "Config") -> tuple[int, ...]:
    return pool_layout(config)[0]


def tail_pools(groups: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """The segment whose tail holds each part's submission area and read slots, by tenant ("": the
    default tenant's, and every unsized tenant's: segment 0)."""
    return {"": 0, **{name: pools[0] for name, pools in groups.items()}}


def slot_tail_bytes(config: "Config") -> int:
    """Bytes after segment 0's share of the pool: the submission area (ecd/writes/submission.py),
    then the read slots (memory/entry_index.py)."""
    leases = config.leases
    return (submission_bytes(config) + slot_area_bytes(leases.slot_sessions, leases.read_slots))


def submission_bytes(config: "Config") -> int:
    """The submission area's bytes: none with named files (`backing = "named"`), which another
    process may truncate under a client's loads and stores of its page (a fault in the client)."""
    leases = config.leases
    return area_bytes(leases.slot_sessions, leases.submit_records) if config.pool.host.backing != "named" else 0


def layout_of(config: "Config") -> Layout:
    sizes, groups = pool_layout(config)
    return Layout(config.node.name, config.pool.host.backing, sizes, groups)


def journal_size(config: "Config") -> int:
    return int(config.restart.journal_size) or default_size(int(config.pool.host.size))


@dataclass
class Kept:
    """The pool and journal a previous run left, mapped, and the journal's valid records."""

    pool: HostPool
    journal_file: ShmFile
    journal: Journal
    key_fd: int  # the journal's key, handed to the keeper again at this run's start
    entries: list[EntryRecord]
    intents: list[IntentRecord]
    skipped: int  # records that failed their checks (torn, stray)
    opened_s: float  # mapping the memory and reading the journal
    old_ring_quiet_at: float = 0.0  # time.monotonic() when no reader trusts the previous run's ring


def open_kept(config: "Config", fds: dict[str, int]) -> Kept:
    """Map what the keeper handed back. JournalRefused (with the reason) when it is not this
    config's pool; the caller then closes `fds` and starts cold. Takes ownership of `fds` on
    success (the pool's files and the journal keep them)."""
    began = time.perf_counter()
    layout = layout_of(config)
    if JOURNAL_FD not in fds:
        raise JournalRefused("the keeper holds no journal")
    if JOURNAL_KEY_FD not in fds:
        raise JournalRefused("the keeper holds no journal key (a journal of an older ecd, or not the daemon's)")
    wanted = [pool_fd_name(i) for i in range(len(layout.segments))]
    missing = [name for name in wanted if name not in fds]
    others = 2 + (RING_FD in fds)
    if missing or len(fds) != len(wanted) + others:
        raise JournalRefused(f"the keeper holds {len(fds) - others} pool segment(s), the config gives "
                             f"{len(layout.segments)}")
    quiet_at = time.monotonic() + old_ring_silent_in_fd(fds.pop(RING_FD, -1))
    key = read_key(fds[JOURNAL_KEY_FD])
    size = journal_size(config)
    journal_file = _map(fds[JOURNAL_FD], journal_name(config.node.name), size, config.pool.host.backing,
                        pool=False)
    try:
        with gc_paused():
            journal, entries, intents, skipped = Journal.open(journal_file.buf, size, layout, key)
        segments = [_map(fds[pool_fd_name(i)], segment_name(config.node.name, i), seg_size, config.pool.host.backing)
                    for i, seg_size in enumerate(layout.segments)]
    except BaseException:
        journal_file.buf.close()
        raise
    return Kept(HostPool.from_segments(segments), journal_file, journal, fds[JOURNAL_KEY_FD], entries, intents,
                skipped, time.perf_counter() - began, quiet_at)


def old_ring_silent_in_fd(fd: int) -> float:
    """old_ring_silent_in of the ring file `fd` (closed here; -1: none was kept, wait it all)."""
    if fd < 0:
        return READER_TRUST_S
    try:
        with mmap.mmap(fd, HEADER_BYTES, mmap.MAP_SHARED, mmap.PROT_READ) as header:
            return old_ring_silent_in(header)
    except (OSError, ValueError):  # not a ring's file: wait as long as any reader could trust one
        return READER_TRUST_S
    finally:
        os.close(fd)


def read_key(fd: int) -> bytes:
    """The journal key in a kept descriptor, after checking it is one: KEY_BYTES in a memfd sealed
    against writes (JournalRefused otherwise)."""
    key = os.pread(fd, KEY_BYTES + 1, 0)
    if seals_of(fd) & SECRET_SEALS != SECRET_SEALS or len(key) != KEY_BYTES:
        raise JournalRefused("the kept journal key is not a sealed memfd of the key's size")
    return key


def _map(fd: int, name: str, size: int, backing: str, *, pool: bool = True) -> ShmFile:
    """A ShmFile (MemfdFile for memfds) over a kept descriptor, after checking it is what it
    should be: its size, a pool memfd's seals, a named pool file's path still naming it (clients
    open it by name)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size != size:
        raise JournalRefused(f"{name}: the kept descriptor is {st.st_size} bytes, {size} expected")
    if backing == "memfd" and pool:
        if seals_of(fd) & POOL_SEALS != POOL_SEALS:
            raise JournalRefused(f"{name}: the kept descriptor is not a sealed memfd")
    if backing == "named" and pool:
        try:
            on_disk = os.stat(shm_path(name))
        except OSError:
            raise JournalRefused(f"{shm_path(name)} is gone: clients could not open it") from None
        if (on_disk.st_dev, on_disk.st_ino) != (st.st_dev, st.st_ino):
            raise JournalRefused(f"{shm_path(name)} is another file than the one kept")
    buf = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    cls: Any = MemfdFile if backing == "memfd" else ShmFile
    return cls(name, size, buf, fd)


def create_journal(config: "Config") -> tuple[ShmFile, Journal, int]:
    """A new, empty journal (a cold start): a memfd, or /dev/shm/ecd.<node>.journal 0600 (only
    the daemon's user: clients never map it); and a new key's sealed memfd (the caller owns it)."""
    size = journal_size(config)
    name = journal_name(config.node.name)
    if config.pool.host.backing == "memfd":
        journal_file: ShmFile = MemfdFile.create_sealed(name, size, seals=F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)
    else:
        journal_file = ShmFile.create(name, size, mode=0o600)
    key = new_key()
    try:
        key_fd = sealed_secret(f"ecd.{config.node.name}.journal.key", key)
    except OSError as exc:
        journal_file.unlink()
        raise ShmError(f"cannot create the journal key's memfd: {exc.strerror}") from None
    return journal_file, Journal.create(journal_file.buf, size, layout_of(config), key), key_fd


def kept_fds(pool: HostPool, journal_file: ShmFile, key_fd: int, ring_fd: int) -> dict[str, int]:
    fds = {pool_fd_name(i): seg.fd for i, seg in enumerate(pool.segments)}
    fds[JOURNAL_FD] = journal_file.fd
    fds[JOURNAL_KEY_FD] = key_fd
    fds[RING_FD] = ring_fd
    return fds


# ---- the registry -----------------------------------------------------------------------

def adopt_entries(store: "Store", kept: Kept, quarantine_s: float) -> RestartStats:
    """Rebuild the registry from the journal's records (before the daemon serves). The cyclic
    garbage collector waits meanwhile: it would walk every new entry again and again (a third of
    the time for 100,000 of them) and there is no cycle among them to find."""
    with gc_paused():
        return _adopt_entries(store, kept, quarantine_s)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _adopt_entries(store: "Store", kept: Kept, quarantine_s: float) -> RestartStats:
    began = time.perf_counter()
    journal, host = kept.journal, store.host
    host_pools = set(host.host_pools)
    newest: dict[tuple[str, str], EntryRecord] = {}
    dropped = 0
    # a put the old daemon had not committed: never served, its extent quarantined like an intent's
    unfinished = [IntentRecord(r.at, r.generation, r.pool, r.offset, align_up(max(r.nbytes, 1)))
                  for r in kept.entries if not r.committed]
    for record in (r for r in kept.entries if r.committed):
        # (a record in another tenant's segments: the journal's groups matched, so a forgery or a bug's)
        if record.pool not in store.tier(-1, record.ns) or store.check_key(record.ns, record.key) is not None:
            journal.forget(record.at)
            dropped += 1
            continue
        key = (record.ns, record.key)
        other = newest.get(key)
        if other is not None and other.generation > record.generation:
            journal.forget(record.at)  # a replace killed between its two records: the newer wins
            continue
        if other is not None:
            journal.forget(other.at)
        newest[key] = record
    by_extent: dict[tuple[int, int], EntryRecord | IntentRecord] = {}
    for record in newest.values():  # two entries at one extent (a bug's): the newer one only
        there = by_extent.setdefault((record.pool, record.offset), record)
        if there is not record:
            loser, winner = (record, there) if record.generation < there.generation else (there, record)
            by_extent[(record.pool, record.offset)] = winner
            journal.forget(loser.at)
            dropped += 1
    for intent in [*kept.intents, *unfinished]:  # one beside a committed entry: the commit happened
        if intent.pool not in host_pools or (intent.pool, intent.offset) in by_extent:
            journal.forget(intent.at)
        else:
            by_extent[(intent.pool, intent.offset)] = intent
    per_pool: dict[int, list[tuple[int, int]]] = {pool: [] for pool in host.host_pools}
    for (pool, offset), held_record in by_extent.items():  # one pass, however many segments
        per_pool[pool].append((offset, _extent_bytes(held_record)))
    for pool, extents in per_pool.items():
        for offset, _ in host.allocators[pool].claim(extents):
            journal.forget(by_extent.pop((pool, offset)).at)  # overlaps another or lies outside
            dropped += 1
    now = store.clock()
    adopted = adopted_bytes = 0
    quarantined: list[IntentRecord] = []
    present: dict[Any, list[int]] = {}  # by ring
    for held in sorted(by_extent.values(), key=lambda r: r.generation):  # LRU order: oldest first
        store.generations_after(held.generation)
        if isinstance(held, IntentRecord):
            quarantined.append(held)
            continue
        _insert(store, held, now, present)
        adopted += 1
        adopted_bytes += held.nbytes
    # No events: no client has read this run's rings yet; the presence tables are what they ask.
    for ring, keyhashes in present.items():
        ring.mark_all_present(keyhashes)
    if quarantined:
        store.scheduler.call_later(quarantine_s, lambda: _end_quarantine(store, journal, quarantined))
    return RestartStats(
        adopted=True, entries=adopted, bytes=adopted_bytes, quarantined=len(quarantined), skipped_records=kept.skipped + dropped,
        seconds=kept.opened_s + time.perf_counter() - began)


def _extent_bytes(record: EntryRecord | IntentRecord) -> int:
    return record.nbytes if isinstance(record, EntryRecord) else record.size


def _insert(store: "Store", record: EntryRecord, now: float, present: dict[Any, list[int]]) -> None:
    """One READY entry from its record; its key hash goes to `present` (by ring: its presence
    table, filled for all of them at once)."""
    ns = sys.intern(record.ns)
    entry = Entry(record.generation, ns, record.key, sys.intern(record.dtype), store.shared_shape(record.shape),
                  record.nbytes, record.pool, record.offset, state=State.READY, last_access=now, when=now,
                  checksum=record.checksum, journal=record.at)
    store.by_generation[entry.generation] = entry
    store.index[(ns, entry.key)] = entry
    size = align_up(max(entry.nbytes, 1))
    store.charge(ns, size)
    store.guarantee(entry, size)
    store.placement.make_evictable(entry)
    keyhash = record.keyhash or entry.keyhash
    store.announcer.index(entry, keyhash)
    if not store.lower_tier.holds(ns, entry.key):  # else the disk tier's record keeps the key present
        present.setdefault(store.announcer.ring_of(ns), []).append(keyhash)


def _end_quarantine(store: "Store", journal: Journal, intents: list[IntentRecord]) -> None:
    """The old daemon's writes can no longer be in progress: their extents go back to the pool."""
    for intent in intents:
        journal.forget(intent.at)
        store.host.free(intent.pool, intent.offset, intent.size)
    log.info("restart: %d extent(s) of writes the previous run left unfinished are free again", len(intents))
