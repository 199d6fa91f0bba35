"""A pytest plugin that points vLLM's own connector unit tests at ecd's connectors.

tests/vllm_upstream/run.py runs vLLM's tests (from vLLM's sdist, never copied into this repo)
with `-p ecd_upstream_plugin`. Before the test modules are imported, this plugin:

- starts one real `ecd serve` daemon (tests/conftest.py's DaemonProcess) for the session;
- puts ecd's connectors where the tests look for a storage connector: the names `ExampleConnector`
  (KV) and `ECExampleConnector` (EC), both in vLLM's connector factories and in the modules the
  tests import them from (so `TestExampleConnector`, the tests' call-recording wrapper, wraps
  ecd's). What they construct is ecd's EcdKVConnector / EcdECConnector, unchanged, except that
  the connector's extra config is ecd's (endpoint: the test daemon, namespace: one per test) in
  place of the example connectors' `shared_storage_path`;
- writes the few model configs the tests name (config.json only: architecture sizes, no weights,
  no tokenizer) into a private Hugging Face cache, since the tests run offline;
- records, per test, its outcome and whether it constructed an ecd connector
  (ECD_UPSTREAM_REPORT names the JSON file).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]

# config.json of the models vLLM's connector tests name (ModelConfig reads only this): the
# published architecture sizes. HF_HUB_OFFLINE=1 resolves them from the cache written here.
MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "facebook/opt-125m": {
        "architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 768,
        "ffn_dim": 3072, "num_hidden_layers": 12, "num_attention_heads": 12, "vocab_size": 50272,
        "max_position_embeddings": 2048, "word_embed_proj_dim": 768, "do_layer_norm_before": True,
        "activation_function": "relu", "torch_dtype": "float16", "bos_token_id": 2,
        "eos_token_id": 2, "pad_token_id": 1,
    },
    "Qwen/Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
        "torch_dtype": "bfloat16", "tie_word_embeddings": True, "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "llava-hf/llava-1.5-7b-hf": {
        "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
        "image_token_index": 32000, "projector_hidden_act": "gelu", "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default", "pad_token_id": 32001, "torch_dtype": "float16",
        "text_config": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
                        "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
                        "num_key_value_heads": 32, "vocab_size": 32064, "max_position_embeddings": 4096,
                        "rms_norm_eps": 1e-5, "torch_dtype": "float16"},
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024, "image_size": 336,
                          "intermediate_size": 4096, "num_attention_heads": 16, "num_hidden_layers": 24,
                          "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
    },
}


def write_hf_cache(root: Path) -> None:
    """A Hugging Face hub cache holding MODEL_CONFIGS (refs/main -> one snapshot)."""
    for repo_id, config in MODEL_CONFIGS.items():
        base = root / "hub" / ("models--" + repo_id.replace("/", "--"))
        commit = hashlib.sha1(repo_id.encode()).hexdigest()
        (base / "refs").mkdir(parents=True, exist_ok=True)
        (base / "refs" / "main").write_text(commit)
        snapshot = base / "snapshots" / commit
        snapshot.mkdir(parents=True, exist_ok=True)
        (snapshot / "config.json").write_text(json.dumps(config))


def load_daemon_helpers():
    """tests/conftest.py, as a module of another name (the upstream tree has conftests too)."""
    spec = importlib.util.spec_from_file_location("ecd_tests_conftest", REPO / "tests" / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["ecd_tests_conftest"] = module
    spec.loader.exec_module(module)
    return module


class Overlay:
    """An object as the test made it, but for the attributes given here (read-only view)."""

    def __init__(self, base: Any, **overrides: Any) -> None:
        object.__setattr__(self, "overlay_base", base)
        for name, value in overrides.items():
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "overlay_base"), name)


class State:
    endpoint = ""
    namespace = "upstream"
    constructed = 0  # ecd connectors made during the current test


def ecd_settings() -> dict[str, Any]:
    return {"endpoint": State.endpoint, "namespace": State.namespace, "load_timeout_s": 5.0}


def with_ecd_settings(vllm_config: Any, attr: str, field: str) -> Any:
    transfer = getattr(vllm_config, attr)
    return Overlay(vllm_config, **{attr: Overlay(transfer, **{field: ecd_settings()})})


def make_adapters():
    from ecd.integrations.vllm.ec_connector import EcdECConnector
    from ecd.integrations.vllm.kv_connector import EcdKVConnector

    class EcdKVAsExample(EcdKVConnector):
        """EcdKVConnector, under the name the tests use; ecd's settings in its extra config."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            State.constructed += 1
            super().__init__(with_ecd_settings(vllm_config, "kv_transfer_config", "kv_connector_extra_config"),
                             role, kv_cache_config)

    class EcdECAsExample(EcdECConnector):
        """EcdECConnector, under the name the tests use; ecd's settings in its extra config."""

        def __init__(self, vllm_config: Any, role: Any) -> None:
            State.constructed += 1
            super().__init__(with_ecd_settings(vllm_config, "ec_transfer_config", "ec_connector_extra_config"),
                             role)

    return EcdKVAsExample, EcdECAsExample


