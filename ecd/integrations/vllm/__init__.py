"""vLLM connectors on ecd: name them on the `vllm serve` command line with
`"ec_connector_module_path": "ecd.integrations.vllm"` / `"kv_connector_module_path": ...`.

Importing this package imports vLLM (the connectors subclass its base classes); `import ecd`
alone never does.
"""
from __future__ import annotations

__all__ = ["EcdECConnector", "EcdKVConnector"]


def __getattr__(name: str):
    # vLLM's factories do getattr(module, class_name): load each connector on first use.
    if name == "EcdECConnector":
        from .ec_connector import EcdECConnector
        return EcdECConnector
    if name == "EcdKVConnector":
        from .kv_connector import EcdKVConnector
        return EcdKVConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
