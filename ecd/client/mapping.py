"""One daemon epoch's shared memory as this process maps it (the data plane's side of a Client).

`EpochMapping`: the host pools mapped read-write and read-only and the event ring, or nothing but a
`NoRing` for a client on another host. Only `ecd.Client` (tensors) maps them: the control-plane
`ControlClient` (ecd.client.control) never imports this module, so it loads neither numpy (the
ring reader's) nor torch.
"""
from __future__ import annotations

import os
import time
from typing import Any

from ..errors import Code, EcdError, InvalidRequest, ProtocolError, error_from_code
from ..memory.host import ShmError, ShmFile, shm_path
from ..memory.ring import ASK, RingReader
from ..protocol import Extent, Location, Welcome

# How long a client that finds the ring's header overwritten waits for the daemon to rewrite it
# (it does every 0.1 s heartbeat) before it gives up on the ring.
RING_REPAIR_WAIT_S = 0.5


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
                self.ring: RingReader | NoRing = NoRing()
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
                f"pools are not mapped: this client is not on the daemon's node ({self.node}), it reached it "
                f"over tcp; {what} moves bytes through shared memory. From here: exists, delete, keys, stats, evict, ping "
                f"and puts of up to {inline_max} bytes")

    def check(self, loc: Location) -> None:
        size = self.sizes[loc.pool] if 0 <= loc.pool < len(self.sizes) else self.arena_sizes.get(loc.pool)
        if size is None or not (0 <= loc.offset and loc.offset + loc.nbytes <= size):
            raise ProtocolError(f"daemon sent a location outside its pools: {loc}")

    def rw_for(self, pool: int, offset: int, nbytes: int) -> Any:
        """The read-write mapping of host pool segment `pool`, once its file is seen to reach past
        offset + nbytes (one fstat, ~1 us): a member of the group may have truncated it, and the
        first access past its end would kill this process (SIGBUS). IntegrityError instead (the
        daemon restores the file, and drops what the cut took, at its next check)."""
        return _reaching(self.rw[pool], pool, offset + nbytes)

    def ro_for(self, pool: int, offset: int, nbytes: int) -> Any:
        """rw_for for the read-only mapping."""
        return _reaching(self.ro[pool], pool, offset + nbytes)

    def is_arena(self, pool: int) -> bool:
        return pool >= len(self.sizes)

    def fits(self, extent: Extent, arena: int) -> bool:
        """Whether an extent lies in the tier a put asks for (arena -1: the host pool)."""
        return extent.pool == arena if arena >= 0 else 0 <= extent.pool < len(self.sizes)


def _reaching(buf: Any, pool: int, end: int) -> Any:
    size = buf.size()  # mmap.size(): an fstat of the file, not the mapping's length
    if size < end:
        raise error_from_code(Code.CORRUPT, f"host pool segment {pool} was truncated to {size} bytes by another "
                                            f"process: bytes up to {end} are gone (the daemon restores the file "
                                            f"and drops the entries the cut took)")
    return buf
