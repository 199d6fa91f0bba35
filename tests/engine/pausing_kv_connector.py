"""A test-only EcdKVConnector that stops between the scheduler's lookup and the worker's load of
the first step that loads anything, so the test can restart the daemon in that window.

The worker, just before the real connector's `start_load_kv` (unchanged, called right after),
writes $ECD_TEST_FAULT_DIR/paused and waits (up to 120 s) for $ECD_TEST_FAULT_DIR/resume, which
the test writes once it restarted the daemon (the engine core inherits the environment). The
lookup found and pinned the blocks in the old daemon run; the load goes to the new one.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any

from ecd.integrations.vllm.kv_connector import EcdKVConnector, EcdKVConnectorMetadata


class PausingKVConnector(EcdKVConnector):
    paused = False

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not type(self).paused and isinstance(meta, EcdKVConnectorMetadata) and meta.loads:
            type(self).paused = True
            folder = os.environ["ECD_TEST_FAULT_DIR"]
            planned = sum(1 for t in meta.loads for k in t.keys if k)
            print(f"pausing_kv_connector: {planned} planned blocks, paused for a daemon restart",
                  file=sys.stderr, flush=True)
            open(os.path.join(folder, "paused"), "w").close()
            deadline = time.monotonic() + 120
            while not os.path.exists(os.path.join(folder, "resume")) and time.monotonic() < deadline:
                time.sleep(0.05)
        super().start_load_kv(forward_context, **kwargs)
