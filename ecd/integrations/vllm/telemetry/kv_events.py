"""The blocks ecd stored for an engine, in that engine's own KV event stream.

vLLM (0.32 and 0.33) publishes, with `--kv-events-config`, what its block pool stores and
removes (medium "GPU", or "CPU" on a CPU engine) and adds what the KV connector reports: after
each step every worker's `get_kv_connector_kv_cache_events()` is collected, the executor merges
the workers' containers (`add_events` + `increment_workers`), the scheduler's connector receives
them in `update_connector_output(output)` (`output.kv_cache_events`) and vLLM publishes what its
`take_events()` yields in the same KVEventBatch as its own blocks.

EcdKVConnector reports one BlockStored per block a worker's `put_many` stored, built from the
block's KVBlockMeta exactly as ecd's own [events] stream publishes it (ecd/daemon/events/wire.py:
the hash, parent, tokens, block size, LoRA name and group as vLLM's own BlockStored), with
medium MEDIUM_HOST ("CPU": the daemon's host pool; ecd's own stream names the same medium). With
tensor or pipeline parallelism every rank stores its part of a block under its own key: a block
is reported once, when all `world` ranks stored it in that step.
Removals are not reported here: they happen in the daemon (LRU eviction, deletes, restarts),
not in a step of this engine; ecd's own [events] stream publishes them (docs/vllm.md).
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Iterable

from vllm.distributed.kv_events import BlockStored, KVCacheEvent, KVConnectorKVEvents

from ....protocol import KVBlockMeta

MEDIUM_HOST = "CPU"  # ecd's host pool, in vLLM's words (ecd.daemon.holdings.Medium.HOST)


def stored_event(meta: KVBlockMeta, medium: str = MEDIUM_HOST) -> BlockStored:
    """vLLM's BlockStored for one block ecd now holds (what ecd's [events] publishes for it)."""
    return BlockStored(block_hashes=[meta.block_hash], parent_block_hash=meta.parent_hash,
                       token_ids=list(meta.token_ids), block_size=meta.block_size, lora_id=None,
                       medium=medium, lora_name=meta.lora_name, group_idx=meta.group_idx)


class EcdKVEvents(KVConnectorKVEvents):
    """The events of one step: one worker's, or the workers' merged by vLLM's executor."""

    def __init__(self, events: list[KVCacheEvent] | None = None, num_workers: int = 1) -> None:
        self.events: list[KVCacheEvent] = list(events or [])
        self.num_workers = num_workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self.events.extend(events)

    def aggregate(self) -> "EcdKVEvents":
        """Keep each event once, and only those every worker reported (a block all ranks stored)."""
        counts = Counter(self.events)
        self.events = [e for e, n in counts.items() if n >= self.num_workers]
        return self

    def increment_workers(self, count: int = 1) -> None:
        self.num_workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return self.events

    def get_number_of_workers(self) -> int:
        return self.num_workers

    def clear_events(self) -> None:
        self.events = []
        self.num_workers = 0

    def __repr__(self) -> str:
        return f"<EcdKVEvents workers={self.num_workers} events={len(self.events)}>"


class ConnectorEvents:
    """Both sides' event bookkeeping: a worker collects what it stored (`stored`, `take`); the
    scheduler collects what the workers reported (`received`) and vLLM takes it (`take_events`).
    Off (nothing kept) unless the engine publishes KV events."""

    def __init__(self, enabled: bool, world: int = 1) -> None:
        self.enabled = enabled
        self.world = max(1, world)
        self._stored: list[KVCacheEvent] = []
        self._received: list[KVCacheEvent] = []

    # ---- worker ----

    def stored(self, metas: Iterable[KVBlockMeta], medium: str = MEDIUM_HOST) -> None:
        if self.enabled:
            self._stored.extend(stored_event(m, medium) for m in metas)

    def take(self) -> EcdKVEvents | None:
        if not self._stored:
            return None
        events, self._stored = self._stored, []
        return EcdKVEvents(events, num_workers=1)

    # ---- scheduler ----

    def received(self, connector_output: Any) -> None:
        got = getattr(connector_output, "kv_cache_events", None)
        if not self.enabled or not isinstance(got, EcdKVEvents) or not got.events:
            return
        # Counted against this engine's world, not the number of workers that reported this
        # step: a block some rank failed to store is not whole in ecd.
        counts = Counter(got.get_all_events())
        self._received.extend(e for e, n in counts.items() if n >= self.world)

    def take_events(self) -> Iterable[KVCacheEvent]:
        events, self._received = self._received, []
        return events
