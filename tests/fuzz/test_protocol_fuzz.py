"""Protocol fuzzing against one real daemon (module scope): adversarial but well-formed requests
and raw garbage from raw DEALER sockets. Every request gets a typed reply with the right code (or
is dropped, unanswered, and counted in ecd_frames_dropped_total); after every example the daemon
still answers Ping; at the end a bystander's leases, pin, write and reservation are untouched and
the pool's bytes add up.
"""
from __future__ import annotations

import itertools
import os
import subprocess
import time

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import DaemonProcess, metric_by_label, scrape_metrics
from ecd.errors import Code
from ecd.memory.allocator import align_up
from ecd.protocol import (DTYPE_ITEMSIZE, PROTOCOL_VERSION, Abort, Acked, Acquire, Acquired, Alloc, Allocated,
                          AllocItem, Bye, Commit, Committed, Delete, Error, Evict, Evicted, Exists, Extent,
                          Failure, Flags, Held, Hello, Keys, KeyList, Location, Ping, Pong, Publish, PutInline,
                          Release, Report, Stats, StatsReply, Unpin, Welcome, encoder, expected_nbytes,
                          reply_decoder, request_decoder)
from ecd.daemon.control.loop import salvage_request_id

MAX_KEY = 256
MAX_BATCH = 512
MAX_NDIM = 8
MAX_MESSAGE = 2 << 20  # 2 MiB: a 1 MiB key fits, a 3 MiB frame is cut off by ZMQ_MAXMSGSIZE
INLINE_MAX = 64 << 10
POOL = 64 << 20
MAX_WAITERS = 4
MAX_LEASES = 8

