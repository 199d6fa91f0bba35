"""A test-only EcdKVConnector that makes the daemon evict a step's blocks between the scheduler's
lookup and the worker's load, deterministically.

In a deployment that window is a few milliseconds and the scheduler's pins hold LRU eviction off,
so an engine test cannot hit it by timing. Here the worker, just before the real connector's
`start_load_kv` (unchanged, called right after), waits until the pins the scheduler took have
expired (pin_seconds is set tiny) and then fills the (small) pool with another tenant's entries
until the daemon has LRU-evicted every block the step is about to load: exactly what a pool too
small for its traffic does. Only the first step with loads is sabotaged, so the engine's later
requests show that it kept serving.
"""
from __future__ import annotations

import sys
import time
from typing import Any

import torch

from ecd import Client, PoolFull
from ecd.integrations.vllm.kv_connector import EcdKVConnector, EcdKVConnectorMetadata

FILLER_NAMESPACE = "filler"
FILLER_ENTRY = 64 << 10


class EvictingKVConnector(EcdKVConnector):
    sabotaged = False

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if (not type(self).sabotaged and isinstance(meta, EcdKVConnectorMetadata) and meta.loads):
            type(self).sabotaged = True
            self.evict_planned(meta)
        super().start_load_kv(forward_context, **kwargs)

    def evict_planned(self, meta: EcdKVConnectorMetadata) -> None:
        keys = [k for t in meta.loads for k in t.keys if k]
        with Client(self.settings.endpoint, namespace=FILLER_NAMESPACE, timeout=5.0) as filler:
            def present() -> int:
                # The operator listing: unlike exists(), it does not make the entries recently used.
                _, entries = filler.keys(self.namespace, limit=100_000)
                names = {e["key"] for e in entries}
                return sum(k in names for k in keys)

            # Let the step's pins lapse: the daemon drops expired pins in a periodic sweep.
            deadline = time.monotonic() + 10.0
            while filler.stats()["pins"] and time.monotonic() < deadline:
                time.sleep(0.05)
            before = present()  # the test wants all of them here (never raise in an engine)
            # Another tenant's puts until LRU eviction has taken the blocks (a pool's worth may
            # not do: eviction makes one contiguous hole at a time, from whatever lies around
            # the least recently used entries), at most a few pools' worth.
            capacity = filler.stats()["capacity_bytes"]
            block = torch.zeros(FILLER_ENTRY, dtype=torch.uint8)
            n = 0
            try:
                while present() and n < 8 * capacity // FILLER_ENTRY:
                    for _ in range(16):
                        filler.put(f"filler-{n}", block)
                        n += 1
            except PoolFull:  # what is left is leased or pinned: nothing more to evict
                pass
            left = present()
        # Seen in the engine's stderr: the test checks the load really found nothing.
        print(f"evicting_kv_connector: {len(keys)} planned blocks, {before} present before and {left} left "
              f"after {n} puts of {FILLER_ENTRY} bytes", file=sys.stderr, flush=True)
