"""node.toml -> msgspec Structs.

Unknown keys are rejected, sizes ("1GiB", "512MiB", 4096) and durations ("30s", "250ms", 2.5)
are parsed into plain ints/floats, and limits are checked. Every failure becomes one
`ConfigError` line that names the key, e.g. `pool.host.size: must be > 0, got -1`.
"""
from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import msgspec

from .cluster_config import INSECURE_CLUSTER_OPENS, ClusterSection
from .config_types import (ByteSize, Duration, Section, check_field, dec_hook, endpoint_is_loopback,
                           enc_hook)
from .errors import ConfigError
from .events_config import EventsSection
from .memory.allocator import ALIGNMENT as POOL_UNIT


class NodeSection(Section):
    name: str = "dev"
    runtime_dir: str = "/tmp/ecd"
    log_level: str = "info"
    # Group that owns the control socket, the runtime dir and the /dev/shm files (engines join
    # it); "" is the daemon's own primary group. A name or a numeric gid, resolved at start.
    group: str = ""
    # On SIGTERM/SIGINT: refuse new writes, let puts in progress and parked gets finish for up
    # to this long, then exit. A second signal cuts it short.
    shutdown_grace: Duration = Duration(10.0)

    def __post_init__(self) -> None:
        check_field(re.fullmatch(r"[A-Za-z0-9_-]{1,64}", self.name) is not None, "name",
               f"must be 1-64 characters of [A-Za-z0-9_-] (it names /dev/shm files), got {self.name!r}")
        check_field(self.runtime_dir.startswith("/"), "runtime_dir",
               f"must be an absolute path, got {self.runtime_dir!r}")
        check_field(self.log_level.lower() in ("debug", "info", "warning", "error"), "log_level",
               f"must be one of debug, info, warning, error, got {self.log_level!r}")
        check_field(0 <= self.shutdown_grace <= 3600, "shutdown_grace",
               f"must be between 0 and 1 hour, got {float(self.shutdown_grace)}")


class ControlSection(Section):
    endpoint: str = "ipc:///tmp/ecd/ecd.sock"
    # CURVE (pyzmq's zmq.auth): the server's secret key file (as `ecd keygen` writes it) and a
    # directory of allowed client public keys (*.key). Both or neither; applies to any endpoint.
    curve_secret_key: str = ""
    curve_allowed_keys: str = ""
    # A tcp endpoint on a non-loopback address without CURVE is refused unless this is true.
    insecure: bool = False
    # Who may say hello on a local (ipc) connection, beside the socket's file permissions: a peer
    # (uid and groups as the kernel recorded them at connect, SO_PEERCRED / SO_PEERGROUPS) whose
    # uid is in allowed_uids, or whose primary or supplementary gid is in allowed_gids. The
    # daemon's own uid is always admitted. Both empty (the default): the socket's permissions
    # alone decide. A refused client gets PermissionDenied naming its uid. SIGHUP applies changes
    # to hellos from then on. With a tcp endpoint they are a config error (CURVE decides there).
    allowed_uids: list[int] = msgspec.field(default_factory=list)
    allowed_gids: list[int] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        check_field(re.fullmatch(r"(ipc://.+|tcp://[^:]+:\d+)", self.endpoint) is not None, "endpoint",
               f"must be ipc://PATH or tcp://HOST:PORT, got {self.endpoint!r}")
        for name in ("allowed_uids", "allowed_gids"):
            ids = getattr(self, name)
            bad = [i for i in ids if not 0 <= i < 2**32 - 1]  # (uid_t)-1 means "no id" to the kernel
            check_field(not bad, name, f"must be uids/gids between 0 and 4294967294, got {bad[0] if bad else 0}")
            check_field(len(ids) <= 4096, name, f"at most 4096 ids (use a group), got {len(ids)}")
            setattr(self, name, sorted(set(ids)))
            # a silent no-op would leave the operator believing the socket is guarded
            check_field(not ids or self.endpoint.startswith("ipc://"), name,
                        "applies to an ipc:// endpoint only (a tcp client has no uid the daemon can check: "
                        "use curve_allowed_keys)")
        check_field(bool(self.curve_secret_key) == bool(self.curve_allowed_keys),
               "curve_allowed_keys" if self.curve_secret_key else "curve_secret_key",
               "curve_secret_key and curve_allowed_keys must be set together")

    @property
    def curve(self) -> bool:
        return bool(self.curve_secret_key)


