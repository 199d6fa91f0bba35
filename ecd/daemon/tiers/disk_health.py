"""Whether the disk tier's filesystem takes writes: the tier's degraded state and its recovery.

The tier is *degraded* while its filesystem refuses writes for a reason that is not the tier's
config and that time or an operator may lift: full (ENOSPC, EDQUOT: another program's files) or
read-only (EROFS: a remount after an error). It becomes so when a start-up probe or any write or
removal fails that way; meanwhile it serves its records (reads need no room), spills and
write-throughs are still tried (each fails alone, as ever: a spill dropped, a PersistFailed), and
a probe (one 4 KiB write, fsync'd, removed, on a worker thread) runs every PROBE_INTERVAL_S until
one succeeds: the state clears then, by itself. Only the probe clears it: the first small write
that fits after a large one failed says the filesystem takes writes again, not a write that a
large record's failure would flip straight back (a nearly full disk would flap per request).

Shown in `ecd status` (DiskStats.degraded), /metrics (ecd_disk_degraded) and the log: a WARNING
when it degrades, an INFO line when it recovers (both at DEBUG within LOG_QUIET_S of the last
warning, so a filesystem on the edge of full cannot flood the log)."""
from __future__ import annotations

import asyncio
import logging
import math
import time
from concurrent.futures import Executor
from typing import Callable

from ...memory import disk as files

log = logging.getLogger("ecd.disk")

DEGRADING_KINDS = ("enospc", "readonly")  # DiskIOError kinds that say the filesystem refuses writes
PROBE_INTERVAL_S = 1.0
LOG_QUIET_S = 60.0


class DiskHealth:
    def __init__(self, path: str) -> None:
        self.path = path
        self.reason = ""  # why the tier is degraded ("" while it is not): "<kind>: <message>"
        self.since = 0.0  # monotonic time it degraded
        self.episodes = 0  # times it degraded, this run
        self._loop: asyncio.AbstractEventLoop | None = None
        self._executor: Callable[[], Executor | None] = lambda: None
        self._recovered: Callable[[bool], None] = lambda direct: None
        self._timer: asyncio.TimerHandle | None = None
        self._probing = False
        self._closed = False
        self._warned_at = -math.inf
        self._loud = True  # this episode's degradation was logged as a warning: so is its end

    @property
    def degraded(self) -> bool:
        return bool(self.reason)

    def seconds(self) -> float:
        return time.monotonic() - self.since if self.reason else 0.0

    def attach(self, loop: asyncio.AbstractEventLoop, executor: Callable[[], Executor | None],
               recovered: Callable[[bool], None]) -> None:
        """Serve: probes run on `executor()`'s threads; `recovered(direct)` is called with the
        probe's O_DIRECT answer when one succeeds. A tier that started degraded probes from now."""
        self._loop, self._executor, self._recovered = loop, executor, recovered
        if self.reason:
            self._schedule()

    def failed(self, error: files.DiskIOError) -> None:
        """A disk operation failed (counted by the caller): degrade when it says the filesystem
        refuses writes."""
        if error.kind in DEGRADING_KINDS:
            self.degrade(f"{error.kind}: {error}")

    def degrade(self, reason: str) -> None:
        if self.reason or self._closed:
            return
        self.reason, self.since = reason, time.monotonic()
        self.episodes += 1
        now = time.monotonic()
        self._loud = now - self._warned_at >= LOG_QUIET_S
        if self._loud:
            self._warned_at = now
        log.log(logging.WARNING if self._loud else logging.DEBUG,
                "pool.disk: disk tier degraded: %s refuses writes (%s): its records are still served, spills and "
                "write-throughs are tried and fail while it does; probing every %gs until a write succeeds", self.path, reason,
                PROBE_INTERVAL_S)
        if self._loop is not None:
            self._schedule()

    def close(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # ---- the probe ------------------------------------------------------------------------

    def _schedule(self) -> None:
        assert self._loop is not None
        if self._timer is None and not self._probing and not self._closed:
            self._timer = self._loop.call_later(PROBE_INTERVAL_S, self._probe)

    def _probe(self) -> None:
        assert self._loop is not None
        self._timer = None
        executor = self._executor()
        if self._closed or not self.reason or executor is None:
            return
        try:
            probe = self._loop.run_in_executor(executor, files.probe_direct_io, self.path)
        except RuntimeError:  # the executor shut down: the daemon is stopping
            return
        self._probing = True
        probe.add_done_callback(self._probed)

    def _probed(self, probe: asyncio.Future) -> None:
        self._probing = False
        if self._closed or probe.cancelled():
            return
        exc = probe.exception()
        if exc is None:
            self._recover(probe.result())
            return
        if isinstance(exc, OSError):  # still full or read-only (or worse: the reason says which)
            self.reason = f"{files.error_kind(exc)}: cannot write in {self.path}: {exc.strerror}"
        else:  # a bug: logged, and the probe goes on
            log.error("pool.disk: the write probe failed", exc_info=exc)
        self._schedule()

    def _recover(self, direct: bool) -> None:
        took = time.monotonic() - self.since
        log.log(logging.INFO if self._loud else logging.DEBUG,
                "pool.disk: disk tier recovered: %s takes writes again (degraded for %.1fs: %s)", self.path, took,
                self.reason)
        self.reason = ""
        self._recovered(direct)
