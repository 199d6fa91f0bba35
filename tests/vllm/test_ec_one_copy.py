"""EcdECConnector's consumer hands vLLM's encoder cache its own copy, made once (issue 26, item 4).

The real worker's start_load_caches, driven as the model runner drives it after a real scheduler
step (tests/vllm/test_ec_connector.py's Step), on a CPU build: each tensor put into the encoder
cache must hold the encoder output's bits, lie outside the daemon's pool (the load's lease ends
with the call), and be the only buffer of its size the load allocated (tests/copy_count.py: torch's
allocations and Python's, seen by the allocators). The client-level test of the same path, and
its controls, are tests/integration/test_one_copy.py; on a GPU, tests/gpu/test_gpu_one_copy.py.
"""
from __future__ import annotations

import pickle

import pytest

from vllm_env import SKIP_REASON, tiny_model_dir  # noqa: F401 (fixture)

vllm = pytest.importorskip("vllm", reason=SKIP_REASON)
if getattr(vllm, "__file__", None) is None:  # see test_ec_connector.py
    pytest.skip(SKIP_REASON, allow_module_level=True)

import torch  # noqa: E402

from copy_count import observe, pool_overlaps  # noqa: E402
from test_ec_connector import (SCHEDULER, WORKER, Step, encoder_output, image_identifier,  # noqa: E402
                               image_request, make_connector, same_bits)

NUM_EMBEDS, HIDDEN = 576, 4096  # one image of a LLaVA-sized model: 4.5 MiB of bfloat16
NBYTES = NUM_EMBEDS * HIDDEN * 2


def test_start_load_caches_copies_each_encoder_output_once(daemon, tiny_model_dir):
    encoder = make_connector(tiny_model_dir, "ec_producer", WORKER, endpoint=daemon.endpoint)
    hashes = [image_identifier(tiny_model_dir, seed) for seed in range(3)]
    reference = {}
    for seed, mm_hash in enumerate(hashes):
        out = encoder_output(NUM_EMBEDS, HIDDEN, seed)
        reference[mm_hash] = out.clone()
        encoder.save_caches({mm_hash: out}, mm_hash)

    scheduler = make_connector(tiny_model_dir, "ec_consumer", SCHEDULER, endpoint=daemon.endpoint)
    worker = make_connector(tiny_model_dir, "ec_consumer", WORKER, endpoint=daemon.endpoint)
    encoder_cache: dict[str, torch.Tensor] = {}

    def load(step: Step):
        worker_output = pickle.loads(pickle.dumps(step.output))  # as MultiprocExecutor delivers it
        worker.bind_connector_metadata(worker_output.ec_connector_metadata)
        try:
            return observe(lambda: worker.start_load_caches(encoder_cache), NBYTES)
        finally:
            worker.clear_connector_metadata()

    # The first step connects the worker's client and maps the pool: not what is counted.
    load(Step(scheduler, [image_request("warm", [(hashes[0], NUM_EMBEDS)])]))
    assert list(encoder_cache) == [hashes[0]]

    step = Step(scheduler, [image_request("p0", [(hashes[1], NUM_EMBEDS)]),
                            image_request("p1", [(hashes[2], NUM_EMBEDS)])])
    assert step.external == {"p0": [0], "p1": [0]}
    seen = load(step)
    client = worker.client.get("test")
    assert client is not None
    for mm_hash in hashes:
        assert same_bits(encoder_cache[mm_hash], reference[mm_hash]), mm_hash
        assert not pool_overlaps(client, encoder_cache[mm_hash])
    assert len(seen.torch_buffers) == 2, seen.torch_buffers  # one per encoder output loaded
    assert seen.python_peak < NBYTES, seen.python_peak  # nothing staged on the way
    assert seen.torch_copies == 0  # copied by ecd._copy straight out of the mapping
