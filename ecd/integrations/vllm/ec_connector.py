"""EcdECConnector: vLLM's encoder-cache (EC) connector on ecd.

Encoder engines (ec_producer) publish each encoder output under its `mm_hash` (the feature's
`identifier`, LoRA prefix included) into the node's ecd pool; prefill engines (ec_consumer)
find, pin and load them instead of running the vision tower. ec_both does both.

Data path (one engine step of a consumer):

  scheduler process                                   worker process
  ensure_cache_available(req)  items the engine
      cannot encode itself: present? (pins hits)
  has_cache_item(h)            exists(h, pin_s): one round trip at most (ring answers
                               misses with none); a hit is pinned so LRU eviction cannot
                               take it before the worker reads it
  update_state_after_alloc     (h, num_embeds, req, index) queued
  build_connector_meta ------- EcdECConnectorMetadata ---->  start_load_caches: ONE get_many
                                                             for every item of the step
  update_connector_output <--- EcdECWorkerMetadata <-------  build_connector_worker_meta
  take_unavailable_requests    requests that cannot get an embedding (failed, retryable)
  request_finished             unpin

How a load failure reaches the scheduler, and why it is not only reported: vLLM 0.33's channel
back is `build_connector_worker_meta` -> ECConnectorOutput -> `update_connector_output`, and the
scheduler fails the requests `take_unavailable_requests` names with a retryable error. But that
report arrives after the step, while the model runner (V1 and V2 alike) raises "Encoder cache
miss" within the step if an item scheduled for an external load is not in `encoder_cache` after
`start_load_caches`: vLLM has no way to withdraw a scheduled load. So a worker whose load failed
(entry deleted despite the pin, daemon restarted or down) has the item recomputed in the same
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
are therefore checked before they are scheduled: ensure_cache_available pins what they need, or
defers them while it is missing, up to load_timeout_s, then fails them (retryable).

Across nodes (`"fetch_from_peers": true`, off by default): an item encoded on another node. A
lookup that misses asks the local daemon once to pull the missing items from its configured
peers (`fetch`: the daemon asks them in parallel, first holder wins, within fetch_timeout_s),
then pins what arrived: one peer round trip at most per lookup, and the worker's load then reads
the bytes from the local pool as usual. An item a fetch did not find is not asked for again for
FETCH_RETRY_S (a request deferred for its embedding checks every step).

Every daemon failure inside a connector method is caught, logged (rate-limited) and turned into
a miss: the connector never raises into the engine. The Client is created on first use,
dropped after DaemonUnavailable and re-created after a short back-off (lazy_client.py, shared
with the KV connector).
"""
from __future__ import annotations

import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (ECConnectorBase, ECConnectorMetadata,
                                                            ECConnectorRole, ECConnectorWorkerMetadata)

from .lazy_client import LOG_INTERVAL_S, LazyClient
from .ratelimit import RateLimitedLog, connector_logger
from .settings import ConnectorSettings, default_namespace, parse_settings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

logger = connector_logger("ec_connector")  # "vllm.ecd.ec_connector": shown in the engine's log


# ---- metadata -------------------------------------------------------------------------------

@dataclass
class EcdLoad:
    """One encoder output the worker loads this step."""

    mm_hash: str
    num_embeds: int  # rows the engine expects (the placeholder's embeddings)
    req_id: str  # the request it was allocated for, and its feature index
    input_id: int
    recompute_ok: bool  # the request carries its media: the worker may encode it itself


@dataclass
class EcdECConnectorMetadata(ECConnectorMetadata):
    """Scheduler -> worker, one per step (picklable; travels inside SchedulerOutput)."""

    loads: list[EcdLoad] = field(default_factory=list)
    # This step's SchedulerOutput.scheduled_encoder_inputs, the same object (see module doc):
    # where a failed load is handed back to the model runner to encode.
    scheduled_encoder_inputs: dict[str, list[int]] | None = None


@dataclass
class EcdECWorkerMetadata(ECConnectorWorkerMetadata):
    """Worker -> scheduler, one per step with loads; aggregated over ranks."""

    loaded: list[str] = field(default_factory=list)
    recomputed: list[str] = field(default_factory=list)  # load failed; encoded in-step instead
    failed: list[tuple[str, str]] = field(default_factory=list)  # (req_id, mm_hash): neither

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        if isinstance(other, EcdECWorkerMetadata):
            self.loaded.extend(other.loaded)
            self.recomputed.extend(other.recomputed)
            self.failed.extend(other.failed)
        return self


# ---- helpers --------------------------------------------------------------------------------

