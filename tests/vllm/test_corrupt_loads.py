"""A corrupted entry (its bytes no longer match the checksum its producer stored) between the
scheduler's lookup and the worker's load, for both connectors, against real vLLM 0.33 classes and
a real `ecd serve`: with `"verify": true` the worker's verified read catches it, and the connector
treats that one entry exactly as a miss: the KV connector reports that block alone as a load
error (vLLM recomputes it), the EC connector hands that item alone back to the model runner (or
fails it when it cannot be encoded here); every other entry of the step still loads, and no
corrupted byte reaches the engine's caches. The bytes are changed in the daemon's pool, through a
third client's read-write mapping, after the lookup pinned the entry.
"""
from __future__ import annotations

import pytest

from vllm_env import SKIP_REASON, tiny_model_dir  # noqa: F401 (fixtures)

vllm = pytest.importorskip("vllm", reason=SKIP_REASON)
if getattr(vllm, "__file__", None) is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)

import torch  # noqa: E402
from test_ec_connector import (SCHEDULER, WORKER, Step, encoded_by_model_runners, encoder_output,  # noqa: E402
                               image_request, make_connector, same_bits)
from test_kv_connector import BS, LAYERS, Engine, assert_same_blocks, bits, make_request, tokens  # noqa: E402

from ecd import Client  # noqa: E402
from ecd.protocol import Acquire, Location, Release  # noqa: E402


def corrupt(endpoint: str, namespace: str, key: str) -> Location:
    """Flip the first byte of `key`'s entry in the daemon's pool (its producer's checksum stays)."""
    with Client(endpoint, namespace=namespace) as c:
        (loc,) = c.request(Acquire(0, namespace, [key], 0.0)).results
        assert isinstance(loc, Location) and loc.checksum, loc  # stored with a checksum
        c.request(Release(0, [loc.generation]))
        buf = c.mapping.rw_for(loc.pool, loc.offset, loc.nbytes)
        buf[loc.offset] ^= 0xFF
    return loc


def integrity_failures(daemon) -> int:
    with daemon.client() as c:
        return c.stats()["integrity_failures"]


def test_kv_block_corrupted_after_lookup_is_a_load_error_of_that_block_alone(tiny_model_dir, daemon):
    a = Engine(tiny_model_dir, daemon.endpoint, verify=True)
    b = Engine(tiny_model_dir, daemon.endpoint, descending=True, verify=True)
    prompt = tokens(21, 4 * BS + 1)
    s1 = a.prefill(make_request("a", prompt))
    req = make_request("b", prompt)
    ns = a.scheduler.namespace
    orig = b.scheduler.get_num_new_matched_tokens

    def lookup_then_corrupt(request, num_computed):
        result = orig(request, num_computed)  # found and pinned all four
        corrupt(daemon.endpoint, ns, request.block_hashes[1].hex())
        return result

    b.scheduler.get_num_new_matched_tokens = lookup_then_corrupt
    before = {layer: t.clone() for layer, t in b.caches.items()}
    s2 = b.prefill(req)
    assert s2.matched == 4 * BS
    assert s2.errors == {s2.block_ids[1]}  # that block alone, reported; nothing raised
    for i in (0, 2, 3):  # the rest loaded, bit for bit
        assert_same_blocks(a, [s1.block_ids[i]], b, [s2.block_ids[i]])
    for layer in LAYERS:  # and not one byte of the corrupt block reached b's cache
        assert torch.equal(bits(b.block(layer, s2.block_ids[1])), bits(before[layer][s2.block_ids[1]]))
    assert integrity_failures(daemon) >= 1  # counted with the daemon (ecd_integrity_failures_total)
    assert b.worker.get_block_ids_with_load_errors() == set()  # reported once


def test_kv_verify_off_by_default_stores_no_checksum(tiny_model_dir, daemon):
    """The setting is what turns checksums on: without it (and no verify namespace), none is
    stored, and a load does not hash."""
    a = Engine(tiny_model_dir, daemon.endpoint)
    req = make_request("a", tokens(22, 2 * BS + 1))
    a.prefill(req)
    with Client(daemon.endpoint, namespace=a.scheduler.namespace) as c:
        (loc,) = c.request(Acquire(0, c.namespace, [req.block_hashes[0].hex()], 0.0)).results
        c.request(Release(0, [loc.generation]))
    assert isinstance(loc, Location) and loc.checksum == 0


def test_ec_item_corrupted_after_hit_is_recomputed_or_failed_alone(daemon, tiny_model_dir):
    scheduler = make_connector(tiny_model_dir, "ec_consumer", SCHEDULER, endpoint=daemon.endpoint, verify=True)
    worker = make_connector(tiny_model_dir, "ec_consumer", WORKER, endpoint=daemon.endpoint, verify=True)
    encoder = make_connector(tiny_model_dir, "ec_producer", WORKER, endpoint=daemon.endpoint, verify=True)
    kept, bad, bad_no_media = encoder_output(64, 256, 1), encoder_output(16, 256, 2), encoder_output(16, 256, 3)
    for h, t in (("kept", kept), ("bad", bad), ("bad-nm", bad_no_media)):
        encoder.save_caches({h: t}, h)
    reqs = [image_request("a", [("kept", 64), ("bad", 16)]), image_request("b", [("bad-nm", 16)], media=False)]
    step = Step(scheduler, reqs)
    assert step.external == {"a": [0, 1], "b": [0]}  # all three found and pinned
    for key in ("bad", "bad-nm"):
        corrupt(daemon.endpoint, scheduler.namespace, key)

    encoder_cache: dict[str, torch.Tensor] = {}
    output = step.run_worker(worker, encoder_cache)  # must not raise
    assert set(encoder_cache) == {"kept"} and same_bits(encoder_cache["kept"], kept)
    meta = output.ec_connector_worker_meta
    assert meta.loaded == ["kept"] and meta.recomputed == ["bad"] and meta.failed == [("b", "bad-nm")]
    # "bad": handed back to the model runner, which encodes it in this step from the request's media
    assert step.worker_output.scheduled_encoder_inputs == {"a": [1]}
    assert encoded_by_model_runners(step.worker_output, reqs, encoder_cache) == (["bad"], ["bad"])
    scheduler.update_connector_output(output)
    assert scheduler.take_unavailable_requests() == {"b"}  # no media here: failed (retryable)
    assert integrity_failures(daemon) >= 2
