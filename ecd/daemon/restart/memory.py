"""The daemon's shared memory at start and at exit: the host pool (adopted from the keeper, or
new), the journal of its entries, the keeper that holds both between runs, and the event ring
(always new: its epoch is this run's).

At exit the keeper goes on holding the pool and the journal (keeper.py says until when), so the
daemon closes its own descriptors and leaves named files in place; without a keeper
(`[restart] adopt = false`, or none could be had) the memory goes with the process, as it always did.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from ...memory import kernel_copy
from ...memory.host import RING_FILE_MODE, HostPool, ShmFile, remove_stale, ring_name, shm_path
from ...memory.journal import Journal, JournalRefused, NullJournal
from ...memory.memfd import RING_SEALS, MemfdFile, MemfdPool
from ...memory.ring import RingWriter, tenant_namespace
from ...protocol import RestartStats
from .adopt import Kept, adopt_entries, create_journal, kept_fds, open_kept, pool_layout, segment_sizes
from .keeper import NoKeeper, PoolKeeper, choose_keeper

if TYPE_CHECKING:  # pragma: no cover
    from ...config import Config
    from ..registry.store import Store

log = logging.getLogger("ecd.daemon")


@dataclass(eq=False)
class Memory:
    pool: HostPool
    ring_file: ShmFile
    ring: RingWriter
    keeper: PoolKeeper = field(default_factory=NoKeeper)
    journal: Journal | NullJournal = field(default_factory=NullJournal)
    journal_file: ShmFile | None = None
    journal_key_fd: int = -1  # the journal's MAC key (restart/adopt.py): a sealed memfd
    kept: Kept | None = None  # the previous run's pool, until adopt_entries
    restart: RestartStats = field(default_factory=RestartStats)
    held: bool = False  # the keeper holds this pool (adopted from it, or handed to it)
    # Each sized tenant's own segments (pool_layout) and event ring (its file and writer), by tenant
    # name: its clients map those and nothing else. (The keeper keeps none of these rings: their
    # heartbeats stop with the node's ring, whose quiet the next run waits for.)
    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)
    tenant_rings: dict[str, tuple[MemfdFile, RingWriter]] = field(default_factory=dict)

    def beat(self) -> None:
        """Every ring's heartbeat (the daemon's timer; clients trust a ring while it beats). The
        node's last: a next run waits for its quiet (the keeper keeps it), which then covers all."""
        for _, ring in self.tenant_rings.values():
            ring.heartbeat()
        self.ring.heartbeat()

    def tenant_parts(self) -> dict[str, tuple[tuple[int, ...], MemfdFile]]:
        """What the fd socket hands a sized tenant's clients: its segments and its ring's file."""
        return {name: (pools, self.tenant_rings[name][0]) for name, pools in self.groups.items()}

    def adopt_entries(self, store: "Store", quarantine_s: float) -> None:
        """Give the store the journal and, for an adopted pool, its entries (before serving)."""
        store.journal = self.journal
        store.announcer.tenant_rings = {tenant_namespace(name, ""): ring for name, (_, ring) in self.tenant_rings.items()}
        kept, self.kept = self.kept, None
        if kept is None:
            return
        # Clients still map the previous run's ring, and validate copies against it until its
        # heartbeat is READER_TRUST_S old (client/local_read.py). An adopted extent must not be
        # reused before then: this run serves (and frees) only after.
        quiet_in = kept.old_ring_quiet_at - time.monotonic()
        if quiet_in > 0:
            log.info("restart: waiting %.2fs for clients to stop trusting the previous run's event ring", quiet_in)
            time.sleep(quiet_in)
        stats = adopt_entries(store, kept, quarantine_s)
        self.restart = msgspec.structs.replace(stats, keeper=self.restart.keeper)
        log.info("restart: adopted %d entries (%d bytes) of the previous run's pool in %.3fs; %d unfinished "
                 "write(s) kept out of use for %gs, %d journal record(s) skipped", stats.entries, stats.bytes,
                 stats.seconds, stats.quarantined, quarantine_s, stats.skipped_records)

    def hand_to_keeper(self, backing: str) -> None:
        """Once the daemon's start can no longer fail: the keeper holds the pool from now on (a
        start that fails earlier leaves no holder behind, nor a pool in one)."""
        if self.journal_file is None:
            return
        named = [] if backing == "memfd" else [shm_path(s.name) for s in self.pool.segments] + [
            shm_path(self.journal_file.name)]
        try:
            self.keeper.keep(kept_fds(self.pool, self.journal_file, self.journal_key_fd, self.ring_file.fd), named)
            self.held = True
        except Exception as exc:
            log.warning("restart: the %s keeper did not take the pool (%s): it will not be adopted after a "
                        "restart", self.keeper.kind, exc)
            self.keeper = NoKeeper()
            self.restart.keeper = "none"

    def kept_line(self, hold_s: float, config_path: str | None) -> str | None:
        """What a stop leaves behind and how to return it, for the shutdown's log line (None: nothing)."""
        if not self.held:
            return None
        holder = getattr(self.keeper, "holder_pid", 0)
        return (f"the {self.keeper.kind} keeper{f' (pid {holder})' if holder else ''} keeps the host pool "
                f"({sum(segment.size for segment in self.pool.segments)} bytes) for the next start, for up to "
                f"{hold_s:g} s (`[restart] hold`); `ecd release --config {config_path or 'node.toml'}` returns its "
                "memory now (systemd: `systemctl stop` does)")

    def stats(self) -> RestartStats:
        return msgspec.structs.replace(self.restart, journal_records=self.journal.records,
                                       journal_full=self.journal.full)

    def close(self) -> None:
        """This process lets go of the memory; a keeper holds on to the pool and the journal."""
        for ring_file, ring in [*self.tenant_rings.values(), (self.ring_file, self.ring)]:  # the node's last
            ring.close()
            ring_file.unlink()
        keeping = self.held  # a start that failed before the hand-over keeps nothing: named files go
        if self.journal_key_fd >= 0:
            os.close(self.journal_key_fd)
            self.journal_key_fd = -1
        if self.journal_file is not None:
            if keeping:
                self.journal_file.close_fd()
            else:
                self.journal_file.unlink()
        self.pool.close(keep_names=keeping)
        self.keeper.close()