def _engine_device() -> torch.device:
    """The device vLLM's encoder cache lives on for this worker."""
    try:
        from vllm.platforms import current_platform
        device_type = current_platform.device_type or "cpu"
        if device_type != "cpu" and hasattr(torch, "accelerator") and torch.accelerator.is_available():
            return torch.device(device_type, torch.accelerator.current_device_index())
        return torch.device(device_type)
    except Exception:  # pragma: no cover - a platform vLLM cannot describe
        return torch.device("cpu")


FETCH_RETRY_S = 1.0  # an item a fetch from peers did not find is not asked for again before this


# ---- the connector --------------------------------------------------------------------------

class EcdECConnector(ECConnectorBase):
    """vLLM EC connector over the node-local ecd daemon (see the module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        ec_config = vllm_config.ec_transfer_config
        # A bad key or value fails here, at engine start, naming the option and the key.
        self.settings: ConnectorSettings = parse_settings(ec_config.ec_connector_extra_config,
                                                          "ec_connector_extra_config")
        model_config = vllm_config.model_config
        self.namespace = self.settings.namespace or default_namespace("ec", vllm_config, {
            "embed_size": model_config.get_inputs_embeds_size() if model_config else None,
            "embed_dtype": str(getattr(model_config, "dtype", None)),
        })
        self._log = RateLimitedLog(logger, LOG_INTERVAL_S)
        side = "scheduler" if role == ECConnectorRole.SCHEDULER else "worker"
        # The daemon, failures contained: _client.call(op, fn) is fn(client), or None (logged,
        # rate-limited) when the daemon fails in any way or is being backed off from.
        self._client = LazyClient(self.settings, self.namespace, f"vllm-ec-{ec_config.ec_role}-{side}-{os.getpid()}",
                                  self._log)

        # scheduler side (consumer)
        self._step_hits: set[str] = set()  # present and pinned, answered this step
        self._pending: dict[str, EcdLoad] = {}  # loads queued this step, by mm_hash
        self._allocated_now: set[str] = set()  # allocated in the engine's encoder cache this step
        self._local: set[str] = set()  # in the engine's encoder cache (allocated, not yet freed)
        self._req_pins: dict[str, set[str]] = {}  # req_id -> mm_hashes pinned for it
        self._pin_refs: Counter[str] = Counter()  # mm_hash -> requests holding its pin
        self._waiting_since: dict[tuple[str, str], float] = {}  # (req_id, mm_hash) -> first miss
        self._unavailable: set[str] = set()  # req_ids for take_unavailable_requests
        self._resolver = None  # vLLM's PlaceholderMetadataResolver, made on first need
        self._fetch_missed: dict[str, float] = {}  # mm_hash -> when a fetch last failed to find it

        # worker side
        self._device: torch.device | None = None
        parallel = vllm_config.parallel_config
        self._single_rank = (parallel.tensor_parallel_size == 1
                             and getattr(parallel, "prefill_context_parallel_size", 1) == 1)
        self._worker_meta = EcdECWorkerMetadata()
        logger.info("EcdECConnector (%s, %s side): endpoint %s, namespace %s", ec_config.ec_role, side,
                    self.settings.endpoint, self.namespace)

    def shutdown(self) -> None:
        # Closing ends the daemon session, which releases every pin it still holds.
        self._client.close()

    # ---- worker side: producer ------------------------------------------------------------

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs) -> None:
        """Publish encoder_cache[mm_hash]. The put copies into the pool before it returns, so the
        engine may reuse or free its tensor at once; the engine waits for that copy and one round
        trip, nothing else. A GPU tensor is copied on the engine's current stream into the
        daemon's arena on that GPU (`[pool.cuda]`), or by DMA into the host pool when the node has
        none; the put returns once that copy is complete."""
        if not self.is_producer:
            return
        tensor = encoder_cache.get(mm_hash)
        if tensor is None:
            return
        tensor = tensor.detach()
        self._client.call("save", lambda c: c.put(mm_hash, tensor))

    # ---- worker side: consumer ------------------------------------------------------------

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs) -> None:
        """Fill encoder_cache[mm_hash] for this step's loads with ONE get_many round trip."""
        meta = self._connector_metadata
        if not isinstance(meta, EcdECConnectorMetadata) or not meta.loads:
            return
        todo = [load for load in meta.loads if load.mm_hash not in encoder_cache]
        if not todo:
            return
        if self._device is None:
            self._device = _engine_device()
        # straight to the engine's device: peer-to-peer or device-to-device from an arena, DMA
        # from the host pool; complete when get_many returns
        tensors = self._client.call("load", lambda c: c.get_many([load.mm_hash for load in todo],
                                                             missing_ok=True, device=self._device))
        if tensors is None:
            tensors = [None] * len(todo)
        for load, tensor in zip(todo, tensors):
            if tensor is not None and (tensor.dim() == 0 or tensor.shape[0] != load.num_embeds):
                self._log.log(logging.WARNING, "load:shape",
                              "ecd entry %s has shape %s, the engine expects %d embeddings: ignored",
                              load.mm_hash, tuple(tensor.shape), load.num_embeds)
                tensor = None
            if tensor is not None:
                encoder_cache[load.mm_hash] = tensor
                self._worker_meta.loaded.append(load.mm_hash)
            elif self._recompute_in_step(load, meta):
                self._worker_meta.recomputed.append(load.mm_hash)
            else:
                self._worker_meta.failed.append((load.req_id, load.mm_hash))
                self._log.log(logging.ERROR, "load:failed",
                              "ecd entry %s for request %s could not be loaded and this engine "
                              "cannot encode it (no media, or tensor parallel > 1): the request "
                              "is failed (retryable)", load.mm_hash, load.req_id)

    def _recompute_in_step(self, load: EcdLoad, meta: EcdECConnectorMetadata) -> bool:
        """Hand a failed load back to the model runner to encode in this step (module doc)."""
        inputs = meta.scheduled_encoder_inputs
        if not (load.recompute_ok and self._single_rank and inputs is not None):
            return False
        ids = inputs.setdefault(load.req_id, [])
        if load.input_id not in ids:
            ids.append(load.input_id)
        self._log.log(logging.WARNING, "load:recompute",
                      "ecd entry %s missing at load (deleted, or the daemon restarted): "
                      "encoding it locally in this step", load.mm_hash)
        return True

    def build_connector_worker_meta(self) -> ECConnectorWorkerMetadata | None:
        meta = self._worker_meta
        if not (meta.loaded or meta.recomputed or meta.failed):
            return None
        self._worker_meta = EcdECWorkerMetadata()
        return meta

    # ---- scheduler side -------------------------------------------------------------------

    def _present(self, keys: list[str]) -> list[bool]:
        """Which keys ecd holds, pinning the hits for pin_seconds: one round trip at most
        (absent keys are answered from the event ring). Any failure: all absent."""
        found = self._client.call("lookup", lambda c: c.exists(keys, pin_s=self.settings.pin_seconds))
        if found is None:
            return [False] * len(keys)
        if self.settings.fetch_from_peers and not all(found):
            found = self._fetch_missing(keys, found)
        self._step_hits.update(k for k, hit in zip(keys, found) if hit)
        return found

    def _fetch_missing(self, keys: list[str], found: list[bool]) -> list[bool]:
        """Pull the missing keys from the daemon's configured peers (one fetch, bounded by
        fetch_timeout_s), then pin those that arrived. Keys a recent fetch did not find are not
        asked again before FETCH_RETRY_S."""
        now = time.monotonic()
        for h in [h for h, t in self._fetch_missed.items() if now - t >= FETCH_RETRY_S]:
            del self._fetch_missed[h]
        ask = [k for k, hit in zip(keys, found) if not hit and k not in self._fetch_missed]
        if not ask:
            return found
        timeout = self.settings.fetch_timeout_s

        def fetch(client) -> list[bool]:
            return client.fetch(ask, timeout=timeout)  # a list of keys: a list of answers

        got = self._client.call("fetch", fetch) or [False] * len(ask)
        arrived = [k for k, ok in zip(ask, got) if ok]
        self._fetch_missed.update((k, now) for k, ok in zip(ask, got) if not ok)
        if not arrived:
            return found
        pinned = self._client.call("lookup", lambda c: c.exists(arrived, pin_s=self.settings.pin_seconds))
        here = {k for k, hit in zip(arrived, pinned or ()) if hit}
        logger.debug("EcdECConnector: %d of %d missing items fetched from peers", len(here), len(ask))
        return [hit or k in here for k, hit in zip(keys, found)]

    def has_cache_item(self, identifier: str) -> bool:
        if not self.is_consumer:
            return False
        if identifier in self._step_hits:
            return True  # present and pinned earlier in this scheduling pass
        return self._present([identifier])[0]

    def _metadata_resolver(self):
        """vLLM's PlaceholderMetadataResolver (which fields only size a placeholder), made on
        first need: it builds the model's multimodal processor."""
        if self._resolver is None:
            from vllm.distributed.ec_transfer.ec_connector.utils import PlaceholderMetadataResolver
            self._resolver = PlaceholderMetadataResolver(self._vllm_config.model_config)
        return self._resolver

    def _has_local_input(self, feature: "MultiModalFeatureSpec") -> bool:
        """Whether the request carries the media itself, so this engine can encode it (the test
        vLLM's ECCPUConnector uses: any non-metadata field with data)."""
        data = feature.data
        if data is None:
            return False
        metadata_fields = self._metadata_resolver().fields_for(feature.modality)
        return any(elem.data is not None for key, elem in data.items() if key not in metadata_fields)

    def ensure_cache_available(self, request: "Request", num_computed_tokens: int) -> bool:
        """False defers the request this step. Only items this engine could not encode itself
        are checked (anything with media is loaded on a hit and encoded on a miss): while one is
        missing the request waits, up to load_timeout_s, then it is failed (retryable)."""
        if not self.is_consumer or not request.mm_features:
            return True
        req_id = request.request_id
        if req_id in self._unavailable:
            return False  # failed at the end of this step (take_unavailable_requests)
        need: list[str] = []
        for feature in request.mm_features:
            pos = feature.mm_position
            h = feature.identifier
            if (pos.offset + pos.length <= num_computed_tokens or h in self._local
                    or h in self._step_hits or h in need or self._has_local_input(feature)):
                continue
            need.append(h)
        if not need:
            return True
        missing = [h for h, hit in zip(need, self._present(need)) if not hit]
        now = time.monotonic()
        for h in need:
            if h not in missing:
                self._waiting_since.pop((req_id, h), None)
        if not missing:
            return True
        waited = max(now - self._waiting_since.setdefault((req_id, h), now) for h in missing)
        if waited >= self.settings.load_timeout_s:
            self._unavailable.add(req_id)
            self._log.log(logging.WARNING, "missing",
                          "request %s: no embedding for %s in ecd after %.1fs and no media to "
                          "encode it here: failing it (retryable)", req_id, missing[0], waited)
        return False

    def update_state_after_alloc(self, request: "Request", index: int) -> None:
        feature = request.mm_features[index]
        h = feature.identifier
        self._allocated_now.add(h)
        self._local.add(h)
        if not self.is_consumer or h not in self._step_hits:
            return  # the engine encodes it itself
        if h not in self._pending:
            self._pending[h] = EcdLoad(h, request.get_num_encoder_embeds(index), request.request_id,
                                       index, self._has_local_input(feature))
        pins = self._req_pins.setdefault(request.request_id, set())
        if h not in pins:
            pins.add(h)
            self._pin_refs[h] += 1

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> ECConnectorMetadata:
        meta = EcdECConnectorMetadata(list(self._pending.values()),
                                      scheduler_output.scheduled_encoder_inputs)
        self._local.difference_update(set(scheduler_output.free_encoder_mm_hashes) - self._allocated_now)
        # Hits that were not scheduled after all (budget, preemption): nothing will load them.
        orphans = [h for h in self._step_hits if not self._pin_refs.get(h)]
        if orphans:
            self._client.call("unpin", lambda c: c.unpin(orphans))
        self._pending = {}
        self._step_hits = set()
        self._allocated_now = set()
        return meta

    def update_connector_output(self, connector_output: "ECConnectorOutput") -> None:
        meta = connector_output.ec_connector_worker_meta
        if not isinstance(meta, EcdECWorkerMetadata):
            return
        for req_id, mm_hash in meta.failed:
            self._unavailable.add(req_id)
            self._local.discard(mm_hash)  # the worker does not hold it

    def take_unavailable_requests(self) -> set[str]:
        failed, self._unavailable = self._unavailable, set()
        return failed

    def request_finished(self, request: "Request") -> tuple[bool, dict[str, Any] | None]:
        """Consumer: release the request's pins. Producer: report, per mm_hash, the placeholder
        metadata vLLM's helper collects (as ECExampleConnector does) so an orchestrator may send
        the consumer a request without the media; an item that did not reach ecd reports none,
        so the media stays on the request."""
        req_id = request.request_id
        for feature in request.mm_features or ():
            self._waiting_since.pop((req_id, feature.identifier), None)
        release = []
        for h in self._req_pins.pop(req_id, ()):
            self._pin_refs[h] -= 1
            if self._pin_refs[h] <= 0:
                del self._pin_refs[h]
                release.append(h)
        if release:
            self._client.call("unpin", lambda c: c.unpin(release))
        if not (self.is_producer and request.mm_features):
            return False, None
        from vllm.distributed.ec_transfer.ec_connector.utils import collect_ec_item_metadata
        try:
            items = collect_ec_item_metadata(request.mm_features, self._metadata_resolver())
        except Exception as exc:  # only an optimisation for the orchestrator: never fail for it
            self._log.log(logging.WARNING, "announce:metadata",
                          "no ec_transfer_params for request %s: %s", req_id, exc)
            return False, None
        published = self._client.call("announce", lambda c: c.exists(list(items))) or [False] * len(items)
        for h, present in zip(list(items), published):
            if not present:
                items[h]["metadata"] = {}
        return False, items
