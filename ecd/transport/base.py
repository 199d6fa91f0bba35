"""The interface every bulk transport of the peer plane implements, and the token table.

An owner serves bytes straight from its pool mapping; a puller receives them straight into an
extent it allocated. Both happen on the transport's own threads, never on the daemon's event
loop: a pull is a blocking call the daemon runs in an executor (its future completes on the loop
through call_soon_threadsafe), and the owner's sends report back through the `on_sent` callback,
which the transport calls on the loop (call_soon_threadsafe) once the bytes are in the kernel's
hands, so the loop can give the transfer lease back.

Tokens: the owner's control plane grants each leased entry a random one-time token
(`secrets.token_bytes(32)`) and files it here; a data connection must present it. Taking a token
(GrantTable.take, on a transport thread) and revoking it (on the loop: lease TTL, release, the
puller's session ending) race, so both go through one lock and exactly one of them wins: a
revoked token admits nothing, and a taken one cannot be revoked while its bytes are being sent.
"""
from __future__ import annotations

import abc
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # pragma: no cover
    from ..cluster_config import ClusterSection


class TransferError(Exception):
    """A transfer failed; `reason` is the metrics label (timeout, connection, refused, protocol,
    checksum, shutdown)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class TransportUnavailable(Exception):
    """A registered transport cannot run here: its module or a library it needs does not import
    (the message says why and, where it can, how to install it). The daemon refuses to start with
    a ConfigError naming cluster.transport."""


@dataclass(eq=False)
class Grant:
    """One leased entry the owner will send to whoever presents `token` (once)."""
    token: bytes
    pool: int
    offset: int
    nbytes: int
    owner: Any = None  # the peer session that holds the lease (the loop's business)
    generation: int = 0
    state: str = "pending"  # -> "sending" (taken by a data connection) -> "done"


class GrantTable:
    """token -> Grant, shared by the loop (files and revokes) and transport threads (take)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._grants: dict[bytes, Grant] = {}

    def add(self, grant: Grant) -> None:
        with self._lock:
            self._grants[grant.token] = grant

    def take(self, token: bytes) -> Grant | None:
        """A transport thread claims a token: its Grant (now "sending"), or None when unknown,
        used or revoked."""
        with self._lock:
            grant = self._grants.pop(token, None)
            if grant is not None:
                grant.state = "sending"
            return grant

    def revoke(self, token: bytes) -> Grant | None:
        """The loop withdraws a token nobody has taken yet: its Grant, or None when a data
        connection took it first (then the send's completion gives the lease back)."""
        with self._lock:
            return self._grants.pop(token, None)

    def __contains__(self, token: object) -> bool:
        """Whether a token is live now, without taking it (tcp's gate: does a connection that has
        not yet been served hold one?)."""
        with self._lock:
            return token in self._grants

    def __len__(self) -> int:
        return len(self._grants)


@dataclass
class PullItem:
    """One entry to receive: its token and the local extent the bytes go to."""
    token: bytes
    buf: Any  # the pool segment's mapping (a writable buffer)
    offset: int
    nbytes: int
    remote: int = 0  # nixl: the entry's address in the owner's registered pool (its offer's addr)


# (grants, bytes sent, failure reason or None). An empty list with a reason: a data connection
# the transport turned away before any token was taken (tcp's gate), to be counted only.
OnSent = Callable[[list[Grant], int, "str | None"], None]


