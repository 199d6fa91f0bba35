"""What a connector's scheduler side and worker side agree on, for both connectors: the metadata
the scheduler hands the worker each step (and, for EC, the worker's report back), and how a KV
block is named in ecd (the keys that metadata carries).

The connector classes vLLM loads (kv_connector.py, ec_connector.py) are thin facades: each makes
the side its role needs (kv_scheduler.py / kv_worker.py, ec_scheduler.py / ec_worker.py), as
vLLM's NixlConnector does. The sides live in different processes and meet only here: the
metadata is pickled from one to the other, so everything in it is plain data.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorMetadata, ECConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from ...protocol import KVBlockMeta

NULL_BLOCK_ID = 0  # vLLM's BlockPool reserves block 0 as the null block: never loaded or saved


# ---- KV: scheduler -> worker ----------------------------------------------------------------

@dataclass
class BlockTransfer:
    """Blocks of one request: keys[i] (a chained block hash, hex) <-> paged block block_ids[i].
    A save also says what each block is (`blocks[i]`), for the routers that follow the daemon's KV
    events ([events]): vLLM's own BlockStored fields."""

    req_id: str
    keys: list[str]
    block_ids: list[int]
    blocks: list[KVBlockMeta] | None = None


@dataclass
class EcdKVConnectorMetadata(KVConnectorMetadata):
    """One step's work for the workers: blocks to load before the forward pass, blocks to save
    after it. Keys are a block's base key; each worker adds its rank (`rank_suffix`)."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


# ---- KV: how blocks are keyed -----------------------------------------------------------------

def hashes_per_block(block_size: int, kv_cache_config: Any) -> int:
    """How many of vLLM's block hashes one paged block spans (hashes may be finer than blocks);
    a block size that is not a multiple of the hash size is a configuration error."""
    hash_block_size = getattr(kv_cache_config, "hash_block_size", None) or block_size
    if block_size % hash_block_size:
        raise ValueError(f"block size {block_size} is not a multiple of vLLM's block hash "
                         f"size {hash_block_size}")
    return block_size // hash_block_size


def hash_hex(block_hash: Any) -> str:
    if isinstance(block_hash, (bytes, bytearray, memoryview)):
        return bytes(block_hash).hex()
    return hashlib.blake2b(repr(block_hash).encode(), digest_size=16).hexdigest()


def block_keys(request: Any, block_size: int, per_block: int) -> list[str]:
    """Hex of vLLM's chained hash of each full block of a request (the hash of a block's last
    hash unit when `per_block` hashes make a block). They already cover multimodal inputs, LoRA
    and the cache salt. Without them (no hasher configured), plain token prompts are hashed here."""
    hashes = list(getattr(request, "block_hashes", None) or ())
    if hashes:
        return [hash_hex(hashes[(i + 1) * per_block - 1]) for i in range(len(hashes) // per_block)]
    if (getattr(request, "mm_features", None) or getattr(request, "lora_request", None)
            or getattr(request, "prompt_embeds", None) is not None
            or getattr(request, "cache_salt", None)):
        return []  # the tokens alone do not determine the KV: never share it
    tokens = list(request.all_token_ids)
    keys, parent = [], b"ecd-kv"
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = np.asarray(tokens[start:start + block_size], dtype=np.int64).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=32).digest()
        keys.append(parent.hex())
    return keys


def block_meta(request: Any, index: int, key: str, block_size: int, per_block: int) -> KVBlockMeta:
    """What the engine's own KV events would say about full block `index` of `request` (vLLM's
    BlockStored: its published hash, the previous block's, the block's tokens), so that a router
    following ecd's events matches ecd's blocks with the engine's. `key` (block_keys') stands in
    for the hash where the request has none (the tokens-only fallback above)."""
    hashes = getattr(request, "block_hashes", None) or ()
    if hashes:
        block_hash = maybe_convert_block_hash(hashes[(index + 1) * per_block - 1])
        parent = maybe_convert_block_hash(hashes[index * per_block - 1]) if index else None
    else:
        block_hash, parent = bytes.fromhex(key), None
    lora = getattr(request, "lora_request", None)
    return KVBlockMeta(block_hash=block_hash, parent_hash=parent,
                       token_ids=list(request.all_token_ids[index * block_size:(index + 1) * block_size]),
                       block_size=block_size, lora_name=lora.name if lora else None, group_idx=0)


def world_size(vllm_config: Any) -> int:
    """How many workers each hold a part of every block (tensor x pipeline parallel ranks)."""
    parallel = vllm_config.parallel_config
    return parallel.tensor_parallel_size * parallel.pipeline_parallel_size


def rank_suffix(rank: int, world: int) -> str:
    """What a worker adds to a block's key for its own entry ("" with a single worker)."""
    return "" if world == 1 else f".{rank}"


def rank_keys(key: str, world: int) -> list[str]:
    """Every worker's entry for one block (tensor/pipeline-parallel ranks store their part)."""
    return [key + rank_suffix(rank, world) for rank in range(world)]


# ---- EC: scheduler -> worker, and back --------------------------------------------------------

@dataclass
class EcdLoad:
    """One encoder output the worker loads this step."""

    mm_hash: str
    num_embeds: int  # rows the engine expects (the placeholder's embeddings)
    req_id: str  # the request it was allocated for, and its feature index
    input_id: int
    recompute_ok: bool  # the request carries its media: the worker may encode it itself


@dataclass
class EcdECConnectorMetadata(ECConnectorMetadata):
    """Scheduler -> worker, one per step (picklable; travels inside SchedulerOutput)."""

    loads: list[EcdLoad] = field(default_factory=list)
    # This step's SchedulerOutput.scheduled_encoder_inputs, the same object (ec_connector.py's
    # docstring): where a failed load is handed back to the model runner to encode.
    scheduled_encoder_inputs: dict[str, list[int]] | None = None


@dataclass
class EcdECWorkerMetadata(ECConnectorWorkerMetadata):
    """Worker -> scheduler, one per step with loads; aggregated over ranks."""

    loaded: list[str] = field(default_factory=list)
    recomputed: list[str] = field(default_factory=list)  # load failed; encoded in-step instead
    failed: list[tuple[str, str]] = field(default_factory=list)  # (req_id, mm_hash): neither

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        if isinstance(other, EcdECWorkerMetadata):
            self.loaded.extend(other.loaded)
            self.recomputed.extend(other.recomputed)
            self.failed.extend(other.failed)
        return self
