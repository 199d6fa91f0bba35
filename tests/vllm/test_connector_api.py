"""The rest of vLLM's connector API, against vLLM's real classes and a real `ecd serve`:
statistics (vLLM's scheduler aggregates them, its msgpack carries them, its logging and Prometheus
stat loggers show them), the connector's KV events (vLLM's scheduler publishes them through its
own ZMQ event publisher, beside its own blocks), and handshake metadata (the workers' daemons
checked by the scheduler). Runs under vLLM 0.33 (`make test-vllm`) and 0.32 (`make test-engine`).

The worker's part of a step calls the connector in the order vLLM's
KVConnectorModelRunnerMixin does (bind, start_load_kv, forward, wait_for_save,
get_block_ids_with_load_errors, get_kv_connector_stats, get_kv_connector_kv_cache_events) and
hands vLLM's real Scheduler a real KVConnectorOutput, as vLLM's model runner does.
"""
from __future__ import annotations

import logging
import pickle
import time

import pytest

from vllm_env import SKIP_REASON, make_vllm_config, tiny_model_dir  # noqa: F401 (fixtures)

vllm = pytest.importorskip("vllm", reason=SKIP_REASON)
if getattr(vllm, "__file__", None) is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)

import msgspec  # noqa: E402
import torch  # noqa: E402
import zmq  # noqa: E402
from prometheus_client import REGISTRY  # noqa: E402
from vllm.config.kv_events import KVEventsConfig  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorLogging, ECConnectorProm  # noqa: E402
from vllm.distributed.kv_events import BlockStored, KVEventBatch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.forward_context import get_forward_context, set_forward_context  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.engine import EngineCoreOutputs  # noqa: E402
from vllm.v1.metrics.loggers import LoggingStatLogger, PrometheusStatLogger  # noqa: E402
from vllm.v1.outputs import ECConnectorOutput, KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from ecd.integrations.vllm.metadata import EcdECConnectorMetadata, EcdLoad  # noqa: E402
from ecd.integrations.vllm.telemetry.handshake import EcdHandshakeMetadata  # noqa: E402
from ecd.integrations.vllm.telemetry.stats import EcdKVConnectorStats  # noqa: E402
from test_ec_connector import SCHEDULER, WORKER, encoder_output, make_connector  # noqa: E402
from test_kv_connector import BS, NUM_BLOCKS, Engine, make_request, tokens  # noqa: E402


@pytest.fixture
def engines(tiny_model_dir, daemon):
    made: list[Engine] = []

    def make(**kwargs) -> Engine:
        made.append(Engine(tiny_model_dir, daemon.endpoint, **kwargs))
        return made[-1]
    yield make
    for e in made:
        e.scheduler.shutdown()
        e.worker.shutdown()


