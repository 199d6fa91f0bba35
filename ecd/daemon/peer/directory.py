"""The fleet directory (`[cluster] directory`): daemons find each other, and each other's keys,
through a Redis or Valkey they share (the layout: directory_store.py).

Everything that talks to the store runs on the directory's own thread (and lookups on a second
one), with a synchronous client whose every command gives up after `directory_timeout`: a slow or
dead store never touches the daemon's loop. The thread:
- registers this node (its record and its place in the live set, under `directory_ttl`) and
  renews it every third of the TTL; each renewal answers the live nodes, and those this node does
  not know yet (or that restarted: another epoch) have their record read, and the set goes to
  the loop as peers (Cluster.directory_peers), beside the static `peers`;
- flushes the key map: what HoldingsListener queued on the loop (the keys `directory_keys`
  selects: encoder-cache entries by default), SADD/SREM in pipelined batches;
- on any failure marks the directory down, keeps the last peers it knew (the loop is not told),
  retries with backoff, and when the store answers again registers again and resyncs: this
  node's registered set in the store is diffed against what it holds now (the listener keeps
  that set, `held`). A fresh registration (the store restarted empty, or the record expired), a
  cold start (`cleared`) and an overflowing queue resync too.

CURVE: a peer's public key may come from the directory only if the operator admitted it too
(it is in `curve_allowed_keys`): a directory cannot introduce a key the operator did not admit.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable

import redis

from ... import __version__
from ...cluster_config import ClusterSection
from ...protocol import EncoderMeta, EntryMeta
from .directory_store import RECORD_FIELDS, DirectoryStore, connect, member, password_file_open, read_password

if TYPE_CHECKING:  # pragma: no cover
    from ..holdings import Medium

log = logging.getLogger("ecd.directory")

MAX_QUEUE = 100_000  # key changes queued for the thread; past it, a resync instead
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.1, 5.0
_MEDIUM_BITS = {"CPU": 1, "STORAGE": 2, "GPU": 4}  # holdings.Medium's values (a str enum)


@dataclass
class DirectoryCounters:
    """What /metrics and Stats show of the directory (written by its threads, read anywhere)."""
    up: bool = False
    commands: int = 0
    errors: int = 0
    lookups: int = 0
    lookup_keys_found: int = 0  # keys a lookup found a live holder for
    lookup_keys_unknown: int = 0
    resyncs: int = 0
    overflows: int = 0
    last_error: str = ""
    nodes: list[str] = field(default_factory=list)  # the live nodes, this one included
    routed: dict[str, int] = field(default_factory=dict)  # keys fetched from a holder the lookup named, by node


@dataclass(frozen=True)
class DirectoryPeer:
    node: str
    endpoint: str  # its peer control endpoint (advertise, else listen)
    curve: str  # its Z85 public key, "" without CURVE


class Directory:
    """The directory of one daemon. Made and started by Cluster.start; a HoldingsListener."""

    def __init__(self, config: ClusterSection, node: str, epoch: int, record: Callable[[], dict[str, str]],
                 on_peers: Callable[[list[DirectoryPeer]], None]) -> None:
        """`record`: this node's record now (called on the thread; RECORD_FIELDS but node and
        epoch); `on_peers`: told the live nodes but this one, on the loop, after each renewal.
        ValueError: the password file cannot be used."""
        self.config = config
        self.node = node
        self.epoch = epoch
        self.ttl = float(config.directory_ttl)
        self.timeout = float(config.directory_timeout)
        self.keys = config.directory_keys
        self._record = record
        self._on_peers = on_peers
        self.loop: asyncio.AbstractEventLoop | None = None
        self.counters = DirectoryCounters()
        self.credentials = self.load_credentials()
        self.held: dict[tuple[str, str], int] = {}  # directory-worthy keys held here -> medium bits
        self._queue: collections.deque[tuple[bool, str]] = collections.deque()
        self._lock = threading.Lock()  # held, _queue, _resync: the loop writes, the thread reads
        self._resync = True
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._known: dict[str, tuple[str, DirectoryPeer | None]] = {}  # node -> (epoch, its peer)
        self._store: DirectoryStore | None = None
        self._registered = False
        self._reported_down = False
        self._thread = threading.Thread(target=self._run, name="ecd-directory", daemon=True)
        self._lookups = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ecd-directory-lookup")

    def load_credentials(self) -> tuple[str | None, str | None]:
        """directory_password_file (ValueError saying why not); re-read on SIGHUP (reload)."""
        path = self.config.directory_password_file
        if not path:
            return None, None
        if password_file_open(path):
            log.warning("cluster.directory_password_file: %s is readable by group or others (chmod 600 it)", path)
        return read_password(path)

    def reload(self) -> None:
        """SIGHUP: the password file again; the next command connects with it."""
        try:
            credentials = self.load_credentials()
        except ValueError as exc:
            log.error("SIGHUP: keeping the directory's credentials: %s", exc)
            return
        if credentials != self.credentials:
            self.credentials = credentials
            self._store = None  # a new client, with them
            self._registered = False
            self._wake.set()

    @property
    def up(self) -> bool:
        return self.counters.up

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._thread.start()

    # ---- HoldingsListener: on the loop; only bookkeeping and a queue --------------------------

    def wanted(self, meta: EntryMeta | None) -> bool:
        return self.keys == "all" or (self.keys == "encoder" and isinstance(meta, EncoderMeta))

    def seed(self, entries: Iterable[tuple[str, str, EntryMeta | None]]) -> None:
        """At start, before listening: what the store holds already (adopted from the last run).
        The first registration resyncs against it."""
        with self._lock:
            for ns, key, meta in entries:
                if self.wanted(meta):
                    self.held[(ns, key)] = 1

    def stored(self, ns: str, key: str, medium: "Medium", meta: EntryMeta | None) -> None:
        k = (ns, key)
        bit = _MEDIUM_BITS.get(medium, 1)
        with self._lock:
            bits = self.held.get(k)
            if bits is not None:
                self.held[k] = bits | bit
                return
            if not self.wanted(meta):
                return
            self.held[k] = bit
            self._put(True, member(ns, key))

    def removed(self, ns: str, key: str, medium: "Medium", meta: EntryMeta | None) -> None:
        k = (ns, key)
        with self._lock:
            bits = self.held.get(k)
            if bits is None:
                return
            bits &= ~_MEDIUM_BITS.get(medium, 1)
            if bits:
                self.held[k] = bits
                return
            del self.held[k]
            self._put(False, member(ns, key))

    def cleared(self) -> None:
        """What the fleet knew of this node is void (the daemon says so at start): the store's view
        of this node is diffed against `held` again. `held` itself stays: it was seeded from the
        store when the directory started listening, and follows every change since, so it is what
        this node holds now (a cold start holds nothing; an adopting one what it adopted)."""
        with self._lock:
            self._queue.clear()
            self._resync = True
        self._wake.set()

    def _put(self, add: bool, text: str) -> None:
        if len(self._queue) >= MAX_QUEUE:  # the thread is behind (the store is slow or down)
            self._queue.clear()
            self._resync = True
            self.counters.overflows += 1
        else:
            self._queue.append((add, text))
        self._wake.set()

    # ---- lookups: from the loop, answered on the lookup thread ---------------------------------

    async def lookup(self, ns: str, keys: list[str]) -> list[list[str]] | None:
        """Per key, the live nodes holding it; None when the directory is down or failed."""
        store = self._store
        if store is None or not self.counters.up:
            return None
        self.counters.lookups += 1
        try:
            found = await asyncio.get_running_loop().run_in_executor(self._lookups, store.lookup, ns, keys)
        except (redis.RedisError, OSError) as exc:
            self._failed(exc)
            return None
        finally:
            self.counters.commands += 1
        hits = sum(1 for x in found if x)
        self.counters.lookup_keys_found += hits
        self.counters.lookup_keys_unknown += len(keys) - hits
        return found

    def routed(self, node: str, n: int) -> None:
        self.counters.routed[node] = self.counters.routed.get(node, 0) + n

    # ---- the thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        backoff = BACKOFF_MIN_S
        next_refresh = 0.0
        while not self._stop.is_set():
            self._wake.clear()
            try:
                store = self._store  # reload() may drop it meanwhile: this round uses the one it took
                if store is None:
                    user, password = self.credentials
                    store = self._store = DirectoryStore(connect(self.config.directory, self.timeout, user, password),
                                                         self.config.directory_prefix)
                if not self._registered or time.monotonic() >= next_refresh:
                    self._refresh(store)
                    next_refresh = time.monotonic() + self.ttl / 3
                self._flush(store)
            except (redis.RedisError, OSError) as exc:
                self._failed(exc)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S, self.ttl / 3)
                continue
            except Exception:  # a bug here must not end the thread: log it, go on
                log.exception("directory thread")
                self._registered = False
                self._stop.wait(BACKOFF_MAX_S)
                continue
            backoff = BACKOFF_MIN_S
            self._wake.wait(max(0.0, next_refresh - time.monotonic()))

    def _failed(self, exc: BaseException) -> None:
        self.counters.errors += 1
        self.counters.last_error = f"{type(exc).__name__}: {exc}"
        self._registered = False
        with self._lock:
            self._resync = True  # what was being written may be lost
        if not self._reported_down:  # once per outage (and for the first failure at start)
            self._reported_down = True
            log.warning("directory %s is unreachable (%s): serving on, with the static peers and the %d "
                        "peers last known; retrying", self.config.directory, self.counters.last_error,
                        len(self._known) - 1 if self.node in self._known else len(self._known))
        self.counters.up = False

    def _refresh(self, store: DirectoryStore) -> None:
        record = dict(self._record())
        record.update(node=self.node, epoch=str(self.epoch), version=__version__)
        fresh, dead, live = store.register(self.node, self.ttl, {k: record.get(k, "") for k in RECORD_FIELDS})
        self.counters.commands += 1
        if not self.counters.up:
            log.info("directory %s: registered node %r (%d live node(s))", self.config.directory, self.node, len(live))
        self._reported_down = False
        self.counters.up = True
        self.counters.last_error = ""
        if fresh:
            with self._lock:
                self._resync = True
        self._registered = True
        for name in dead:  # this call pruned it: its entries leave the key sets
            self.counters.commands += store.forget_node(name)
            log.info("directory: node %r expired", name)
        changed = [name for name, epoch in live.items() if name != self.node
                   and (name not in self._known or self._known[name][0] != epoch)]
        records = store.records(changed) if changed else {}
        self.counters.commands += len(changed)
        known: dict[str, tuple[str, DirectoryPeer | None]] = {}
        for name, epoch in live.items():
            if name == self.node:
                continue
            if name in records:
                rec = records[name]
                endpoint = rec.get("endpoint", "")
                known[name] = (epoch, DirectoryPeer(name, endpoint, rec.get("curve", "")) if endpoint else None)
            elif name in self._known:
                known[name] = self._known[name]
        self._known = known
        self.counters.nodes = sorted(live)
        peers = [peer for _, peer in known.values() if peer is not None]
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self._on_peers, peers)

    def _flush(self, store: DirectoryStore) -> None:
        """The queued key changes to the store; a resync first when one is due."""
        with self._lock:
            resync, self._resync = self._resync, False
            snapshot = {member(ns, key) for ns, key in self.held} if resync else None
            queued = list(self._queue)
            self._queue.clear()
        try:
            if snapshot is not None:
                self.counters.resyncs += 1
                there = store.held(self.node)
                self.counters.commands += 1 + len(there) // 1000
                changes = [(True, t) for t in snapshot - there] + [(False, t) for t in there - snapshot]
                self.counters.commands += store.apply(self.node, changes)
                if changes:
                    log.info("directory: resynced node %r's keys (%d held, %d added, %d withdrawn)", self.node,
                             len(snapshot), len(snapshot - there), len(there - snapshot))
            if queued:
                last = dict((text, add) for add, text in queued)  # a key's last change wins
                self.counters.commands += store.apply(self.node, ((add, t) for t, add in last.items()))
        except BaseException:
            with self._lock:
                self._resync = True  # what was queued may be half written: the next round resyncs
            raise

    def close(self) -> None:
        """Stop the threads; leave the directory (the node drops out now, not after its TTL)."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.timeout + 1.0)
        self._lookups.shutdown(wait=False, cancel_futures=True)
        store = self._store
        if store is not None and self.counters.up:
            try:
                store.leave(self.node)
            except (redis.RedisError, OSError) as exc:
                log.info("directory: could not leave cleanly (%s): the node expires after its TTL", exc)
        self.counters.up = False
