"""The value types of node.toml and the endpoint rules its sections share: sizes ("1GiB") and
durations ("250ms") parsed into plain ints and floats, the base of every section (unknown keys
rejected), and tcp:// endpoint parsing. config.py assembles the sections; cluster_config.py holds
`[cluster]`.
"""
from __future__ import annotations

import ipaddress
import re
from typing import Any

import msgspec


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


def dec_hook(type_: type, obj: Any) -> Any:
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


def enc_hook(obj: Any) -> Any:
    # Print sizes and durations the way they are written in node.toml.
    if isinstance(obj, ByteSize):
        return format_size(int(obj))
    if isinstance(obj, Duration):
        text = format_duration(float(obj))
        return text if parse_duration(text) == float(obj) else float(obj)  # never print a rounding
    raise NotImplementedError(type(obj))


def check_field(condition: bool, key: str, message: str) -> None:
    # Raised inside __post_init__, msgspec re-raises it as a ValidationError with the path.
    if not condition:
        raise ValueError(f"{key}: {message}")


class Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


_TCP_ENDPOINT = re.compile(r"tcp://(?P<host>\[[0-9A-Fa-f:.]+\]|[^:/\[\]\s]+):(?P<port>\d{1,5})")


WILDCARD_HOSTS = ("0.0.0.0", "::", "*")


def split_tcp_endpoint(endpoint: str) -> tuple[str, int] | None:
    """(host, port) of "tcp://HOST:PORT" (IPv6 in brackets), or None when it is not one."""
    match = _TCP_ENDPOINT.fullmatch(endpoint)
    if match is None or int(match.group("port")) > 65535:
        return None
    return match.group("host").strip("[]"), int(match.group("port"))


def client_endpoint(endpoint: object, what: str = "endpoint") -> str:
    """The daemon endpoint a client connects to, checked before any socket exists: "ipc://PATH"
    or "tcp://HOST:PORT"; a bare absolute path means ipc://PATH. InvalidEndpoint (one line, the
    form expected) for anything else: libzmq's own "Invalid argument" says neither."""
    from .errors import InvalidEndpoint
    if isinstance(endpoint, str) and "\0" not in endpoint:
        if endpoint.startswith("/"):
            return "ipc://" + endpoint
        if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
            return endpoint
        if split_tcp_endpoint(endpoint) is not None:
            return endpoint
    raise InvalidEndpoint(f"{what} {endpoint!r:.200}: expected ipc:///path/to/ecd.sock (a bare /path means that) "
                          "or tcp://HOST:PORT")


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
