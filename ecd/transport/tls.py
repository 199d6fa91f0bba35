"""`[cluster] tls = true`: the data streams of transport "tcp" in TLS 1.3 (the standard library's
ssl), both directions authenticated by pinned self-signed certificates.

Each node has a self-signed certificate and its private key (`ecd keygen --tls DIR --name NODE`
writes NODE.crt and NODE.crt_secret with the openssl command, an EC P-256 key, CA:FALSE), kept
beside its CURVE key pair. A node trusts exactly the certificates in its allowed directory
(`*.crt`, by default the CURVE `curve_allowed_keys` directory, where the peers' public keys
already go): they are the only trust anchors of both its server and its client context, so the
handshake succeeds only between two nodes that hold each other's certificate (mutual TLS), and
after it the peer's certificate is also checked by SHA-256 fingerprint against that set. No CA,
no host names: the certificate itself is the identity, like a CURVE public key. The one-time
token still admits each transfer, so TLS adds confidentiality and integrity of the bytes, and a
second, independent authentication of both ends.
"""
from __future__ import annotations

import glob
import hashlib
import os
import shutil
import socket
import ssl
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class TlsConfig:
    server: ssl.SSLContext
    client: ssl.SSLContext
    allowed: frozenset[bytes]  # SHA-256 of the DER of each admitted certificate

    def check_peer(self, sock: ssl.SSLSocket) -> None:
        """After the handshake: the peer's certificate must be one of the pinned ones."""
        der = sock.getpeercert(binary_form=True)
        if der is None or hashlib.sha256(der).digest() not in self.allowed:
            raise ssl.SSLError("the peer's certificate is not one of the pinned ones")


def _context(side: int, cert: str, key: str, cafiles: list[str]) -> ssl.SSLContext:
    ctx = ssl.SSLContext(side)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(cert, key)
    ctx.check_hostname = False  # no names: the pinned certificate is the identity
    ctx.verify_mode = ssl.CERT_REQUIRED
    for path in cafiles:
        ctx.load_verify_locations(cafile=path)
    if side == ssl.PROTOCOL_TLS_SERVER:
        ctx.num_tickets = 0  # no resumption; and no bytes arrive on an idle pooled connection
    return ctx


def load_tls(cert: str, key: str, allowed_dir: str) -> TlsConfig:
    """ValueError("KEY: problem") naming the config key (tls_cert, tls_key, tls_allowed_certs)."""
    for name, path in (("tls_cert", cert), ("tls_key", key)):
        if not os.path.isfile(path):
            raise ValueError(f"{name}: {path} is not a readable file (write one with "
                             "`ecd keygen --tls DIR --name NODE`)")
    if not os.path.isdir(allowed_dir):
        raise ValueError(f"tls_allowed_certs: {allowed_dir} is not a directory")
    cafiles = sorted(glob.glob(os.path.join(allowed_dir, "*.crt")))
    if not cafiles:
        raise ValueError(f"tls_allowed_certs: no peer certificate (*.crt) in {allowed_dir}")
    allowed = set()
    for path in cafiles:
        try:
            with open(path) as f:
                allowed.add(hashlib.sha256(ssl.PEM_cert_to_DER_cert(f.read())).digest())
        except (OSError, ValueError) as exc:
            raise ValueError(f"tls_allowed_certs: {path}: not a PEM certificate ({exc})") from None
    try:
        server = _context(ssl.PROTOCOL_TLS_SERVER, cert, key, cafiles)
        client = _context(ssl.PROTOCOL_TLS_CLIENT, cert, key, cafiles)
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"tls_cert: cannot load {cert} with its key {key}: {exc}") from None
    return TlsConfig(server, client, frozenset(allowed))


def write_tls_pair(directory: str, name: str, force: bool = False) -> tuple[str, str]:
    """NAME.crt (the certificate peers pin) and NAME.crt_secret (its key, mode 0600), with the
    openssl command; FileExistsError / OSError / RuntimeError otherwise."""
    cert, key = os.path.join(directory, f"{name}.crt"), os.path.join(directory, f"{name}.crt_secret")
    for path in (cert, key):
        if os.path.exists(path) and not force:
            raise FileExistsError(path)
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("the openssl command is needed to write a TLS certificate")
    os.makedirs(directory, exist_ok=True)
    old = os.umask(0o077)
    try:
        proc = subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
                               "-nodes", "-days", "3650", "-subj", f"/CN=ecd-{name}",
                               "-addext", "basicConstraints=critical,CA:FALSE",
                               "-addext", "keyUsage=critical,digitalSignature",
                               "-keyout", key, "-out", cert], capture_output=True, text=True, timeout=60)
    finally:
        os.umask(old)
    if proc.returncode != 0:
        raise RuntimeError(f"openssl failed: {proc.stderr.strip().splitlines()[-1:]}")
    os.chmod(key, 0o600)
    os.chmod(cert, 0o644)
    return cert, key


def fingerprint(cert: str) -> str:
    with open(cert) as f:
        return hashlib.sha256(ssl.PEM_cert_to_DER_cert(f.read())).hexdigest()


def raw_shutdown(sock: socket.socket) -> None:
    """Wake a thread blocked on `sock` (an SSLSocket too, without touching its TLS state)."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass
