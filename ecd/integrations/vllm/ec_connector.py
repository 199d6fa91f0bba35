"""EcdECConnector: vLLM's encoder-cache (EC) connector on ecd.

Encoder engines (ec_producer) publish each encoder output under its `mm_hash` (the feature's
`identifier`, LoRA prefix included) into the node's ecd pool; prefill engines (ec_consumer)
find, pin and load them instead of running the vision tower. ec_both does both.

Data path (one engine step of a consumer):

  scheduler process                                   worker process
  ensure_cache_available(req)  items the engine
      cannot encode itself: present?
  has_cache_item(h)            exists(h) answered from the client's event ring and
                               location cache: no round trip for a key the ring names
                               (present or absent), one only for a key it cannot vouch for
  update_state_after_alloc     (h, num_embeds, req, index) queued; its pin taken
  build_connector_meta ------- EcdECConnectorMetadata ---->  start_load_caches: ONE get_many
      the step's pins: ONE message, not waited for           for every item of the step
      (LRU eviction cannot take them before the worker reads them)
  update_connector_output <--- EcdECWorkerMetadata <-------  build_connector_worker_meta
  take_unavailable_requests    requests that cannot get an embedding (failed, retryable)
  request_finished             unpin: sent with the next step's pins, or 50 ms later if
                               no step comes (lazy_client.StepPins), not waited for

So the scheduler, whose time is every request's time to first token, waits on the daemon only
for a key the ring cannot answer. The price is a window: an item evicted between the lookup and
its pin (the rest of that scheduling pass) is a miss at load, handled as below.

How a load failure reaches the scheduler, and why it is not only reported: vLLM 0.33's channel
back is `build_connector_worker_meta` -> ECConnectorOutput -> `update_connector_output`, and the
scheduler fails the requests `take_unavailable_requests` names with a retryable error. But that
report arrives after the step, while the model runner (V1 and V2 alike) raises "Encoder cache
miss" within the step if an item scheduled for an external load is not in `encoder_cache` after
`start_load_caches`: vLLM has no way to withdraw a scheduled load. So a worker whose load failed
(entry deleted despite the pin, evicted before its pin landed, daemon restarted or down) has the item recomputed in the same
step: the metadata carries a reference to this step's `SchedulerOutput.scheduled_encoder_inputs`
(still the same dict object in the worker: the executor pickles the SchedulerOutput as one
object, or passes it in-process), and adding (req_id, input_id) to it makes the model runner,
which reads that dict right after `start_load_caches`, run the encoder on the request's own
media. The scheduler's books stay right: it allocated the item, and the worker now holds it. This
needs the media on this engine (vLLM's EPD proxy sends the original request to prefill) and one
tensor-parallel rank (the vision tower is a collective; ranks must not decide differently). A
failure that cannot be recomputed is reported (`failed`) and the scheduler defers, then fails,
the request (retryable); in vLLM 0.33 the model runner has raised for that step already, so this
is the one case the connector cannot save. Requests without media (metadata-only EPD requests)
are therefore checked before they are scheduled: ensure_cache_available finds (and the step pins)
what they need, or defers them while it is missing, up to load_timeout_s, then fails them (retryable).

Across nodes (`"fetch_from_peers": true`, off by default): an item encoded on another node. A
lookup that misses asks the local daemon once to pull the missing items from its configured
peers (`fetch`: the daemon asks them in parallel, first holder wins, within fetch_timeout_s),
then looks up what arrived: one peer round trip at most per lookup, and the worker's load then reads
the bytes from the local pool as usual. An item a fetch did not find is not asked for again for
FETCH_RETRY_S (a request deferred for its embedding checks every step).

Where the code is: vLLM makes one connector per role, in different processes; this class is a
thin facade that makes the side its role needs and hands vLLM's calls to it (as vLLM's
NixlConnector does): ec_scheduler.py (the left column above), ec_worker.py (the right one). They
meet in metadata.py (EcdECConnectorMetadata one way, EcdECWorkerMetadata back). A method of the
other role is answered as "nothing to do" (vLLM never calls one).

Every daemon failure inside a connector method is caught, logged (rate-limited) and turned into
a miss: the connector never raises into the engine. The Client is created on first use,
dropped after DaemonUnavailable and re-created after a short back-off (lazy_client.py, shared
with the KV connector).
"""
from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (ECConnectorBase, ECConnectorMetadata,
                                                            ECConnectorRole, ECConnectorWorkerMetadata)

