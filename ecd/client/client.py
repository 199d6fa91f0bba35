"""ecd.Client: the synchronous client every engine shim is built on.

One DEALER socket carries small msgspec requests; tensor bytes are copied straight into and out
of the daemon's shared-memory pools, mapped once per daemon epoch (read-write for puts, a second
read-only mapping for views so a stray in-place write faults instead of corrupting the cache).
The event ring, mapped read-only, answers exists() negatives without a round trip and drops
cached locations of entries that were evicted or replaced.

Thread-safety: one lock serialises socket round trips; copies run outside it, so threads of one
process can put/get concurrently through one Client.
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

from ..errors import (Code, DaemonUnavailable, EcdError, KeyNotFound, LimitExceeded, ProtocolError,
                      StaleGeneration, error_from_code)
from ..memory.host import ShmError, ShmFile
from ..memory.ring import EventKind, RingReader, key_hash
from ..memory.allocator import align_up
from ..protocol import (PROTOCOL_VERSION, Abort, Acked, Acquire, Acquired, Alloc, Allocated, AllocItem,
                        Bye, Commit, Committed, Delete, Error, Evict, Evicted, Exists, Extent, Failure,
                        Flags, Held, Hello, KeyInfo, KeyList, Keys, Location, Ping, Publish, PutInline,
                        Release, Report, Stats, StatsReply, Unpin, Welcome, encoder, reply_decoder)
from .tensors import copy_into, copy_out, dtype_name, host_tensor, view_of

RING_SILENCE_S = 1.0  # a ring whose heartbeat is older than this is not trusted for negatives
RING_MAX_BACKLOG = 4096  # more unread events than this: drop the location cache instead


_NAMES_GENERATIONS = (Commit, Publish, Abort, Release)


def _key_list(keys: str | Sequence[str]) -> tuple[list[str], bool]:
    """(keys as a list, whether one bare key was given): one key in, one answer out."""
    return ([keys], True) if isinstance(keys, str) else (list(keys), False)


class _Resources:
    """What must be closed when the Client goes away, reachable without the Client itself."""

    def __init__(self) -> None:
        self.ctx = zmq.Context(io_threads=1)
        self.sock: zmq.Socket | None = None

    def drop_socket(self, say_bye: bool = False) -> None:
        if self.sock is None:
            return
        if say_bye:
            with contextlib.suppress(zmq.ZMQError):
                self.sock.send(encoder.encode(Bye(0)), zmq.NOBLOCK)
        self.sock.close(linger=100 if say_bye else 0)
        self.sock = None

    def close(self) -> None:
        self.drop_socket(say_bye=True)
        self.ctx.term()


class _Mapping:
    """One daemon epoch's shared memory as this process sees it."""

    def __init__(self, welcome: Welcome, populate: bool) -> None:
        self.epoch = welcome.epoch
        try:
            self.rw = [ShmFile.attach(p.name, p.size, writable=True, populate=populate).buf
                       for p in welcome.pools]
            self.ro = [ShmFile.attach(p.name, p.size, writable=False, populate=populate).buf
                       for p in welcome.pools]
            ring_file = ShmFile.attach(welcome.ring.name, welcome.ring.size, writable=False)
            self.ring = RingReader(ring_file.buf, welcome.ring.slots, welcome.ring.buckets)
        except (ShmError, ValueError) as exc:
            raise EcdError(f"cannot map the daemon's shared memory: {exc}") from None
        self.sizes = [p.size for p in welcome.pools]

    def check(self, loc: Location) -> None:
        if not (0 <= loc.pool < len(self.sizes) and 0 <= loc.offset
                and loc.offset + loc.nbytes <= self.sizes[loc.pool]):
            raise ProtocolError(f"daemon sent a location outside its pools: {loc}")


