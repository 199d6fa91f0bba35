"""Bound TCP listening sockets, for the servers the daemon runs beside its ZeroMQ sockets (the
metrics HTTP server, the peer plane's data port). Bound at start-up, so a port in use is a
start-up error reported before READY, not a failure later."""
from __future__ import annotations

import socket


def bind_tcp_listener(host: str, port: int, backlog: int) -> socket.socket:
    """A listening socket on (host, port), IPv6 when the host is an IPv6 address; closed again
    if binding fails (the OSError propagates)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock
