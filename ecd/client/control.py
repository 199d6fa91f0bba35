"""ecd.ControlClient: the daemon's control socket, without tensors (imports neither torch nor numpy).

Everything of a client that is messages and nothing else: the DEALER socket, the version (and
CURVE) handshake, reconnecting to a restarted daemon, the request round trip (`request()`, public:
any ecd.protocol request, typed reply or the mapped EcdError), and the operations that move no
tensor bytes: exists, unpin, delete, keys, evict, held, stats, ping. The operator CLI (`ecd status`,
`ecd keys`, `ecd evict`) uses it as it is, and so starts in a fraction of a second.

`ecd.Client` (ecd.client.client) is a ControlClient plus the data plane: it maps the daemon's
pools and event ring (ecd.client.mapping, numpy) and moves torch tensors through them; its exists()
answers from the ring and its location cache where it can. Keep this module free of both: the
admin commands' start-up time depends on it (tests/ops/test_cli.py checks sys.modules).

Thread-safety: one lock serialises socket round trips. Remote use: with curve_secret_key and
curve_server_key the DEALER is a CURVE client (a refused handshake raises AuthenticationFailed). A
daemon that cannot watch this process (tcp, another pid namespace) asks for heartbeats in its
Welcome: a small daemon thread then pings when the client has been idle that long.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import threading
import time
import typing
import weakref
from typing import Sequence

import msgspec
import zmq

from ..errors import (RESTARTED, AuthenticationFailed, Code, DaemonUnavailable, EcdError, InvalidRequest, LimitExceeded,
                      ProtocolError, StaleGeneration, error_from_code)
from ..protocol import (PROTOCOL_VERSION, Abort, Acquire, Bye, Commit, Delete, Error, Evict, Evicted, Exists,
                        Fetch, Flags, Held, Hello, KeyInfo, KeyList, Keys, Ping, Publish, Release, Report, Stats,
                        StatsReply, Unpin, Welcome, encoder, reply_decoder)
from .. import protocol
from ..config_types import client_endpoint
from .connection import HANDSHAKE_EVENTS, Resources, check_socket_access, curve_keys, heartbeat

# Requests that name generations: after a daemon restart they mean nothing (or something else).
_NAMES_GENERATIONS = (Commit, Publish, Abort, Release)
_REQUESTS = typing.get_args(protocol.Request)
# The client's own business, never sent through request(): the session (Hello, Bye) and the
# counters it reports (Report, which the daemon never answers).
_NOT_REQUESTABLE = (Hello, Bye, Report)
# A fetch's default timeout (the daemon's cluster.fetch_timeout default): the round trip waits for
# it plus the client's own timeout.
FETCH_DEFAULT_TIMEOUT_S = 30.0
_Self = typing.TypeVar("_Self", bound="ControlClient")  # `with Client(...) as c`: c is a Client


# What each reason a fetch gives means (FetchOutcome.message); the labels are the daemon's
# (ecd/daemon/peer/fetch.py), the same ecd_transfer_failures_total counts.
FETCH_REASONS = {
    "not_found": "no peer asked holds it",
    "timeout": "the peer did not answer, or the transfer did not finish, within the fetch's timeout",
    "connection": "the data connection to the owner failed (owner stopped or died mid-transfer?)",
    "refused": "the peer refused this node (CURVE key, TLS certificate, transport or a spent token)",
    "data_host": "the peer announced its data port at another host than the one dialled: refused",
    "protocol": "the peer answered something malformed",
    "checksum": "the bytes did not match the owner's checksum: dropped",
    "pool_full": "no room for it in the local pool",
    "invalid": "the local daemon refused to allocate it",
    "lookup_refused": "the peer refused the lookup",
    "lookup_failed": "the lookup failed inside the local daemon (see its log)",
    "commit_refused": "the local daemon refused to commit the bytes it received",
    "shutdown": "the local daemon is shutting down",
    "unknown": "not local (the daemon is older than per-key reasons)",
}


@dataclasses.dataclass(frozen=True, slots=True)
class FetchOutcome:
    """One key of fetch_detailed(): true when it is local now; false with the reason why not."""
    key: str
    local: bool
    reason: str  # "" when local, else a FETCH_REASONS label

    def __bool__(self) -> bool:
        return self.local

    @property
    def message(self) -> str:
        return FETCH_REASONS.get(self.reason, self.reason) if self.reason else "local"


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


class ControlClient:
    """Look up, delete, list, evict and count entries of an ecd daemon; send it any request.

    A client of the control socket only: it maps no shared memory and moves no tensors (that is
    `ecd.Client`, which has all of this too). Works the same from another host."""

    def __init__(self, endpoint: str = "ipc:///tmp/ecd/ecd.sock", namespace: str = "default",
                 timeout: float = 5.0, *, name: str = "", curve_secret_key: str | None = None,
                 curve_server_key: str | None = None) -> None:
        """`curve_secret_key`: this client's key file (NAME.key_secret from `ecd keygen`) and
        `curve_server_key`: the daemon's public key (its .key file, or the 40-character Z85
        text), for a daemon with CURVE (remote tcp endpoints). Both or neither."""
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self._curve = curve_keys(curve_secret_key, curve_server_key)
        _check_encodable("namespace", [namespace])
        self.endpoint = client_endpoint(endpoint)  # before any socket or context exists
        self.namespace = namespace
        self.timeout = float(timeout)
        self.name = name
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._decoder = reply_decoder()
        self._res = Resources()
        self._finalizer = weakref.finalize(self, self._res.close)
        self._closed = False
        self._session = 0
        self._welcome: Welcome | None = None
        self._pid_ns = protocol.pid_namespace()  # looked up here so tests can fake a container
        self._heartbeat_s = 0.0  # from Welcome: ping when idle this long (0: not needed)
        self._last_sent = time.monotonic()  # any message sent counts as activity
        self._heartbeat_thread: threading.Thread | None = None
        try:
            with self._lock:
                self._connect()
        except BaseException:
            self._finalizer()  # now: nothing of a client that never was may keep the process from exiting
            raise

    # ---- connection ---------------------------------------------------------------------

    def _connect(self) -> None:
        """Say hello (again). The socket is kept across timeouts: a daemon that was only slow
        still knows this session and its leases; ZMQ reconnects it to a restarted daemon."""
        if self._res.sock is None:
            check_socket_access(self.endpoint)  # EACCES now, not a timeout: libzmq retries it silently
            sock = self._res.ctx.socket(zmq.DEALER)
            self._res.sock = sock  # from now on drop_socket closes it and its monitor, whatever fails
            self._res.ipc_path = self.endpoint[len("ipc://"):] if self.endpoint.startswith("ipc://") else None
            sock.setsockopt(zmq.LINGER, 0)
            if self._curve is not None:
                sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = self._curve
            try:
                # Before connect, so the first handshake's failure is seen.
                self._res.monitor = sock.get_monitor_socket(HANDSHAKE_EVENTS)
                self._res.handshake_drops = 0
                sock.connect(self.endpoint)
            except BaseException:
                self._res.drop_socket()
                raise
        reply = self._roundtrip(Hello(next(self._ids), PROTOCOL_VERSION, os.getpid(), self.name, self._pid_ns),
                                self.timeout)
        if isinstance(reply, Error):
            raise error_from_code(reply.code, reply.message)
        if not isinstance(reply, Welcome):
            raise ProtocolError(f"expected Welcome, got {type(reply).__name__}")
        restarted = self._welcome is not None and self._welcome.epoch != reply.epoch
        if self._welcome is None or self._welcome.epoch != reply.epoch:
            self._new_epoch(reply)  # the first daemon run this client meets, or a restarted one
        self._welcome = reply
        self._session = reply.session
        self._new_session(reply, restarted)
        if restarted:
            self._restarted()
        self._heartbeat_s = reply.heartbeat_s
        if self._heartbeat_s > 0 and self._heartbeat_thread is None:
            self._heartbeat_thread = threading.Thread(target=heartbeat, args=(weakref.ref(self), self._res.stop),
                                                      name="ecd-heartbeat", daemon=True)
            self._heartbeat_thread.start()

    def _new_epoch(self, welcome: Welcome) -> None:
        """Called by _connect, under the lock, when the daemon's epoch differs from the last
        Welcome's (or there was none), before that Welcome is adopted. A control client holds
        nothing of a daemon run; ecd.Client maps its shared memory here (raising EcdError keeps
        the old state and fails the connect)."""

    def _new_session(self, welcome: Welcome, restarted: bool) -> None:
        """Called by _connect, under the lock, for every Welcome (after _new_epoch; before
        _restarted when `restarted`)."""

    def _restarted(self) -> None:
        """Called by _connect, under the lock, once the Welcome of a restarted daemon is this
        client's: what it held of the old run and can take again (ecd.Client: its open views)."""

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
            # No connection to queue on: after a refused handshake libzmq drops it until its next
            # reconnect, so a refused key must be reported as such, not as an absent daemon.
            why = self._res.handshake_failure(self.endpoint, self._curve is not None)
            if why is not None:
                raise self._auth_failed(why) from None
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
            return self._call_locked(request, wait_s)

    def _call_locked(self, request, wait_s: float = 0.0):
        """_call for a caller that holds the lock already (one acquisition for its whole step)."""
        if self._closed:
            raise EcdError("client is closed")
        if self._res.sock is None:
            self._connect()
        reply = self._roundtrip(request, self.timeout + wait_s)
        if isinstance(reply, Error) and reply.code == Code.NOT_REGISTERED:
            epoch = self._welcome.epoch
            self._connect()
            if isinstance(request, _NAMES_GENERATIONS) and self._welcome.epoch != epoch:
                # Generations of the old daemon mean nothing (or something else) to the new one.
                raise StaleGeneration(RESTARTED)
            reply = self._roundtrip(request, self.timeout + wait_s)
        if isinstance(reply, Error):
            raise error_from_code(reply.code, reply.message)
        return reply

    def _send_quietly(self, request) -> None:
        """A fire-and-forget message (id 0) on the current socket; dropped if there is none."""
        with self._lock:
            if self._res.sock is not None:
                with contextlib.suppress(zmq.ZMQError):
                    self._res.sock.send(encoder.encode(request), zmq.NOBLOCK)
                    self._last_sent = time.monotonic()

    def request(self, message):
        """Send one ecd.protocol request and return the daemon's reply, a typed ecd.protocol Struct.

        The low-level door for tools and tests: any request the daemon accepts, as it travels on
        the wire (docs/protocol.md), e.g. `c.request(Alloc(0, "ns", [AllocItem("k", "uint8", [8],
        8)]))` -> Allocated. The client numbers it: the message's own `id` is ignored (build it
        with 0), the reply carries the number it was sent with. It travels like every call of
        this client: an Error reply raises the EcdError its code maps to (KeyNotFound,
        LimitExceeded, InvalidRequest, ...) while per-item Failures inside a batch reply
        (Allocated, Acquired, Acked, Committed) are returned as they are; a daemon that restarted
        is greeted again and the request sent once more, except one naming generations (Commit,
        Publish, Abort, Release), which raises StaleGeneration; no reply within the client's
        timeout (plus an Acquire's wait_s) raises DaemonUnavailable.

        What a request takes is the caller's to give back: the read leases of an Acquire (Release
        them), the writes of an Alloc (Commit or Abort them, or the daemon expires them after
        leases.write_ttl). Hello, Bye and Report are this client's own business (its session and
        its counters): ValueError; so is anything that is not a request (TypeError)."""
        if not isinstance(message, _REQUESTS):
            raise TypeError(f"expected an ecd.protocol request, got {type(message).__name__}")
        if isinstance(message, _NOT_REQUESTABLE):
            raise ValueError(f"{type(message).__name__} is sent by the client itself, not through request()")
        wait_s = 0.0
        if isinstance(message, Acquire):  # the daemon answers when the wait is over, at the latest
            wait_s = min(message.wait_s, self.limits.max_wait_s)
        elif isinstance(message, Fetch):
            wait_s = message.timeout_s or FETCH_DEFAULT_TIMEOUT_S
        return self._call(msgspec.structs.replace(message, id=next(self._ids)), wait_s)

    @property
    def welcome(self) -> Welcome:
        """The daemon's last Welcome, as received (read-only): its pools, ring, arenas, limits,
        heartbeat_s, disk tier, fd socket and so on (ecd.protocol.Welcome)."""
        return typing.cast(Welcome, self._welcome)  # connected in __init__: set

    @property
    def session_id(self) -> int:
        """This client's session with the daemon (from its Welcome); a new one after a reconnect
        that had to say hello again."""
        return self._session

    @property
    def heartbeating(self) -> bool:
        """Whether this client runs its heartbeat thread (the daemon asked for heartbeats: it
        cannot watch this process by pid)."""
        return self._heartbeat_thread is not None

    @property
    def limits(self):
        """The daemon's ecd.protocol.Limits, from its Welcome (max_batch, inline_max_bytes, ...)."""
        return self._welcome.limits

    @property
    def epoch(self) -> int:
        """The daemon run this client talks to (a restarted daemon has a new one)."""
        return self._welcome.epoch

    @property
    def node(self) -> str:
        """The daemon's node name ([node] name), from its Welcome."""
        return self._welcome.node

    @property
    def cluster_listen(self) -> str:
        """The daemon's peer endpoint (`cluster.listen` as bound, tcp://HOST:PORT), "" when it has
        no peer plane (or is older than this field): where other nodes fetch its entries from."""
        return self._welcome.cluster_listen

    @property
    def verify_namespaces(self) -> frozenset[str]:
        """Namespaces the daemon is configured to checksum (`verify = true`): puts into them
        always store a checksum and reads from them always verify it."""
        return frozenset(self._welcome.verify_namespaces)

    # ---- exists / pins / delete ---------------------------------------------------------

    def exists(self, keys: str | Sequence[str], pin_s: float = 0.0) -> bool | list[bool]:
        """Which keys are present (one round trip). With pin_s > 0, present entries cannot be
        evicted for pin_s seconds (or until unpin())."""
        keys, single = self._checked_keys(keys)
        reply: Flags = self._call(Exists(next(self._ids), self.namespace, keys, float(pin_s)))
        return reply.values[0] if single else reply.values

    def unpin(self, keys: str | Sequence[str]) -> bool | list[bool]:
        keys, single = _key_list(keys)
        reply: Flags = self._call(Unpin(next(self._ids), self.namespace, keys))
        return reply.values[0] if single else reply.values

    def send_pin(self, keys: Sequence[str], pin_s: float) -> None:
        """exists(keys, pin_s) without waiting for the answer (a message the daemon never
        answers): the present ones among `keys` stay for pin_s seconds or until unpinned. For a
        caller that knows already (an unpinned exists: the event ring) what is present and only
        wants it kept until it loads it: a key evicted before the pin lands is not pinned, so
        that load must take a miss as it takes any other (vLLM's connectors recompute it)."""
        if not pin_s > 0:
            raise InvalidRequest(f"pin_s must be > 0, got {pin_s!r}")
        self._send_batches(list(keys), lambda chunk: Exists(0, self.namespace, chunk, float(pin_s)))

    def send_unpin(self, keys: Sequence[str]) -> None:
        """unpin(keys) without waiting for the answer: nothing a caller does next depends on it,
        and a pin whose message is lost (a daemon restart) runs out at its deadline."""
        self._send_batches(list(keys), lambda chunk: Unpin(0, self.namespace, chunk))

    def _send_batches(self, keys: list[str], message: typing.Callable[[list[str]], object]) -> None:
        """Fire-and-forget messages (id 0, never answered) over `keys`, limits.max_batch at a
        time; connects first if need be. They go in order on this client's one socket, so the
        daemon handles them before any later request of this client."""
        for chunk in self._chunks(keys):
            self._send_quietly(message(chunk))

    def _checked_keys(self, keys: str | Sequence[str]) -> tuple[list[str], bool]:
        """The keys of one exists/unpin, refused here as the daemon would, connected and locked."""
        keys, single = _key_list(keys)
        _check_encodable("key", keys)  # key_hash needs the UTF-8 bytes
        if len(keys) > self.limits.max_batch:
            raise LimitExceeded(f"batch of {len(keys)} keys exceeds limits.max_batch={self.limits.max_batch}")
        with self._lock:
            if self._res.sock is None and not self._closed:
                self._connect()
        return keys, single

    def _chunks(self, keys: Sequence[str]) -> typing.Iterator[list[str]]:
        """send_pin/send_unpin: limits.max_batch keys at a time, under the lock (connected)."""
        keys = list(keys)
        _check_encodable("key", keys)
        with self._lock:
            if self._closed:
                raise EcdError("client is closed")
            if self._res.sock is None:
                self._connect()
            for start in range(0, len(keys), self.limits.max_batch):
                yield keys[start:start + self.limits.max_batch]

    def delete(self, keys: str | Sequence[str]) -> bool | list[bool]:
        """Remove entries; readers holding a view keep their bytes until they release."""
        keys, single = _key_list(keys)
        reply: Flags = self._call(Delete(next(self._ids), self.namespace, keys))
        self._forget(self.namespace, keys)
        return reply.values[0] if single else reply.values

    def _forget(self, ns: str, keys: list[str]) -> None:
        """Drop what this client knows of these entries (deleted): a control client knows nothing."""

    # ---- the peer plane ----------------------------------------------------------------

    def fetch(self, keys: str | Sequence[str], peer: str | None = None,
              timeout: float = FETCH_DEFAULT_TIMEOUT_S) -> bool | list[bool]:
        """Make keys local: the local daemon pulls the absent ones from a peer daemon ([cluster]
        in its node.toml) and answers which keys are local now (one already local counts).

        `peer`: a peer's endpoint ("tcp://HOST:PORT") or node name; None asks the daemon's
        configured peers, first holder wins. `timeout` bounds the whole fetch (the daemon caps it
        at its cluster.fetch_timeout); a key not fetched by then is False. DaemonUnavailable when the
        local daemon does not answer within timeout plus this client's own timeout;
        InvalidRequest for a daemon without a peer plane or a peer it does not know.
        fetch_detailed() says, per key, why it is not local."""
        outcomes = self.fetch_detailed(keys, peer, timeout)
        return outcomes.local if isinstance(outcomes, FetchOutcome) else [o.local for o in outcomes]

    def fetch_detailed(self, keys: str | Sequence[str], peer: str | None = None,
                       timeout: float = FETCH_DEFAULT_TIMEOUT_S) -> "FetchOutcome | list[FetchOutcome]":
        """fetch(), answered per key with a FetchOutcome: true when the key is local now, else
        false with the reason (`reason`: "not_found", "timeout", "connection", "refused",
        "checksum", "pool_full", ...; `message` explains it). Same arguments and errors."""
        keys, single = _key_list(keys)
        _check_encodable("key", keys)
        if peer is not None and not isinstance(peer, str):
            raise InvalidRequest(f"peer must be an endpoint or a node name, got {type(peer).__name__}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        if len(keys) > self.limits.max_batch:
            raise LimitExceeded(f"batch of {len(keys)} keys exceeds limits.max_batch={self.limits.max_batch}")
        reply: Flags = self._call(Fetch(next(self._ids), self.namespace, keys, peer or "", float(timeout)),
                                  float(timeout))
        reasons = reply.reasons if len(reply.reasons) == len(keys) else [""] * len(keys)  # an older daemon
        outcomes = [FetchOutcome(key, bool(local), "" if local else (why or "unknown"))
                    for key, local, why in zip(keys, reply.values, reasons)]
        self._fetched(self.namespace, [o.key for o in outcomes if o.local])
        return outcomes[0] if single else outcomes

    def _fetched(self, ns: str, keys: list[str]) -> None:
        """These keys are local now: a control client caches nothing about them."""

    # ---- operators ----------------------------------------------------------------------

    def keys(self, namespace: str | None = None, limit: int = 1000) -> tuple[int, list[dict]]:
        """(number of matching entries, the first `limit` by namespace and key) for operators.
        namespace None lists every namespace. Each entry: ns, key, generation, nbytes, dtype,
        shape, age_s, idle_s, readers, pins, tier (memory, disk, memory+disk). Asks page by page: the daemon bounds each reply."""
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
        if not self._closed:  # before the lock: a put between its place and its post may wait for it
            with contextlib.suppress(Exception):  # (a dead daemon: nothing to settle, nothing lost here)
                self._settle_writes()  # puts whose records wait for a device copy, before the goodbye
        with self._lock:
            if not self._closed:
                self._closed = True
                self._finalizer()

    def _settle_writes(self, keys: typing.Sequence[str] | None = None) -> None:
        """A subclass's posted puts (of `keys`) settled (Client: its submission page's)."""

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
