"""EcdECConnector with real vLLM 0.33 objects (CPU) and a real `ecd serve` daemon.

The scheduler-side calls are made in the order vLLM's Scheduler makes them for a waiting
request (ensure_cache_available, has_cache_item, update_state_after_alloc, build_connector_meta,
then update_connector_output, take_unavailable_requests, request_finished); the worker side
gets the metadata the way MultiprocExecutor delivers it (one pickle of the SchedulerOutput).
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import time

import pytest

from vllm_env import SKIP_REASON, make_vllm_config, round_trips, tiny_model_dir  # noqa: F401 (fixtures)

vllm = pytest.importorskip("vllm", reason=SKIP_REASON)
if getattr(vllm, "__file__", None) is None:
    # Without vLLM, `import vllm` finds this very directory (tests/vllm) as a namespace package.
    pytest.skip(SKIP_REASON, allow_module_level=True)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory  # noqa: E402
from vllm.multimodal.hasher import MultiModalHasher  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.outputs import ECConnectorOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from ecd import Client, PoolFull  # noqa: E402
from ecd.integrations.vllm.ec_connector import EcdECConnector  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SCHEDULER, WORKER = ECConnectorRole.SCHEDULER, ECConnectorRole.WORKER


# ---- helpers (also imported by the encoder process below) -----------------------------------

def make_connector(model_dir: str, ec_role: str, side: ECConnectorRole, **extra) -> EcdECConnector:
    """Through vLLM's own factory, by module path, as `vllm serve --ec-transfer-config` does."""
    connector = ECConnectorFactory.create_connector(make_vllm_config(model_dir, ec_role=ec_role, extra=extra),
                                                    side)
    assert isinstance(connector, EcdECConnector)
    return connector


def image_identifier(model_dir: str, seed: int) -> str:
    """The mm_hash vLLM's processor gives an image: a hash of the model and the pixels."""
    pixels = np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    return MultiModalHasher.hash_kwargs("sha256", model_id=model_dir, image=pixels)


def image_request(req_id: str, images: list[tuple[str, int]], media: bool = True, salt: str | None = None) -> Request:
    """A real vllm.v1.request.Request whose prompt holds `images` as (identifier, embeddings),
    one placeholder range after the other. media=False: a metadata-only EPD request (the proxy
    dropped the pixels), which this engine cannot encode itself. `salt`: its cache_salt."""
    features, offset = [], 0
    for identifier, length in images:
        features.append(MultiModalFeatureSpec(data=MultiModalKwargsItem.dummy() if media else None,
                                              modality="image", identifier=identifier,
                                              mm_position=PlaceholderRange(offset=offset, length=length)))
        offset += length
    return Request(req_id, [7] * (offset + 8), SamplingParams(max_tokens=4), None, mm_features=features,
                   cache_salt=salt)


def encoder_output(num_embeds: int, hidden: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_embeds, hidden, generator=g).to(torch.bfloat16)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


class Step:
    """One engine step of a consumer: the scheduler half then the worker half."""

    def __init__(self, scheduler: EcdECConnector, requests: list[Request]) -> None:
        self.deferred: list[str] = []
        self.external: dict[str, list[int]] = {}  # req_id -> inputs loaded through the connector
        self.output = SchedulerOutput.make_empty()
        for req in requests:
            # Scheduler.schedule(): _ec_transfer_pending, then _try_schedule_encoder_inputs
            if not scheduler.ensure_cache_available(req, req.num_computed_tokens):
                self.deferred.append(req.request_id)
                continue
            for i, feature in enumerate(req.mm_features):
                if scheduler.has_cache_item(feature.identifier):
                    self.external.setdefault(req.request_id, []).append(i)
                else:
                    self.output.scheduled_encoder_inputs.setdefault(req.request_id, []).append(i)
                scheduler.update_state_after_alloc(req, i)  # _allocate_encoder_inputs: both kinds
        self.output.ec_connector_metadata = scheduler.build_connector_meta(self.output)

    def run_worker(self, worker: EcdECConnector, encoder_cache: dict) -> ECConnectorOutput:
        # MultiprocExecutor pickles the whole SchedulerOutput once for its workers.
        self.worker_output: SchedulerOutput = pickle.loads(pickle.dumps(self.output))
        worker.bind_connector_metadata(self.worker_output.ec_connector_metadata)
        worker.start_load_caches(encoder_cache)
        # ... the model runner encodes worker_output.scheduled_encoder_inputs, gathers, runs ...
        out = ECConnectorOutput(ec_connector_worker_meta=worker.build_connector_worker_meta())
        worker.clear_connector_metadata()
        return out