class Transport(abc.ABC):
    """A bulk data plane. The daemon makes one at start (registry.make_transport, by the name in
    `[cluster] transport`) and closes it at shutdown, before its pools are unmapped.

    Life: construct -> bind() (in Cluster.prepare, before READY: start-up errors exit 2) ->
    `loop` set and serve() (in Cluster.start, on the loop) -> pull() for fetches, the owner's
    grants filed in `grants` -> close().

    Every transport's constructor takes these keywords (the daemon passes all of them; a
    transport ignores what does not apply to it): host, port (cluster.data_listen), max_inflight
    (pull threads), io_timeout (seconds without progress), loop (may come later: see `loop`),
    tls (a tls.TlsConfig or None; config refuses cluster.tls for a transport that cannot use
    it), instance (a name unique to this daemon run, "ecd:NODE:EPOCH"; "" for a made-up one).
    A library it needs that does not import: TransportUnavailable from the constructor.

    What the daemon asks of a transport's class, instead of testing its name: `has_data_listener`,
    `owner_sees_send` and `pins_pool` (capabilities), and check_config() (its own `[cluster]` checks).
    """

    name: str
    grants: GrantTable
    executor: Any  # where pulls run: at most cluster.max_inflight at once
    # The event loop that on_sent runs on (call_soon_threadsafe): the constructor's `loop`, or
    # set by the daemon before serve().
    loop: Any = None

    # tcp: the owner sees its sends end (on_sent gives the leases back). nixl: READs are
    # one-sided, so the puller tells the owner over the control plane (peer_done).
    owner_sees_send: bool = True
    # True (tcp): bind() opens a listener on cluster.data_listen, and peers dial its port at the
    # host they reach cluster.listen by (so config keeps data_listen on listen's host or a
    # wildcard). False (nixl: UCX listens by itself): data_listen does not apply, and the data
    # address the daemon announces only names it (its control port, unique on its host).
    has_data_listener: bool = True
    # Non-empty when the transport pins the host pool in the daemon (nixl: UCX registers it), so
    # `ecd doctor` checks RLIMIT_MEMLOCK against the pool's size: says how, for its finding.
    pins_pool: str = ""

    @classmethod
    def check_config(cls, cluster: "ClusterSection") -> None:
        """This transport's own checks of `[cluster]`, run by config validation once the name is
        known to be registered, before the TLS and CURVE checks (data_listen may still be "": its
        default comes later). Refuse with ValueError("KEY: why"), as config_types.check_field
        does; config reports it as cluster.KEY."""
        return None

    @abc.abstractmethod
    def bind(self) -> tuple[str, int]:
        """Take the data port now, so start-up errors come before READY (OSError: the daemon
        refuses to start, naming cluster.data_listen); returns where it is bound (host, port).
        serve() starts accepting on it. A transport without a listener of its own returns the
        address it was given."""

    @abc.abstractmethod
    def serve(self, segments: Callable[[int], Any], on_sent: OnSent) -> tuple[str, int]:
        """Start serving grants from the pool (segments(pool) -> its mapping, pools 0..n-1,
        IndexError past the last), binding first if bind() was not called; returns where peers
        reach it (host, port). `on_sent` runs on `loop` after each connection."""

    @abc.abstractmethod
    def pull(self, host: str, port: int, items: list[PullItem], deadline: float) -> int:
        """Blocking (run it in `executor`): receive every item from the owner at host:port by
        `deadline` (time.monotonic()); returns bytes received; TransferError otherwise. Never
        returns while a byte may still be written into an item's extent."""

    async def pull_on_loop(self, host: str, port: int, items: list[PullItem], deadline: float) -> int | None:
        """A pull() done on the event loop without ever blocking it, where the transport can (tcp:
        over a pooled plain connection): bytes received, TransferError, or None when it cannot
        here (then pull() on `executor`). Once it returns or raises, nothing writes into the items."""
        return None

    def metadata(self) -> bytes:
        """What the owner's peer_welcome carries for this transport (nixl: its agent metadata)."""
        return b""

    def learn_peer(self, address: tuple[str, int], metadata: bytes) -> None:
        """On the loop, from an owner's welcome: its transport metadata, keyed by its data address."""
        return None  # tcp needs none: the data connection's token is all

    def address_of(self, buf: Any, offset: int) -> int:
        """What an offer's `addr` says of an entry at `offset` in pool segment `buf` (nixl: its
        address in the registered pool; 0 where the transport needs none)."""
        return 0

    @abc.abstractmethod
    def close(self) -> None:
        """Stop serving and pulling; returns once no thread touches a pool mapping any more."""
