"""ecd.Client: the synchronous client every engine shim is built on.

A Client is a ControlClient (ecd.client.control: the DEALER socket, handshake, reconnects, the
request round trip and the operations that move no bytes) plus the data plane, here: tensor bytes
are copied straight into and out of the daemon's shared-memory pools, mapped once per daemon epoch
(ecd.client.mapping: read-write for puts, a second read-only mapping for views so a stray in-place
write faults instead of corrupting the cache). The event ring, mapped read-only, answers exists()
negatives without a round trip and drops cached locations of entries that were evicted or replaced.

Thread-safety: one lock serialises socket round trips; copies run outside it, so threads of one
process can put/get concurrently through one Client.

Remote use: with curve_secret_key/curve_server_key the DEALER is a CURVE client (see
ControlClient). A client on another host cannot map the pools: control operations and
inline-sized puts work, bulk put/get/view raise InvalidRequest.
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Iterator, Literal, Mapping, Sequence, cast, overload

import torch
import zmq

from ..errors import (Code, EcdError, IntegrityError, InvalidRequest, KeyNotFound, LimitExceeded,
                      StaleGeneration, error_from_code)
from ..integrity import checksum as checksum_of, describe
from ..memory.ring import HERE, NOT_HERE, key_hash
from ..memory.allocator import align_up
from ..protocol import (Abort, Acked, Acquire, Acquired, Alloc, Allocated, AllocItem, Bye, Commit, Committed,
                        Exists, Extent, Failure, Flags, Location, Publish, PutInline, Release, Report, Welcome,
                        encoder)
from .connection import pool_not_visible, same_host
from .control import ControlClient, _check_encodable, _key_list
from .location_cache import LocationCache
from .mapping import EpochMapping
from .tensors import copy_into, copy_out, copy_out_checked, dtype_name, host_tensor, parse_device, view_of


PERSIST_WAIT_S = 60.0  # beyond the client's timeout, for a put(persist=True) to be made durable


class Client(ControlClient):
    """Put, get, view, wait for and look up tensors held by the local ecd daemon."""

    def __init__(self, endpoint: str = "ipc:///tmp/ecd/ecd.sock", namespace: str = "default",
                 timeout: float = 5.0, *, name: str = "", populate: bool = True,
                 curve_secret_key: str | None = None, curve_server_key: str | None = None) -> None:
        """`curve_secret_key`: this client's key file (NAME.key_secret from `ecd keygen`) and
        `curve_server_key`: the daemon's public key (its .key file, or the 40-character Z85
        text), for a daemon with CURVE (remote tcp endpoints). Both or neither. `populate`:
        prefault the pool mappings when they are made (MAP_POPULATE) rather than on first use."""
        self.populate = populate
        # [(extent, aligned size, use-by monotonic time, session, epoch mapping)] of the daemon's
        # reservation for this client's next put, or []: a list, so a put claims it with one
        # atomic pop; and whether a put is filling the one it claimed right now
        self._reservation: list[tuple[Extent, int, float, int, EpochMapping]] = []
        self._reservation_busy = False
        self._map: EpochMapping | None = None
        # keyhash -> (namespace, key, generation) of entries this client put or read: a bounded
        # LRU (location_cache.py), kept current by ring events; exists() answers from it
        self._cache = LocationCache()
        super().__init__(endpoint, namespace, timeout, name=name, curve_secret_key=curve_secret_key,
                         curve_server_key=curve_server_key)  # connects: maps the pools (_new_epoch)

    def _new_epoch(self, welcome: Welcome) -> None:
        """A new daemon (or the first): map its pools and ring; drop what belonged to the old one."""
        try:
            mapping = EpochMapping(welcome, self.populate)  # a new daemon: new pools, new ring
            if not mapping.local and same_host(self.endpoint):  # a /dev/shm of its own: refused whole
                raise pool_not_visible(self.endpoint, welcome.node, welcome.ring.name)
        except EcdError:
            # Leave no session behind that this client cannot use; keep nothing of it either.
            with contextlib.suppress(zmq.ZMQError):
                self._res.sock.send(encoder.encode(Bye(0)), zmq.NOBLOCK)
            raise
        self._res.close_cuda()  # the old daemon's arenas are gone; its mappings go next
        self._map = mapping
        self._cache.clear()
        self._reservation.clear()

    def _verifies(self, asked: bool) -> bool:
        return asked or self.namespace in self._welcome.verify_namespaces

    # ---- put ----------------------------------------------------------------------------

    def put(self, key: str, tensor: torch.Tensor, *, checksum: bool = False, tier: str | None = None,
            persist: bool = False) -> None:
        """Store `tensor` (any dtype/shape, contiguous or not) under `key`, replacing atomically.
        With `checksum` (always in a verify namespace) an xxh3-64 of the stored bytes is kept
        with the entry, for readers that verify (for bytes on a GPU it is computed by staging
        them to host memory: slow).

        A CUDA tensor goes to the daemon's arena on its device (`[pool.cuda]`), copied on the
        caller's current stream; the entry is published only once that copy has completed. Without
        an arena on that device it goes to the host pool (an asynchronous device-to-host copy into
        the CUDA-registered mapping), as it does with tier="host"; tier="cuda" refuses the
        fallback (InvalidRequest). CPU tensors always go to the host pool.

        `persist`: also write the entry through to the daemon's disk tier (`[pool.disk]`) and
        return only once it is durable there (it then survives a daemon restart or crash);
        PersistFailed when it could not be made durable (the entry is stored in memory all the
        same), InvalidRequest (nothing stored) when the daemon has no disk tier."""
        self.put_many({key: tensor}, checksum=checksum, tier=tier, persist=persist)

    def put_many(self, items: Mapping[str, torch.Tensor], *, checksum: bool = False,
                 tier: str | None = None, persist: bool = False) -> None:
        """Store several tensors with one allocation and one commit round trip per tier (the
        host pool, and each arena the CUDA tensors go to: see put; `persist` as in put)."""
        if tier is not None and tier not in ("host", "cuda"):
            raise InvalidRequest(f"tier must be None, 'host' or 'cuda', got {tier!r}")
        if persist and not self._welcome.disk:
            raise InvalidRequest("persist=True but the daemon has no disk tier ([pool.disk] is not configured): "
                                 "nothing was stored")
        _check_encodable("key", items)
        pending = dict(items)
        on_gpu = any(isinstance(t, torch.Tensor) and t.is_cuda for t in items.values())
        for attempt in range(2):
            epoch = self._map.epoch
            try:
                if on_gpu:  # one Alloc/Commit per tier: the host pool, and each arena the tensors go to
                    groups = self._cuda_plane(cast(EpochMapping, self._map)).group_by_tier(pending, tier)
                else:
                    groups = {-1: {key: host_tensor(t) for key, t in pending.items()}}  # -1: the host pool
                for arena, tensors in groups.items():
                    if tensors:
                        self._put_once(tensors, self._verifies(checksum), arena, persist)
                    for key in tensors:
                        del pending[key]
                return
            except StaleGeneration:
                # The daemon restarted between alloc and commit: the bytes went with it. Retry once.
                if attempt or self._map.epoch == epoch:
                    raise

    def _cuda_plane(self, mapping: EpochMapping):
        """The CUDA plane (ecd.client.cuda) of `mapping`'s epoch, made on first use."""
        with self._lock:
            if mapping is not self._map:
                raise StaleGeneration("the daemon restarted: entries of its previous run are gone")
            plane = self._res.cuda
            if plane is None or plane.epoch != mapping.epoch:
                from .cuda import CudaPlane
                self._res.close_cuda()
                plane = CudaPlane(mapping.epoch, mapping.arenas if mapping.local else [], mapping.rw,
                                  len(mapping.sizes))
                self._res.cuda = plane
            return plane

    def _put_once(self, tensors: dict[str, torch.Tensor], checksum: bool, arena: int = -1,
                  persist: bool = False) -> None:
        """The one put route. Place the bytes — in the message (inline-sized), in the extent the
        daemon reserved for this client's next put, or in extents allocated for them (Alloc) —
        then one round trip publishes them (PutInline, Publish or Commit) and brings the
        reservation for the next put. A reserved or inline put takes the client's lock once."""
        if not self._map.local:  # a client off the daemon's node: only puts small enough to ride inline
            sizes = [t.numel() * t.element_size() for t in tensors.values()]
            if max(sizes) > self.limits.inline_max_bytes:
                self._map.require_local("a put larger than limits.inline_max_bytes", self.limits.inline_max_bytes)
            for (key, t), nbytes in zip(tensors.items(), sizes):
                self._put_inline(key, t, nbytes, checksum, persist)
            return
        if len(tensors) == 1:
            (key, t), = tensors.items()
            nbytes = t.numel() * t.element_size()
            if arena < 0 and nbytes <= self.limits.inline_max_bytes:
                self._put_inline(key, t, nbytes, checksum, persist)
                return
            if self._put_reserved(key, t, nbytes, checksum, arena, persist):
                return
        self._put_allocated(tensors, checksum, arena, persist)

    def _put_inline(self, key: str, t: torch.Tensor, nbytes: int, checksum: bool, persist: bool = False) -> None:
        if t.is_cuda:
            t = t.cpu()  # small enough to ride in the message: a synchronous copy is the cheapest
        buf = bytearray(nbytes)
        copy_into(buf, 0, t)
        data = bytes(buf)
        self._finish_put(PutInline(next(self._ids), self.namespace, key, dtype_name(t.dtype), list(t.shape),
                                   data, checksum_of(data) if checksum else 0, persist), [key], [], -1)

    def _put_reserved(self, key: str, t: torch.Tensor, nbytes: int, checksum: bool, arena: int,
                      persist: bool = False) -> bool:
        """Copy into the reservation the last put left, then Publish. False when there is no
        usable reservation, or the daemon no longer holds it: the caller allocates."""
        claimed = self._claim_reservation(nbytes, arena)
        if claimed is None:
            return False
        extent, mapping, ring_pos = claimed
        try:
            if t.is_cuda or mapping.is_arena(extent.pool):
                digest, = self._cuda_plane(mapping).copy_in([extent], [t], checksum)
            else:
                digest = copy_into(mapping.rw_for(extent.pool, extent.offset, nbytes), extent.offset, t,
                                   with_checksum=checksum)
        except BaseException:
            self._reservation_busy = False
            self._send_quietly(Abort(0, [extent.generation]))  # do not strand the reservation
            raise
        item = AllocItem(key, dtype_name(t.dtype), list(t.shape), nbytes)
        publish = Publish(next(self._ids), self.namespace, extent.generation, item, nbytes, digest, persist)
        return self._finish_put(publish, [key], [extent.generation], ring_pos, mapping)

    def _claim_reservation(self, nbytes: int, arena: int) -> tuple[Extent, EpochMapping, int] | None:
        """Take the reservation for this put, without the lock: list.pop is atomic, so two
        threads never get the same one. Returns (extent, its epoch's mapping, ring position)."""
        try:
            extent, size, use_by, session, mapping = self._reservation.pop()
        except IndexError:
            return None
        ring_pos = mapping.ring.next_seq
        if (align_up(max(nbytes, 1)) != size or time.monotonic() > use_by or session != self._session
                or mapping is not self._map or not mapping.fits(extent, arena)):
            # Not usable (another size or tier, too old, another daemon run): hand it back if
            # it is still ours, so the next Commit can reserve anew.
            if session == self._session and mapping is self._map:
                self._send_quietly(Abort(0, [extent.generation]))
            return None
        self._reservation_busy = True  # the daemon still holds it: asking for another is futile
        return extent, mapping, ring_pos

    def _put_allocated(self, tensors: dict[str, torch.Tensor], checksum: bool, arena: int,
                       persist: bool = False) -> None:
        """Alloc extents for the items, copy into them, Commit."""
        items = [AllocItem(key, dtype_name(t.dtype), list(t.shape), t.numel() * t.element_size())
                 for key, t in tensors.items()]
        with self._lock:
            # Taken before the request: the daemon's write TTL starts later, when it allocates.
            use_by = time.monotonic() + self._safe_write_window()
            reply: Allocated = self._call(Alloc(next(self._ids), self.namespace, items, arena))
            mapping, ring_pos = cast(EpochMapping, self._map), self._map.ring.next_seq
        extents = reply.results
        failed = next((r for r in extents if isinstance(r, Failure)), None)
        generations = [r.generation for r in extents if not isinstance(r, Failure)]
        try:
            if failed is not None:
                raise error_from_code(failed.code, failed.message)
            digests = self._copy_into_extents(mapping, cast("list[Extent]", extents), list(tensors.values()),
                                              checksum, use_by)
        except BaseException:
            if generations:
                with contextlib.suppress(EcdError):
                    self._call(Abort(next(self._ids), generations))
            raise
        reserve = items[0].nbytes if len(items) == 1 else 0  # same-sized puts (embeddings, KV blocks) reuse it
        commit = Commit(next(self._ids), generations, reserve, digests if checksum else [], persist)
        self._finish_put(commit, list(tensors), generations, ring_pos, mapping)

    def _copy_into_extents(self, mapping: EpochMapping, extents: list[Extent], tensors: list[torch.Tensor],
                           checksum: bool, use_by: float) -> list[int]:
        """Copy each tensor into its extent (host copies first, then those on a GPU); digests."""
        digests: list[int] = []
        on_device: list[int] = []  # items whose copy runs on a GPU (after the host copies)
        for i, (extent, t) in enumerate(zip(extents, tensors)):
            if time.monotonic() > use_by:
                # Stalled (stopped, swapped out) since the Alloc: the daemon may have expired the
                # write and handed the extent to another entry; copying now would corrupt that
                # entry, so give up as a commit of an expired write would.
                raise StaleGeneration("the write lease may have expired (leases.write_ttl) before "
                                      "its bytes were copied: put again")
            if t.is_cuda or mapping.is_arena(extent.pool):
                on_device.append(i)
                digests.append(0)
                continue
            digests.append(copy_into(mapping.rw_for(extent.pool, extent.offset, t.numel() * t.element_size()),
                                     extent.offset, t, with_checksum=checksum))
        if on_device:
            done = self._cuda_plane(mapping).copy_in([extents[i] for i in on_device], [tensors[i] for i in on_device],
                                                      checksum)
            for i, digest in zip(on_device, done):
                digests[i] = digest
        return digests

    def _finish_put(self, request: PutInline | Publish | Commit, keys: list[str], generations: list[int],
                    ring_pos: int, mapping: EpochMapping | None = None) -> bool:
        """The put's last round trip, under one acquisition of the lock: ask for a reservation
        for the next put unless this client holds one, send, keep the one that comes back and
        the locations learnt. False when a Publish found its reservation gone or unfit (the
        caller allocates); a failed item raises."""
        with self._lock:
            if isinstance(request, Publish):
                self._reservation_busy = False  # this put claimed it; the reply says what became of it
            if mapping is not None and mapping is not self._map:
                # Another thread reconnected to a restarted daemon while this put copied: its
                # extents went with the old one, and their generations may name others' there.
                if isinstance(request, Publish):
                    return False
                raise StaleGeneration("the daemon restarted: entries of its previous run are gone")
            if not isinstance(request, PutInline) and (self._reservation or self._reservation_busy):
                request.reserve = 0  # the daemon keeps one reservation per client
            # a persisted put is answered once the disk has it: give the write and its fsyncs time
            reply: Acked | Committed = self._call_locked(request, PERSIST_WAIT_S if request.persist else 0.0)
            if isinstance(reply, Committed):
                self._keep_reservation(reply.reservation, request.reserve)
            failure = next((r for r in reply.results if isinstance(r, Failure)), None)
            if isinstance(request, PutInline):
                self._cache.forget(key_hash(self.namespace, keys[0]))  # generation unknown: ask next time
            elif failure is None:
                self._remember_locked(self.namespace, keys, generations, ring_pos)
        if failure is not None and isinstance(request, Publish) and failure.code in (Code.STALE, Code.INVALID):
            return False  # the reservation was gone or unfit: put it the ordinary way
        self._raise_first(reply.results)
        return True

    def _safe_write_window(self) -> float:
        """How long after an Alloc (or reservation) this client may still start copying: half of
        what the daemon waits before it takes the extent back — the write TTL, or for a session it
        cannot watch by pid the session TTL (three heartbeat intervals)."""
        window = self.limits.write_ttl_s / 2
        if self._heartbeat_s:
            window = min(window, 1.5 * self._heartbeat_s)
        return window

    def _keep_reservation(self, reservation: Extent | Failure | None, nbytes: int) -> None:
        """Under the lock, with the reply that brought it."""
        if isinstance(reservation, Extent):
            # Use it only well inside the time the daemon gives it: after that the extent may belong
            # to someone else, and copying into it would corrupt their entry.
            use_by = time.monotonic() + self._safe_write_window()
            self._reservation[:] = [(reservation, align_up(max(nbytes, 1)), use_by, self._session,
                                     cast(EpochMapping, self._map))]  # connected: set

    def _remember_locked(self, ns: str, keys: list[str], generations: list[int], ring_pos: int) -> None:
        """Cache locations learnt from a reply, unless ring events were consumed while the request
        was out: one of them may have been this entry's eviction, read before it was cached."""
        ring = self._map.ring
        if ring.next_seq != ring_pos:
            return
        cache = self._cache
        for key, generation in zip(keys, generations):
            cache.remember(key_hash(ns, key), ns, key, generation)
        if self._map.local:
            cache.catch_up(ring)

    @staticmethod
    def _raise_first(results: Sequence[Failure | None]) -> None:
        for result in results:
            if isinstance(result, Failure):
                raise error_from_code(result.code, result.message)

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
            found = [(key, r.generation) for key, r in zip(keys, reply.results) if isinstance(r, Location)]
            self._remember_locked(self.namespace, [k for k, _ in found], [g for _, g in found], ring_pos)
        for result in reply.results:
            if isinstance(result, Location):
                mapping.check(result)
        return reply.results, session, cast(EpochMapping, mapping)  # connected: set

    def _release(self, generations: list[int], session: int, epoch: int) -> None:
        """Fire-and-forget: the daemon frees the lease; no round trip is waited for."""
        with self._lock:
            # Leases of another session or daemon run died with it; their numbers may already
            # name someone else's leases in the new one.
            if session == self._session and epoch == self._map.epoch and generations:
                self._send_quietly(Release(0, generations))

    def _located(self, key: str, result: Location | Failure) -> Location:
        if isinstance(result, Failure):
            if result.code == Code.KEY_NOT_FOUND:
                raise KeyNotFound(f"{key!r} not found in namespace {self.namespace!r}")
            raise error_from_code(result.code, result.message)
        return result

    def _corrupt(self, key: str, loc: Location, actual: int) -> IntegrityError:
        """Count a failed verification with the daemon (ecd_integrity_failures_total) and build
        the error; the caller releases the lease."""
        self._send_quietly(Report(0, integrity_failures=1))
        with self._lock:
            self._cache.forget(key_hash(self.namespace, key))
        return IntegrityError(
            f"{key!r} in namespace {self.namespace!r} (generation {loc.generation}, {loc.nbytes} bytes) "
            f"failed verification: its producer stored checksum {describe(loc.checksum)}, the bytes "
            f"read hash to {describe(actual)}", key=key, expected=loc.checksum, actual=actual)

    def get(self, key: str, timeout: float | None = None, *, verify: bool = False,
            device=None) -> torch.Tensor:
        """A copy of the tensor under `key`; with `timeout`, wait that long for it to be published.
        With `verify` (always in a verify namespace), the copy is checked against the checksum
        stored with the entry (entries stored without one are not checked): IntegrityError; a
        copy on a GPU is checked by staging it to host memory (slow).

        `device`: where the copy goes: None (where the entry lives: an arena entry to this
        process's device of that arena, a host entry to the CPU), "cpu", "cuda", "cuda:N", N or a
        torch.device. Copies to a GPU run on the caller's current stream (peer-to-peer from
        another device's arena; from the CUDA-registered host mapping for a host entry) and have
        completed when get returns (the read lease is released only then)."""
        return self.get_many([key], timeout, verify=verify, device=device)[0]

    @overload
    def get_many(self, keys: Sequence[str], timeout: float | None = None, *,
                 missing_ok: Literal[False] = False, verify: bool = False, device=None) -> list[torch.Tensor]: ...
    @overload
    def get_many(self, keys: Sequence[str], timeout: float | None = None, *,
                 missing_ok: bool = False, verify: bool = False, device=None) -> list[torch.Tensor | None]: ...

    def get_many(self, keys: Sequence[str], timeout: float | None = None, *, missing_ok: bool = False,
                 verify: bool = False, device=None) -> list[torch.Tensor] | list[torch.Tensor | None]:
        """Copies of several tensors in one round trip (None for a missing key if missing_ok);
        `device` as in get."""
        keys = list(keys)
        verify = self._verifies(verify)
        target = parse_device(device)
        to_gpu = target is not None and target.type == "cuda"
        results, session, mapping = self._acquire(keys, timeout)
        held = [r.generation for r in results if isinstance(r, Location)]
        batch = None
        try:
            out: list[torch.Tensor | None] = []
            checks: list[tuple[int, str, Location]] = []  # copies made on a GPU, verified after the wait
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
                        raise self._corrupt(key, loc, actual)
                    out.append(tensor)
                else:
                    src = mapping.rw_for(loc.pool, loc.offset, loc.nbytes)
                    out.append(copy_out(src, loc.offset, loc.nbytes, loc.dtype, loc.shape))
            if batch is not None:
                batch.wait()
                from .cuda import tensor_checksum
                for i, key, loc in checks:
                    actual = tensor_checksum(cast(torch.Tensor, out[i]))  # a copy made on a GPU
                    if actual != loc.checksum:
                        raise self._corrupt(key, loc, actual)
            return out
        finally:
            if batch is not None:
                batch.wait_quietly()  # the lease goes only once no copy reads the extent any more
            self._release(held, session, mapping.epoch)

    @contextlib.contextmanager
    def view(self, key: str, timeout: float | None = None, *, verify: bool = False) -> Iterator[torch.Tensor]:
        """A zero-copy, read-only tensor over the entry, valid inside the `with` block only.

        Writing to it faults (the memory is mapped read-only): copy it to modify it. With
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
        results, session, mapping = self._acquire(keys, timeout)
        on_gpu: list[torch.Tensor] = []
        try:
            views: list[torch.Tensor | None] = []
            for key, result in zip(keys, results):
                if missing_ok and isinstance(result, Failure) and result.code == Code.KEY_NOT_FOUND:
                    views.append(None)
                    continue
                loc = self._located(key, result)
                if mapping.is_arena(loc.pool):
                    tensor = self._cuda_plane(mapping).arena_tensor(loc.pool, loc.offset, loc.nbytes, loc.dtype,
                                                                    loc.shape)
                    on_gpu.append(tensor)
                    if verify and loc.checksum:
                        from .cuda import tensor_checksum
                        actual = tensor_checksum(tensor)
                        if actual != loc.checksum:
                            raise self._corrupt(key, loc, actual)
                else:
                    if verify and loc.checksum:
                        actual = checksum_of(mapping.ro_for(loc.pool, loc.offset, loc.nbytes), loc.offset, loc.nbytes)
                        if actual != loc.checksum:
                            raise self._corrupt(key, loc, actual)
                    src = mapping.ro_for(loc.pool, loc.offset, loc.nbytes)
                    tensor = view_of(src, loc.offset, loc.nbytes, loc.dtype, loc.shape)
                views.append(tensor)
            yield views
        finally:
            if on_gpu:  # the lease goes only once the work queued on those devices is done
                batch = self._cuda_plane(mapping).batch()
                for tensor in on_gpu:
                    batch.after(tensor)
                batch.wait_quietly()
            self._release([r.generation for r in results if isinstance(r, Location)], session, mapping.epoch)

    # ---- exists / pins / delete ---------------------------------------------------------

    # the ignore: a str is also a Sequence[str], but the implementation takes it as one key
    @overload
    def exists(self, keys: str, pin_s: float = 0.0) -> bool: ...  # type: ignore[overload-overlap]
    @overload
    def exists(self, keys: Sequence[str], pin_s: float = 0.0) -> list[bool]: ...

    def exists(self, keys: str | Sequence[str], pin_s: float = 0.0) -> bool | list[bool]:
        """Which keys are present. With pin_s > 0, present entries cannot be evicted for pin_s
        seconds (or until unpin()). Without a pin, the event ring's presence table answers most
        keys with no round trip (absent ones; present ones it can name, see ecd.memory.ring)."""
        keys, single = _key_list(keys)
        ns = self.namespace
        _check_encodable("key", keys)  # key_hash needs the UTF-8 bytes
        if len(keys) > self.limits.max_batch:  # refused here as the daemon would, ring or not
            raise LimitExceeded(f"batch of {len(keys)} keys exceeds limits.max_batch={self.limits.max_batch}")
        with self._lock:
            if self._res.sock is None and not self._closed:
                self._connect()
            ring = self._map.ring
            trusted, overrun = self._cache.sync(ring)
            if overrun:  # operators see overruns in ecd_ring_reader_overruns_total
                self._send_quietly(Report(0, 1))
            answers: list[bool | None] = [None] * len(keys)
            ask: list[int] = []
            asked_hashes: list[int] = []
            is_cached = self._cache.known
            lookup = ring.lookup
            for i, key in enumerate(keys):
                keyhash = key_hash(ns, key)
                if trusted:
                    said = lookup(keyhash)
                    if said == NOT_HERE:
                        if not is_cached(keyhash, ns, key):
                            answers[i] = False
                            continue
                    elif pin_s <= 0 and (said == HERE or is_cached(keyhash, ns, key)):
                        # the bucket names this key, or this client put or read it and has
                        # not seen it go: present, as far as an unpinned (advisory) answer goes
                        answers[i] = True
                        continue
                # Not trusted, a pin to take, or the ring and this client's cache disagree (an
                # eviction whose event is not read yet, or a presence word someone overwrote
                # with a well-formed ABSENT): the daemon knows.
                ask.append(i)
                asked_hashes.append(keyhash)
            if ask:
                reply: Flags = self._call(Exists(next(self._ids), ns, [keys[i] for i in ask], float(pin_s)))
                for i, keyhash, found in zip(ask, asked_hashes, reply.values):
                    answers[i] = found
                    if not found:  # whatever generation was cached is gone
                        self._cache.forget(keyhash)
        return cast("bool | list[bool]", answers[0] if single else answers)  # every answer is filled in

    def _forget(self, ns: str, keys: list[str]) -> None:
        """Deleted: their cached locations go (delete() is ControlClient's)."""
        with self._lock:
            for key in keys:
                self._cache.forget(key_hash(ns, key))
