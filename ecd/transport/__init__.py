"""Bulk data planes of the peer plane: one interface (base.Transport), one module per transport.

"tcp" (tcp.TcpTransport, the default: TCP streams, optionally TLS) and "nixl" (nixl.NixlTransport:
one-sided READs through a NIXL agent, UCX underneath; an optional install, imported only here)."""
from __future__ import annotations

from .base import Grant, GrantTable, PullItem, Transport, TransferError


def make_transport(name: str, **kwargs) -> Transport:
    if name == "tcp":
        from .tcp import TcpTransport
        return TcpTransport(**kwargs)
    if name == "nixl":
        from .nixl import NixlTransport
        return NixlTransport(**kwargs)
    raise ValueError(f"unknown transport {name!r}: 'tcp' or 'nixl'")


__all__ = ["Grant", "GrantTable", "PullItem", "Transport", "TransferError", "make_transport"]
