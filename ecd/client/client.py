"""ecd.Client: the synchronous client every engine shim is built on.

A Client is a ControlClient (ecd.client.control: the DEALER socket, handshake, reconnects, round
trips, the operations that move no bytes) plus the data plane: tensor bytes are copied straight
into and out of the daemon's shared-memory pools, mapped once per daemon epoch (ecd.client.mapping:
read-write for puts, read-only for views, so a stray write into a view faults). The event ring,
mapped read-only, answers exists() negatives and drops cached locations of evicted entries.

Every put goes one route, ecd.client.put: place (the session's put lease, inline, the reserved
extent, or extents allocated now), copy, commit (a submission record, ecd.writes; or PutInline,
Publish, Commit).

Thread-safety: one lock serialises socket round trips; copies run outside it. Remote use (CURVE,
see ControlClient): control operations and inline-sized puts; bulk put/get/view raise InvalidRequest.
"""
from __future__ import annotations

import contextlib
import faulthandler
import logging
import math
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator, Literal, Mapping, Sequence, TypeVar, cast, overload

import torch
import zmq

from ..errors import (RESTARTED, Code, EcdError, KeyNotFound, StaleGeneration, error_from_code)
from ..integrity import checksum as checksum_of
from ..memory.entry_index import SlotPage
from ..protocol import (EntryMeta, Acquire, Acquired, Bye, Exists, Failure, LeaseSpace, Location, Release, Welcome,
                        encoder)
from .connection import pool_not_visible, same_host, watch_views
from .control import ControlClient
from .local_read import (LocalReads, copy_from_pools, corrupt_error, get_cached, hold_slots, read_cached,
                         slot_page, slots_released)
from .location_cache import LocationCache
from .mapping import EpochMapping
from .pins import SlotPins, answer_exists, unpin_keys
from .put import PutRoute
from ..writes.producer import Submissions, submissions
from .tensors import PoolViews, copy_out_checked, parse_device

log = logging.getLogger("ecd.client")
T = TypeVar("T")


@dataclass(eq=False)
class OpenView:
    """The entries a view_many block holds read leases on, and under which session and daemon run."""

    ns: str
    keys: list[str]
    generations: list[int]
    session: int
    epoch: int
    slots: list[int] | None = None  # held by these read slots of `page` (local_read.hold_slots), not leases
    page: SlotPage | None = None


