"""Loaded by every Python process whose PYTHONPATH has tests/sglang/cpu_shims (the SGLang server
processes of tests/sglang/test_sglang_server.py), and only where torch has no CUDA. SGLang 0.5.23's
HiCache is wired for CUDA/ROCm/XPU devices; on a CPU device three things stop it, each patched
right after its SGLang module loads:

1. sglang.srt.mem_cache.pool_host.common: the host pool registers its buffer with cudaHostRegister
   (`pin_memory` defaults to True and the pool assembler passes no other value): the buffer is
   allocated unpinned here (`alloc_with_host_register` called with pin_memory=False).
2. sglang.srt.mem_cache.pool_host.base: later page buffers (`get_dummy_flat_data_page`) ask torch for
   pinned memory, which a CPU-only torch refuses: `pin_memory` is False once the pool is built.
3. sglang.srt.mem_cache.pool_host.mha: the device<->host KV copies come from sgl_kernel.kvcacheio,
   imported for CUDA/ROCm/XPU only (`NameError: transfer_kv_direct`): `transfer_kv_direct` (the
   `--hicache-io-backend direct`, `--hicache-mem-layout layer_first` path) as torch indexing, the
   same row copy per layer.
Nothing here touches ecd or the storage interface SGLang drives."""
import importlib.abc
import importlib.machinery
import sys

TARGETS = ("sglang.srt.mem_cache.pool_host.common", "sglang.srt.mem_cache.pool_host.base",
           "sglang.srt.mem_cache.pool_host.mha")


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    """sgl_kernel.kvcacheio.transfer_kv_direct in torch: per layer, dst[dst_indices] = src[src_indices]."""
    if len(src_layers) != len(dst_layers):
        raise ValueError("Source and destination layers must have the same number of layers")
    for src, dst in zip(src_layers, dst_layers):
        dst[dst_indices.to(dst.device)] = src[src_indices.to(src.device)].to(dst.device)


def _patch(name, module):
    if name.endswith(".mha"):
        module.transfer_kv_direct = transfer_kv_direct
    elif name.endswith(".common"):
        alloc = module.alloc_with_host_register

        def alloc_with_host_register(dims, dtype, device, pin_memory, allocator, *a, **k):
            return alloc(dims, dtype, device, False, allocator, *a, **k)
        module.alloc_with_host_register = alloc_with_host_register
    else:
        init = module.HostKVCache.__init__

        def __init__(self, *a, **k):
            init(self, *a, **k)
            self.pin_memory = False
        module.HostKVCache.__init__ = __init__
    print(f"tests/sglang/cpu_shims: patched {name} for a CPU-only torch", file=sys.stderr)


class _Hook(importlib.abc.MetaPathFinder):
    def __init__(self):
        self.done = set()

    def find_spec(self, name, path, target=None):
        if name not in TARGETS or name in self.done:
            return None
        self.done.add(name)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            import torch
            if not torch.cuda.is_available():
                _patch(name, module)
        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Hook())
