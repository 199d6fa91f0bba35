"""NOT Intel's sgl-kernel. SGLang 0.5.23's CPU path imports a few names from `sgl_kernel` at module
load (e.g. `copy_all_layer_kv_cache_cpu` in sglang/kernels/ops/kvcache/cache_move.py), and its CPU
kernels come only from building sgl-kernel's CPU variant from SGLang's source tree (no wheel on
PyPI). tests/sglang/test_sglang_server.py serves with `--attention-backend torch_native` on a CPU
without AMX, where none of those kernels is called: this module only lets the imports succeed, and
any call raises, naming the kernel, so a run that needed one fails loudly instead of computing
something else."""


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"tests/sglang/cpu_shims: sgl_kernel.{name} is not available on this CPU")
    missing.__name__ = name
    return missing
