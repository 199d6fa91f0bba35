"""One SGLang host pool's pages as EcdHiCacheStorage reads and writes them.

A page is stored as the bytes of `get_data_page(index, flat=False)`: for the KV pools (MHA, MLA)
a strided view straight into the host pool, which Client.put_many copies into the daemon's pool
(one copy) and a load copies back into from the daemon's read-only mapping (one copy). Those bytes
are exactly the flat page of SGLang's generic path (`get_data_page(flat=True)`,
`get_dummy_flat_data_page`), so both paths read each other's pages. Pools whose page is not a view
(mamba state is gathered from several tensors) are stored from that gathered copy and loaded with
`set_from_flat_data_page`. A stored entry whose size is not the page's is never copied anywhere.
"""
from __future__ import annotations

from typing import Any

import torch


def _shares_storage(view: torch.Tensor, pool: Any) -> bool:
    """Whether `view` is a view into one of `pool`'s own buffers (writing it writes the pool)."""
    if not view._is_view():
        return False
    ptr = view.untyped_storage().data_ptr()
    for name in ("kv_buffer", "k_buffer", "v_buffer"):
        buf = getattr(pool, name, None)
        if isinstance(buf, torch.Tensor) and buf.untyped_storage().data_ptr() == ptr:
            return True
    return False


def as_dtype(stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The stored entry's bytes, flat, as `dtype` (a view: entries are contiguous)."""
    flat = stored.reshape(-1)
    if flat.dtype == dtype:
        return flat
    return flat.view(torch.uint8).view(dtype)


class PoolPages:
    """Page access to one host pool (see the module docstring)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.page_size = int(getattr(pool, "page_size", 1) or 1)
        if hasattr(pool, "kv_buffer") and pool.kv_buffer is None:  # DeepSeek V4's logical KV anchor
            raise ValueError(f"ecd HiCache storage cannot page {type(pool).__name__}: it has no KV buffer "
                             f"(a logical anchor whose data lives in side pools), which ecd does not support")
        try:
            probe = pool.get_data_page(0, flat=False)
        except Exception as exc:  # e.g. MHA's page_unified layout, which has no data page view
            raise ValueError(f"ecd HiCache storage cannot page {type(pool).__name__} (layout "
                             f"{getattr(pool, 'layout', None)!r}): {exc}; use --hicache-mem-layout "
                             f"page_first, page_first_direct or layer_first") from exc
        self.direct = _shares_storage(probe, pool)
        self.page_shape = tuple(probe.shape)
        flat = pool.get_dummy_flat_data_page()
        self.flat_dtype = flat.dtype
        self.page_bytes = flat.numel() * flat.element_size()
        if probe.numel() * probe.element_size() != self.page_bytes:
            raise ValueError(f"{type(pool).__name__}: a data page has {probe.numel() * probe.element_size()} bytes, "
                             f"its flat page {self.page_bytes}")

    def facts(self) -> dict[str, Any]:
        """What makes another server's page of this pool the same bytes for the same tokens."""
        pool = self.pool
        facts: dict[str, Any] = {
            "class": type(pool).__name__,
            "layout": getattr(pool, "layout", None),
            "dtype": str(getattr(pool, "dtype", None)),
            "page_size": self.page_size,
            "page_shape": list(self.page_shape),
            "page_bytes": self.page_bytes,
            "storage_format_tag": getattr(pool, "storage_format_tag", None),
        }
        for name in ("layer_num", "head_num", "head_dim", "v_head_dim", "kv_lora_rank", "qk_rope_head_dim",
                     "start_layer", "end_layer", "size_per_token"):
            value = getattr(pool, name, None)
            if isinstance(value, (int, float, str, bool)):
                facts[name] = value
        return facts

    def indices(self, host_indices: Any, n_keys: int) -> list[int] | None:
        """The first host slot of each of `n_keys` pages; None when host_indices does not hold
        exactly n_keys pages."""
        if host_indices is None or int(host_indices.numel()) != n_keys * self.page_size:
            return None
        return [int(i) for i in host_indices[::self.page_size].tolist()]

    def source(self, index: int) -> torch.Tensor:
        """The page at host slot `index`, to store (a view into the pool where the pool has one)."""
        return self.pool.get_data_page(index, flat=False)

    def load(self, index: int, stored: torch.Tensor) -> bool:
        """Copy a stored entry into the page at host slot `index`; False (the page untouched) when
        its size is not this pool's page size."""
        if stored.numel() * stored.element_size() != self.page_bytes:
            return False
        if self.direct:
            dst = self.pool.get_data_page(index, flat=False)
            dst.copy_(as_dtype(stored, dst.dtype).view(dst.shape))
        else:
            self.pool.set_from_flat_data_page(index, as_dtype(stored, self.flat_dtype))
        return True


def load_into(target: torch.Tensor, stored: torch.Tensor) -> bool:
    """The generic path: copy a stored entry into a caller's flat page buffer; False (untouched)
    when the sizes differ."""
    if stored.numel() * stored.element_size() != target.numel() * target.element_size():
        return False
    target.copy_(as_dtype(stored, target.dtype).view(target.shape))
    return True
