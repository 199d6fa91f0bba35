"""EcdECConnector with a fault injected between the scheduler's hit and the worker's load, for
the failure test in test_ec_engines.py (loaded by the engine through ec_connector_module_path;
tests/engine is on the engine's PYTHONPATH).

The fault comes from the environment (the engine core is a child process: it inherits it):
ECD_TEST_FAULT_MODE and ECD_TEST_FAULT_DIR.
- mode "delete": the first step that loads anything deletes those entries from the daemon
  (as `ecd evict --force` would: a pin does not stop it), then loads.
- mode "corrupt": the first such step flips a byte of each of those entries in the daemon's
  pool (corrupt_pool.py: indexed, pinned, their checksum kept), then loads; the connector must
  be set `"verify": true` to catch it.
- mode "restart": the first such step writes DIR/paused and waits (up to 60 s) for DIR/resume,
  which the test writes after it restarted the daemon; then loads.
Every step that loaded appends {"loaded", "recomputed", "failed"} to DIR/loads.jsonl, so the test
sees what the worker did.
"""
from __future__ import annotations

import json
import os
import time

from ecd.integrations.vllm.ec_connector import EcdECConnector


class FaultyEcdECConnector(EcdECConnector):
    def __init__(self, vllm_config, role) -> None:
        super().__init__(vllm_config, role)
        self.fault = {"mode": os.environ["ECD_TEST_FAULT_MODE"], "dir": os.environ["ECD_TEST_FAULT_DIR"]}
        self.fault_done = False

    def inject(self, keys: list[str]) -> None:
        mode, folder = self.fault["mode"], self.fault["dir"]
        if mode == "delete":
            self.client.call("fault", lambda c: c.delete(keys))
        elif mode == "corrupt":
            from corrupt_pool import corrupt_entries
            flipped = self.client.call("fault", lambda c: corrupt_entries(c, keys))
            with open(os.path.join(folder, "corrupted"), "w") as f:
                f.write(str(flipped))
        elif mode == "restart":
            open(os.path.join(folder, "paused"), "w").close()
            deadline = time.monotonic() + 60
            while not os.path.exists(os.path.join(folder, "resume")) and time.monotonic() < deadline:
                time.sleep(0.05)
        else:
            raise ValueError(f"unknown fault mode {mode}")

    def start_load_caches(self, encoder_cache, **kwargs) -> None:
        meta = self._connector_metadata
        keys = [load.mm_hash for load in getattr(meta, "loads", ()) if load.mm_hash not in encoder_cache]
        if keys and not self.fault_done:
            self.fault_done = True
            self.inject(keys)
        super().start_load_caches(encoder_cache, **kwargs)
        if keys:
            meta_out = self.connector_worker.pending_report
            with open(os.path.join(self.fault["dir"], "loads.jsonl"), "a") as f:
                f.write(json.dumps({"keys": keys, "loaded": list(meta_out.loaded),
                                    "recomputed": list(meta_out.recomputed),
                                    "failed": [list(x) for x in meta_out.failed]}) + "\n")
