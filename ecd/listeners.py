"""Bound TCP listening sockets, for the servers the daemon runs beside its ZeroMQ sockets (the
metrics HTTP server, the peer plane's data port). Bound at start-up, so a port in use is a
start-up error reported before READY, not a failure later. And the file mode of the daemon's
unix sockets (control, fd socket, events): its group's, no one else's."""
from __future__ import annotations

import contextlib
import os
import socket
from typing import Iterator


@contextlib.contextmanager
def group_socket_file(path: str | None, gid: int) -> Iterator[None]:
    """Bind a unix socket at `path` inside: its file is the owner's and group's only from birth
    (umask 007, so there is no moment where others may connect), then mode 0660 and group `gid`
    (node.group: the engines join it). `path` None (a tcp endpoint): the umask alone."""
    old_umask = os.umask(0o007)
    try:
        yield
        if path is not None:
            os.chown(path, -1, gid)
            os.chmod(path, 0o660)
    finally:
        os.umask(old_umask)


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