BYSTANDER_NS = "bystander"
FUZZ_NS = "fuzz"
EXAMPLES = settings(max_examples=60, deadline=None, derandomize=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

pytestmark = pytest.mark.timeout(300)


class Peer:
    """A DEALER speaking the wire protocol by hand, one request in flight at a time."""

    _ids = itertools.count(1000)

    def __init__(self, ctx: zmq.Context, endpoint: str, timeout_ms: int = 10_000) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
        self.sock.connect(endpoint)
        self.decoder = reply_decoder()

    def next_id(self) -> int:
        return next(self._ids)

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def recv(self):
        return self.decoder.decode(self.sock.recv())

    def ask(self, msg):
        """Send one request (its id must not be 0) and return the reply, checking the id."""
        self.send(encoder.encode(msg))
        reply = self.recv()
        assert reply.id == msg.id, f"reply {reply!r} to {msg!r}"
        return reply

    def replies_until_ping(self, owed: int = 0) -> tuple[list, bool]:
        """Send a Ping sentinel; return the other replies that arrived until its answer and at
        least `owed` of them (a parked Acquire answers after the Ping), and whether the peer is
        registered (Pong) or not (NOT_REGISTERED)."""
        sentinel = self.next_id()
        self.send(encoder.encode(Ping(sentinel)))
        others, registered = [], None
        while registered is None or len(others) < owed:
            reply = self.recv()
            if reply.id == sentinel and isinstance(reply, (Pong, Error)) and registered is None:
                if isinstance(reply, Error):
                    assert reply.code == Code.NOT_REGISTERED, reply
                registered = isinstance(reply, Pong)
            else:
                others.append(reply)
        return others, registered

    def hello(self, name: str = "fuzz", pid: int | None = None) -> Welcome:
        # our pid namespace, so the daemon watches the pid like a real local client's
        reply = self.ask(Hello(self.next_id(), PROTOCOL_VERSION, os.getpid() if pid is None else pid, name,
                               os.stat("/proc/self/ns/pid").st_ino))
        assert isinstance(reply, Welcome)
        return reply

    def close(self) -> None:
        self.sock.close(0)


class World:
    def __init__(self) -> None:
        extra = f"""
[leases]
write_ttl = "10m"
max_wait = "1s"
[limits]
max_key_bytes = {MAX_KEY}
max_batch = {MAX_BATCH}
max_ndim = {MAX_NDIM}
max_message_bytes = {MAX_MESSAGE}
inline_max_bytes = {INLINE_MAX}
max_waiters_per_client = {MAX_WAITERS}
max_leases_per_client = {MAX_LEASES}
"""
        self.daemon = DaemonProcess(size="64MiB", extra=extra)
        self.daemon.start()
        self.ctx = zmq.Context()
        self.health = self.peer()
        self.health.hello("health")
        self.bystander = self.peer()
        self.bystander.hello("bystander")
        b = self.bystander
        assert b.ask(PutInline(b.next_id(), BYSTANDER_NS, "held", "float32", [4], b"\x01" * 16)).results == [None]
        (loc,) = b.ask(Acquire(b.next_id(), BYSTANDER_NS, ["held"])).results
        assert isinstance(loc, Location)
        self.lease_gen = loc.generation
        assert b.ask(Exists(b.next_id(), BYSTANDER_NS, ["held"], pin_s=600)).values == [True]
        (ext,) = b.ask(Alloc(b.next_id(), BYSTANDER_NS, [AllocItem("pending", "uint8", [1000], 1000)])).results
        assert isinstance(ext, Extent)
        self.pending_gen = ext.generation
        (ext2,) = b.ask(Alloc(b.next_id(), BYSTANDER_NS, [AllocItem("second", "uint8", [300], 300)])).results
        reply = b.ask(Commit(b.next_id(), [ext2.generation], reserve=8192))
        assert reply.results == [None] and isinstance(reply.reservation, Extent)
        self.reservation_gen = reply.reservation.generation
        self.bystander_gens = [self.lease_gen, self.pending_gen, self.reservation_gen]
        self.fuzzer = self.peer()
        self.fuzzer.hello("fuzzer")
        self.garbage = self.peer()
        self.garbage.hello("garbage")
        self.stranger = self.peer()  # never says hello
        self.refused_sent = 0  # id-0 requests we sent that the daemon must refuse silently

    def peer(self) -> Peer:
        return Peer(self.ctx, self.daemon.endpoint)

    def check_alive(self) -> None:
        assert self.daemon.alive(), self.daemon.log()[-3000:]
        rid = self.health.next_id()
        assert isinstance(self.health.ask(Ping(rid)), Pong)

    def stats(self):
        reply = self.health.ask(Stats(self.health.next_id()))
        assert isinstance(reply, StatsReply)
        return reply.stats

    def close(self) -> None:
        for p in (self.health, self.bystander, self.fuzzer, self.garbage, self.stranger):
            p.close()
        self.ctx.term()
        self.daemon.cleanup()


@pytest.fixture(scope="module")
def world():
    w = World()
    yield w
    w.close()


# ---- the daemon's checks, as a model --------------------------------------------------------

def item_failure(ns: str, item: AllocItem) -> int | None:
    """The code Store._check_item gives an item (None: acceptable)."""
    if not item.key:
        return Code.INVALID
    if len(item.key.encode()) > MAX_KEY or len(ns.encode()) > MAX_KEY:
        return Code.LIMIT
    if item.dtype not in DTYPE_ITEMSIZE:
        return Code.INVALID
    if len(item.shape) > MAX_NDIM:
        return Code.LIMIT
    if expected_nbytes(item.dtype, item.shape) != item.nbytes or item.nbytes > POOL:
        return Code.INVALID
    return None


def key_failure(ns: str, key: str) -> int | None:
    if not key:
        return Code.INVALID
    if len(key.encode()) > MAX_KEY or len(ns.encode()) > MAX_KEY:
        return Code.LIMIT
    return None


# ---- strategies -----------------------------------------------------------------------------

keys = st.one_of(st.sampled_from(["", "a", "k1", "k2", "k3", "x" * MAX_KEY, "y" * (MAX_KEY + 1), "é" * 200]),
                 st.text(max_size=40))
namespaces = st.one_of(st.sampled_from([FUZZ_NS, "", "other", "n" * (MAX_KEY + 1)]),
                       st.text(max_size=12)).filter(lambda ns: ns != BYSTANDER_NS)
dtypes = st.one_of(st.sampled_from(sorted(DTYPE_ITEMSIZE)), st.text(max_size=12))
dims = st.one_of(st.integers(0, 64), st.integers(0, 2**40), st.just(2**63 - 1))
shapes = st.lists(dims, max_size=MAX_NDIM + 3)
u64 = st.integers(0, 2**63 - 1)
generations = st.one_of(st.integers(-2**63, 2**64 - 1), st.integers(0, 300), st.sampled_from(["bystander"]))


@st.composite
def alloc_items(draw):
    key, dtype, shape = draw(keys), draw(dtypes), draw(shapes)
    exact = expected_nbytes(dtype, shape) if dtype in DTYPE_ITEMSIZE else 0
    nbytes = draw(st.one_of(st.just(exact), st.just(0), st.sampled_from([1, exact + 1, max(exact - 1, 0)]),
                            u64, st.just(POOL + 1)))
    if exact > 2**63 - 1:
        nbytes = draw(u64)
    return AllocItem(key, dtype, shape, min(nbytes, 2**63 - 1))


def resolve(world: World, gens: list) -> list[int]:
    out = []
    for g in gens:
        out.append(world.bystander_gens[len(out) % 3] if g == "bystander" else g)
    return out


# ---- well-formed, adversarial ---------------------------------------------------------------

@EXAMPLES
@given(ns=namespaces, items=st.lists(alloc_items(), max_size=6), reserve=st.one_of(st.just(0), u64))
def test_alloc_gets_one_result_per_item_with_the_right_code(world, ns, items, reserve):
    f = world.fuzzer
    reply = f.ask(Alloc(f.next_id(), ns, items))
    assert isinstance(reply, Allocated) and len(reply.results) == len(items)
    mine = []
    for item, result in zip(items, reply.results):
        want = item_failure(ns, item)
        if want is None:
            assert isinstance(result, Extent) or result.code == Code.POOL_FULL, (item, result)
            if isinstance(result, Extent):
                mine.append(result.generation)
        else:
            assert isinstance(result, Failure) and result.code == want and result.message, (item, result)
    if mine:  # commit one (maybe asking for a reservation), abort the rest
        reply = f.ask(Commit(f.next_id(), mine[:1], reserve=reserve))
        assert isinstance(reply, Committed) and reply.results == [None]
        if reserve > POOL:
            assert reply.reservation.code == Code.INVALID
        elif reserve:
            assert isinstance(reply.reservation, (Extent, Failure))
            if isinstance(reply.reservation, Extent):
                mine.append(reply.reservation.generation)
                # a reservation cannot be committed without a key
                (bad,) = f.ask(Commit(f.next_id(), [reply.reservation.generation])).results
                assert bad.code == Code.INVALID
        assert f.ask(Abort(f.next_id(), mine[1:])).results == [None] * (len(mine) - 1)
    world.check_alive()


@EXAMPLES
@given(ns=namespaces, key=keys, dtype=dtypes, shape=shapes, size=st.one_of(st.integers(0, 64), st.just(INLINE_MAX + 1)))
def test_put_inline_checks_shape_dtype_and_size(world, ns, key, dtype, shape, size):
    f = world.fuzzer
    reply = f.ask(PutInline(f.next_id(), ns, key, dtype, shape, b"\x00" * size))
    assert isinstance(reply, Acked) and len(reply.results) == 1
    (result,) = reply.results
    if size > INLINE_MAX:
        assert result.code == Code.LIMIT
    else:
        want = item_failure(ns, AllocItem(key, dtype, shape, size))
        assert (result is None) if want is None else (result.code == want), (result, want)
    world.check_alive()


@EXAMPLES
@given(op=st.sampled_from(["commit", "abort", "release", "held", "publish"]),
       gens=st.lists(generations, max_size=8))
def test_generations_of_others_or_of_nobody_are_refused(world, op, gens):
    f = world.fuzzer
    gens = resolve(world, gens)
    rid = f.next_id()
    if op == "publish":
        g = gens[0] if gens else 1
        reply = f.ask(Publish(rid, FUZZ_NS, g, AllocItem("p", "uint8", [8192], 8192)))
        assert isinstance(reply, Committed) and reply.results[0].code == Code.STALE
        world.check_alive()
        return
    msg = {"commit": Commit, "abort": Abort, "release": Release, "held": Held}[op](rid, gens)
    reply = f.ask(msg)
    if op == "held":
        assert isinstance(reply, Flags) and len(reply.values) == len(gens)
        assert all(v for g, v in zip(gens, reply.values) if g in world.bystander_gens)
        world.check_alive()
        return
    assert isinstance(reply, (Acked, Committed)) and len(reply.results) == len(gens)
    for g, result in zip(gens, reply.results):
        assert isinstance(result, Failure), (op, g)
        if op == "release" or g in (world.pending_gen, world.reservation_gen):
            assert result.code == Code.NOT_OWNER, (op, g, result)
        else:
            assert result.code in (Code.STALE, Code.NOT_OWNER), (op, g, result)
    world.check_alive()


@EXAMPLES
@given(op=st.sampled_from(["exists", "unpin", "delete", "acquire", "evict"]), ns=namespaces,
       ks=st.lists(keys, max_size=10), wait=st.sampled_from([0.0, 0.0, 0.01, 0.05]),
       pin=st.sampled_from([0.0, 0.5, 1e9]))
def test_key_batches_get_per_key_answers(world, op, ns, ks, wait, pin):
    f = world.fuzzer
    rid = f.next_id()
    if op == "acquire":
        reply = f.ask(Acquire(rid, ns, ks, wait))
        bad = [c for c in (key_failure(ns, k) for k in ks) if c is not None]
        if bad:
            assert isinstance(reply, Error) and reply.code == bad[0]
        elif len(ks) > MAX_LEASES:  # every key counts, repeated or not
            assert isinstance(reply, Error) and reply.code == Code.LIMIT
        else:
            assert isinstance(reply, Acquired) and len(reply.results) == len(ks)
            held = [r.generation for r in reply.results if isinstance(r, Location)]
            assert all(r.code == Code.KEY_NOT_FOUND for r in reply.results if isinstance(r, Failure))
            assert f.ask(Release(f.next_id(), held)).results == [None] * len(held)
    elif op == "evict":
        reply = f.ask(Evict(rid, ns, ks))
        # every distinct present key is evicted or refused once, however often it is named
        # (hypothesis found a present key named twice: evicted once, missing never)
        assert isinstance(reply, Evicted) and len(reply.missing) <= len(ks)
        assert reply.evicted + len(reply.refused) == len(set(ks) - set(reply.missing))
    else:
        msg = {"exists": lambda: Exists(rid, ns, ks, pin), "unpin": lambda: Unpin(rid, ns, ks),
               "delete": lambda: Delete(rid, ns, ks)}[op]()
        reply = f.ask(msg)
        assert isinstance(reply, Flags) and len(reply.values) == len(ks)
        if op == "exists" and pin:
            f.ask(Unpin(f.next_id(), ns, ks))
    world.check_alive()


@EXAMPLES
@given(msg=st.one_of(
    st.builds(Ping, st.integers(1, 2**40)),
    st.builds(Stats, st.integers(1, 2**40)),
    st.builds(Exists, st.integers(1, 2**40), namespaces, st.lists(keys, max_size=3)),
    st.builds(Commit, st.integers(1, 2**40), st.lists(generations.filter(lambda g: g != "bystander"), max_size=3)),
    st.builds(Release, st.integers(1, 2**40), st.lists(st.sampled_from([1, 2, 3]), max_size=3)),
    st.builds(Alloc, st.integers(1, 2**40), namespaces, st.lists(alloc_items(), max_size=2)),
))
def test_requests_before_hello_are_not_registered(world, msg):
    reply = world.stranger.ask(msg)
    assert isinstance(reply, Error) and reply.code == Code.NOT_REGISTERED
    world.check_alive()


@EXAMPLES
@given(version=st.integers(-2**63, 2**64 - 1).filter(lambda v: v != PROTOCOL_VERSION),
       pid=st.integers(-2**63, 2**64 - 1), name=st.text(max_size=30))
def test_hello_with_a_wrong_version_is_refused(world, version, pid, name):
    reply = world.stranger.ask(Hello(world.stranger.next_id(), version, pid, name))
    assert isinstance(reply, Error) and reply.code == Code.VERSION
    world.check_alive()


@EXAMPLES
@given(msg=st.one_of(
    st.builds(Release, st.just(0), st.lists(generations.filter(lambda g: g != "bystander"), min_size=1, max_size=4)),
    st.builds(Report, st.just(0), st.integers(0, 2**31)),
    st.builds(Ping, st.just(0)),
    st.builds(Exists, st.just(0), st.just(FUZZ_NS), st.lists(keys, max_size=3)),
), registered=st.booleans())
def test_fire_and_forget_requests_are_never_answered(world, msg, registered):
    """Nothing comes back for an id-0 request, not even an Error: the very next reply on the
    connection is the one to the next request."""
    peer = world.fuzzer if registered else world.stranger
    peer.send(encoder.encode(msg))
    assert peer.replies_until_ping() == ([], registered)
    if isinstance(msg, Release) and registered:
        world.refused_sent += 1  # the fuzzer holds no leases: every Release of it is refused
    if not registered:
        world.refused_sent += 1  # NOT_REGISTERED, and no one to tell
    world.check_alive()


def test_a_huge_key_and_a_huge_batch_are_refused_with_limit(world):
    f = world.fuzzer
    mib_key = "k" * (1 << 20)
    (result,) = f.ask(Alloc(f.next_id(), FUZZ_NS, [AllocItem(mib_key, "uint8", [1], 1)])).results
    assert result.code == Code.LIMIT and "max_key_bytes" in result.message
    reply = f.ask(Acquire(f.next_id(), FUZZ_NS, [mib_key]))
    assert isinstance(reply, Error) and reply.code == Code.LIMIT and "max_key_bytes" in reply.message
    (result,) = f.ask(PutInline(f.next_id(), FUZZ_NS, "k", "uint8", [1], b"x")).results
    assert result is None
    assert f.ask(Exists(f.next_id(), mib_key, ["k"])).values == [False]  # a 1 MiB namespace: no such entry
    big = [f"k{i}" for i in range(100_000)]
    for msg in (Exists(f.next_id(), FUZZ_NS, big), Acquire(f.next_id(), FUZZ_NS, big),
                Delete(f.next_id(), FUZZ_NS, big), Unpin(f.next_id(), FUZZ_NS, big),
                Evict(f.next_id(), FUZZ_NS, big), Commit(f.next_id(), list(range(100_000))),
                Abort(f.next_id(), list(range(100_000))), Release(f.next_id(), list(range(100_000))),
                Held(f.next_id(), list(range(100_000))),
                Alloc(f.next_id(), FUZZ_NS, [AllocItem("k", "uint8", [1], 1)] * (MAX_BATCH + 1))):
        reply = f.ask(msg)
        assert isinstance(reply, Error) and reply.code == Code.LIMIT and "max_batch" in reply.message, msg
    assert f.ask(Exists(f.next_id(), FUZZ_NS, ["k"])).values == [True]  # nothing was half-done
    world.check_alive()


def test_too_many_dimensions_are_refused_with_limit(world):
    f = world.fuzzer
    (result,) = f.ask(Alloc(f.next_id(), FUZZ_NS, [AllocItem("nd", "uint8", [1] * (MAX_NDIM + 1), 1)])).results
    assert result.code == Code.LIMIT and "max_ndim" in result.message
    (result,) = f.ask(PutInline(f.next_id(), FUZZ_NS, "nd", "uint8", [1] * (MAX_NDIM + 1), b"x")).results
    assert result.code == Code.LIMIT and "max_ndim" in result.message
    (result,) = f.ask(Alloc(f.next_id(), FUZZ_NS, [AllocItem("nd", "uint8", [1] * MAX_NDIM, 1)])).results
    assert isinstance(result, Extent)
    assert f.ask(Abort(f.next_id(), [result.generation])).results == [None]


def test_leases_per_client_are_limited(world):
    f = world.fuzzer
    names = [f"lease-{i}" for i in range(MAX_LEASES + 1)]
    for name in names:
        assert f.ask(PutInline(f.next_id(), FUZZ_NS, name, "uint8", [1], b"x")).results == [None]
    reply = f.ask(Acquire(f.next_id(), FUZZ_NS, names))
    assert isinstance(reply, Error) and reply.code == Code.LIMIT and "max_leases_per_client" in reply.message
    held = [r.generation for r in f.ask(Acquire(f.next_id(), FUZZ_NS, names[:MAX_LEASES])).results]
    reply = f.ask(Acquire(f.next_id(), FUZZ_NS, names[-1:]))
    assert isinstance(reply, Error) and reply.code == Code.LIMIT
    other = world.peer()  # the limit is per client: another one is not affected
    try:
        other.hello("other")
        (loc,) = other.ask(Acquire(other.next_id(), FUZZ_NS, names[-1:])).results
        assert isinstance(loc, Location)
        other.send(encoder.encode(Bye(0)))  # its lease goes with it
    finally:
        other.close()
    assert f.ask(Release(f.next_id(), held)).results == [None] * len(held)
    (loc,) = f.ask(Acquire(f.next_id(), FUZZ_NS, names[-1:])).results
    assert f.ask(Release(f.next_id(), [loc.generation])).results == [None]
    assert f.ask(Delete(f.next_id(), FUZZ_NS, names)).values == [True] * len(names)
    wait_leases(world, lambda s: s.read_leases == 1)  # the bystander's


def scrape_dropped(port: int) -> dict[str, float]:
    return metric_by_label(scrape_metrics(port), "ecd_frames_dropped_total", "reason")


def wait_leases(world: World, predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate(world.stats()):
        assert time.monotonic() < deadline, world.stats()
        time.sleep(0.02)


def test_parked_requests_per_client_are_limited(world):
    f = world.fuzzer
    parked = []
    for i in range(MAX_WAITERS):
        rid = f.next_id()
        f.send(encoder.encode(Acquire(rid, FUZZ_NS, [f"never-{i}"], wait_s=1.0)))
        parked.append(rid)
    reply = f.ask(Acquire(f.next_id(), FUZZ_NS, ["never-x"], wait_s=1.0))
    assert isinstance(reply, Error) and reply.code == Code.LIMIT and "max_waiters_per_client" in reply.message
    answered = {f.recv().id for _ in parked}  # each parked one times out with KEY_NOT_FOUND
    assert answered == set(parked)
    assert world.stats().waiters == 0


# ---- raw garbage ----------------------------------------------------------------------------

TAGS = ["ping", "alloc", "commit", "publish", "abort", "put_inline", "acquire", "release", "exists", "unpin",
        "delete", "stats", "keys", "evict", "held", "report", "bye", "no-such-tag", ""]
msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=12)
structured = st.builds(lambda tag, rid, fields: encoder.encode([tag, rid, *fields]),
                       st.sampled_from(TAGS), st.one_of(st.integers(0, 2**64 - 1), msgpack_values),
                       st.lists(msgpack_values, max_size=6))
garbage_frames = st.one_of(st.binary(max_size=300), structured, st.builds(encoder.encode, msgpack_values),
                           st.sampled_from([b"", b"\x91", b"\xdd\xff\xff\xff\xff", b"\xc1", b"\x92\xa4ping"]))
_decoder = request_decoder()


def expected_replies(frames: list[bytes], registered: bool) -> int:
    """How many replies the daemon owes for this message, and checks on them (by the caller)."""
    if len(frames) != 1:
        return 1
    try:
        request = _decoder.decode(frames[0])
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError, ValueError):
        return 1
    if isinstance(request, Hello):
        return 1
    if request.id == 0 or isinstance(request, (Report, Bye)):
        return 0
    return 1


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=st.one_of(st.lists(garbage_frames, min_size=1, max_size=1), st.lists(garbage_frames, min_size=2, max_size=4)),
       registered=st.booleans())
