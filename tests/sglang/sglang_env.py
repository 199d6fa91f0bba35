"""Real SGLang objects for tests/sglang, on CPU: host KV pools (MHA in each layout, MLA, mamba)
over real SGLang device pools, and ecd's backend made by SGLang's own StorageBackendFactory from
the extra_config a user passes on the command line. Importing this skips the test module (with
the reason) where SGLang is not importable: `make test` in .venv has none; `make test-sglang` has."""
from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage",
                    reason="SGLang is not installed here: `make test-sglang` runs tests/sglang in .venv-sglang")
pytest.importorskip("sglang.srt.mem_cache.pool_host.mha",
                    reason="SGLang's host KV pools do not import here (see requirements/sglang-cpu.txt)")

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

PAGE_SIZE = 4
# SGLang refuses a host pool unless the machine has it free beyond a 10 GiB reserve (psutil,
# sampled per pool): a loaded 23 GiB test VM often has not. Pools here are kilobytes: they are built
# inside SGLang's own host_memory_budget_scope (what its pool assembler uses) with this budget.
POOL_BUDGET_BYTES = 256 << 20


def budget():
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    return host_memory_budget_scope(POOL_BUDGET_BYTES)
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
USER_CONFIG = {"backend_name": "ecd", "module_path": "ecd.integrations.sglang", "class_name": "EcdHiCacheStorage",
               "interface_v1": 1}


def mha_host_pool(layout: str = "page_first", *, tokens: int = 256, page_size: int = PAGE_SIZE,
                  dtype: torch.dtype = torch.bfloat16, heads: int = 2, head_dim: int = 8, layers: int = 2):
    """SGLang's MHATokenToKVPoolHost over a real MHATokenToKVPool on "cpu" (unpinned memory)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    device = MHATokenToKVPool(tokens, page_size, dtype, heads, head_dim, layers, "cpu", False,
                              start_layer=0, end_layer=layers - 1)
    with budget():
        return MHATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 2.0, 0, page_size, layout,
                                    pin_memory=False, device="cpu", device_capacity_tokens=device.size,
                                    start_layer=device.start_layer, end_layer=device.end_layer,
                                    write_back_staging=device.hicache_write_back_staging)


MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def mla_host_pool(layout: str = "page_first", *, tokens: int = 256, page_size: int = PAGE_SIZE,
                  dtype: torch.dtype = torch.bfloat16, kv_lora_rank: int = 16, rope_dim: int = 8, layers: int = 2):
    """SGLang's MLATokenToKVPoolHost over a real MLATokenToKVPool on "cpu" (unpinned memory)."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    device = MLATokenToKVPool(tokens, page_size, dtype, kv_lora_rank, rope_dim, layers, "cpu", False,
                              start_layer=0, end_layer=layers - 1)
    with budget():
        return MLATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 2.0, 0, page_size, layout,
                                    pin_memory=False, device="cpu", device_capacity_tokens=device.size,
                                    start_layer=device.start_layer, end_layer=device.end_layer,
                                    target_layer_num=layers)


def mamba_host_pool(*, layers: int = 2, checkpoints: int = 9):
    """SGLang's MambaPoolHost (page size 1) over real state tensors: a sidecar pool for v2."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
    info = MambaStateBufferInfo(temporal=torch.zeros(layers, checkpoints, 3, 4, dtype=torch.float32),
                                conv=(torch.zeros(layers, checkpoints, 5, 2, dtype=torch.bfloat16),))
    with budget():
        return MambaPoolHost(info, 2.0, 0, device_capacity=checkpoints, pin_memory=False, device="cpu",
                             layout="page_first")


def storage_config(extra: dict | None, *, model: str = "test/tiny", tp_rank: int = 0, tp_size: int = 1,
                   pp_rank: int = 0, pp_size: int = 1, mla: bool = False, page_first: bool = True,
                   metrics: bool = True) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=metrics,
                                is_page_first_layout=page_first, model_name=model, extra_config=extra)


def make_backend(endpoint: str, host_pool, **config):
    """ecd's backend as SGLang's cache controller makes it: the factory's "dynamic" backend from
    the user's extra_config, then register_mem_pool_host."""
    extra = {**USER_CONFIG, "endpoint": endpoint, **config.pop("extra", {})}
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra, **config), host_pool)
    backend.register_mem_pool_host(host_pool)
    return backend


def fill(host_pool, seed: int) -> None:
    """Seeded random bytes in every page of the host pool."""
    g = torch.Generator().manual_seed(seed)
    buf = host_pool.kv_buffer
    buf.copy_(torch.randn(buf.shape, generator=g).to(buf.dtype))


def pages(host_pool, first_slot: int, n: int) -> list[torch.Tensor]:
    """Copies of n pages from host slot first_slot on (flat, as SGLang's generic path sees them)."""
    ps = host_pool.page_size
    return [host_pool.get_data_page(first_slot + i * ps, flat=True).clone() for i in range(n)]


def slots(first_slot: int, n: int, page_size: int = PAGE_SIZE) -> torch.Tensor:
    """host_indices for n pages from first_slot on, as SGLang passes them (one per token)."""
    return torch.arange(first_slot, first_slot + n * page_size, dtype=torch.int64)
