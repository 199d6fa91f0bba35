"""The ecd.Client of a vLLM connector (EC and KV alike): made on first use, dropped when the
daemon is unreachable, and not tried again for a back-off period after that.

Why: a connector must never raise into the engine nor make a step wait for a daemon that is not
there. A missing daemon has to cost a cache miss, not a client timeout on every scheduler step.

- The Client is created on the first call (`get`/`call`), not when vLLM builds the connector: an
  engine may start before its daemon.
- Before connecting, an `ipc://` endpoint's socket is probed with one non-blocking connect: a
  stopped daemon removed its socket, a killed one left it refusing connections; either way the
  attempt fails at once instead of waiting out `load_timeout_s` in the Client's hello.
- Before each use of a live Client, the socket file is checked (one stat): a daemon that stopped
  unlinked it, so the Client is dropped without a round trip; a socket file that is not the one
  the Client connected to (another inode or change time: the daemon restarted, after a kill too)
  drops it and makes a new one at once, so nothing is answered from the old daemon's event ring.
  (Abstract `ipc://@name` sockets and tcp endpoints have no file: neither check applies; failures
  then show as timeouts.)
- After a failure to reach the daemon (DaemonUnavailable, a failed connect) or an error that is
  not ecd's (the Client's state is then unknown), the Client is closed (its session ends, the
  daemon drops its pins and leases) and no call is made for BACKOFF_FIRST_S, doubling with each
  further failure up to BACKOFF_MAX_S; the first successful call resets it. Meanwhile every
  call is a miss that costs nothing. Other ecd errors (KeyNotFound, PoolFull, ...) keep the
  Client.
- Every failure is logged through the connector's RateLimitedLog, keyed by operation, so a dead
  daemon logs one line per kind of operation per LOG_INTERVAL_S.

Thread-safe (the Client is; creation and dropping are serialised here). Imports neither vLLM nor
torch until a Client is made.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Callable, TypeVar

from ...errors import DaemonUnavailable, EcdError, IntegrityError
from .ratelimit import RateLimitedLog
from .settings import ConnectorSettings

if TYPE_CHECKING:
    from ...client.client import Client

T = TypeVar("T")

BACKOFF_FIRST_S = 0.25  # no daemon calls (all misses) for this long after it was unreachable,
BACKOFF_MAX_S = 5.0  # doubling per further failure up to this: how late a restarted daemon is used
LOG_INTERVAL_S = 30.0  # one log line per kind of failure per interval; the rest are counted


def listening(path: str) -> bool:
    """Whether a unix socket at `path` accepts connections (one connect, closed at once)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)
    try:
        probe.connect(path)
    except BlockingIOError:  # a full backlog: someone is listening
        return True
    except OSError:  # missing file, refused (a killed daemon's socket), not a socket, no access
        return False
    finally:
        probe.close()
    return True


def socket_path(endpoint: str) -> str | None:
    """The socket file of an ipc:// endpoint; None for tcp:// and abstract (ipc://@name) ones."""
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint[len("ipc://"):]
    return None if not path or path.startswith("@") else path


def _new_client(settings: ConnectorSettings, namespace: str, name: str, populate: bool) -> Client:
    from ... import Client
    return Client(settings.endpoint, namespace, timeout=settings.load_timeout_s, name=name, populate=populate)


def batches(items: list, size: int):
    """`items` in slices of at most `size` (a request's max_batch)."""
    for i in range(0, len(items), max(1, size)):
        yield items[i:i + size]


