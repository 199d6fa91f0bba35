"""The keys of SGLang's `--hicache-storage-backend-extra-config` that EcdHiCacheStorage reads,
validated, and its namespace: the configured one, or by default a fingerprint of what makes two
servers' pages interchangeable (model, parallel shard, page geometry, layout, dtype), so SGLang
servers that agree on those share pages through one daemon and servers that do not never read
each other's bytes. Imports neither SGLang nor torch."""
from __future__ import annotations

from typing import Any

import msgspec

from ...config_types import client_endpoint
from ...errors import InvalidRequest
from ..vllm.settings import DEFAULT_ENDPOINT, ConnectorSettings, convert_settings, fingerprint

# Keys SGLang itself reads from the same extra_config (the dynamic backend's three, the zero-copy
# switch, and the prefetch / TP options its cache controller pops): accepted and ignored here.
SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size", "prefetch_threshold",
    "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys",
})


class HiCacheSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    endpoint: str = DEFAULT_ENDPOINT  # the daemon's control endpoint
    namespace: str = ""  # "" = derived from model, shard and page geometry
    pin_seconds: float = 30.0  # how long batch_exists keeps its hits from eviction for the prefetch
    load_timeout_s: float = 5.0  # per daemon round trip (vLLM's connectors' name; `timeout_s` is read too)
    verify: bool = False  # checksum every page on store, check it on load (a mismatch is a miss)

    def __post_init__(self) -> None:
        self.endpoint = client_endpoint(self.endpoint)  # ipc://PATH, tcp://HOST:PORT, or a bare /path
        if not 0 <= self.pin_seconds <= 86400:
            raise ValueError(f"pin_seconds: must be in [0, 86400], got {self.pin_seconds}")
        if not 0 < self.load_timeout_s <= 3600:
            raise ValueError(f"load_timeout_s: must be in (0, 3600], got {self.load_timeout_s}")
        if len(self.namespace) > 256:
            raise ValueError("namespace: longer than 256 characters")

    def connector_settings(self) -> ConnectorSettings:
        """What the shared LazyClient (ecd.integrations.vllm.lazy_client) reads."""
        return ConnectorSettings(endpoint=self.endpoint, namespace=self.namespace, load_timeout_s=self.load_timeout_s)


KNOWN_KEYS = (*HiCacheSettings.__struct_fields__, "timeout_s", *sorted(SGLANG_KEYS))


def parse_settings(extra_config: dict[str, Any] | None) -> HiCacheSettings:
    """The ecd keys of `extra_config`; InvalidRequest naming the key for an unknown key or a bad value."""
    if extra_config is not None and not isinstance(extra_config, dict):
        raise InvalidRequest(f"hicache-storage-backend-extra-config: must be a JSON object, got "
                             f"{type(extra_config).__name__}")
    ours = {k: v for k, v in (extra_config or {}).items() if k not in SGLANG_KEYS}
    if "timeout_s" in ours:  # the name this backend first had for load_timeout_s
        if "load_timeout_s" in ours:
            raise InvalidRequest("hicache-storage-backend-extra-config (ecd): timeout_s and load_timeout_s name the "
                                 "same setting: give one")
        ours["load_timeout_s"] = ours.pop("timeout_s")
    return convert_settings(ours, HiCacheSettings, "hicache-storage-backend-extra-config (ecd)", KNOWN_KEYS)


def shard_facts(config: Any, *, replicated: bool) -> dict[str, Any]:
    """What selects one server's shard of a page, from SGLang's HiCacheStorageConfig. `replicated`:
    the pool holds the same bytes on every TP rank (MLA KV): TP is left out, so all ranks (and
    servers of another TP size) share the pages, as SGLang's own file backend does."""
    facts: dict[str, Any] = {
        "model": getattr(config, "model_name", None),
        "pp": [getattr(config, "pp_rank", 0), getattr(config, "pp_size", 1)],
        "attn_cp": [getattr(config, "attn_cp_rank", 0), getattr(config, "attn_cp_size", 1)],
    }
    dcp_size = getattr(config, "dcp_size", 1) or 1
    if dcp_size > 1:  # equivalent MLA shards of different DCP groups share a page
        facts["dcp"] = [getattr(config, "dcp_rank", 0), dcp_size, getattr(config, "tp_size", 1),
                        getattr(config, "logical_page_size", None)]
    if not replicated:
        facts["tp"] = [getattr(config, "tp_rank", 0), getattr(config, "tp_size", 1)]
    return facts


def derive_namespace(config: Any, pool_facts: dict[str, Any] | None) -> str:
    """e.g. "sglang-hicache-3f2a…": hash of the KV pool's shard and page facts (pool_facts None: no
    host pool registered yet, the configuration's facts alone)."""
    mla = bool(getattr(config, "is_mla_model", False))
    facts = {"kind": "sglang-hicache", "mla": mla, **shard_facts(config, replicated=mla), "pool": pool_facts}
    return f"sglang-hicache-{fingerprint(facts)}"


def sidecar_tag(config: Any, name: str, pool_facts: dict[str, Any]) -> str:
    """The key suffix of a sidecar pool's pages (e.g. mamba): its name and a hash of its own page
    facts, with TP always in (mamba state is TP-sharded even where MLA KV is not)."""
    return f"{name}.{fingerprint({'name': name, **shard_facts(config, replicated=False), 'pool': pool_facts}, 6)}"
