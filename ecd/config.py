"""node.toml -> msgspec Structs.

Unknown keys are rejected, sizes ("1GiB", "512MiB", 4096) and durations ("30s", "250ms", 2.5)
are parsed into plain ints/floats, and limits are checked. Every failure becomes one
`ConfigError` line that names the key, e.g. `pool.host.size: must be > 0, got -1`.
"""
from __future__ import annotations

import ipaddress
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import msgspec

from .errors import ConfigError
from .memory.allocator import ALIGNMENT as POOL_UNIT


class ByteSize(int):
    """A byte count written as an int or as "64KiB", "1GiB", "1.5GB", "4096"."""


class Duration(float):
    """Seconds written as a number or as "250ms", "30s", "5m", "1h"."""


_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}
# (multiplier, divisor): dividing by 1000 keeps "9ms" exact where multiplying by 1e-3 would not
_DURATION_UNITS = {"": (1, 1), "us": (1, 1_000_000), "ms": (1, 1000), "s": (1, 1), "m": (60, 1),
                   "min": (60, 1), "h": (3600, 1)}
_NUMBER_WITH_UNIT = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"expected a size like '1GiB', got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        match = _NUMBER_WITH_UNIT.match(value)
        if match and match.group(2).lower() in _SIZE_UNITS:
            return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
    raise ValueError(f"expected a size like '1GiB' or '512MiB', got {value!r}")