def encoded_by_model_runners(worker_output: SchedulerOutput, requests: list[Request],
                             encoder_cache: dict) -> tuple[list[str], list[str]]:
    """The mm_hashes vLLM's model runners (V1 and V2) would encode for this SchedulerOutput, by
    their own methods; `self` carries only the per-request state those methods read."""
    from types import SimpleNamespace

    from vllm.v1.worker.gpu.mm.encoder_cache import EncoderCache
    from vllm.v1.worker.gpu.mm.encoder_runner import EncoderRunner
    from vllm.v1.worker.gpu_input_batch import CachedRequestState
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    states = {r.request_id: CachedRequestState(r.request_id, r.prompt_token_ids, r.mm_features, r.sampling_params,
                                               None, ([],), 0, []) for r in requests}
    v1, _, _ = GPUModelRunner._batch_mm_inputs_from_scheduler(SimpleNamespace(requests=states), worker_output)
    cache = EncoderCache()
    cache.encoder_outputs = encoder_cache
    for r in requests:
        cache.add_request(r.request_id, r.mm_features)
    v2, _ = EncoderRunner.prepare_mm_inputs(SimpleNamespace(encoder_cache=cache),
                                            worker_output.scheduled_encoder_inputs)
    return v1, v2


def pins(daemon, key: str) -> int:
    with daemon.client() as c:
        entries = [e for e in c.keys(limit=100)[1] if e["key"] == key]
    return entries[0]["pins"] if entries else -1


def pins_become(daemon, keys: list[str], count: int, timeout_s: float = 10.0) -> bool:
    """Whether every key's pin count reaches `count` within timeout_s: the scheduler sends pins
    and unpins without waiting for the daemon, so another client sees them a moment later."""
    deadline = time.monotonic() + timeout_s
    while not all(pins(daemon, k) == count for k in keys):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# ---- the factory ----------------------------------------------------------------------------

def test_factory_creates_the_connector_in_every_role(tiny_model_dir):
    made = {}
    for ec_role in ("ec_producer", "ec_consumer", "ec_both"):
        for side in (SCHEDULER, WORKER):
            # No daemon at this endpoint: construction must not need one (the Client is lazy).
            c = make_connector(tiny_model_dir, ec_role, side, endpoint="ipc:///tmp/ecd-none/ecd.sock")
            assert c.role == side
            assert c.is_producer == (ec_role != "ec_consumer")
            assert c.is_consumer == (ec_role != "ec_producer")
            made[ec_role, side] = c
    # Every engine serving the same model, dtype and embedding width shares one namespace.
    assert len({c.namespace for c in made.values()}) == 1
    assert next(iter(made.values())).namespace.startswith("vllm-ec-")
    named = make_connector(tiny_model_dir, "ec_consumer", SCHEDULER, namespace="paligemma-prod")
    assert named.namespace == "paligemma-prod"
    # No daemon: a miss, no exception, no wait.
    start = time.monotonic()
    assert made["ec_consumer", SCHEDULER].has_cache_item("abc") is False
    made["ec_producer", WORKER].save_caches({"abc": torch.zeros(4, 256)}, "abc")
    assert time.monotonic() - start < 1.0


@pytest.mark.parametrize("extra, key", [
    ({"pin_secs": 5}, "pin_secs"),
    ({"pin_seconds": -1}, "pin_seconds"),
    ({"endpoint": "run/ecd/ecd.sock"}, "endpoint 'run/ecd/ecd.sock': expected ipc://"),
    ({"load_timeout_s": "soon"}, "load_timeout_s"),
])
def test_bad_extra_config_fails_at_construction_naming_the_key(tiny_model_dir, extra, key):
    config = make_vllm_config(tiny_model_dir, ec_role="ec_consumer", extra=extra)
    with pytest.raises(ValueError) as info:
        ECConnectorFactory.create_connector(config, SCHEDULER)
    message = str(info.value)
    assert message.startswith("ec_connector_extra_config:") and key in message, message


# ---- E -> P across processes ----------------------------------------------------------------

