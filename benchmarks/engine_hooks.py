"""Connector classes that time their own hooks, for benchmarks/bench_engine.py.

`TimedEcdKVConnector`, `TimedExampleConnector`, `TimedNixlConnector`, `TimedEcdECConnector` and
`TimedECExampleConnector` are the connectors vLLM ships or ecd ships, unchanged but for a clock
around each scheduler and worker hook the connector itself defines (the base class's no-op
defaults are left alone). vLLM loads them by module path (`kv_connector_module_path:
"engine_hooks"`), in the engine core, where the scheduler and the CPU worker live.

Each hook call appends one line `HOOK START_NS END_NS` (CLOCK_MONOTONIC, so the driver can place
it in its own timeline) to the file named by ECD_BENCH_HOOKS, through one O_APPEND descriptor:
a few microseconds per call, against hooks that cost tens of microseconds to milliseconds.
Without ECD_BENCH_HOOKS nothing is written. Classes are made on first use (module __getattr__),
so a missing optional connector (NIXL) fails only the run that asks for it.
"""
from __future__ import annotations

import functools
import importlib
import os
import time
from typing import Any

KV_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
            "request_finished", "update_connector_output", "start_load_kv", "wait_for_layer_load",
            "save_kv_layer", "wait_for_save", "get_finished")
EC_HOOKS = ("has_cache_item", "ensure_cache_available", "update_state_after_alloc", "build_connector_meta",
            "request_finished", "update_connector_output", "start_load_caches", "save_caches", "get_finished")
# Which hooks are the hand-off on the receiving side (the rest are the scheduler's or the saver's).
LOAD_HOOKS = {"start_load_kv", "wait_for_layer_load", "get_finished", "start_load_caches"}
SCHEDULER_HOOKS = {"get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                   "request_finished", "update_connector_output", "has_cache_item", "ensure_cache_available"}
SAVE_HOOKS = {"save_kv_layer", "wait_for_save", "save_caches"}

BASES = {  # Timed<name>: (module, class, hooks)
    "EcdKVConnector": ("ecd.integrations.vllm", "EcdKVConnector", KV_HOOKS),
    "ExampleConnector": ("vllm.distributed.kv_transfer.kv_connector.v1.example_connector", "ExampleConnector",
                         KV_HOOKS),
    "NixlConnector": ("vllm.distributed.kv_transfer.kv_connector.v1.nixl", "NixlConnector", KV_HOOKS),
    "EcdECConnector": ("ecd.integrations.vllm", "EcdECConnector", EC_HOOKS),
    "ECExampleConnector": ("vllm.distributed.ec_transfer.ec_connector.example_connector", "ECExampleConnector",
                           EC_HOOKS),
}
_ABSTRACT = {"KVConnectorBase_V1", "KVConnectorBase", "ECConnectorBase", "object"}
_fd: int | None = None


def _record(hook: str, start_ns: int, end_ns: int) -> None:
    global _fd
    if _fd is None:
        path = os.environ.get("ECD_BENCH_HOOKS")
        if not path:
            return
        _fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(_fd, f"{hook} {start_ns} {end_ns}\n".encode())


def _clocked(hook: str, method: Any) -> Any:
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.monotonic_ns()
        try:
            return method(self, *args, **kwargs)
        finally:
            _record(hook, start, time.monotonic_ns())
    return wrapper


def timed(base: type, hooks: tuple[str, ...]) -> type:
    """A subclass of `base` whose own hooks (those not inherited from the abstract base) are clocked."""
    own = {}
    for hook in hooks:
        owner = next((k for k in base.__mro__ if hook in k.__dict__), None)
        if owner is not None and owner.__name__ not in _ABSTRACT:
            own[hook] = _clocked(hook, getattr(base, hook))
    return type(f"Timed{base.__name__}", (base,), {**own, "__module__": __name__})


@functools.cache
def _make(name: str) -> type:
    module, cls, hooks = BASES[name]
    return timed(getattr(importlib.import_module(module), cls), hooks)


def __getattr__(attr: str) -> type:
    if attr.startswith("Timed") and attr[len("Timed"):] in BASES:
        return _make(attr[len("Timed"):])
    raise AttributeError(attr)


def read_hooks(path: str) -> list[tuple[str, int, int]]:
    """The lines a run wrote: [(hook, start_ns, end_ns), ...]; [] if it wrote none."""
    try:
        with open(path) as f:
            return [(h, int(a), int(b)) for h, a, b in (line.split() for line in f if line.strip())]
    except FileNotFoundError:
        return []
