"""`[pool.cuda]` end to end without a GPU: the real `ecd serve` refuses to start on a node without
CUDA (one line, exit 2, nothing left in /dev/shm), and a daemon started with a fake driver
(tests/fake_cuda.py) announces its arenas in Welcome, places Alloc.arena entries and the
reservation riding on their commit in the arena, refuses a bad arena, exports metrics per
arena and frees the arenas at exit."""
from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, DaemonProcess, metric, scrape_metrics, shm_files, wait_for
from ecd.errors import Code
from ecd.protocol import (PROTOCOL_VERSION, Alloc, AllocItem, Commit, Committed, Error, Extent,
                          Hello, Stats, StatsReply, Welcome)

sys.path.insert(0, str(REPO / "tests"))
from fake_cuda import UUIDS, Raw  # noqa: E402,F401  # Raw: test_cuda_fd_export takes it from here

FAKE = REPO / "tests" / "fake_cuda.py"
CUDA = f'[pool.cuda]\ndevices = ["{UUIDS[1]}", 0]\nsize = "4MiB"\n'


def has_libcuda() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


@pytest.mark.skipif(has_libcuda(), reason="this node has libcuda.so.1")
def test_serve_without_cuda_exits_2_with_one_line():
    d = DaemonProcess("16MiB", CUDA)
    try:
        proc = subprocess.run([sys.executable, "-m", "ecd", "serve", "--config", str(d.config)],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().splitlines() == [
            "ecd: cannot start: pool.cuda: CUDA is not available on this node: libcuda.so.1 not found"]
        assert shm_files(d.node) == []
        assert not os.path.exists(d.socket_path)
    finally:
        d.cleanup()


class FakeCudaDaemon(DaemonProcess):
    def start(self, timeout: float = 20.0, env: dict | None = None, launcher: tuple[str, ...] = (str(FAKE),)) -> None:
        """`launcher`: the script that installs the fake driver and serves (a chaos script's, with a mutant)."""
        self.alloc_log = os.path.join(self.runtime_dir, "cuda.log")
        env = dict(os.environ, PYTHONPATH=str(REPO), ECD_FAKE_CUDA_LOG=self.alloc_log, **(env or {}))
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, *launcher, "serve", "--config", str(self.config)],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}: {self.log()}")
            text = self.log_path.read_bytes()
            if b"serving node" in text:
                self.metrics_port = int(re.search(rb"metrics on http://[^:]+:(\d+)/metrics", text).group(1))
                return
            time.sleep(0.02)
        raise RuntimeError(f"daemon did not start: {self.log()}")


@pytest.fixture
def fake_daemon():
    d = FakeCudaDaemon("16MiB", CUDA)
    d.start()
    yield d
    d.cleanup()


def test_fake_driver_daemon_serves_arenas(fake_daemon):
    raw = Raw(fake_daemon.endpoint)
    try:
        welcome = raw.ask(Hello(1, PROTOCOL_VERSION, os.getpid(), "test"))
        assert isinstance(welcome, Welcome), welcome
        host = len(welcome.pools)
        assert [(a.index, a.device_uuid, a.size) for a in welcome.arenas] == [
            (host, UUIDS[1], 4 << 20), (host + 1, UUIDS[0], 4 << 20)]
        for arena, ordinal in zip(welcome.arenas, (1, 0)):
            assert len(arena.handle) == 64 and arena.handle[8:] == bytes([ordinal]) * 56
        # Alloc.arena places in that arena; the reservation of its Commit goes there too
        item = AllocItem("k", "uint8", [4096], 4096)
        (ext,) = raw.ask(Alloc(2, "ns", [item], arena=host + 1)).results
        assert isinstance(ext, Extent) and ext.pool == host + 1
        committed = raw.ask(Commit(3, [ext.generation], reserve=8192))
        assert isinstance(committed, Committed) and committed.results == [None]
        assert isinstance(committed.reservation, Extent) and committed.reservation.pool == host + 1
        (hext,) = raw.ask(Alloc(4, "ns", [AllocItem("h", "uint8", [16], 16)])).results
        assert isinstance(hext, Extent) and hext.pool < host
        bad = raw.ask(Alloc(5, "ns", [item], arena=0))
        assert isinstance(bad, Error) and bad.code == Code.INVALID and "not a CUDA arena" in bad.message
        stats = raw.ask(Stats(6))
        assert isinstance(stats, StatsReply)
        assert len(stats.stats.pools) == host + 2
        assert stats.stats.pools[host + 1] == (4 << 20, 4096 + 8192)
    finally:
        raw.close()
    # the reservation goes with the Bye, which nothing orders before the scrape
    assert wait_for(lambda: metric(scrape_metrics(fake_daemon.metrics_port), "ecd_pool_used_bytes", pool="cuda0")
                    == 4096, timeout=10)
    body = scrape_metrics(fake_daemon.metrics_port)
    assert metric(body, "ecd_pool_capacity_bytes", pool="cuda1") == 4 << 20
    assert metric(body, "ecd_pool_capacity_bytes", pool="host0") == 16 << 20
    assert metric(body, "ecd_cuda_arena_info", pool="cuda0", device_uuid=UUIDS[0]) == 1
    assert metric(body, "ecd_cuda_arena_info", pool="cuda1", device_uuid=UUIDS[1]) == 1
    # the host pool still works for an ordinary client
    with fake_daemon.client() as c:
        import torch
        c.put("t", torch.arange(100_000, dtype=torch.int64))
        assert torch.equal(c.get("t"), torch.arange(100_000, dtype=torch.int64))
    assert fake_daemon.stop(signal.SIGTERM) == 0
    log = open(fake_daemon.alloc_log).read().splitlines()
    allocs = sorted(l.split()[2] for l in log if l.startswith("alloc"))
    frees = sorted(l.split()[2] for l in log if l.startswith("free"))
    assert len(allocs) == 2 and allocs == frees, log
    assert shm_files(fake_daemon.node) == []


def test_unknown_device_is_one_line():
    d = FakeCudaDaemon("16MiB", '[pool.cuda]\ndevices = [0, 7]\nsize = "4MiB"\n')
    try:
        with pytest.raises(RuntimeError, match="exited with 2"):
            d.start()
        assert (f"ecd: cannot start: pool.cuda.devices: no CUDA device 7 on this node "
                f"(2 visible: 0 {UUIDS[0]}, 1 {UUIDS[1]})") in d.log()
        assert shm_files(d.node) == []
    finally:
        d.cleanup()
