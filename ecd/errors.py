"""The EcdError hierarchy. Every error has a wire code so a daemon reply maps to one class."""
from __future__ import annotations

import enum


class Code(enum.IntEnum):
    """Error codes carried by `protocol.Error` replies and per-item failures."""

    PROTOCOL = 1  # malformed frame, unknown tag, wrong types
    VERSION = 2  # protocol version mismatch in the handshake
    NOT_REGISTERED = 3  # request from an identity that never said Hello (daemon restarted)
    KEY_NOT_FOUND = 4
    POOL_FULL = 5
    INVALID = 6  # well-formed but unacceptable arguments (shape/dtype/nbytes mismatch, ...)
    STALE = 7  # generation does not name a live entry in the expected state
    NOT_OWNER = 8  # lease or write owned by another client
    LIMIT = 9  # a configured limit (key length, batch size, waiters, leases) was exceeded
    SHUTTING_DOWN = 10
    INTERNAL = 11
    QUOTA_EXCEEDED = 12  # the namespace is at its byte quota and none of its own entries can go
    CORRUPT = 13  # the bytes read do not match the checksum their producer stored
    NOT_DURABLE = 14  # put(persist=True): stored in memory, but could not be made durable on disk
    NOT_ALLOWED = 15  # Hello from a local uid/gid that control.allowed_uids/allowed_gids do not admit


class EcdError(Exception):
    """Base class of every error ecd raises."""

    code: Code = Code.INTERNAL

    def __init__(self, message: str = "", *, code: Code | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class ProtocolError(EcdError):
    """The peer sent something that does not follow the protocol."""

    code = Code.PROTOCOL


class VersionMismatch(ProtocolError):
    code = Code.VERSION


class KeyNotFound(EcdError, KeyError):
    code = Code.KEY_NOT_FOUND

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class PoolFull(EcdError):
    """No extent large enough even after evicting every unleased entry."""

    code = Code.POOL_FULL


class InvalidRequest(EcdError, ValueError):
    code = Code.INVALID


# What a request in flight across a daemon restart gets (a StaleGeneration: retry it). Committed
# entries live on in the adopted pool ([restart]); what the request named was the old run's.
RESTARTED = ("the daemon restarted: this request's writes or leases were the previous run's "
             "(writes in progress are dropped; committed entries are kept): retry it")


class StaleGeneration(EcdError):
    code = Code.STALE


class NotOwner(EcdError):
    code = Code.NOT_OWNER


class LimitExceeded(EcdError):
    code = Code.LIMIT


class ShuttingDown(EcdError):
    code = Code.SHUTTING_DOWN


class QuotaExceeded(EcdError):
    """The namespace is at its configured quota and none of its own entries can be evicted."""

    code = Code.QUOTA_EXCEEDED


class IntegrityError(EcdError):
    """An entry's bytes do not match the checksum its producer stored with it.

    Raised by a verifying read (`key`, `expected` and `actual` set) and for a PutInline whose
    data does not match the checksum sent with it (from the daemon's reply: message only)."""

    code = Code.CORRUPT

    def __init__(self, message: str = "", *, code: Code | None = None, key: str | None = None,
                 expected: int | None = None, actual: int | None = None) -> None:
        super().__init__(message, code=code)
        self.key, self.expected, self.actual = key, expected, actual


class PersistFailed(EcdError):
    """put(persist=True) could not make the entry durable on the disk tier (full, I/O error,
    read-only). The entry is still stored in the host pool, as a put without persist would be."""

    code = Code.NOT_DURABLE


class PermissionDenied(EcdError, PermissionError):
    """The daemon does not admit this client's uid: `[control] allowed_uids` / `allowed_gids`
    name neither its uid nor its groups. The message names the uid and what to set."""

    code = Code.NOT_ALLOWED


class DaemonUnavailable(EcdError):
    """The daemon is down (no socket where the endpoint says) or did not answer within the
    client's timeout: worth retrying."""

    code = Code.INTERNAL


class SocketPermissionDenied(PermissionDenied):
    """This process may not connect to the daemon's ipc socket (EACCES): libzmq would retry the
    connect forever in silence and the caller see only a timeout, so the client looks first. Not
    a DaemonUnavailable: retrying does not help; the message says what to change."""


class InvalidEndpoint(EcdError, ValueError):
    """An endpoint that is neither ipc://PATH nor tcp://HOST:PORT (a bare absolute path is read as
    ipc://PATH): refused before any socket exists."""

    code = Code.INVALID


class PoolNotVisible(EcdError):
    """A client on the daemon's own host (it reached it over ipc://) cannot see the daemon's named
    /dev/shm pool files: another IPC or mount namespace (a container with its own /dev/shm)."""


class AuthenticationFailed(EcdError):
    """The daemon refused this client's CURVE handshake (unknown key, wrong server key, or a
    plaintext client at a CURVE daemon and vice versa). Client-side only: it has no wire code."""

    code = Code.INTERNAL


class ConfigError(EcdError):
    """A node.toml that cannot be used; the message names the key and the problem."""


_BY_CODE: dict[int, type[EcdError]] = {
    cls.code: cls
    for cls in (
        ProtocolError,
        VersionMismatch,
        KeyNotFound,
        PoolFull,
        InvalidRequest,
        StaleGeneration,
        NotOwner,
        LimitExceeded,
        ShuttingDown,
        QuotaExceeded,
        IntegrityError,
        PersistFailed,
        PermissionDenied,
    )
}


def error_from_code(code: int, message: str) -> EcdError:
    """Build the exception a client raises for an error reply."""
    cls = _BY_CODE.get(code, EcdError)
    return cls(message, code=Code(code) if code in Code._value2member_map_ else None)
