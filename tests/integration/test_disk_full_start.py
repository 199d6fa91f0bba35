"""A daemon restarted onto a disk tier whose filesystem is full (ENOSPC) or read-only (EROFS)
starts anyway (issue 23, attack 5): exit 2 is in the systemd unit's RestartPreventExitStatus, so
a refused start would leave the node without its cache until someone intervened. It serves the
records it can read, says the tier is degraded (Stats, /metrics, the log), fails write-throughs
with PersistFailed meanwhile, and recovers by itself once a write succeeds again. Real daemons on
size-limited tmpfs mounts (root only: skipped elsewhere, as test_disk_tier.py's)."""
from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
from typing import Iterator

import pytest
import torch

from conftest import DaemonProcess, metric, scrape_metrics, wait_for
from ecd import KeyNotFound, PersistFailed
from test_disk_tier import MIB, disk_config, records, tensor, tmpfs


def fill(path: str) -> str:
    """Another program fills the filesystem: write until ENOSPC; the filler's path."""
    filler = os.path.join(path, "filler")
    chunk = b"\xa5" * MIB
    with open(filler, "wb", buffering=0) as f:
        while True:
            try:
                f.write(chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                break
    with open(filler, "ab", buffering=0) as f:  # and the last partial megabyte
        while True:
            try:
                f.write(b"\xa5" * 4096)
            except OSError:
                break
    return filler


def persisted(c) -> None:
    for i in range(3):
        c.put(f"p{i}", tensor(i), persist=True)
    c.put("small", tensor(9, 1000), persist=True)  # rides inline


def assert_persisted_served(c) -> None:
    for i in range(3):
        assert torch.equal(c.get(f"p{i}"), tensor(i)), f"p{i}"
    assert torch.equal(c.get("small"), tensor(9, 1000))


@contextlib.contextmanager
def crashed_with_records() -> Iterator[tuple[DaemonProcess, str]]:
    """A daemon with a disk tier on a 40 MiB tmpfs that persisted four entries and was SIGKILLed:
    (the daemon, to start again; the tier's path). Cleaned up after."""
    with tmpfs("40m") as path:
        d = DaemonProcess("64MiB", extra=disk_config(path, "32MiB"))
        try:
            d.start()
            with d.client() as c:
                persisted(c)
            d.stop(signal.SIGKILL)  # a crash
            yield d, path
        finally:
            d.cleanup()


def test_a_restart_onto_a_full_filesystem_serves_its_records_and_recovers():
    with crashed_with_records() as (d, path):
        filler = fill(path)  # another program fills the filesystem meanwhile
        d.start()  # main: "daemon exited with 2: pool.disk.path: ... not writable (No space left on device)"
        with d.client() as c:
            disk = c.stats()["disk"]
            assert disk["loaded"] == 4 and disk["persisted_entries"] == 4, disk
            assert disk["degraded"].startswith("enospc"), disk
            assert_persisted_served(c)  # a warm restart on a full disk: bytes intact
            assert metric(scrape_metrics(d.metrics_port), "ecd_disk_degraded") == 1
            with pytest.raises(PersistFailed, match="not persisted"):
                c.put("while-full", tensor(20), persist=True)
            assert torch.equal(c.get("while-full"), tensor(20))  # stored in memory all the same
            c.put("plain", tensor(21))
            assert torch.equal(c.get("plain"), tensor(21))
            assert c.stats()["disk"]["degraded"]  # the failed write-through changed nothing
            assert "disk tier degraded" in d.log()

            os.unlink(filler)  # room again: the probe notices within seconds
            disk = wait_for(lambda: (s := c.stats()["disk"])["degraded"] == "" and s, timeout=10)
            assert disk and disk["degraded"] == "", c.stats()["disk"]
            assert metric(scrape_metrics(d.metrics_port), "ecd_disk_degraded") == 0
            assert "disk tier recovered" in d.log()
            c.put("after", tensor(22), persist=True)  # durable again
        d.stop(signal.SIGKILL)
        d.start()
        with d.client() as c:
            assert_persisted_served(c)
            assert torch.equal(c.get("after"), tensor(22))
            assert c.stats()["disk"]["degraded"] == ""


def test_a_restart_onto_a_read_only_filesystem_serves_its_records_and_recovers():
    with crashed_with_records() as (d, path):
        # what a filesystem remounted read-only after an error looks like; a stale temporary
        # file of a torn write, which the start cannot remove now: not fatal, removed on recovery
        open(os.path.join(path, "0-1-1.ecd.tmp"), "wb").close()
        subprocess.run(["mount", "-o", "remount,ro", path], check=True)
        d.start()
        with d.client() as c:
            disk = c.stats()["disk"]
            assert disk["loaded"] == 4 and disk["degraded"].startswith("readonly"), disk
            assert_persisted_served(c)
            with pytest.raises(PersistFailed, match="not persisted"):
                c.put("while-ro", tensor(20), persist=True)
            assert c.delete("small")  # its file cannot go now: it goes on recovery
            assert len(records(path)) == 4
            subprocess.run(["mount", "-o", "remount,rw", path], check=True)
            disk = wait_for(lambda: (s := c.stats()["disk"])["degraded"] == "" and s, timeout=10)
            assert disk and disk["degraded"] == "", c.stats()["disk"]
            assert wait_for(lambda: len(os.listdir(path)) == 3), os.listdir(path)  # no .tmp, no "small"
            c.put("after", tensor(22), persist=True)
        d.stop(signal.SIGTERM)
        d.start()
        with d.client() as c:
            for i in range(3):
                assert torch.equal(c.get(f"p{i}"), tensor(i)), f"p{i}"
            assert torch.equal(c.get("after"), tensor(22))
            with pytest.raises(KeyNotFound):
                c.get("small")  # deleted while read-only: never back
