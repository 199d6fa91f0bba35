"""The scheduler side of EcdECConnector (ec_connector.py): which encoder outputs ecd holds
(pinned until the request finishes), which of them the worker loads this step, which requests
wait for (or cannot get) an embedding, and, for a producer, the placeholder metadata it
announces. The data path and the reasons behind it: ec_connector.py's docstring."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from .lazy_client import LazyClient, StepPins
from .metadata import EcdECConnectorMetadata, EcdECWorkerMetadata, EcdLoad, salted_key
from .ratelimit import RateLimitedLog, connector_logger
from .settings import ConnectorSettings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

logger = connector_logger("ec_connector")  # the connector's logger, shared by its two sides

FETCH_RETRY_S = 1.0  # an item a fetch from peers did not find is not asked for again before this


class EcdECConnectorScheduler:
    """The scheduler-side methods of EcdECConnector (see the module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", settings: ConnectorSettings, is_producer: bool,
                 is_consumer: bool, client: LazyClient, log: RateLimitedLog) -> None:
        self.settings = settings
        self.client = client
        self._log = log
        self._model_config = vllm_config.model_config
        self._is_producer = is_producer
        self._is_consumer = is_consumer
        self._step_hits: set[str] = set()  # ecd keys present (the event ring said so), answered this step
        self._pending: dict[str, EcdLoad] = {}  # loads queued this step, by ecd key
        # The cache_salt of the request ensure_cache_available last looked at: vLLM's Scheduler asks
        # has_cache_item (no request given) right after it, about that request's items.
        self._salt: str | None = None
        # producer: each live request's items' (mm_hash, ecd key), by req_id; the keys asked to be
        # saved, by mm_hash (while the engine holds it); this step's requests
        self._keys_of: dict[str, list[tuple[str, str]]] = {}
        self._saved: dict[str, set[str]] = {}
        self._seen_now: set[str] = set()
        self._allocated_now: set[str] = set()  # allocated in the engine's encoder cache this step
        self._local: set[str] = set()  # in the engine's encoder cache (allocated, not yet freed)
        self._pins = StepPins(client, settings.pin_seconds)  # req_id -> the mm_hashes it loads
        self._waiting_since: dict[tuple[str, str], float] = {}  # (req_id, mm_hash) -> first miss
        self._unavailable: set[str] = set()  # req_ids for take_unavailable_requests
        self._resolver = None  # vLLM's PlaceholderMetadataResolver, made on first need
        self._fetch_missed: dict[str, float] = {}  # mm_hash -> when a fetch last failed to find it

    # ---- lookups ----

    def _present(self, keys: list[str]) -> list[bool]:
        """Which keys ecd holds: answered from the client's event ring and location cache, a
        round trip only for a key they cannot vouch for. Nothing is pinned here: the hits that
        are scheduled are pinned once per step (build_connector_meta). Any failure: all absent."""
        found = self.client.call("lookup", lambda c: c.exists(keys))
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

        got = self.client.call("fetch", fetch) or [False] * len(ask)
        arrived = [k for k, ok in zip(ask, got) if ok]
        self._fetch_missed.update((k, now) for k, ok in zip(ask, got) if not ok)
        if not arrived:
            return found
        local = self.client.call("lookup", lambda c: c.exists(arrived))
        here = {k for k, hit in zip(arrived, local or ()) if hit}
        logger.debug("EcdECConnector: %d of %d missing items fetched from peers", len(here), len(ask))
        return [hit or k in here for k, hit in zip(keys, found)]

    def has_cache_item(self, identifier: str) -> bool:
        if not self._is_consumer:
            return False
        key = salted_key(identifier, self._salt)
        if key in self._step_hits:
            return True  # found earlier in this scheduling pass
        return self._present([key])[0]

    def _metadata_resolver(self):
        """vLLM's PlaceholderMetadataResolver (which fields only size a placeholder), made on
        first need: it builds the model's multimodal processor."""
        if self._resolver is None:
            from vllm.distributed.ec_transfer.ec_connector.utils import PlaceholderMetadataResolver
            self._resolver = PlaceholderMetadataResolver(self._model_config)
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
        self._salt = request.cache_salt
        if self._is_producer and request.mm_features:
            self._seen_now.add(request.request_id)
            if request.request_id not in self._keys_of:
                self._keys_of[request.request_id] = [(f.identifier, salted_key(f.identifier, request.cache_salt))
                                                     for f in request.mm_features]
        if not self._is_consumer or not request.mm_features:
            return True
        req_id = request.request_id
        if req_id in self._unavailable:
            return False  # failed at the end of this step (take_unavailable_requests)
        need: list[str] = []
        for feature in request.mm_features:
            pos = feature.mm_position
            h = feature.identifier
            key = salted_key(h, self._salt)
            if (pos.offset + pos.length <= num_computed_tokens or h in self._local
                    or key in self._step_hits or key in need or self._has_local_input(feature)):
                continue
            need.append(key)
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

    # ---- planning a step ----

    def update_state_after_alloc(self, request: "Request", index: int) -> None:
        feature = request.mm_features[index]
        h = feature.identifier
        key = salted_key(h, request.cache_salt)
        self._allocated_now.add(h)
        self._local.add(h)
        if not self._is_consumer or key not in self._step_hits:
            return  # the engine encodes it itself
        if key not in self._pending:
            self._pending[key] = EcdLoad(h, request.get_num_encoder_embeds(index), request.request_id,
                                         index, self._has_local_input(feature), key)
        self._pins.hold(request.request_id, (key,))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> EcdECConnectorMetadata:
        meta = EcdECConnectorMetadata(list(self._pending.values()),
                                      scheduler_output.scheduled_encoder_inputs)
        if self._is_producer:
            self._plan_saves(meta, scheduler_output)
        freed = set(scheduler_output.free_encoder_mm_hashes) - self._allocated_now
        self._local.difference_update(freed)
        for h in freed:
            self._saved.pop(h, None)
        # The step's pins in one message, not waited for: it reaches the daemon before the
        # worker asks for the bytes, and an item evicted in between is a miss the worker handles
        # (recomputed, or the request failed as retryable). Hits that were not scheduled
        # (budget, preemption) are never pinned.
        self._pins.flush()
        self._pending = {}
        self._step_hits = set()
        self._allocated_now = set()
        return meta

    def _plan_saves(self, meta: EcdECConnectorMetadata, scheduler_output: "SchedulerOutput") -> None:
        """Producer: under which keys the worker saves each output. What this step encodes goes
        under the keys of the requests that want it (salted_key: a salted request's never under
        the bare mm_hash); an output the engine's encoder cache already holds, which a request of
        this step wants under a key it was not yet saved under, is saved from that cache
        (start_save_caches), once while the engine holds it."""
        for req_id, indices in (scheduler_output.scheduled_encoder_inputs or {}).items():
            keys = self._keys_of.get(req_id, ())
            for i in indices:
                if i < len(keys):
                    h, key = keys[i]
                    self._saved.setdefault(h, set()).add(key)
                    if key not in meta.save_keys.setdefault(h, []):
                        meta.save_keys[h].append(key)
        for req_id in self._seen_now:
            for h, key in self._keys_of.get(req_id, ()):
                if key in self._saved.get(h, ()):
                    continue
                if h in meta.save_keys:  # encoded this step for another request: saved under this key too
                    meta.save_keys[h].append(key)
                elif h in self._local:
                    meta.copy_keys.setdefault(h, []).append(key)
                else:
                    continue  # not encoded yet: its own scheduling will save it
                self._saved.setdefault(h, set()).add(key)
        self._seen_now = set()

    # ---- after a step, and at the end ----

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
        self._keys_of.pop(req_id, None)
        for feature in request.mm_features or ():
            self._waiting_since.pop((req_id, salted_key(feature.identifier, request.cache_salt)), None)
        self._pins.release(req_id)  # sent with the next step: the engine does not wait for it
        if not (self._is_producer and request.mm_features):
            return False, None
        from vllm.distributed.ec_transfer.ec_connector.utils import collect_ec_item_metadata
        try:
            items = collect_ec_item_metadata(request.mm_features, self._metadata_resolver())
        except Exception as exc:  # only an optimisation for the orchestrator: never fail for it
            self._log.log(logging.WARNING, "announce:metadata",
                          "no ec_transfer_params for request %s: %s", req_id, exc)
            return False, None
        keys = [salted_key(h, request.cache_salt) for h in items]
        published = self.client.call("announce", lambda c: c.exists(keys)) or [False] * len(items)
        for h, present in zip(list(items), published):
            if not present:
                items[h]["metadata"] = {}
        return False, items

    def shutdown(self) -> None:
        # Closing ends the daemon session, which releases every pin it still holds.
        self._pins.close()
        self.client.close()
