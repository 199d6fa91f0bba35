"""vLLM's KV event wire format (vllm/distributed/kv_events.py), re-declared so that ecd encodes
byte-identical batches without importing vLLM: the same class names (the msgpack tags), field
names, field order and defaults. A batch is the msgpack array [ts, events] (data_parallel_rank,
None, omitted); an event a map tagged by its class name ("type": "BlockStored"), fields at their
default omitted. docs/events.md has the schema and ecd's mapping onto it."""
from __future__ import annotations

from typing import Any

import msgspec

from ...protocol import EncoderMeta, KVBlockMeta

BlockHash = int | bytes  # vLLM's ExternalBlockHash

MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE = "GPU", "CPU", "STORAGE"
ENCODER_KIND = "encoder"  # kv_cache_spec_kind of an encoder-cache entry's BlockStored


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base of the events; the tag is the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def stored_event(key: str, medium: str, meta: Any) -> BlockStored:
    """BlockStored of one entry: its KVBlockMeta's block, its EncoderMeta's mm_hash, or (no meta)
    its key UTF-8 encoded as its one block hash."""
    if type(meta) is KVBlockMeta:
        return BlockStored([meta.block_hash], meta.parent_hash, meta.token_ids, meta.block_size, None, medium,
                           meta.lora_name, group_idx=meta.group_idx)
    if type(meta) is EncoderMeta:
        return BlockStored([(meta.mm_hash or key).encode()], None, [], meta.num_tokens, None, medium, None,
                           kv_cache_spec_kind=ENCODER_KIND)
    return BlockStored([key.encode()], None, [], 0, None, medium, None)


def removed_event(key: str, medium: str, meta: Any) -> BlockRemoved:
    if type(meta) is KVBlockMeta:
        return BlockRemoved([meta.block_hash], medium, group_idx=meta.group_idx)
    if type(meta) is EncoderMeta:
        return BlockRemoved([(meta.mm_hash or key).encode()], medium)
    return BlockRemoved([key.encode()], medium)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker
