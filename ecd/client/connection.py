"""What a client holds per connection, and the pieces of the handshake.

`Resources`: the ZMQ context, the DEALER socket and its handshake monitor, the CUDA plane: what
must be closed when the client goes away (reachable without the client itself, so a finalizer can
close it). Also the CURVE keys and the heartbeat thread of a session the daemon cannot watch by
pid. Neither numpy nor torch: the control plane (ecd.client.control, the admin CLI) imports this;
the shared memory of a daemon epoch is ecd.client.mapping's.
"""
from __future__ import annotations

import contextlib
import os
import stat
import threading
import time
import weakref
from typing import TYPE_CHECKING, Callable

import zmq

from ..errors import DaemonUnavailable, EcdError, PoolNotVisible, SocketPermissionDenied
from ..protocol import MAX_LOCAL_READS, Bye, Report, encoder

if TYPE_CHECKING:
    from .cuda import CudaPlane

# Handshake outcomes the socket monitor reports: AUTH (the daemon's ZAP handler refused the key),
# PROTOCOL (e.g. a plaintext client at a CURVE daemon), NO_DETAIL (the daemon dropped the
# connection mid-handshake: once may be chance, again and again is a wrong server key).
HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_SUCCEEDED)
HANDSHAKE_RETRIES = 3  # consecutive NO_DETAIL failures that count as a refusal


def _who() -> str:
    return f"uid {os.geteuid()}, groups {sorted({os.getegid(), *os.getgroups()})}"


def _mode_of(st: os.stat_result) -> str:
    return f"mode {st.st_mode & 0o7777:04o}, owner uid {st.st_uid}, group {st.st_gid}"


