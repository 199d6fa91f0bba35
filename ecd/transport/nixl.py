"""transport = "nixl": one-sided READs through a NIXL agent (UCX underneath: RDMA, EFA, TCP).

The model is vLLM's NixlConnector with `kv_buffer_device="cpu"`: each daemon creates one NIXL
agent (UCX backend, progress thread on) and registers its host pool segments once, as DRAM, when
the peer plane starts. An owner's agent metadata (its UCX address and the remote keys of its
registered pool) travels in the `peer_welcome` of the peer control plane, which CURVE
authenticates; each `offer` of a `leased` reply carries the entry's address in the owner's pool.
The puller then READs straight from the owner's registered pool into the extent it allocated in
its own registered pool (`initialize_xfer("READ", local, remote, agent)`, `transfer`, poll
`check_xfer_state`, `release_xfer_handle`), on its own executor threads, never on the loop.

The owner's CPU does not take part in a READ, so it never learns that the bytes went: the puller
says so over the control plane (`peer_done`, see ecd/daemon/peer/fetch.py), and the owner gives the
transfer leases back then (or on `peer_release`, the lease TTL, the puller's session ending).
GrantTable tokens still name each lease on the control plane, but no data connection presents
them: what admits a READ is the agent metadata, handed only to authenticated peers, and the
remote key of the registration (see docs/operating.md, "transport = nixl": the fabric must be
trusted; `cluster.tls` does not apply).

A dead owner shows up as an exception (nixlRemoteDisconnectError, measured: 0.03 s after a
SIGKILL over UCX-TCP on lo) or "ERR" from check_xfer_state: a TransferError("connection"), and the
remote agent is dropped so that the next pull loads its metadata afresh. At the deadline the
transfer is cancelled (release_xfer_handle) before pull() returns: no byte lands in the extent
after that.
"""
from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

from ..config_types import check_field
from .base import GrantTable, OnSent, PullItem, Transport, TransferError, TransportUnavailable

if TYPE_CHECKING:  # pragma: no cover
    from ..cluster_config import ClusterSection

log = logging.getLogger("ecd.transport")

# The PyPI wheels: `nixl` (a meta package) provides the `nixl` module; `nixl-cu12` / `nixl-cu13`
# install theirs as `nixl_cu12` / `nixl_cu13` (the same API, without a GPU needed for DRAM).
MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
INSTALL_HINT = "pip install --no-deps nixl-cu12 numpy (or: make nixl)"
POLL_MIN_S, POLL_MAX_S = 50e-6, 1e-3  # check_xfer_state backoff: a 16 MiB READ takes ~10-30 ms here
CANCEL_GRACE_S = 2.0  # a transfer that cannot be cancelled at once gets this long to end


def _reason(exc: Exception) -> str:
    """The failure label of a NIXL exception: what the owner sent was wrong (bad metadata, or
    descriptors outside its registered pool) is "protocol"; anything else (seen: the remote
    agent disconnected, a backend error while UCX reaches a dead owner) means it went away."""
    bad = type(exc).__name__ in ("nixlInvalidParamError", "nixlMismatchError", "nixlNotSupportedError")
    return "protocol" if bad else "connection"


class NixlUnavailable(TransportUnavailable):
    """NIXL does not import here (the message says why and how to install it)."""


def load_nixl() -> Any:
    """The NIXL Python API module (`nixl_agent`, `nixl_agent_config`), or NixlUnavailable."""
    errors = []
    for name in MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:  # also a wheel whose native libraries do not load
            errors.append(f"{name}: {exc}")
    raise NixlUnavailable(f"NIXL does not import ({'; '.join(errors)}); install it: {INSTALL_HINT}")


def buffer_address(buf: Any) -> int:
    """The address of a writable buffer (a pool segment's mmap). The numpy view only lends it:
    dropping it at once releases the export, so the daemon can still close the mmap."""
    import numpy as np
    view = np.frombuffer(buf, dtype=np.uint8)
    try:
        return int(view.ctypes.data)
    finally:
        del view


