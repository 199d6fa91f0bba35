"""ecd.Client: the synchronous client every engine shim is built on.

One DEALER socket carries small msgspec requests; tensor bytes are copied straight into and out
of the daemon's shared-memory pools, mapped once per daemon epoch (read-write for puts, a second
read-only mapping for views so a stray in-place write faults instead of corrupting the cache).
The event ring, mapped read-only, answers exists() negatives without a round trip and drops
cached locations of entries that were evicted or replaced.

Thread-safety: one lock serialises socket round trips; copies run outside it, so threads of one
process can put/get concurrently through one Client.

Remote use: with curve_secret_key/curve_server_key the DEALER is a CURVE client (a refused
handshake raises AuthenticationFailed). A daemon that cannot watch this process (tcp, another pid
namespace) asks for heartbeats in its Welcome: a small daemon thread then pings when the client
has been idle that long. A client on another host cannot map the pools: control operations and
inline-sized puts work, bulk put/get/view raise InvalidRequest.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import os
import threading
import time
import weakref
from typing import Iterator, Mapping, Sequence

import msgspec
import torch
import zmq

from ..errors import (AuthenticationFailed, Code, DaemonUnavailable, EcdError, IntegrityError, InvalidRequest,
                      KeyNotFound, LimitExceeded, ProtocolError, StaleGeneration, error_from_code)
from ..integrity import checksum as checksum_of, describe
from ..memory.ring import key_hash
from ..memory.allocator import align_up
from ..protocol import (PROTOCOL_VERSION, Abort, Acked, Acquire, Acquired, Alloc, Allocated, AllocItem,
                        Bye, Commit, Committed, Delete, Error, Evict, Evicted, Exists, Extent, Failure,
                        Flags, Held, Hello, KeyInfo, KeyList, Keys, Location, Ping, Publish, PutInline,
                        Release, Report, Stats, StatsReply, Unpin, Welcome, encoder, reply_decoder)
from .. import protocol
from . import connection
from .connection import HANDSHAKE_EVENTS, EpochMapping, Resources, curve_keys, heartbeat
from .location_cache import LocationCache
from .tensors import copy_into, copy_out, copy_out_checked, dtype_name, host_tensor, parse_device, view_of

RING_SILENCE_S = 1.0  # a ring whose heartbeat is older than this is not trusted for negatives
RING_MAX_BACKLOG = 4096  # more unread events than this: drop the location cache instead
# A put or get that finds this many unread ring events applies them to the location cache, so a
# client that never calls exists() keeps its cached locations current (pruned of evictions)
# instead of falling RING_MAX_BACKLOG behind and losing them all at its next exists().
RING_SYNC_BACKLOG = 1024


_NAMES_GENERATIONS = (Commit, Publish, Abort, Release)
def _key_list(keys: str | Sequence[str]) -> tuple[list[str], bool]:
    """(keys as a list, whether one bare key was given): one key in, one answer out."""
    return ([keys], True) if isinstance(keys, str) else (list(keys), False)


def _check_encodable(what: str, names) -> None:
    """Keys and namespaces travel as UTF-8: a str with a lone surrogate ('\\udc80') cannot.
    Refused before anything is sent or copied (InvalidRequest, not a UnicodeEncodeError from deep
    inside a put that may already hold a reservation)."""
    for name in names:
        try:
            name.encode()
        except UnicodeEncodeError as exc:
            raise InvalidRequest(f"{what} {name!r} is not valid UTF-8 text: {exc.reason}") from None
        except AttributeError:
            raise InvalidRequest(f"{what} must be a str, got {type(name).__name__}") from None


class Client:
    """Put, get, view, wait for and look up tensors held by the local ecd daemon."""

    def __init__(self, endpoint: str = "ipc:///tmp/ecd/ecd.sock", namespace: str = "default",
                 timeout: float = 5.0, *, name: str = "", populate: bool = True,
                 curve_secret_key: str | None = None, curve_server_key: str | None = None) -> None:
        """`curve_secret_key`: this client's key file (NAME.key_secret from `ecd keygen`) and
        `curve_server_key`: the daemon's public key (its .key file, or the 40-character Z85
        text), for a daemon with CURVE (remote tcp endpoints). Both or neither."""
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self._curve = curve_keys(curve_secret_key, curve_server_key)
        _check_encodable("namespace", [namespace])
        self.endpoint = endpoint
        self.namespace = namespace
        self.timeout = float(timeout)
        self.name = name
        self.populate = populate
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._decoder = reply_decoder()
        self._res = Resources()
        self._finalizer = weakref.finalize(self, self._res.close)
        self._closed = False
        self._session = 0
        # (extent, aligned size, use-by monotonic time, session, epoch) of the daemon's
        # reservation for this client's next put, and whether a put is filling it right now
        self._reservation: tuple | None = None
        self._reservation_busy = False
        self._map: EpochMapping | None = None
        self._welcome: Welcome | None = None
        # keyhash -> (namespace, key, generation) of entries this client put or read: a bounded
        # LRU (location_cache.py), kept current by ring events; exists() answers from it
        self._cache = LocationCache()
        self._pid_ns = protocol.pid_namespace()  # looked up here so tests can fake a container
        self._heartbeat_s = 0.0  # from Welcome: ping when idle this long (0: not needed)
        self._last_sent = time.monotonic()  # any message sent counts as activity
        self._heartbeat_thread: threading.Thread | None = None
        with self._lock:
            self._connect()

    # ---- connection ---------------------------------------------------------------------

    def _connect(self) -> None:
        """Say hello (again). The socket is kept across timeouts: a daemon that was only slow
        still knows this session and its leases; ZMQ reconnects it to a restarted daemon."""
        if self._res.sock is None:
            sock = self._res.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if self._curve is not None:
                sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = self._curve
            # Before connect, so the first handshake's failure is seen.
            self._res.monitor = sock.get_monitor_socket(HANDSHAKE_EVENTS)
            self._res.handshake_drops = 0
            sock.connect(self.endpoint)
            self._res.sock = sock
        reply = self._roundtrip(Hello(next(self._ids), PROTOCOL_VERSION, os.getpid(), self.name, self._pid_ns),
                                self.timeout)
        if isinstance(reply, Error):
            raise error_from_code(reply.code, reply.message)
        if not isinstance(reply, Welcome):
            raise ProtocolError(f"expected Welcome, got {type(reply).__name__}")
        if self._map is None or self._map.epoch != reply.epoch:
            try:
                mapping = connection.EpochMapping(reply, self.populate)  # a new daemon: new pools, new ring
            except EcdError:
                # Leave no session behind that this client cannot use; keep nothing of it either.
                with contextlib.suppress(zmq.ZMQError):
                    self._res.sock.send(encoder.encode(Bye(0)), zmq.NOBLOCK)
                raise
            self._res.close_cuda()  # the old daemon's arenas are gone; its mappings go next
            self._map = mapping
            self._cache.clear()
            self._reservation = None
        self._welcome = reply
        self._session = reply.session
        self._heartbeat_s = reply.heartbeat_s
        if self._heartbeat_s > 0 and self._heartbeat_thread is None:
            self._heartbeat_thread = threading.Thread(target=heartbeat, args=(weakref.ref(self), self._res.stop),
                                                      name="ecd-heartbeat", daemon=True)
            self._heartbeat_thread.start()

    def _ping_quietly(self) -> None:
        """The heartbeat: a fire-and-forget Ping, unless a request is in flight (that is activity)."""
        if self._lock.acquire(blocking=False):
            try:
                if not self._closed:
                    self._send_quietly(Ping(0))
            finally:
                self._lock.release()

    def _auth_failed(self, why: str) -> AuthenticationFailed:
        self._res.drop_socket()  # ZMQ would retry the same handshake forever; the next call starts afresh
        return AuthenticationFailed(why)
    def _roundtrip(self, request, timeout: float):
        sock = self._res.sock
        try:
            frame = encoder.encode(request)
        except UnicodeEncodeError as exc:  # a key or namespace with a lone surrogate: nothing sent
            raise InvalidRequest(f"request not sent: {exc.object!r} is not valid UTF-8 text ({exc.reason})") from None
        try:
            sock.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError:
            self._res.drop_socket()
            raise DaemonUnavailable(f"cannot send to the daemon at {self.endpoint}") from None
        now = time.monotonic()
        self._last_sent = now
        deadline = now + timeout
        # A hello may be the first message on a fresh connection: watch its handshake too, so a
        # refused key is reported at once rather than as a timeout. A CURVE client watches on
        # every request: ZMQ reconnects by itself (a restarted daemon may no longer allow its key),
        # and a tcp round trip dwarfs the cost of the poller.
        poller = None
        if (isinstance(request, Hello) or self._curve is not None) and self._res.monitor is not None:
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            poller.register(self._res.monitor, zmq.POLLIN)
        while True:
            remaining = deadline - time.monotonic()
            try:
                if remaining <= 0:
                    raise zmq.Again()
                if poller is not None:
                    ready = dict(poller.poll(min(max(1, int(remaining * 1000)), 2**31 - 1)))
                    if self._res.monitor in ready:
                        why = self._res.handshake_failure(self.endpoint, self._curve is not None)
                        if why is not None:
                            raise self._auth_failed(why)
                    if sock not in ready:
                        continue
                    frame = sock.recv(zmq.NOBLOCK)
                else:
                    # A receive timeout on a blocking recv: cheaper than building a poller per call.
                    sock.setsockopt(zmq.RCVTIMEO, min(max(1, int(remaining * 1000)), 2**31 - 1))
                    frame = sock.recv()
            except zmq.Again:
                why = self._res.handshake_failure(self.endpoint, self._curve is not None)  # e.g. a reconnect to a daemon with other keys
                if why is not None:
                    raise self._auth_failed(why) from None
                # The socket stays: a late reply is skipped by its id, and the session's leases
                # stay valid in a daemon that was only slow.
                raise DaemonUnavailable(f"no answer from the daemon at {self.endpoint} within {timeout:g}s") from None
            try:
                reply = self._decoder.decode(frame)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise ProtocolError(f"malformed reply from the daemon: {exc}") from None
            if reply.id == request.id or (isinstance(reply, Error) and reply.id == 0):
                return reply
            # otherwise: a reply to an earlier request this client gave up on; skip it

    def _call(self, request, wait_s: float = 0.0):
        """Round trip with reconnect: a daemon that restarted is greeted again, once."""
        with self._lock:
            if self._closed:
                raise EcdError("client is closed")
            if self._res.sock is None:
                self._connect()
            reply = self._roundtrip(request, self.timeout + wait_s)
            if isinstance(reply, Error) and reply.code == Code.NOT_REGISTERED:
                epoch = self._map.epoch
                self._connect()
                if isinstance(request, _NAMES_GENERATIONS) and self._map.epoch != epoch:
                    # Generations of the old daemon mean nothing (or something else) to the new one.
                    raise StaleGeneration("the daemon restarted: entries of its previous run are gone")
                reply = self._roundtrip(request, self.timeout + wait_s)
            if isinstance(reply, Error):
                raise error_from_code(reply.code, reply.message)
            return reply

    @property
    def limits(self):
        return self._welcome.limits

    @property
    def epoch(self) -> int:
        return self._map.epoch

    @property
    def verify_namespaces(self) -> frozenset[str]:
        """Namespaces the daemon is configured to checksum (`verify = true`): puts into them
        always store a checksum and reads from them always verify it."""
        return frozenset(self._welcome.verify_namespaces)

    def _verifies(self, asked: bool) -> bool:
        return asked or self.namespace in self._welcome.verify_namespaces

    # ---- put ----------------------------------------------------------------------------

    def put(self, key: str, tensor: torch.Tensor, *, checksum: bool = False, tier: str | None = None) -> None:
        """Store `tensor` (any dtype/shape, contiguous or not) under `key`, replacing atomically.
        With `checksum` (always in a verify namespace) an xxh3-64 of the stored bytes is kept
        with the entry, for readers that verify (for bytes on a GPU it is computed by staging
        them to host memory: slow).

        A CUDA tensor goes to the daemon's arena on its device (`[pool.cuda]`), copied on the
        caller's current stream; the entry is published only once that copy has completed. Without
        an arena on that device it goes to the host pool (an asynchronous device-to-host copy into
        the CUDA-registered mapping), as it does with tier="host"; tier="cuda" refuses the
        fallback (InvalidRequest). CPU tensors always go to the host pool."""
        self.put_many({key: tensor}, checksum=checksum, tier=tier)

    def put_many(self, items: Mapping[str, torch.Tensor], *, checksum: bool = False,
                 tier: str | None = None) -> None:
        """Store several tensors with one allocation and one commit round trip per tier (the
        host pool, and each arena the CUDA tensors go to: see put)."""
        if tier is not None and tier not in ("host", "cuda"):
            raise InvalidRequest(f"tier must be None, 'host' or 'cuda', got {tier!r}")
        _check_encodable("key", items)
        if any(isinstance(t, torch.Tensor) and t.is_cuda for t in items.values()):
            self._put_cuda_many(items, checksum, tier)
            return
        tensors = {key: host_tensor(t) for key, t in items.items()}
        if not tensors:
            return
        for attempt in range(2):
            epoch = self._map.epoch
            try:
                return self._put_once(tensors, self._verifies(checksum))
            except StaleGeneration:
                # The daemon restarted between alloc and commit: the bytes went with it. Retry once.
                if attempt or self._map.epoch == epoch:
                    raise

    def _put_cuda_many(self, items: Mapping[str, torch.Tensor], checksum: bool, tier: str | None) -> None:
        """put_many with CUDA tensors among the items: one Alloc/Commit per tier."""
        from . import cuda
        pending = dict(items)
        for attempt in range(2):
            epoch = self._map.epoch
            plane = self._cuda_plane(self._map)
            groups: dict[int, dict[str, torch.Tensor]] = {}
            for key, t in pending.items():
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t = cuda.device_tensor(t)
                    arena = plane.tier_for(t, tier)
                else:
                    t, arena = host_tensor(t), cuda.HOST
                groups.setdefault(arena, {})[key] = t
            try:
                for arena, tensors in groups.items():
                    self._put_once(tensors, self._verifies(checksum), arena)
                    for key in tensors:
                        del pending[key]
                return
            except StaleGeneration:
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

    def _copy_cuda(self, mapping: EpochMapping, extents: Sequence[Extent], tensors: Sequence[torch.Tensor],
                   checksum: bool) -> list[int]:
        """Copy tensors into extents on the callers' current streams and wait for the copies: the
        bytes are there when this returns (a put may commit). Digests (0 without checksum)."""
        plane = self._cuda_plane(mapping)
        batch = plane.batch()
        try:
            for extent, t in zip(extents, tensors):
                batch.put(extent.pool, extent.offset, t)
            batch.wait()
        except BaseException:
            batch.wait_quietly()  # never give an extent back while a copy may still write into it
            raise
        if not checksum:
            return [0] * len(extents)
        return [plane.extent_checksum(e.pool, e.offset, t.numel() * t.element_size())
                for e, t in zip(extents, tensors)]

    def _put_once(self, tensors: dict[str, torch.Tensor], checksum: bool, arena: int = -1) -> None:
        ns = self.namespace
        reserve = 0
        if len(tensors) == 1:
            (key, t), = tensors.items()
            nbytes = t.numel() * t.element_size()
            if arena < 0 and nbytes <= self.limits.inline_max_bytes:
                self._put_inline(key, t, nbytes, checksum)
                return
            if self._put_reserved(key, t, nbytes, checksum, arena):
                return
            reserve = nbytes  # same-sized puts (embeddings, KV blocks) will reuse it
        if not self._map.local:
            self._put_unmapped(tensors, checksum)
            return
        items = [AllocItem(key, dtype_name(t.dtype), list(t.shape), t.numel() * t.element_size())
                 for key, t in tensors.items()]
        with self._lock:
            # Taken before the request: the daemon's write TTL starts later, when it allocates.
            use_by = time.monotonic() + self._safe_write_window()
            reply: Allocated = self._call(Alloc(next(self._ids), ns, items, arena))
            mapping, ring_pos = self._map, self._map.ring.next_seq
        extents = reply.results
        failed = next((r for r in extents if isinstance(r, Failure)), None)
        generations = [r.generation for r in extents if not isinstance(r, Failure)]
        digests: list[int] = []
        on_device: list[int] = []  # items whose copy runs on a GPU (after the host copies)
        try:
            if failed is not None:
                raise error_from_code(failed.code, failed.message)
            for i, (extent, t) in enumerate(zip(extents, tensors.values())):
                if time.monotonic() > use_by:
                    # Stalled (stopped, swapped out) since the Alloc: the daemon may have expired
                    # the write and handed the extent to another entry; copying now would
                    # corrupt that entry, so give up as a commit of an expired write would.
                    raise StaleGeneration("the write lease may have expired (leases.write_ttl) before "
                                          "its bytes were copied: put again")
                if t.is_cuda or mapping.is_arena(extent.pool):
                    on_device.append(i)
                    digests.append(0)
                    continue
                digests.append(copy_into(mapping.rw[extent.pool], extent.offset, t, with_checksum=checksum))
            if on_device:
                values = list(tensors.values())
                done = self._copy_cuda(mapping, [extents[i] for i in on_device], [values[i] for i in on_device],
                                       checksum)
                for i, digest in zip(on_device, done):
                    digests[i] = digest
        except BaseException:
            if generations:
                with contextlib.suppress(EcdError):
                    self._call(Abort(next(self._ids), generations))
            raise
        with self._lock:
            if self._reservation is not None or self._reservation_busy:
                reserve = 0  # the daemon keeps one reservation per client
        committed: Committed = self._call(Commit(next(self._ids), generations, reserve,
                                                 digests if checksum else []))
        self._keep_reservation(committed.reservation, reserve)
        self._raise_first(committed.results)
        self._remember(ns, list(tensors), generations, ring_pos)

    def _safe_write_window(self) -> float:
        """How long after an Alloc (or reservation) this client may still start copying: half of
        what the daemon waits before it takes the extent back — the write TTL, or for a session it
        cannot watch by pid the session TTL (three heartbeat intervals)."""
        window = self.limits.write_ttl_s / 2
        if self._heartbeat_s:
            window = min(window, 1.5 * self._heartbeat_s)
        return window

    def _put_unmapped(self, tensors: dict[str, torch.Tensor], checksum: bool) -> None:
        """A client off the daemon's node: only puts small enough to ride inline."""
        inline_max = self.limits.inline_max_bytes
        sizes = {key: t.numel() * t.element_size() for key, t in tensors.items()}
        if max(sizes.values()) > inline_max:
            self._map.require_local("a put larger than limits.inline_max_bytes", inline_max)
        for key, t in tensors.items():
            self._put_inline(key, t, sizes[key], checksum)

    def _put_reserved(self, key: str, t: torch.Tensor, nbytes: int, checksum: bool, arena: int = -1) -> bool:
        """Copy into the reservation the last put left, then Publish: one round trip. False
        when there is no usable reservation (the caller takes the Alloc path)."""
        with self._lock:
            res = self._reservation
            if res is None:
                return False
            extent, size, expires, session, epoch = res
            self._reservation = None
            if (align_up(max(nbytes, 1)) != size or time.monotonic() > expires
                    or session != self._session or epoch != self._map.epoch
                    or not self._map.fits(extent, arena)):  # the last put left it in another tier
                # Not usable: hand it back (if it is still ours) so the next Commit can reserve anew.
                if session == self._session and epoch == self._map.epoch:
                    self._send_quietly(Abort(0, [extent.generation]))
                return False
            self._reservation_busy = True
            mapping, ring_pos = self._map, self._map.ring.next_seq
        try:
            try:
                if t.is_cuda or mapping.is_arena(extent.pool):
                    digest, = self._copy_cuda(mapping, [extent], [t], checksum)
                else:
                    digest = copy_into(mapping.rw[extent.pool], extent.offset, t, with_checksum=checksum)
                item = AllocItem(key, dtype_name(t.dtype), list(t.shape), nbytes)
            except BaseException:
                self._send_quietly(Abort(0, [extent.generation]))  # do not strand the reservation
                raise
            committed: Committed = self._call(Publish(next(self._ids), self.namespace, extent.generation,
                                                      item, nbytes, digest))
        finally:
            with self._lock:
                self._reservation_busy = False
        self._keep_reservation(committed.reservation, nbytes)
        result = committed.results[0]
        if isinstance(result, Failure) and result.code in (Code.STALE, Code.INVALID):
            return False  # the reservation was gone or unfit: put it the ordinary way
        self._raise_first(committed.results)
        self._remember(self.namespace, [key], [extent.generation], ring_pos)
        return True

    def _keep_reservation(self, reservation: Extent | Failure | None, nbytes: int) -> None:
        if not isinstance(reservation, Extent):
            return
        with self._lock:
            # Use it only well inside the time the daemon gives it: after that the extent may belong
            # to someone else, and copying into it would corrupt their entry.
            expires = time.monotonic() + self._safe_write_window()
            self._reservation = (reservation, align_up(max(nbytes, 1)), expires, self._session,
                                 self._map.epoch)

    def _remember(self, ns: str, keys: list[str], generations: list[int], ring_pos: int) -> None:
        """Cache locations learnt from a reply, unless ring events were consumed while the request
        was out: one of them may have been this entry's eviction, read before it was cached.
        Then, when the ring has RING_SYNC_BACKLOG unread events (half the ring if smaller), apply
        them: a client that only puts and gets would otherwise never read the ring."""
        with self._lock:
            ring = self._map.ring
            if ring.next_seq != ring_pos:
                return
            cache = self._cache
            for key, generation in zip(keys, generations):
                cache.remember(key_hash(ns, key), ns, key, generation)
            if self._map.local and ring.pending() >= min(RING_SYNC_BACKLOG, ring.nslots // 2):
                events = ring.poll(RING_MAX_BACKLOG) if ring.usable(RING_SILENCE_S) else None
                if events is None:
                    # Too far behind (idle while others wrote), lapped, or the ring is not usable:
                    # what is still valid cannot be told. Start again from the head, quietly: no
                    # answer depended on it, so it is not reported as an overrun.
                    cache.clear()
                    ring.skip_to_head()
                else:
                    cache.apply(events.tolist())

    def _send_quietly(self, request) -> None:
        """A fire-and-forget message (id 0) on the current socket; dropped if there is none."""
        with self._lock:
            if self._res.sock is not None:
                with contextlib.suppress(zmq.ZMQError):
                    self._res.sock.send(encoder.encode(request), zmq.NOBLOCK)
                    self._last_sent = time.monotonic()

    def _put_inline(self, key: str, t: torch.Tensor, nbytes: int, checksum: bool) -> None:
        if t.is_cuda:
            t = t.cpu()  # small enough to ride in the message: a synchronous copy is the cheapest
        data = bytearray(nbytes)
        copy_into(data, 0, t)
        data = bytes(data)
        acked: Acked = self._call(PutInline(next(self._ids), self.namespace, key, dtype_name(t.dtype),
                                            list(t.shape), data, checksum_of(data) if checksum else 0))
        self._raise_first(acked.results)
        with self._lock:
            self._cache.forget(key_hash(self.namespace, key))  # generation unknown: ask next time

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
        with self._lock:
            # The mapping is taken with the reply, under the same lock: another thread's call could
            # otherwise reconnect to a restarted daemon in between, and this reply's locations (of
            # the old daemon's pools) would be read from the new daemon's: other entries' bytes.
            reply: Acquired = self._call(Acquire(next(self._ids), self.namespace, keys, wait_s), wait_s)
            session, mapping = self._session, self._map
        found = [(key, r.generation) for key, r in zip(keys, reply.results) if isinstance(r, Location)]
        self._remember(self.namespace, [k for k, _ in found], [g for _, g in found], ring_pos)
        for result in reply.results:
            if isinstance(result, Location):
                mapping.check(result)
        return reply.results, session, mapping

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

    def get_many(self, keys: Sequence[str], timeout: float | None = None, *,
                 missing_ok: bool = False, verify: bool = False, device=None) -> list[torch.Tensor | None]:
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
                    tensor, actual = copy_out_checked(mapping.rw[loc.pool], loc.offset, loc.nbytes,
                                                      loc.dtype, loc.shape)
                    if actual != loc.checksum:
                        raise self._corrupt(key, loc, actual)
                    out.append(tensor)
                else:
                    out.append(copy_out(mapping.rw[loc.pool], loc.offset, loc.nbytes, loc.dtype, loc.shape))
            if batch is not None:
                batch.wait()
                from .cuda import tensor_checksum
                for i, key, loc in checks:
                    actual = tensor_checksum(out[i])
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
        verify = self._verifies(verify)
        (result,), session, mapping = self._acquire([key], timeout)
        loc = self._located(key, result) if isinstance(result, Failure) else result
        if mapping.is_arena(loc.pool):
            try:
                plane = self._cuda_plane(mapping)
                tensor = plane.arena_tensor(loc.pool, loc.offset, loc.nbytes, loc.dtype, loc.shape)
                if verify and loc.checksum:
                    from .cuda import tensor_checksum
                    actual = tensor_checksum(tensor)
                    if actual != loc.checksum:
                        raise self._corrupt(key, loc, actual)
                batch = plane.batch()
                try:
                    yield tensor
                finally:
                    batch.after(tensor)
                    batch.wait_quietly()
            finally:
                self._release([loc.generation], session, mapping.epoch)
            return
        try:
            if verify and loc.checksum:
                actual = checksum_of(mapping.ro[loc.pool], loc.offset, loc.nbytes)
                if actual != loc.checksum:
                    raise self._corrupt(key, loc, actual)
            yield view_of(mapping.ro[loc.pool], loc.offset, loc.nbytes, loc.dtype, loc.shape)
        finally:
            self._release([loc.generation], session, mapping.epoch)

    # ---- exists / pins / delete ---------------------------------------------------------

    def _sync_ring(self) -> bool:
        """Apply ring events to the location cache; True when the ring may answer negatives."""
        ring = self._map.ring
        # usable: the writer is alive and the header (epoch included) is as the daemon wrote it;
        # a ring another group member scribbled over is not, until the daemon has repaired it.
        if not ring.usable(RING_SILENCE_S):
            self._cache.clear()
            return False
        if not self._cache:
            ring.skip_to_head()
            return True
        corruptions = ring.corruptions
        events = ring.poll(RING_MAX_BACKLOG)
        if events is None:  # overrun, or events overwritten: we may have missed an eviction
            self._cache.clear()
            self._send_quietly(Report(0, 1))  # operators see overruns in ecd_ring_reader_overruns_total
            return ring.corruptions == corruptions  # overwritten: ask the daemon this time
        self._cache.apply(events.tolist())  # drops what was evicted, deleted, or replaced
        return True

    def exists(self, keys: str | Sequence[str], pin_s: float = 0.0) -> bool | list[bool]:
        """Which keys are present. With pin_s > 0, present entries cannot be evicted for pin_s
        seconds (or until unpin()). Absent keys are answered from the event ring, no round trip."""
        keys, single = _key_list(keys)
        ns = self.namespace
        _check_encodable("key", keys)  # key_hash needs the UTF-8 bytes
        if len(keys) > self.limits.max_batch:  # refused here as the daemon would, ring or not
            raise LimitExceeded(f"batch of {len(keys)} keys exceeds limits.max_batch={self.limits.max_batch}")
        with self._lock:
            if self._res.sock is None and not self._closed:
                self._connect()
            trusted = self._sync_ring()
            ring = self._map.ring
            answers: list[bool | None] = [None] * len(keys)
            ask: list[int] = []
            asked_hashes: list[int] = []
            is_cached = self._cache.known
            for i, key in enumerate(keys):
                keyhash = key_hash(ns, key)
                if trusted:
                    known = is_cached(keyhash, ns, key)
                    if not ring.maybe_present(keyhash):
                        if not known:
                            answers[i] = False
                            continue
                    elif known and pin_s <= 0:
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
        return answers[0] if single else answers

    def unpin(self, keys: str | Sequence[str]) -> bool | list[bool]:
        keys, single = _key_list(keys)
        reply: Flags = self._call(Unpin(next(self._ids), self.namespace, keys))
        return reply.values[0] if single else reply.values

    def delete(self, keys: str | Sequence[str]) -> bool | list[bool]:
        """Remove entries; readers holding a view keep their bytes until they release."""
        keys, single = _key_list(keys)
        reply: Flags = self._call(Delete(next(self._ids), self.namespace, keys))
        with self._lock:
            for key in keys:
                self._cache.forget(key_hash(self.namespace, key))
        return reply.values[0] if single else reply.values

    # ---- misc ---------------------------------------------------------------------------

    def keys(self, namespace: str | None = None, limit: int = 1000) -> tuple[int, list[dict]]:
        """(number of matching entries, the first `limit` by namespace and key) for operators.
        namespace None lists every namespace. Each entry: ns, key, generation, nbytes, dtype,
        shape, age_s, idle_s, readers, pins. Asks page by page: the daemon bounds each reply."""
        fields = KeyInfo.__struct_fields__
        entries: list[dict] = []
        after = None
        while True:
            reply: KeyList = self._call(Keys(next(self._ids), namespace or "", limit - len(entries), after))
            entries += [dict(zip(fields, msgspec.structs.astuple(e))) for e in reply.entries]
            if not reply.more or not reply.entries or len(entries) >= limit:
                return reply.total, entries
            after = (reply.entries[-1].ns, reply.entries[-1].key)

    def evict(self, keys: Sequence[str] = (), *, namespace: str | None = None, everything: bool = False,
              force: bool = False) -> dict:
        """Operator removal of keys (in `namespace`, default this client's), of a whole namespace
        (keys empty, namespace given), or of everything. Entries under a lease or pin are
        refused unless force. Returns evicted/refused/missing/draining (draining: generations
        whose readers still hold the bytes; see held())."""
        whole = not keys and namespace is not None and not everything
        if not keys and not whole and not everything:
            raise ValueError("name keys, a namespace, or everything=True")
        reply: Evicted = self._call(Evict(next(self._ids), namespace or self.namespace, list(keys),
                                          whole, everything, force))
        return {"evicted": reply.evicted, "refused": reply.refused, "missing": reply.missing,
                "draining": reply.draining}

    def held(self, generations: Sequence[int]) -> list[bool]:
        """Which of these generations still hold their bytes (evicted entries drain readers)."""
        return self._call(Held(next(self._ids), list(generations))).values

    def stats(self) -> dict:
        reply: StatsReply = self._call(Stats(next(self._ids)))
        return msgspec.to_builtins(reply.stats)

    def ping(self) -> int:
        """One round trip; returns the daemon's epoch."""
        return self._call(Ping(next(self._ids))).epoch

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._finalizer()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
