"""`[cluster]` of node.toml: the peer plane's settings and their checks (config.py re-exports it)."""
from __future__ import annotations

import msgspec

from .config_types import WILDCARD_HOSTS, Duration, Section, ByteSize, check_field, split_tcp_endpoint
from .transport.base import Transport, TransportUnavailable
from .transport.registry import quoted_names, transport_class, transport_names

# What `[cluster] insecure = true` opens, said in the refusal and in the daemon's start-up warning.
INSECURE_CLUSTER_OPENS = ("any process that can reach the peer port (on loopback: every local user) "
                          "can look up and read every entry")


DIRECTORY_KEYS = ("encoder", "all", "none")


def check_directory(section: "ClusterSection") -> None:
    """The directory's settings (ValueError naming the key)."""
    if not section.directory:
        check_field(not section.directory_password_file, "directory_password_file", "is set but directory is not")
        return
    check_field(bool(section.listen), "directory", "needs listen (the directory finds peers for the peer plane)")
    where = split_tcp_endpoint(section.listen)
    check_field(bool(section.advertise) or (where is not None and where[0] not in WILDCARD_HOSTS), "advertise",
                "the directory tells other nodes where to dial: with listen on a wildcard, set advertise")
    url = section.directory
    try:
        from redis.connection import parse_url
        parsed = parse_url(url)
    except ValueError as exc:
        raise ValueError(f"directory: {exc}, got {url!r}") from None
    except Exception as exc:  # a malformed port and the like
        raise ValueError(f"directory: not a redis URL ({exc}): {url!r}") from None
    check_field("password" not in parsed and "username" not in parsed, "directory",
                "must not hold credentials (put them in directory_password_file), got a URL with them")
    check_field(bool(parsed.get("host") or parsed.get("path")), "directory", f"names no host or socket: {url!r}")
    check_field(0 <= int(parsed.get("db", 0)) <= 1 << 16, "directory", f"bad database number in {url!r}")
    prefix = section.directory_prefix
    check_field(0 < len(prefix) <= 64 and prefix.isprintable() and " " not in prefix and "{" not in prefix,
                "directory_prefix", f"must be 1-64 printable characters without spaces or braces, got {prefix!r}")
    check_field(3.0 <= section.directory_ttl <= 3600, "directory_ttl",
                f"must be between 3s and 1 hour, got {float(section.directory_ttl)}")
    check_field(0.01 <= section.directory_timeout <= 60, "directory_timeout",
                f"must be between 10ms and 60s, got {float(section.directory_timeout)}")
    check_field(section.directory_timeout * 3 <= section.directory_ttl, "directory_timeout",
                "must be at most a third of directory_ttl (a refresh must fit in its interval)")
    check_field(section.directory_keys in DIRECTORY_KEYS, "directory_keys",
                f"must be one of {', '.join(DIRECTORY_KEYS)}, got {section.directory_keys!r}")


class DirectoryStats(msgspec.Struct):
    """[cluster] directory in `ecd status`; counts: commands, errors, lookups, found / unknown (keys)."""
    url: str
    up: bool  # its last command answered
    nodes: list[str] = []  # the live nodes it listed last (this one included)
    counts: dict[str, int] = {}
    routed: dict[str, int] = {}  # keys fetched from the holder a lookup named, by node


