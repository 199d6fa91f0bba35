"""The put route of ecd.Client: place, copy, commit, the same three steps for every put.

Every put-like entry point (put, put_many, put(persist=True), CUDA tensors, the reservation the
previous commit left) comes in through `PutRoute.put_many`, which groups the tensors by tier (the
host pool, or the CUDA arena of each tensor's device) and sends each group down `PutRoute.put`:

1. place: describe each tensor once (dtype name, shape, size, key hash: what copy and commit
   need), decide once where the bytes go, and get that destination:
   - INLINE: in the message itself, for a tensor of at most limits.inline_max_bytes going to the
     host pool, and for every put of a client off the daemon's node (one message per tensor);
   - RESERVED: the extent the daemon reserved for this client's next put (the previous Commit or
     Publish brought it): no Alloc, so such a put is one round trip;
   - ALLOCATED: extents an Alloc round trip asks for now.
   An extent lies in the host pool or in a CUDA arena, the tier the group asked for.
2. copy: the bytes into the destination, with their checksum where one is stored: a host copy
   (ecd.client.tensors, one call for both) into the message's bytes or the pool's writable
   mapping, or a CUDA copy (ecd.client.cuda) for a tensor on a GPU going into extents or an
   extent in an arena, waited for before the commit. A copy that fails gives
   the destination back (Abort), so no extent is stranded.
3. commit: one round trip publishes the bytes (PutInline, Publish or Commit) and brings the
   reservation for the next put; the locations learnt go to the client's location_cache.

A Publish can find its reservation gone (the daemon took it back, or restarted): nothing was
stored, and that put goes once more the ordinary way (ALLOCATED).
"""
from __future__ import annotations

import contextlib
import functools
import math
import time
from typing import TYPE_CHECKING, Any, ContextManager, Iterator, Mapping, Protocol, Sequence, cast

import torch

from ..errors import RESTARTED, Code, EcdError, InvalidRequest, StaleGeneration, error_from_code
from ..memory.allocator import align_up
from ..protocol import (EntryMeta, Abort, Acked, Alloc, Allocated, AllocItem, Commit, Committed, Extent, Failure,
                        LeaseSpace, Location, Publish, PutInline)
from .control import _check_encodable
from .mapping import EpochMapping
from .tensors import copy_into, copy_many_into, dtype_name, host_tensor
from ..writes.producer import Placed, Submissions

if TYPE_CHECKING:
    from ..protocol import Limits, Welcome
    from .location_cache import LocationCache

PERSIST_WAIT_S = 60.0  # beyond the client's timeout, for a put(persist=True) to be made durable
HOST = -1  # a group's arena for the host pool (Alloc.arena's value for it; cuda.HOST, without importing it)

INLINE, RESERVED, ALLOCATED, SUBMITTED = "inline", "reserved", "allocated", "submitted"


class PutLink(Protocol):
    """All the put route uses of the client that owns it (ecd.client.client.Client is one): where
    its puts go (namespace, limits, the daemon run's mapping and submission page, the session they
    belong to), its lock, request ids and round trips, its location cache and CUDA plane. Typed
    against this, the route can reach nothing else of Client (mypy holds it to that)."""

    namespace: str
    timeout: float

    @property
    def welcome(self) -> Welcome: ...
    @property
    def limits(self) -> Limits: ...
    @property
    def location_cache(self) -> LocationCache: ...
    @property
    def _map(self) -> EpochMapping | None: ...  # the current daemon run's mapping
    @property
    def _writes(self) -> Submissions | None: ...  # its session's submission page
    @property
    def _session(self) -> int: ...
    @property
    def _heartbeat_s(self) -> float: ...
    @property
    def _lock(self) -> ContextManager[Any]: ...  # one acquisition per step that must not interleave
    @property
    def _ids(self) -> Iterator[int]: ...  # request ids
    def ping(self) -> Any: ...  # reconnect to a restarted daemon
    def _call(self, request: Any, wait_s: float = 0.0) -> Any: ...  # a round trip (takes the lock)
    def _call_locked(self, request: Any, wait_s: float = 0.0) -> Any: ...
    def _send_quietly(self, request: Any) -> None: ...  # fire and forget (id 0)
    def _settle_writes(self) -> None: ...  # its page's posted puts committed
    def _cuda_plane(self, mapping: EpochMapping) -> Any: ...
    def _verifies(self, asked: bool) -> bool: ...  # a checksum asked for, or the namespace verifies


