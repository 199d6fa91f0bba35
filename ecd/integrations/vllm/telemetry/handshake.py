"""Handshake metadata: which ecd daemon each worker of an engine reached, told to its scheduler.

vLLM (0.32 and 0.33) asks every worker's connector for `get_handshake_metadata()` once its KV
caches are registered (and again after a wake-up), keys the answers by (pp_rank, tp_rank) and
hands them to the scheduler's connector (`set_xfer_handshake_metadata`). NIXL sends its agent's
memory descriptors this way; ecd's P/D needs no exchange between engines (the daemons find each
other over their peer plane, and a producer's `kv_transfer_params` name its daemon: docs/vllm.md),
but it needs one thing vLLM's processes alone cannot check: that an engine's scheduler and its
workers use the SAME daemon. The scheduler looks blocks up (and pins them) in its daemon, the
workers load and save in theirs; an engine whose workers run on other nodes (multi-node tensor
or pipeline parallelism) would find blocks it cannot load, and name its scheduler's daemon in the
`kv_transfer_params` that a decode engine fetches from. So each worker reports the daemon it
connected to (node name, peer endpoint, host, control endpoint) and the scheduler compares them
with its own: agreement is logged once at INFO, a mismatch as an ERROR naming the ranks.
"""
from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata

from ..kv_peers import advertised_endpoint
from ..lazy_client import LazyClient


@dataclass
class EcdHandshakeMetadata(KVConnectorHandshakeMetadata):
    """The daemon one process of an engine reached ("" where it did not reach one)."""

    node: str  # the daemon's node name (its Welcome)
    peer: str  # its peer endpoint as other nodes reach it ("" without [cluster])
    host: str  # this process's host name
    endpoint: str  # the control endpoint this process was configured with
    namespace: str

    def same_daemon(self, other: "EcdHandshakeMetadata") -> bool | None:
        """Whether both reached one daemon; None when that cannot be told (one reached none)."""
        if self.node and other.node:
            return (self.node, self.peer) == (other.node, other.peer)
        if self.endpoint.startswith("ipc://") and self.endpoint == other.endpoint:
            return self.host == other.host  # a socket path is only the same daemon on one host
        return None

    def describe(self) -> str:
        return f"node {self.node or '?'} ({self.peer or 'no peer endpoint'}) via {self.endpoint} on {self.host}"


def local_daemon(client: LazyClient, op: str = "handshake") -> EcdHandshakeMetadata:
    """This process's daemon, connecting now if the connector has not yet."""
    node = peer = ""
    c = client.get(op)
    if c is not None:
        node = getattr(c, "node", "") or ""
        peer = client.settings.peer_endpoint or advertised_endpoint(getattr(c, "cluster_listen", "") or "")
    return EcdHandshakeMetadata(node=node, peer=peer, host=socket.gethostname(), endpoint=client.settings.endpoint,
                                namespace=client.namespace)


class WorkerDaemons:
    """The scheduler's view of its workers' daemons (set_xfer_handshake_metadata)."""

    def __init__(self, client: LazyClient, logger: logging.Logger) -> None:
        self._client = client
        self._logger = logger
        self.workers: dict[Any, EcdHandshakeMetadata] = {}  # rank -> what that worker reached
        self.mismatched: list[Any] = []  # ranks whose daemon is not the scheduler's
        self.consistent: bool | None = None  # None: not told, or nothing to compare

    def received(self, metadata: dict[Any, Any]) -> None:
        self.workers = {rank: m for rank, m in (metadata or {}).items() if isinstance(m, EcdHandshakeMetadata)}
        if not self.workers:
            return
        mine = local_daemon(self._client)
        verdicts = {rank: mine.same_daemon(m) for rank, m in self.workers.items()}
        self.mismatched = sorted((r for r, v in verdicts.items() if v is False), key=str)
        if self.mismatched:
            self.consistent = False
            self._logger.error(
                "ecd kv connector: worker rank(s) %s reached another ecd daemon (%s) than the scheduler "
                "(%s): the scheduler's lookups find blocks its workers cannot load (they are recomputed) "
                "and kv_transfer_params name the scheduler's daemon; run an engine's scheduler and "
                "workers against one daemon", ", ".join(map(str, self.mismatched)),
                "; ".join(self.workers[r].describe() for r in self.mismatched), mine.describe())
        elif all(v is True for v in verdicts.values()):
            self.consistent = True
            self._logger.info("ecd kv connector: all %d worker(s) use the scheduler's daemon (%s)",
                              len(self.workers), mine.describe())
        else:
            self.consistent = None  # a side had no daemon yet: nothing to tell