def parse_duration(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"expected a duration like '30s', got {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        match = _NUMBER_WITH_UNIT.match(value)
        if match and match.group(2).lower() in _DURATION_UNITS:
            multiplier, divisor = _DURATION_UNITS[match.group(2).lower()]
            return float(match.group(1)) * multiplier / divisor
    raise ValueError(f"expected a duration like '30s' or '250ms', got {value!r}")


def _dec_hook(type_: type, obj: Any) -> Any:
    if type_ is ByteSize:
        return ByteSize(parse_size(obj))
    if type_ is Duration:
        return Duration(parse_duration(obj))
    raise NotImplementedError(type_)


def format_size(nbytes: int) -> str:
    for unit, factor in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if nbytes >= factor and nbytes % factor == 0:
            return f"{nbytes // factor}{unit}"
    return str(nbytes)


def format_duration(seconds: float) -> str:
    return f"{seconds * 1000:g}ms" if seconds < 1 else f"{seconds:g}s"


def _enc_hook(obj: Any) -> Any:
    # Print sizes and durations the way they are written in node.toml.
    if isinstance(obj, ByteSize):
        return format_size(int(obj))
    if isinstance(obj, Duration):
        text = format_duration(float(obj))
        return text if parse_duration(text) == float(obj) else float(obj)  # never print a rounding
    raise NotImplementedError(type(obj))


def _check(condition: bool, key: str, message: str) -> None:
    # Raised inside __post_init__, msgspec re-raises it as a ValidationError with the path.
    if not condition:
        raise ValueError(f"{key}: {message}")


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class NodeSection(_Section):
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
        _check(re.fullmatch(r"[A-Za-z0-9_-]{1,64}", self.name) is not None, "name",
               f"must be 1-64 characters of [A-Za-z0-9_-] (it names /dev/shm files), got {self.name!r}")
        _check(self.runtime_dir.startswith("/"), "runtime_dir",
               f"must be an absolute path, got {self.runtime_dir!r}")
        _check(self.log_level.lower() in ("debug", "info", "warning", "error"), "log_level",
               f"must be one of debug, info, warning, error, got {self.log_level!r}")
        _check(0 <= self.shutdown_grace <= 3600, "shutdown_grace",
               f"must be between 0 and 1 hour, got {float(self.shutdown_grace)}")


class ControlSection(_Section):
    endpoint: str = "ipc:///tmp/ecd/ecd.sock"
    # CURVE (pyzmq's zmq.auth): the server's secret key file (as `ecd keygen` writes it) and a
    # directory of allowed client public keys (*.key). Both or neither; applies to any endpoint.
    curve_secret_key: str = ""
    curve_allowed_keys: str = ""
    # A tcp endpoint on a non-loopback address without CURVE is refused unless this is true.
    insecure: bool = False

    def __post_init__(self) -> None:
        _check(re.fullmatch(r"(ipc://.+|tcp://[^:]+:\d+)", self.endpoint) is not None, "endpoint",
               f"must be ipc://PATH or tcp://HOST:PORT, got {self.endpoint!r}")
        _check(bool(self.curve_secret_key) == bool(self.curve_allowed_keys),
               "curve_allowed_keys" if self.curve_secret_key else "curve_secret_key",
               "curve_secret_key and curve_allowed_keys must be set together")

    @property
    def curve(self) -> bool:
        return bool(self.curve_secret_key)


class HostPoolSection(_Section):
    size: ByteSize = ByteSize(1 << 30)
    # Largest single shm file; the pool is split into ceil(size / segment_size) segments and one
    # entry never spans two, so this is also the largest tensor that fits.
    segment_size: ByteSize = ByteSize(1 << 30)

    def __post_init__(self) -> None:
        _check(self.size > 0, "size", f"must be > 0, got {int(self.size)}")
        _check(self.size <= 1 << 44, "size", f"must be <= 16TiB, got {int(self.size)}")
        _check(self.segment_size >= 1 << 20, "segment_size",
               f"must be >= 1MiB, got {int(self.segment_size)}")
        # Shared memory comes in pages: "1.5GB" means the next whole 4 KiB page.
        self.size = ByteSize(-(-int(self.size) // 4096) * 4096)
        self.segment_size = ByteSize(-(-int(self.segment_size) // 4096) * 4096)


class CudaPoolSection(_Section):
    """`[pool.cuda]`: one daemon-owned arena of `size` bytes on each of `devices`."""

    # CUDA device ordinals as the daemon sees them (its CUDA_VISIBLE_DEVICES applies) or device
    # UUIDs ("GPU-8d0b…", as `nvidia-smi -L` prints them), which do not depend on it.
    devices: list[int | str] = msgspec.field(default_factory=list)
    size: ByteSize = ByteSize(0)  # per device

    def __post_init__(self) -> None:
        _check(len(self.devices) > 0, "devices", "must name at least one device (an ordinal or a GPU UUID)")
        for device in self.devices:
            _check(isinstance(device, str) and re.fullmatch(r"(GPU|MIG)-[0-9A-Za-z-]+", device) is not None
                   or isinstance(device, int) and 0 <= device < 1024, "devices",
                   f"each must be an ordinal >= 0 or a UUID like 'GPU-8d0b...', got {device!r}")
        _check(len(set(map(str, self.devices))) == len(self.devices), "devices",
               f"lists a device twice: {self.devices!r}")
        _check(self.size > 0, "size", f"must be > 0, got {int(self.size)}")
        # CUDA IPC exports whole allocations; 2 MiB is the allocation granularity on current GPUs.
        self.size = ByteSize(-(-int(self.size) // (2 << 20)) * (2 << 20))


class DiskPoolSection(_Section):
    """`[pool.disk]`: a second tier on a local filesystem (ecd/daemon/disk_tier.py): host entries
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
        _check(self.path.startswith("/"), "path", f"must be an absolute path, got {self.path!r}")
        _check(self.size >= 16 << 20, "size", f"must be >= 16MiB, got {int(self.size)}")
        _check(self.direct_io in (True, False, "auto"), "direct_io",
               f"must be true, false or \"auto\", got {self.direct_io!r}")
        _check(self.min_spill_size >= 0, "min_spill_size", f"must be >= 0, got {int(self.min_spill_size)}")
        _check(self.spill_buffer >= 1 << 20, "spill_buffer", f"must be >= 1MiB, got {int(self.spill_buffer)}")
        _check(1 <= self.io_threads <= 64, "io_threads", f"must be between 1 and 64, got {self.io_threads}")
        self.spill_buffer = ByteSize(-(-int(self.spill_buffer) // 4096) * 4096)


class PoolSection(_Section):
    host: HostPoolSection = msgspec.field(default_factory=HostPoolSection)
    cuda: CudaPoolSection | None = None
    disk: DiskPoolSection | None = None


class RingSection(_Section):
    slots: int = 65536  # events kept before a slow reader is overrun
    presence_buckets: int = 1 << 20  # words clients read to answer unpinned exists() locally

    def __post_init__(self) -> None:
        for key, value in (("slots", self.slots), ("presence_buckets", self.presence_buckets)):
            _check(value >= 64 and value & (value - 1) == 0 and value <= 1 << 26, key,
                   f"must be a power of two between 64 and 2^26, got {value}")


class LeasesSection(_Section):
    write_ttl: Duration = Duration(60.0)  # an uncommitted put is aborted after this
    max_pin: Duration = Duration(600.0)  # longest pin exists(pin_s=...) may ask for
    max_wait: Duration = Duration(300.0)  # longest a get may wait for a key to be published
    # Sessions the daemon cannot watch by pid (tcp peers, clients in another pid namespace) send
    # heartbeats; one silent this long loses its leases, pins, parked gets and reservation.
    session_ttl: Duration = Duration(30.0)

    def __post_init__(self) -> None:
        for key, value in (("write_ttl", self.write_ttl), ("max_pin", self.max_pin),
                           ("max_wait", self.max_wait), ("session_ttl", self.session_ttl)):
            _check(0 < value <= 86400, key, f"must be between 0 and 1 day, got {float(value)}")


class LimitsSection(_Section):
    max_key_bytes: int = 1024
    max_batch: int = 16384
    max_message_bytes: ByteSize = ByteSize(64 << 20)
    inline_max_bytes: ByteSize = ByteSize(64 << 10)  # puts this small ride in one message
    max_ndim: int = 16
    max_waiters_per_client: int = 4096
    max_leases_per_client: int = 1 << 20
    max_pins_per_client: int = 1 << 20
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
            _check(getattr(self, key) > 0, key, f"must be > 0, got {int(getattr(self, key))}")
        _check(0 <= self.inline_max_bytes <= self.max_message_bytes // 2, "inline_max_bytes",
               "must be between 0 and half of max_message_bytes")


class MetricsSection(_Section):
    listen: str = "127.0.0.1:9464"  # "" turns the HTTP endpoint off; port 0 picks a free port
    # HTTP connections open at once; past it the oldest one still waiting for its request is
    # closed, so idle connections can neither starve the scraper nor take the daemon's fds.
    max_connections: int = 64

    def __post_init__(self) -> None:
        _check(0 < self.max_connections <= 65536, "max_connections",
               f"must be between 1 and 65536, got {self.max_connections}")
        if self.listen == "":
            return
        host, sep, port = self.listen.rpartition(":")
        _check(bool(sep) and bool(host) and port.isdigit() and 0 <= int(port) < 65536, "listen",
               f"must be HOST:PORT (or \"\" for off), got {self.listen!r}")

    @property
    def address(self) -> tuple[str, int] | None:
        if not self.listen:
            return None
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]"), int(port)


_TCP_ENDPOINT = re.compile(r"tcp://(?P<host>\[[0-9A-Fa-f:.]+\]|[^:/\[\]\s]+):(?P<port>\d{1,5})")


WILDCARD_HOSTS = ("0.0.0.0", "::", "*")


def split_tcp_endpoint(endpoint: str) -> tuple[str, int] | None:
    """(host, port) of "tcp://HOST:PORT" (IPv6 in brackets), or None when it is not one."""
    match = _TCP_ENDPOINT.fullmatch(endpoint)
    if match is None or int(match.group("port")) > 65535:
        return None
    return match.group("host").strip("[]"), int(match.group("port"))


class ClusterSection(_Section):
    """`[cluster]`: the peer plane, through which daemons fetch entries from each other.

    Control (who holds what, transfer leases, one-time data tokens) is ZeroMQ on `listen`; the
    bytes go over `transport` on `data_listen`. Off while `listen` is ""."""

    listen: str = ""  # tcp://HOST:PORT of this node's peer control socket ("": no peer plane)
    # tcp://HOST:PORT of the bulk data listener; "": listen's host and its port + 1 (port 0 when
    # listen's is 0: a free one, announced to peers in the handshake)
    data_listen: str = ""
    # tcp://HOST:PORT at which other nodes reach `listen`, told to clients (the vLLM connectors
    # put it in kv_transfer_params); "": `listen` itself (nothing, where it binds a wildcard)
    advertise: str = ""
    peers: list[str] = msgspec.field(default_factory=list)  # other nodes' `listen` endpoints
    # "tcp" (ecd's TCP streams on data_listen) or "nixl" (one-sided READs through a NIXL agent
    # that registered the pool; needs `pip install --no-deps nixl-cu12 numpy`; data_listen and
    # tls do not apply)
    transport: str = "tcp"
    # CURVE, as in [control]: this node's key pair (it is both server and client of its peers),
    # the directory of the peers' public keys it admits (*.key, re-read on SIGHUP), and the
    # public key of each peer it connects to (a key file or the Z85 text), by endpoint.
    curve_secret_key: str = ""
    curve_allowed_keys: str = ""
    peer_keys: dict[str, str] = msgspec.field(default_factory=dict)
    # Run the peer plane WITHOUT authentication: any process that can reach `listen` (on loopback,
    # every local user, whatever its uid or group) can look up and read every entry: the one-time
    # data tokens go to whoever asks. Without CURVE the daemon refuses to start unless this is
    # true, on loopback too.
    insecure: bool = False
    # TLS 1.3 on the data streams (mutual: pinned self-signed certificates, see
    # ecd/transport/tls.py). This node's certificate and key (`ecd keygen --tls`), and the
    # directory of the peers' certificates (*.crt) it admits and trusts. With CURVE set, each
    # defaults to its CURVE sibling: NAME.crt and NAME.crt_secret beside curve_secret_key's
    # NAME.key_secret, and the curve_allowed_keys directory.
    tls: bool = False
    tls_cert: str = ""
    tls_key: str = ""
    tls_allowed_certs: str = ""
    transfer_ttl: Duration = Duration(60.0)  # longest an owner holds entries leased for a transfer
    fetch_timeout: Duration = Duration(30.0)  # a fetch's default (and longest) time
    request_timeout: Duration = Duration(5.0)  # one control round trip to a peer
    # A peer silent this long is "down", and (as owner) its leases are given back; the puller
    # pings every third of it.
    peer_ttl: Duration = Duration(10.0)
    max_inflight: int = 4  # transfers at once, each way (threads)
    max_peers: int = 64  # peers known at once (configured and named by fetches)
    # What one peer session may hold at the owner. Bytes of replies its connection has not read
    # (and of requests read ahead for it: ZMQ_RCVHWM = this / limits.max_message_bytes, at least
    # 2): past it the connection is closed and the session's leases go back. Pending transfer
    # leases: a lookup that could pass it is refused (Code.LIMIT); 4 lookups of limits.max_batch.
    peer_queue_bytes: ByteSize = ByteSize(64 << 20)
    max_leases_per_peer: int = 65536

    def __post_init__(self) -> None:
        if self.listen:
            _check(split_tcp_endpoint(self.listen) is not None, "listen",
                   f"must be tcp://HOST:PORT, got {self.listen!r}")
        if self.data_listen:
            _check(split_tcp_endpoint(self.data_listen) is not None, "data_listen",
                   f"must be tcp://HOST:PORT, got {self.data_listen!r}")
        if self.advertise:
            where = split_tcp_endpoint(self.advertise)
            _check(where is not None and where[1] > 0 and where[0] not in WILDCARD_HOSTS, "advertise",
                   f"must be tcp://HOST:PORT that other nodes can dial (no wildcard, no port 0), "
                   f"got {self.advertise!r}")
        for peer in self.peers:
            where = split_tcp_endpoint(peer)
            _check(where is not None and where[1] > 0, "peers",
                   f"each must be tcp://HOST:PORT with a port > 0, got {peer!r}")
        _check(len(set(self.peers)) == len(self.peers), "peers", f"lists a peer twice: {self.peers!r}")
        _check(self.transport in ("tcp", "nixl"), "transport",
               f"must be \"tcp\" or \"nixl\", got {self.transport!r}")
        # NIXL moves the bytes itself (UCX, RDMA): ecd's TLS wraps only its own TCP streams
        _check(not (self.tls and self.transport == "nixl"), "tls",
               "applies to transport \"tcp\" only (NIXL/UCX traffic is not encrypted by ecd)")
        _check(bool(self.curve_secret_key) == bool(self.curve_allowed_keys),
               "curve_allowed_keys" if self.curve_secret_key else "curve_secret_key",
               "curve_secret_key and curve_allowed_keys must be set together")
        for endpoint in self.peer_keys:
            _check(split_tcp_endpoint(endpoint) is not None, "peer_keys",
                   f"keys must be tcp://HOST:PORT endpoints, got {endpoint!r}")
        if self.curve:
            missing = [p for p in self.peers if p not in self.peer_keys]
            _check(not missing, "peer_keys", f"no public key for peer {', '.join(missing)} (CURVE is on: "
                                             "each peer needs one)")
        for key, value in (("transfer_ttl", self.transfer_ttl), ("fetch_timeout", self.fetch_timeout),
                           ("request_timeout", self.request_timeout), ("peer_ttl", self.peer_ttl)):
            _check(0 < value <= 3600, key, f"must be between 0 and 1 hour, got {float(value)}")
        _check(1 <= self.max_inflight <= 256, "max_inflight", f"must be between 1 and 256, got {self.max_inflight}")
        _check(1 <= self.max_peers <= 4096, "max_peers", f"must be between 1 and 4096, got {self.max_peers}")
        _check(self.peer_queue_bytes >= 1 << 20, "peer_queue_bytes",
               f"must be at least 1MiB, got {int(self.peer_queue_bytes)}")
        _check(1 <= self.max_leases_per_peer <= 1 << 24, "max_leases_per_peer",
               f"must be between 1 and {1 << 24}, got {self.max_leases_per_peer}")
        if self.tls:
            if self.curve:
                stem = self.curve_secret_key.removesuffix(".key_secret")
                self.tls_cert = self.tls_cert or stem + ".crt"
                self.tls_key = self.tls_key or stem + ".crt_secret"
                self.tls_allowed_certs = self.tls_allowed_certs or self.curve_allowed_keys
            for key in ("tls_cert", "tls_key", "tls_allowed_certs"):
                _check(bool(getattr(self, key)), key, "tls = true needs it (or CURVE keys to derive it from: "
                                                      "see docs/operating.md, \"TLS on the data streams\")")
        if self.listen and not self.data_listen:
            host, port = split_tcp_endpoint(self.listen)  # type: ignore[misc]
            host = f"[{host}]" if ":" in host else host
            self.data_listen = f"tcp://{host}:{port + 1 if port else 0}"
            _check(port < 65535, "data_listen", "listen's port is 65535: give data_listen explicitly")
        if self.listen and self.transport == "tcp":
            # Peers dial the data port at the host they reach `listen` by, and refuse a welcome
            # that names another (a peer must not steer their daemon to connect elsewhere).
            data_host = split_tcp_endpoint(self.data_listen)[0]  # type: ignore[index]
            listen_host = split_tcp_endpoint(self.listen)[0]  # type: ignore[index]
            _check(data_host in (listen_host, *WILDCARD_HOSTS), "data_listen",
                   f"must be on listen's host ({listen_host}) or a wildcard: peers dial the data port at "
                   f"the host they reach listen by, got {self.data_listen!r}")

    @property
    def enabled(self) -> bool:
        return bool(self.listen)

    @property
    def curve(self) -> bool:
        return bool(self.curve_secret_key)


class NamespaceSection(_Section):
    """`[namespaces.NAME]`: per-tenant policy for the keys of one namespace."""

    # Most bytes this namespace may hold in the host pool (0: no quota). Over it, the namespace
    # evicts its own least recently used entries first; QuotaExceeded when none can go.
    quota: ByteSize = ByteSize(0)
    # Bytes of this namespace that other namespaces' allocations never evict.
    guaranteed: ByteSize = ByteSize(0)
    # Producers store an xxh3-64 checksum with every entry; consumers verify it on every read.
    verify: bool = False

    def __post_init__(self) -> None:
        _check(self.quota >= 0, "quota", f"must be >= 0, got {int(self.quota)}")
        _check(self.guaranteed >= 0, "guaranteed", f"must be >= 0, got {int(self.guaranteed)}")
        # The pool hands out whole 256-byte units: quota = "1000" would refuse a 1000-byte entry.
        for key, value in (("quota", self.quota), ("guaranteed", self.guaranteed)):
            _check(value % POOL_UNIT == 0, key, f"must be a multiple of {POOL_UNIT} bytes (entries take "
                                                f"whole {POOL_UNIT}-byte units), got {int(value)}")
        _check(self.quota == 0 or self.guaranteed <= self.quota, "guaranteed",
               f"must be <= quota ({int(self.quota)}), got {int(self.guaranteed)}")


class Config(_Section):
    node: NodeSection = msgspec.field(default_factory=NodeSection)
    control: ControlSection = msgspec.field(default_factory=ControlSection)
    pool: PoolSection = msgspec.field(default_factory=PoolSection)
    ring: RingSection = msgspec.field(default_factory=RingSection)
    leases: LeasesSection = msgspec.field(default_factory=LeasesSection)
    limits: LimitsSection = msgspec.field(default_factory=LimitsSection)
    metrics: MetricsSection = msgspec.field(default_factory=MetricsSection)
    cluster: ClusterSection = msgspec.field(default_factory=ClusterSection)
    namespaces: dict[str, NamespaceSection] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        # Quotas and guaranteed shares count an entry's bytes in every tier (host and CUDA arenas).
        pool, what = int(self.pool.host.size), "pool.host.size"
        if self.pool.cuda is not None:
            pool += int(self.pool.cuda.size) * len(self.pool.cuda.devices)
            what = "pool.host.size plus the CUDA arenas"
        for name, ns in self.namespaces.items():
            _check(0 < len(name.encode()) <= self.limits.max_key_bytes, f"namespaces.{name}",
                   "namespace name must be 1 to limits.max_key_bytes bytes")
            _check(ns.quota <= pool, f"namespaces.{name}.quota",
                   f"must be <= {what} ({pool}), got {int(ns.quota)}")
        guaranteed = sum(int(ns.guaranteed) for ns in self.namespaces.values())
        _check(guaranteed <= pool, "namespaces",
               f"guaranteed shares add up to {guaranteed} bytes, more than {what} ({pool})")

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self, enc_hook=_enc_hook)


def endpoint_is_loopback(endpoint: str) -> bool:
    """True for ipc:// and for tcp:// on a loopback address (127.0.0.0/8, ::1, localhost)."""
    if not endpoint.startswith("tcp://"):
        return True
    host = endpoint[len("tcp://"):].rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # an interface name, a hostname or "*": may face the network
        return False


def check_control_policy(config: Config) -> None:
    """Start-time rule (also run by `ecd check-config`): a tcp endpoint reachable from the network
    needs CURVE, or an explicit `insecure = true`. Raises ConfigError naming the key."""
    control = config.control
    if not endpoint_is_loopback(control.endpoint) and not control.curve and not control.insecure:
        raise ConfigError(f"control.endpoint: {control.endpoint} is not a loopback address: set "
                          "control.curve_secret_key and control.curve_allowed_keys, or "
                          "control.insecure = true to serve it without authentication")


def check_cluster_policy(config: Config) -> None:
    """Start-time rule for the peer plane: `cluster.listen` needs CURVE (peers authenticate each
    other both ways, so only allowed peers get the one-time data tokens), or an explicit
    `insecure = true`.
    Loopback is no exception: every local user can reach it, whatever its uid or group."""
    cluster = config.cluster
    if cluster.enabled and not cluster.curve and not cluster.insecure:
        raise ConfigError(f"cluster.listen: {cluster.listen} has no authentication: set "
                          "cluster.curve_secret_key and cluster.curve_allowed_keys (CURVE), or "
                          f"cluster.insecure = true, under which {INSECURE_CLUSTER_OPENS}")
    if cluster.peers and not cluster.enabled:
        raise ConfigError("cluster.peers: set cluster.listen too (peers answer on it)")


# What `[cluster] insecure = true` opens, said in the refusal and in the daemon's start-up warning.
INSECURE_CLUSTER_OPENS = ("any process that can reach the peer port (on loopback: every local user) "
                          "can look up and read every entry")


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
    inner = re.match(r"^([A-Za-z_]+): (.*)$", message)  # our _check() already named the leaf
    if inner and "Expected" not in message:
        return f"{path}.{inner.group(1)}: {inner.group(2)}" if path else message
    return f"{path}: {message[0].lower()}{message[1:]}" if path else message


def _check_namespace_tables(data: dict[str, Any]) -> None:
    """msgspec reports a bad value inside a dict as `namespaces[...]`; check each table first so
    the error names the namespace: `namespaces.tenant-a.quota: ...`."""
    tables = data.get("namespaces")
    if not isinstance(tables, dict):
        return
    for name, table in tables.items():
        try:
            msgspec.convert(table, NamespaceSection, dec_hook=_dec_hook)
        except msgspec.ValidationError as exc:
            line = _one_line(exc)
            where = f"namespaces.{name}" if line.startswith("Expected") else f"namespaces.{name}."
            raise ConfigError(f"{where}{line}".replace("Expected", ": expected", 1)) from None


def load_config(data: dict[str, Any]) -> Config:
    _check_namespace_tables(data)
    try:
        return msgspec.convert(data, Config, dec_hook=_dec_hook)
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