def point_vllm_at_ecd() -> None:
    from vllm.distributed.ec_transfer.ec_connector import example_connector as ec_example
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1 import example_connector as kv_example

    kv_cls, ec_cls = make_adapters()
    kv_example.ExampleConnector = kv_cls
    ec_example.ECExampleConnector = ec_cls
    # The factories' lazy loaders, by name (register_connector refuses a name twice).
    vars(KVConnectorFactory)["_registry"]["ExampleConnector"] = lambda: kv_cls
    vars(ECConnectorFactory)["_registry"]["ECExampleConnector"] = lambda: ec_cls


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ["HF_HUB_OFFLINE"] = "1"
    hf_home = Path(tempfile.mkdtemp(prefix="ecd-upstream-hf-"))
    write_hf_cache(hf_home)
    os.environ["HF_HOME"] = str(hf_home)
    os.environ["HF_HUB_CACHE"] = str(hf_home / "hub")
    config.addinivalue_line("markers", "cpu_test: vLLM's marker for tests that need no GPU")
    helpers = load_daemon_helpers()
    daemon = helpers.DaemonProcess(size="256MiB")
    daemon.start()
    State.endpoint = daemon.endpoint
    config.stash[DAEMON] = (helpers, daemon)
    config.stash[RESULTS] = {}
    point_vllm_at_ecd()


DAEMON = pytest.StashKey[Any]()
RESULTS = pytest.StashKey[dict]()


def pytest_unconfigure(config: pytest.Config) -> None:
    helpers, daemon = config.stash.get(DAEMON, (None, None))
    if daemon is not None:
        daemon.cleanup()
        helpers.pytest_sessionfinish(None, 0)
    path = os.environ.get("ECD_UPSTREAM_REPORT")
    if path and RESULTS in config.stash:
        Path(path).write_text(json.dumps(config.stash[RESULTS], indent=1, sort_keys=True))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """ECD_UPSTREAM_SELECT names a file of node ids: only those run (run.py's applicable list)."""
    path = os.environ.get("ECD_UPSTREAM_SELECT")
    if not path:
        return
    wanted = set(Path(path).read_text().split())
    dropped = [item for item in items if item.nodeid not in wanted]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if item.nodeid in wanted]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    State.constructed = 0
    State.namespace = "upstream-" + hashlib.blake2b(item.nodeid.encode(), digest_size=6).hexdigest()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    results = item.config.stash[RESULTS]
    entry = results.setdefault(item.nodeid, {"outcome": "passed", "ecd": False, "message": ""})
    entry["ecd"] = entry["ecd"] or State.constructed > 0
    if report.failed or (report.skipped and entry["outcome"] == "passed"):
        entry["outcome"] = "failed" if report.failed else "skipped"
        if report.failed and call.excinfo is not None:
            entry["message"] = f"{report.when}: {call.excinfo.typename}: {call.excinfo.value}"[:500]
        elif report.skipped and isinstance(report.longrepr, tuple):
            entry["message"] = str(report.longrepr[2])[:500]
    return report
