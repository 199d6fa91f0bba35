"""SGLang's HiCache L3 storage on ecd: name it on the `sglang serve` command line with
`--hicache-storage-backend dynamic --hicache-storage-backend-extra-config
'{"backend_name": "ecd", "module_path": "ecd.integrations.sglang", "class_name": "EcdHiCacheStorage",
"interface_v1": 1}'` (docs/sglang.md).

Importing the class imports SGLang (it subclasses HiCacheStorage); `import ecd` alone never does.
"""
from __future__ import annotations

__all__ = ["EcdHiCacheStorage"]


def __getattr__(name: str):
    # SGLang's StorageBackendFactory does getattr(module, class_name): loaded on first use.
    if name == "EcdHiCacheStorage":
        from .hicache import EcdHiCacheStorage
        return EcdHiCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
