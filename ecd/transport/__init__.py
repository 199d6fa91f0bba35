"""Bulk data planes of the peer plane: one interface (base.Transport), one module per transport.

Only "tcp" exists (tcp.TcpTransport); "nixl" (RDMA through UCX) is the next one and plugs in
behind the same interface (see docs/architecture.md, "Where the next parts plug in")."""
from __future__ import annotations

from .base import Grant, GrantTable, PullItem, Transport, TransferError


def make_transport(name: str, **kwargs) -> Transport:
    if name == "tcp":
        from .tcp import TcpTransport
        return TcpTransport(**kwargs)
    raise ValueError(f"transport {name!r} is not built yet: only 'tcp'")


__all__ = ["Grant", "GrantTable", "PullItem", "Transport", "TransferError", "make_transport"]
