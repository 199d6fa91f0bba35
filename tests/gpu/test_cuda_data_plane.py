"""The CUDA data plane end to end: a real daemon with `[pool.cuda]`, producers and consumers in
separate processes. Marked `gpu`: skipped where torch sees no CUDA device (tests/conftest.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import line_within, wait_for
from ecd.client.testing import acquire

pytestmark = pytest.mark.gpu

WORKER = Path(__file__).with_name("gpu_worker.py")
REPO = Path(__file__).resolve().parents[2]
ARENA = '[pool.cuda]\ndevices = [0]\nsize = "256MiB"\n'


def worker(endpoint: str, *args, env: dict | None = None, timeout: float = 120) -> tuple[int, str]:
    full_env = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    out = subprocess.run([sys.executable, str(WORKER), endpoint, *map(str, args)], capture_output=True,
                         text=True, timeout=timeout, env=full_env)
    assert out.returncode == 0, out.stderr
    status, digest, device = out.stdout.split()
    assert status == "ok"
    return int(digest), device


@pytest.fixture
def gpu_daemon(daemon_factory):
    return daemon_factory(size="256MiB", extra=ARENA)


def arena_pools(client) -> set[int]:
    return {a.index for a in client.welcome.arenas}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16", "uint8"])
def test_d2d_across_processes_is_bit_identical(gpu_daemon, dtype):
    ep = gpu_daemon.endpoint
    digest, device = worker(ep, "put", "x", 7, 3 << 20, dtype, "cuda:0", "none")
    assert device == "cuda:0"
    with gpu_daemon.client() as c:
        assert arena_pools(c), "the daemon exported no arena"
        (loc,), release = acquire(c, ["x"])
        assert loc.pool in arena_pools(c)  # it lives in the arena, not the host pool
        release()
    assert worker(ep, "get", "x", "none") == (digest, "cuda:0")  # default: where it lives
    assert worker(ep, "get", "x", "cuda:0") == (digest, "cuda:0")
    assert worker(ep, "get", "x", "cpu") == (digest, "cpu")
    assert worker(ep, "view", "x") == (digest, "cuda:0")


def test_host_tier_d2h_then_h2d(gpu_daemon):
    ep = gpu_daemon.endpoint
    digest, _ = worker(ep, "put", "h", 3, 1 << 20, "bfloat16", "cuda:0", "host")
    with gpu_daemon.client() as c:
        (loc,), release = acquire(c, ["h"])
        assert loc.pool not in arena_pools(c)
        release()
    assert worker(ep, "get", "h", "none") == (digest, "cpu")
    assert worker(ep, "get", "h", "cuda:0") == (digest, "cuda:0")


def test_producer_sigkill_after_publish_leaves_the_entry_readable(gpu_daemon):
    ep = gpu_daemon.endpoint
    proc = subprocess.Popen([sys.executable, str(WORKER), ep, "put", "k", "11", str(1 << 22), "bfloat16", "cuda:0",
                             "none", "hold"], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        status, digest, _ = proc.stdout.readline().split()
        assert status == "ok"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert worker(ep, "get", "k", "cuda:0") == (int(digest), "cuda:0")
    assert worker(ep, "view", "k") == (int(digest), "cuda:0")


def test_producer_sigkill_mid_put_gives_the_extent_back_and_publishes_nothing(daemon_factory):
    # session_ttl: the bound should the daemon fall back to heartbeats (no pidfd for the worker)
    d = daemon_factory(size="256MiB", extra=ARENA + '[leases]\nsession_ttl = "10s"\n')
    ep, key, numel = d.endpoint, "m", 1 << 22  # bfloat16: 8 MiB
    with d.client() as c:
        (arena,) = arena_pools(c)
        used_before = c.stats()["pools"][arena][1]
        proc = subprocess.Popen([sys.executable, str(WORKER), ep, "put-stall", key, "13", str(numel), "bfloat16",
                                 "cuda:0"], stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
        try:
            status, pool, _ = line_within(proc, 120).split()
            assert status == "allocated" and int(pool) == arena
            stats = c.stats()
            assert stats["entries_writing"] == 1
            assert stats["pools"][arena][1] >= used_before + 2 * numel
            assert c.exists(key) is False  # half-written: not published
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)

        def reclaimed():
            s = c.stats()
            return s["entries_writing"] == 0 and s["pools"][arena][1] == used_before and s

        stats = wait_for(reclaimed, timeout=30.0, interval=0.1)
        assert stats, f"the dead producer's arena extent was not given back: {c.stats()}"
        assert stats["reclaimed_sessions"] >= 1
        assert c.exists(key) is False
        assert c.get_many([key], missing_ok=True) == [None]
        with pytest.raises(KeyError):  # KeyNotFound: nothing was ever published
            c.get(key, timeout=0.5)
    # the same key and size, put whole by another producer, reads back bit-identical
    digest, device = worker(ep, "put", key, 14, numel, "bfloat16", "cuda:0", "cuda")
    assert device == "cuda:0"
    assert worker(ep, "get", key, "cuda:0") == (digest, "cuda:0")
    assert worker(ep, "get", key, "cpu") == (digest, "cpu")
    assert worker(ep, "view", key) == (digest, "cuda:0")


def test_commit_waits_for_work_queued_on_the_current_stream(gpu_daemon):
    import torch
    with gpu_daemon.client() as c:
        for stream in (torch.cuda.current_stream(0), torch.cuda.Stream(0)):
            with torch.cuda.stream(stream):
                x = torch.zeros(1 << 22, device="cuda:0")
                torch.cuda._sleep(200_000_000)  # ~0.1 s of spinning before the fill runs
                x.fill_(7.0)
                c.put("slow", x)  # must copy after the fill and publish after the copy
            with gpu_daemon.client() as other:
                got = other.get("slow", device="cpu")
            assert bool((got == 7.0).all())


def test_checksums_and_verify_on_gpu_bytes(gpu_daemon):
    import torch
    with gpu_daemon.client() as c:
        x = torch.randn(1 << 20, device="cuda:0").to(torch.bfloat16)
        c.put("v", x, checksum=True)
        c.put("vh", x, checksum=True, tier="host")
        assert torch.equal(c.get("v", verify=True), x)
        assert torch.equal(c.get("vh", verify=True, device="cuda:0"), x)
        with c.view("v", verify=True) as v:
            assert torch.equal(v, x)


def test_put_many_groups_by_tier_and_non_contiguous(gpu_daemon):
    import torch
    with gpu_daemon.client() as c:
        a = torch.randn(512, 1024, device="cuda:0")[:, ::2]  # strided
        b = torch.randn(4096)
        d = torch.randn(1 << 18, device="cuda:0")
        c.put_many({"a": a, "b": b, "d": d})
        c.put_many({"ah": a}, tier="host")
        assert torch.equal(c.get("a"), a) and c.get("a").is_cuda
        assert torch.equal(c.get("b"), b) and not c.get("b").is_cuda
        assert torch.equal(c.get("d", device="cuda"), d)
        assert torch.equal(c.get("ah", device="cuda:0"), a)


def test_no_arena_falls_back_to_host_and_cuda_tier_is_refused(daemon_factory):
    import torch
    from ecd.errors import InvalidRequest
    d = daemon_factory(size="128MiB")  # no [pool.cuda]
    with d.client() as c:
        x = torch.randn(1 << 20, device="cuda:0")
        c.put("x", x)
        assert torch.equal(c.get("x", device="cuda:0"), x)
        with pytest.raises(InvalidRequest, match="no CUDA arena"):
            c.put("y", x, tier="cuda")


def test_no_gpu_memory_growth_over_many_puts(gpu_daemon):
    import torch
    with gpu_daemon.client() as c:
        x = torch.randn(1 << 22, device="cuda:0")
        for i in range(20):
            c.put(f"w{i % 4}", x)
            c.get(f"w{i % 4}")
        torch.cuda.synchronize()
        free_before, _ = torch.cuda.mem_get_info(0)
        for i in range(500):
            c.put(f"w{i % 4}", x)
            y = c.get(f"w{i % 4}")
            with c.view(f"w{i % 4}") as v:
                assert v.numel() == x.numel()
        del y
        torch.cuda.synchronize()
        free_after, _ = torch.cuda.mem_get_info(0)
        assert free_before - free_after < 64 << 20, (free_before, free_after)


def test_peer_to_peer_and_remapped_ordinals(gpu_daemon):
    import torch
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    ep = gpu_daemon.endpoint
    digest, _ = worker(ep, "put", "p", 5, 1 << 22, "bfloat16", "cuda:0", "cuda")
    assert worker(ep, "get", "p", "cuda:1") == (digest, "cuda:1")  # peer-to-peer from the arena
    # A consumer that sees the arena's GPU as its ordinal 1 maps the arena by UUID.
    env = {"CUDA_VISIBLE_DEVICES": "1,0"}
    assert worker(ep, "get", "p", "none", env=env) == (digest, "cuda:1")
    assert worker(ep, "view", "p", env=env) == (digest, "cuda:1")
    # A producer on the other GPU has no arena there: host fallback, readable anywhere.
    digest2, _ = worker(ep, "put", "q", 6, 1 << 20, "float32", "cuda:1", "none")
    assert worker(ep, "get", "q", "cuda:0") == (digest2, "cuda:0")