from .ec_scheduler import EcdECConnectorScheduler
from .ec_worker import EcdECConnectorWorker
from .lazy_client import LOG_INTERVAL_S, LazyClient
from .metadata import EcdECConnectorMetadata, EcdECWorkerMetadata, EcdLoad
from .ratelimit import RateLimitedLog, connector_logger
from .settings import ConnectorSettings, ec_namespace, parse_settings
from .telemetry.hooks import ECConnectorHooks
from .telemetry.recorders import ECTelemetry

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

__all__ = ["EcdECConnector", "EcdECConnectorMetadata", "EcdECWorkerMetadata", "EcdLoad"]

logger = connector_logger("ec_connector")  # "vllm.ecd.ec_connector": shown in the engine's log


class EcdECConnector(ECConnectorHooks, ECConnectorBase):
    """vLLM EC connector over the node-local ecd daemon (see the module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        ec_config = vllm_config.ec_transfer_config
        # A bad key or value fails here, at engine start, naming the option and the key.
        self.settings: ConnectorSettings = parse_settings(ec_config.ec_connector_extra_config,
                                                          "ec_connector_extra_config")
        self.namespace = ec_namespace(self.settings, vllm_config)
        log = RateLimitedLog(logger, LOG_INTERVAL_S)
        side = "scheduler" if role == ECConnectorRole.SCHEDULER else "worker"
        # The daemon, failures contained: client.call(op, fn) is fn(client), or None (logged,
        # rate-limited) when the daemon fails in any way or is being backed off from.
        self.client = LazyClient(self.settings, self.namespace, f"vllm-ec-{ec_config.ec_role}-{side}-{os.getpid()}",
                                 log)
        self.connector_scheduler: EcdECConnectorScheduler | None = None
        self.connector_worker: EcdECConnectorWorker | None = None
        self.telemetry = ECTelemetry()  # statistics (telemetry/: the hooks are ECConnectorHooks')
        if role == ECConnectorRole.SCHEDULER:
            self.connector_scheduler = EcdECConnectorScheduler(vllm_config, self.settings, self.is_producer,
                                                               self.is_consumer, self.client, log)
        else:
            self.connector_worker = EcdECConnectorWorker(vllm_config, self.is_producer, self.client, log)
        logger.info("EcdECConnector (%s, %s side): endpoint %s, namespace %s", ec_config.ec_role, side,
                    self.settings.endpoint, self.namespace)

    def shutdown(self) -> None:
        for part in (self.connector_scheduler, self.connector_worker):
            if part is not None:
                part.shutdown()

    # ---- worker side (ec_worker.py) --------------------------------------------------------

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs) -> None:
        if self.connector_worker is not None:
            started = time.perf_counter()
            if self.connector_worker.save_caches(encoder_cache, mm_hash, self._connector_metadata, **kwargs):
                self.telemetry.saved(encoder_cache, mm_hash, time.perf_counter() - started)

    def start_save_caches(self, encoder_cache: dict[str, torch.Tensor] | None = None, **kwargs) -> None:
        if self.connector_worker is not None and encoder_cache is not None:
            self.connector_worker.start_save_caches(self._connector_metadata, encoder_cache)

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs) -> None:
        if self.connector_worker is not None:
            started = self.telemetry.loading(self._connector_metadata, encoder_cache)
            self.connector_worker.start_load_caches(self._connector_metadata, encoder_cache)
            self.telemetry.loaded(started, encoder_cache)

    def build_connector_worker_meta(self) -> ECConnectorWorkerMetadata | None:
        if self.connector_worker is None:
            return None
        return self.telemetry.report(self.connector_worker.build_connector_worker_meta())

    # ---- scheduler side (ec_scheduler.py) --------------------------------------------------

    def has_cache_item(self, identifier: str) -> bool:
        if self.connector_scheduler is None:
            return False
        found = self.connector_scheduler.has_cache_item(identifier)
        self.telemetry.looked_up(found)
        return found

    def ensure_cache_available(self, request: "Request", num_computed_tokens: int) -> bool:
        if self.connector_scheduler is None:
            return True
        return self.connector_scheduler.ensure_cache_available(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", index: int) -> None:
        if self.connector_scheduler is not None:
            self.connector_scheduler.update_state_after_alloc(request, index)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> ECConnectorMetadata:
        if self.connector_scheduler is None:
            return EcdECConnectorMetadata()
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: "ECConnectorOutput") -> None:
        if self.connector_scheduler is not None:
            self.connector_scheduler.update_connector_output(connector_output)
            self.telemetry.received(connector_output)

    def take_unavailable_requests(self) -> set[str]:
        if self.connector_scheduler is None:
            return set()
        return self.connector_scheduler.take_unavailable_requests()

    def request_finished(self, request: "Request") -> tuple[bool, dict[str, Any] | None]:
        if self.connector_scheduler is None:
            return False, None
        return self.connector_scheduler.request_finished(request)
