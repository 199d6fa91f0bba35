"""The logic of two of vLLM's own connector tests that ecd cannot pass as written (docs/vllm.md,
"vLLM's own connector tests"): tests/v1/ec_connector/unit/test_ec_example_connector.py's
TestCacheExistence::test_has_cache_item_all_exist_3_items and ::test_has_cache_item_partial_exist
save through a SCHEDULER-role connector, which vLLM never does (save_caches is a worker-side
method). Here the same checks go through the roles vLLM uses: a producer's worker saves, a
consumer's scheduler looks up. Our code, following theirs; a real daemon.

Not followed: their producer-side lookup. ecd's has_cache_item answers False on a pure
producer (the engine encodes and publishes; see docs/vllm.md, "vLLM's own connector tests")."""
from __future__ import annotations

import pytest

from vllm_env import SKIP_REASON, make_vllm_config, tiny_model_dir  # noqa: F401 (fixture)

vllm = pytest.importorskip("vllm", reason=SKIP_REASON)
if getattr(vllm, "__file__", None) is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)

import torch  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory  # noqa: E402

ITEMS = ["img_hash_1", "img_hash_2", "img_hash_3"]  # three images of one request


def connector(model_dir: str, ec_role: str, side: ECConnectorRole, endpoint: str, namespace: str):
    config = make_vllm_config(model_dir, ec_role=ec_role, extra={"endpoint": endpoint, "namespace": namespace})
    return ECConnectorFactory.create_connector(config, side)


def embeddings(tiny_model_dir: str) -> torch.Tensor:
    hidden = make_vllm_config(tiny_model_dir).model_config.get_inputs_embeds_size()
    return torch.randn(10, hidden).to(torch.bfloat16)


@pytest.mark.parametrize("saved", [ITEMS, ITEMS[1:2]], ids=["all_exist_3_items", "partial_exist"])
def test_has_cache_item_finds_what_a_producer_saved_and_only_that(daemon, tiny_model_dir, saved):
    namespace = f"upstream-logic-{len(saved)}"
    worker = connector(tiny_model_dir, "ec_producer", ECConnectorRole.WORKER, daemon.endpoint, namespace)
    consumer = connector(tiny_model_dir, "ec_consumer", ECConnectorRole.SCHEDULER, daemon.endpoint, namespace)
    try:
        encoder_cache: dict[str, torch.Tensor] = {}
        for mm_hash in saved:
            encoder_cache[mm_hash] = embeddings(tiny_model_dir)
            worker.save_caches(encoder_cache, mm_hash)
        expected = [mm_hash in saved for mm_hash in ITEMS]
        assert [consumer.has_cache_item(h) for h in ITEMS] == expected
    finally:
        for c in (worker, consumer):
            c.shutdown()
