"""The daemon: start-up checks -> pools, ring, ROUTER socket -> serve -> shutdown.

One asyncio loop (uvloop) owns everything. The ROUTER socket is a plain non-blocking zmq socket
whose FD the loop watches: libzmq's FD is edge-triggered, so every wake-up drains the socket
until EAGAIN and any send made outside that drain (timers, client exits) schedules another
drain. Replies are sent with NOBLOCK: a client that stopped reading loses its replies, the
daemon never waits for it.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
import time
from contextlib import suppress
from typing import Any

import msgspec
import zmq

from .. import __version__
from ..config import Config
from ..errors import Code, ConfigError
from ..integrity import checksum as checksum_of, describe
from ..memory.host import RING_FILE_MODE, HostPool, NodeLock, ShmError, ShmFile, remove_stale, ring_name
from ..memory.ring import RingWriter, ring_bytes
from ..protocol import (PROTOCOL_VERSION, Abort, Acked, Acquire, Acquired, Alloc, Allocated, AllocItem, ArenaInfo,
                        Bye, Commit, Committed, DaemonStats, Delete, Error, Evict, Evicted, Exists, Failure,
                        Flags, Held, Hello, KeyInfo, KeyList, Keys, Limits, Ping, PoolInfo, Pong, Publish,
                        PutInline, Release, Report, RingInfo, Stats, StatsReply, Unpin, Welcome, encoder,
                        request_decoder, salvage_request_id)
from .connections import SNDHWM, Connection, Connections, connection_budget, raise_fd_limit
from .metrics import MetricsServer, RequestStats, bind_listener, make_registry
from .security import CurveAuth, check_security
from .entries import RequestError, Session, State, StoreLimits
from .sessions import Sessions
from .store import Store
from .systemd import Notifier

log = logging.getLogger("ecd.daemon")

HEARTBEAT_INTERVAL_S = 0.1  # ring heartbeat; clients distrust a ring silent for 1 s
EXPIRY_INTERVAL_S = 0.25  # write-TTL and pin sweep
DRAIN_BATCH = 512  # messages handled per wake-up before yielding to timers
STATUS_INTERVAL_S = 5.0  # sd_notify STATUS= refresh
DRAIN_POLL_S = 0.05  # how often a draining daemon checks whether anything is left in flight
SESSION_SWEEP_S = 0.25  # how often sessions that must heartbeat are checked for silence
# zmq's constants are enums: `&` on them runs Python enum code, a microsecond a message here
ZMQ_EVENTS, POLLIN, RCVMORE, SRCFD, NOBLOCK = (int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.RCVMORE),
                                                int(zmq.SRCFD), int(zmq.NOBLOCK))
LISTING_REPLY_BYTES = 1 << 20  # a Keys page is cut at about this many bytes
KEY_INFO_OVERHEAD = 64  # msgpack bytes of one KeyInfo beside its strings and shape (an upper bound)


def request_hwm(limits) -> int:
    """ZMQ_RCVHWM: requests of one peer libzmq may hold before the daemon reads them, so that
    they (each at most max_message_bytes) stay within client_queue_bytes; at least 2."""
    return max(2, min(1000, int(limits.client_queue_bytes) // int(limits.max_message_bytes)))


class StartupError(Exception):
    """The daemon cannot start; the message is the one line `ecd serve` prints."""


class Daemon:
    def __init__(self, config: Config, config_path: str | None = None, cuda_driver: Any = None) -> None:
        self.config = config
        # `[pool.cuda]`: the driver (ecd.memory.cuda.load_driver() unless a test passes a fake),
        # the configured devices' ordinals, and the arenas allocated on them (the handle registry).
        self.cuda_driver = cuda_driver
        self._cuda_ordinals: list[int] = []
        self.arenas: Any = None  # ecd.memory.cuda.CudaArenas
        self.config_path = config_path  # re-read on SIGHUP
        self.node = config.node.name
        self.epoch = time.time_ns()
        self.started = time.monotonic()
        self.start_wall_time = time.time()
        self.state = "starting"  # -> serving -> draining (what /healthz reports)
        self.requests = RequestStats()
        self.ring_overruns = 0  # reported by clients
        # reads that did not match their stored checksum (reported by clients), and inline puts
        # whose data did not match the checksum sent with it (seen here)
        self.integrity_failures = {"read": 0, "inline_put": 0}
        self.notifier = Notifier()
        self.metrics_listener: socket.socket | None = None
        self.metrics_server: MetricsServer | None = None
        self._signals_seen = 0
        self.endpoint = config.control.endpoint
        self._lock = NodeLock(self.node)
        self.pool: HostPool | None = None
        self.ring_file: ShmFile | None = None
        self.ring: RingWriter | None = None
        self.store: Store | None = None
        self.ctx: zmq.Context | None = None
        self.sock: zmq.Socket | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.connections: Connections | None = None  # every control connection (_bind)
        self.sessions: Sessions | None = None  # every client session (serve)
        self.fd_limit = 0  # RLIMIT_NOFILE after raising it (prepare)
        self.max_connections = 0  # limits.max_connections, or fewer if fd_limit cannot hold them
        self.gid = -1  # node.group, resolved in prepare()
        self.curve: CurveAuth | None = None
        self._decoder = request_decoder()
        self._drain_scheduled = False
        self._draining = False
        self._stopping: asyncio.Event | None = None
        self._force_stop = asyncio.Event()
        self.errors: dict[str, int] = {}
        self.dropped: dict[str, int] = {}  # requests and replies nobody could be told about, by reason

    # ---- start-up -----------------------------------------------------------------------

    def prepare(self) -> None:
        """Everything that can fail at start, in an order that leaves nothing behind on failure."""
        try:
            self.gid, self.curve = check_security(self.config)
        except ConfigError as exc:
            raise StartupError(str(exc)) from None
        if self.config.pool.cuda is not None:
            self._open_cuda()  # before anything is created: a node without CUDA leaves nothing behind
        self._lock.group = self.gid
        self._plan_file_descriptors()
        self._prepare_runtime_dir()
        try:
            self._lock.acquire()
        except ShmError as exc:
            raise StartupError(f"node.name: {exc}") from None
        try:
            self._check_endpoint_free()
            stale = remove_stale(self.node)
            if stale:
                log.info("removed %d stale shm file(s) of a previous run: %s", len(stale), ", ".join(stale))
            self._create_memory()
            self._create_arenas()
            self._bind()
            self._bind_metrics()
        except BaseException:
            self.close()
            raise

    def _plan_file_descriptors(self) -> None:
        """libzmq aborts the process when accept() fails with EMFILE: raise the soft limit to the
        hard one and cap connections so that they, their pidfds and the HTTP connections never
        reach it."""
        self.fd_limit = raise_fd_limit()
        wanted = self.config.limits.max_connections
        http = self.config.metrics.max_connections if self.config.metrics.address is not None else 0
        self.max_connections = connection_budget(self.fd_limit, wanted, http)
        if self.max_connections < wanted:
            log.warning("limits.max_connections=%d lowered to %d: the open-file limit is %d (raise "
                        "LimitNOFILE= or ulimit -n)", wanted, self.max_connections, self.fd_limit)

    def apply_connection_limits(self) -> None:
        """[limits] max_connections and client_queue_bytes, at start and on SIGHUP (ZMQ_RCVHWM,
        derived from them, applies to connections made after it is set)."""
        self._plan_file_descriptors()
        limits = self.config.limits
        self.connections.max_connections = self.max_connections
        self.connections.queue_bytes = int(limits.client_queue_bytes)
        self.sock.setsockopt(zmq.RCVHWM, request_hwm(limits))

    def _prepare_runtime_dir(self) -> None:
        path = self.config.node.runtime_dir
        try:
            if not os.path.isdir(path):
                os.makedirs(path, exist_ok=True)
                os.chown(path, -1, self.gid)  # node.group: engines join it
                os.chmod(path, 0o770)  # owner and group only
            elif os.stat(path).st_mode & 0o007:
                log.warning("node.runtime_dir: %s is accessible to all users; the control socket "
                            "in it is not (0660, group %s)", path, self.gid)
            probe = os.path.join(path, f".ecd-write-test-{os.getpid()}")
            with open(probe, "w"):
                pass
            os.unlink(probe)
        except OSError as exc:
            raise StartupError(f"node.runtime_dir: {path} is not writable ({exc.strerror})") from None

    def _ipc_path(self) -> str | None:
        return self.endpoint[len("ipc://"):] if self.endpoint.startswith("ipc://") else None

    def _check_endpoint_free(self) -> None:
        path = self._ipc_path()
        if path is None:
            return  # tcp: bind() itself reports EADDRINUSE
        if not os.path.isdir(os.path.dirname(path) or "."):
            raise StartupError(f"control.endpoint: directory of {path} does not exist")
        if not os.path.exists(path):
            return
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(1.0)
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(path)  # a socket file left by a daemon that died
            return
        except OSError as exc:
            raise StartupError(f"control.endpoint: cannot probe {path} ({exc.strerror})") from None
        finally:
            probe.close()
        raise StartupError(f"control.endpoint: {self.endpoint} is already in use by another process")

    def _create_memory(self) -> None:
        host = self.config.pool.host
        ring_cfg = self.config.ring
        try:
            self.pool = HostPool(self.node, int(host.size), int(host.segment_size), self.gid)
            # 0640: clients map the ring read-only, so no engine in the group can write into it
            self.ring_file = ShmFile.create(ring_name(self.node), ring_bytes(ring_cfg.slots, ring_cfg.presence_buckets),
                                            self.gid, mode=RING_FILE_MODE)
        except ShmError as exc:
            raise StartupError(f"pool.host.size: {exc}") from None
        self.ring = RingWriter(self.ring_file.buf, ring_cfg.slots, ring_cfg.presence_buckets, self.epoch)
        self.store_limits = self.build_store_limits()

    def _open_cuda(self) -> None:
        """Load the CUDA driver and map `[pool.cuda] devices` to this process's ordinals."""
        from ..memory.cuda import CudaError, CudaUnavailable, DeviceNotFound, load_driver, resolve_devices
        try:
            if self.cuda_driver is None:
                self.cuda_driver = load_driver()
            self._cuda_ordinals = resolve_devices(self.cuda_driver, self.config.pool.cuda.devices)
        except CudaUnavailable as exc:
            raise StartupError(f"pool.cuda: CUDA is not available on this node: {exc}") from None
        except DeviceNotFound as exc:
            raise StartupError(f"pool.cuda.devices: {exc}") from None
        except CudaError as exc:
            raise StartupError(f"pool.cuda: {exc}") from None

    def _create_arenas(self) -> None:
        """One arena of `[pool.cuda] size` per device, exported once as a CUDA IPC handle."""
        if self.config.pool.cuda is None:
            return
        from ..memory.cuda import CudaArenas, CudaError
        size = int(self.config.pool.cuda.size)
        try:
            self.arenas = CudaArenas(self.cuda_driver, self._cuda_ordinals, size)
        except CudaError as exc:
            raise StartupError(f"pool.cuda.size: cannot allocate and export {size} bytes on each of "
                               f"devices {self._cuda_ordinals}: {exc}") from None
        for arena in self.arenas:
            log.info("CUDA arena on device %d (%s): %d bytes", arena.ordinal, arena.uuid, arena.size)

    def arena_infos(self) -> list[ArenaInfo]:
        """Welcome.arenas: pool indices follow the host segments."""
        if self.arenas is None:
            return []
        first = len(self.pool.segments)
        return [ArenaInfo(first + i, a.uuid, a.size, a.handle) for i, a in enumerate(self.arenas)]

    def pool_labels(self) -> list[str]:
        """The `pool` label of each pool's metrics: host<n> for segments, cuda<ordinal> for arenas."""
        labels = [f"host{i}" for i in range(len(self.pool.segments) if self.pool is not None else 0)]
        if self.arenas is not None:
            labels += [a.label for a in self.arenas]
        return labels

    def build_store_limits(self) -> StoreLimits:
        leases, limits = self.config.leases, self.config.limits
        return StoreLimits(
            max_key_bytes=limits.max_key_bytes, max_batch=limits.max_batch, max_ndim=limits.max_ndim,
            max_waiters_per_client=limits.max_waiters_per_client,
            max_leases_per_client=limits.max_leases_per_client,
            max_pins_per_client=limits.max_pins_per_client, write_ttl=float(leases.write_ttl),
            max_pin=float(leases.max_pin), max_wait=float(leases.max_wait))

    def _bind(self) -> None:
        self.ctx = zmq.Context(io_threads=1)
        if self.curve is not None:
            self.curve.start(self.ctx)  # the ZAP handler, on its own thread
        sock = self.ctx.socket(zmq.ROUTER)
        if self.curve is not None:
            self.curve.apply(sock)
        limits = self.config.limits
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, int(limits.max_message_bytes))
        # What one peer can make the daemon hold, both ways (see connections.py): replies by
        # count here and by bytes in Connections.send; requests by count times their largest size.
        # ROUTER_MANDATORY turns a full pipe into EAGAIN instead of a silent drop.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.copy_threshold = 0  # a reply sent copy=False is really zero-copy: its tracker means something
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.RCVHWM, request_hwm(limits))
        self.connections = Connections(sock, self.max_connections, int(limits.client_queue_bytes),
                                       self._on_connection_gone)
        old_umask = os.umask(0o007)  # the ipc socket file: owner and group only, from birth
        try:
            sock.bind(self.endpoint)
        except zmq.ZMQError as exc:
            self.connections.close_monitor()
            sock.close(0)
            reason = "address already in use" if exc.errno == errno.EADDRINUSE else str(exc)
            raise StartupError(f"control.endpoint: cannot bind {self.endpoint}: {reason}") from None
        finally:
            os.umask(old_umask)
        path = self._ipc_path()
        if path is not None:
            os.chown(path, -1, self.gid)
            os.chmod(path, 0o660)
        else:  # tcp: port 0 picks a free port; log the one bound
            self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.sock = sock

    def _bind_metrics(self) -> None:
        address = self.config.metrics.address
        if address is None:
            return
        try:
            self.metrics_listener = bind_listener(*address)
        except OSError as exc:
            raise StartupError(f"metrics.listen: cannot bind {self.config.metrics.listen}: "
                               f"{exc.strerror or exc}") from None

    # ---- serving ------------------------------------------------------------------------

    def run(self) -> None:
        import uvloop
        uvloop.run(self.serve())

    async def serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        self.store = Store([seg.size for seg in self.pool.segments], self.ring, self.loop,
                           self.store_limits, namespaces=self.config.namespaces,
                           arena_sizes=[a.size for a in self.arenas] if self.arenas is not None else [])
        self.sessions = Sessions(self.store, self.loop, self.connections, self.endpoint.startswith("ipc://"),
                                 lambda: self.config.limits, self._schedule_drain)
        if self.metrics_listener is not None:
            self.metrics_server = MetricsServer(self.metrics_listener, make_registry(self), lambda: self.state,
                                                max_connections=self.config.metrics.max_connections)
            await self.metrics_server.start()
            log.info("metrics on http://%s:%d/metrics", *self.metrics_listener.getsockname()[:2])
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.loop.add_signal_handler(sig, self._on_stop_signal, sig)
        self.loop.add_signal_handler(signal.SIGHUP, self._on_reload_signal)
        self.loop.add_reader(self.sock.getsockopt(zmq.FD), self._drain)
        self.loop.add_reader(self.connections.monitor_fd(), self._drain)
        tasks = [self.loop.create_task(self._every(HEARTBEAT_INTERVAL_S, self.ring.heartbeat)),
                 self.loop.create_task(self._every(EXPIRY_INTERVAL_S, self.store.expire)),
                 self.loop.create_task(self._every(STATUS_INTERVAL_S, self._report_status)),
                 self.loop.create_task(self._every(SESSION_SWEEP_S, self._sweep_sessions))]
        if self.notifier.watchdog_interval:
            # From the loop itself: a wedged loop stops the pings and systemd restarts the daemon.
            tasks.append(self.loop.create_task(self._every(self.notifier.watchdog_interval,
                                                           self.notifier.watchdog)))
        self.state = "serving"
        log.info("serving node %s on %s: host pool %d bytes in %d segment(s), %d CUDA arena(s), epoch %d",
                 self.node, self.endpoint, sum(s.size for s in self.pool.segments), len(self.pool.segments),
                 len(self.arenas) if self.arenas is not None else 0, self.epoch)
        self.notifier.ready(self.status_line())
        self._drain()  # messages that arrived before the reader was registered
        try:
            await self._stopping.wait()
            await self._drain_gracefully()
        finally:
            for task in tasks:
                task.cancel()
            if self.metrics_server is not None:
                await self.metrics_server.stop()
            self._shutdown()

    async def _every(self, interval: float, tick) -> None:
        while True:
            await asyncio.sleep(interval)
            tick()
            self._schedule_drain()

    def status_line(self) -> str:
        s = self.stats()
        return (f"{s.entries_ready} entries, {s.used_bytes >> 20}/{s.capacity_bytes >> 20} MiB used, "
                f"{s.clients} clients, {s.hits} hits / {s.misses} misses")

    def _report_status(self) -> None:
        self.notifier.status(self.status_line())

    def _on_stop_signal(self, sig: int) -> None:
        self._signals_seen += 1
        name = signal.Signals(sig).name
        if self._signals_seen == 1:
            grace = float(self.config.node.shutdown_grace)
            log.info("received %s: draining (new writes refused, up to %gs for puts in progress and "
                     "parked gets; signal again to stop now)", name, grace)
            self.state = "draining"
            self.notifier.stopping("draining")
            self._stopping.set()
        else:
            log.warning("received %s again: stopping now", name)
            self._force_stop.set()

    async def _drain_gracefully(self) -> None:
        """Until the grace period ends, a second signal arrives, or nothing is left in flight:
        commits of puts in progress and parked gets are still served, new writes are not."""
        deadline = self.loop.time() + float(self.config.node.shutdown_grace)
        while self.loop.time() < deadline and not self._force_stop.is_set():
            # cheap checks (no full stats): this runs every DRAIN_POLL_S
            if not self.store.writes_in_progress() and not self.store.waiters:
                return
            with suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._force_stop.wait(), DRAIN_POLL_S)
        log.info("shutdown grace over: abandoning writes in progress and parked requests")

    def _on_reload_signal(self) -> None:
        from .reload import reload_config
        reload_config(self)

    def _schedule_drain(self) -> None:
        if not self._drain_scheduled:
            self._drain_scheduled = True
            self.loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._drain_scheduled = False
        sock = self.sock
        if sock is None:
            return
        self._draining = True
        connections = self.connections
        monitor_events = connections.monitor.getsockopt
        events = sock.getsockopt
        try:
            for _ in range(DRAIN_BATCH):
                # Connection events first, before every message: a connection's end must be known
                # before a message of one that reuses its fd or routing id is handled.
                if monitor_events(ZMQ_EVENTS) & POLLIN:
                    connections.handle_events()
                # Asking ZMQ_EVENTS (not receiving until zmq.Again, which costs an exception) is
                # also what re-arms the edge-triggered FD after the sends made while handling.
                if not events(ZMQ_EVENTS) & POLLIN:
                    if connections.closing:  # every message they sent has been handled
                        connections.settle()
                    return
                conn, frames = self._recv_request(sock)
                try:
                    self._handle(conn, frames)
                except Exception:  # never let one message stop the drain (and stall the socket)
                    log.exception("unhandled error on a request")
                    self._count_error("unhandled")
            self._schedule_drain()  # more may be queued: let timers run first
        finally:
            self._draining = False

    def _recv_request(self, sock: zmq.Socket) -> tuple[Connection, list[bytes]]:
        """(the connection it came on, [identity, payload, *extra]); like recv_multipart but with
        one RCVMORE check fewer for the usual two-frame message (the daemon's per-request CPU is
        what bounds ops/s)."""
        # A ROUTER message always carries the identity and at least one (maybe empty) frame, and
        # multipart messages arrive whole, so the second recv cannot block or fail.
        identity = sock.recv(NOBLOCK, copy=False)  # a Frame: it knows the fd it came on
        frames = [identity.bytes, sock.recv(NOBLOCK)]
        while sock.getsockopt(RCVMORE):
            frames.append(sock.recv(NOBLOCK))
        return self.connections.of(frames[0], identity.get(SRCFD)), frames

    def _send(self, identity: bytes, reply: Any) -> None:
        failure = self.connections.send(identity, encoder.encode(reply))
        if failure is not None:  # peer gone or not reading; never block on it
            self._count_error("send_dropped")
            self._count_drop(failure)
        if not self._draining:  # a send from a timer or a client exit: re-check the edge
            self._schedule_drain()

    def _count_error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1

    def _count_drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def _refuse(self, identity: bytes, request: Any, code: Code, message: str) -> str:
        """Error for a decoded request; one with id 0 (fire-and-forget) is never answered: an
        Error(0) would be taken by that client as the reply to whatever it asks next. A Report is
        fire-and-forget whatever its id."""
        if request.id == 0 or isinstance(request, Report):
            outcome = code.name.lower()
            self._count_error(outcome)
            self._count_drop("refused")
            return outcome
        return self._reply_error(identity, request.id, code, message)

    def _reply_error(self, identity: bytes, request_id: int, code: Code, message: str) -> str:
        """Send a typed error; returns the outcome label metrics record for the request."""
        outcome = code.name.lower()
        self._count_error(outcome)
        self._send(identity, Error(request_id, int(code), message))
        return outcome

    # ---- dispatch -----------------------------------------------------------------------

    def _handle(self, conn: Connection, frames: list[bytes]) -> None:
        started = time.perf_counter()
        op, outcome = "malformed", "internal"
        try:
            op, outcome = self._handle_request(conn, frames)
        finally:
            self.requests.observe(op, outcome, time.perf_counter() - started)

    def _handle_request(self, conn: Connection, frames: list[bytes]) -> tuple[str, str]:
        """Decode, check, dispatch and answer one request; returns (op, outcome) for metrics."""
        identity = frames[0]
        if len(frames) != 2:
            return "malformed", self._reply_error(identity, 0, Code.PROTOCOL,
                                                  f"expected one frame per request, got {len(frames) - 1}")
        payload = frames[1]
        try:
            request = self._decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return "malformed", self._reply_error(identity, salvage_request_id(payload), Code.PROTOCOL,
                                                  f"malformed request: {exc}")
        except Exception as exc:  # e.g. RecursionError, UnicodeDecodeError from hostile bytes
            return "malformed", self._reply_error(identity, 0, Code.PROTOCOL,
                                                  f"malformed request: {type(exc).__name__}: {exc}")
        op = request.__struct_config__.tag
        session = conn.session
        try:
            if isinstance(request, Hello):
                return op, self._on_hello(identity, conn, request)
            if isinstance(request, Bye):
                if session is not None:
                    self.sessions.end(session)
                else:
                    self._count_drop("refused")
                return op, "ok"
            if session is None:
                return op, self._refuse(identity, request, Code.NOT_REGISTERED,
                                        "unknown client: say Hello first (the daemon may have restarted)")
            if not session.watched:
                session.last_seen = time.monotonic()
            if self.state == "draining" and isinstance(request, (Alloc, PutInline, Publish)):
                return op, self._refuse(identity, request, Code.SHUTTING_DOWN,
                                        "daemon is shutting down: no new writes")
            refused = self.store.quota_refused
            reply = self._dispatch(identity, session, request)
            if reply is not None:
                if request.id != 0:
                    self._send(identity, reply)
                elif not isinstance(request, (Release, Ping)):  # Ping(0) is a session's heartbeat
                    self._count_drop("unanswerable")  # a request that wants a reply, sent with id 0
            # an item refused for its namespace's quota labels the whole request (metrics)
            return op, "ok" if self.store.quota_refused == refused else "quota_exceeded"
        except RequestError as exc:
            return op, self._refuse(identity, request, exc.code, str(exc))
        except Exception as exc:  # a bug must cost one request, never the daemon
            log.exception("internal error handling %s", op)
            return op, self._refuse(identity, request, Code.INTERNAL, f"internal error: {exc!r}")

    def _dispatch(self, identity: bytes, session: Session, request: Any) -> Any:
        store = self.store
        match request:
            case Exists(id=rid, ns=ns, keys=keys, pin_s=pin_s):
                return Flags(rid, store.exists(session, ns, keys, pin_s))
            case Acquire(id=rid, ns=ns, keys=keys, wait_s=wait_s):
                def on_done(results, rid=rid):
                    self._send(identity, Acquired(rid, results))
                results = store.acquire(session, ns, keys, wait_s, on_done)
                return None if results is None else Acquired(rid, results)
            case Release(id=rid, generations=generations):
                store.check_batch(len(generations))
                results = [store.release(session, g) for g in generations]
                if rid == 0 and any(results):
                    self._count_error("release_refused")
                    self._count_drop("refused")
                return Acked(rid, results)
            case Alloc(id=rid, ns=ns, items=items, arena=arena):
                store.check_batch(len(items))
                pools = store.tier(arena)
                return Allocated(rid, [store.alloc(session, ns, item, pools) for item in items])
            case Commit(id=rid, generations=generations, reserve=reserve, checksums=checksums):
                store.check_batch(len(generations))
                if checksums and len(checksums) != len(generations):
                    raise RequestError(Code.INVALID, f"{len(checksums)} checksums for "
                                                     f"{len(generations)} generations")
                checksums = checksums or [0] * len(generations)
                # the reservation goes in the tier of the first committed item (host if none)
                tier = store.tier_of(generations[0]) if reserve and generations else None
                results = [store.commit(session, g, c) for g, c in zip(generations, checksums)]
                return Committed(rid, results, store.reserve(session, reserve, tier) if reserve else None)
            case Publish(id=rid, ns=ns, generation=generation, item=item, reserve=reserve,
                         checksum=checksum):
                tier = store.tier_of(generation) if reserve else None  # the reservation's own tier
                result = store.publish(session, ns, generation, item, checksum)
                return Committed(rid, [result], store.reserve(session, reserve, tier) if reserve else None)
            case Abort(id=rid, generations=generations):
                store.check_batch(len(generations))
                return Acked(rid, [store.abort(session, g) for g in generations])
            case PutInline():
                return Acked(request.id, [self._put_inline(session, request)])
            case Unpin(id=rid, ns=ns, keys=keys):
                return Flags(rid, store.unpin(session, ns, keys))
            case Delete(id=rid, ns=ns, keys=keys):
                return Flags(rid, store.delete(ns, keys))
            case Ping(id=rid):
                return Pong(rid, self.epoch)
            case Stats(id=rid):
                return StatsReply(rid, self.stats())
            case Keys(id=rid, ns=ns, limit=limit, after=after):
                return self._list_keys(rid, ns, limit, after)
            case Evict(id=rid, ns=ns, keys=keys, whole_namespace=whole, everything=everything, force=force):
                evicted, refused, missing, draining = store.evict(ns, keys, whole, everything, force)
                return Evicted(rid, evicted, refused, missing, draining)
            case Held(id=rid, generations=generations):
                return Flags(rid, store.held(generations))
            case Report(ring_overruns=overruns, integrity_failures=corrupt):
                self.ring_overruns += overruns
                if corrupt:
                    self.integrity_failures["read"] += corrupt
                    log.warning("client pid %d (session %d) read %d entr%s whose bytes do not match "
                                "their stored checksum", session.pid, session.id, corrupt,
                                "y" if corrupt == 1 else "ies")
                return None
        raise RequestError(Code.PROTOCOL, f"unexpected request {type(request).__name__}")

    def _list_keys(self, rid: int, ns: str, limit: int, after: tuple[str, str] | None) -> KeyList:
        """One page of `ecd keys`, at most LISTING_REPLY_BYTES encoded: a listing of a big index
        must not become one huge reply queued to a client that may never read it."""
        total, entries = self.store.list_keys(ns, limit + 1, after)  # one more tells if more follow
        now = time.monotonic()
        page, size = [], 0
        for e in entries[:limit]:
            size += KEY_INFO_OVERHEAD + len(e.ns.encode()) + len(e.key.encode()) + len(e.dtype) + 9 * len(e.shape)
            if page and size > LISTING_REPLY_BYTES:
                break
            page.append(KeyInfo(e.ns, e.key, e.generation, e.nbytes, e.dtype, e.shape, now - e.published_at,
                                now - e.last_access, e.readers, e.pins))
        return KeyList(rid, total, page, more=len(entries) > len(page))

    def _put_inline(self, session: Session, request: PutInline) -> Failure | None:
        limit = int(self.config.limits.inline_max_bytes)
        if len(request.data) > limit:
            return Failure(Code.LIMIT, f"inline payload of {len(request.data)} bytes exceeds "
                                       f"limits.inline_max_bytes={limit}")
        if request.checksum:
            actual = checksum_of(request.data)
            if actual != request.checksum:
                self.integrity_failures["inline_put"] += 1
                return Failure(Code.CORRUPT, f"inline put of {request.key!r}: data checksum {describe(actual)} "
                                             f"does not match the {describe(request.checksum)} sent with it")
        item = AllocItem(request.key, request.dtype, request.shape, len(request.data))
        placed = self.store.alloc(session, request.ns, item)
        if isinstance(placed, Failure):
            return placed
        # Small enough that copying in the daemon costs less than the round trip it saves.
        segment = self.pool.segments[placed.pool].buf
        segment[placed.offset:placed.offset + len(request.data)] = request.data
        return self.store.commit(session, placed.generation, request.checksum)

    # ---- sessions -----------------------------------------------------------------------

    def _on_hello(self, identity: bytes, conn: Connection, hello: Hello) -> str:
        if hello.version != PROTOCOL_VERSION:
            return self._reply_error(identity, hello.id, Code.VERSION, f"protocol version {hello.version} "
                                     f"not supported; daemon speaks {PROTOCOL_VERSION}")
        session = self.sessions.open(conn, hello.pid)  # RequestError(LIMIT) in Welcome's place
        limits, cfg = self.config.limits, self.config
        heartbeat_s = 0.0 if session.watched else float(cfg.leases.session_ttl) / 3
        self._send(identity, Welcome(
            hello.id, PROTOCOL_VERSION, session.id, self.epoch, self.node,
            [PoolInfo(i, seg.name, seg.size) for i, seg in enumerate(self.pool.segments)],
            RingInfo(self.ring_file.name, self.ring_file.size, cfg.ring.slots, cfg.ring.presence_buckets),
            Limits(limits.max_key_bytes, limits.max_batch, int(limits.max_message_bytes),
                   int(limits.inline_max_bytes), limits.max_ndim, float(cfg.leases.max_wait),
                   float(cfg.leases.max_pin), float(cfg.leases.write_ttl)), heartbeat_s,
            sorted(self.store.verify_namespaces), self.arena_infos()))
        return "ok"

    def _on_connection_gone(self, conn: Connection, reason: str) -> None:
        if self.sessions is not None:
            self.sessions.on_connection_gone(conn, reason)

    def _sweep_sessions(self) -> None:
        self.connections.sweep()
        self.sessions.reap_silent(float(self.config.leases.session_ttl))

    # ---- stats and shutdown -------------------------------------------------------------

    def stats(self) -> DaemonStats:
        store = self.store
        states = store.count_states()
        leases, pins, waiters = store.lease_totals()
        reservations, reserved_bytes = store.reservation_totals()
        pools = [(a.capacity, a.used) for a in store.allocators]
        c = store.counters
        return DaemonStats(
            node=self.node, epoch=self.epoch, version=__version__,
            uptime_s=time.monotonic() - self.started,
            capacity_bytes=sum(p[0] for p in pools), used_bytes=sum(p[1] for p in pools), pools=pools,
            entries_ready=states[State.READY], entries_writing=store.writes_in_progress(),
            reservations=reservations, reserved_bytes=reserved_bytes,
            entries_retired=states[State.RETIRED], clients=store.sessions, read_leases=leases,
            pins=pins, waiters=waiters, hits=c["hits"], misses=c["misses"], evictions=c["evictions"],
            reclaimed_sessions=c["reclaimed_sessions"], expired_writes=c["expired_writes"],
            ring_events=self.ring.events_written, ops=self.requests.by_op(), errors=self._error_counts(),
            integrity_failures=sum(self.integrity_failures.values()))

    def _error_counts(self) -> dict[str, int]:
        errors = dict(self.errors)
        if self.curve is not None and self.curve.rejected:
            errors["auth_rejected"] = self.curve.rejected  # counted on the ZAP thread
        return errors

    def _shutdown(self) -> None:
        log.info("shutting down: unlinking shared memory and the control socket")
        if self.store is not None:
            self.store.fail_waiters(Code.SHUTTING_DOWN, "daemon is shutting down")
        if self.sessions is not None:
            self.sessions.close()
        if self.loop is not None and self.sock is not None:
            with suppress(Exception):
                self.loop.remove_reader(self.sock.getsockopt(zmq.FD))
                self.loop.remove_reader(self.connections.monitor_fd())
        self.close()

    def close(self) -> None:
        """Release everything prepare() created; safe to call more than once."""
        if self.sock is not None:
            self.connections.close_monitor()
            self.sock.close(linger=200)  # let the last replies (ShuttingDown to waiters) go out
            self.sock = None
            path = self._ipc_path()
            if path is not None:
                with suppress(FileNotFoundError):
                    os.unlink(path)
        if self.curve is not None:
            self.curve.stop()
        if self.ctx is not None:
            self.ctx.term()
            self.ctx = None
        if self.ring is not None:
            self.ring.close()
        if self.ring_file is not None:
            self.ring_file.unlink()
            self.ring_file = None
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self.arenas is not None:
            self.arenas.close()
            self.arenas = None
        self._lock.release()