class Served:
    """vLLM's real Scheduler (log_stats on) over an Engine's worker connector and paged cache."""

    def __init__(self, engine: Engine, events_endpoint: str | None = None) -> None:
        cfg = engine.config
        cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
        cfg.model_config.multimodal_config.language_model_only = True
        cfg.model_config.multimodal_config.enable_mm_embeds = False
        if events_endpoint is not None:
            cfg.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                  endpoint=events_endpoint, topic="kv")
            # the worker reads the config when it is made: make it again, as vLLM would
            engine.worker.shutdown()
            engine.worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, engine.kv_cache_config)
            engine.worker.register_kv_caches(engine.caches)
        self.engine = engine
        self.scheduler = Scheduler(cfg, engine.kv_cache_config, StructuredOutputManager(cfg), block_size=BS,
                                   log_stats=True)
        self.requests: dict = {}
        self.block_table: dict[str, list[int]] = {}

    def add(self, request) -> None:
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)

    def worker_step(self, out) -> KVConnectorOutput:
        """The worker's part, in KVConnectorModelRunnerMixin's order."""
        worker = self.engine.worker
        meta = pickle.loads(pickle.dumps(out.kv_connector_metadata))  # it crosses a process in vLLM
        worker.bind_connector_metadata(meta)
        with set_forward_context(None, self.engine.config):
            worker.start_load_kv(get_forward_context())
        for req_id, n in out.num_scheduled_tokens.items():
            start = self.starts[req_id]
            self.engine.forward(self.requests[req_id], self.block_table[req_id], start, start + n)
        worker.wait_for_save()
        output = KVConnectorOutput(invalid_block_ids=worker.get_block_ids_with_load_errors())
        output.kv_connector_stats = worker.get_kv_connector_stats()
        output.kv_cache_events = worker.get_kv_connector_kv_cache_events()
        worker.clear_connector_metadata()
        return output

    def step(self) -> EngineCoreOutputs | None:
        out = self.scheduler.schedule()
        self.starts = {}
        for new in out.scheduled_new_reqs:
            self.block_table[new.req_id] = list(new.block_ids[0])
            self.starts[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if cached.new_block_ids[i]:
                self.block_table[req_id].extend(cached.new_block_ids[i][0])
            self.starts[req_id] = cached.num_computed_tokens[i]
        connector_output = self.worker_step(out)
        # one worker: vLLM's executor still merges the worker outputs (KVOutputAggregator)
        ids = list(out.num_scheduled_tokens)
        sampled = [[42] if self.starts[r] + n == self.requests[r].num_tokens else []
                   for r, n in out.num_scheduled_tokens.items()]
        runner_output = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                          sampled_token_ids=sampled, kv_connector_output=connector_output)
        runner_output = KVOutputAggregator(expected_finished_count=1).aggregate([runner_output])
        outputs = self.scheduler.update_from_output(out, runner_output)
        return next(iter(outputs.values()), None)


def scheduler_stats_of(outputs: EngineCoreOutputs | None):
    """The step's SchedulerStats as the front-end receives them (vLLM's msgpack, both ways)."""
    assert outputs is not None and outputs.scheduler_stats is not None
    wire = MsgpackEncoder().encode(outputs)
    return MsgpackDecoder(EngineCoreOutputs).decode(wire).scheduler_stats


def sample(name: str, **labels) -> float:
    value = REGISTRY.get_sample_value(name, labels)
    return 0.0 if value is None else value


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_kv_stats_reach_vllms_log_line_and_prometheus_counters(engines, daemon):
    producer = engines(descending=True)
    prompt = tokens(31, 5 * BS + 4)
    producer.prefill(make_request("p", prompt))
    saved = producer.worker.get_kv_connector_stats()  # what the producer's worker counted
    entry = producer.worker.connector_worker.paged.entry_nbytes
    assert isinstance(saved, EcdKVConnectorStats)
    assert saved.data["save_blocks"] == 5 and saved.data["save_bytes"] == 5 * entry
    assert saved.data["save_seconds"] > 0 and saved.data["save_steps"] == 1
    assert producer.worker.get_kv_connector_stats() is None  # taken: nothing new since

    served = Served(engines())
    served.add(make_request("d", prompt, max_tokens=1))
    stats = scheduler_stats_of(served.step())
    data = stats.kv_connector_stats  # the worker's and the scheduler's, summed by vLLM's scheduler
    assert data["hit_tokens"] == 5 * BS and data["lookup_tokens"] == 5 * BS + 4
    assert data["lookup_requests"] == data["hit_requests"] == 1
    assert data["load_blocks"] == 5 and data["load_bytes"] == 5 * entry and data.get("load_failed_blocks", 0) == 0
    assert data["load_seconds"] > 0 and data["load_steps"] == 1

    # vLLM's logging stat logger: "KV Transfer metrics: ..." with ecd's numbers
    config = served.engine.config
    log = LoggingStatLogger(config, engine_index=0)
    captured = Captured()
    log.record(stats, None)
    log.kv_connector_logging.log(log_fn=lambda fmt, *args: captured.lines.append(fmt % args))
    (line,) = captured.lines
    assert line.startswith("KV Transfer metrics: ") and f"ecd_hit_tokens={5 * BS}" in line
    assert "ecd_loaded_blocks=5" in line and "ecd_token_hit_rate=" in line and "ecd_load_ms_per_step=" in line

    # vLLM's Prometheus stat logger: ecd's counters, labelled by model and engine
    prom = PrometheusStatLogger(config, engine_indexes=[0])
    prom.record(stats, None, engine_idx=0)
    labels = {"model_name": config.model_config.served_model_name, "engine": "0"}
    assert sample("vllm:ecd_kv_hit_tokens_total", **labels) == 5 * BS
    assert sample("vllm:ecd_kv_loaded_blocks_total", **labels) == 5
    assert sample("vllm:ecd_kv_loaded_bytes_total", **labels) == 5 * entry
    assert sample("vllm:ecd_kv_load_seconds_total", **labels) > 0
    # and what ecd counts next to vLLM's own counter of connector hits
    assert sample("vllm:external_prefix_cache_hits_total", **labels) in (0.0, 5 * BS)


