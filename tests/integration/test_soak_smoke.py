"""benchmarks/soak.py, short: real daemon, 2 worker processes, ~18 s. CI exercises the soak
harness and the daemon under a random mix; the long run is done by hand (README)."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import soak  # noqa: E402


def test_payloads_verify_themselves():
    data = soak.make_payload("k7", 12345, 1000)
    assert soak.check_payload("k7", data) is None
    assert "another key" in soak.check_payload("k8", data)
    assert "header says" in soak.check_payload("k7", data[:999])
    flipped = data.copy()
    flipped[500] ^= 1
    assert "first wrong byte at 500" in soak.check_payload("k7", flipped)
    other = soak.make_payload("k7", 999, 1000)  # a whole other put of the same key: also fine
    assert soak.check_payload("k7", other) is None and not np.array_equal(other, data)
    assert soak.check_payload("k7", soak.make_payload("k7", 1, soak.MIN_SIZE)) is None


@pytest.mark.timeout(180)
def test_soak_smoke(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "soak.py"), "--minutes", "0.3",
                           "--clients", "2", "--pool", "128MiB", "--max-size", str(2 << 20), "--quiet",
                           "--seed", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=170, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["ok"] and not res["failures"]
    assert res["ops"] > 0 and res["workers_reported"] == 2
    assert res["corrupt_reads"] == 0 and res["checksum_failures"] == 0
    assert res["unexpected_errors"] == {}
    for op in ("put", "get", "view", "exists", "delete", "wait_get"):
        assert res["per_op"][op]["count"] > 0, op
    after = res["after_workers"]
    assert after["read_leases"] == after["pins"] == after["waiters"] == after["entries_writing"] == 0
    assert res["used_bytes_after_evicting_everything"] == 0
    assert res["daemon_exit_code"] == 0 and res["shm_files_left"] == []
    assert "RESULT: PASS" in proc.stdout