class HostPoolSection(Section):
    size: ByteSize = ByteSize(1 << 30)
    # Largest single shm file; the pool is split into ceil(size / segment_size) segments and one
    # entry never spans two, so this is also the largest tensor that fits.
    segment_size: ByteSize = ByteSize(1 << 30)
    # "memfd": sealed memfds handed to local clients over the fd socket beside the control socket
    # (no name in /dev/shm; nobody can truncate them; clients in other IPC namespaces reach them).
    # "named": files /dev/shm/ecd.<node>.<n> that clients open by name (any member of node.group
    # can ftruncate one: ecd/daemon/tiers/host.py limits the damage; see docs/SECURITY.md).
    backing: str = "memfd"

    def __post_init__(self) -> None:
        check_field(self.backing in ("memfd", "named"), "backing",
               f'must be "memfd" or "named", got {self.backing!r}')
        check_field(self.size > 0, "size", f"must be > 0, got {int(self.size)}")
        check_field(self.size <= 1 << 44, "size", f"must be <= 16TiB, got {int(self.size)}")
        check_field(self.segment_size >= 1 << 20, "segment_size",
               f"must be >= 1MiB, got {int(self.segment_size)}")
        # Shared memory comes in pages: "1.5GB" means the next whole 4 KiB page.
        self.size = ByteSize(-(-int(self.size) // 4096) * 4096)
        self.segment_size = ByteSize(-(-int(self.segment_size) // 4096) * 4096)


class CudaPoolSection(Section):
    """`[pool.cuda]`: one daemon-owned arena of `size` bytes on each of `devices`."""

    # CUDA device ordinals as the daemon sees them (its CUDA_VISIBLE_DEVICES applies) or device
    # UUIDs ("GPU-8d0b…", as `nvidia-smi -L` prints them), which do not depend on it.
    devices: list[int | str] = msgspec.field(default_factory=list)
    size: ByteSize = ByteSize(0)  # per device
    # How clients get the arenas: "fd" exports each as a file descriptor handed out on the fd
    # socket (CUDA virtual memory management: reaches clients in other pods and pid namespaces),
    # "ipc" as a legacy CUDA IPC handle in Welcome (clients must share the daemon's pid and IPC
    # namespaces), "auto" is "fd" where the devices and the fd socket allow it, else "ipc".
    export: str = "auto"

    def __post_init__(self) -> None:
        check_field(self.export in ("auto", "fd", "ipc"), "export",
                    f'must be "auto", "fd" or "ipc", got {self.export!r}')
        check_field(len(self.devices) > 0, "devices", "must name at least one device (an ordinal or a GPU UUID)")
        for device in self.devices:
            check_field(isinstance(device, str) and re.fullmatch(r"(GPU|MIG)-[0-9A-Za-z-]+", device) is not None
                   or isinstance(device, int) and 0 <= device < 1024, "devices",
                   f"each must be an ordinal >= 0 or a UUID like 'GPU-8d0b...', got {device!r}")
        check_field(len(set(map(str, self.devices))) == len(self.devices), "devices",
               f"lists a device twice: {self.devices!r}")
        check_field(self.size > 0, "size", f"must be > 0, got {int(self.size)}")
        # CUDA IPC exports whole allocations; 2 MiB is the allocation granularity on current GPUs.
        self.size = ByteSize(-(-int(self.size) // (2 << 20)) * (2 << 20))


class DiskPoolSection(Section):
    """`[pool.disk]`: a second tier on a local filesystem (ecd/daemon/tiers/disk.py): host entries
    evicted for room are spilled there, `put(persist=True)` writes through, a restart re-indexes it."""

    path: str  # a directory on a local filesystem, owned by this daemon alone
    size: ByteSize  # bytes of records (4 KiB headers included) it may hold
    spill: bool = True  # write host entries evicted for room to disk instead of dropping them
    # O_DIRECT: "auto" where the filesystem allows it (not tmpfs before Linux 6.6), true: required
    # (a start error where it is not), false: buffered I/O through the page cache.
    direct_io: bool | str = "auto"
    min_spill_size: ByteSize = ByteSize(64 << 10)  # smaller evicted entries are dropped, not spilled
    spill_buffer: ByteSize = ByteSize(256 << 20)  # RAM for evicted bytes on their way to disk
    io_threads: int = 2  # worker threads doing the disk reads and writes

    def __post_init__(self) -> None:
        check_field(self.path.startswith("/"), "path", f"must be an absolute path, got {self.path!r}")
        check_field(self.size >= 16 << 20, "size", f"must be >= 16MiB, got {int(self.size)}")
        check_field(self.direct_io in (True, False, "auto"), "direct_io",
               f"must be true, false or \"auto\", got {self.direct_io!r}")
        check_field(self.min_spill_size >= 0, "min_spill_size", f"must be >= 0, got {int(self.min_spill_size)}")
        check_field(self.spill_buffer >= 1 << 20, "spill_buffer", f"must be >= 1MiB, got {int(self.spill_buffer)}")
        check_field(1 <= self.io_threads <= 64, "io_threads", f"must be between 1 and 64, got {self.io_threads}")
        self.spill_buffer = ByteSize(-(-int(self.spill_buffer) // 4096) * 4096)


class PoolSection(Section):
    host: HostPoolSection = msgspec.field(default_factory=HostPoolSection)
    cuda: CudaPoolSection | None = None
    disk: DiskPoolSection | None = None


class RingSection(Section):
    slots: int = 65536  # events kept before a slow reader is overrun
    presence_buckets: int = 1 << 20  # words clients read to answer unpinned exists() locally
    # records of the entry index (memory/entry_index.py: 256 bytes each), where clients find an
    # entry's location without asking; 0: none (every first get of a key asks the daemon)
    index_records: int = 1 << 15

    def __post_init__(self) -> None:
        for key, value in (("slots", self.slots), ("presence_buckets", self.presence_buckets)):
            check_field(value >= 64 and value & (value - 1) == 0 and value <= 1 << 26, key,
                   f"must be a power of two between 64 and 2^26, got {value}")
        check_field(self.index_records == 0 or (self.index_records >= 4 and self.index_records & (
            self.index_records - 1) == 0 and self.index_records <= 1 << 22), "index_records",
            f"must be 0 or a power of two between 4 and 2^22, got {self.index_records}")

    def file_bytes(self) -> int:
        """The ring's file: the ring, then the entry index."""
        from .memory.entry_index import index_bytes
        from .memory.ring import ring_bytes
        return ring_bytes(self.slots, self.presence_buckets) + index_bytes(self.index_records)


class RestartSection(Section):
    """`[restart]`: what outlives the daemon's process (ecd/daemon/restart/): the host pool and the
    journal of its committed entries, held by a keeper between two runs, adopted by the next."""

    adopt: bool = True  # keep the host pool's entries across a restart (false: every start is cold)
    # Who holds the pool while no daemon runs: "auto" (systemd's file descriptor store under
    # systemd with FileDescriptorStoreMax=, else a holder process the daemon spawns), "systemd",
    # "spawn" (a holder the daemon spawns), "holder" (an `ecd hold` someone else runs: a sidecar
    # container, a DaemonSet, a unit of its own).
    keeper: str = "auto"
    # How long a holder keeps the pool once no daemon holds it (a crash, a stop): a daemon that
    # starts within it adopts; after it, the pool's memory returns to the machine.
    hold: Duration = Duration(300.0)
    # Bytes of shared memory for the journal of committed entries (0: pool.host.size / 256, at
    # least 16 MiB). A full journal still stores entries, it just cannot adopt them after a restart.
    journal_size: ByteSize = ByteSize(0)

    def __post_init__(self) -> None:
        check_field(self.keeper in ("auto", "systemd", "spawn", "holder"), "keeper",
                    f'must be "auto", "systemd", "spawn" or "holder", got {self.keeper!r}')
        check_field(0 <= self.hold <= 7 * 86400, "hold", f"must be between 0 and 7 days, got {float(self.hold)}")
        check_field(self.journal_size == 0 or 1 << 20 <= self.journal_size <= 16 << 30, "journal_size",
                    f"must be 0 (automatic) or between 1MiB and 16GiB, got {int(self.journal_size)}")


class LeasesSection(Section):
    write_ttl: Duration = Duration(60.0)  # an uncommitted put is aborted after this
    max_pin: Duration = Duration(600.0)  # longest pin exists(pin_s=...) may ask for
    max_wait: Duration = Duration(300.0)  # longest a get may wait for a key to be published
    # Sessions the daemon cannot watch by pid (tcp peers, clients in another pid namespace) send
    # heartbeats; one silent this long loses its leases, pins, parked gets and reservation.
    session_ttl: Duration = Duration(30.0)
    # Read slots (memory/entry_index.py): a view or pin of a known entry without a message. Each of
    # up to `slot_sessions` sessions gets `read_slots` slots (16 bytes each, in shared memory after
    # the pool's first segment; fixed at start); a session without a page, or with its slots all
    # held, asks the daemon. 0 in either: off.
    read_slots: int = 128
    slot_sessions: int = 64
    # Puts without a message (ecd/writes/submission.py): each of up to `slot_sessions` sessions
    # gets a ring of `submit_records` records (256 bytes each, in shared memory beside the read
    # slots; 0: off, every put asks the daemon) and leases of `put_slab` bytes of the pool (at
    # most 1/128 of it) that it places its puts in.
    submit_records: int = 128
    put_slab: ByteSize = ByteSize(16 << 20)

    def __post_init__(self) -> None:
        for key, value in (("write_ttl", self.write_ttl), ("max_pin", self.max_pin),
                           ("max_wait", self.max_wait), ("session_ttl", self.session_ttl)):
            check_field(0 < value <= 86400, key, f"must be between 0 and 1 day, got {float(value)}")
        for key in ("read_slots", "slot_sessions", "submit_records"):
            check_field(0 <= getattr(self, key) <= 4096, key, f"must be between 0 and 4096, got {getattr(self, key)}")
        check_field(64 << 10 <= self.put_slab <= 1 << 40, "put_slab",
                    f"must be between 64 KiB and 1 TiB, got {int(self.put_slab)}")


class LimitsSection(Section):
    max_key_bytes: int = 1024
    max_batch: int = 16384
    max_message_bytes: ByteSize = ByteSize(64 << 20)
    inline_max_bytes: ByteSize = ByteSize(64 << 10)  # puts this small ride in one message
    max_ndim: int = 16
    max_waiters_per_client: int = 4096
    max_leases_per_client: int = 1 << 20
    max_pins_per_client: int = 1 << 20
    # Pinned entries may hold at most this share of each pool (host pool, each CUDA arena), and in
    # the host pool never what guaranteed shares still lack: one client's pins cannot starve the
    # others' puts. A pin past it is not taken (that key's pinned lookup answers "not found").
    pinned_share: float = 0.5
    # Sessions (Hello) at once, in all and from one process; the excess is refused in Welcome's
    # place. Each costs the daemon a connection fd and a share of a pidfd.
    max_clients: int = 1024
    max_clients_per_pid: int = 64
    # Open control connections, with or without a session; the excess is closed as it arrives.
    # Lowered at start when the process's file limit could not hold them (a warning says so).
    max_connections: int = 4096
    # Bytes the daemon holds for one connection: replies it has not read yet, and requests it sent
    # that the daemon has not handled (ZMQ_RCVHWM = this / max_message_bytes, at least 2). A peer
    # past it is disconnected and its session reclaimed: never unbounded growth.
    client_queue_bytes: ByteSize = ByteSize(64 << 20)

    def __post_init__(self) -> None:
        for key in ("max_key_bytes", "max_batch", "max_message_bytes", "max_ndim",
                    "max_waiters_per_client", "max_leases_per_client", "max_pins_per_client",
                    "max_clients", "max_clients_per_pid", "max_connections", "client_queue_bytes"):
            check_field(getattr(self, key) > 0, key, f"must be > 0, got {int(getattr(self, key))}")
        check_field(0 <= self.inline_max_bytes <= self.max_message_bytes // 2, "inline_max_bytes",
               "must be between 0 and half of max_message_bytes")
        check_field(0 < self.pinned_share <= 1, "pinned_share", f"must be in (0, 1], got {self.pinned_share}")


class MetricsSection(Section):
    listen: str = "127.0.0.1:9464"  # "" turns the HTTP endpoint off; port 0 picks a free port
    # HTTP connections open at once; past it the oldest one still waiting for its request is
    # closed, so idle connections can neither starve the scraper nor take the daemon's fds.
    max_connections: int = 64

    def __post_init__(self) -> None:
        check_field(0 < self.max_connections <= 65536, "max_connections",
               f"must be between 1 and 65536, got {self.max_connections}")
        if self.listen == "":
            return
        host, sep, port = self.listen.rpartition(":")
        check_field(bool(sep) and bool(host) and port.isdigit() and 0 <= int(port) < 65536, "listen",
               f"must be HOST:PORT (or \"\" for off), got {self.listen!r}")

    @property
    def address(self) -> tuple[str, int] | None:
        if not self.listen:
            return None
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]"), int(port)


class NamespaceSection(Section):
    """`[namespaces.NAME]`: per-tenant policy for the keys of one namespace."""

    # Most bytes this namespace may hold in the host pool (0: no quota). Over it, the namespace
    # evicts its own least recently used entries first; QuotaExceeded when none can go.
    quota: ByteSize = ByteSize(0)
    # Bytes of this namespace that other namespaces' allocations never evict.
    guaranteed: ByteSize = ByteSize(0)
    # Producers store an xxh3-64 checksum with every entry; consumers verify it on every read.
    verify: bool = False

    def __post_init__(self) -> None:
        # The pool hands out whole 256-byte units: quota = "1000" would refuse a 1000-byte entry.
        for key, value in (("quota", self.quota), ("guaranteed", self.guaranteed)):
            check_field(value >= 0, key, f"must be >= 0, got {int(value)}")
            check_field(value % POOL_UNIT == 0, key, f"must be a multiple of {POOL_UNIT} bytes (entries take "
                                                f"whole {POOL_UNIT}-byte units), got {int(value)}")
        check_field(self.quota == 0 or self.guaranteed <= self.quota, "guaranteed",
               f"must be <= quota ({int(self.quota)}), got {int(self.guaranteed)}")


TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
DEFAULT_TENANT = "default"  # who matches no other tenant: its namespaces are the names clients say


class TenantSection(Section):
    """`[tenants.NAME]`: whose clients are this tenant's (docs/SECURITY.md, Tenants). A tenant's
    namespaces are its own: the same name in two tenants is two namespaces."""

    uids: list[int] = msgspec.field(default_factory=list)  # local clients by SO_PEERCRED uid
    gids: list[int] = msgspec.field(default_factory=list)  # or by primary / supplementary gid
    curve_keys: list[str] = msgspec.field(default_factory=list)  # remote clients by CURVE public key (Z85)
    admit: bool = True  # [tenants.default] only (`[tenants] default = false`): clients of no tenant refused
    # Its part of the host pool, segments of its own (docs/SECURITY.md, Tenants), and its quota in all tiers.
    # 0: none (it shares the default tenant's segments); the default tenant has what the others leave.
    size: ByteSize = ByteSize(0)

    def __post_init__(self) -> None:
        for name in ("uids", "gids"):
            ids = getattr(self, name)
            bad = [i for i in ids if not 0 <= i < 2**32 - 1]
            check_field(not bad, name, f"must be uids/gids between 0 and 4294967294, got {bad[0] if bad else 0}")
            setattr(self, name, sorted(set(ids)))
        check_field(self.size >= 0 and self.size % POOL_UNIT == 0, "size",
                    f"must be a multiple of {POOL_UNIT} bytes >= 0 (entries take whole units), got {int(self.size)}")
        bad_keys = [k for k in self.curve_keys if not re.fullmatch(r"[0-9A-Za-z.:+=^!/*?&<>()\[\]{}@%$#-]{40}", k)]
        check_field(not bad_keys, "curve_keys", f"must be 40-character Z85 public keys (ecd keygen writes them), "
                                                f"got {bad_keys[0][:48] if bad_keys else ''!r}")


def _check_tenants(config: "Config") -> None:
    """Every id names one tenant at most (a client belongs to exactly one); the default tenant
    lists none (it is who matches no other); ids by the kind of endpoint that can see them."""
    seen: dict[tuple[str, object], str] = {}
    for name, tenant in config.tenants.items():
        check_field(TENANT_NAME.fullmatch(name) is not None, f"tenants.{name}",
                    "a tenant name is 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit")
        if name == DEFAULT_TENANT:
            check_field(not (tenant.uids or tenant.gids or tenant.curve_keys), "tenants.default",
                        "lists no ids: the default tenant is every client that matches no other tenant")
            check_field(not tenant.size, "tenants.default.size", "none: it has what the other tenants leave")
            continue
        check_field(tenant.admit, f"tenants.{name}.admit", "applies to [tenants.default] only")
        for kind in ("uids", "gids", "curve_keys"):
            for ident in getattr(tenant, kind):
                other = seen.setdefault((kind, ident), name)
                check_field(other == name, f"tenants.{name}.{kind}",
                            f"{ident} is tenants.{other}.{kind}'s too: a client belongs to exactly one tenant")
        local = tenant.uids or tenant.gids
        check_field(not local or config.control.endpoint.startswith("ipc://"), f"tenants.{name}",
                    "uids/gids identify clients of an ipc:// endpoint only (a tcp client has no uid the daemon "
                    "can check: name its curve_keys)")
        check_field(not tenant.curve_keys or bool(config.control.curve), f"tenants.{name}.curve_keys",
                    "needs control.curve_secret_key and control.curve_allowed_keys (the keys are CURVE's)")
    sizes, host = sum(int(tenant.size) for tenant in config.tenants.values()), int(config.pool.host.size)
    check_field(not sizes or config.pool.host.backing == "memfd", "tenants", 'sizes need [pool.host] backing = '
                "\"memfd\": a sized tenant's segments are its own, and named files open to the daemon's whole group")
    check_field(sizes < host, "tenants", f"sizes add up to {sizes} bytes: they must leave part of pool.host.size "
                                         f"({host}) to the default tenant (its segments hold the read slots)")


class Config(Section):
    node: NodeSection = msgspec.field(default_factory=NodeSection)
    control: ControlSection = msgspec.field(default_factory=ControlSection)
    pool: PoolSection = msgspec.field(default_factory=PoolSection)
    ring: RingSection = msgspec.field(default_factory=RingSection)
    leases: LeasesSection = msgspec.field(default_factory=LeasesSection)
    restart: RestartSection = msgspec.field(default_factory=RestartSection)
    limits: LimitsSection = msgspec.field(default_factory=LimitsSection)
    metrics: MetricsSection = msgspec.field(default_factory=MetricsSection)
    cluster: ClusterSection = msgspec.field(default_factory=ClusterSection)
    events: EventsSection = msgspec.field(default_factory=EventsSection)
    namespaces: dict[str, NamespaceSection] = msgspec.field(default_factory=dict)
    tenants: dict[str, TenantSection] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_tenants(self)
        # Quotas and guaranteed shares count an entry's bytes in every tier (host and CUDA arenas).
        pool, what = int(self.pool.host.size), "pool.host.size"
        check_field(self.pool.cuda is None or self.pool.cuda.export != "fd" or self.pool.host.backing == "memfd",
                    "pool.cuda.export", '"fd" hands the arenas out on the fd socket, which needs '
                    '[pool.host] backing = "memfd"')
        # named files open to the daemon's group: a member the lists refuse would still map the pool (issue 40)
        for key in ("allowed_uids", "allowed_gids"):
            check_field(not getattr(self.control, key) or self.pool.host.backing == "memfd", f"control.{key}",
                        'protects nothing with [pool.host] backing = "named" (its files open to the daemon\'s whole '
                        'group): use backing = "memfd" (the default: the fd socket hands the pool to admitted clients)')
        if self.pool.cuda is not None:
            pool += int(self.pool.cuda.size) * len(self.pool.cuda.devices)
            what = "pool.host.size plus the CUDA arenas"
        for name, ns in self.namespaces.items():
            check_field(0 < len(name.encode()) <= self.limits.max_key_bytes, f"namespaces.{name}",
                   "namespace name must be 1 to limits.max_key_bytes bytes")
            check_field(ns.quota <= pool, f"namespaces.{name}.quota",
                   f"must be <= {what} ({pool}), got {int(ns.quota)}")
        guaranteed, sizes = (sum(int(s.guaranteed) for s in self.namespaces.values()),
                             sum(int(t.size) for t in self.tenants.values()))
        check_field(guaranteed + sizes <= pool, "tenants" if sizes else "namespaces",
                    f"guaranteed shares{' and tenant sizes' if sizes else ''} add up to {guaranteed + sizes} bytes, "
                    f"more than {what} ({pool})")

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self, enc_hook=enc_hook)

    def client_ids(self) -> tuple[set[int], set[int]]:
        """The uids and gids named as local clients: [control] allowed_uids / allowed_gids and
        every tenant's (admitted once either list is set; the sockets give each an ACL entry)."""
        uids, gids = set(self.control.allowed_uids), set(self.control.allowed_gids)
        for tenant in self.tenants.values():
            uids.update(tenant.uids)
            gids.update(tenant.gids)
        return uids, gids


def check_control_policy(config: Config) -> None:
    """Start-time rule (also run by `ecd check-config`): a tcp endpoint reachable from the network
    needs CURVE, or an explicit `insecure = true`. Raises ConfigError naming the key."""
    control = config.control
    if not endpoint_is_loopback(control.endpoint) and not control.curve and not control.insecure:
        raise ConfigError(f"control.endpoint: {control.endpoint} is not a loopback address: set "
                          "control.curve_secret_key and control.curve_allowed_keys, or "
                          "control.insecure = true to serve it without authentication")


def check_cluster_policy(config: Config) -> None:
    """Start-time rule: `cluster.listen` needs CURVE (peers authenticate each other both ways, so only
    allowed peers get data tokens) or `insecure = true`, on loopback too (every local user reaches it)."""
    cluster = config.cluster
    if cluster.enabled and not cluster.curve and not cluster.insecure:
        raise ConfigError(f"cluster.listen: {cluster.listen} has no authentication: set "
                          "cluster.curve_secret_key and cluster.curve_allowed_keys (CURVE), or "
                          f"cluster.insecure = true, under which {INSECURE_CLUSTER_OPENS}")
    if cluster.peers and not cluster.enabled:
        raise ConfigError("cluster.peers: set cluster.listen too (peers answer on it)")


_PATH_IN_MESSAGE = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)


def _one_line(error: msgspec.ValidationError) -> str:
    """Turn msgspec's "Expected `int`, got `str` - at `$.pool.host.size`" into
    "pool.host.size: expected int, got str" (the key first, then the problem)."""
    match = _PATH_IN_MESSAGE.match(str(error))
    assert match is not None
    message, path = match.group("msg"), (match.group("path") or "").lstrip(".")
    unknown = re.match(r"Object contains unknown field `([^`]+)`", message)
    if unknown:
        key = f"{path}.{unknown.group(1)}" if path else unknown.group(1)
        return f"{key}: unknown key"
    message = message.replace("`", "")
    inner = re.match(r"^([A-Za-z_]+): (.*)$", message)  # our check_field() already named the leaf
    if inner and "Expected" not in message:
        return f"{path}.{inner.group(1)}: {inner.group(2)}" if path else message
    return f"{path}: {message[0].lower()}{message[1:]}" if path else message


def _check_named_tables(data: dict[str, Any], section: str, kind: type) -> None:
    """msgspec reports a bad value inside a dict as `namespaces[...]`; check each table first so
    the error names the namespace (or tenant): `namespaces.tenant-a.quota: ...`."""
    tables = data.get(section)
    if not isinstance(tables, dict):
        return
    for name, table in tables.items():
        try:
            msgspec.convert(table, kind, dec_hook=dec_hook)
        except msgspec.ValidationError as exc:
            line = _one_line(exc)
            where = f"{section}.{name}" if line.startswith("Expected") else f"{section}.{name}."
            raise ConfigError(f"{where}{line}".replace("Expected", ": expected", 1)) from None


def load_config(data: dict[str, Any]) -> Config:
    tenants = data.get("tenants")
    if isinstance(tenants, dict) and isinstance(tenants.get(DEFAULT_TENANT), bool):
        # `[tenants] default = false`: the default tenant's table, said short
        data = {**data, "tenants": {**tenants, DEFAULT_TENANT: {"admit": tenants[DEFAULT_TENANT]}}}
    _check_named_tables(data, "namespaces", NamespaceSection)
    _check_named_tables(data, "tenants", TenantSection)
    try:
        return msgspec.convert(data, Config, dec_hook=dec_hook)
    except msgspec.ValidationError as exc:
        raise ConfigError(_one_line(exc)) from None


def load_config_file(path: str | Path) -> Config:
    path = Path(path)
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not valid UTF-8 (byte {exc.start}): {exc.reason}") from None
    try:
        return load_config(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def dumps_toml(config: Config) -> str:
    """Render the effective config as TOML (what `ecd check-config` prints)."""
    lines: list[str] = []

    def emit(prefix: str, table: dict[str, Any]) -> None:
        # None is an absent optional table (e.g. [pool.cuda]): TOML has no null
        scalars = {k: v for k, v in table.items() if not isinstance(v, dict) and v is not None}
        if scalars:
            lines.append(f"[{prefix}]")
            for key, value in scalars.items():
                if not re.fullmatch(r"[A-Za-z0-9_-]+", key):  # e.g. cluster.peer_keys' endpoints
                    key = json.dumps(key, ensure_ascii=False)
                if isinstance(value, (str, list)):  # JSON strings and arrays of them are TOML too
                    lines.append(f"{key} = {json.dumps(value, ensure_ascii=False)}")
                elif isinstance(value, bool):
                    lines.append(f"{key} = {str(value).lower()}")
                else:
                    lines.append(f"{key} = {value}")
            lines.append("")
        for key, value in table.items():
            if isinstance(value, dict):
                emit(f"{prefix}.{key}" if prefix else key, value)

    emit("", config.to_dict())
    return "\n".join(lines)
