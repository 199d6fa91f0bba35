"""Who may reach the daemon: the group its local files belong to, and CURVE for the control socket
and for the peer plane (`[cluster]`, the same key handling: one CurveAuth per ZMQ context).

Local: the runtime dir (0770), the ipc socket (0660) and every /dev/shm file (0660) belong to
`node.group`, so engines join that group and nobody else gets in. Remote: with
`control.curve_secret_key` / `control.curve_allowed_keys`, the ROUTER socket is a CURVE server and
a ZAP handler (pyzmq's ThreadAuthenticator, on its own thread: the serving loop never sees it)
admits only the client public keys found in the allowed-keys directory, re-read on SIGHUP.
"""
from __future__ import annotations

import grp
import logging
import os
import threading
from typing import TYPE_CHECKING

import zmq

from ...config import Config, check_cluster_policy, check_control_policy
from ...curve import load_allowed_keys, load_keyfile, load_public_key
from ...errors import ConfigError

if TYPE_CHECKING:
    from zmq.auth.thread import ThreadAuthenticator

    from ...transport.tls import TlsConfig

log = logging.getLogger("ecd.daemon")

ZAP_DOMAIN = "ecd"


def resolve_group(name: str) -> int:
    """The gid for node.group ("" is the daemon's primary group); ConfigError if unusable."""
    if not name:
        return os.getegid()
    try:
        gid = int(name) if name.isdigit() else grp.getgrnam(name).gr_gid
    except KeyError:
        raise ConfigError(f"node.group: unknown group {name!r}") from None
    if os.geteuid() != 0 and gid != os.getegid() and gid not in os.getgroups():
        raise ConfigError(f"node.group: the daemon's user is not a member of group {name!r} "
                          "and cannot give its files to it")
    return gid


def check_security(config: Config) -> tuple[int, "CurveAuth | None"]:
    """Everything about access that can be checked before binding: the tcp/CURVE policy, the
    key files and the group. Returns (gid, the loaded CurveAuth or None); raises ConfigError
    naming the key. `ecd serve` keeps both; `ecd check-config` only checks."""
    check_control_policy(config)
    check_cluster_policy(config)
    curve = CurveAuth.load(config) if config.control.curve else None
    cluster_curve(config)  # the peer plane's keys: the daemon loads them again when it starts it
    if config.events.enabled and config.events.curve:  # [events]' keys, likewise
        CurveAuth.from_files(config.events.curve_secret_key, config.events.curve_allowed_keys, "events")
    cluster_tls(config)
    return resolve_group(config.node.group), curve


def cluster_curve(config: Config) -> "tuple[CurveAuth, dict[str, bytes]] | None":
    """`[cluster]` CURVE: this node's key pair and admitted peers (a CurveAuth), and each
    configured peer's public key by endpoint; None without CURVE. ConfigError naming the key."""
    cluster = config.cluster
    if not cluster.enabled or not cluster.curve:
        return None
    auth = CurveAuth.from_files(cluster.curve_secret_key, cluster.curve_allowed_keys, "cluster")
    return auth, load_peer_keys(cluster.peer_keys)


def cluster_tls(config: Config) -> "TlsConfig | None":
    """`[cluster] tls`: the data streams' TLS contexts; None without it. ConfigError naming the key."""
    from ...transport.tls import load_tls
    cluster = config.cluster
    if not cluster.enabled or not cluster.tls:
        return None
    try:
        return load_tls(cluster.tls_cert, cluster.tls_key, cluster.tls_allowed_certs)
    except ValueError as exc:
        raise ConfigError(f"cluster.{exc}") from None


def load_peer_keys(peer_keys: dict[str, str]) -> dict[str, bytes]:
    """cluster.peer_keys: endpoint -> the peer's Z85 public key (from a key file or the text)."""
    keys = {}
    for endpoint, value in peer_keys.items():
        try:
            keys[endpoint] = load_public_key(value)
        except ValueError as exc:
            raise ConfigError(f"cluster.peer_keys: {endpoint}: {exc}") from None
    return keys


class CurveAuth:
    """The server key pair and the allowed client keys, and the ZAP handler that consults them."""

    def __init__(self, public: bytes, secret: bytes, allowed: frozenset[bytes], directory: str,
                 section: str = "control") -> None:
        self.public, self.secret = public, secret
        self.section = section  # the config section the keys come from, named in messages
        self.allowed = allowed  # replaced whole on reload: the ZAP thread reads it without a lock
        self.directory = directory
        self.rejected = 0  # handshakes refused (read by stats; written only by the ZAP thread)
        self._authenticator: ThreadAuthenticator | None = None
        self._lock = threading.Lock()
        self._logged: set[bytes] = set()

    @classmethod
    def load(cls, config: Config) -> "CurveAuth":
        return cls.from_files(config.control.curve_secret_key, config.control.curve_allowed_keys, "control")

    @classmethod
    def from_files(cls, secret_key: str, allowed_keys: str, section: str) -> "CurveAuth":
        try:
            public, secret = load_keyfile(secret_key, need_secret=True)
        except ValueError as exc:
            raise ConfigError(f"{section}.curve_secret_key: {exc}") from None
        try:
            allowed = load_allowed_keys(allowed_keys)
        except ValueError as exc:
            raise ConfigError(f"{section}.curve_allowed_keys: {exc}") from None
        return cls(public, secret, allowed, allowed_keys, section)

    def start(self, ctx: zmq.Context) -> None:
        from zmq.auth.thread import ThreadAuthenticator
        self._authenticator = ThreadAuthenticator(ctx, log=logging.getLogger("ecd.auth"))
        self._authenticator.start()
        self._authenticator.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self)
        if not self.allowed:
            log.warning("%s.curve_allowed_keys: %s holds no *.key file: no client can connect "
                        "(add keys, then SIGHUP)", self.section, self.directory)

    def apply(self, sock: zmq.Socket) -> None:
        """Make `sock` (before bind) a CURVE server whose peers the ZAP handler vets."""
        sock.curve_server = True
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.zap_domain = ZAP_DOMAIN.encode()

    def callback(self, domain: str, client_key: bytes) -> bool:
        """Called by the ZAP thread for each CURVE handshake, with the client's Z85 public key."""
        if client_key in self.allowed:
            return True
        with self._lock:
            self.rejected += 1
            first = client_key not in self._logged and len(self._logged) < 1024
            if first:
                self._logged.add(client_key)  # a refused client retries: log each key once
        if first:
            log.warning("refused a CURVE client: public key %s is not in %s (logged once per key; "
                        "auth_rejected in stats counts them all)", client_key.decode(errors="replace"),
                        self.directory)
        return False

    def reload(self) -> None:
        """Re-read the allowed-keys directory (SIGHUP); a bad directory keeps the current keys."""
        try:
            allowed = load_allowed_keys(self.directory)
        except ValueError as exc:
            log.error("SIGHUP: keeping the allowed CURVE keys: %s.curve_allowed_keys: %s", self.section, exc)
            return
        added, removed = len(allowed - self.allowed), len(self.allowed - allowed)
        self.allowed = allowed
        with self._lock:
            self._logged.clear()
        log.info("SIGHUP: %d allowed CURVE client key(s) in %s (%d added, %d removed); connected "
                 "clients keep their sessions", len(allowed), self.section, added, removed)

    def stop(self) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
