"""A TCP port on 127.0.0.1 for a server a test starts: below the kernel's ephemeral range, in a
block of its own per pytest-xdist worker.

Binding port 0 and handing the number on is racy: until the server binds it, any outgoing
connection on the machine (a scrape, a Redis client, a peer) may be given it as its source port
from the ephemeral range, and a parallel test may be handed the same number (CI failed once with
"Address already in use" that way). Ports below the range are never handed out by the kernel,
and each worker takes its own block of them, round-robin, skipping any it cannot bind now."""
from __future__ import annotations

import itertools
import os
import socket

BLOCK = 400
_next = itertools.count(os.getpid() % BLOCK)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    low = max(_ephemeral_low() - 8 * BLOCK, 1024) + (index % 8) * BLOCK
    for _ in range(BLOCK):
        port = low + next(_next) % BLOCK
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use, or in TIME_WAIT from an earlier test
            return port
    raise RuntimeError(f"no free port in {low}-{low + BLOCK - 1}")
