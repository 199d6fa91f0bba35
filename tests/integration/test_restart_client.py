"""A client across a daemon restart that adopts the pool ([restart], the default): a view open
across it keeps its entry (the client takes its lease again from the new daemon, so eviction
cannot hand the extent to a new put while the view is open), and the client carries on by itself.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
import torch

from conftest import holders_of_this_run, wait_for

MiB = 1 << 20


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_view_open_across_a_restart_keeps_its_bytes_under_eviction(daemon_factory, sig):
    d = daemon_factory(size="32MiB")
    c = d.client()
    viewed = torch.arange(MiB // 4, dtype=torch.int32)  # 1 MiB, the oldest entry: the LRU's first victim
    c.put("viewed", viewed)
    for i in range(8):
        c.put(f"other{i}", torch.full((MiB // 4,), i, dtype=torch.int32))
    with c.view("viewed") as view:
        d.stop(sig)
        d.start()
        restart = c.stats()["restart"]
        assert restart["adopted"] and restart["entries"] == 9, restart
        # Fill the pool twice over: every unleased entry is evicted, the viewed one must not be.
        for i in range(64):
            c.put(f"new{i}", torch.full((MiB // 4,), 1000 + i, dtype=torch.int32))
        assert torch.equal(view, viewed), "the viewed entry's extent was handed to a new put"
        assert c.exists(["viewed"]) == [True]
        assert not c.exists(["other0"])[0], "the pool was not filled enough to evict"
    # the view's lease went with the block: the entry is evictable again
    for i in range(64):
        c.put(f"again{i}", torch.full((MiB // 4,), i, dtype=torch.int32))
    assert c.exists(["viewed"]) == [False]
    c.close()


def test_an_entry_gone_at_the_restart_is_reported_and_the_view_closes_cleanly(daemon_factory, caplog):
    d = daemon_factory(size="32MiB", extra="[restart]\nadopt = false\n")
    c = d.client()
    c.put("k", torch.ones(1024))
    with caplog.at_level("WARNING", logger="ecd.client"):
        with c.view("k") as view:
            d.stop(signal.SIGKILL)
            d.start()
            c.put("after", torch.zeros(8))  # reconnects: the cold daemon has no "k"
            assert torch.equal(view, torch.ones(1024))  # the old run's memory, still mapped here
    assert "not in the restarted daemon's pool" in caplog.text
    assert c.exists(["k", "after"]) == [False, True]
    assert c.stats()["restart"]["adopted"] is False and c.stats()["restart"]["keeper"] == "none"
    c.close()


def holder_of(node: str) -> list[int]:
    """Pids of the holder processes of `node`."""
    pids = []
    for pid in holders_of_this_run():
        try:
            if f"--node\0{node}\0".encode() in open(f"/proc/{pid}/cmdline", "rb").read():
                pids.append(pid)
        except OSError:
            pass
    return pids


def test_ecd_release_returns_a_stopped_daemons_pool_at_once(daemon):
    with daemon.client() as c:
        c.put("k", torch.ones(1024))
    daemon.stop(signal.SIGTERM)
    held = holder_of(daemon.node)
    assert len(held) == 1, "the spawned holder keeps the pool for the next run"
    result = subprocess.run([sys.executable, "-m", "ecd", "release", "--config", str(daemon.config)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "not held any more" in result.stdout, result.stderr
    assert wait_for(lambda: not holder_of(daemon.node), 5.0), "the holder did not exit"
    daemon.start()  # nothing kept: a cold start
    with daemon.client() as c:
        assert c.exists(["k"]) == [False]
        assert c.stats()["restart"]["adopted"] is False


def test_ecd_status_says_what_the_start_adopted_and_how_long_it_took(daemon):
    with daemon.client() as c:
        for i in range(3):
            c.put(f"k{i}", torch.ones(4096))
    daemon.stop(signal.SIGKILL)
    daemon.start()
    ecd = [sys.executable, "-m", "ecd", "status", "--config", str(daemon.config), "--interval", "0"]
    shown = subprocess.run(ecd, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "adopted 3 entries" in shown.stdout and "kept by holder" in shown.stdout, shown.stdout
    as_json = subprocess.run([*ecd, "--json"], capture_output=True, text=True, timeout=60)
    restart = json.loads(as_json.stdout)["restart"]
    assert restart["adopted"] and restart["entries"] == 3 and 0 < restart["seconds"] < 60, restart
