"""Several real `ecd serve` daemons on this machine, each its own node (name, pool, runtime dir),
joined by the peer plane on 127.0.0.1 (never any other address)."""
from __future__ import annotations

import socket

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_toml(listen: str, peers: list[str], extra: str = "") -> str:
    quoted = ", ".join(f'"{p}"' for p in peers)
    return f"""
[cluster]
listen = "{listen}"
data_listen = "tcp://127.0.0.1:0"
peers = [{quoted}]
request_timeout = "2s"
peer_ttl = "3s"
{extra}
"""


@pytest.fixture
def cluster(daemon_factory):
    """make(n, size=..., extra=[per-node [cluster] lines], other=config after it (one for all,
    or one per node)) -> daemons, all peers of each other; each has .peer_endpoint."""

    def make(n: int = 2, size: str = "256MiB", extra: list[str] | None = None, other: str | list[str] = "",
             peers: bool = True):
        endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in range(n)]
        nodes = []
        for i in range(n):
            others = [e for j, e in enumerate(endpoints) if j != i] if peers else []
            text = cluster_toml(endpoints[i], others, (extra or [""] * n)[i]) + (other if isinstance(other, str) else other[i])
            d = daemon_factory(size=size, extra=text)
            d.peer_endpoint = endpoints[i]
            nodes.append(d)
        return nodes

    return make
