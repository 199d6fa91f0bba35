"""CI runs a short `benchmarks/fuzz.py`: mixed adversarial frames and garbage against its own
daemon; no crash, no lost reply, no internal error, the bystander untouched, memory flat."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(180)
def test_short_fuzz_run_passes():
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "fuzz.py"), "--frames", "3000", "--seed", "7",
                           "--json"], capture_output=True, text=True, timeout=170, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    r = json.loads(proc.stdout)
    assert r["failures"] == [] and r["crashes"] == 0 and r["daemon_exit"] == 0
    assert r["sent"] == 3000 and r["replies_lost"] == 0 and r["replies_unexpected"] == 0
    replies = r["replies"]
    assert replies.get("error:PROTOCOL", 0) > 0 and replies.get("error:NOT_REGISTERED", 0) > 0
    assert replies.get("failure:NOT_OWNER", 0) > 0 and replies.get("failure:STALE", 0) > 0
    assert r["bystander_generations_refused"] == {"NOT_OWNER": 5}
    assert r["dropped_by_daemon"]["refused"] > 0 and r["dropped_by_daemon"]["unanswerable"] > 0
    assert "INTERNAL" not in " ".join(replies) and "unhandled" not in r["daemon_errors"]