def test_load_errors_are_counted_as_failed_not_loaded(engines, daemon):
    producer, consumer = engines(), engines(descending=True)
    prompt = tokens(32, 4 * BS + 1)
    producer.prefill(make_request("p", prompt))
    ns = producer.scheduler.namespace
    orig = consumer.scheduler.get_num_new_matched_tokens

    def lookup_then_remove(request, num_computed):  # two pinned blocks removed before the load
        result = orig(request, num_computed)
        with daemon.client(namespace=ns) as c:
            hexes = [h.hex() for h in request.block_hashes]
            assert c.evict([hexes[1]], force=True)["evicted"] == 1
            assert c.delete(hexes[3]) is True
        return result

    consumer.scheduler.get_num_new_matched_tokens = lookup_then_remove
    step = consumer.prefill(make_request("c", prompt))
    assert step.matched == 4 * BS and len(step.errors) == 2
    data = consumer.worker.get_kv_connector_stats().data
    entry = consumer.worker.connector_worker.paged.entry_nbytes
    assert data["load_failed_blocks"] == 2 and data["load_blocks"] == 2 and data["load_bytes"] == 2 * entry
    # the consumer computed and saved nothing new here: its prompt's blocks were planned as loads
    assert consumer.scheduler.get_kv_connector_stats().data["hit_tokens"] == 4 * BS


def per_block(events: list[BlockStored]) -> dict:
    """hash -> (parent hash, tokens, block size) of each block (one BlockStored may carry a run)."""
    blocks = {}
    for e in events:
        parent = e.parent_block_hash
        for i, h in enumerate(e.block_hashes):
            blocks[h] = (parent, list(e.token_ids[i * e.block_size:(i + 1) * e.block_size]), e.block_size)
            parent = h
    return blocks


def test_stored_blocks_appear_in_vllms_own_event_stream(engines, daemon, tmp_path):
    endpoint = f"ipc://{tmp_path}/engine-events"  # vLLM binds ipc:// (it connects to tcp://HOST)
    served = Served(engines(), events_endpoint=endpoint)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    try:
        time.sleep(0.5)  # PUB/SUB: the subscription reaches vLLM's publisher
        prompt = tokens(33, 3 * BS + 4)
        served.add(make_request("s", prompt, max_tokens=1))
        served.step()
        events = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(getattr(e, "medium", None) == "CPU" for e in events):
            if sub.poll(100):
                _topic, _seq, payload = sub.recv_multipart()
                events.extend(decoder.decode(payload).events)
    finally:
        sub.close(0)
        ctx.term()
        served.scheduler.shutdown()
    stored = [e for e in events if isinstance(e, BlockStored)]
    ours = per_block([e for e in stored if e.medium == "CPU"])
    theirs = per_block([e for e in stored if e.medium == "GPU"])  # vLLM's block pool
    assert len(ours) == 3, stored
    for block_hash, block in ours.items():  # the very blocks vLLM's block pool reported
        assert theirs.get(block_hash) == block
        assert len(block[1]) == BS == block[2]


