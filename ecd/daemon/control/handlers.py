"""One handler per request type: what the daemon does with each message of a known session,
dispatched with `match` on the tagged msgspec union (the loop, loop.py, has already decoded
the frame, found the session and refused what a session may not send)."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from ... import __version__
from ...errors import Code
from ...integrity import checksum as checksum_of, describe
from ...protocol import (PROTOCOL_VERSION, Abort, Acked, Acquire, Acquired, Alloc, Allocated, AllocItem, Commit,
                        Committed, DaemonStats, Delete, Evict, Evicted, Exists, Extent, Failure, Fetch, Flags, Held, Hello,
                        KeyInfo, KeyList, Keys, LeaseSpace, Limits, Ping, PoolInfo, Pong, Publish, PutInline, Release,
                        Report, RingInfo, Stats, StatsReply, Unpin, Welcome)
from .connections import Connection
from ..ops.metrics import client_sessions
from ..registry.entries import Entry, RequestError, Session, State
from ...memory.ring import TENANT_SEP, tenant_namespace

if TYPE_CHECKING:  # pragma: no cover
    from .context import HandlerContext
    from ..ops.metrics import ServeCounters

log = logging.getLogger("ecd.daemon")

LISTING_REPLY_BYTES = 1 << 20  # a Keys page is cut at about this many bytes
KEY_INFO_OVERHEAD = 64  # msgpack bytes of one KeyInfo beside its strings and shape (an upper bound)
# requests that may drop disk records (delete, evict, a put replacing a key): see dispatch
REMOVES_RECORDS = (Delete, Evict, Commit, Publish, PutInline)


async def _first_of_both(first: asyncio.Future, second: asyncio.Future) -> Any:
    """`first`'s result once both are done."""
    result = await first
    await second
    return result