ENCODER_PROCESS = r"""
import json, sys
args = json.loads(sys.argv[1])
sys.path[:0] = [args["tests"], args["repo"]]
import torch
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from test_ec_connector import encoder_output, image_identifier, image_request, make_connector

encoder = make_connector(args["model_dir"], "ec_producer", ECConnectorRole.WORKER, endpoint=args["endpoint"])
hidden = encoder._vllm_config.model_config.get_inputs_embeds_size()
requests = [image_request(f"e{i}", [(image_identifier(args["model_dir"], seed), n) for seed, n in images])
            for i, images in enumerate(args["requests"])]
encoder_cache, reference = {}, {}
for req in requests:
    for feature in req.mm_features:
        out = encoder_output(feature.mm_position.get_num_embeds(), hidden, seed=len(reference))
        reference[feature.identifier] = out.clone()      # a copy taken before the save
        encoder_cache[feature.identifier] = out           # what _cache_encoder_output does,
        encoder.save_caches(encoder_cache, feature.identifier)  # then it calls save_caches
        out.fill_(float("nan"))                           # the engine reuses its buffer...
        del encoder_cache[feature.identifier], out        # ...or frees it, right away
torch.save(reference, args["reference"])
print(json.dumps(sorted(reference)))
"""


def test_epd_flow_across_processes_is_bit_identical(daemon, tiny_model_dir, tmp_path, round_trips):
    images = [[(1, 256)], [(2, 64), (3, 128)]]  # (pixel seed, embeddings) per image, per request
    args = {"tests": HERE, "repo": REPO, "model_dir": tiny_model_dir, "endpoint": daemon.endpoint,
            "requests": images, "reference": str(tmp_path / "reference.pt")}
    done = subprocess.run([sys.executable, "-c", ENCODER_PROCESS, json.dumps(args)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    published = json.loads(done.stdout.strip().splitlines()[-1])
    reference = torch.load(args["reference"])

    # The encoder engine's response carries per-item metadata for an orchestrator (vLLM's helper).
    encoder_scheduler = make_connector(tiny_model_dir, "ec_producer", SCHEDULER, endpoint=daemon.endpoint)
    e1 = image_request("e1", [(image_identifier(tiny_model_dir, s), n) for s, n in images[1]])
    delay, params = encoder_scheduler.request_finished(e1)
    assert delay is False and sorted(params) == sorted(f.identifier for f in e1.mm_features)
    assert [params[f.identifier]["item_indices"] for f in e1.mm_features] == [[0], [1]]

    # The prefill engine: its own Requests for the same images hash to the same mm_hashes.
    scheduler = make_connector(tiny_model_dir, "ec_consumer", SCHEDULER, endpoint=daemon.endpoint)
    worker = make_connector(tiny_model_dir, "ec_consumer", WORKER, endpoint=daemon.endpoint)
    requests = [image_request(f"p{i}", [(image_identifier(tiny_model_dir, s), n) for s, n in imgs])
                for i, imgs in enumerate(images)]
    assert sorted(f.identifier for r in requests for f in r.mm_features) == published

    round_trips.clear()
    step = Step(scheduler, requests)
    assert step.deferred == [] and step.output.scheduled_encoder_inputs == {}
    assert step.external == {"p0": [0], "p1": [0, 1]}
    # The ring answered every lookup and the step's pins went without waiting: no round trip
    # (the scheduler's Client was made by an earlier lookup of this test, its hello counted there).
    assert round_trips == []
    assert pins_become(daemon, published, 1)  # pinned until the worker has read them

    round_trips.clear()
    encoder_cache: dict[str, torch.Tensor] = {}
    output = step.run_worker(worker, encoder_cache)
    # ONE get_many for the step's three items, and no round trip: the ring's entry index shows
    # where each is, and the copies are checked against the ring afterwards (client/local_read.py)
    assert round_trips.count("Acquire") == 0, round_trips
    assert sorted(encoder_cache) == published
    for h in published:
        assert encoder_cache[h].device == torch.device("cpu")  # the engine's device (CPU build)
        assert same_bits(encoder_cache[h], reference[h]), h
    assert sorted(output.ec_connector_worker_meta.loaded) == published

    scheduler.update_connector_output(output)
    assert scheduler.take_unavailable_requests() == set()
    for req in requests:
        assert scheduler.request_finished(req) == (False, None)
    assert pins_become(daemon, published, 0)

    # A second step finds nothing to do for items already in the engine's encoder cache.
    round_trips.clear()
    worker.bind_connector_metadata(step.worker_output.ec_connector_metadata)
    worker.start_load_caches(encoder_cache)
    assert "Acquire" not in round_trips

    # A save is one put: after the first, a same-sized output costs its copy and no round trip (a
    # record on the session's submission page, placed in a put lease granted ahead).
    encoder = make_connector(tiny_model_dir, "ec_producer", WORKER, endpoint=daemon.endpoint)
    for i in range(3):
        round_trips.clear()
        encoder.save_caches({f"s{i}": encoder_output(256, 256, i)}, f"s{i}")
    assert round_trips == []


def test_cache_salt_keeps_encoder_outputs_apart(daemon, tiny_model_dir):
    """vLLM's mm_hash never includes a request's cache_salt: the connector folds it into the ecd
    key (salted_key), so a salted request never loads an unsalted or differently salted output,
    and an unsalted one never loads a salted one's. The producer saves an output under the keys
    of the requests that want it: encoded this step (save_caches), or already in its encoder
    cache for an earlier request of another salt (start_save_caches)."""
    from ecd.integrations.vllm.metadata import salted_key
    producer = make_connector(tiny_model_dir, "ec_producer", SCHEDULER, endpoint=daemon.endpoint)
    encoder = make_connector(tiny_model_dir, "ec_producer", WORKER, endpoint=daemon.endpoint)
    a, b = image_identifier(tiny_model_dir, 11), image_identifier(tiny_model_dir, 12)
    outputs = {a: encoder_output(16, 256, 1), b: encoder_output(16, 256, 2)}
    step = Step(producer, [image_request("r1", [(a, 16)]), image_request("r2", [(a, 16)], salt="alice"),
                           image_request("r3", [(b, 16)], salt="bob")])
    encoder.bind_connector_metadata(step.output.ec_connector_metadata)
    for h in outputs:  # the model runner encodes each scheduled item once, then saves it
        encoder.save_caches(dict(outputs), h)
    encoder.clear_connector_metadata()
    # a later request of another salt for `a`, which the engine's encoder cache still holds
    producer.ensure_cache_available(image_request("r4", [(a, 16)], salt="carol"), 0)
    meta = producer.build_connector_meta(SchedulerOutput.make_empty())
    encoder.bind_connector_metadata(meta)
    encoder.start_save_caches(encoder_cache=dict(outputs))
    encoder.clear_connector_metadata()
    with Client(daemon.endpoint, namespace=encoder.namespace) as c:
        stored = dict(zip(["a", "a/alice", "a/carol", "a/mallory", "b", "b/bob"], c.exists(
            [a, salted_key(a, "alice"), salted_key(a, "carol"), salted_key(a, "mallory"), b, salted_key(b, "bob")])))
    assert stored == {"a": True, "a/alice": True, "a/carol": True, "a/mallory": False, "b": False,
                      "b/bob": True}, stored

    # the consumer: each request finds the output of its own salt alone
    scheduler = make_connector(tiny_model_dir, "ec_consumer", SCHEDULER, endpoint=daemon.endpoint)
    worker = make_connector(tiny_model_dir, "ec_consumer", WORKER, endpoint=daemon.endpoint)
    # (misses first: once an output is in this engine's encoder cache, vLLM itself serves it to
    # any request of that mm_hash, whatever its salt: its encoder cache is keyed by mm_hash alone)
    requests = [image_request("mallory", [(a, 16)], media=False, salt="mallory"),
                image_request("plain-b", [(b, 16)], media=False),
                image_request("alice", [(a, 16)], media=False, salt="alice"),
                image_request("bob", [(b, 16)], media=False, salt="bob")]
    step = Step(scheduler, requests)
    assert step.external == {"alice": [0], "bob": [0]} and step.deferred == ["mallory", "plain-b"], step.external
    encoder_cache: dict[str, torch.Tensor] = {}
    output = step.run_worker(worker, encoder_cache)
    assert sorted(output.ec_connector_worker_meta.loaded) == sorted([a, b])
    assert same_bits(encoder_cache[a], outputs[a]) and same_bits(encoder_cache[b], outputs[b])


# ---- misses, lost entries, restarts ---------------------------------------------------------

def test_miss_is_encoded_locally_or_deferred_until_published(daemon, tiny_model_dir, round_trips):
    scheduler = make_connector(tiny_model_dir, "ec_consumer", SCHEDULER, endpoint=daemon.endpoint,
                               load_timeout_s=0.5)
    encoder = make_connector(tiny_model_dir, "ec_producer", WORKER, endpoint=daemon.endpoint)
    with_media = image_request("m", [("never-saved", 16)])
    no_media = image_request("n", [("late", 16)], media=False)
    hopeless = image_request("x", [("never", 16)], media=False)

    round_trips.clear()
    step = Step(scheduler, [with_media, no_media, hopeless])
    # The engine has the pixels: a miss is simply encoded here. No round trip for a miss.
    assert step.output.scheduled_encoder_inputs == {"m": [0]} and step.external == {}
    assert step.output.ec_connector_metadata.loads == []
    assert "Exists" not in round_trips
    # No pixels: deferred (not scheduled, not failed) while the encoder may still publish.
    assert step.deferred == ["n", "x"]
    assert scheduler.take_unavailable_requests() == set()

    encoder.save_caches({"late": encoder_output(16, 256, 0)}, "late")
    step = Step(scheduler, [no_media, hopeless])
    assert step.external == {"n": [0]} and step.deferred == ["x"]
    assert [load.mm_hash for load in step.output.ec_connector_metadata.loads] == ["late"]

    time.sleep(0.6)  # load_timeout_s: then a request that cannot be served is failed, retryably
    step = Step(scheduler, [hopeless])
    assert step.deferred == ["x"]
    assert scheduler.take_unavailable_requests() == {"x"}


def test_entry_deleted_or_pressed_after_the_pin_ends_recomputed(daemon_factory, tiny_model_dir):
    daemon = daemon_factory(size="4MiB")
    scheduler = make_connector(tiny_model_dir, "ec_consumer", SCHEDULER, endpoint=daemon.endpoint)
    worker = make_connector(tiny_model_dir, "ec_consumer", WORKER, endpoint=daemon.endpoint)
    encoder = make_connector(tiny_model_dir, "ec_producer", WORKER, endpoint=daemon.endpoint)
    kept, gone, gone_no_media = encoder_output(1024, 256, 1), encoder_output(16, 256, 2), encoder_output(16, 256, 3)
    for h, t in (("kept", kept), ("gone", gone), ("gone-nm", gone_no_media)):
        encoder.save_caches({h: t}, h)
    reqs = [image_request("a", [("kept", 1024), ("gone", 16)]), image_request("b", [("gone-nm", 16)], media=False)]
    step = Step(scheduler, reqs)
    assert step.external == {"a": [0, 1], "b": [0]}

    with Client(daemon.endpoint, scheduler.namespace) as other:
        # Pool pressure cannot take a pinned entry: 512 KiB puts into a 4 MiB pool evict only
        # unpinned entries (or fail once nothing else is left).
        for i in range(8):  # 4 MiB: more than the pool holds besides them
            try:
                other.put(f"flood-{i}", torch.zeros(1024, 256, dtype=torch.bfloat16))
            except PoolFull:
                pass
        assert other.stats()["evictions"] > 0 and other.exists(["kept", "gone"]) == [True, True]
        # ...but a delete can (pins stop eviction, not deletion).
        assert other.delete(["gone", "gone-nm"]) == [True, True]

    encoder_cache: dict[str, torch.Tensor] = {}
    output = step.run_worker(worker, encoder_cache)  # must not raise
    assert same_bits(encoder_cache["kept"], kept)
    meta = output.ec_connector_worker_meta
    assert meta.loaded == ["kept"] and meta.recomputed == ["gone"] and meta.failed == [("b", "gone-nm")]
    # "gone": handed back to the model runner, which encodes what this dict lists in this step.
    assert step.worker_output.scheduled_encoder_inputs == {"a": [1]}
    assert "gone" not in encoder_cache
    assert encoded_by_model_runners(step.worker_output, reqs, encoder_cache) == (["gone"], ["gone"])
    # "gone-nm" has no pixels here: the scheduler holds the request back and fails it (retryable).
    scheduler.update_connector_output(output)
    assert scheduler.ensure_cache_available(reqs[1], 0) is False
    assert scheduler.take_unavailable_requests() == {"b"}
    for req in reqs:
        scheduler.request_finished(req)
    assert pins_become(daemon, ["kept"], 0)


def connected_trio(daemon, tiny_model_dir):
    """An EC consumer's scheduler and worker and a producer's worker, "img" saved by the producer
    and loaded once by the consumer (every client connected): (scheduler, worker, encoder, emb)."""
    scheduler = make_connector(tiny_model_dir, "ec_consumer", SCHEDULER, endpoint=daemon.endpoint,
                               load_timeout_s=1.0)
    worker = make_connector(tiny_model_dir, "ec_consumer", WORKER, endpoint=daemon.endpoint, load_timeout_s=1.0)
    encoder = make_connector(tiny_model_dir, "ec_producer", WORKER, endpoint=daemon.endpoint, load_timeout_s=1.0)
    emb = encoder_output(64, 256, 5)
    encoder.save_caches({"img": emb}, "img")
    warm: dict[str, torch.Tensor] = {}
    Step(scheduler, [image_request("r0", [("img", 64)])]).run_worker(worker, warm)
    assert same_bits(warm["img"], emb)
    return scheduler, worker, encoder, emb


def test_a_restarted_daemon_serves_the_adopted_embedding(daemon, tiny_model_dir):
    """The default restart adopts the pool ([restart]): an embedding scheduled before the restart
    is loaded from the adopted pool after it, without recompute and without a new connector."""
    scheduler, worker, _, emb = connected_trio(daemon, tiny_model_dir)
    step = Step(scheduler, [image_request("r", [("img", 64)])])
    assert step.external == {"r": [0]}
    daemon.stop(signal.SIGKILL)  # restarted between scheduling and the load: it adopts the pool
    daemon.start()
    loaded: dict[str, torch.Tensor] = {}
    output = step.run_worker(worker, loaded)
    assert output.ec_connector_worker_meta.recomputed == []
    assert same_bits(loaded["img"], emb)


def test_daemon_restart_or_outage_never_raises(daemon_factory, tiny_model_dir, caplog, monkeypatch):
    # A cold restart ([restart] adopt = false): the new pool starts empty, the load must recompute.
    daemon = daemon_factory(extra="[restart]\nadopt = false\n")
    # The connector logs under vLLM's "vllm" logger, which vLLM sets not to propagate to the root
    # logger (where caplog listens): let it, for this test.
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)
    caplog.set_level(logging.WARNING, logger="vllm.ecd.ec_connector")
    scheduler, worker, encoder, emb = connected_trio(daemon, tiny_model_dir)

    req = image_request("r", [("img", 64)])
    step = Step(scheduler, [req])
    assert step.external == {"r": [0]}
    daemon.stop()  # restarted between scheduling and the load: the new pool starts empty
    daemon.start()
    output = step.run_worker(worker, {})
    assert output.ec_connector_worker_meta.recomputed == ["img"]
    assert step.worker_output.scheduled_encoder_inputs == {"r": [0]}  # encoded in this step
    scheduler.update_connector_output(output)
    assert scheduler.take_unavailable_requests() == set()
    scheduler.request_finished(req)

    # The next request for it is a plain miss (encoded locally), and publishing works again.
    assert Step(scheduler, [image_request("r2", [("img", 64)])]).output.scheduled_encoder_inputs == {"r2": [0]}
    encoder.save_caches({"img": emb}, "img")
    step = Step(scheduler, [image_request("r3", [("img", 64)])])
    assert step.external == {"r3": [0]}

    # Down entirely: every call is a miss, none raises, and the warnings are rate-limited.
    daemon.stop()
    caplog.clear()
    output = step.run_worker(worker, {})  # its socket is gone: the client is dropped, no wait
    assert output.ec_connector_worker_meta.recomputed == ["img"]
    Step(scheduler, [image_request("d", [("img", 64)])])  # the same, once, for the other clients
    encoder.save_caches({"img": emb}, "img")
    start = time.monotonic()
    for i in range(20):
        assert Step(scheduler, [image_request(f"d{i}", [("img", 64)])]).external == {}
        encoder.save_caches({"img": emb}, "img")
    assert time.monotonic() - start < 1.0  # then back-off, and no socket: no waiting at all
    downs = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(downs) == 3, downs  # one per operation (load, lookup, save), not one per call

    daemon.start()  # back: the connector reconnects on its own after the back-off
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        encoder.save_caches({"img": emb}, "img")
        if Step(scheduler, [image_request("up", [("img", 64)])]).external:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the connector did not reconnect to the restarted daemon")
    cache: dict[str, torch.Tensor] = {}
    Step(scheduler, [image_request("up2", [("img", 64)])]).run_worker(worker, cache)
    assert same_bits(cache["img"], emb)