class Client(ControlClient):
    """Put, get, view, wait for and look up tensors held by the local ecd daemon."""

    def __init__(self, endpoint: str = "ipc:///tmp/ecd/ecd.sock", namespace: str = "default",
                 timeout: float = 5.0, *, name: str = "", populate: bool = True,
                 curve_secret_key: str | None = None, curve_server_key: str | None = None,
                 local_reads: bool = True, submit: bool = True) -> None:
        """`curve_secret_key`: this client's key file (NAME.key_secret from `ecd keygen`) and
        `curve_server_key`: the daemon's public key (its .key file, or the 40-character Z85
        text), for a daemon with CURVE (remote tcp endpoints). Both or neither. `populate`:
        prefault the pool mappings ahead of first use: in a background thread where the kernel
        can (ecd.memory.prefault; `mapping.prefaulting`), else when they are made (MAP_POPULATE).
        `local_reads`: a get of an entry the client can locate copies without asking the daemon
        (client/local_read.py). `submit`: puts go through the session's submission page, no
        message each (ecd/writes/producer.py). False: each get (put) is a round trip."""
        self.populate, self.local_reads, self.submit = populate, local_reads, submit
        self._puts = PutRoute()  # the put route, and the reservation for this client's next put
        self._map: EpochMapping | None = None
        # keyhash -> (namespace, key, generation) of entries this client put or read: a bounded
        # LRU (location_cache.py), kept current by ring events; exists() answers from it
        self._cache = LocationCache()
        self._local_reads: LocalReads | None = None  # gets made without a round trip, until told
        self._views: set[OpenView] = set()  # views open now: their leases are taken again after a restart
        self._view_watch: threading.Thread | None = None  # while views are open (connection.watch_views)
        self._slots: SlotPage | None = None  # this session's read slots (memory/entry_index.py)
        self._pins: SlotPins | None = None  # the pins they hold (client/pins.py)
        self._writes: Submissions | None = None  # this session's submission page (ecd/writes)
        super().__init__(endpoint, namespace, timeout, name=name, curve_secret_key=curve_secret_key,
                         curve_server_key=curve_server_key)  # connects: maps the pools (_new_epoch)

    def _new_epoch(self, welcome: Welcome) -> None:
        """A new daemon (or the first): map its pools and ring; drop what belonged to the old one."""
        try:
            mapping = EpochMapping(welcome, self.populate, self.endpoint, self.timeout)  # new pools, ring
            if not mapping.local and same_host(self.endpoint):  # a /dev/shm of its own: refused whole
                raise pool_not_visible(self.endpoint, welcome.node, welcome.ring.name)
        except EcdError:
            # Leave no session behind that this client cannot use; keep nothing of it either.
            with contextlib.suppress(zmq.ZMQError):
                self._res.sock.send(encoder.encode(Bye(0)), zmq.NOBLOCK)
            raise
        self._res.close_cuda()  # the old daemon's arenas are gone; its mappings go next
        if self._res.close_fds is not None:
            self._res.close_fds()
        self._res.close_fds = mapping.close_fds
        mapping.views = PoolViews(mapping.ro)
        self._map = mapping
        self._cache.clear()
        self._cache.tenant = welcome.tenant  # its keys hash in the tenant's namespaces (as the daemon stores them)
        if self._local_reads is None:  # made here: the first connect made the Resources it reports through
            self._local_reads = LocalReads(self._res.unreported)
        self._local_reads.drop()
        self._puts.forget_reservation()

    def _new_session(self, welcome: Welcome, restarted: bool) -> None:
        """Its page of read slots, if the daemon gave one. Views open on the old page (another
        session's soon) take read leases instead (after a restart: _restarted does)."""
        old, self._slots = self._slots, slot_page(welcome, self._map)
        self._writes = submissions(welcome, self._map, self._writes) if self.submit else None
        if self._pins is not None:  # the daemon takes over what the old page pinned
            for ns, by_time in self._pins.handed_over().items():
                for seconds, keys in by_time.items():
                    # sent before the loop moves on: the lambda never outlives ns, seconds
                    self._send_batches(keys, lambda chunk: Exists(0, ns, chunk, seconds))  # noqa: B023
        self._pins = SlotPins(self._slots) if self._slots is not None else None
        if old is not None and not restarted:
            self._retake([v for v in self._views if v.slots is not None], "a new session")

    @property
    def mapping(self) -> EpochMapping:
        """The daemon run's shared memory as this process maps it (read-only use): `local`,
        `sealed` (memfd pools), `ring` (the event ring reader, its `overruns`)."""
        return cast(EpochMapping, self._map)  # connected: set

    def cuda_plane(self):
        """The current daemon run's CUDA plane (ecd.client.cuda.CudaPlane: its arenas as this
        process maps them), made on first use. Imports torch's CUDA side."""
        return self._cuda_plane(self.mapping)

    @property
    def location_cache(self) -> LocationCache:
        """The locations this client learnt (keyhash -> namespace, key, generation), for inspection."""
        return self._cache

    def _verifies(self, asked: bool) -> bool:
        return asked or self.namespace in self._welcome.verify_namespaces

    # ---- put ----------------------------------------------------------------------------

    def put(self, key: str, tensor: torch.Tensor, *, checksum: bool = False, tier: str | None = None,
            persist: bool = False, meta: EntryMeta | None = None, wait: bool = True) -> None:
        """Store `tensor` (any dtype/shape, contiguous or not) under `key`, replacing atomically.
        With `checksum` (always in a verify namespace) an xxh3-64 of the stored bytes is kept
        with the entry, for readers that verify (bytes on a GPU are staged to host memory: slow).

        A CUDA tensor goes to the daemon's arena on its device (`[pool.cuda]`), copied on the
        caller's current stream and published once that copy has completed; without an arena on
        that device (or with tier="host") to the host pool; tier="cuda" refuses that fallback
        (InvalidRequest). CPU tensors always go to the host pool.

        `wait=False`: return once the bytes are copied; the entry becomes visible to others when
        the daemon commits it (no message for it: ecd/writes/producer.py), and `flush()` waits
        for that and raises a refusal. This client's own reads see it at once. `wait=True`
        returns once it is visible.

        `persist`: also write the entry through to the daemon's disk tier (`[pool.disk]`) and
        return only once it is durable there; PersistFailed when it could not be (the entry is
        stored in memory all the same), InvalidRequest (nothing stored) without a disk tier.

        `meta`: what the entry is (KVBlockMeta, EncoderMeta), published in KV events (docs/events.md)."""
        self.put_many({key: tensor}, checksum=checksum, tier=tier, persist=persist,
                      meta={key: meta} if meta is not None else None, wait=wait)

    def put_many(self, items: Mapping[str, torch.Tensor], *, checksum: bool = False,
                 tier: str | None = None, persist: bool = False,
                 meta: Mapping[str, EntryMeta] | None = None, wait: bool = True) -> None:
        """Store several tensors (`persist`, `meta` by key, `wait`: as in put), without a message
        per put where the daemon gave this session a submission page, else with one allocation
        and one commit round trip per tier. Every put takes the put route of ecd.client.put."""
        self._puts.put_many(self, items, checksum, tier, persist, meta, wait)

    def flush(self) -> None:
        """Wait until every put made with wait=False is visible; raise the first the daemon refused."""
        if self._writes is not None:
            self._writes.flush(self.timeout)

    def _settle_writes(self, keys: Sequence[str] | None = None, in_order: bool = False) -> None:
        """Before a read (of `keys`): this client's posted puts (of them) committed (refusals kept for
        flush). `in_order`: under the lock, which a put between its place and its post may wait for."""
        writes = self._writes
        if writes is not None and writes.pending(keys):
            writes.flush(self.timeout, raise_refused=False, in_order=in_order)

    def _cuda_plane(self, mapping: EpochMapping):
        """The CUDA plane (ecd.client.cuda) of `mapping`'s epoch, made on first use."""
        plane = self._res.cuda
        if plane is not None and plane.epoch == mapping.epoch and mapping is self._map:
            return plane  # (no lock: a put between its place and its post must not wait for it)
        with self._lock:
            if mapping is not self._map:
                raise StaleGeneration(RESTARTED)
            plane = self._res.cuda
            if plane is None or plane.epoch != mapping.epoch:
                from .cuda import CudaPlane
                self._res.close_cuda()
                plane = CudaPlane(mapping.epoch, mapping.arenas if mapping.local else [], mapping.rw,
                                  len(mapping.sizes), mapping.arena_fds)
                self._res.cuda = plane
            return plane

    def _call(self, request, wait_s: float = 0.0):
        self._settle_writes()  # before the lock: what it asks sees every put this thread posted
        return super()._call(request, wait_s)

    def _call_locked(self, request, wait_s: float = 0.0):
        if not isinstance(request, LeaseSpace):  # what it asks sees this client's puts (a delete, a get)
            self._settle_writes(in_order=True)
        if self._local_reads:  # the daemon hears of this client's reads before what it asks next
            self._local_reads.tell(self)
        return super()._call_locked(request, wait_s)

    # ---- get / view ---------------------------------------------------------------------

    def _acquire(self, keys: list[str], timeout: float | None) -> tuple[list[Location | Failure], int, EpochMapping]:
        wait_s = float(timeout) if timeout else 0.0
        if not 0 <= wait_s < math.inf:
            raise ValueError(f"timeout must be a finite number of seconds >= 0, got {timeout!r}")
        wait_s = min(wait_s, self.limits.max_wait_s)  # the daemon would cut it there anyway
        with self._lock:
            self._map.require_local("get/view", self.limits.inline_max_bytes)
            ring_pos = self._map.ring.next_seq
            # The mapping is taken with the reply, under the same lock: another thread's call could
            # otherwise reconnect to a restarted daemon in between, and this reply's locations (of
            # the old daemon's pools) would be read from the new daemon's: other entries' bytes.
            reply: Acquired = self._call_locked(Acquire(next(self._ids), self.namespace, keys, wait_s), wait_s)
            session, mapping = self._session, self._map
            found = [(key, r) for key, r in zip(keys, reply.results) if isinstance(r, Location)]
            if self._map.ring.next_seq == ring_pos:  # else an event read meanwhile may be this entry's eviction
                self._cache.remember_reply(self._map.ring, ring_pos, self.namespace, [k for k, _ in found],
                                           [self._cache.keyhash(self.namespace, k) for k, _ in found],
                                           [loc.generation for _, loc in found], catch_up=self._map.local,
                                           locations=[loc for _, loc in found])
        for result in reply.results:
            if isinstance(result, Location):
                mapping.check(result)
        return reply.results, session, cast(EpochMapping, mapping)  # connected: set

    def _release(self, generations: list[int], session: int, epoch: int) -> None:
        """Fire-and-forget: the daemon frees the lease. Leases of another session or daemon run
        died with it (their numbers may name others' leases in the new one)."""
        with self._lock:
            if session == self._session and epoch == self._map.epoch and generations:
                self._send_quietly(Release(0, generations))

    def _located(self, key: str, result: Location | Failure) -> Location:
        if isinstance(result, Failure):
            if result.code == Code.KEY_NOT_FOUND:
                raise KeyNotFound(f"{key!r} not found in namespace {self.namespace!r}")
            raise error_from_code(result.code, result.message)
        return result

    def get(self, key: str, timeout: float | None = None, *, verify: bool = False,
            device=None) -> torch.Tensor:
        """A copy of the tensor under `key`; with `timeout`, wait that long for it to be published.
        With `verify` (always in a verify namespace), the copy is checked against the checksum
        stored with the entry (entries stored without one are not checked): IntegrityError; a
        copy on a GPU is checked by staging it to host memory (slow).

        `device`: where the copy goes: None (where the entry lives: an arena's to this process's
        device of it, a host entry to the CPU), "cpu", "cuda", "cuda:N", N or a torch.device. A
        copy to a GPU runs on the caller's current stream and has completed when get returns."""
        return self.get_many([key], timeout, verify=verify, device=device)[0]

    @overload
    def get_many(self, keys: Sequence[str], timeout: float | None = None, *,
                 missing_ok: Literal[False] = False, verify: bool = False, device=None) -> list[torch.Tensor]: ...
    @overload
    def get_many(self, keys: Sequence[str], timeout: float | None = None, *,
                 missing_ok: bool = False, verify: bool = False, device=None) -> list[torch.Tensor | None]: ...

    def get_many(self, keys: Sequence[str], timeout: float | None = None, *, missing_ok: bool = False,
                 verify: bool = False, device=None) -> list[torch.Tensor] | list[torch.Tensor | None]:
        """Copies of several tensors in one round trip (None for a missing key if missing_ok)."""
        keys = list(keys)
        verify = self._verifies(verify)
        self._settle_writes(keys)
        target = parse_device(device)
        to_gpu = target is not None and target.type == "cuda"
        if not to_gpu:
            copies = get_cached(self, keys, verify)  # no round trip for what this client can locate
            if copies is not None:
                return copies
        mapping = self._map
        if to_gpu or (mapping is not None and mapping.arena_sizes):  # a GPU copies: slots, no round trip
            slotted = hold_slots(self, keys)
            if slotted is not None:
                try:
                    return self._copy_out(keys, slotted[1], slotted[0], target, verify, missing_ok)
                finally:
                    self._let_go(slotted[2])  # after _copy_out waited for every copy reading the extents
        results, session, mapping = self._acquire(keys, timeout)
        try:
            return self._copy_out(keys, results, mapping, target, verify, missing_ok)
        finally:
            self._release([r.generation for r in results if isinstance(r, Location)], session, mapping.epoch)

    def _copy_out(self, keys: list[str], results: Sequence[Location | Failure], mapping: EpochMapping,
                  target: torch.device | None, verify: bool, missing_ok: bool) -> list[torch.Tensor | None]:
        """get_many's copies of entries held (read slots or leases): host ones per pool segment, the
        rest on the CUDA plane, waited for before this returns (errors too): the holds go after."""
        to_gpu = target is not None and target.type == "cuda"
        batch = None
        try:
            out: list[torch.Tensor | None] = []
            checks: list[tuple[int, str, Location]] = []  # copies made on a GPU, verified after the wait
            host: dict[int, Location] = {}  # place in out -> location: copied together, per pool
            for key, result in zip(keys, results):
                if missing_ok and isinstance(result, Failure) and result.code == Code.KEY_NOT_FOUND:
                    out.append(None)
                    continue
                loc = self._located(key, result)
                if to_gpu or mapping.is_arena(loc.pool):
                    if batch is None:
                        plane = self._cuda_plane(mapping)
                        batch = plane.batch()
                    src = plane.location_tensor(loc.pool, loc.offset, loc.nbytes, loc.dtype, loc.shape)
                    dst = target if target is not None else src.device
                    if dst.type == "cuda" and dst.index is None:
                        dst = torch.device("cuda", torch.cuda.current_device())
                    out.append(batch.get(src, dst))
                    if verify and loc.checksum:
                        checks.append((len(out) - 1, key, loc))
                    continue
                if verify and loc.checksum:
                    src = mapping.rw_for(loc.pool, loc.offset, loc.nbytes)
                    tensor, actual = copy_out_checked(src, loc.offset, loc.nbytes, loc.dtype, loc.shape)
                    if actual != loc.checksum:
                        raise corrupt_error(self, key, loc, actual)
                    out.append(tensor)
                else:
                    host[len(out)] = loc
                    out.append(None)
            for i, tensor in zip(host, copy_from_pools(mapping, list(host.values()))):
                out[i] = tensor
            if batch is not None:
                batch.wait()
                from .cuda import tensor_checksum
                for i, key, loc in checks:
                    actual = tensor_checksum(cast(torch.Tensor, out[i]))  # a copy made on a GPU
                    if actual != loc.checksum:
                        raise corrupt_error(self, key, loc, actual)
            return out
        finally:
            if batch is not None:
                batch.wait_quietly()  # the hold goes only once no copy reads the extent any more

    @contextlib.contextmanager
    def view(self, key: str, timeout: float | None = None, *, verify: bool = False) -> Iterator[torch.Tensor]:
        """A zero-copy, read-only tensor over the entry, valid inside the `with` block only.

        Writing to it kills the process with SIGSEGV (the memory is mapped read-only, and torch
        has no read-only tensors): copy it to modify it. The first view turns on Python's
        faulthandler (unless the process did), so that death prints the Python line that wrote. With
        `verify` (always in a verify namespace) the mapped bytes are checked against the stored
        checksum before the view is handed out (one read of the entry): IntegrityError.

        An entry in a CUDA arena is viewed as a CUDA tensor on this process's device of that arena
        (zero copy, through the arena's IPC mapping). GPU memory cannot be mapped read-only: do not
        write to it. When the block exits, the work queued on that device's current stream is
        waited for before the lease is released (kernels reading the view finish first); a
        verified view is checked by staging the entry to host memory (slow).
        """
        with self.view_many([key], timeout, verify=verify) as (tensor,):
            yield cast(torch.Tensor, tensor)  # not missing_ok: a missing key raised

    @contextlib.contextmanager
    def view_many(self, keys: Sequence[str], timeout: float | None = None, *, missing_ok: bool = False,
                  verify: bool = False) -> Iterator[list[torch.Tensor | None]]:
        """Views (as in view) of several entries under one round trip's read leases, released
        together when the block exits; None for a missing key if missing_ok. What a consumer
        copying entries somewhere of its own wants: one copy, out of the pool."""
        keys = list(keys)
        verify = self._verifies(verify)
        self._settle_writes(keys)
        if not faulthandler.is_enabled():  # a write into a view is a SIGSEGV: say where it came from
            faulthandler.enable()
        slotted = hold_slots(self, keys)  # no round trip for what this client can locate
        results: Sequence[Location | Failure]
        if slotted is not None:
            mapping, results, held = slotted
        else:
            results, session, mapping = self._acquire(keys, timeout)
            held = OpenView(self.namespace, [k for k, r in zip(keys, results) if isinstance(r, Location)],
                            [r.generation for r in results if isinstance(r, Location)], session, mapping.epoch)
        self._watch_while_open(held, mapping)
        on_gpu: list[torch.Tensor] = []
        try:
            yield self._views_of(keys, results, mapping, verify, missing_ok, on_gpu)
        finally:
            if on_gpu:  # the hold goes only once the work queued on those devices is done
                batch = self._cuda_plane(mapping).batch()
                for tensor in on_gpu:
                    batch.after(tensor)
                batch.wait_quietly()
            self._let_go(held)

    def _views_of(self, keys: list[str], results: Sequence[Location | Failure], mapping: EpochMapping,
                  verify: bool, missing_ok: bool, on_gpu: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """view_many's tensors over held entries; those on a GPU are added to `on_gpu`."""
        views: list[torch.Tensor | None] = []
        pool_views: PoolViews = mapping.views
        if not mapping.sealed:  # pool files someone may truncate: each must reach past its entries
            ends: dict[int, int] = {}
            for r in results:
                if isinstance(r, Location) and not mapping.is_arena(r.pool):
                    ends[r.pool] = max(ends.get(r.pool, 0), r.offset + r.nbytes)
            for pool, end in ends.items():
                mapping.ro_for(pool, end, 0)
        for key, result in zip(keys, results):
            if missing_ok and isinstance(result, Failure) and result.code == Code.KEY_NOT_FOUND:
                views.append(None)
                continue
            loc = self._located(key, result)
            if mapping.is_arena(loc.pool):
                tensor = self._cuda_plane(mapping).arena_tensor(loc.pool, loc.offset, loc.nbytes, loc.dtype, loc.shape)
                on_gpu.append(tensor)
                if verify and loc.checksum:
                    from .cuda import tensor_checksum
                    actual = tensor_checksum(tensor)
                    if actual != loc.checksum:
                        raise corrupt_error(self, key, loc, actual)
            else:
                if verify and loc.checksum:
                    actual = checksum_of(mapping.ro_for(loc.pool, loc.offset, loc.nbytes), loc.offset, loc.nbytes)
                    if actual != loc.checksum:
                        raise corrupt_error(self, key, loc, actual)
                tensor = pool_views.view(loc.pool, loc.offset, loc.nbytes, loc.dtype, loc.shape)
            views.append(tensor)
        return views

    def _watch_while_open(self, held: OpenView, mapping: EpochMapping) -> None:
        """An open view: its holds are taken again after a restart (connection.watch_views)."""
        with self._lock:
            self._views.add(held)
            if self._view_watch is None and mapping.local:
                self._view_watch = threading.Thread(target=watch_views, args=(weakref.ref(self), self._res.stop),
                                                    name="ecd-view-watch", daemon=True)
                self._view_watch.start()

    def read_many(self, keys: Sequence[str], consume: Callable[[list[torch.Tensor | None]], T],
                  timeout: float | None = None, *, missing_ok: bool = False, verify: bool = False) -> T:
        """`consume(views)` over views of the entries (None for a missing key if missing_ok), and
        what it returns: for a caller that only copies the entries somewhere of its own (a KV
        cache's blocks, a host buffer). Where the client knows every entry's location (it put or
        read it, or the ring's entry index shows it) the views are taken without a round trip and
        without a lease, and `consume` may see bytes of an extent reused under it: its result is
        kept only if the ring, read after it returned, shows every entry still in place; else
        `consume` runs again over leased views (view_many). So it must only read the views, and
        may run twice. `verify`: a view whose bytes do not match the stored checksum is never
        consumed (IntegrityError)."""
        keys = list(keys)
        verify = self._verifies(verify)
        self._settle_writes(keys)
        if not faulthandler.is_enabled():  # a write into a view is a SIGSEGV: say where it came from
            faulthandler.enable()
        done, result = read_cached(self, keys, consume, verify)
        if done:
            return cast(T, result)
        with self.view_many(keys, timeout, missing_ok=missing_ok, verify=verify) as views:
            return consume(views)

    def _restarted(self) -> None:
        """A restarted daemon adopts the pool (the same memory and generations: a view held across
        the restart still shows its entry's bytes) but not the old run's leases: take them again
        for the entries still there, so that no eviction hands their extents out while the view
        is open. An entry not adopted (or replaced) cannot be protected: said once per view."""
        self._retake(list(self._views), "a daemon restart", restart=True)

    def _retake(self, views: list[OpenView], why: str, restart: bool = False) -> None:
        """Read leases of this session for open views (under the lock): after a restart, or for
        views a replaced session's read slots held."""
        for held in views:
            try:
                reply = self._roundtrip(Acquire(next(self._ids), held.ns, held.keys, 0.0), self.timeout)
            except EcdError:
                reply = None
            found = reply.results if isinstance(reply, Acquired) else []
            again = [r.generation for r, g in zip(found, held.generations) if isinstance(r, Location) and r.generation == g]
            others = [r.generation for r, g in zip(found, held.generations) if isinstance(r, Location) and r.generation != g]
            if others:
                self._send_quietly(Release(0, others))
            if len(again) < len(held.generations):
                log.warning("a view of %d entries was open across %s: %d of them are not in the %s pool as they were, "
                            "and their bytes may be reused before the view closes", len(held.generations), why,
                            len(held.generations) - len(again), "restarted daemon's" if restart else "daemon's")
            held.generations, held.session, held.epoch = again, self._session, self._map.epoch
            held.slots = held.page = None

    def _let_go(self, held: OpenView) -> None:
        """End what holds an open view's entries: a store of 0 in each read slot, or a Release."""
        with self._lock:
            self._views.discard(held)
            if held.slots is not None:
                if held.page is self._slots:  # else a replaced session's page: leases were taken
                    held.page.clear(held.slots)
                    slots_released(self, held)
                held.slots = None
            else:
                self._release(held.generations, held.session, held.epoch)

    # ---- exists / pins / delete ---------------------------------------------------------

    # the ignore: a str is also a Sequence[str], but the implementation takes it as one key
    @overload
    def exists(self, keys: str, pin_s: float = 0.0) -> bool: ...  # type: ignore[overload-overlap]
    @overload
    def exists(self, keys: Sequence[str], pin_s: float = 0.0) -> list[bool]: ...

    def exists(self, keys: str | Sequence[str], pin_s: float = 0.0) -> bool | list[bool]:
        """Which keys are present. With pin_s > 0, present entries cannot be evicted for pin_s
        seconds (or until unpin()). The event ring's presence table answers most unpinned keys
        with no round trip (absent ones; present ones it can name, see ecd.memory.ring), and this
        session's read slots take most pins (client/pins.py: within the pin budget)."""
        keys, single = self._checked_keys(keys)
        self._settle_writes(keys)
        with self._lock:
            answers = answer_exists(self, keys, float(pin_s))
        return cast("bool | list[bool]", answers[0] if single else answers)  # every answer is filled in

    def unpin(self, keys: str | Sequence[str]) -> bool | list[bool]:
        keys, single = self._checked_keys(keys)
        with self._lock:
            answers = unpin_keys(self, keys)
        return cast("bool | list[bool]", answers[0] if single else answers)

    # send_pin stays ControlClient's one message: nobody waits for it, and a message costs its
    # caller less than a slot per key would (bench-scheduler: vLLM's step pins, 127 keys a request)

    def send_unpin(self, keys: Sequence[str]) -> None:
        """Slot pins (exists(pin_s): SGLang's batch_exists) are cleared here, the rest told to the daemon."""
        for chunk in self._chunks(keys):
            unpin_keys(self, chunk, wait=False)

    def _forget(self, ns: str, keys: list[str]) -> None:
        """Deleted: their cached locations go (delete() is ControlClient's)."""
        with self._lock:
            for key in keys:
                self._cache.forget(self._cache.keyhash(ns, key))
