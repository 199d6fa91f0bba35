"""A pool that cannot fit: a clear start-up error naming the size, exit 2, nothing left in
/dev/shm, and the node starts fine with a pool that fits. Named mode: bigger than /dev/shm's free
space; memfd mode: bigger than the node's available memory (MemAvailable)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import DaemonProcess, shm_files, write_config
from invariants import assert_healthy
from ecd.memory.memfd import available_memory


@pytest.mark.parametrize("backing", ["named", "memfd"])
def test_pool_bigger_than_its_memory_is_refused(daemon_factory, backing):
    d: DaemonProcess = daemon_factory(start=False, backing=backing)
    if backing == "named":
        free, where = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize, "/dev/shm"
    else:
        free, where = available_memory(), "memory available"
        assert free is not None
    size = free + (1 << 30)
    write_config(d.runtime_dir, d.node, size=str(size), backing=backing)
    result = subprocess.run([sys.executable, "-m", "ecd", "serve", "--config", str(d.config)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "pool.host.size" in lines[0] and where in lines[0], lines[0]
    # names the size it was asked for (named: `ecd doctor`'s preflight line, in GiB)
    assert str(size) in lines[0] if backing == "memfd" else "needs" in lines[0], lines[0]
    assert shm_files(d.node) == []
    assert not os.path.exists(d.socket_path)
    # The same node with a pool that fits starts and serves.
    write_config(d.runtime_dir, d.node, size="16MiB", backing=backing)
    d.start()
    assert_healthy(d)
