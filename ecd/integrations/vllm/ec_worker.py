"""The worker side of EcdECConnector (ec_connector.py): a producer publishes each encoder output
into ecd (`save_caches`); a consumer loads the step's planned items with one `get_many`
(`start_load_caches`) and reports what it loaded, recomputed or could not get
(`build_connector_worker_meta`). Why a failed load is recomputed in the same step, and when it
cannot be: ec_connector.py's docstring."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorWorkerMetadata

from ...protocol import EncoderMeta
from .lazy_client import LazyClient, skipping_corrupt
from .metadata import EcdECConnectorMetadata, EcdECWorkerMetadata, EcdLoad
from .ratelimit import RateLimitedLog

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def engine_device() -> torch.device:
    """The device vLLM's encoder cache lives on for this worker."""
    try:
        from vllm.platforms import current_platform
        device_type = current_platform.device_type or "cpu"
        if device_type != "cpu" and hasattr(torch, "accelerator") and torch.accelerator.is_available():
            return torch.device(device_type, torch.accelerator.current_device_index())
        return torch.device(device_type)
    except Exception:  # pragma: no cover - a platform vLLM cannot describe
        return torch.device("cpu")


class EcdECConnectorWorker:
    """The worker-side methods of EcdECConnector (see the module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", is_producer: bool, client: LazyClient,
                 log: RateLimitedLog) -> None:
        self.client = client
        self._log = log
        self._is_producer = is_producer
        self._device: torch.device | None = None
        parallel = vllm_config.parallel_config
        self._single_rank = (parallel.tensor_parallel_size == 1
                             and getattr(parallel, "prefill_context_parallel_size", 1) == 1)
        self._worker_meta = EcdECWorkerMetadata()

    @property
    def pending_report(self) -> EcdECWorkerMetadata:
        """What this step's loads came to so far: the report `build_connector_worker_meta` hands
        the scheduler next (read it, do not keep it: that call starts a new one)."""
        return self._worker_meta

    # ---- producer ----

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, meta: Any = None,
                    **kwargs: Any) -> bool:
        """Publish encoder_cache[mm_hash]. The put copies into the pool before it returns, so the
        engine may reuse or free its tensor at once; the engine waits for that copy and one round
        trip, nothing else. A GPU tensor is copied on the engine's current stream into the
        daemon's arena on that GPU (`[pool.cuda]`), or by DMA into the host pool when the node has
        none; the put returns once that copy is complete."""
        if not self._is_producer:
            return False
        # under the keys the requests that want it name (the step's metadata: a salted request's
        # salted_key), the bare mm_hash where the scheduler named none
        keys = meta.save_keys.get(mm_hash) if isinstance(meta, EcdECConnectorMetadata) else None
        return self._put(encoder_cache, {mm_hash: keys or [mm_hash]})

    def start_save_caches(self, meta: Any, encoder_cache: dict[str, torch.Tensor]) -> None:
        """Before the step's model run: outputs the engine's encoder cache already holds, saved
        under the keys of requests of another salt that want them now (they are not encoded
        again, so save_caches never fires for them)."""
        if self._is_producer and isinstance(meta, EcdECConnectorMetadata) and meta.copy_keys:
            self._put(encoder_cache, meta.copy_keys)

    def _put(self, encoder_cache: dict[str, torch.Tensor], keys_of: dict[str, list[str]]) -> bool:
        items, about = {}, {}
        for mm_hash, keys in keys_of.items():
            tensor = encoder_cache.get(mm_hash)
            if tensor is None:
                continue
            tensor = tensor.detach()
            for key in keys:
                items[key] = tensor
                # Marked as an encoder output: published on the encoder topic ([events]) and, by
                # default, registered in the fleet directory ([cluster] directory) so other nodes find it.
                about[key] = EncoderMeta(num_tokens=int(tensor.shape[0]) if tensor.dim() else 0)
        if not items:
            return False

        def put(c) -> bool:
            for key, tensor in items.items():
                c.put(key, tensor, meta=about[key], checksum=self.client.settings.verify)
            return True
        return bool(self.client.call("save", put))

    # ---- consumer ----

    def start_load_caches(self, meta: Any, encoder_cache: dict[str, torch.Tensor]) -> None:
        """Fill encoder_cache[mm_hash] for this step's loads (`meta`: the step's bound metadata,
        or None) with ONE get_many round trip."""
        if not isinstance(meta, EcdECConnectorMetadata) or not meta.loads:
            return
        todo = [load for load in meta.loads if load.mm_hash not in encoder_cache]
        if not todo:
            return
        if self._device is None:
            self._device = engine_device()
        # straight to the engine's device: peer-to-peer or device-to-device from an arena, DMA
        # from the host pool; complete when get_many returns
        tensors = self.client.call("load", lambda c: self._get_verified(c, [load.key or load.mm_hash
                                                                            for load in todo]))
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

    def _get_verified(self, c: Any, keys: list[str]) -> list[torch.Tensor | None]:
        """get_many of `keys`, None for a missing one and, with `verify` (or in a verify
        namespace), for one whose bytes do not match its producer's checksum: that item alone is
        then recomputed or failed, as a missing one is; the others still load."""
        verify = self.client.settings.verify

        def read(picked: list[int]) -> list[torch.Tensor | None]:
            if not picked:
                return []
            return c.get_many([keys[i] for i in picked], missing_ok=True, verify=verify, device=self._device)

        got, corrupt = skipping_corrupt(keys, read)
        if not corrupt:
            return got
        self._log.log(logging.WARNING, "load:corrupt", "ecd entries %s failed verification (their bytes do not "
                      "match the producer's checksum): not loaded", [keys[i] for i in corrupt])
        out: list[torch.Tensor | None] = [None] * len(keys)
        for i, tensor in zip([i for i in range(len(keys)) if i not in corrupt], got):
            out[i] = tensor
        return out

    def _recompute_in_step(self, load: EcdLoad, meta: EcdECConnectorMetadata) -> bool:
        """Hand a failed load back to the model runner to encode in this step (ec_connector.py)."""
        inputs = meta.scheduled_encoder_inputs
        if not (load.recompute_ok and self._single_rank and inputs is not None):
            return False
        ids = inputs.setdefault(load.req_id, [])
        if load.input_id not in ids:
            ids.append(load.input_id)
        self._log.log(logging.WARNING, "load:recompute",
                      "ecd entry %s missing at load (deleted, evicted, corrupt, or the daemon restarted): "
                      "encoding it locally in this step", load.mm_hash)
        return True

    def build_connector_worker_meta(self) -> ECConnectorWorkerMetadata | None:
        meta = self._worker_meta
        if not (meta.loaded or meta.recomputed or meta.failed):
            return None
        self._worker_meta = EcdECWorkerMetadata()
        return meta

    def shutdown(self) -> None:
        self.client.close()
