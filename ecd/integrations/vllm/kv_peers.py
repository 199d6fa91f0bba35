"""The KV connector across nodes (docs/vllm.md "Across nodes"): the kv_transfer_params a producer
returns to say where a request's blocks are, and the scheduler side's pulls of missing blocks
from peers through the local daemon's peer plane (`Client.fetch`).

A pull runs on one of FETCH_WORKERS connector threads, bounded by `fetch_timeout_s`, while the
connector answers vLLM "not decided yet" (`get_num_new_matched_tokens` -> None: the request waits
a step, others run), so the scheduler loop never blocks on the network. Whatever a pull did not
bring is a local miss, recomputed; nothing here raises into vLLM."""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .lazy_client import LazyClient, batches
from .ratelimit import RateLimitedLog

PARAM_NODE = "ecd_node"  # the producer daemon's node name
PARAM_PEER = "ecd_peer"  # its peer endpoint (tcp://HOST:PORT), "" when it has none to give
PARAM_BLOCKS = "ecd_blocks"  # how many of the prompt's first full blocks it holds
PARAM_LAST_KEY = "ecd_last_key"  # the key of the last of them (names the whole prefix)
FETCH_WORKERS = 4  # pulls in flight at once, per scheduler
_WILDCARD_HOSTS = ("0.0.0.0", "[::]", "::", "*", "")


def advertised_endpoint(listen: str) -> str:
    """A daemon's cluster.listen as another node can dial it: "" for a wildcard address."""
    if not listen.startswith("tcp://"):
        return ""
    host = listen[len("tcp://"):].rpartition(":")[0]
    return "" if host in _WILDCARD_HOSTS else listen


def remote_source(params: Any) -> tuple[str, int, str] | None:
    """(peer or node, blocks, last key) of a request's ecd kv_transfer_params; None when the
    request carries none (or they do not ask for a remote prefill)."""
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        return None
    peer = params.get(PARAM_PEER) or params.get(PARAM_NODE)
    blocks, last = params.get(PARAM_BLOCKS), params.get(PARAM_LAST_KEY)
    if not isinstance(peer, str) or not peer or not isinstance(blocks, int) or not isinstance(last, str):
        return None
    return peer, blocks, last


@dataclass
class _Pull:
    """A request's pull from peers, on the fetch threads."""

    future: Future | None
    deadline: float  # monotonic: the request is looked up then, fetched or not

    def settled(self) -> bool:
        return self.future is None or self.future.done() or time.monotonic() >= self.deadline


class PeerPulls:
    """One scheduler's pulls from peers (one per request) and its daemon's peer identity."""

    def __init__(self, client: LazyClient, settings: Any, log: RateLimitedLog, logger: logging.Logger) -> None:
        self._client = client
        self.settings = settings
        self._log = log
        self._logger = logger
        self._pulls: dict[str, _Pull] = {}  # req_id -> its pull (kept once settled)
        self._pool: ThreadPoolExecutor | None = None
        self._identity: tuple[str, str] | None = None  # (node, peer endpoint) of our daemon

    def waiting(self, req_id: str) -> bool | None:
        """True while the request's pull runs, False once settled, None if it never had one."""
        pull = self._pulls.get(req_id)
        return None if pull is None else not pull.settled()

    def settle(self, req_id: str) -> None:
        """This request pulls nothing: it is looked up locally from now on."""
        self._pulls[req_id] = _Pull(None, 0.0)

    def start(self, req_id: str, keys: list[str], peer: str | None) -> None:
        """Pull `keys` from `peer` (None: the daemon's configured peers) on a fetch thread."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(FETCH_WORKERS, thread_name_prefix="ecd-kv-fetch")
        timeout = self.settings.fetch_timeout_s
        future = self._pool.submit(self._pull, req_id, keys, peer, timeout)
        # The client's own reply timeout comes on top of the fetch's: past both, stop waiting.
        self._pulls[req_id] = _Pull(future, time.monotonic() + timeout + self.settings.load_timeout_s)

    def forget(self, req_id: Any) -> None:
        self._pulls.pop(req_id, None)  # a pull still running just lands

    def _pull(self, req_id: str, keys: list[str], peer: str | None, timeout: float) -> int:
        """On a fetch thread: make `keys` local through our daemon within `timeout` overall.
        Returns how many are local now; never raises."""
        deadline = time.monotonic() + timeout

        def fetch(client) -> int:
            n = 0
            for part in batches(keys, client.limits.max_batch):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                n += sum(client.fetch(part, peer=peer, timeout=left))
            return n

        got = self._client.call("fetch", fetch) or 0  # failures logged there, a miss here
        if got < len(keys):
            self._log.warning("fetch-miss", "request %s: %d of %d blocks fetched from %s; the rest are "
                              "recomputed", req_id, got, len(keys), peer or "the configured peers")
        else:
            self._logger.debug("ecd kv connector: request %s: %d blocks fetched from %s", req_id, got,
                               peer or "the configured peers")
        return got

    def identity(self) -> tuple[str, str]:
        """(node name, peer endpoint) of the local daemon, asked once; ("", "") while unknown."""
        if self._identity is None:
            client = self._client.get("identity")
            if client is None:
                return "", ""
            node = getattr(client, "node", "") or ""
            endpoint = self.settings.peer_endpoint or advertised_endpoint(getattr(client, "cluster_listen", "") or "")
            self._identity = (node, endpoint)
        return self._identity

    def transfer_params(self, blocks: int, last_key: str) -> dict[str, Any] | None:
        """A producer's answer to `do_remote_decode`: its first `blocks` blocks are here."""
        node, endpoint = self.identity()
        if blocks == 0 or not (node or endpoint):
            return None  # nothing stored (a short prompt) or no daemon: the decode side computes it
        return {"do_remote_prefill": True, "do_remote_decode": False, PARAM_NODE: node, PARAM_PEER: endpoint,
                PARAM_BLOCKS: blocks, PARAM_LAST_KEY: last_key}

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
