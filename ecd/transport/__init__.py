"""Bulk data planes of the peer plane: one interface (base.Transport), one module per transport,
each registered by name in registry.py (`make_transport`, `register_transport`,
`transport_names`), which imports a transport's module only when it is chosen.

"tcp" (tcp.TcpTransport, the default: TCP streams, optionally TLS) and "nixl" (nixl.NixlTransport:
one-sided READs through a NIXL agent, UCX underneath; an optional install).

This package's __init__ imports only base (which imports nothing of ecd): the registry and the
transports import base, so importing them here would make an import circle."""
from __future__ import annotations

from .base import Grant, GrantTable, PullItem, Transport, TransferError, TransportUnavailable

__all__ = ["Grant", "GrantTable", "PullItem", "Transport", "TransferError", "TransportUnavailable"]
