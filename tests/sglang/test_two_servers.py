"""Two SGLang servers on one node, each its own process with its own host pool, share one ecd: the
pages one backed up are hits for the other, loaded bit-exact into its pool."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import sglang_env  # noqa: F401  (skips this module without SGLang)

from conftest import REPO

SERVER = Path(__file__).with_name("server_proc.py")


def server(endpoint: str, role: str, layout: str, seed: int, n: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(SERVER.parent), str(REPO / "tests")])}
    out = subprocess.run([sys.executable, str(SERVER), endpoint, role, layout, str(seed), str(n)],
                         capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_server_hits_the_first_servers_pages(daemon):
    first = server(daemon.endpoint, "store", "page_first", seed=11, n=5)
    assert first["stored"] == [True] * 5
    second = server(daemon.endpoint, "load", "page_first", seed=11, n=5)
    assert second["namespace"] == first["namespace"]
    assert second["exists"] == 5
    assert second["loaded"] == [True] * 5 and second["exact"] is True
    assert second["counters"]["loaded_pages"] == 5 and second["counters"]["stored_pages"] == 0


def test_a_server_with_another_layout_does_not_hit_them(daemon):
    first = server(daemon.endpoint, "store", "page_first", seed=12, n=2)
    other = server(daemon.endpoint, "load", "layer_first", seed=12, n=2)
    assert other["namespace"] != first["namespace"]
    assert other["exists"] == 0 and other["loaded"] == [False, False]
