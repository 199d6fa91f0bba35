"""CURVE key files (the format pyzmq's zmq.auth.create_certificates writes), for daemon, client
and `ecd keygen`. Every failure is a ValueError whose message names the file and the problem."""
from __future__ import annotations

import datetime
import os
import re
from typing import Literal, overload

import zmq
import zmq.auth
import zmq.utils.z85

_Z85_KEY = re.compile(rb"[0-9a-zA-Z.:+=^!/*?&<>()\[\]{}@%$#-]{40}")

_HEADER = """#   ****  Generated on {now} by ecd keygen  ****
#   ZeroMQ CURVE {kind} Certificate
#   {advice}

metadata
curve
    public-key = "{public}"
"""


def _is_z85_key(value: bytes) -> bool:
    if not _Z85_KEY.fullmatch(value):
        return False
    try:
        return len(zmq.utils.z85.decode(value)) == 32
    except Exception:  # noqa: BLE001 - z85 raises assorted errors for bad characters
        return False


@overload
def load_keyfile(path: str, need_secret: Literal[True]) -> tuple[bytes, bytes]: ...
@overload
def load_keyfile(path: str, need_secret: bool) -> tuple[bytes, bytes | None]: ...


def load_keyfile(path: str, need_secret: bool) -> tuple[bytes, bytes | None]:
    """(public, secret) z85 keys from a certificate file; secret is required when need_secret."""
    if not os.path.exists(path):
        raise ValueError(f"{path} does not exist")
    if not os.path.isfile(path):
        raise ValueError(f"{path} is not a file")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (ValueError, UnicodeDecodeError):
        raise ValueError(f"{path} is not a CURVE key file (no public-key line)") from None
    if not _is_z85_key(public):
        raise ValueError(f"{path}: public-key is not a 40-character Z85 CURVE key")
    if need_secret:
        if secret is None:
            raise ValueError(f"{path} holds no secret key (give the .key_secret file)")
        if not _is_z85_key(secret):
            raise ValueError(f"{path}: secret-key is not a 40-character Z85 CURVE key")
    return public, secret


def load_public_key(value: str) -> bytes:
    """A server public key given as a key file path (.key or .key_secret) or as the Z85 text."""
    raw = value.encode()
    if not os.path.exists(value):
        if _is_z85_key(raw):
            return raw
        raise ValueError(f"{value!r} is neither a key file nor a 40-character Z85 key")
    return load_keyfile(value, need_secret=False)[0]


def load_allowed_keys(directory: str) -> frozenset[bytes]:
    """Public keys of every *.key file in `directory`."""
    if not os.path.isdir(directory):
        raise ValueError(f"{directory} is not a directory" if os.path.exists(directory)
                         else f"{directory} does not exist")
    try:
        names = sorted(os.listdir(directory))
    except OSError as exc:
        raise ValueError(f"cannot list {directory}: {exc.strerror}") from None
    return frozenset(load_keyfile(os.path.join(directory, name), need_secret=False)[0]
                     for name in names if name.endswith(".key"))


def write_keypair(directory: str, name: str, force: bool = False) -> tuple[str, str]:
    """Write NAME.key (public, 0644) and NAME.key_secret (0600); returns their paths.
    FileExistsError when either exists and not force."""
    os.makedirs(directory, exist_ok=True)
    public_path = os.path.join(directory, f"{name}.key")
    secret_path = os.path.join(directory, f"{name}.key_secret")
    if not force:
        for path in (public_path, secret_path):
            if os.path.lexists(path):
                raise FileExistsError(path)
    public, secret = (k.decode() for k in zmq.curve_keypair())
    now = datetime.datetime.now().isoformat(timespec="seconds")
    public_text = _HEADER.format(now=now, kind="Public", public=public,
                                 advice="Copy it to the daemon's curve_allowed_keys directory (clients)"
                                        " or to clients (the daemon's own key).")
    secret_text = _HEADER.format(now=now, kind="**Secret**", public=public,
                                 advice="DO NOT share this file or widen its permissions.")
    secret_text += f'    secret-key = "{secret}"\n'
    _write(secret_path, secret_text, 0o600)
    _write(public_path, public_text, 0o644)
    return public_path, secret_path


def _write(path: str, text: str, mode: int) -> None:
    """Write through a temporary file and rename, so the file never exists with a wider mode."""
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)  # whatever the umask says
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