def test_no_events_kept_without_kv_events_config(engines, daemon):
    producer = engines()
    producer.prefill(make_request("p", tokens(34, 2 * BS)))
    assert producer.worker.get_kv_connector_kv_cache_events() is None  # nothing collected
    assert list(producer.scheduler.take_events()) == []


def test_handshake_reports_the_workers_daemon_and_the_scheduler_checks_it(engines, daemon, daemon_factory):
    engine = engines()
    meta = engine.worker.get_handshake_metadata()
    assert isinstance(meta, EcdHandshakeMetadata) and meta.node == daemon.node
    assert meta.endpoint == daemon.endpoint and meta.namespace == engine.worker.namespace
    assert engine.scheduler.get_handshake_metadata() is None  # only workers have any
    meta = pickle.loads(pickle.dumps(meta))  # vLLM's executor returns it from the worker process
    captured = Captured()
    logger = logging.getLogger("vllm.ecd.kv_connector")
    logger.addHandler(captured)
    level = logger.level
    logger.setLevel(logging.INFO)  # vLLM sets it so in an engine; a bare test process is at WARNING
    try:
        # as vLLM's EngineCore hands it over: {(pp_rank, tp_rank): metadata}, through the base class
        engine.scheduler.set_xfer_handshake_metadata_pp_aware({(0, 0): meta})
        assert engine.scheduler.worker_daemons.consistent is True
        assert any("use the scheduler's daemon" in line for line in captured.lines)

        other = daemon_factory()  # a worker that reached another node's daemon
        stray = Engine(engine.config.model_config.model, other.endpoint)
        try:
            stray_meta = stray.worker.get_handshake_metadata()
        finally:
            stray.scheduler.shutdown()
            stray.worker.shutdown()
        assert stray_meta.node == other.node != daemon.node
        engine.scheduler.set_xfer_handshake_metadata_pp_aware({(0, 0): meta, (0, 1): stray_meta})
        assert engine.scheduler.worker_daemons.consistent is False
        assert engine.scheduler.worker_daemons.mismatched == [1]
        assert any("reached another ecd daemon" in line and other.node in line for line in captured.lines)
    finally:
        logger.removeHandler(captured)
        logger.setLevel(level)


def to_scheduler(scheduler, worker) -> None:
    """A worker's step report to its scheduler, as vLLM's model runner (V1 and V2) and
    scheduler carry it: ECConnectorOutput.ec_connector_worker_meta, pickled across processes."""
    report = pickle.loads(pickle.dumps(worker.build_connector_worker_meta()))
    scheduler.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=report))