class NixlTransport(Transport):
    name = "nixl"
    owner_sees_send = False  # READs are one-sided: the puller reports completion (peer_done)
    has_data_listener = False  # UCX opens its own listener (its address is in the agent metadata)
    pins_pool = "registers it with UCX in the daemon"

    @classmethod
    def check_config(cls, cluster: "ClusterSection") -> None:
        # NIXL moves the bytes itself (UCX, RDMA): ecd's TLS wraps only its own TCP streams
        check_field(not cluster.tls, "tls",
                    "applies to transport \"tcp\" only (NIXL/UCX traffic is not encrypted by ecd)")

    def __init__(self, host: str, port: int, max_inflight: int = 4, io_timeout: float = 5.0,
                 loop: Any = None, tls: Any = None, instance: str = "") -> None:
        if tls is not None:  # config refuses it; a caller that bypasses config must not think it applies
            raise ValueError("cluster.tls applies to transport \"tcp\" only")
        api = load_nixl()
        self.grants = GrantTable()
        self.executor = ThreadPoolExecutor(max_inflight, thread_name_prefix="ecd-nixl-pull")
        self.io_timeout = io_timeout
        self.loop = loop
        self._bind = (host, port)
        self._stop = threading.Event()
        # One agent per daemon; its name must be unique among every agent a peer ever loads (an
        # owner that restarts comes back under a new name, and its old one is dropped).
        self.agent_name = instance or f"ecd-{os.getpid()}-{time.time_ns():x}"
        sync = getattr(api, "nixl_thread_sync_t", None)
        kwargs: dict[str, Any] = {"enable_prog_thread": True, "backends": ["UCX"]}
        if sync is not None:
            kwargs["sync_mode"] = sync.NIXL_THREAD_SYNC_STRICT  # pulls run on several threads
        try:
            self.agent = api.nixl_agent(self.agent_name, api.nixl_agent_config(**kwargs))
        except Exception as exc:  # UCX found no usable transport, the plugin did not load, ...
            raise NixlUnavailable(f"cannot create a NIXL agent with the UCX backend: {exc}") from None
        if "UCX" not in getattr(self.agent, "backends", {"UCX": None}):
            raise NixlUnavailable("NIXL has no UCX backend plugin here")
        # Our own lock as well as NIXL's: remote-agent bookkeeping spans several NIXL calls.
        self._lock = threading.Lock()
        self._registered: list[Any] = []  # nixlRegDList per registration, deregistered at close
        self._bases: dict[int, int] = {}  # id(segment buffer) -> its address (pool segments live as long as we do)
        self._metadata = b""
        self._peers: dict[tuple[str, int], bytes] = {}  # owner's data address -> its agent metadata
        self._loaded: dict[tuple[str, int], tuple[bytes, str]] = {}  # -> (metadata, remote agent name)
        self._busy = 0  # pulls running (close waits for them)
        self._idle = threading.Condition(self._lock)

    # ---- both sides: the pool, registered once ---------------------------------------------

    def bind(self) -> tuple[str, int]:
        """Nothing to bind: UCX opens its own listener when the agent is created. The address
        the daemon announces only names this daemon (see Cluster.prepare)."""
        return self._bind

    def serve(self, segments: Callable[[int], Any], on_sent: OnSent) -> tuple[str, int]:
        """Register every pool segment with the agent, once (the puller's extents and the
        owner's entries both live there), and make the metadata peers get in peer_welcome."""
        regions = []
        index = 0
        while True:
            try:
                buf = segments(index)  # the pool's segments are fixed at start: 0..n-1
            except IndexError:
                break
            base = buffer_address(buf)
            self._bases[id(buf)] = base
            regions.append((base, len(buf), 0, ""))
            index += 1
        if regions:
            with self._lock:
                self._registered.append(self.agent.register_memory(regions, "DRAM", backends=["UCX"]))
                self._metadata = bytes(self.agent.get_agent_metadata())
        log.info("NIXL agent %s registered %d pool segment(s) (%d bytes)", self.agent_name, len(regions),
                 sum(r[1] for r in regions))
        return self._bind

    def metadata(self) -> bytes:
        return self._metadata

    def address_of(self, buf: Any, offset: int) -> int:
        return self._base(buf) + offset

    def _base(self, buf: Any) -> int:
        base = self._bases.get(id(buf))
        return base if base is not None else buffer_address(buf)

    # ---- puller side ------------------------------------------------------------------------

    def learn_peer(self, address: tuple[str, int], metadata: bytes) -> None:
        """On the loop, from a peer's welcome: the metadata to load before reading from it.
        Loading and connecting (NIXL calls) run on a pull thread, now rather than in the first
        pull: UCX aborts the whole process (an assertion in its error path, seen in CI) when the
        owner dies while it sets up a connection, so that window belongs at the welcome, not
        under a fetch, whose owner dying mid-READ on an established endpoint is a clean error.
        No lock here: the loop must never wait for a pull thread inside NIXL (a single dict
        store is atomic)."""
        self._peers[address] = metadata
        if self._stop.is_set():
            return
        try:
            self.executor.submit(self._connect_ahead, address)
        except RuntimeError:  # the executor shut down meanwhile: the daemon is stopping
            pass

    def _connect_ahead(self, address: tuple[str, int]) -> None:
        try:
            name = self._remote(address)
        except TransferError as exc:  # the first pull tries again and reports it
            log.warning("NIXL: cannot connect ahead to the owner at %s:%d: %s", address[0], address[1], exc)
            return
        log.info("NIXL: connected to agent %s of the owner at %s:%d", name, address[0], address[1])

    def _remote(self, address: tuple[str, int]) -> str:
        """The loaded remote agent for `address` (loading or reloading its metadata here)."""
        with self._lock:
            metadata = self._peers.get(address)
            if not metadata:
                raise TransferError("protocol", f"no NIXL agent metadata from the owner at {address[0]}:{address[1]} "
                                                "(does it run transport \"nixl\"?)")
            loaded = self._loaded.get(address)
            if loaded is not None and loaded[0] == metadata:
                return loaded[1]
            if loaded is not None:  # the owner restarted: a new agent; drop the old one
                self._forget_locked(address)
            try:
                name = self.agent.add_remote_agent(metadata)
            except Exception as exc:  # seen: NIXL_ERR_BACKEND when UCX cannot reach a dead owner
                raise TransferError(_reason(exc), f"cannot load the owner's NIXL metadata: "
                                                  f"{type(exc).__name__}: {exc}") from None
            name = name.decode() if isinstance(name, bytes) else str(name)
            self._loaded[address] = (metadata, name)
            # Connect here rather than lazily inside the first transfer (see learn_peer).
            try:
                self.agent.make_connection(name, backends=["UCX"])
            except Exception as exc:
                self._forget_locked(address)
                raise TransferError(_reason(exc), f"cannot connect to the owner's NIXL agent: "
                                                  f"{type(exc).__name__}: {exc}") from None
            return name

    def _forget_locked(self, address: tuple[str, int]) -> None:
        loaded = self._loaded.pop(address, None)
        if loaded is None:
            return
        try:
            self.agent.remove_remote_agent(loaded[1])
        except Exception as exc:  # already gone
            log.debug("removing NIXL agent %s: %s", loaded[1], exc)

    def pull(self, host: str, port: int, items: list[PullItem], deadline: float) -> int:
        with self._lock:
            if self._stop.is_set():
                raise TransferError("shutdown", "the daemon is shutting down")
            self._busy += 1
        try:
            return self._pull(host, port, items, deadline)
        finally:
            with self._lock:
                self._busy -= 1
                self._idle.notify_all()

    def _pull(self, host: str, port: int, items: list[PullItem], deadline: float) -> int:
        if not items:
            return 0
        if time.monotonic() >= deadline:
            raise TransferError("timeout", "the fetch's deadline passed before its transfer started")
        address = (host, port)
        remote = self._remote(address)
        local = [(self._base(i.buf) + i.offset, i.nbytes, 0) for i in items]
        far = [(i.remote, i.nbytes, 0) for i in items]
        try:
            with self._lock:
                handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(local, "DRAM"),
                                                    self.agent.get_xfer_descs(far, "DRAM"), remote,
                                                    backends=["UCX"])
        except Exception as exc:
            with self._lock:
                self._forget_locked(address)
            raise TransferError(_reason(exc), f"cannot set up the NIXL READ from {remote}: {type(exc).__name__}: {exc}") from None
        try:
            state = self._run(handle, deadline)
        except TransferError:
            self._cancel(handle, address)
            raise
        except Exception as exc:  # nixlRemoteDisconnectError and friends: the owner died or vanished
            self._cancel(handle, address)
            raise TransferError("connection", f"NIXL READ from {remote} failed: {type(exc).__name__}: {exc}") from None
        self._release(handle, address)
        if state != "DONE":
            with self._lock:
                self._forget_locked(address)
            raise TransferError("connection", f"NIXL READ from {remote} ended in state {state}")
        return sum(i.nbytes for i in items)

    def _run(self, handle: Any, deadline: float) -> str:
        """Post the READ and poll it to an end state; TransferError at the deadline or shutdown."""
        with self._lock:
            state = self.agent.transfer(handle)
        pause = POLL_MIN_S
        while state == "PROC":
            if self._stop.is_set():
                raise TransferError("shutdown", "the daemon is shutting down")
            if time.monotonic() >= deadline:
                raise TransferError("timeout", "transfer deadline passed during the NIXL READ")
            time.sleep(pause)
            pause = min(pause * 2, POLL_MAX_S)
            with self._lock:
                state = self.agent.check_xfer_state(handle)
        return state

    def _release(self, handle: Any, address: tuple[str, int]) -> bool:
        try:
            with self._lock:
                self.agent.release_xfer_handle(handle)
            return True
        except Exception as exc:
            log.debug("releasing a NIXL transfer handle: %s", exc)
            return False

    def _cancel(self, handle: Any, address: tuple[str, int]) -> None:
        """Make sure no byte of this READ lands after we return: release (NIXL cancels an active
        transfer), else wait for it to end; then disconnect from the owner altogether, so that
        nothing UCX still had under way for it can reach the extent, which the daemon is about
        to free and may hand to another entry. (The next pull loads the owner's metadata again.)"""
        if self._release(handle, address):
            with self._lock:
                self._forget_locked(address)
            return
        until = time.monotonic() + CANCEL_GRACE_S
        while time.monotonic() < until:
            try:
                with self._lock:
                    if self.agent.check_xfer_state(handle) != "PROC":
                        break
            except Exception:
                break  # an error state: nothing is moving any more
            time.sleep(POLL_MAX_S)
        with self._lock:
            self._forget_locked(address)  # tears the UCX endpoint down: an in-flight READ stops
        self._release(handle, address)

    # ---- shutdown -----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop pulling (running READs are cancelled at their next poll), then deregister the
        pool, so that no transfer touches a mapping after this returns."""
        self._stop.set()
        self.executor.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            while self._busy:
                self._idle.wait(1.0)
            for address in list(self._loaded):
                self._forget_locked(address)
            for registered in self._registered:
                try:
                    self.agent.deregister_memory(registered, backends=["UCX"])
                except Exception as exc:
                    log.debug("deregistering the pool from NIXL: %s", exc)
            self._registered.clear()
