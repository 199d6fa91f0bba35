"""The daemon's lifecycle: start-up checks -> pools, ring, ROUTER socket -> serve -> drain ->
shutdown, and its signals (in the spirit of uvicorn's Server).

One asyncio loop (uvloop) owns everything. What happens to each message is elsewhere: the
control socket's loop (control/loop.py) and one handler per request type (control/handlers.py); who is on
the other end of each connection (control/connections.py) and each client session (control/sessions.py); the
registry (registry/store.py). Each part is handed what it reads of the daemon, never the daemon
itself: the handlers a control/context.HandlerContext, the peer plane a peer/context.PeerContext,
metrics an ops/context.MetricsSource and reload an ops/context.ReloadTarget (filled by wiring.py).
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
from typing import TYPE_CHECKING, Any, cast

import zmq

from ..config import Config
from ..errors import Code, ConfigError
from ..listeners import SocketFiles
from ..memory.host import HostPool, NodeLock, ShmError, ShmFile
from ..memory.memfd import MemfdFile
from ..memory.ring import RingWriter
from ..protocol import DaemonStats
from .control.connections import SNDHWM, Connection, Connections, connection_budget, raise_fd_limit
from .control.loop import ControlLoop
from .control.fd_server import FdServer
from .control.handlers import daemon_stats
from .ops.metrics import MetricsServer, ServeCounters, bind_listener, make_registry
from .ops.security import CurveAuth, check_security
from .control.sessions import Sessions
from .registry.store import Store
from .restart.memory import Memory, open_memory
from .tiers.base import LowerTier, NullTier
from .ops.systemd import Notifier
from .restart.adopt import submission_bytes
from .wiring import (arena_fds, handler_context, host_tier, metrics_source, peer_context, reload_target, slot_areas,
                     submission_areas)
from .writes.areas import SubmissionAreas

if TYPE_CHECKING:  # pragma: no cover
    from ..protocol import EventsStats
    from .events.service import Events
    from ..memory.cuda import CudaArenas
    from .control.context import HandlerContext
    from .peer.cluster import Cluster

log = logging.getLogger("ecd.daemon")

HEARTBEAT_INTERVAL_S = 0.1  # ring heartbeat; clients distrust a ring silent for 1 s
EXPIRY_INTERVAL_S = 0.25  # write-TTL and pin sweep
STATUS_INTERVAL_S = 5.0  # sd_notify STATUS= refresh
DRAIN_POLL_S = 0.05  # how often a draining daemon checks whether anything is left in flight
POOL_CHECK_INTERVAL_S = 0.25  # how often the pool files' sizes are checked (tiers/host.py)
SESSION_SWEEP_S = 0.25  # how often sessions that must heartbeat are checked for silence


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
        self.arenas: CudaArenas | None = None
        self.config_path = config_path  # re-read on SIGHUP
        self.node = config.node.name
        self.epoch = time.time_ns()
        self.started = time.monotonic()
        self.start_wall_time = time.time()
        self.state = "starting"  # -> serving -> draining (what /healthz reports)
        self.counters = ServeCounters()  # requests, errors, drops, client reports
        self.notifier = Notifier()
        self.metrics_listener: socket.socket | None = None
        self.metrics_server: MetricsServer | None = None
        self._signals_seen = 0
        self.endpoint = config.control.endpoint
        self._lock = NodeLock(self.node)
        self.pool: HostPool | None = None  # a MemfdPool with backing = "memfd"
        self.fd_server: FdServer | None = None  # backing = "memfd": hands the pool to clients
        self.fd_socket_name = ""  # Welcome.fd_socket
        self.ring_file: ShmFile | None = None
        # the pool, its journal and keeper ([restart]) and the ring: restart/memory.py
        self.memory: Memory | None = None
        self.ring: RingWriter | None = None
        self.store: Store | None = None
        self.submissions: SubmissionAreas | None = None  # puts without a message (ecd/daemon/writes)
        self.ctx: zmq.Context | None = None
        self.sock: zmq.Socket | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.connections: Connections | None = None  # every control connection (_bind)
        self.sessions: Sessions | None = None  # every client session (serve)
        self.fd_limit = 0  # RLIMIT_NOFILE after raising it (prepare)
        self.max_connections = 0  # limits.max_connections, or fewer if fd_limit cannot hold them
        self.gid = -1  # node.group, resolved in prepare()
        self.curve: CurveAuth | None = None
        self.cluster: Cluster | None = None  # the peer plane, with [cluster] listen
        self.events: "Events | None" = None  # [events] publish: the KV events (daemon/events/)
        # the tier below the host pool: the disk tier (tiers/disk.DiskTier) with [pool.disk], else the null tier
        self.lower_tier: LowerTier = NullTier()
        self.control: ControlLoop | None = None  # the ROUTER loop and the request handlers (serve)
        self.handler_context: HandlerContext | None = None  # what the handlers read of the daemon (serve)
        self._stopping: asyncio.Event | None = None
        self._force_stop = asyncio.Event()

    # ---- start-up -----------------------------------------------------------------------

    def prepare(self) -> None:
        """Everything that can fail at start, in an order that leaves nothing behind on failure."""
        try:
            self.gid, self.curve = check_security(self.config)
            self.socket_files = SocketFiles(self.gid, *self.config.client_ids())  # allowed ids: ACL entries
        except ConfigError as exc:
            raise StartupError(str(exc)) from None
        self._preflight()
        if self.config.pool.cuda is not None:
            self._open_cuda()  # before anything is created: a node without CUDA leaves nothing behind
        self._lock.group = self.gid
        # libzmq aborts the process when accept() fails with EMFILE: raise the soft limit to the
        # hard one, and cap connections so that they, their pidfds and HTTP never reach it.
        self.fd_limit = raise_fd_limit()
        self.max_connections = self._connection_cap()
        self._prepare_runtime_dir()
        try:
            self._lock.acquire()
        except ShmError as exc:
            raise StartupError(f"node.name: {exc}") from None
        except OSError as exc:  # preflight saw the directory writable: it changed since
            raise StartupError(f"{os.path.dirname(self._lock.path)}: cannot create the node lock "
                               f"{self._lock.path} ({exc.strerror})") from None
        try:
            self._check_endpoint_free()
            self._open_disk()
            self._create_memory()
            self._create_arenas()
            self._bind()
            self._bind_fd_socket()
            self._bind_metrics()
            self._bind_cluster()
            self._bind_events()
            self.memory.hand_to_keeper(self.config.pool.host.backing)
        except BaseException:
            self.close()
            raise

    def _preflight(self) -> None:
        """`ecd doctor`'s checks but CUDA's (_open_cuda keeps its driver): warnings logged, errors refuse the
        start with doctor's line, before a pool over the cgroup's memory gets the daemon OOM-killed."""
        from ..cli.doctor import preflight
        findings = preflight(self.config, self.gid, cuda=False)
        for finding in findings:
            if finding.level == "warning":
                log.warning("%s", finding.line())
        errors = [f.line() for f in findings if f.level == "error"]
        if errors:
            raise StartupError("\n".join(errors))

    def _open_disk(self) -> None:
        """`[pool.disk]`: check the directory and re-index what a previous run left there."""
        if self.config.pool.disk is None:
            return
        from .tiers.disk import DiskTier
        disk = DiskTier(self.config.pool.disk, self.epoch)
        try:
            disk.open()
        except ConfigError as exc:
            raise StartupError(str(exc)) from None
        self.lower_tier = disk

    def _connection_cap(self) -> int:
        """limits.max_connections, or fewer when the open-file limit cannot hold them."""
        wanted = self.config.limits.max_connections
        http = self.config.metrics.max_connections if self.config.metrics.address is not None else 0
        cap = connection_budget(self.fd_limit, wanted, http)
        if cap < wanted:
            log.warning("limits.max_connections=%d lowered to %d: the open-file limit is %d (raise "
                        "LimitNOFILE= or ulimit -n)", wanted, cap, self.fd_limit)
        return cap

    def install_config(self, new: Config) -> None:
        """On SIGHUP (ops/reload.py decided what applies): the store's limits and namespaces, the
        sockets' allowed ids, the largest message, [limits] max_connections and client_queue_bytes
        (ZMQ_RCVHWM and MAXMSGSIZE apply to connections made after they are set)."""
        self.config = new
        self.store.set_limits(new.limits, new.leases)
        self.store.set_namespaces(new.namespaces, new.tenants)
        self.socket_files.allow(*new.client_ids())
        self.sock.setsockopt(zmq.MAXMSGSIZE, int(new.limits.max_message_bytes))
        self.max_connections = self._connection_cap()
        self.connections.max_connections = self.max_connections
        self.connections.queue_bytes = int(new.limits.client_queue_bytes)
        self.sock.setsockopt(zmq.RCVHWM, request_hwm(new.limits))

    def _prepare_runtime_dir(self) -> None:
        path = self.config.node.runtime_dir
        try:
            if not os.path.isdir(path):
                os.makedirs(path, exist_ok=True)
                os.chown(path, -1, self.gid)  # node.group: engines join it
                # owner and group only; sticky: a member may not remove or rename what it does not own
                os.chmod(path, 0o1770)
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
        """The host pool (adopted from the keeper, else new), its journal and the event ring."""
        try:
            memory = open_memory(self.config, self.gid, self.epoch)
        except ShmError as exc:
            raise StartupError(f"pool.host.size: {exc}") from None
        self.memory = memory
        self.pool, self.ring_file, self.ring = memory.pool, memory.ring_file, memory.ring

    def _open_cuda(self) -> None:
        """Load the CUDA driver and map `[pool.cuda] devices` to this process's ordinals."""
        from ..cli.doctor import open_cuda
        try:
            self.cuda_driver, self._cuda_ordinals = open_cuda(self.config.pool.cuda.devices, self.cuda_driver)
        except ConfigError as exc:
            raise StartupError(str(exc)) from None

    def _create_arenas(self) -> None:
        """One arena of `[pool.cuda] size` per device, exported once (memory/cuda.py)."""
        if self.config.pool.cuda is not None:
            from ..memory.cuda import CudaError, create_arenas
            try:
                self.arenas = create_arenas(self.cuda_driver, self._cuda_ordinals, self.config.pool.cuda,
                                            fd_socket=self.config.pool.host.backing == "memfd", log=log)
            except CudaError as exc:
                raise StartupError(str(exc)) from None

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
        # What one peer can make the daemon hold, both ways (see control/connections.py): replies by
        # count here and by bytes in Connections.send; requests by count times their largest size.
        # ROUTER_MANDATORY turns a full pipe into EAGAIN instead of a silent drop.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.copy_threshold = 0  # a reply sent copy=False is really zero-copy: its tracker means something
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.RCVHWM, request_hwm(limits))
        self.connections = Connections(sock, self.max_connections, int(limits.client_queue_bytes),
                                       self._on_connection_gone)
        try:
            with self.socket_files.bind(self._ipc_path()):
                sock.bind(self.endpoint)
        except zmq.ZMQError as exc:
            self.connections.close_monitor()
            sock.close(0)
            reason = "address already in use" if exc.errno == errno.EADDRINUSE else str(exc)
            raise StartupError(f"control.endpoint: cannot bind {self.endpoint}: {reason}") from None
        if self._ipc_path() is None:  # tcp: port 0 picks a free port; log the one bound
            self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.sock = sock

    def _bind_fd_socket(self) -> None:
        """memfds: the fd socket beside the control socket; Welcome names it by basename (tcp: path)."""
        if not isinstance(self.ring_file, MemfdFile):
            return
        ipc = self._ipc_path()
        path = ipc + ".fds" if ipc is not None else os.path.join(self.config.node.runtime_dir, f"ecd.{self.node}.fds")
        try:
            self.fd_server = FdServer(path, self.socket_files, self.epoch, self.ring_file, self.pool.segments,
                                      lambda: self.config, arena_fds(self), self.fd_limit,
                                      doorbell=submission_bytes(self.config) > 0, tenants=self.memory.tenant_parts())
        except OSError as exc:
            raise StartupError(f"control.endpoint: cannot bind the fd socket {path}: {exc.strerror or exc}") from None
        self.fd_socket_name = os.path.basename(path) if ipc is not None else path

    def _bind_metrics(self) -> None:
        address = self.config.metrics.address
        if address is None:
            return
        try:
            self.metrics_listener = bind_listener(*address)
        except OSError as exc:
            raise StartupError(f"metrics.listen: cannot bind {self.config.metrics.listen}: "
                               f"{exc.strerror or exc}") from None

    def _bind_cluster(self) -> None:
        if not self.config.cluster.enabled:
            return
        from .peer.cluster import Cluster
        try:
            self.cluster = Cluster(self.config, self.node, self.epoch)
            self.cluster.prepare()
        except ConfigError as exc:
            raise StartupError(str(exc)) from None

    def _bind_events(self) -> None:
        if not self.config.events.enabled:
            return
        from .events.service import Events
        try:
            self.events = Events(self.config.events, self.gid, self.config.tenants)
            self.events.open()
        except ConfigError as exc:
            raise StartupError(str(exc)) from None

    # ---- serving ------------------------------------------------------------------------

    def run(self) -> None:
        import uvloop
        uvloop.run(self.serve())

    async def serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        assert self.pool is not None and self.ring is not None and self.connections is not None  # prepare() made these
        assert self.sock is not None
        self.store = Store(host_tier(self), self.lower_tier, self.ring, self.loop, self.config.limits,
                           self.config.leases, namespaces=self.config.namespaces, slots=slot_areas(self),
                           tenants=self.config.tenants)
        self.memory.adopt_entries(self.store, float(self.config.leases.write_ttl))
        self.submissions = submission_areas(self)
        # a session's end may queue replies: the control loop (made next) drains them
        self.sessions = Sessions(self.store, self.loop, self.connections, self.endpoint.startswith("ipc://"),
                                 lambda: self.config.limits, lambda: self.control.schedule_drain())
        self.handler_context = handler_context(self)
        self.control = ControlLoop(self.handler_context, self.loop, self.sock, self.connections,
                                   lambda: self.state, self.counters)
        if self.cluster is not None:
            self.cluster.start(peer_context(self))
        if self.fd_server is not None:
            self.fd_server.start(self.loop)
        self.lower_tier.attach(self.store, self.loop, self.pool.segments)
        if self.events is not None:
            self.events.attach(self.store, self.loop)
        self.store.holdings.cleared()  # what the fleet knew of this node is void: a snapshot follows
        if self.metrics_listener is not None:
            source = metrics_source(self)
            self.metrics_server = MetricsServer(self.metrics_listener, make_registry(source), lambda: self.state,
                                                max_connections=self.config.metrics.max_connections)
            source.http = self.metrics_server
            await self.metrics_server.start()
            log.info("metrics on http://%s:%d/metrics", *self.metrics_listener.getsockname()[:2])
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.loop.add_signal_handler(sig, self._on_stop_signal, sig)
        self.loop.add_signal_handler(signal.SIGHUP, self._on_reload_signal)
        self.loop.add_reader(cast(int, self.sock.getsockopt(zmq.FD)), self.control.drain)  # an int option
        self.loop.add_reader(self.connections.monitor_fd(), self.control.drain)
        tasks = [self.loop.create_task(self._every(HEARTBEAT_INTERVAL_S, self.memory.beat)),
                 self.loop.create_task(self._every(EXPIRY_INTERVAL_S, self.store.expire)),
                 self.loop.create_task(self._every(STATUS_INTERVAL_S, self._report_status)),
                 self.loop.create_task(self._every(SESSION_SWEEP_S, self._sweep_sessions)),
                 # a pool file truncated while no request comes: its cut entries go within this
                 self.loop.create_task(self._every(POOL_CHECK_INTERVAL_S, self.store.host.check_pools))]
        if self.notifier.watchdog_interval:
            # From the loop itself: a wedged loop stops the pings and systemd restarts the daemon.
            tasks.append(self.loop.create_task(self._every(self.notifier.watchdog_interval,
                                                           self.notifier.watchdog)))
        self.state = "serving"
        self.memory.beat()  # the rings' stamps are from their making: a slow start (a holder to spawn) aged it
        log.info("serving node %s on %s: host pool %d bytes in %d %s segment(s), %d CUDA arena(s), epoch %d",
                 self.node, self.endpoint, sum(s.size for s in self.pool.segments), len(self.pool.segments),
                 self.config.pool.host.backing,
                 len(self.arenas) if self.arenas is not None else 0, self.epoch)
        self.notifier.ready(self.status_line())
        self.control.drain()  # messages that arrived before the reader was registered
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
            self.control.schedule_drain()

    def stats(self) -> DaemonStats:
        assert self.handler_context is not None  # serving
        return daemon_stats(self.handler_context, self.counters)

    def events_stats(self) -> "EventsStats | None":
        return self.events.stats() if self.events is not None else None

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
            if (not self.store.writes_in_progress() and not self.store.waiters
                    and not self.lower_tier.writes):
                return
            with suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._force_stop.wait(), DRAIN_POLL_S)
        log.info("shutdown grace over: abandoning writes in progress and parked requests")

    def _on_reload_signal(self) -> None:
        from .ops.reload import reload_config
        reload_config(reload_target(self))
        if self.events is not None:
            self.events.reload()  # the allowed subscriber keys ([events] curve_allowed_keys)

    def _on_connection_gone(self, conn: Connection, reason: str) -> None:
        if self.sessions is not None:
            self.sessions.on_connection_gone(conn, reason)

    def _sweep_sessions(self) -> None:
        self.connections.sweep()
        self.sessions.reap_silent(float(self.config.leases.session_ttl))

    # ---- stats and shutdown -------------------------------------------------------------

    def _shutdown(self) -> None:
        kept = self.memory.kept_line(float(self.config.restart.hold), self.config_path) if self.memory else None
        log.info("shutting down: %s", kept or "unlinking shared memory and the control socket")
        if self.store is not None:
            self.store.fail_waiters(Code.SHUTTING_DOWN, "daemon is shutting down")
        if self.sessions is not None:
            self.sessions.close()
        if self.cluster is not None:
            self.cluster.close()  # its threads stop touching the pools before they are unmapped
            self.cluster = None
        if self.loop is not None and self.sock is not None:
            with suppress(Exception):
                self.loop.remove_reader(cast(int, self.sock.getsockopt(zmq.FD)))
                self.loop.remove_reader(self.connections.monitor_fd())
        self.close()

    def close(self) -> None:
        """Release everything prepare() created; safe to call more than once."""
        if self.submissions is not None:
            self.submissions.stop()  # its timers and doorbell, before the pool goes
        if self.cluster is not None:
            self.cluster.close()
            self.cluster = None
        if self.sock is not None:
            if self.control is not None:
                self.control.stop()  # a drain still scheduled finds no socket
            self.connections.close_monitor()
            self.sock.close(linger=200)  # let the last replies (ShuttingDown to waiters) go out
            self.sock = None
            path = self._ipc_path()
            if path is not None:
                with suppress(FileNotFoundError):
                    os.unlink(path)
        if self.curve is not None:
            self.curve.stop()
        if self.events is not None:
            self.events.close()
            self.events = None
        if self.ctx is not None:
            self.ctx.term()
            self.ctx = None
        self.lower_tier.close()  # its threads stop touching the pools before those are unmapped
        self.lower_tier = NullTier()
        if self.fd_server is not None:
            self.fd_server.close()
            self.fd_server = None
        if self.memory is not None:  # the ring and the pool; the keeper goes on holding the pool
            self.memory.close()
            self.memory = None
            self.pool = self.ring_file = None
        if self.arenas is not None:
            self.arenas.close()
            self.arenas = None
        self._lock.release()
