"""A test-only EcdKVConnector that corrupts some of a step's blocks in the daemon's pool between
the scheduler's lookup (which found and pinned them) and the worker's load, deterministically.

Just before the real connector's `start_load_kv` (unchanged, called right after), the worker
flips a byte of every other planned block in the pool (corrupt_pool.py): the entries stay indexed
and pinned with their producer's checksum, so the lookup's hit stands and only the verified load
(`"verify": true`) can tell. Only the first step with loads is sabotaged; the corrupt entries stay
in the pool, so later loads of them fail verification too.
"""
from __future__ import annotations

import sys
from typing import Any

from corrupt_pool import corrupt_entries

from ecd import Client
from ecd.integrations.vllm.kv_connector import EcdKVConnector, EcdKVConnectorMetadata


class CorruptingKVConnector(EcdKVConnector):
    sabotaged = False

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not type(self).sabotaged and isinstance(meta, EcdKVConnectorMetadata) and meta.loads:
            type(self).sabotaged = True
            self.corrupt_planned(meta)
        super().start_load_kv(forward_context, **kwargs)

    def corrupt_planned(self, meta: EcdKVConnectorMetadata) -> None:
        keys = [k for t in meta.loads for k in t.keys if k]
        with Client(self.settings.endpoint, namespace=self.namespace, timeout=5.0) as client:
            flipped = corrupt_entries(client, keys[1::2])
        # Seen in the engine's stderr: the test checks the corruption really happened.
        print(f"corrupting_kv_connector: {len(keys)} planned blocks, {flipped} corrupted", file=sys.stderr,
              flush=True)
