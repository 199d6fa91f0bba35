"""One daemon epoch's shared memory as this process maps it (the data plane's side of a Client).

`EpochMapping`: the host pools mapped read-write and read-only and the event ring, or nothing but a
`NoRing` for a client on another host. A daemon with `[pool.host] backing = "memfd"` hands them
over as descriptors on its fd socket (ecd/fd_passing.py): sealed, so no one can truncate them and
the size checks below are skipped; one with "named" files leaves them for the client to open in
/dev/shm. Only `ecd.Client` (tensors) maps them: the control-plane
`ControlClient` (ecd.client.control) never imports this module, so it loads neither numpy (the
ring reader's) nor torch.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
import weakref
from typing import Any

from .. import fd_passing
from ..errors import Code, DaemonUnavailable, EcdError, InvalidRequest, ProtocolError, error_from_code
from ..memory.host import ShmError, ShmFile, shm_path
from ..memory import prefault
from ..memory.memfd import F_GET_SEALS, F_SEAL_GROW, F_SEAL_SHRINK, map_fd
from ..memory.ring import ASK, RingReader
from ..protocol import Extent, Location, Welcome

# How long a client that finds the ring's header overwritten waits for the daemon to rewrite it
# (it does every 0.1 s heartbeat) before it gives up on the ring.
RING_REPAIR_WAIT_S = 0.5
_SIZE_SEALS = F_SEAL_SHRINK | F_SEAL_GROW

log = logging.getLogger("ecd.client")


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

    @staticmethod
    def lookup(keyhash: int) -> int:
        return ASK


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
            ring = RingReader(ring_file.buf, welcome.ring.slots, welcome.ring.buckets, welcome.ring.index_records)
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

    def __init__(self, welcome: Welcome, populate: bool, endpoint: str = "", timeout: float = 5.0) -> None:
        """`endpoint`: the control endpoint this client connected to (the fd socket is beside
        it); `timeout`: for fetching the descriptors."""
        self.epoch = welcome.epoch
        self.node = welcome.node
        self.views: Any = None  # the Client's tensors.PoolViews of `ro` (this module stays torch-free)
        # by pool index: a sized tenant's client is given its own segments only (0 / None: not mapped)
        self.sizes = host_sizes(welcome)
        # `[pool.cuda]` arenas: pool numbers after the host segments' (ecd.client.cuda opens them)
        self.arenas = list(welcome.arenas)
        self.arena_sizes = {a.index: a.size for a in welcome.arenas}
        self.local = True
        self.sealed = bool(welcome.fd_socket)  # memfds: their size cannot change
        # pool index -> descriptor of each arena exported as one (`[pool.cuda] export = "fd"`):
        # ecd.client.cuda imports it on first use; closed with this mapping
        self.arena_fds: dict[int, int] = {}
        self.doorbell_fd = -1  # the submission area's eventfd (ecd.writes.producer rings it), when handed one
        self.close_fds: Any = _nothing  # closes these once (the Client at close or a new epoch, else GC)
        # `populate`: the pools' page tables built ahead of the first copies, in the background
        # where the kernel can (ecd.memory.prefault), else by MAP_POPULATE while mapping
        self.prefaulting: threading.Thread | None = None
        in_background = populate and prefault.supported()
        if in_background:
            populate = False
        if self.sealed:
            self._map_passed(welcome, populate, endpoint, timeout)
        else:
            self._map_named(welcome, populate)
        if in_background and self.rw:
            self.prefaulting = prefault.start([b for b in self.rw if b is not None], [b for b in self.ro if b is not None])

    def _map_named(self, welcome: Welcome, populate: bool) -> None:
        """The pools and ring as /dev/shm files of the names the Welcome gives."""
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
                self._not_local()
                return
            self.ring: RingReader | NoRing = ring
            self.rw: list[Any] = [ShmFile.attach(p.name, p.size, writable=True, populate=populate).buf
                       for p in welcome.pools]
            self.ro: list[Any] = [ShmFile.attach(p.name, p.size, writable=False, populate=populate).buf
                       for p in welcome.pools]
        except (ShmError, ValueError) as exc:
            raise EcdError(f"cannot map the daemon's shared memory: {exc}") from None

    def _not_local(self) -> None:
        self.local = False
        self.rw = self.ro = []
        self.ring = NoRing()

    def _map_passed(self, welcome: Welcome, populate: bool, endpoint: str, timeout: float) -> None:
        """The pools and ring as descriptors from the daemon's fd socket, found in the directory
        of this client's own control socket path (a pod may mount it elsewhere than the daemon's).
        Over tcp the daemon may be on another host: no socket there, or another daemon's, means
        the pools are out of reach (as the named mode's missing files do)."""
        ipc = endpoint.startswith("ipc://")
        path = os.path.join(os.path.dirname(endpoint[len("ipc://"):]) if ipc else "/", welcome.fd_socket)
        if not ipc and not os.path.exists(path):
            self._not_local()
            return
        try:
            header, items = fd_passing.receive(path, timeout)
        except fd_passing.FdFetchError as exc:
            if not ipc:
                log.info("pools not mapped (the daemon may be on another host): %s", exc)
                self._not_local()
                return
            raise DaemonUnavailable(f"cannot map the daemon's shared memory: {exc}") from None
        try:
            if header.epoch != welcome.epoch:
                if not ipc:
                    self._not_local()  # a daemon on this host, not the one this client talks to
                    return
                raise DaemonUnavailable(f"the fd socket {path} belongs to daemon run {header.epoch}, the Welcome "
                                        f"to run {welcome.epoch}: the daemon restarted meanwhile; connect again")
            fds = {(item.kind, item.index): (item.size, fd) for item, fd in items}
            want = [("ring", 0, welcome.ring.size)] + [("pool", p.index, p.size) for p in welcome.pools]
            for kind, index, size in want:
                got = fds.get((kind, index))
                if got is None or got[0] != size:
                    raise ProtocolError(f"the fd socket {path} sent {kind} {index} as {got and got[0]} bytes, "
                                        f"Welcome says {size}")
                if fcntl.fcntl(got[1], F_GET_SEALS) & _SIZE_SEALS != _SIZE_SEALS:
                    raise ProtocolError(f"the daemon's {kind} {index} is not sealed against truncation")
            ring_buf = map_fd(fds["ring", 0][1], welcome.ring.size, writable=False)
            ring = open_ring(ShmFile(welcome.ring.name, welcome.ring.size, ring_buf), welcome)
            if ring is None:
                raise ProtocolError(f"the ring from the fd socket {path} is not daemon run {welcome.epoch}'s")
            self.ring = ring
            # Views get a read-only mapping of the same descriptor: a stray in-place write faults.
            self.rw = [None] * len(self.sizes)
            self.ro = [None] * len(self.sizes)
            for p in welcome.pools:
                self.rw[p.index] = map_fd(fds["pool", p.index][1], p.size, writable=True, populate=populate)
                self.ro[p.index] = map_fd(fds["pool", p.index][1], p.size, writable=False, populate=populate)
            self.arena_fds = arena_descriptors(welcome, fds, path)
            kept = list(self.arena_fds.values())
            if ("doorbell", 0) in fds:
                self.doorbell_fd = os.dup(fds["doorbell", 0][1])
                kept.append(self.doorbell_fd)
            if kept:
                self.close_fds = weakref.finalize(self, _close_all, kept)
        except (OSError, ShmError, ValueError) as exc:
            raise EcdError(f"cannot map the daemon's shared memory from {path}: {exc}") from None
        finally:
            for _, fd in items:
                os.close(fd)  # the mappings keep what they need

    def require_local(self, what: str, inline_max: int) -> None:
        if not self.local:
            raise InvalidRequest(
                f"pools are not mapped: this client is not on the daemon's node ({self.node}), it reached it "
                f"over tcp; {what} moves bytes through shared memory. From here: exists, delete, keys, stats, evict, ping "
                f"and puts of up to {inline_max} bytes")

    def check(self, loc: Location) -> None:
        size = self.sizes[loc.pool] or None if 0 <= loc.pool < len(self.sizes) else self.arena_sizes.get(loc.pool)
        if size is None or not (0 <= loc.offset and loc.offset + loc.nbytes <= size):
            raise ProtocolError(f"daemon sent a location outside its pools: {loc}")

    def rw_for(self, pool: int, offset: int, nbytes: int) -> Any:
        """The read-write mapping of host pool segment `pool`, once its file is seen to reach past
        offset + nbytes (one fstat, ~1 us): a member of the group may have truncated it, and the
        first access past its end would kill this process (SIGBUS). IntegrityError instead (the
        daemon restores the file, and drops what the cut took, at its next check). A sealed
        memfd cannot be truncated: no check."""
        return self.rw[pool] if self.sealed else _reaching(self.rw[pool], pool, offset + nbytes)

    def ro_for(self, pool: int, offset: int, nbytes: int) -> Any:
        """rw_for for the read-only mapping."""
        return self.ro[pool] if self.sealed else _reaching(self.ro[pool], pool, offset + nbytes)

    def is_arena(self, pool: int) -> bool:
        return pool >= len(self.sizes)

    def fits(self, extent: Extent, arena: int) -> bool:
        """Whether an extent lies in the tier a put asks for (arena -1: the host pool)."""
        return extent.pool == arena if arena >= 0 else 0 <= extent.pool < len(self.sizes) and self.sizes[extent.pool] > 0


def host_sizes(welcome: Welcome) -> list[int]:
    """Each host segment's size by pool index, 0 for one not given to this client (another
    tenant's): the arenas' pool numbers follow every host segment."""
    count = min((a.index for a in welcome.arenas), default=max((p.index + 1 for p in welcome.pools), default=0))
    sizes = [0] * count
    for pool in welcome.pools:
        if not 0 <= pool.index < count:
            raise ProtocolError(f"the daemon named host pool segment {pool.index} beside arenas from {count}")
        sizes[pool.index] = pool.size
    return sizes


def arena_descriptors(welcome: Welcome, fds: dict[tuple[str, int], tuple[int, int]],
                      path: str) -> dict[int, int]:
    """{pool index: a duplicate of its descriptor} of the arenas Welcome says are exported as file
    descriptors, from the fd socket's items `fds` ((kind, index) -> (size, fd); those stay the
    caller's). ProtocolError, with nothing left open, where one is missing or of another size."""
    kept: dict[int, int] = {}
    try:
        for arena in welcome.arenas:
            if arena.export != "fd":
                continue
            got = fds.get(("arena", arena.index))
            if got is None or got[0] != arena.size:
                raise ProtocolError(f"the fd socket {path} sent arena {arena.index} as {got and got[0]} bytes, "
                                    f"Welcome says {arena.size}")
            kept[arena.index] = os.dup(got[1])
    except BaseException:
        _close_all(list(kept.values()))
        raise
    return kept


def _nothing() -> None:
    pass


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _reaching(buf: Any, pool: int, end: int) -> Any:
    size = buf.size()  # mmap.size(): an fstat of the file, not the mapping's length
    if size < end:
        raise error_from_code(Code.CORRUPT, f"host pool segment {pool} was truncated to {size} bytes by another "
                                            f"process: bytes up to {end} are gone (the daemon restores the file "
                                            f"and drops the entries the cut took)")
    return buf
