"""On a GPU: arenas exported as file descriptors (`[pool.cuda] export = "fd"`, CUDA virtual memory
management) carry tensors between processes exactly as legacy IPC handles do, and also between
processes in different pid namespaces (`unshare --pid`: what separate pods are), where the
descriptor travels over the daemon's fd socket. Marked `gpu`: skipped without a CUDA device."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

WORKER = Path(__file__).with_name("gpu_worker.py")
REPO = Path(__file__).resolve().parents[2]


def arena_config(export: str) -> str:
    return f'[pool.cuda]\ndevices = [0]\nsize = "256MiB"\nexport = "{export}"\n'


def run_worker(endpoint: str, *args: str, prefix: tuple[str, ...] = ()) -> tuple[int, str]:
    out = subprocess.run([*prefix, sys.executable, str(WORKER), endpoint, *args], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 0, out.stderr
    status, digest, device = out.stdout.split()
    assert status == "ok"
    return int(digest), device


def own_pid_namespace() -> tuple[str, ...]:
    """A command prefix that runs a process in a new pid namespace, or skip where it cannot."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1)")
    prefix = (unshare, "--pid", "--fork", "--mount-proc")
    probe = subprocess.run([*prefix, sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                           text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a pid namespace here: {probe.stderr.strip()}")
    assert probe.stdout.strip() == "1"  # really another namespace: the child is its init
    return prefix


@pytest.mark.parametrize("export", ["fd", "ipc"])
def test_each_export_carries_tensors_between_processes(daemon_factory, export):
    d = daemon_factory(size="256MiB", extra=arena_config(export))
    with d.client() as c:
        assert [a.export for a in c.welcome.arenas] == [export]
        assert (len(c.welcome.arenas[0].handle) == 64) == (export == "ipc")
    digest, _ = run_worker(d.endpoint, "put", "x", "7", str(3 << 20), "bfloat16", "cuda:0", "cuda")
    assert run_worker(d.endpoint, "get", "x", "cuda:0") == (digest, "cuda:0")
    assert run_worker(d.endpoint, "view", "x") == (digest, "cuda:0")
    assert run_worker(d.endpoint, "get", "x", "cpu") == (digest, "cpu")


def test_auto_picks_fd_export_on_this_gpu(daemon_factory):
    d = daemon_factory(size="64MiB", extra='[pool.cuda]\ndevices = [0]\nsize = "64MiB"\n')
    with d.client() as c:
        assert [a.export for a in c.welcome.arenas] == ["fd"]
        x = torch.arange(1 << 20, device="cuda:0", dtype=torch.int32)
        c.put("a", x)
        assert torch.equal(c.get("a"), x) and c.get("a").is_cuda


def test_producer_and_consumer_in_other_pid_namespaces(daemon_factory):
    prefix = own_pid_namespace()
    d = daemon_factory(size="256MiB", extra=arena_config("fd"))
    # a producer in its own pid namespace puts into the arena; a consumer in another reads it
    digest, _ = run_worker(d.endpoint, "put", "ns", "3", str(4 << 20), "float16", "cuda:0", "cuda", prefix=prefix)
    assert run_worker(d.endpoint, "get", "ns", "cuda:0", prefix=prefix) == (digest, "cuda:0")
    assert run_worker(d.endpoint, "view", "ns", prefix=prefix) == (digest, "cuda:0")
    assert run_worker(d.endpoint, "get", "ns", "cuda:0") == (digest, "cuda:0")  # and from this namespace


def test_the_arena_outlives_a_consumer_that_dies_holding_its_mapping(daemon_factory):
    d = daemon_factory(size="256MiB", extra=arena_config("fd"))
    digest, _ = run_worker(d.endpoint, "put", "k", "5", str(1 << 20), "bfloat16", "cuda:0", "cuda")
    for _ in range(2):  # each consumer imports the descriptor and exits without unmapping
        assert run_worker(d.endpoint, "view", "k") == (digest, "cuda:0")
    free_before = torch.cuda.mem_get_info(0)[0]
    for _ in range(3):
        assert run_worker(d.endpoint, "get", "k", "cuda:0") == (digest, "cuda:0")
    # imports by processes that are gone leave no device memory behind (within allocator noise)
    assert free_before - torch.cuda.mem_get_info(0)[0] < 64 << 20