class Destination:
    """One commit's tensors, described once for every step after (`items`: the key, dtype name,
    shape and size of each, as Alloc, Publish and PutInline send them; `keyhashes`, for the
    location cache), and where `PutRoute.place` decided their bytes go: INLINE until `into`
    names extents, with the epoch's mapping they lie in, the ring position before the reply that
    named them, and the time after which copying into them is no longer safe."""

    __slots__ = ("kind", "keys", "tensors", "items", "keyhashes", "extents", "mapping", "ring_pos", "deadline",
                 "data", "placed")

    def __init__(self, namespace: str, tensors: dict[str, torch.Tensor], cache: LocationCache,
                 meta: Mapping[str, EntryMeta] | None = None) -> None:
        self.kind = INLINE
        self.keys = list(tensors)
        self.tensors = list(tensors.values())
        self.items = [AllocItem(key, dtype_name(t.dtype), list(t.shape), _nbytes(t), meta.get(key) if meta else None)
                      for key, t in tensors.items()]
        self.keyhashes = [cache.keyhash(namespace, key) for key in self.keys]
        self.extents: list[Extent] = []
        self.mapping: EpochMapping | None = None
        self.ring_pos = -1
        self.deadline = math.inf
        self.data: bytes | bytearray = b""  # INLINE: the bytes, once copied
        self.placed: list[Placed] = []  # SUBMITTED: each put's place in a lease and its record

    def into(self, kind: str, extents: list[Extent], mapping: EpochMapping, ring_pos: int,
             deadline: float = math.inf) -> Destination:
        """Into these extents (the reservation, or extents allocated now)."""
        self.kind, self.extents, self.mapping, self.ring_pos, self.deadline = kind, extents, mapping, ring_pos, deadline
        return self


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class PutRoute:
    """A Client's puts, and the one reservation the daemon keeps for this client's next put.

    Part of the Client that owns it (ecd.client.client), split out so the route reads top to
    bottom in one place: each step is given that client and uses its connection state (its lock,
    request ids, round trip, mapping and location cache) as the client itself does. The client
    is passed, not kept: a reference back would make a cycle, and an unclosed Client would then
    be finalized (its socket closed, its session ended) only by the cyclic garbage collector."""

    def __init__(self) -> None:
        # [(extent, aligned size, use-by monotonic time, session, epoch mapping)] of the daemon's
        # reservation for this client's next put, or []: a list, so a put claims it with one
        # atomic pop; and whether a put is filling the one it claimed right now
        self._reservation: list[tuple[Extent, int, float, int, EpochMapping]] = []
        self._reservation_busy = False

    def forget_reservation(self) -> None:
        """A new daemon run: the old one's reservation went with it."""
        self._reservation.clear()

    # ---- the entry point and the route --------------------------------------------------

    def put_many(self, c: PutLink, items: Mapping[str, torch.Tensor], checksum: bool, tier: str | None, persist: bool,
                 meta: Mapping[str, EntryMeta] | None = None, wait: bool = True) -> None:
        """Client.put_many: one route per tier; the whole put once more if the daemon restarted
        between placing and committing (the bytes went with it)."""
        if tier is not None and tier not in ("host", "cuda"):
            raise InvalidRequest(f"tier must be None, 'host' or 'cuda', got {tier!r}")
        if persist and not c.welcome.disk:
            raise InvalidRequest("persist=True but the daemon has no disk tier ([pool.disk] is not configured): "
                                 "nothing was stored")
        _check_encodable("key", items)
        pending = dict(items)
        on_gpu = any(isinstance(t, torch.Tensor) and t.is_cuda for t in items.values())
        for attempt in range(2):
            epoch, page = c._map.epoch, c._writes
            try:
                if on_gpu:  # one Alloc/Commit per tier: the host pool, and each arena the tensors go to
                    groups = c._cuda_plane(cast(EpochMapping, c._map)).group_by_tier(pending, tier)
                else:
                    groups = {HOST: {key: host_tensor(t) for key, t in pending.items()}}
                for arena, tensors in groups.items():
                    if tensors:
                        self.put(c, tensors, c._verifies(checksum), arena, persist, meta, wait)
                    for key in tensors:
                        del pending[key]
                return
            except StaleGeneration:
                if attempt:
                    raise
                writes = c._writes
                if writes is not None and writes is page and writes.gone():
                    c.ping()  # the page says the daemon restarted: reconnect (a new session, page, epoch)
                if c._map.epoch == epoch and c._writes is page:
                    raise  # not a restart this client met: the daemon's own refusal

    def put(self, c: PutLink, tensors: dict[str, torch.Tensor], checksum: bool, arena: int, persist: bool,
            meta: Mapping[str, EntryMeta] | None = None, wait: bool = True) -> None:
        """The one put route for one tier's tensors: place, copy, commit (`meta`: by key, what
        Alloc, Publish or PutInline says each entry is). Puts go through the session's submission
        page when it has one (`wait`: until the daemon committed them)."""
        writes = c._writes
        if writes is not None and not persist and writes.mapping is c._map:
            tensors = self.submit(c, writes, tensors, checksum, wait, meta, arena)
            if not tensors:
                return
        c._settle_writes()  # (this thread's puts of these keys on the page before this one)
        for dest in self.place(c, tensors, arena, meta):
            digests = self.copy(c, dest, checksum)
            if not self.commit(c, dest, digests, checksum, persist):
                # A Publish whose reservation the daemon no longer held, or found unfit: nothing
                # was stored. The same tensors once more, the ordinary way.
                dest = self.allocate(c, dest, arena)
                self.commit(c, dest, self.copy(c, dest, checksum), checksum, persist)

    # ---- 1. place -----------------------------------------------------------------------

    def place(self, c: PutLink, tensors: dict[str, torch.Tensor], arena: int,
              meta: Mapping[str, EntryMeta] | None = None) -> Iterator[Destination]:
        """Where these tensors go: inline (one at a time: each is committed before the next is
        described), into the reservation, or into extents allocated now."""
        mapping, ns = c._map, c.namespace
        inline_max = c.limits.inline_max_bytes
        if not mapping.local:  # a client off the daemon's node: only puts small enough to ride inline
            if max(_nbytes(t) for t in tensors.values()) > inline_max:
                mapping.require_local("a put larger than limits.inline_max_bytes", inline_max)
            for key, t in tensors.items():
                yield Destination(ns, {key: t}, c.location_cache, meta)
            return
        dest = Destination(ns, tensors, c.location_cache, meta)
        if len(dest.items) == 1:
            if arena < 0 and dest.items[0].nbytes <= inline_max:
                yield dest  # INLINE
            else:
                yield self.claim_reservation(c, dest, arena) or self.allocate(c, dest, arena)
        else:
            yield self.allocate(c, dest, arena)

    def submit(self, c: PutLink, writes: Submissions, tensors: dict[str, torch.Tensor], checksum: bool,
               wait: bool, meta: Mapping[str, EntryMeta] | None = None, arena: int = HOST) -> dict[str, torch.Tensor]:
        """Place in the session's put leases of this tier, copy (an arena's: on the device, waited
        for), post a record each (ecd/writes/producer.py): no message unless a lease must be
        asked for. The tensors it could not take."""
        dest = Destination(c.namespace, tensors, c.location_cache)
        with c._lock:  # now: from its place to its post a put takes no lock (a read under it may wait for the post)
            cache = c.location_cache
            for keyhash in dest.keyhashes:
                cache.forget(keyhash)  # a generation cached before is being replaced
            cache.catch_up(cast(EpochMapping, c._map).ring)  # a client that only puts keeps up with the ring
        placed = writes.place(c.namespace, functools.partial(self.lease_space, c), tensors,
                              [it.nbytes for it in dest.items], [it.dtype for it in dest.items], meta, arena, c.timeout)
        if len(placed) < len(tensors):
            # One the page cannot take (a long key, no lease to be had): the whole batch goes the
            # round-trip route, whose Alloc places all of it or none (a refused item, nothing stored).
            writes.post(placed, [0] * len(placed), False, False, c.timeout, aborted=True)
            return tensors
        dest.into(SUBMITTED, [p.extent for p in placed], writes.mapping, -1, writes.deadline(arena)).placed = placed
        # All on the device, not waited for, no checksum to read back: the copies are queued on
        # the caller's streams and their records posted once the copies are done (post_after)
        on_device = not wait and not checksum and all(t.is_cuda or arena != HOST for t in dest.tensors)
        copies = self.copy_later(c, dest) if on_device else None
        digests = [0] * len(placed) if on_device else self.copy(c, dest, checksum)
        if copies is not None:
            writes.post_after(copies, placed, c.timeout, dest.tensors)
        else:
            writes.post(placed, digests, checksum, wait, c.timeout)
        return {}

    def lease_space(self, c: PutLink, page: Submissions, namespace: str, nbytes: int, tier: int) -> Acked | None:
        """The page's one round trip: LeaseSpace for a lease of `nbytes` in `tier` (the grant
        lands on the page). None when the client's session is not the page's (any more)."""
        with c._lock:
            if c._session != page.session:
                return None
            reply: Acked = c._call_locked(LeaseSpace(next(c._ids), namespace, nbytes, tier))
        return reply if c._writes is page else None  # else: reconnected meanwhile, the grant is elsewhere

    def copy_later(self, c: PutLink, dest: Destination) -> object:
        """Queue the device copies of a submitted put (not waited for): their CopyBatch."""
        try:
            if time.monotonic() > dest.deadline:  # as in copy: the lease may be someone else's now
                raise StaleGeneration("the put lease may have been revoked (leases.write_ttl) before its "
                                      "bytes were copied: put again")
            return c._cuda_plane(cast(EpochMapping, dest.mapping)).copy_in_async(dest.extents, dest.tensors)
        except BaseException:
            self.give_back(c, dest)
            raise

    def claim_reservation(self, c: PutLink, dest: Destination, arena: int) -> Destination | None:
        """Take the reservation for this put, without the lock: list.pop is atomic, so two threads
        never get the same one. None when there is none, or it does not fit this put."""
        try:
            extent, size, use_by, session, mapping = self._reservation.pop()
        except IndexError:
            return None
        ring_pos = mapping.ring.next_seq
        if (align_up(max(dest.items[0].nbytes, 1)) != size or time.monotonic() > use_by or session != c._session
                or mapping is not c._map or not mapping.fits(extent, arena)):
            # Not usable (another size or tier, too old, another daemon run): hand it back if
            # it is still ours, so the next Commit can reserve anew.
            if session == c._session and mapping is c._map:
                c._send_quietly(Abort(0, [extent.generation]))
            return None
        self._reservation_busy = True  # the daemon still holds it: asking for another is futile
        # use_by was checked just now: the copy does not look at the clock again
        return dest.into(RESERVED, [extent], mapping, ring_pos)

    def allocate(self, c: PutLink, dest: Destination, arena: int) -> Destination:
        """Alloc extents for the destination's items (one round trip); a refused item gives the
        others back and raises."""
        with c._lock:
            # Taken before the request: the daemon's write TTL starts later, when it allocates.
            deadline = time.monotonic() + self.safe_write_window(c)
            reply: Allocated = c._call_locked(Alloc(next(c._ids), c.namespace, dest.items, arena))
            mapping, ring_pos = cast(EpochMapping, c._map), c._map.ring.next_seq
        extents = [r for r in reply.results if not isinstance(r, Failure)]
        dest.into(ALLOCATED, extents, mapping, ring_pos, deadline)
        failed = next((r for r in reply.results if isinstance(r, Failure)), None)
        if failed is not None:
            self.give_back(c, dest)
            raise error_from_code(failed.code, failed.message)
        return dest

    def give_back(self, c: PutLink, dest: Destination) -> None:
        """Hand back extents whose put will not commit: a reservation with a fire-and-forget
        Abort (the lock may not be free: no round trip), allocated ones with a round trip."""
        generations = [e.generation for e in dest.extents]
        if dest.kind == SUBMITTED:
            c._writes.post(dest.placed, [0] * len(dest.placed), False, False, c.timeout, aborted=True)
        elif dest.kind == RESERVED:
            self._reservation_busy = False
            c._send_quietly(Abort(0, generations))
        elif generations:
            with contextlib.suppress(EcdError):
                c._call(Abort(next(c._ids), generations))

    # ---- 2. copy ------------------------------------------------------------------------

    def copy(self, c: PutLink, dest: Destination, checksum: bool) -> list[int]:
        """Copy each tensor into its place, with its checksum (0 without `checksum`): a host copy
        into the message's bytes or the pool's writable mapping, and those that run on a GPU (a
        tensor on a device going into extents, or an extent in an arena) afterwards, started
        together and waited for together. A failed copy gives the extents back."""
        mapping = cast(EpochMapping, dest.mapping)
        digests = [0] * len(dest.tensors)
        on_device: list[int] = []
        # Several host tensors without checksums: one compiled copy per pool segment for all of
        # them, not one numpy copy each (a put_many of a step's KV blocks: hundreds of entries).
        batched: dict[int, tuple[list[int], list[torch.Tensor], list[int]]] = {}  # pool -> offsets, tensors, sizes
        batch = dest.kind != INLINE and not checksum and len(dest.tensors) > 1
        try:
            for i, t in enumerate(dest.tensors):
                if batch and not t.is_cuda:
                    extent = dest.extents[i]
                    if not mapping.is_arena(extent.pool):
                        offsets, tensors, sizes = batched.setdefault(extent.pool, ([], [], []))
                        offsets.append(extent.offset)
                        tensors.append(t)
                        sizes.append(dest.items[i].nbytes)
                        continue
                nbytes = dest.items[i].nbytes
                if dest.kind == INLINE:
                    if t.is_cuda:
                        t = t.cpu()  # small enough to ride in the message: a synchronous copy is the cheapest
                    dest.data = buf = bytearray(nbytes)  # the message's bytes
                    offset = 0
                else:
                    extent = dest.extents[i]
                    if time.monotonic() > dest.deadline:
                        # Stalled (stopped, swapped out) since the Alloc: the daemon may have expired
                        # the write and handed the extent to another entry; copying now would corrupt
                        # that entry, so give up as a commit of an expired write would.
                        raise StaleGeneration("the write lease may have expired (leases.write_ttl) before "
                                              "its bytes were copied: put again")
                    if t.is_cuda or mapping.is_arena(extent.pool):
                        on_device.append(i)
                        continue
                    buf, offset = mapping.rw_for(extent.pool, extent.offset, nbytes), extent.offset
                digests[i] = copy_into(buf, offset, t, with_checksum=checksum)
            if batched:
                if time.monotonic() > dest.deadline:  # as above: the extents may be someone else's now
                    raise StaleGeneration("the write lease may have expired (leases.write_ttl) before "
                                          "its bytes were copied: put again")
                for pool, (offsets, tensors, sizes) in batched.items():
                    end = max(map(sum, zip(offsets, sizes)))
                    copy_many_into(mapping.rw_for(pool, end, 0), offsets, tensors, sizes)
            if on_device:
                done = c._cuda_plane(mapping).copy_in([dest.extents[i] for i in on_device],
                                                      [dest.tensors[i] for i in on_device], checksum)
                for i, digest in zip(on_device, done):
                    digests[i] = digest
        except BaseException:
            self.give_back(c, dest)  # do not strand the extents (an inline put holds none)
            raise
        return digests

    # ---- 3. commit ----------------------------------------------------------------------

    def commit(self, c: PutLink, dest: Destination, digests: list[int], checksum: bool, persist: bool) -> bool:
        """The put's last round trip, under one acquisition of the lock: ask for a reservation for
        the next put unless this client holds one, send, keep the one that comes back and the
        locations learnt. False when a Publish found its reservation gone or unfit (the caller
        allocates); a failed item raises."""
        request: PutInline | Publish | Commit
        item = dest.items[0]
        if dest.kind == INLINE:
            request = PutInline(next(c._ids), c.namespace, item.key, item.dtype, item.shape, bytes(dest.data), digests[0],
                                persist, item.meta)
        elif dest.kind == RESERVED:
            request = Publish(next(c._ids), c.namespace, dest.extents[0].generation, item, item.nbytes, digests[0],
                              persist)
        else:
            reserve = item.nbytes if len(dest.items) == 1 else 0  # same-sized puts reuse it
            request = Commit(next(c._ids), [e.generation for e in dest.extents], reserve,
                             digests if checksum else [], persist)
        with c._lock:
            if dest.kind == RESERVED:
                self._reservation_busy = False  # this put claimed it; the reply says what became of it
            if dest.mapping is not None and dest.mapping is not c._map:
                # Another thread reconnected to a restarted daemon while this put copied: its
                # extents went with the old one, and their generations may name others' there.
                if dest.kind == RESERVED:
                    return False
                raise StaleGeneration(RESTARTED)
            if dest.kind != INLINE and (self._reservation or self._reservation_busy):
                request.reserve = 0  # the daemon keeps one reservation per client
            # a persisted put is answered once the disk has it: give the write and its fsyncs time
            reply: Acked | Committed = c._call_locked(request, PERSIST_WAIT_S if persist else 0.0)
            if isinstance(reply, Committed):
                self._keep_reservation(c, reply.reservation, request.reserve)
            failure = next((r for r in reply.results if isinstance(r, Failure)), None)
            cache = c.location_cache
            if dest.kind == INLINE:
                cache.forget(dest.keyhashes[0])  # generation unknown: ask next time
            elif failure is None:
                # where each entry lives: a later get of it copies without asking (local_read.py)
                locations = [Location(e.generation, e.pool, e.offset, it.nbytes, it.dtype, list(it.shape),
                                      digest if checksum else 0)
                             for e, it, digest in zip(dest.extents, dest.items, digests)]
                mapping = cast(EpochMapping, c._map)
                cache.remember_reply(mapping.ring, dest.ring_pos, c.namespace, dest.keys, dest.keyhashes,
                                     [e.generation for e in dest.extents], catch_up=mapping.local,
                                     locations=locations)
        if failure is not None and dest.kind == RESERVED and failure.code in (Code.STALE, Code.INVALID):
            return False  # the reservation was gone or unfit: put it the ordinary way
        _raise_first(reply.results)
        return True

    def safe_write_window(self, c: PutLink) -> float:
        """How long after an Alloc (or reservation) this client may still start copying: half of
        what the daemon waits before it takes the extent back — the write TTL, or for a session it
        cannot watch by pid the session TTL (three heartbeat intervals)."""
        window = c.limits.write_ttl_s / 2
        if c._heartbeat_s:
            window = min(window, 1.5 * c._heartbeat_s)
        return window

    def _keep_reservation(self, c: PutLink, reservation: Extent | Failure | None, nbytes: int) -> None:
        """Under the lock, with the reply that brought it."""
        if isinstance(reservation, Extent):
            # Use it only well inside the time the daemon gives it: after that the extent may belong
            # to someone else, and copying into it would corrupt their entry.
            use_by = time.monotonic() + self.safe_write_window(c)
            self._reservation[:] = [(reservation, align_up(max(nbytes, 1)), use_by, c._session,
                                     cast(EpochMapping, c._map))]  # connected: set


def _raise_first(results: Sequence[Failure | None]) -> None:
    for result in results:
        if isinstance(result, Failure):
            raise error_from_code(result.code, result.message)