class ClusterSection(Section):
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
    # tls do not apply): a name registered in ecd/transport/registry.py
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
    # The fleet directory (ecd/daemon/peer/directory.py): a Redis or Valkey where daemons register
    # (under a TTL they refresh), learn each other as peers beside `peers`, and map the keys worth
    # finding fleet-wide to their holders. "": none. redis://HOST:PORT/DB, rediss://..., or
    # unix:///PATH?db=N; never a password in it: directory_password_file holds it ("PASSWORD" or
    # "USERNAME PASSWORD" for an ACL user).
    directory: str = ""
    directory_password_file: str = ""
    directory_prefix: str = "ecd"  # every name this fleet uses starts PREFIX: (fleets share a store)
    directory_ttl: Duration = Duration(15.0)  # a registration's life; refreshed every third of it
    directory_keys: str = "encoder"  # "encoder" (entries put with EncoderMeta), "all", or "none"
    directory_timeout: Duration = Duration(0.5)  # one command (a round trip) to the store

    def __post_init__(self) -> None:
        check_directory(self)
        if self.listen:
            check_field(split_tcp_endpoint(self.listen) is not None, "listen",
                   f"must be tcp://HOST:PORT, got {self.listen!r}")
        if self.data_listen:
            check_field(split_tcp_endpoint(self.data_listen) is not None, "data_listen",
                   f"must be tcp://HOST:PORT, got {self.data_listen!r}")
        if self.advertise:
            where = split_tcp_endpoint(self.advertise)
            check_field(where is not None and where[1] > 0 and where[0] not in WILDCARD_HOSTS, "advertise",
                   f"must be tcp://HOST:PORT that other nodes can dial (no wildcard, no port 0), "
                   f"got {self.advertise!r}")
        for peer in self.peers:
            where = split_tcp_endpoint(peer)
            check_field(where is not None and where[1] > 0, "peers",
                   f"each must be tcp://HOST:PORT with a port > 0, got {peer!r}")
        check_field(len(set(self.peers)) == len(self.peers), "peers", f"lists a peer twice: {self.peers!r}")
        check_field(self.transport in transport_names(), "transport",
               f"must be {quoted_names(transport_names())}, got {self.transport!r}")
        transport = self._transport_class()
        transport.check_config(self)  # its own checks (nixl: tls does not apply)
        check_field(bool(self.curve_secret_key) == bool(self.curve_allowed_keys),
               "curve_allowed_keys" if self.curve_secret_key else "curve_secret_key",
               "curve_secret_key and curve_allowed_keys must be set together")
        for endpoint in self.peer_keys:
            check_field(split_tcp_endpoint(endpoint) is not None, "peer_keys",
                   f"keys must be tcp://HOST:PORT endpoints, got {endpoint!r}")
        if self.curve:
            missing = [p for p in self.peers if p not in self.peer_keys]
            check_field(not missing, "peer_keys", f"no public key for peer {', '.join(missing)} (CURVE is on: "
                                             "each peer needs one)")
        for key, value in (("transfer_ttl", self.transfer_ttl), ("fetch_timeout", self.fetch_timeout),
                           ("request_timeout", self.request_timeout), ("peer_ttl", self.peer_ttl)):
            check_field(0 < value <= 3600, key, f"must be between 0 and 1 hour, got {float(value)}")
        check_field(1 <= self.max_inflight <= 256, "max_inflight", f"must be between 1 and 256, got {self.max_inflight}")
        check_field(1 <= self.max_peers <= 4096, "max_peers", f"must be between 1 and 4096, got {self.max_peers}")
        check_field(self.peer_queue_bytes >= 1 << 20, "peer_queue_bytes",
               f"must be at least 1MiB, got {int(self.peer_queue_bytes)}")
        check_field(1 <= self.max_leases_per_peer <= 1 << 24, "max_leases_per_peer",
               f"must be between 1 and {1 << 24}, got {self.max_leases_per_peer}")
        if self.tls:
            if self.curve:
                stem = self.curve_secret_key.removesuffix(".key_secret")
                self.tls_cert = self.tls_cert or stem + ".crt"
                self.tls_key = self.tls_key or stem + ".crt_secret"
                self.tls_allowed_certs = self.tls_allowed_certs or self.curve_allowed_keys
            for key in ("tls_cert", "tls_key", "tls_allowed_certs"):
                check_field(bool(getattr(self, key)), key, "tls = true needs it (or CURVE keys to derive it from: "
                                                      "see docs/operating.md, \"TLS on the data streams\")")
        if self.listen and not self.data_listen:
            host, port = split_tcp_endpoint(self.listen)  # type: ignore[misc]
            host = f"[{host}]" if ":" in host else host
            self.data_listen = f"tcp://{host}:{port + 1 if port else 0}"
            check_field(port < 65535, "data_listen", "listen's port is 65535: give data_listen explicitly")
        if self.listen and transport.has_data_listener:
            # Peers dial the data port at the host they reach `listen` by, and refuse a welcome
            # that names another (a peer must not steer their daemon to connect elsewhere).
            data_host = split_tcp_endpoint(self.data_listen)[0]  # type: ignore[index]
            listen_host = split_tcp_endpoint(self.listen)[0]  # type: ignore[index]
            check_field(data_host in (listen_host, *WILDCARD_HOSTS), "data_listen",
                   f"must be on listen's host ({listen_host}) or a wildcard: peers dial the data port at "
                   f"the host they reach listen by, got {self.data_listen!r}")

    def _transport_class(self) -> type[Transport]:
        """The configured transport's class (its module imported now, not the library it may
        need: that is the daemon's to find, at start)."""
        try:
            return transport_class(self.transport)
        except TransportUnavailable as exc:
            raise ValueError(f"transport: \"{self.transport}\" is registered but {exc}") from None

    @property
    def enabled(self) -> bool:
        return bool(self.listen)

    @property
    def curve(self) -> bool:
        return bool(self.curve_secret_key)