def test_garbage_gets_a_protocol_error_or_is_dropped(world, frames, registered):
    if not registered:
        try:
            if isinstance(_decoder.decode(frames[0]), Hello):
                return  # a stranger that says a valid hello is no stranger
        except Exception:
            pass
    peer = world.garbage if registered else world.stranger
    owed = expected_replies(frames, registered)
    peer.send(*frames)
    replies, registered_after = peer.replies_until_ping(owed)
    assert len(replies) == owed, (frames, replies)
    if registered and not registered_after:  # it said a valid bye
        peer.hello("garbage")
    if owed and len(frames) == 1:
        try:
            request = _decoder.decode(frames[0])
        except Exception:
            request = None
        if request is None:
            (error,) = replies
            assert isinstance(error, Error) and error.code == Code.PROTOCOL and error.message
            assert error.id == salvage_request_id(frames[0])
        else:
            assert replies[0].id == request.id
            if isinstance(replies[0], Error):
                assert replies[0].code not in (Code.PROTOCOL, Code.INTERNAL), replies[0]
    elif owed:
        (error,) = replies
        assert isinstance(error, Error) and error.code == Code.PROTOCOL and error.id == 0
    world.check_alive()


def test_oversized_frames_cut_the_connection_and_others_are_served(world):
    """ZMQ_MAXMSGSIZE: libzmq closes the connection of a peer that sends a frame over
    limits.max_message_bytes; the daemon never sees it and keeps serving everyone else."""
    clients = world.stats().clients
    for size in (MAX_MESSAGE + 1, 3 * MAX_MESSAGE):
        peer = world.peer()
        owner = subprocess.Popen(["sleep", "60"])  # the pid the orphaned session is tied to
        try:
            peer.hello("oversized", pid=owner.pid)
            peer.sock.setsockopt(zmq.RCVTIMEO, 500)
            peer.send(encoder.encode(PutInline(peer.next_id(), FUZZ_NS, "big", "uint8", [size], b"\x00" * size)))
            with pytest.raises(zmq.Again):
                peer.recv()
            # DEALER reconnects by itself, as a new identity the daemon has never greeted
            peer.sock.setsockopt(zmq.RCVTIMEO, 10_000)
            reply = peer.ask(Ping(peer.next_id()))
            assert isinstance(reply, Error) and reply.code == Code.NOT_REGISTERED
            peer.hello("oversized-again")
            assert isinstance(peer.ask(Ping(peer.next_id())), Pong)
            peer.send(encoder.encode(Bye(0)))
            # the cut connection's session went with it, though the pid its hello named lives on
            wait_leases(world, lambda s: s.clients == clients)
            assert owner.poll() is None
        finally:
            peer.close()
            if owner.poll() is None:
                owner.kill()
                owner.wait()
        world.check_alive()
    # two frames each under the limit are a protocol error, not a dropped connection
    peer = world.peer()
    try:
        half = b"\x00" * (MAX_MESSAGE // 2)
        peer.send(half, half)
        (error,), _ = peer.replies_until_ping(1)
        assert error.code == Code.PROTOCOL
    finally:
        peer.close()
    f = world.fuzzer
    just_under = MAX_MESSAGE - 1024
    reply = f.ask(Exists(f.next_id(), FUZZ_NS, ["z" * just_under]))
    assert reply.values == [False]


def test_evict_naming_a_key_twice_is_not_an_internal_error(world):
    """Regression (found by benchmarks/fuzz.py): Evict with a repeated present key answered
    INTERNAL after a KeyError half-way through."""
    f = world.fuzzer
    assert f.ask(PutInline(f.next_id(), FUZZ_NS, "twice", "uint8", [1], b"x")).results == [None]
    reply = f.ask(Evict(f.next_id(), FUZZ_NS, ["twice", "twice", "nope"]))
    assert isinstance(reply, Evicted) and reply.evicted == 1 and reply.missing == ["nope"]
    assert f.ask(Exists(f.next_id(), FUZZ_NS, ["twice"])).values == [False]
    world.check_alive()



# ---- last: nothing of the bystander was touched, and the books balance ----------------------

def test_zz_bystander_is_intact_and_the_pool_adds_up(world):
    f = world.fuzzer
    b = world.bystander
    for msg, code in ((Release(f.next_id(), [world.lease_gen]), Code.NOT_OWNER),
                      (Commit(f.next_id(), [world.pending_gen]), Code.NOT_OWNER),
                      (Abort(f.next_id(), [world.pending_gen]), Code.NOT_OWNER),
                      (Commit(f.next_id(), [world.reservation_gen]), Code.NOT_OWNER),
                      (Abort(f.next_id(), [world.reservation_gen]), Code.NOT_OWNER)):
        (result,) = f.ask(msg).results
        assert result.code == code, (msg, result)
    (result,) = f.ask(Publish(f.next_id(), BYSTANDER_NS, world.reservation_gen,
                              AllocItem("stolen", "uint8", [8192], 8192))).results
    assert result.code == Code.STALE
    assert f.ask(Unpin(f.next_id(), BYSTANDER_NS, ["held"])).values == [False]
    reply = f.ask(Evict(f.next_id(), BYSTANDER_NS, ["held"]))
    assert reply.evicted == 0 and reply.refused == ["held"]  # leased and pinned

    # the fuzzers leave: everything they held goes with them
    f.send(encoder.encode(Bye(0)))
    world.garbage.send(encoder.encode(Bye(0)))
    wait_leases(world, lambda s: s.clients == 2)  # health and bystander
    stats = world.stats()
    assert stats.read_leases == 1 and stats.pins == 1 and stats.waiters == 0
    assert stats.entries_writing == 1 and stats.reservations == 1 and stats.entries_retired == 0
    keys = world.health.ask(Keys(world.health.next_id(), "", 1_000_000))
    assert isinstance(keys, KeyList)
    ready_bytes = sum(align_up(max(e.nbytes, 1)) for e in keys.entries)
    assert stats.entries_ready == keys.total == len(keys.entries)
    assert stats.used_bytes == ready_bytes + align_up(1000) + stats.reserved_bytes, stats
    assert stats.reserved_bytes == align_up(8192)
    assert stats.errors.get("unhandled", 0) == 0 and stats.errors.get("internal", 0) == 0, stats.errors

    # the bystander's own lease, write and reservation still work
    (loc,) = b.ask(Acquire(b.next_id(), BYSTANDER_NS, ["held"])).results
    assert loc.generation == world.lease_gen
    assert b.ask(Release(b.next_id(), [world.lease_gen, world.lease_gen])).results == [None, None]
    assert b.ask(Commit(b.next_id(), [world.pending_gen])).results == [None]
    (result,) = b.ask(Publish(b.next_id(), BYSTANDER_NS, world.reservation_gen,
                              AllocItem("published", "uint8", [8192], 8192))).results
    assert result is None
    assert b.ask(Unpin(b.next_id(), BYSTANDER_NS, ["held"])).values == [True]

    # everything dropped unanswered was counted
    dropped = scrape_dropped(world.daemon.metrics_port)
    assert dropped["refused"] >= world.refused_sent > 0 and dropped["unanswerable"] > 0, dropped
    world.check_alive()
