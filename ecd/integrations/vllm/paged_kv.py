"""The engine's paged KV cache as ecd sees it (worker side of EcdKVConnector): the registered
per-layer caches as block-major views, gathered into one entry per block (every layer of that
block) for a save and scattered back from one for a load, with no staging copy when the layers
sit in one allocation at a constant distance (vLLM's own allocation)."""
from __future__ import annotations

import math
from typing import cast

import numpy as np
import torch

from ...client.tensors import copy_rows_between

_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _np(tensor: torch.Tensor) -> np.ndarray:
    """A numpy array over the tensor's memory (bf16/fp8 seen as same-width integers)."""
    return tensor.view(_SAME_WIDTH_INT[tensor.element_size()]).numpy()



class PagedKV:
    """The registered per-layer caches as block-major views `[num_blocks, *block]`, and, when the
    layers sit in one allocation at a constant distance (vLLM's own allocation), one strided
    view `[num_blocks, layers, *block]`: a block of every layer is then a single tensor that
    ecd copies straight into or out of its pool (no staging copy)."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int | None) -> None:
        layers: list[torch.Tensor] = []
        self.names: list[str] = []
        seen: set[tuple] = set()
        for name, kv in kv_caches.items():
            if not isinstance(kv, torch.Tensor):
                raise ValueError(f"layer {name}: KV cache is a {type(kv).__name__}, not a tensor")
            ident = (kv.data_ptr(), tuple(kv.shape), kv.stride(), kv.dtype)
            if ident in seen:  # a layer sharing another layer's KV cache: store it once
                continue
            seen.add(ident)
            layers.append(self._block_major(name, kv, num_blocks))
            self.names.append(name)
        if not layers:
            raise ValueError("no KV cache layers were registered")
        first = layers[0]
        self.block_shape = tuple(first.shape[1:])
        self.dtype = first.dtype
        self.device = first.device
        self.num_blocks = first.shape[0]
        for name, t in zip(self.names, layers):
            if tuple(t.shape[1:]) != self.block_shape or t.dtype != self.dtype or t.device != self.device \
                    or t.shape[0] != self.num_blocks:
                raise ValueError(f"layer {name}: block {tuple(t.shape)} {t.dtype} differs from "
                                 f"{self.names[0]}'s {tuple(first.shape)} {first.dtype}; "
                                 "layers of different shapes are not supported")
        self.layers = layers
        self.entry_shape = (len(layers), *self.block_shape)
        self.stacked = self._stack(layers)
        self.use_numpy = self.device.type == "cpu"
        self._np_layers = [_np(t) for t in layers] if self.use_numpy else None
        self._np_stacked = _np(self.stacked) if self.use_numpy and self.stacked is not None else None
        # one layer's block is one contiguous row (what _scatter_rows copies by address)
        self._rows_contiguous = (self.stacked is not None and self.num_blocks > 0
                                 and self.stacked[0, 0].is_contiguous())
        self._staging_buf: torch.Tensor | None = None

    @staticmethod
    def _block_major(name: str, kv: torch.Tensor, num_blocks: int | None) -> torch.Tensor:
        # vLLM 0.33 hands connectors per-layer views [num_blocks, H, N, C]; older attention
        # backends used [2, num_blocks, ...] (K and V outermost). Blocks go first either way.
        if kv.ndim >= 2 and num_blocks is not None:
            if kv.shape[0] == num_blocks:
                return kv
            if kv.shape[0] == 2 and kv.shape[1] == num_blocks:
                return kv.movedim(1, 0)
            raise ValueError(f"layer {name}: no dimension of {tuple(kv.shape)} counts the "
                             f"{num_blocks} KV cache blocks in the first two places")
        if kv.ndim == 5 and kv.shape[0] == 2:
            return kv.movedim(1, 0)
        if kv.ndim >= 2:
            return kv
        raise ValueError(f"layer {name}: unsupported KV cache shape {tuple(kv.shape)}")

    @staticmethod
    def _stack(layers: list[torch.Tensor]) -> torch.Tensor | None:
        first = layers[0]
        if len(layers) == 1:
            return first.unsqueeze(1)
        item = first.element_size()
        step_bytes = layers[1].data_ptr() - first.data_ptr()
        if step_bytes <= 0 or step_bytes % item:
            return None
        base = first.untyped_storage().data_ptr()
        for i, t in enumerate(layers):
            if (t.stride() != first.stride() or t.untyped_storage().data_ptr() != base
                    or t.data_ptr() - first.data_ptr() != i * step_bytes):
                return None
        step = step_bytes // item
        return first.as_strided((first.shape[0], len(layers), *first.shape[1:]),
                                (first.stride(0), step, *first.stride()[1:]), first.storage_offset())

    @property
    def entry_nbytes(self) -> int:
        return math.prod(self.entry_shape) * torch.empty((), dtype=self.dtype).element_size()

    # save ------------------------------------------------------------------------------------

    def gather(self, block_ids: list[int]) -> list[torch.Tensor]:
        """One tensor `[layers, *block]` per block: on CPU, views into the paged cache when the
        layers share one allocation, else rows of a reused staging buffer; on a GPU, rows of one
        gathered tensor on that GPU (put_many copies them device-to-device into the daemon's arena,
        or by DMA into the host pool). Valid until the next gather; the caller hands them to
        put_many, which copies them right away."""
        if self.use_numpy:
            if self.stacked is not None:
                return [self.stacked[b] for b in block_ids]  # ecd copies these strided views
            staging = self._staging(len(block_ids))
            staging_np = _np(staging)
            for row, b in zip(staging_np, block_ids):
                for layer, src in enumerate(cast("list[np.ndarray]", self._np_layers)):  # set with use_numpy
                    row[layer] = src[b]
            return list(staging)
        idx = torch.as_tensor(block_ids, dtype=torch.long, device=self.device)
        if self.stacked is not None:
            staged = self.stacked.index_select(0, idx)
        else:
            staged = torch.stack([t.index_select(0, idx) for t in self.layers], dim=1)
        return list(staged)

    def _staging(self, rows: int) -> torch.Tensor:
        # Reused: fresh memory for every step would pay a page fault per 4 KiB on each save.
        if self._staging_buf is None or self._staging_buf.shape[0] < rows:
            self._staging_buf = torch.empty((rows, *self.entry_shape), dtype=self.dtype)
        return self._staging_buf[:rows]

    # load ------------------------------------------------------------------------------------

    def scatter_found(self, block_ids: list[int], got: list[torch.Tensor | None]
                      ) -> tuple[int, list[int], Exception | None]:
        """Scatter the entries that were found and have this cache's layout: (how many were
        missing or of another layout, the block ids that did not load, the copy's exception).
        Never raises: a failed copy fails its blocks."""
        good_ids: list[int] = []
        good: list[torch.Tensor] = []
        failed: list[int] = []
        for block_id, tensor in zip(block_ids, got):
            if tensor is None or tuple(tensor.shape) != self.entry_shape or tensor.dtype != self.dtype:
                failed.append(block_id)
            else:
                good_ids.append(block_id)
                good.append(tensor)
        missing = len(failed)
        try:
            self.scatter(good_ids, good)
        except Exception as exc:
            return missing, failed + good_ids, exc
        return missing, failed, None

    def _scatter_rows(self, block_ids: list[int], entries: list[torch.Tensor]) -> bool:
        """A CPU engine's load into the stacked cache as one compiled copy of every layer's row
        of every block (ecd.client.tensors.copy_rows_between), not a numpy copy per block: for
        a step's hundreds of KV blocks that per-block work was most of the load's cost. False
        (nothing copied) where the layout or the build does not allow it."""
        stacked = self.stacked
        if stacked is None or not self._rows_contiguous:
            return False
        layers = stacked.shape[1]
        item = stacked.element_size()
        row = stacked[0, 0].numel() * item
        block_step, layer_step, base = stacked.stride(0) * item, stacked.stride(1) * item, stacked.data_ptr()
        dst: list[int] = []
        src: list[int] = []
        for b, t in zip(block_ids, entries):
            if (not 0 <= b < self.num_blocks or tuple(t.shape) != self.entry_shape or t.dtype != self.dtype
                    or not t.is_cpu or not t.is_contiguous()):
                return False  # raw addresses: anything unchecked goes the numpy way (which raises)
            at, start = base + b * block_step, t.data_ptr()
            for layer in range(layers):
                dst.append(at + layer * layer_step)
                src.append(start + layer * row)
        return copy_rows_between(dst, src, [row] * len(dst))

    def scatter(self, block_ids: list[int], entries: list[torch.Tensor]) -> None:
        if not block_ids:
            return
        if self.use_numpy and self._scatter_rows(block_ids, entries):
            return
        if self.use_numpy:
            for b, t in zip(block_ids, entries):
                src_np = _np(t)
                if self._np_stacked is not None:
                    np.copyto(self._np_stacked[b], src_np)
                else:
                    for layer, dst_np in enumerate(cast("list[np.ndarray]", self._np_layers)):  # set with use_numpy
                        dst_np[b] = src_np[layer]
            return
        idx = torch.as_tensor(block_ids, dtype=torch.long, device=self.device)
        src = torch.stack(entries).to(self.device)
        if self.stacked is not None:
            self.stacked[idx] = src
        else:
            for layer, dst in enumerate(self.layers):
                dst.index_copy_(0, idx, src[:, layer])


# ---- the connector --------------------------------------------------------------------------
