"""The `*_connector_extra_config` keys both connectors accept, validated, plus each connector's
namespace: the configured one, or by default a fingerprint of what makes bytes interchangeable,
so engines that disagree on model, dtype or layout never read each other's entries. Both sides
of a connector (scheduler and worker, in different processes) derive the same one here."""
from __future__ import annotations

import hashlib
import json
from typing import Any, Sequence, TypeVar

import msgspec

from ...config_types import client_endpoint
from ...errors import InvalidRequest

DEFAULT_ENDPOINT = "ipc:///run/ecd/ecd.sock"


class ConnectorSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    endpoint: str = DEFAULT_ENDPOINT
    namespace: str = ""  # "" = derived from model, dtype and layout
    pin_seconds: float = 60.0  # how long a scheduler-side hit stays pinned for the worker's load
    load_timeout_s: float = 5.0  # per daemon round trip (and the longest a load may wait)
    # Producers store an xxh3-64 checksum with every entry; consumers verify it on every load, and
    # an entry whose bytes do not match is a miss (recomputed), never loaded. A daemon's
    # `[namespaces.X] verify = true` does the same for namespace X whatever this says.
    verify: bool = False
    # The peer plane ([cluster] of the daemons; docs/vllm.md, "Across nodes"). Consumers: ask the
    # local daemon to pull what is missing from its configured peers (a KV request that carries
    # a producer's ecd kv_transfer_params is fetched from that producer whatever this says).
    fetch_from_peers: bool = False
    fetch_timeout_s: float = 5.0  # longest one fetch from peers may take
    # Producers: the peer endpoint other nodes reach this node's daemon at, as put in
    # kv_transfer_params ("": the daemon's cluster.listen, unless that is a wildcard address).
    peer_endpoint: str = ""

    def __post_init__(self) -> None:
        self.endpoint = client_endpoint(self.endpoint)  # ipc://PATH, tcp://HOST:PORT, or a bare /path
        if not 0 < self.pin_seconds <= 86400:
            raise ValueError(f"pin_seconds: must be in (0, 86400], got {self.pin_seconds}")
        if not 0 < self.load_timeout_s <= 3600:
            raise ValueError(f"load_timeout_s: must be in (0, 3600], got {self.load_timeout_s}")
        if not 0 < self.fetch_timeout_s <= 3600:
            raise ValueError(f"fetch_timeout_s: must be in (0, 3600], got {self.fetch_timeout_s}")
        if self.peer_endpoint and not self.peer_endpoint.startswith("tcp://"):
            raise ValueError(f"peer_endpoint: must be tcp://HOST:PORT, got {self.peer_endpoint!r}")
        if len(self.namespace) > 256:
            raise ValueError("namespace: longer than 256 characters")


S = TypeVar("S", bound=msgspec.Struct)


def convert_settings(raw: dict[str, Any], kind: type[S], which: str, known: Sequence[str]) -> S:
    """`raw` as the settings struct `kind`; InvalidRequest prefixed with `which` (the option the
    user wrote) naming the key of an unknown key (listing `known`) or of a bad value."""
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as exc:
        message = str(exc)
        if message.startswith("Object contains unknown field"):
            message = f"{message.split('`')[1]}: unknown key (known: {', '.join(known)})"
        raise InvalidRequest(f"{which}: {message}") from None


def parse_settings(extra_config: dict[str, Any] | None, which: str) -> ConnectorSettings:
    """`which` names the vLLM option in errors, e.g. "ec_connector_extra_config"."""
    return convert_settings(extra_config or {}, ConnectorSettings, which, ConnectorSettings.__struct_fields__)


def fingerprint(facts: dict[str, Any], size: int = 8) -> str:
    """A short stable hash of `facts` (JSON, keys sorted): what default namespaces are made of."""
    return hashlib.blake2b(json.dumps(facts, sort_keys=True, default=str).encode(), digest_size=size).hexdigest()


def default_namespace(kind: str, vllm_config: Any, layout: dict[str, Any]) -> str:
    """e.g. "vllm-ec-3f2a…": hash of model, dtype, the connector kind and its layout facts."""
    model_config = getattr(vllm_config, "model_config", None)
    facts = {
        "kind": kind,
        "model": getattr(model_config, "model", None),
        "revision": getattr(model_config, "revision", None),
        "dtype": str(getattr(model_config, "dtype", None)),
        **layout,
    }
    return f"vllm-{kind}-{fingerprint(facts)}"


def kv_namespace(settings: ConnectorSettings, vllm_config: Any) -> str:
    """The KV connector's namespace: configured, or derived from the KV block layout."""
    return settings.namespace or default_namespace("kv", vllm_config, kv_layout_facts(vllm_config))


def ec_namespace(settings: ConnectorSettings, vllm_config: Any) -> str:
    """The EC connector's namespace: configured, or derived from the embeddings' width and dtype."""
    model_config = vllm_config.model_config
    return settings.namespace or default_namespace("ec", vllm_config, {
        "embed_size": model_config.get_inputs_embeds_size() if model_config else None,
        "embed_dtype": str(getattr(model_config, "dtype", None)),
    })


def kv_dtype_name(vllm_config: Any) -> str:
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    if cache_dtype == "auto":
        return str(getattr(vllm_config.model_config, "dtype", None))
    return cache_dtype


def kv_layout_facts(vllm_config: Any) -> dict[str, Any]:
    """What makes two engines' KV blocks interchangeable (the default namespace hashes it)."""
    model_config, parallel = vllm_config.model_config, vllm_config.parallel_config
    try:
        from vllm.platforms import current_platform
        platform = current_platform.device_type
    except Exception:  # pragma: no cover
        platform = None
    attention = getattr(vllm_config, "attention_config", None)
    return {
        "block_size": vllm_config.cache_config.block_size,
        "num_layers": model_config.get_total_num_hidden_layers(),
        "num_kv_heads": model_config.get_num_kv_heads(parallel),  # per tensor-parallel rank
        "head_size": model_config.get_head_size(),
        "kv_cache_dtype": kv_dtype_name(vllm_config),
        "tensor_parallel_size": parallel.tensor_parallel_size,
        "pipeline_parallel_size": parallel.pipeline_parallel_size,
        "platform": platform,
        "attention_backend": str(getattr(attention, "backend", None)),
        "hash_algo": getattr(vllm_config.cache_config, "prefix_caching_hash_algo", None),
    }
