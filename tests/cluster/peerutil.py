"""Several real `ecd serve` daemons on this machine, each its own node (name, pool, runtime dir),
joined by the peer plane on 127.0.0.1 (never any other address)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from conftest import wait_for
from ports import free_port  # noqa: F401  # the cluster tests import it from here

BIG_KEYS = [f"blk-{i}" for i in range(8)]  # 8 x 64 MiB: a transfer long enough to kill mid-way


def leases_back(client, timeout: float = 10) -> bool:
    """Whether the owner behind `client` gives every read and transfer lease back within
    `timeout`. Never checked once, right after a fetch: the owner learns that a send ended (tcp)
    or a READ did (nixl: the puller's peer_done) only after the puller has answered its client."""
    def back() -> bool:
        s = client.stats()
        return s["read_leases"] == 0 and s["transfer_leases"] == 0
    return bool(wait_for(back, timeout=timeout))


def cluster_toml(listen: str, peers: list[str], extra: str = "", insecure: bool | None = None) -> str:
    """A [cluster] section. Without CURVE in `extra` it says `insecure = true` (the daemon refuses
    a peer plane with neither, loopback included: tests/cluster/test_peer_loopback.py);
    `insecure` forces the line on or off."""
    quoted = ", ".join(f'"{p}"' for p in peers)
    if insecure is None:
        insecure = "curve_secret_key" not in extra
    return f"""
[cluster]
listen = "{listen}"
data_listen = "tcp://127.0.0.1:0"
peers = [{quoted}]
request_timeout = "2s"
peer_ttl = "3s"
{"insecure = true" if insecure else ""}
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


def put_big(client) -> dict:
    """BIG_KEYS, 64 MiB each, with checksums; returns what was put."""
    data = {}
    for i, key in enumerate(BIG_KEYS):
        t = torch.full((16 << 20,), i, dtype=torch.float32)
        client.put(key, t, checksum=True)
        data[key] = t
    return data


def fetch_in_thread(d, peer: str, timeout: float, client_timeout: float = 10):
    """Fetch BIG_KEYS on daemon `d` from `peer` in a thread: (thread, out) where out gets
    "result" or "error", and "elapsed"."""
    out: dict = {}

    def run():
        started = time.monotonic()
        with d.client(timeout=client_timeout) as c:
            try:
                out["result"] = c.fetch(BIG_KEYS, peer=peer, timeout=timeout)
            except Exception as exc:  # noqa: BLE001 - the test inspects it
                out["error"] = exc
        out["elapsed"] = time.monotonic() - started

    thread = threading.Thread(target=run, daemon=True)  # a client of a killed daemon may linger
    thread.start()
    return thread, out


def fetch_concurrently(d, key: str, peer: str, n: int = 6, timeout: float = 30) -> list:
    """n clients of daemon `d` fetch `key` from `peer` at the same moment: their answers."""
    results: list = []
    barrier = threading.Barrier(n)

    def fetch():
        with d.client() as c:
            barrier.wait()
            results.append(c.fetch(key, peer=peer, timeout=timeout))

    threads = [threading.Thread(target=fetch) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results