def check_socket_access(endpoint: str) -> None:
    """Raise SocketPermissionDenied, naming the path, its mode and owner and this process's ids,
    where an ipc:// endpoint's socket (or a directory above it) refuses this process, and
    DaemonUnavailable at once where no socket is there (rather than a whole timeout's wait)."""
    if not endpoint.startswith("ipc://") or endpoint[len("ipc://"):].startswith("@"):
        return  # tcp, or an abstract socket (no file permissions)
    path = os.path.abspath(endpoint[len("ipc://"):])
    if os.access(path, os.R_OK | os.W_OK, effective_ids=os.access in os.supports_effective_ids):
        return
    fix = ("join the socket's group (the daemon's node.group) or run as a uid the daemon admits "
           "([control] allowed_uids / allowed_gids); `ecd doctor` on the daemon's side checks the directory")
    directory = os.path.dirname(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise DaemonUnavailable(f"no daemon socket at {path}: is `ecd serve` running, with [control] endpoint = "
                                f"\"ipc://{path}\"? (`ecd doctor --config node.toml` checks the daemon's side)") from None
    except PermissionError:
        # a directory on the way does not let this process through: name the first one
        while directory != "/" and not os.access(directory, os.X_OK):
            parent = os.path.dirname(directory)
            if os.access(parent, os.X_OK):
                break
            directory = parent
        try:
            where = f"{directory} ({_mode_of(os.stat(directory))})"
        except OSError:
            where = directory
        raise SocketPermissionDenied(f"permission denied: this process ({_who()}) cannot pass through the "
                                     f"directory {where} to the daemon's socket {path}: {fix}") from None
    except OSError:
        return  # anything else: let the connect itself report it
    if stat.S_ISSOCK(st.st_mode):
        raise SocketPermissionDenied(f"permission denied: this process ({_who()}) may not connect to the "
                                     f"daemon's socket {path} ({_mode_of(st)}): {fix}")


def same_host(endpoint: str) -> bool:
    """An ipc:// endpoint is a unix socket: whoever answers runs on this kernel, and so its named
    /dev/shm files are this host's (unless a namespace hides them)."""
    return endpoint.startswith("ipc://")


def pool_not_visible(endpoint: str, node: str, ring_name: str) -> PoolNotVisible:
    """The error of a same-host client whose /dev/shm lacks the daemon's files, or holds another
    daemon's of the same node name (its ring's epoch differs)."""
    from ..memory.host import shm_path
    path = shm_path(ring_name)
    why = "another daemon's: its epoch differs" if os.path.exists(path) else "not there"
    return PoolNotVisible(
        f"the daemon's pool file {path} ({why}) is not visible from this process, although it reached the "
        f"daemon of node {node} at {endpoint} on this host: a different IPC or mount namespace (a container "
        f"with its own /dev/shm)? Use [pool.host] backing = \"memfd\" (the pool comes over the socket) or share "
        f"the daemon's /dev/shm with this container; ecd.ControlClient still works from here")


def curve_keys(secret_key: str | None, server_key: str | None) -> tuple[bytes, bytes, bytes] | None:
    """(client public, client secret, server public) from the constructor's arguments."""
    if secret_key is None and server_key is None:
        return None
    if not secret_key or not server_key:
        raise ValueError("give both curve_secret_key and curve_server_key, or neither")
    from ..curve import load_keyfile, load_public_key
    try:
        public, secret = load_keyfile(str(secret_key), need_secret=True)
    except ValueError as exc:
        raise ValueError(f"curve_secret_key: {exc}") from None
    try:
        server = load_public_key(str(server_key))
    except ValueError as exc:
        raise ValueError(f"curve_server_key: {exc}") from None
    return public, secret, server


def heartbeat(client_ref: "weakref.ref", stop: threading.Event) -> None:
    """Ping (fire-and-forget) whenever the client has been idle for its heartbeat interval."""
    while True:
        client = client_ref()
        if client is None:
            return
        interval = client._heartbeat_s
        del client  # never keep the Client alive from here
        if stop.wait(max(0.05, interval / 4)):
            return
        client = client_ref()
        if client is None:
            return
        if client._heartbeat_s and time.monotonic() - client._last_sent >= client._heartbeat_s:
            client._ping_quietly()
        del client


VIEW_WATCH_S = 0.25  # how often a client with views open looks at its daemon's ring
RING_SILENCE_S = 1.0  # a ring silent this long: its daemon may be gone (it beats every 0.1 s)


def watch_views(client_ref: "weakref.ref", stop: threading.Event) -> None:
    """While a Client has views open: when its daemon's ring goes silent the daemon may have
    restarted, and a round trip reaches the new one, which the client then asks for its views'
    leases again (Client._restarted), without waiting for the client's own next call: an idle
    reader's views are protected too. Ends with the last view (or the client)."""
    while not stop.wait(VIEW_WATCH_S):
        client = client_ref()
        if client is None:
            return
        try:
            with client._lock:
                if not client._views or not client._map.local:
                    client._view_watch = None
                    return
                alive = client._map.ring.alive(RING_SILENCE_S)
            if not alive:
                with contextlib.suppress(EcdError):
                    client.ping()  # reconnects to a restarted daemon (or times out: tried again)
        finally:
            del client


# The longest a closing client waits for its last messages (report, goodbye) to leave. At 100 ms a
# loaded machine dropped a Bye now and then (the session then counted as reclaimed).
BYE_LINGER_MS = 500


class Resources:
    """What must be closed when the client goes away, reachable without the client itself."""

    def __init__(self) -> None:
        self.ctx = zmq.Context(io_threads=1)
        self.sock: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None  # handshake failures of `sock`
        self.handshake_drops = 0  # consecutive NO_DETAIL handshake failures of `sock`
        self.stop = threading.Event()  # ends the heartbeat thread
        self.cuda: CudaPlane | None = None  # of the current epoch, once CUDA was involved
        # closes the current epoch's arena and doorbell descriptors (EpochMapping.close_fds): at close
        # or when a new epoch replaces it, not whenever the old mapping is collected
        self.close_fds: Callable[[], object] | None = None
        # generations read without a round trip and not yet reported (client/local_read.py's
        # LocalReads keeps them here): told to the daemon with the goodbye, even at exit
        self.unreported: list[int] = []
        self.ipc_path: str | None = None  # the control socket's file (ipc://), if any

    def close_cuda(self) -> None:
        """Close the arena handles and unregister the host mappings (client close, new epoch)."""
        plane, self.cuda = self.cuda, None
        if plane is not None:
            plane.close()

    def handshake_failure(self, endpoint: str, with_keys: bool) -> str | None:
        """Why the security handshake failed, if the socket monitor says it did."""
        from zmq.utils.monitor import recv_monitor_message
        monitor = self.monitor
        while monitor is not None:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.ZMQError:
                return None
            kind, value = event["event"], event["value"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.handshake_drops = 0
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                self.handshake_drops += 1
                if self.handshake_drops >= HANDSHAKE_RETRIES:
                    return (f"the daemon at {endpoint} dropped {self.handshake_drops} security "
                            f"handshakes in a row ({os.strerror(int(value))})"
                            + (": is curve_server_key the daemon's public key?" if with_keys else
                               ": does it require CURVE keys?"))
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                return (f"the daemon at {endpoint} refused this client's key (ZAP status {int(value)}): "
                        "is its public key in the daemon's control.curve_allowed_keys?")
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                return (f"security handshake with {endpoint} failed ({protocol_error_name(value)}): the "
                        "daemon requires CURVE and this client has no keys, or the other way round")
        return None

    def drop_socket(self, say_bye: bool = False) -> None:
        if self.sock is None:
            return
        if say_bye:
            with contextlib.suppress(zmq.ZMQError):
                if self.unreported:
                    self.sock.send(encoder.encode(Report(0, local_reads=self.unreported[-MAX_LOCAL_READS:])),
                                   zmq.NOBLOCK)
                    self.unreported.clear()
                self.sock.send(encoder.encode(Bye(0)), zmq.NOBLOCK)
        if self.monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.sock.disable_monitor()
            self.monitor.close(linger=0)
            self.monitor = None
        # the goodbye (and the last report) must leave even when the I/O thread runs late under
        # load; but a daemon whose socket file is gone (stopped) takes nothing: no wait then
        there = self.ipc_path is None or os.path.exists(self.ipc_path)
        self.sock.close(linger=BYE_LINGER_MS if say_bye and there else 0)
        self.sock = None

    def close(self) -> None:
        self.stop.set()
        self.close_cuda()
        if self.close_fds is not None:
            self.close_fds()
        self.drop_socket(say_bye=True)
        self.ctx.term()


def protocol_error_name(value: int) -> str:
    """libzmq's name for a handshake protocol error code (PROTOCOL_ERROR_ZMTP_...)."""
    import zmq.constants
    names = [n for n in dir(zmq.constants) if n.startswith("PROTOCOL_ERROR_")
             and getattr(zmq.constants, n) == int(value)]
    return names[0].lower().replace("_", " ") if names else f"protocol error {int(value):#x}"