class Handlers:
    def __init__(self, context: "HandlerContext", counters: "ServeCounters", send: Callable[[bytes, Any], None],
                 reply_error: Callable[[bytes, int, Code, str], str], count_error: Callable[[str], None],
                 count_drop: Callable[[str], None]) -> None:
        self.context = context  # what the handlers read of the daemon (context.py)
        self.counters = counters
        self.send = send  # queue a reply to a routing id
        self.reply_error = reply_error  # queue a typed error, return the metrics outcome
        self.count_error = count_error
        self.count_drop = count_drop
        self._removal_mark = -1  # while a REMOVES_RECORDS request is dispatched: the disk tier's mark

    def dispatch(self, identity: bytes, session: Session, request: Any) -> Any:
        """The request's answer, or None when it is answered later. A request that removed disk
        records is answered once they are gone for good: a key deleted or replaced must not come
        back at the next start (the unlinks run on the disk tier's worker threads).
        A namespace a request names is its session's tenant's (TENANT\0NAME, memory/ring.py)."""
        ns = getattr(request, "ns", None)
        if ns is not None:
            if TENANT_SEP in ns and self.context.config().tenants:  # (no tenants: NUL is just a character)
                raise RequestError(Code.INVALID, "a namespace name may not contain NUL while [tenants] are "
                                                 "configured (a tenant's namespaces are stored as TENANT NUL NAME)")
            if session.tenant and (ns or not isinstance(request, Keys)):  # Keys "": every namespace of its tenant
                request.ns = tenant_namespace(session.tenant, ns)
        if not isinstance(request, REMOVES_RECORDS):
            return self._dispatch(identity, session, request)
        self._removal_mark = self.context.lower_tier.removal_mark()
        try:
            reply = self._dispatch(identity, session, request)
            removed = self._removed() if reply is not None and request.id else None
        finally:
            self._removal_mark = -1
        if removed is None:
            return reply
        self._answer_when_done(identity, session, request.id, "removal", removed, lambda _: reply)
        return None

    def _dispatch(self, identity: bytes, session: Session, request: Any) -> Any:
        store = self.context.store
        match request:
            case Exists(id=rid, ns=ns, keys=keys, pin_s=pin_s):
                return Flags(rid, store.exists(session, ns, keys, pin_s))
            case Acquire(id=rid, ns=ns, keys=keys, wait_s=wait_s):
                def on_done(results, rid=rid):
                    self.send(identity, Acquired(rid, results))
                results = store.acquire(session, ns, keys, wait_s, on_done)
                return None if results is None else Acquired(rid, results)
            case Release(id=rid, generations=generations):
                store.check_batch(len(generations))
                released = [store.release(session, g) for g in generations]
                if rid == 0 and any(released):
                    self.count_error("release_refused")
                    self.count_drop("refused")
                return Acked(rid, released)
            case Alloc(id=rid, ns=ns, items=items, arena=arena):
                store.check_batch(len(items))
                pools = store.tier(arena, ns)
                run = store.placement.place_run(ns, items, pools)  # one allocator search for them all
                extents: list[Extent | Failure] = (
                    [store.open_write(session, ns, item, placed) for item, placed in zip(items, run)]
                    if run is not None else [store.alloc(session, ns, item, pools) for item in items])
                store.host.check_fresh(extents)  # a truncated pool file is whole again before the client copies
                return Allocated(rid, extents)
            case Commit(id=rid, generations=generations, reserve=reserve, checksums=checksums, persist=persist):
                store.check_batch(len(generations))
                if persist:
                    self.check_persist(session, generations)
                if checksums and len(checksums) != len(generations):
                    raise RequestError(Code.INVALID, f"{len(checksums)} checksums for "
                                                     f"{len(generations)} generations")
                checksums = checksums or [0] * len(generations)
                store.host.check_generations(generations)  # what a pool truncation took is refused
                # the reservation goes in the tier of the first committed item (host if none)
                tier = store.tier_of(generations[0]) if reserve and generations else None
                committed = [store.commit(session, g, c) for g, c in zip(generations, checksums)]
                reservation = store.reserve(session, reserve, tier) if reserve else None
                return self._committed(identity, session, rid, generations, committed, reservation, persist)
            case Publish(id=rid, ns=ns, generation=generation, item=item, reserve=reserve,
                         checksum=checksum, persist=persist):
                if persist:
                    self.check_persist(session, [generation])
                tier = store.tier_of(generation) if reserve else None  # the reservation's own tier
                store.host.check_generations([generation])
                result = store.publish(session, ns, generation, item, checksum)
                reservation = store.reserve(session, reserve, tier) if reserve else None
                return self._committed(identity, session, rid, [generation], [result], reservation, persist)
            case Abort(id=rid, generations=generations):
                store.check_batch(len(generations))
                return Acked(rid, [store.abort(session, g) for g in generations])
            case LeaseSpace(id=rid, ns=ns, nbytes=nbytes, arena=arena):
                area = self.context.submissions
                return Acked(rid, [area.grant(session, ns, nbytes, arena) if area is not None else
                                   Failure(Code.INVALID, "puts without a message are off (leases.submit_records = 0)")])
            case PutInline():
                if request.persist:
                    self.check_persist(session, [])
                placed = self.put_inline(session, request)
                if request.persist and isinstance(placed, int):
                    return self.persist(identity, session, request.id, [placed], [None],
                                        lambda results: Acked(request.id, results))
                return Acked(request.id, [placed if not isinstance(placed, int) else None])
            case Unpin(id=rid, ns=ns, keys=keys):
                return Flags(rid, store.unpin(session, ns, keys))
            case Delete(id=rid, ns=ns, keys=keys):
                return Flags(rid, store.delete(ns, keys))
            case Ping(id=rid):
                return Pong(rid, self.context.epoch)
            case Stats(id=rid):
                tenant = None if self.context.sessions.operator(session) else session.tenant
                return StatsReply(rid, daemon_stats(self.context, self.counters, tenant))
            case Keys(id=rid, ns=ns, limit=limit, after=after):
                return self.list_keys(rid, ns, limit, after, self._scope(session))
            case Evict(id=rid, ns=ns, keys=keys, whole_namespace=whole, everything=everything, force=force):
                evicted, refused, missing, draining = store.evict(ns, keys, whole, everything, force,
                                                                  self._scope(session))
                if everything and session.tenant:  # "NS/KEY" of the tenant's namespaces, as its clients name them
                    refused = [name[len(session.tenant) + 1:] for name in refused]
                return Evicted(rid, evicted, refused, missing, draining)
            case Fetch(id=rid, ns=ns, keys=keys, peer=peer, timeout_s=timeout_s):
                return self.fetch(identity, session, rid, ns, keys, peer, timeout_s)
            case Held(id=rid, generations=generations):
                return Flags(rid, store.held(generations))
            case Report(ring_overruns=overruns, integrity_failures=corrupt, local_reads=local_reads):
                self.counters.ring_overruns += overruns
                if local_reads:
                    store.placement.read_locally(local_reads)
                store.slot_holds.recheck()  # a client closed a view of an entry since removed: free it now
                if corrupt:
                    self.counters.integrity_failures["read"] += corrupt
                    log.warning("client pid %d (session %d) read %d entr%s whose bytes do not match "
                                "their stored checksum", session.pid, session.id, corrupt,
                                "y" if corrupt == 1 else "ies")
                return None
        raise RequestError(Code.PROTOCOL, f"unexpected request {type(request).__name__}")

    def _removed(self) -> "asyncio.Future[None] | None":
        """Done once the disk records this request removed (a delete, an eviction, a put that
        replaced a key) are gone from the directory durably; None when it removed none."""
        return self.context.lower_tier.removals_since(self._removal_mark) if self._removal_mark >= 0 else None

    def check_persist(self, session: Session, generations: list[int]) -> None:
        """A put asking for persist on a daemon without a disk tier is refused whole (its writes
        aborted), never stored quietly in memory alone."""
        if self.context.lower_tier.persists:
            return
        for generation in generations:
            self.context.store.abort(session, generation)
        raise RequestError(Code.INVALID, "persist=True but this daemon has no disk tier ([pool.disk] is not "
                                         "configured): nothing was stored")

    def _committed(self, identity: bytes, session: Session, rid: int, generations: list[int],
                   results: list[Failure | None], reservation: Extent | Failure | None,
                   persist: bool) -> Committed | None:
        """A Commit's or Publish's answer: now, or (persist) once the entries are durable."""
        if not persist:
            return Committed(rid, results, reservation)
        self.persist(identity, session, rid, generations, results, lambda durable: Committed(rid, durable, reservation))
        return None

    def persist(self, identity: bytes, session: Session, rid: int, generations: list[int],
                results: list[Failure | None], reply: Callable[[list[Failure | None]], Any]) -> None:
        """Answer a committed put once its entries are durable on disk (DiskTier.persist)."""
        store = self.context.store
        entries = [store.by_generation.get(g) if r is None else None for g, r in zip(generations, results)]
        durable: asyncio.Future = self.context.lower_tier.persist(entries)
        removed = self._removed()
        if removed is not None:  # a replaced key's old record too (see dispatch)
            durable = asyncio.ensure_future(_first_of_both(durable, removed))
        self._answer_when_done(identity, session, rid, "persist", durable,
                               lambda durable: reply([r if r is not None else p for r, p in zip(results, durable)]))

    def fetch(self, identity: bytes, session: Session, rid: int, ns: str, keys: list[str], peer: str,
              timeout_s: float) -> None:
        """Answered when the peer plane is done (peer/cluster.py), within the fetch's timeout."""
        peers = self.context.peers
        if peers is None:
            raise RequestError(Code.INVALID, "this daemon has no peer plane ([cluster] listen is not set)")
        task = peers.fetch(ns, keys, peer, timeout_s)  # RequestError now for a bad peer
        self._answer_when_done(identity, session, rid, "fetch", task,
                               lambda reasons: Flags(rid, [not why for why in reasons], reasons))

    def _answer_when_done(self, identity: bytes, session: Session, rid: int, what: str,
                          task: asyncio.Future, reply: Callable[[Any], Any]) -> None:
        """Answer a request whose work goes on after the handler returns (a fetch, a persist):
        with reply(result) once `task` is done, or a typed error. The session counts as busy
        meanwhile (it waits on the daemon: not a silent client to reap)."""
        session.replies_pending += 1

        def done(task) -> None:
            session.replies_pending -= 1
            if rid == 0:
                return
            if task.cancelled():
                self.reply_error(identity, rid, Code.SHUTTING_DOWN, "daemon is shutting down")
            elif task.exception() is not None:
                log.error("%s failed: %r", what, task.exception())
                self.reply_error(identity, rid, Code.INTERNAL, f"{what} failed: {task.exception()!r}")
            else:
                self.send(identity, reply(task.result()))
        task.add_done_callback(done)

    def _scope(self, session: Session) -> str | None:
        """Whose namespaces an operator request (Keys, Evict) reaches: the session's tenant's
        (None: no tenants configured, every namespace)."""
        return session.tenant if self.context.config().tenants else None

    def list_keys(self, rid: int, ns: str, limit: int, after: tuple[str, str] | None,
                  tenant: str | None = None) -> KeyList:
        """One page of `ecd keys` (of `tenant`'s namespaces, shown as its clients name them), at
        most LISTING_REPLY_BYTES encoded: a listing of a big index must not become one huge reply
        queued to a client that may never read it."""
        if after is not None and tenant:
            after = (tenant_namespace(tenant, after[0]), after[1])
        # one more tells if more follow
        total, entries = self.context.store.list_keys(ns, limit + 1, after, tenant)
        now = time.monotonic()
        page: list[KeyInfo] = []
        size = 0
        slotted = self.context.store.slot_holds.snapshot()  # views and pins held by read slots
        for e in entries[:limit]:
            info = self._key_info(e, now, slotted, len(tenant) + 1 if tenant else 0)
            size += (KEY_INFO_OVERHEAD + len(info.ns.encode()) + len(info.key.encode()) + len(info.dtype)
                     + 9 * len(info.shape))
            if page and size > LISTING_REPLY_BYTES:
                break
            page.append(info)
        return KeyList(rid, total, page, more=len(entries) > len(page))

    def _key_info(self, e: Any, now: float, slotted: tuple, prefix: int) -> KeyInfo:
        """One row of `ecd keys`: a READY entry, or a disk record of a key not in memory (its
        namespace without the first `prefix` characters: the tenant's, as its clients name it)."""
        if isinstance(e, Entry):
            tier = "memory+disk" if self.context.lower_tier.clean(e) else "memory"
            viewed, pinned = slotted
            return KeyInfo(e.ns[prefix:], e.key, e.generation, e.nbytes, e.dtype, list(e.shape), now - e.published_at,
                           now - e.last_access, e.readers + (e.generation in viewed), e.pins + pinned[e.generation],
                           tier)
        header = e.header
        age = max(0.0, time.time() - header.written_ns / 1e9)
        return KeyInfo(header.ns[prefix:], header.key, 0, header.nbytes, header.dtype, list(header.shape), age, age, 0, 0,
                       "disk")

    def put_inline(self, session: Session, request: PutInline) -> Failure | int:
        """The committed entry's generation, or why not."""
        limit = int(self.context.config().limits.inline_max_bytes)
        if len(request.data) > limit:
            return Failure(Code.LIMIT, f"inline payload of {len(request.data)} bytes exceeds "
                                       f"limits.inline_max_bytes={limit}")
        if request.checksum:
            actual = checksum_of(request.data)
            if actual != request.checksum:
                self.counters.integrity_failures["inline_put"] += 1
                return Failure(Code.CORRUPT, f"inline put of {request.key!r}: data checksum {describe(actual)} "
                                             f"does not match the {describe(request.checksum)} sent with it")
        item = AllocItem(request.key, request.dtype, request.shape, len(request.data), request.meta)
        placed = self.context.store.alloc(session, request.ns, item)
        if isinstance(placed, Failure):
            return placed
        # Small enough that copying in the daemon costs less than the round trip it saves.
        failure = self._copy_inline(session, placed, request)
        if failure is None:
            failure = self.context.store.commit(session, placed.generation, request.checksum)
        return placed.generation if failure is None else failure

    def _copy_inline(self, session: Session, placed: Extent, request: PutInline) -> Failure | None:
        """Copy an inline put into its extent. A copy cut short (another process truncated the
        pool file under it: ShmFile.write_at does not fault) restores the file and copies again
        once; a second cut refuses the put."""
        store, segment = self.context.store, self.context.segments[placed.pool]
        for _ in range(2):
            if segment.write_at(placed.offset, request.data) == len(request.data):
                return None
            store.host.check_pool(placed.pool)  # restored; this write is marked cut, but is written again
            store.host.forget_cut(placed.generation)
        store.abort(session, placed.generation)
        store.counters["truncated_writes_refused"] += 1
        return Failure(Code.CORRUPT, f"inline put of {request.key!r} not stored: host pool segment {placed.pool} "
                                     f"({segment.name}) was truncated by another process during the copy, twice")

    def hello(self, identity: bytes, conn: Connection, hello: Hello) -> str:
        if hello.version != PROTOCOL_VERSION:
            return self.reply_error(identity, hello.id, Code.VERSION, f"protocol version {hello.version} "
                                     f"not supported; daemon speaks {PROTOCOL_VERSION}")
        # RequestError in Welcome's place: NOT_ALLOWED (control.allowed_uids/gids), LIMIT
        ctx, cfg = self.context, self.context.config()
        tenant = ctx.sessions.admit(conn, cfg)
        session = ctx.sessions.open(conn, hello, tenant)
        limits = cfg.limits
        heartbeat_s = 0.0 if session.watched else float(cfg.leases.session_ttl) / 3
        # A sized tenant's client maps its own segments and ring and nothing of the others' (its
        # read slots and submission page lie in its own first segment: SlotHolds, SubmissionAreas)
        ring_file = ctx.tenant_rings.get(tenant, ctx.ring_file)
        ring = RingInfo(ring_file.name, ring_file.size, cfg.ring.slots, cfg.ring.presence_buckets, cfg.ring.index_records,
                        ctx.store.slot_holds.assign(session),
                        ctx.submissions.assign(session) if ctx.submissions is not None else [])
        self.send(identity, Welcome(
            hello.id, PROTOCOL_VERSION, session.id, ctx.epoch, ctx.node,
            [PoolInfo(i, ctx.segments[i].name, ctx.segments[i].size) for i in ctx.store.host.pools_of_tenant(tenant)],
            ring,
            Limits(limits.max_key_bytes, limits.max_batch, int(limits.max_message_bytes),
                   int(limits.inline_max_bytes), limits.max_ndim, float(cfg.leases.max_wait),
                   float(cfg.leases.max_pin), float(cfg.leases.write_ttl)), heartbeat_s,
            [] if tenant else sorted(ctx.store.verify_namespaces), ctx.arenas,  # ([namespaces.X]: the default's)
            ctx.peers.advertised if ctx.peers is not None else "", ctx.lower_tier.persists, ctx.fd_socket, tenant))
        return "ok"


