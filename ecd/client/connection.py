"""What a Client holds per connection and per daemon epoch.

`Resources`: the ZMQ context, the DEALER socket and its handshake monitor, the CUDA plane: what
must be closed when the Client goes away (reachable without the Client itself, so a finalizer can
close it). `EpochMapping`: one daemon epoch's shared memory as this process sees it (pools mapped
read-write and read-only, the event ring), or nothing but a `NoRing` for a client on another host.
Also the pieces of the handshake: the CURVE keys, the heartbeat
thread of a session the daemon cannot watch by pid.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref

import zmq

from ..errors import EcdError, InvalidRequest, ProtocolError
from ..memory.host import ShmError, ShmFile, shm_path
from ..memory.ring import RingReader
from ..protocol import Bye, Extent, Location, Welcome, encoder

# Handshake outcomes the socket monitor reports: AUTH (the daemon's ZAP handler refused the key),
# PROTOCOL (e.g. a plaintext client at a CURVE daemon), NO_DETAIL (the daemon dropped the
# connection mid-handshake: once may be chance, again and again is a wrong server key).
HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_SUCCEEDED)
HANDSHAKE_RETRIES = 3  # consecutive NO_DETAIL failures that count as a refusal
# How long a client that finds the ring's header overwritten waits for the daemon to rewrite it
# (it does every 0.1 s heartbeat) before it gives up on the ring.
RING_REPAIR_WAIT_S = 0.5


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


class Resources:
    """What must be closed when the Client goes away, reachable without the Client itself."""

    def __init__(self) -> None:
        self.ctx = zmq.Context(io_threads=1)
        self.sock: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None  # handshake failures of `sock`
        self.handshake_drops = 0  # consecutive NO_DETAIL handshake failures of `sock`
        self.stop = threading.Event()  # ends the heartbeat thread
        self.cuda = None  # ecd.client.cuda.CudaPlane of the current epoch, once CUDA was involved

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
                self.sock.send(encoder.encode(Bye(0)), zmq.NOBLOCK)
        if self.monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.sock.disable_monitor()
            self.monitor.close(linger=0)
            self.monitor = None
        self.sock.close(linger=100 if say_bye else 0)
        self.sock = None

    def close(self) -> None:
        self.stop.set()
        self.close_cuda()
        self.drop_socket(say_bye=True)
        self.ctx.term()


class NoRing:
    """The event ring of a daemon on another host: never trusted, so every lookup asks."""

    next_seq = 0
    epoch = 0
    overruns = corruptions = 0

    @staticmethod
    def alive(max_silence_s: float) -> bool:
        return False

    @staticmethod
    def usable(max_silence_s: float) -> bool:
        return False


def open_ring(ring_file: ShmFile, welcome: Welcome) -> RingReader | None:
    """The daemon's event ring, or None where the file is another daemon's (its epoch differs).

    Any group member can write the ring. A header that fails the reader's checks, or a live
    ring with another epoch, may just have been scribbled over: the daemon rewrites its header
    every heartbeat, so look again for up to RING_REPAIR_WAIT_S before believing it (without
    that, one bad write would keep every client that connects meanwhile off the pools).
    ValueError where the header stays unreadable."""
    deadline = time.monotonic() + RING_REPAIR_WAIT_S
    while True:
        try:
            ring = RingReader(ring_file.buf, welcome.ring.slots, welcome.ring.buckets)
        except ValueError:
            if time.monotonic() >= deadline:
                raise
        else:
            if ring.epoch == welcome.epoch:
                return ring
            if not ring.alive(RING_REPAIR_WAIT_S) or time.monotonic() >= deadline:
                return None  # a dead daemon's leftover, or a same-named daemon's on this host
        time.sleep(0.002)  # short: under repeated scribbling, catch the moment after a repair


class EpochMapping:
    """One daemon epoch's shared memory as this process sees it."""

    def __init__(self, welcome: Welcome, populate: bool) -> None:
        self.epoch = welcome.epoch
        self.node = welcome.node
        self.sizes = [p.size for p in welcome.pools]
        # `[pool.cuda]` arenas: pool numbers after the host segments' (ecd.client.cuda opens them)
        self.arenas = list(welcome.arenas)
        self.arena_sizes = {a.index: a.size for a in welcome.arenas}
        self.local = True
        try:
            # The ring first: missing, or another daemon's (its epoch differs), means the daemon
            # is on another host and its pools are out of reach.
            try:
                ring_file = ShmFile.attach(welcome.ring.name, welcome.ring.size, writable=False)
            except ShmError:
                if os.path.exists(shm_path(welcome.ring.name)):
                    raise
                ring_file = None
            ring = None if ring_file is None else open_ring(ring_file, welcome)
            if ring is None:
                self.local = False
                self.rw = self.ro = []
                self.ring = NoRing()
                return
            self.ring = ring
            self.rw = [ShmFile.attach(p.name, p.size, writable=True, populate=populate).buf
                       for p in welcome.pools]
            self.ro = [ShmFile.attach(p.name, p.size, writable=False, populate=populate).buf
                       for p in welcome.pools]
        except (ShmError, ValueError) as exc:
            raise EcdError(f"cannot map the daemon's shared memory: {exc}") from None

    def require_local(self, what: str, inline_max: int) -> None:
        if not self.local:
            raise InvalidRequest(
                f"pools are not mapped: this client is not on the daemon's node ({self.node}); {what} "
                f"moves bytes through /dev/shm. From here: exists, delete, keys, stats, evict, ping "
                f"and puts of up to {inline_max} bytes")

    def check(self, loc: Location) -> None:
        size = self.sizes[loc.pool] if 0 <= loc.pool < len(self.sizes) else self.arena_sizes.get(loc.pool)
        if size is None or not (0 <= loc.offset and loc.offset + loc.nbytes <= size):
            raise ProtocolError(f"daemon sent a location outside its pools: {loc}")

    def is_arena(self, pool: int) -> bool:
        return pool >= len(self.sizes)

    def fits(self, extent: Extent, arena: int) -> bool:
        """Whether an extent lies in the tier a put asks for (arena -1: the host pool)."""
        return extent.pool == arena if arena >= 0 else 0 <= extent.pool < len(self.sizes)


def protocol_error_name(value: int) -> str:
    """libzmq's name for a handshake protocol error code (PROTOCOL_ERROR_ZMTP_...)."""
    import zmq.constants
    names = [n for n in dir(zmq.constants) if n.startswith("PROTOCOL_ERROR_")
             and getattr(zmq.constants, n) == int(value)]
    return names[0].lower().replace("_", " ") if names else f"protocol error {int(value):#x}"
