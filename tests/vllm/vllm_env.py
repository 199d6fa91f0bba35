"""Real vLLM 0.33 objects on CPU for tests: a tiny PaliGemma config on disk (no weights, no
network) and VllmConfig factories naming ecd's connectors. Test modules start with
`pytest.importorskip("vllm", reason=SKIP_REASON)` so they skip where vLLM is not installed."""
from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SKIP_REASON = "vLLM is not installed here: `make test-vllm` builds a venv with vLLM 0.33 and runs these"

# A multimodal architecture whose vLLM module imports without torchvision or mistral_common.
TINY_MODEL = {
    "architectures": ["PaliGemmaForConditionalGeneration"],
    "model_type": "paligemma",
    "image_token_index": 257152,
    "hidden_size": 256,
    "projection_dim": 256,
    "torch_dtype": "bfloat16",
    "text_config": {"model_type": "gemma", "hidden_size": 256, "intermediate_size": 512,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                    "num_hidden_layers": 2, "vocab_size": 257216, "max_position_embeddings": 4096,
                    "torch_dtype": "bfloat16"},
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 64, "intermediate_size": 128,
                      "num_attention_heads": 2, "num_hidden_layers": 2, "image_size": 224,
                      "patch_size": 14, "projection_dim": 256, "num_image_tokens": 256},
}


def write_tiny_model(path) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(TINY_MODEL, f)
    return str(path)


def make_vllm_config(model_dir: str, *, ec_role: str | None = None, kv_role: str | None = None,
                     extra: dict | None = None, block_size: int | None = None):
    """A real VllmConfig naming ecd's connectors by module path."""
    from vllm.config import ECTransferConfig, KVTransferConfig, ModelConfig, VllmConfig
    kwargs = {"model_config": ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16")}
    if ec_role is not None:
        kwargs["ec_transfer_config"] = ECTransferConfig(
            ec_connector="EcdECConnector", ec_connector_module_path="ecd.integrations.vllm",
            ec_role=ec_role, ec_connector_extra_config=dict(extra or {}))
    if kv_role is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="EcdKVConnector", kv_connector_module_path="ecd.integrations.vllm",
            kv_role=kv_role, kv_connector_extra_config=dict(extra or {}))
    config = VllmConfig(**kwargs)
    if block_size is not None:
        config.cache_config.block_size = block_size
    return config


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """Import this fixture into a test module (`from vllm_env import tiny_model_dir`). It lives
    here, not in a tests/vllm/conftest.py: a second module named `conftest` would shadow
    tests/conftest.py for the `from conftest import ...` lines of other test directories."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-paligemma"))


@pytest.fixture
def round_trips():
    """Counts daemon round trips by request type, of every ecd.Client (fire-and-forget messages
    are not round trips and are not counted)."""
    from ecd import Client
    from ecd.client.testing import intercept_round_trips
    seen: list[str] = []

    def counting(request, send):
        seen.append(type(request).__name__)
        return send(request)

    with intercept_round_trips(Client, counting):
        yield seen