class LazyClient:
    """One connector's Client (see the module docstring). `call(op, fn)` is the usual way in;
    `get(op)` hands out the Client (or None) for work that needs it before calling."""

    def __init__(self, settings: ConnectorSettings, namespace: str, name: str, log: RateLimitedLog, *,
                 populate: bool = True,
                 factory: Callable[[ConnectorSettings, str, str, bool], Client] = _new_client) -> None:
        """`populate`: pre-fault the pools into this process (workers copy bytes; a scheduler that
        only asks exists/unpin need not). `factory` makes the Client (tests replace it)."""
        self.settings = settings
        self.namespace = namespace
        self.name = name
        self.populate = populate
        self._log = log
        self._factory = factory
        self._socket_path = socket_path(settings.endpoint)
        self._client: Client | None = None
        self._client_socket_id: tuple[int, int, int] | None = None  # the socket file it connected to
        self._retry_at = 0.0  # monotonic time before which no Client is made
        self._backoff = BACKOFF_FIRST_S  # the next back-off period
        self._lock = threading.Lock()
        self.clients_made = 0  # a new one per daemon run met: what the old run's session held is gone

    @property
    def retry_at(self) -> float:
        """The monotonic time before which no Client is made (0.0: none is being backed off)."""
        return self._retry_at

    @property
    def next_backoff_s(self) -> float:
        """How long the next failure to reach the daemon backs off for."""
        return self._backoff

    def end_back_off(self) -> None:
        """Let the next call try the daemon at once, as if the back-off period were over (for
        tests; the doubling of later periods is kept)."""
        self._retry_at = 0.0

    @property
    def backing_off(self) -> bool:
        """No Client and none will be made yet: every call is a miss for now."""
        return self._client is None and time.monotonic() < self._retry_at

    def get(self, op: str) -> Client | None:
        """The Client, made now if needed; None while backing off or when the daemon cannot be
        reached (logged under `op`)."""
        dropped = None
        why: BaseException | None = None
        with self._lock:
            client = self._client
            if client is not None:
                socket_id = self._socket_id()
                if socket_id == self._client_socket_id:
                    return client
                dropped, self._client = client, None
                if socket_id is None:  # the daemon stopped: its socket is gone
                    self._back_off()
                    why = DaemonUnavailable(f"its socket {self._socket_path} is gone (daemon stopped?)")
                # else: another daemon bound the socket (a restart, after a kill too): this
                # Client's session and mappings are the old daemon's, whose ring may still look
                # alive for a moment; a new Client now, before anything is answered from them.
            if why is None and time.monotonic() < self._retry_at:
                pass  # backing off: a miss, quietly
            elif why is None:
                try:
                    if self._socket_path is not None and not listening(self._socket_path):
                        raise DaemonUnavailable(f"nothing listening on {self._socket_path}")
                    socket_id = self._socket_id()
                    self._client = self._factory(self.settings, self.namespace, self.name, self.populate)
                    self._client_socket_id = socket_id
                    self.clients_made += 1
                except Exception as exc:  # DaemonUnavailable, a pool it cannot map, ...
                    self._back_off()
                    why = exc
            client = self._client
        if dropped is not None:
            self._close(dropped)
        if why is not None:
            self._report(op, why)
        return client

    def _socket_id(self) -> tuple[int, int, int] | None:
        """(device, inode, change time) of the daemon's socket file, None if it is gone; zeros
        for endpoints without one (tcp, abstract ipc), which cannot be checked this way. The
        change time because tmpfs hands a freed inode number to the next file at once. One stat."""
        if self._socket_path is None:
            return (0, 0, 0)
        try:
            st = os.stat(self._socket_path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_ctime_ns)

    def call(self, op: str, fn: Callable[[Client], T]) -> T | None:
        """fn(client), or None when there is no Client or fn raised (logged, rate-limited, by
        `op`; the Client dropped as the module docstring says). Never raises."""
        client = self.get(op)
        if client is None:
            return None
        try:
            result = fn(client)
        except Exception as exc:
            self.failed(op, exc, client)
            return None
        self._backoff = BACKOFF_FIRST_S  # the daemon answered
        return result

    def failed(self, op: str, exc: BaseException, client: Client | None = None) -> None:
        """A call on `client` (default: the current one) raised `exc`: log it; drop the Client and
        back off unless it is an ecd error other than DaemonUnavailable."""
        if isinstance(exc, DaemonUnavailable) or not isinstance(exc, EcdError):
            with self._lock:
                dropped = self._client if client is None or client is self._client else None
                if dropped is not None:  # (another thread may have replaced it already)
                    self._client = None
                    self._back_off()
            if dropped is not None:
                self._close(dropped)
        self._report(op, exc)

    def close(self) -> None:
        """Close the Client (its session ends: the daemon releases its pins); a later call makes
        a new one."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            self._close(client)

    def _back_off(self) -> None:
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)

    def _report(self, op: str, exc: BaseException) -> None:
        name = type(exc).__name__
        if isinstance(exc, DaemonUnavailable):
            self._log.log(logging.WARNING, f"{op}:down",
                          "ecd daemon unavailable during %s (%s): treated as a miss; next try in %.2gs",
                          op, exc, max(0.0, self._retry_at - time.monotonic()))
        elif isinstance(exc, EcdError):  # KeyNotFound, PoolFull, StaleGeneration, a pool it cannot map, ...
            self._log.log(logging.WARNING, f"{op}:{name}", "ecd %s failed (%s: %s): treated as a miss",
                          op, name, exc)
        else:  # not ecd's (zmq, OS, a bad tensor): still never into the engine
            self._log.log(logging.ERROR, f"{op}:{name}", "ecd %s failed unexpectedly (%s: %s): treated as a miss",
                          op, name, exc, exc_info=exc)

    @staticmethod
    def _close(client: Client) -> None:
        try:
            client.close()  # says bye: the daemon drops this session's pins and leases
        except Exception:  # pragma: no cover - closing never matters more than serving
            pass


IDLE_FLUSH_S = 0.05  # unpins no step has sent by then go on their own (an engine gone idle)


class StepPins:
    """The pins a scheduler takes for the loads it plans, kept off the engine's critical path.

    Counted per key across requests: a key several requests load is pinned once and unpinned when
    the last of them finishes. Nothing is waited for: the step's new pins go with its metadata
    (`flush` from build_connector_meta, ONE fire-and-forget message), and so do the unpins of the
    requests that finished since, before them, so a key unpinned and pinned again ends pinned.
    Unpins no step sends within IDLE_FLUSH_S (the engine went idle) are sent by a small thread,
    started on first need; a pin whose message is lost (daemon restarted) runs out by itself."""

    def __init__(self, client: LazyClient, pin_s: float) -> None:
        self.client = client
        self.pin_s = pin_s
        self._held: dict[str, set[str]] = {}  # owner (request id) -> keys it holds pinned
        self._refs: dict[str, int] = {}  # key -> owners holding it
        self._to_pin: set[str] = set()
        self._to_unpin: set[str] = set()
        self._lock = threading.Lock()  # the scheduler's thread and the idle flusher
        self._wake = threading.Event()
        self._flusher: threading.Thread | None = None
        self._closed = False
        self._pinned_with = 0  # LazyClient.clients_made when the pins were last sent

    def hold(self, owner: str, keys) -> None:
        """`owner` loads `keys`: keep them pinned until release(owner)."""
        with self._lock:
            held = self._held.setdefault(owner, set())
            refs = self._refs
            for k in keys:
                if k in held:
                    continue
                held.add(k)
                refs[k] = refs.get(k, 0) + 1
                if refs[k] == 1:
                    self._to_unpin.discard(k)
                    self._to_pin.add(k)

    def release(self, owner: str) -> None:
        """`owner` finished: its keys no other owner holds are unpinned (or never pinned, when
        their pin was not sent yet)."""
        with self._lock:
            refs = self._refs
            for k in self._held.pop(owner, ()):
                refs[k] -= 1
                if refs[k] > 0:
                    continue
                del refs[k]
                if k in self._to_pin:
                    self._to_pin.discard(k)  # finished before its pin was sent
                else:
                    self._to_unpin.add(k)
            if not self._to_unpin or self._closed:
                return
            if self._flusher is None:
                self._flusher = threading.Thread(target=self._flush_when_idle, name="ecd-unpin", daemon=True)
                self._flusher.start()
        self._wake.set()

    def holds(self, owner: str) -> frozenset[str]:
        """The keys `owner` holds pinned (sent or about to be)."""
        with self._lock:
            return frozenset(self._held.get(owner, ()))

    def flush(self) -> None:
        """Send what is queued: the unpins, then the pins (one message each, not waited for)."""
        with self._lock:  # held while sending: a flush from the other thread cannot reorder them
            unpin, self._to_unpin = list(self._to_unpin), set()
            pin, self._to_pin = list(self._to_pin), set()
            if self.client.clients_made != self._pinned_with:
                # The daemon restarted (a new Client since the last flush): its pool was adopted,
                # but the pins went with the old run's session. Every key still held, pinned again.
                self._pinned_with = self.client.clients_made
                pin = list(set(pin) | set(self._refs))
            if unpin:
                self.client.call("unpin", lambda c: c.send_unpin(unpin))
            if pin:
                self.client.call("pin", lambda c: c.send_pin(pin, self.pin_s))

    def _flush_when_idle(self) -> None:
        while True:
            self._wake.wait()
            if self._closed:
                return
            time.sleep(IDLE_FLUSH_S)  # a step usually sends them first
            self._wake.clear()
            self.flush()
            if self._closed:
                return

    def close(self) -> None:
        """Send what is queued and stop the idle flusher (the connector shuts down)."""
        self.flush()
        self._closed = True
        self._wake.set()


def skipping_corrupt(keys: list[str], read: Callable[[list[int]], T]) -> tuple[T, list[int]]:
    """A verified read of `keys` in which an entry that fails verification is a miss of that
    entry alone, as if it had been evicted, not a failure of the whole batch: `read(picked)` reads
    keys[i] for the indices `picked`; when it raises IntegrityError naming one of them (a verifying
    get_many/view_many raises for the first corrupt entry, before any byte is handed out), that
    index is dropped and the rest read again. Returns read's result and the dropped indices.
    Other errors, and an IntegrityError naming no key of the batch (a truncated pool), propagate."""
    picked = list(range(len(keys)))
    corrupt: list[int] = []
    while True:
        try:
            return read(picked), corrupt
        except IntegrityError as exc:
            at = next((n for n, i in enumerate(picked) if keys[i] == exc.key), None)
            if at is None:
                raise
            corrupt.append(picked.pop(at))
