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
    group: int = 0  # the KV cache group these blocks belong to (hybrid models: KVGroups)


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


def block_meta(request: Any, index: int, key: str, block_size: int, per_block: int,
               group_idx: int = 0) -> KVBlockMeta:
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
                       block_size=block_size, lora_name=lora.name if lora else None, group_idx=group_idx)


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


# ---- KV: hybrid models (several KV cache groups) ------------------------------------------------

@dataclass(frozen=True)
class KVGroup:
    """One of vLLM's KV cache groups as ecd stores it: its layers, and how much of a request's
    past its attention reads (`sliding_window` tokens, None for full attention)."""

    index: int
    layer_names: tuple[str, ...]
    sliding_window: int | None = None
    extra_retained: int = 0  # tokens below the window vLLM keeps too (multi-token speculation)

    def first_kept_block(self, end_block: int, block_size: int) -> int:
        """The first block vLLM keeps allocated (not the null block) for this group when a
        request's computed tokens end at block `end_block`: every block for full attention;
        for a sliding window, vLLM's SlidingWindowManager.get_num_skipped_tokens."""
        if self.sliding_window is None:
            return 0
        skipped = max(0, end_block * block_size - self.sliding_window + 1 - self.extra_retained)
        return skipped // block_size


@dataclass
class KVGroups:
    """The KV cache groups the connector stores, from vLLM's KVCacheConfig. One group (every
    model without the hybrid allocator) keeps the single-group keys and behaviour; several
    (full attention plus sliding window layers with vLLM's hybrid memory allocator) key each
    group's blocks apart (`key`) and plan every group's loads and saves. `unsupported` says why
    the connector stays off for this model (a group kind ecd cannot store yet, e.g. Mamba
    state, or groups of different block sizes)."""

    groups: list[KVGroup]
    unsupported: str | None = None
    hybrid: bool = False  # vLLM made several groups (block ids come per group)

    def key(self, base: str, group: int) -> str:
        """A block's key in one group (the base key itself with a single group)."""
        return f"{base}.g{group}" if self.hybrid else base

    def keys(self, base_keys: list[str]) -> list[str]:
        """Every group's key of each block, block by block."""
        return [self.key(k, g.index) for k in base_keys for g in self.groups]


@dataclass
class GroupBlocks:
    """One KV cache group's blocks of one request (scheduler side, hybrid models): per block its
    key, whether ecd holds it (looked up, loaded or saved), and the request's block ids."""

    keys: list[str]
    present: list[bool]
    block_ids: list[int] = field(default_factory=list)
    next_save: int = 0  # blocks below this were saved or skipped already


def hybrid_hit_end(groups: KVGroups, blocks: list[GroupBlocks], start: int, loadable: int, block_size: int) -> int:
    """The largest `end` in [start, loadable] such that every group holds what a request whose
    computed tokens end at block `end` needs from ecd: full attention groups every block from
    `start`, sliding-window groups the blocks vLLM keeps for the window (first_kept_block on).
    `start` when nothing past it qualifies."""
    end = loadable
    for group, held in zip(groups.groups, blocks):
        if group.sliding_window is None:
            run = start
            while run < end and held.present[run]:
                run += 1
            end = run
    while end > start:
        if all(all(held.present[max(start, group.first_kept_block(end, block_size)):end])
               for group, held in zip(groups.groups, blocks) if group.sliding_window is not None):
            return end
        end -= 1
    return start


def _group_kind(spec: Any) -> tuple[str, int | None, int]:
    """("full" | "sliding" | the unsupported spec's class name, window, extra retained)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
    specs = list(getattr(spec, "kv_cache_specs", {}).values()) or [spec]  # UniformTypeKVCacheSpecs
    kinds = set()
    for s in specs:
        name = type(s).__name__
        if isinstance(s, SlidingWindowSpec):
            kinds.add(("sliding", s.sliding_window, getattr(s, "extra_retained_tokens", 0)))
        elif isinstance(s, FullAttentionSpec) and name in ("FullAttentionSpec", "MLAAttentionSpec"):
            kinds.add(("full", None, 0))
        else:
            kinds.add((name, None, 0))
    if len(kinds) != 1:
        return "mixed " + "/".join(sorted(k[0] for k in kinds)), None, 0
    return kinds.pop()


def kv_groups(kv_cache_config: Any, block_size: int) -> KVGroups:
    """KVGroups from vLLM's KVCacheConfig (None: one group of every layer, as before vLLM gave
    connectors the config). Groups vLLM marks as not transferable are left out."""
    raw = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(raw) <= 1:
        names = tuple(raw[0].layer_names) if raw else ()
        return KVGroups([KVGroup(0, names)])
    groups: list[KVGroup] = []
    for index, group in enumerate(raw):
        if not getattr(group, "enable_kv_transfer", True):
            continue
        spec = group.kv_cache_spec
        kind, window, extra = _group_kind(spec)
        if kind not in ("full", "sliding"):
            return KVGroups(groups, f"KV cache group {index} is {kind}, which ecd does not store", True)
        if getattr(spec, "block_size", block_size) != block_size:
            return KVGroups(groups, f"KV cache group {index} has {spec.block_size}-token blocks, "
                                    f"not {block_size}", True)
        groups.append(KVGroup(index, tuple(group.layer_names), window if kind == "sliding" else None, extra))
    return KVGroups(groups, None, True)


# ---- EC: scheduler -> worker, and back --------------------------------------------------------

@dataclass
class EcdLoad:
    """One encoder output the worker loads this step."""

    mm_hash: str
    num_embeds: int  # rows the engine expects (the placeholder's embeddings)
    req_id: str  # the request it was allocated for, and its feature index
    input_id: int
    recompute_ok: bool  # the request carries its media: the worker may encode it itself
    key: str = ""  # its ecd key (salted_key: the request's cache_salt in it); "": the mm_hash


def salted_key(mm_hash: str, salt: str | None) -> str:
    """The ecd key of an encoder output for a request with this `cache_salt`: the mm_hash itself
    when unsalted, else prefixed by a hash of the salt. vLLM's mm_hash never includes the salt
    (its KV block hashes do): without this a salted request would hit another salt's entry, or
    an unsalted one's (and an unsalted request a salted one's)."""
    if not salt:
        return mm_hash
    return f"s:{hashlib.blake2b(salt.encode(), digest_size=16).hexdigest()}:{mm_hash}"


@dataclass
class EcdECConnectorMetadata(ECConnectorMetadata):
    """Scheduler -> worker, one per step (picklable; travels inside SchedulerOutput)."""

    loads: list[EcdLoad] = field(default_factory=list)
    # This step's SchedulerOutput.scheduled_encoder_inputs, the same object (ec_connector.py's
    # docstring): where a failed load is handed back to the model runner to encode.
    scheduled_encoder_inputs: dict[str, list[int]] | None = None
    # producer: the ecd keys (salted_key) of what this step encodes, by mm_hash (absent: the
    # mm_hash alone), and of what the engine's encoder cache already holds that a request of
    # another salt asked for (start_save_caches saves those)
    save_keys: dict[str, list[str]] = field(default_factory=dict)
    copy_keys: dict[str, list[str]] = field(default_factory=dict)


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