def open_memory(config: "Config", gid: int, epoch: int) -> Memory:
    """The memory of this run (ShmError when it cannot be had: nothing is left behind then)."""
    host, node = config.pool.host, config.node.name
    restart = RestartStats()
    keeper, kept = _take_kept(config, restart)
    keep = frozenset() if kept is None else frozenset([s.name for s in kept.pool.segments] + [kept.journal_file.name])
    stale = remove_stale(node, keep)
    if stale:
        log.info("removed %d stale shm file(s) of a previous run: %s", len(stale), ", ".join(stale))
    pool: HostPool | None = None
    journal_file: ShmFile | None = None
    journal: Journal | NullJournal = NullJournal()
    key_fd = -1
    try:
        if kept is not None:
            pool, journal_file, journal, key_fd = kept.pool, kept.journal_file, kept.journal, kept.key_fd
        elif host.backing == "memfd":  # sealed: no one can truncate them (memory/memfd.py)
            pool = MemfdPool(node, segment_sizes(config))
        else:
            pool = HostPool(node, segment_sizes(config), gid)
        if kept is None and keeper.kind != "none":
            journal_file, journal, key_fd = create_journal(config)
        ring_size = config.ring.file_bytes()
        if host.backing == "memfd":
            ring_file: ShmFile = MemfdFile.create_sealed(ring_name(node), ring_size, seals=RING_SEALS)
        else:
            # 0640: clients map the ring read-only, so no engine in the group can write into it
            ring_file = ShmFile.create(ring_name(node), ring_size, gid, mode=RING_FILE_MODE)
    except BaseException:
        if key_fd >= 0:
            os.close(key_fd)
        if journal_file is not None:
            journal_file.unlink()
        if pool is not None:
            pool.close()
        keeper.close()
        raise
    if host.backing == "named" and not kernel_copy.available():
        log.warning("process_vm_writev is not available (a seccomp filter?): inline puts copy into the pool "
                    "after a size check, and a pool file truncated in between would crash the daemon")
    ring = RingWriter(ring_file.buf, config.ring.slots, config.ring.presence_buckets, epoch, config.ring.index_records)
    memory = Memory(pool, ring_file, ring, keeper, journal, journal_file, key_fd, kept, restart, held=kept is not None,
                    groups=pool_layout(config)[1])
    try:  # (sized tenants need backing = "memfd": config.py)
        for name in memory.groups:
            tenant_file = MemfdFile.create_sealed(f"{ring_name(node)}.{name}", ring_file.size, seals=RING_SEALS)
            try:
                memory.tenant_rings[name] = (tenant_file, RingWriter(tenant_file.buf, config.ring.slots,
                                                                     config.ring.presence_buckets, epoch,
                                                                     config.ring.index_records))
            except BaseException:
                tenant_file.unlink()
                raise
    except BaseException:
        memory.close()
        raise
    return memory


def _take_kept(config: "Config", restart: RestartStats) -> tuple[PoolKeeper, Kept | None]:
    """The keeper, and what the previous run left with it when that is this config's pool (None,
    with one log line saying why when something was kept, for a cold start)."""
    if not config.restart.adopt:
        return NoKeeper(), None
    began = time.perf_counter()
    try:
        keeper = choose_keeper(config.restart, config.node.name, config.node.runtime_dir)
        fds = keeper.take()
    except Exception as exc:  # KeeperUnavailable and the like: serve anyway, cold
        log.warning("restart: no keeper for the pool (%s): this start is cold and the pool will not be "
                    "adopted after the next restart", exc)
        return NoKeeper(), None
    restart.keeper = keeper.kind
    if not fds:
        return keeper, None
    taking = time.perf_counter() - began
    try:
        kept = open_kept(config, fds)
        kept.opened_s += taking  # the adoption's time counts the keeper's hand-back too
        return keeper, kept
    except (JournalRefused, OSError, ValueError) as exc:
        for fd in fds.values():
            os.close(fd)
        restart.refused = str(exc)
        log.warning("restart: the pool the previous run left was not adopted: %s; starting cold", exc)
        try:  # its memory goes now, before a new pool is allocated beside it (a pod's limit holds one)
            keeper.keep({}, [])
        except Exception as drop_failed:
            log.warning("restart: the keeper still holds the refused pool (%s) until it lets go", drop_failed)
        return keeper, None