def test_ec_stats_reach_vllms_ec_logging_and_prometheus(daemon, tiny_model_dir):
    encoder_s = make_connector(tiny_model_dir, "ec_producer", SCHEDULER, endpoint=daemon.endpoint)
    encoder_w = make_connector(tiny_model_dir, "ec_producer", WORKER, endpoint=daemon.endpoint)
    consumer_s = make_connector(tiny_model_dir, "ec_consumer", SCHEDULER, endpoint=daemon.endpoint)
    consumer_w = make_connector(tiny_model_dir, "ec_consumer", WORKER, endpoint=daemon.endpoint)
    try:
        tensor = encoder_output(16, 256, seed=5)
        nbytes = tensor.numel() * tensor.element_size()
        encoder_w.save_caches({"mm-a": tensor}, "mm-a")
        encoder_w.save_caches({}, "mm-missing")  # nothing to save, nothing counted
        assert encoder_w.get_ec_connector_stats() is None  # a worker's counts go in its step report
        to_scheduler(encoder_s, encoder_w)
        saved = encoder_s.get_ec_connector_stats()
        assert saved.data["save_items"] == 1 and saved.data["save_bytes"] == nbytes and saved.data["save_seconds"] > 0
        assert encoder_s.get_ec_connector_stats() is None  # taken

        assert consumer_s.has_cache_item("mm-a") and not consumer_s.has_cache_item("mm-b")
        cache: dict[str, torch.Tensor] = {}
        consumer_w.bind_connector_metadata(EcdECConnectorMetadata(loads=[
            EcdLoad(mm_hash="mm-a", num_embeds=16, req_id="r", input_id=0, recompute_ok=False)]))
        consumer_w.start_load_caches(cache)
        consumer_w.clear_connector_metadata()
        to_scheduler(consumer_s, consumer_w)
        total = consumer_s.get_ec_connector_stats()  # its lookups and its worker's loads
        assert total.data["lookups"] == 2 and total.data["hits"] == 1
        assert total.data["load_items"] == 1 and total.data["load_bytes"] == nbytes
        assert total.data.get("load_failed_items", 0) == 0 and total.data["load_seconds"] > 0

        # vLLM's EC stat logging and Prometheus, as its stat loggers call them with SchedulerStats
        config = consumer_s._vllm_config
        logging_ = ECConnectorLogging(config.ec_transfer_config)
        logging_.observe(total.data)
        lines: list[str] = []
        logging_.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
        assert len(lines) == 1 and lines[0].startswith("EC Transfer metrics: ")
        assert "ecd_hits=1" in lines[0] and "ecd_loaded_items=1" in lines[0]
        prom = ECConnectorProm(config, ["model_name", "engine"], {0: ["m", "0"]})
        prom.observe(total.data, 0)
        assert sample("vllm:ecd_ec_hits_total", model_name="m", engine="0") == 1
        assert sample("vllm:ecd_ec_loaded_bytes_total", model_name="m", engine="0") == nbytes
    finally:
        for c in (encoder_s, encoder_w, consumer_s, consumer_w):
            c.shutdown()
        from vllm.v1.metrics.prometheus import unregister_vllm_metrics
        unregister_vllm_metrics()


def test_a_block_is_reported_once_when_every_rank_stored_it(engines, tmp_path):
    """Tensor parallelism: each rank stores its part of a block. Two workers' event containers,
    merged by vLLM's own KVOutputAggregator as its executor does, reach a scheduler-side
    ConnectorEvents of a 2-rank engine: a block both ranks stored is reported once, a block only
    one rank stored (the other's put failed) is not reported at all."""
    from ecd.integrations.vllm.telemetry.kv_events import ConnectorEvents
    ranks = []
    for rank in range(2):
        engine = engines(namespace=f"tp-rank-{rank}")  # each rank's part under its own keys
        engine.config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        engine.worker.shutdown()
        engine.worker = KVConnectorFactory.create_connector(engine.config, KVConnectorRole.WORKER,
                                                            engine.kv_cache_config)
        engine.worker.register_kv_caches(engine.caches)
        ranks.append(engine)
    both = tokens(35, 2 * BS)
    for rank, engine in enumerate(ranks):  # both ranks store `both`'s blocks; rank 0 also another block
        engine.prefill(make_request(f"both-{rank}", both))
        if rank == 0:
            engine.prefill(make_request("only-0", tokens(36, BS)))
    outputs = []
    for engine in ranks:
        events = engine.worker.get_kv_connector_kv_cache_events()
        outputs.append(ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=KVConnectorOutput(
            kv_cache_events=pickle.loads(pickle.dumps(events)))))  # each from its worker process
    assert len(outputs[0].kv_connector_output.kv_cache_events.get_all_events()) == 3
    merged = KVOutputAggregator(expected_finished_count=2).aggregate(outputs)
    scheduler_side = ConnectorEvents(enabled=True, world=2)
    scheduler_side.received(merged.kv_connector_output)
    reported = list(scheduler_side.take_events())
    assert sorted(len(e.token_ids) for e in reported) == [BS, BS]
    assert {h for e in reported for h in e.block_hashes} == \
        {h for e in outputs[1].kv_connector_output.kv_cache_events.get_all_events() for h in e.block_hashes}
    assert list(scheduler_side.take_events()) == []  # taken
