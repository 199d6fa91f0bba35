"""The puller's fetch flow: make keys local by pulling them from the daemon that owns them.

For a `Fetch` request (a client asks its local daemon), on the event loop:
1. keys already here (READY, or on this node's disk tier) count as fetched; a key another fetch
   on this node is pulling now is waited for, not pulled again (`inflight`: one future per
   (ns, key): concurrent fetches of the same key pull once);
2. `lookup` at the named peer, or at every configured peer in parallel (first holder wins; the
   losers' leases are released, late replies included);
3. per owner, `Store.alloc` a local extent per key under this node's fetch session (WRITING:
   invisible to every reader), then the transport pulls the bytes into those extents on a worker
   thread, and the same thread checks each against the owner's xxh3-64 checksum;
4. back on the loop, each key is committed (READY, a PUBLISHED ring event, parked gets woken)
   only when its bytes arrived whole and matched; anything else is aborted (nothing visible) and
   counted by reason, and tokens the transfer did not use are released at the owner.
The answer is, per key, "" (local now) or why not: a FAILURE_REASONS label (cluster.py), the
same the failure counters use, or "not_found" (every peer asked answered, none holds it). Over nixl
   the owner never sees its bytes leave (one-sided READs): after a READ the puller sends
   `peer_done` for its tokens, and the owner gives those leases back.
A transfer is never abandoned while its thread may still write: the loop waits for the thread,
which itself gives up at the fetch's deadline (socket timeouts), so the daemon answers in time.
The deadline is kept under `leases.write_ttl`, so the store never expires a write being filled.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from ...errors import Code
from ...integrity import checksum as checksum_of
from ...peer_protocol import Leased, Lookup, Offer, PeerDone, PeerError, PeerRelease
from ...protocol import AllocItem, Extent
from ...transport import PullItem, TransferError
from ..registry.entries import RequestError
from .links import PeerLink, PeerUnavailable

if TYPE_CHECKING:  # pragma: no cover
    from ..registry.store import Store
    from .cluster import Cluster

log = logging.getLogger("ecd.peers")

LOCAL = ""  # a fetch's answer for a key that is local now


class Fetcher:
    def __init__(self, cluster: "Cluster") -> None:
        self.cluster = cluster
        self.inflight: dict[tuple[str, str], asyncio.Future] = {}
        self.session = cluster.context.store.open_session(cluster.internal_session_id(), 0)

    @property
    def store(self) -> "Store":
        return self.cluster.context.store

    def deadline_for(self, timeout_s: float) -> float:
        cfg = self.cluster.config
        timeout = float(cfg.fetch_timeout) if timeout_s <= 0 else min(timeout_s, float(cfg.fetch_timeout))
        # a local extent being filled must never reach the store's write TTL
        return time.monotonic() + min(timeout, 0.9 * float(self.cluster.context.config().leases.write_ttl))

    async def fetch(self, ns: str, keys: list[str], links: list[PeerLink], deadline: float) -> list[str]:
        """Per key "" (local now) or the reason it is not."""
        started = time.monotonic()
        result = ["timeout"] * len(keys)
        mine: list[str] = []
        waits: list[tuple[int, asyncio.Future]] = []
        loop = self.cluster.context.loop
        for i, key in enumerate(keys):
            if self.store.is_local(ns, key):
                result[i] = LOCAL
            elif (ns, key) in self.inflight:
                waits.append((i, self.inflight[(ns, key)]))
            else:
                self.inflight[(ns, key)] = loop.create_future()
                mine.append(key)
        got: dict[str, str] = {}
        try:
            if mine:
                got = await self._pull(ns, mine, links, deadline)
        finally:
            for key in mine:
                future = self.inflight.pop((ns, key))
                if not future.done():
                    future.set_result(got.get(key, "shutdown"))
        for i, key in enumerate(keys):
            if key in got:
                result[i] = got[key]
        for i, future in waits:
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    result[i] = await asyncio.shield(future)
            except TimeoutError:
                result[i] = LOCAL if (ns, keys[i]) in self.store.index else "timeout"
        if mine:
            self.cluster.stats.fetch_latency.observe(time.monotonic() - started)
        return result

    async def _pull(self, ns: str, keys: list[str], links: list[PeerLink], deadline: float) -> dict[str, str]:
        offers, lookup_failure = await self._lookup(ns, keys, links, deadline)
        by_link: dict[PeerLink, list[Offer]] = {}
        got: dict[str, str] = {}
        for key in keys:
            if key in offers:
                link, offer = offers[key]
                by_link.setdefault(link, []).append(offer)
            else:  # a peer that failed to answer may hold it: say so rather than "not_found"
                got[key] = lookup_failure or "not_found"
        if len(by_link) == 1:  # one owner (the usual case): no gather
            (link, chosen), = by_link.items()
            got.update(await self._transfer(link, ns, chosen, deadline))
            return got
        results = await asyncio.gather(*(self._transfer(link, ns, chosen, deadline)
                                         for link, chosen in by_link.items()))
        for part in results:
            got.update(part)
        return got

    async def _lookup(self, ns: str, keys: list[str], links: list[PeerLink],
                      deadline: float) -> tuple[dict[str, tuple[PeerLink, Offer]], str | None]:
        """Ask every link at once; per key the first that holds it wins. Offers that lose, in
        replies that come after we stopped waiting too, are released at their owner. Returns the
        offers chosen and why a link that did not answer with offers failed (None: all answered)."""
        cfg = self.cluster.config
        ttl = max(1.0, deadline - time.monotonic() + 1.0)
        chosen: dict[str, tuple[PeerLink, Offer]] = {}
        failed: list[str] = []
        timeout = min(float(cfg.request_timeout), max(0.0, deadline - time.monotonic()))

        def fail(reason: str, link: PeerLink) -> None:
            self.cluster.stats.count_failure(reason, link)
            failed.append(reason)

        def take(link: PeerLink, reply: Any, exc: BaseException | None) -> None:
            if exc is not None:
                fail(exc.reason if isinstance(exc, PeerUnavailable) else "lookup_failed", link)
                return
            if isinstance(reply, PeerError):
                log.warning("peer %s refused a lookup: %s", link.endpoint, reply.message)
                fail("lookup_refused", link)
                return
            if not isinstance(reply, Leased) or len(reply.offers) != len(keys):
                fail("protocol", link)
                return
            unused = []
            for key, offer in zip(keys, reply.offers):
                if offer is None:
                    continue
                if key in chosen or offer.key != key:
                    unused.append(offer.token)
                else:
                    chosen[key] = (link, offer)
            self.release(link, unused)

        if len(links) == 1:  # the usual case (a named peer): no task to race, just the request
            try:
                reply = await links[0].request(Lookup(0, ns, keys, ttl), timeout)
            except Exception as exc:
                take(links[0], None, exc)
            else:
                take(links[0], reply, None)
            return chosen, (failed[0] if failed else None)

        def take_task(task: asyncio.Task) -> None:
            if not task.cancelled():
                exc = task.exception()
                take(tasks[task], None if exc is not None else task.result(), exc)

        loop = self.cluster.context.loop
        tasks = {loop.create_task(link.request(Lookup(0, ns, keys, ttl), timeout)): link for link in links}
        pending = set(tasks)
        while pending and len(chosen) < len(set(keys)):
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task.cancelled():
                    fail("lookup_failed", tasks[task])
                else:
                    take_task(task)
        for task in pending:  # still out when every key found a holder: release what they lease
            task.add_done_callback(take_task)
        return chosen, (failed[0] if failed else None)

    def release(self, link: PeerLink, tokens: list[bytes], done: bool = False) -> None:
        """Give leases back at the owner, without waiting (its TTL covers a lost message);
        `done`: their bytes were read (peer_done, so the owner counts them served)."""
        if not tokens:
            return
        message = PeerDone(0, tokens) if done else PeerRelease(0, tokens)

        async def send() -> None:
            try:
                await link.request(message, float(self.cluster.config.request_timeout))
            except PeerUnavailable:
                pass
        self.cluster.context.loop.create_task(send())

    async def _transfer(self, link: PeerLink, ns: str, offers: list[Offer], deadline: float) -> dict[str, str]:
        got: dict[str, str] = {}
        placed: list[tuple[Offer, Extent]] = []
        unused: list[bytes] = []
        for offer in offers:
            if (ns, offer.key) in self.store.index:  # published here meanwhile
                got[offer.key] = LOCAL
                unused.append(offer.token)
                continue
            extent = self.store.alloc(self.session, ns, AllocItem(offer.key, offer.dtype, offer.shape, offer.nbytes,
                                                                          offer.meta))
            if isinstance(extent, Extent):
                placed.append((offer, extent))
            else:
                log.warning("fetch of %r from %s: no local room: %s", offer.key, link.label, extent.message)
                reason = "pool_full" if extent.code == Code.POOL_FULL else "invalid"
                self.cluster.stats.count_failure(reason, link)
                got[offer.key] = reason
                unused.append(offer.token)
        self.release(link, unused)
        if not placed:
            return got
        assert link.data_address is not None  # set by the hello the lookup needed
        segments = self.cluster.context.segments
        items = [PullItem(o.token, segments[e.pool].buf, e.offset, o.nbytes, o.addr) for o, e in placed]
        host, port = link.data_address
        transport = self.cluster.transport
        try:
            verdicts = await self._receive(transport, host, port, items, [o.checksum for o, _ in placed],
                                          [segments[e.pool] for _, e in placed], deadline)
        except TransferError as exc:
            log.warning("fetch of %d entr%s from %s failed: %s", len(placed), "y" if len(placed) == 1 else "ies",
                        link.label, exc)
            self.cluster.stats.count_failure(exc.reason, link)
            for offer, extent in placed:
                self.store.abort(self.session, extent.generation)
                got[offer.key] = exc.reason
            self.release(link, [o.token for o, _ in placed])
            return got
        if not transport.owner_sees_send:  # nixl: the READs are over, the owner's leases can go
            self.release(link, [o.token for o, _ in placed], done=True)
        for (offer, extent), ok in zip(placed, verdicts):
            if not ok:
                log.error("fetch of %r from %s: bytes do not match the owner's checksum: dropped",
                          offer.key, link.label)
                self.cluster.stats.count_failure("checksum", link)
                self.store.abort(self.session, extent.generation)
                got[offer.key] = "checksum"
            elif (ns, offer.key) in self.store.index:
                self.store.abort(self.session, extent.generation)  # a local put won meanwhile: keep it
                got[offer.key] = LOCAL
            else:
                failure = self.store.commit(self.session, extent.generation, offer.checksum)
                got[offer.key] = LOCAL if failure is None else "commit_refused"
                if failure is not None:
                    log.warning("fetch of %r: commit refused: %s", offer.key, failure.message)
                    self.cluster.stats.count_failure("commit_refused", link)
                else:
                    self.cluster.stats.fetched(link, offer.nbytes)
        return got

    async def _receive(self, transport: Any, host: str, port: int, items: list[PullItem], checksums: list[int],
                       files: list[Any], deadline: float) -> list[bool]:
        """The bytes into the extents, then each checked against its owner's checksum: per item
        whether it matched. Without checksums, on the loop where the transport can (tcp over a
        pooled connection: no hand-off to a thread and back, a good part of a small fetch's own
        cost); else on a transport thread, which pulls and hashes in one hand-off (a hash of MiBs
        would stall the loop)."""
        if not any(checksums) and await transport.pull_on_loop(host, port, items, deadline) is not None:
            return [True] * len(items)
        future = self.cluster.context.loop.run_in_executor(transport.executor, _pull_and_verify, transport, host,
                                                           port, items, checksums, files, deadline)
        # shield: even if this task is cancelled, the extents stay until the thread is done
        return await asyncio.shield(future)

    def close(self) -> None:
        for future in self.inflight.values():
            if not future.done():
                future.set_result("shutdown")


def _pull_and_verify(transport: Any, host: str, port: int, items: list[PullItem], checksums: list[int],
                     files: list[Any], deadline: float) -> list[bool]:
    """On a transport thread: pull, then check each entry against its owner's checksum. The hash
    reads the mapping: a pool file a group member truncated meanwhile would fault it (SIGBUS), so
    its size is looked at first (one fstat); the commit's own check then drops what the cut took
    (tiers/host.py). The pull itself cannot fault: the kernel's recv into a cut page is EFAULT."""
    transport.pull(host, port, items, deadline)
    return [not want or (file.current_size() >= item.offset + item.nbytes
                         and checksum_of(item.buf, item.offset, item.nbytes) == want)
            for item, want, file in zip(items, checksums, files)]


def check_fetch(store: Any, ns: str, keys: list[str]) -> None:
    """What a Fetch must satisfy before anything starts (RequestError otherwise)."""
    store.check_batch(len(keys))
    for key in keys:
        failure = store.check_key(ns, key)
        if failure is not None:
            raise RequestError(Code(failure.code), failure.message)