def daemon_stats(context: "HandlerContext", counters: "ServeCounters", tenant: str | None = None) -> DaemonStats:
    """Stats: the store's state and the loop's counters; the sessions listed are `tenant`'s (a
    client's Stats: its own tenant's) or all (None: the daemon's own status)."""
    store = context.store
    states = store.count_states()
    leases, pins, waiters = store.lease_totals()
    reservations, reserved_bytes = store.reservation_totals()
    host = store.host
    # a client's: its tenant's segments and the arenas (another tenant's segments read as (0, 0))
    seen = None if tenant is None else {*host.pools_of_tenant(tenant), *host.arena_pools}
    pools = [(a.capacity, a.used) if seen is None or i in seen else (0, 0) for i, a in enumerate(host.allocators)]
    c = store.counters
    return DaemonStats(
        node=context.node, epoch=context.epoch, version=__version__,
        uptime_s=time.monotonic() - context.started,
        capacity_bytes=sum(p[0] for p in pools), used_bytes=sum(p[1] for p in pools), pools=pools,
        entries_ready=states[State.READY], entries_writing=store.writes_in_progress(),
        reservations=reservations, reserved_bytes=reserved_bytes,
        entries_retired=states[State.RETIRED], read_leases=leases,
        pins=pins, waiters=waiters, hits=c["hits"], misses=c["misses"], evictions=c["evictions"],
        reclaimed_sessions=c["reclaimed_sessions"], expired_writes=c["expired_writes"],
        ring_events=context.ring.events_written, ops=counters.requests.by_op(), errors=error_counts(context, counters),
        integrity_failures=sum(counters.integrity_failures.values()),
        disk=context.lower_tier.stats(), sessions=context.sessions.listing(tenant), restart=context.restart(),
        events=context.events(), leased_bytes=context.submissions.totals()[1] if context.submissions else 0,
        **cluster_stats(context))


def cluster_stats(context: "HandlerContext") -> dict[str, Any]:
    """The peer plane's part of Stats (DaemonStats' trailing fields), and the connected clients."""
    peers = context.peers
    clients = client_sessions(context.store, peers, context.lower_tier)
    if peers is None:
        return {"clients": clients}
    return {"clients": clients, "cluster_listen": peers.listen,
            "peers": peers.peer_states(), "transfer_leases": peers.transfer_leases(),
            "fetches_in_flight": peers.fetches_in_flight(), "fetch_failures": dict(peers.stats.failures),
            "directory": peers.directory_stats()}


def error_counts(context: "HandlerContext", counters: "ServeCounters") -> dict[str, int]:
    errors = dict(counters.errors)
    if context.curve is not None and context.curve.rejected:
        errors["auth_rejected"] = context.curve.rejected  # counted on the ZAP thread
    return errors

