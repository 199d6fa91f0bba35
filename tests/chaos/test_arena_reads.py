"""Reads of CUDA arena entries without a round trip, under churn (no GPU: the fake driver's
arenas are memfds, tests/fake_gpu_plane.py copies them on a "stream" that runs late, as a GPU's
does). A writer puts into a 1 MiB arena (16 values of 64 KiB, 24 keys: every put evicts), readers
get (a device copy holding its read slot until it completes) and view arena entries with delays
injected before the slots are stored: zero wrong bytes, no view changing while open, and the
reads hold slots, not leases. The same run against a client that clears its slots before its
copies complete, or a daemon that frees without scanning the slots, goes wrong."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "tests" / "integration"))
from test_cuda_arenas import FakeCudaDaemon  # noqa: E402

CHURN = Path(__file__).resolve().parent / "arena_read_churn.py"
KEYS = 24
CUDA = '[pool.cuda]\ndevices = [0]\nsize = "1MiB"\n'


def run(daemon_mutant: str = "none", client_mutant: str = "none", seconds: float = 6, readers: int = 2):
    d = FakeCudaDaemon("16MiB", CUDA)
    try:
        d.start(env={"ECD_FAKE_CUDA_FD": "1"},
                launcher=(str(CHURN), "daemon", daemon_mutant, "--") if daemon_mutant != "none" else (
                    str(REPO / "tests" / "fake_cuda.py"),))
        procs = [subprocess.Popen([sys.executable, str(CHURN), "writer", d.endpoint, str(KEYS), str(seconds), "1"],
                                  stdout=subprocess.PIPE, text=True)]
        procs += [subprocess.Popen([sys.executable, str(CHURN), "reader", d.endpoint, str(KEYS), str(seconds),
                                    str(10 + i), client_mutant], stdout=subprocess.PIPE, text=True)
                  for i in range(readers)]
        reports = []
        try:
            for p in procs:
                out, _ = p.communicate(timeout=seconds + 60)
                assert p.returncode == 0, (p.args, out, d.log())
                reports.append(json.loads(out.strip().splitlines()[-1]))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        with d.client() as c:
            ops = c.stats()["ops"]
        return reports[0], reports[1:], ops
    finally:
        d.cleanup()


def test_arena_reads_under_churn_never_return_wrong_bytes():
    writer, readers, ops = run()
    assert writer["puts"] > 200, writer
    reads = sum(r["reads"] for r in readers)
    assert reads > 200 and all(r["views"] > 20 for r in readers), readers
    assert sum(r["wrong"] for r in readers) == 0, readers
    # arena reads held read slots: the daemon was asked only for what the slots did not take
    slotted = sum(r["slotted"] for r in readers)
    assert slotted > 0.8 * reads, readers
    assert ops.get("acquire", 0) <= reads - slotted + sum(r["missing"] for r in readers), (ops, readers)


@pytest.mark.parametrize("client_mutant,daemon_mutant", [("early-release", "none"), ("none", "no-slot-scan")])
def test_a_mutant_of_the_arena_read_slots_returns_wrong_bytes(client_mutant, daemon_mutant):
    _, readers, _ = run(daemon_mutant, client_mutant)
    assert sum(r["reads"] for r in readers) > 100, readers
    assert sum(r["wrong"] for r in readers) > 0, f"the mutant went unseen: {readers}"