class Client:
    """Put, get, view, wait for and look up tensors held by the local ecd daemon."""

    def __init__(self, endpoint: str = "ipc:///tmp/ecd/ecd.sock", namespace: str = "default",
                 timeout: float = 5.0, *, name: str = "", populate: bool = True) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.endpoint = endpoint
        self.namespace = namespace
        self.timeout = float(timeout)
        self.name = name
        self.populate = populate
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._decoder = reply_decoder()
        self._res = _Resources()
        self._finalizer = weakref.finalize(self, self._res.close)
        self._closed = False
        self._session = 0
        # (extent, aligned size, use-by monotonic time, session, epoch) of the daemon's
        # reservation for this client's next put, and whether a put is filling it right now
        self._reservation: tuple | None = None
        self._reservation_busy = False
        self._map: _Mapping | None = None
        self._welcome: Welcome | None = None
        # keyhash -> (namespace, key, generation) of entries this client put or read
        self._cache: dict[int, tuple[str, str, int]] = {}
        with self._lock:
            self._connect()

    # ---- connection ---------------------------------------------------------------------

    def _connect(self) -> None:
        """Say hello (again). The socket is kept across timeouts: a daemon that was only slow
        still knows this session and its leases; ZMQ reconnects it to a restarted daemon."""
        if self._res.sock is None:
            sock = self._res.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.endpoint)
            self._res.sock = sock
        reply = self._roundtrip(Hello(next(self._ids), PROTOCOL_VERSION, os.getpid(), self.name), self.timeout)
        if isinstance(reply, Error):
            raise error_from_code(reply.code, reply.message)
        if not isinstance(reply, Welcome):
            raise ProtocolError(f"expected Welcome, got {type(reply).__name__}")
        if self._map is None or self._map.epoch != reply.epoch:
            try:
                mapping = _Mapping(reply, self.populate)  # a new daemon: new pools, new ring
            except EcdError:
                # Leave no session behind that this client cannot use; keep nothing of it either.
                with contextlib.suppress(zmq.ZMQError):
                    self._res.sock.send(encoder.encode(Bye(0)), zmq.NOBLOCK)
                raise
            self._map = mapping
            self._cache.clear()
            self._reservation = None
        self._welcome = reply
        self._session = reply.session

    def _roundtrip(self, request, timeout: float):
        sock = self._res.sock
        try:
            sock.send(encoder.encode(request), zmq.NOBLOCK)
        except zmq.ZMQError:
            self._res.drop_socket()
            raise DaemonUnavailable(f"cannot send to the daemon at {self.endpoint}") from None
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                if remaining <= 0:
                    raise zmq.Again()
                # A receive timeout on a blocking recv: cheaper than building a poller per call.
                sock.setsockopt(zmq.RCVTIMEO, min(max(1, int(remaining * 1000)), 2**31 - 1))
                frame = sock.recv()
            except zmq.Again:
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

    # ---- put ----------------------------------------------------------------------------

    def put(self, key: str, tensor: torch.Tensor) -> None:
        """Store `tensor` (any dtype/shape, contiguous or not) under `key`, replacing atomically."""
        self.put_many({key: tensor})

    def put_many(self, items: Mapping[str, torch.Tensor]) -> None:
        """Store several tensors with one allocation and one commit round trip."""
        tensors = {key: host_tensor(t) for key, t in items.items()}
        if not tensors:
            return
        for attempt in range(2):
            epoch = self._map.epoch
            try:
                return self._put_once(tensors)
            except StaleGeneration:
                # The daemon restarted between alloc and commit: the bytes went with it. Retry once.
                if attempt or self._map.epoch == epoch:
                    raise

    def _put_once(self, tensors: dict[str, torch.Tensor]) -> None:
        ns = self.namespace
        reserve = 0
        if len(tensors) == 1:
            (key, t), = tensors.items()
            nbytes = t.numel() * t.element_size()
            if nbytes <= self.limits.inline_max_bytes:
                self._put_inline(key, t, nbytes)
                return
            if self._put_reserved(key, t, nbytes):
                return
            reserve = nbytes  # same-sized puts (embeddings, KV blocks) will reuse it
        items = [AllocItem(key, dtype_name(t.dtype), list(t.shape), t.numel() * t.element_size())
                 for key, t in tensors.items()]
        with self._lock:
            # Taken before the request: the daemon's write TTL starts later, when it allocates.
            use_by = time.monotonic() + self.limits.write_ttl_s / 2
            reply: Allocated = self._call(Alloc(next(self._ids), ns, items))
            mapping, ring_pos = self._map, self._map.ring.next_seq
        extents = reply.results
        failed = next((r for r in extents if isinstance(r, Failure)), None)
        generations = [r.generation for r in extents if not isinstance(r, Failure)]
        try:
            if failed is not None:
                raise error_from_code(failed.code, failed.message)
            for extent, t in zip(extents, tensors.values()):
                if time.monotonic() > use_by:
                    # Stalled (stopped, swapped out) since the Alloc: the daemon may have expired
                    # the write and handed the extent to another entry; copying now would
                    # corrupt that entry, so give up as a commit of an expired write would.
                    raise StaleGeneration("the write lease may have expired (leases.write_ttl) before "
                                          "its bytes were copied: put again")
                copy_into(mapping.rw[extent.pool], extent.offset, t)
        except BaseException:
            if generations:
                with contextlib.suppress(EcdError):
                    self._call(Abort(next(self._ids), generations))
            raise
        with self._lock:
            if self._reservation is not None or self._reservation_busy:
                reserve = 0  # the daemon keeps one reservation per client
        committed: Committed = self._call(Commit(next(self._ids), generations, reserve))
        self._keep_reservation(committed.reservation, reserve)
        self._raise_first(committed.results)
        self._remember(ns, list(tensors), generations, ring_pos)

    def _put_reserved(self, key: str, t: torch.Tensor, nbytes: int) -> bool:
        """Copy into the reservation the last put left, then Publish: one round trip. False
        when there is no usable reservation (the caller takes the Alloc path)."""
        with self._lock:
            res = self._reservation
            if res is None:
                return False
            extent, size, expires, session, epoch = res
            self._reservation = None
            if (align_up(max(nbytes, 1)) != size or time.monotonic() > expires
                    or session != self._session or epoch != self._map.epoch):
                # Not usable: hand it back (if it is still ours) so the next Commit can reserve anew.
                if session == self._session and epoch == self._map.epoch:
                    self._send_quietly(Abort(0, [extent.generation]))
                return False
            self._reservation_busy = True
            mapping, ring_pos = self._map, self._map.ring.next_seq
        try:
            try:
                copy_into(mapping.rw[extent.pool], extent.offset, t)
                item = AllocItem(key, dtype_name(t.dtype), list(t.shape), nbytes)
            except BaseException:
                self._send_quietly(Abort(0, [extent.generation]))  # do not strand the reservation
                raise
            committed: Committed = self._call(Publish(next(self._ids), self.namespace, extent.generation,
                                                      item, nbytes))
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
            # Use it only well inside the daemon's write TTL: after that the extent may belong
            # to someone else, and copying into it would corrupt their entry.
            expires = time.monotonic() + self.limits.write_ttl_s / 2
            self._reservation = (reservation, align_up(max(nbytes, 1)), expires, self._session,
                                 self._map.epoch)

    def _remember(self, ns: str, keys: list[str], generations: list[int], ring_pos: int) -> None:
        """Cache locations learnt from a reply, unless ring events were consumed while the request
        was out: one of them may have been this entry's eviction, read before it was cached."""
        with self._lock:
            if self._map.ring.next_seq != ring_pos:
                return
            for key, generation in zip(keys, generations):
                self._cache[key_hash(ns, key)] = (ns, key, generation)

    def _send_quietly(self, request) -> None:
        """A fire-and-forget message (id 0) on the current socket; dropped if there is none."""
        with self._lock:
            if self._res.sock is not None:
                with contextlib.suppress(zmq.ZMQError):
                    self._res.sock.send(encoder.encode(request), zmq.NOBLOCK)

    def _put_inline(self, key: str, t: torch.Tensor, nbytes: int) -> None:
        data = bytearray(nbytes)
        copy_into(data, 0, t)
        acked: Acked = self._call(PutInline(next(self._ids), self.namespace, key, dtype_name(t.dtype),
                                            list(t.shape), bytes(data)))
        self._raise_first(acked.results)
        with self._lock:
            self._cache.pop(key_hash(self.namespace, key), None)  # generation unknown: ask next time

    @staticmethod
    def _raise_first(results: Sequence[Failure | None]) -> None:
        for result in results:
            if isinstance(result, Failure):
                raise error_from_code(result.code, result.message)

    # ---- get / view ---------------------------------------------------------------------

    def _acquire(self, keys: list[str], timeout: float | None) -> tuple[list[Location | Failure], int, _Mapping]:
        wait_s = float(timeout) if timeout else 0.0
        if not 0 <= wait_s < math.inf:
            raise ValueError(f"timeout must be a finite number of seconds >= 0, got {timeout!r}")
        wait_s = min(wait_s, self.limits.max_wait_s)  # the daemon would cut it there anyway
        with self._lock:
            ring_pos = self._map.ring.next_seq
        reply: Acquired = self._call(Acquire(next(self._ids), self.namespace, keys, wait_s), wait_s)
        with self._lock:
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

    def get(self, key: str, timeout: float | None = None) -> torch.Tensor:
        """A copy of the tensor under `key`; with `timeout`, wait that long for it to be published."""
        return self.get_many([key], timeout)[0]

    def get_many(self, keys: Sequence[str], timeout: float | None = None, *,
                 missing_ok: bool = False) -> list[torch.Tensor | None]:
        """Copies of several tensors in one round trip (None for a missing key if missing_ok)."""
        keys = list(keys)
        results, session, mapping = self._acquire(keys, timeout)
        held = [r.generation for r in results if isinstance(r, Location)]
        try:
            out: list[torch.Tensor | None] = []
            for key, result in zip(keys, results):
                if missing_ok and isinstance(result, Failure) and result.code == Code.KEY_NOT_FOUND:
                    out.append(None)
                    continue
                loc = self._located(key, result)
                out.append(copy_out(mapping.rw[loc.pool], loc.offset, loc.nbytes, loc.dtype, loc.shape))
            return out
        finally:
            self._release(held, session, mapping.epoch)

    @contextlib.contextmanager
    def view(self, key: str, timeout: float | None = None) -> Iterator[torch.Tensor]:
        """A zero-copy, read-only tensor over the entry, valid inside the `with` block only.

        Writing to it faults (the memory is mapped read-only): copy it to modify it.
        """
        (result,), session, mapping = self._acquire([key], timeout)
        loc = self._located(key, result) if isinstance(result, Failure) else result
        try:
            yield view_of(mapping.ro[loc.pool], loc.offset, loc.nbytes, loc.dtype, loc.shape)
        finally:
            self._release([loc.generation], session, mapping.epoch)

    # ---- exists / pins / delete ---------------------------------------------------------

    def _sync_ring(self) -> bool:
        """Apply ring events to the location cache; True when the ring may answer negatives."""
        ring = self._map.ring
        if not ring.alive(RING_SILENCE_S) or ring.epoch != self._map.epoch:
            self._cache.clear()
            return False
        if not self._cache:
            ring.skip_to_head()
            return True
        events = ring.poll(RING_MAX_BACKLOG)
        if events is None:  # overrun: we may have missed an eviction
            self._cache.clear()
            self._send_quietly(Report(0, 1))  # operators see overruns in ecd_ring_reader_overruns_total
            return True
        cache = self._cache
        for kind, keyhash, generation in events.tolist():
            cached = cache.get(keyhash)
            if cached is not None and (kind != EventKind.PUBLISHED or cached[2] != generation):
                del cache[keyhash]  # evicted, deleted, or replaced by a newer generation
        return True

    def exists(self, keys: str | Sequence[str], pin_s: float = 0.0) -> bool | list[bool]:
        """Which keys are present. With pin_s > 0, present entries cannot be evicted for pin_s
        seconds (or until unpin()). Absent keys are answered from the event ring, no round trip."""
        keys, single = _key_list(keys)
        ns = self.namespace
        if len(keys) > self.limits.max_batch:  # refused here as the daemon would, ring or not
            raise LimitExceeded(f"batch of {len(keys)} keys exceeds limits.max_batch={self.limits.max_batch}")
        with self._lock:
            if self._res.sock is None and not self._closed:
                self._connect()
            trusted = self._sync_ring()
            ring = self._map.ring
            answers: list[bool | None] = [None] * len(keys)
            ask: list[int] = []
            for i, key in enumerate(keys):
                keyhash = key_hash(ns, key)
                if trusted and not ring.maybe_present(keyhash):
                    answers[i] = False
                elif trusted and pin_s <= 0 and self._cache.get(keyhash, (None, None))[:2] == (ns, key):
                    answers[i] = True
                else:
                    ask.append(i)
            if ask:
                reply: Flags = self._call(Exists(next(self._ids), ns, [keys[i] for i in ask], float(pin_s)))
                for i, found in zip(ask, reply.values):
                    answers[i] = found
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
                self._cache.pop(key_hash(self.namespace, key), None)
        return reply.values[0] if single else reply.values

    # ---- misc ---------------------------------------------------------------------------

    def keys(self, namespace: str | None = None, limit: int = 1000) -> tuple[int, list[dict]]:
        """(number of matching entries, the first `limit` by namespace and key) for operators.
        namespace None lists every namespace. Each entry: ns, key, generation, nbytes, dtype,
        shape, age_s, idle_s, readers, pins."""
        reply: KeyList = self._call(Keys(next(self._ids), namespace or "", limit))
        fields = KeyInfo.__struct_fields__
        return reply.total, [dict(zip(fields, msgspec.structs.astuple(e))) for e in reply.entries]

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
