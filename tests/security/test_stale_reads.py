"""What a client remembers never outlives what another client changed (issue 40, "worth a test"):
a reader's location cache and its ring-based `exists` (the presence table, no round trip) after a
key is deleted, and then replaced, by another process (another tenant's engine, here a real
process of another uid in the daemon's group). Never the old bytes, never "present" for a deleted key.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

import ecd
from conftest import REPO

NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the other tenant drops to another uid: needs root")

OTHER = r"""
import os, sys, torch
from ecd.client.client import Client  # imported before dropping: the venv may be root's alone
os.setgroups([0]); os.setgid(65534); os.setuid(65534)
endpoint, action = sys.argv[1], sys.argv[2]
with Client(endpoint, timeout=10) as c:
    if action == "delete":
        print(c.delete(["shared"]), flush=True)
    else:
        c.put("shared", torch.full((4096,), 7, dtype=torch.uint8))
        print("replaced", flush=True)
"""


def other_tenant(d, action: str) -> str:
    out = subprocess.run([sys.executable, "-c", OTHER, d.endpoint, action], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def eventually(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_key_another_tenant_deleted_or_replaced_is_never_served_from_memory(daemon_factory):
    d = daemon_factory()
    os.chmod(d.runtime_dir, 0o750)  # the group reaches the sockets
    with d.client() as reader:
        reader.put("shared", torch.full((4096,), 1, dtype=torch.uint8))
        assert torch.equal(reader.get("shared"), torch.full((4096,), 1, dtype=torch.uint8))  # location cached
        assert reader.exists("shared") is True  # from the ring's presence table
        assert other_tenant(d, "delete") == "[True]"
        # the ring's DELETED event reaches the reader's table and cache: no stale "present"
        assert eventually(lambda: reader.exists("shared") is False), "a deleted key still answers present"
        with pytest.raises(ecd.KeyNotFound):
            reader.get("shared")
        assert other_tenant(d, "replace") == "replaced"
        assert eventually(lambda: reader.exists("shared") is True)
        assert torch.equal(reader.get("shared"), torch.full((4096,), 7, dtype=torch.uint8))  # the new bytes
        with reader.view("shared") as view:
            assert bool((view == 7).all())
