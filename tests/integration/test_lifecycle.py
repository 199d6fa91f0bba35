"""`ecd serve` start-up, permissions, stale cleanup, bad configs and shutdown, as a real process."""
from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys

import pytest

from conftest import shm_files, wait_for, write_config


def serve(config) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ecd", "serve", "--config", str(config)],
                          capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("backing", ["memfd", "named"])
def test_creates_owner_group_only_files_and_unlinks_everything_on_sigterm(daemon_factory, backing):
    daemon = daemon_factory(backing=backing)
    names = shm_files(daemon.node)
    if backing == "named":
        assert f"ecd.{daemon.node}.0" in names and f"ecd.{daemon.node}.ring" in names
    else:  # no pool or ring file: the fd socket beside the control socket hands them out
        assert names == [f"ecd.{daemon.node}.lock"]
        fds_mode = os.stat(daemon.socket_path + ".fds").st_mode
        assert stat.S_ISSOCK(fds_mode) and stat.S_IMODE(fds_mode) == 0o660
    for name in names:
        mode = stat.S_IMODE(os.stat(f"/dev/shm/{name}").st_mode)
        assert mode & 0o007 == 0, f"{name} is world-accessible: {oct(mode)}"
        # pools group read-write; the ring group read-only (only the daemon writes it); the restart
        # journal not at all (what the next daemon adopts: no client may write, or read, it)
        group = 0o040 if name.endswith(".ring") else 0 if name.endswith(".journal") else 0o060
        assert mode & 0o060 == group, f"{name}: group access {oct(mode & 0o060)}, wanted {oct(group)}"
    sock_mode = os.stat(daemon.socket_path).st_mode
    assert stat.S_ISSOCK(sock_mode) and stat.S_IMODE(sock_mode) & 0o007 == 0
    assert daemon.stop(signal.SIGTERM) == 0
    # the pool and its journal stay for the next run ([restart]), held by the holder: named files
    # 0600 (the journal: the daemon's alone) or 0660 (the pool); the ring and the lock are gone
    kept = shm_files(daemon.node)
    if backing == "named":
        assert sorted(kept) == sorted([f"ecd.{daemon.node}.0", f"ecd.{daemon.node}.journal"])
        assert stat.S_IMODE(os.stat(f"/dev/shm/ecd.{daemon.node}.journal").st_mode) == 0o600
    else:
        assert kept == []
    assert not os.path.exists(daemon.socket_path)
    assert not os.path.exists(daemon.socket_path + ".fds")
    daemon.release_pool()  # a final stop: the holder unlinks them
    assert wait_for(lambda: shm_files(daemon.node) == [], 5.0)


def test_sigint_also_cleans_up(daemon):
    assert daemon.stop(signal.SIGINT) == 0
    assert shm_files(daemon.node) == []


@pytest.mark.parametrize("body, key", [
    ('[node]\nname = "x"\nbogus = 1\n', "node.bogus: unknown key"),
    ('[pool.host]\nsize = -5\n', "pool.host.size: must be > 0"),
    ('[pool.host]\nsize = "lots"\n', "pool.host.size"),
    ('[leases]\nwrite_ttl = "soon"\n', "leases.write_ttl"),
    ('[control]\nendpoint = "http://x"\n', "control.endpoint"),
    ('[node\n', "not valid TOML"),
])
def test_bad_config_exits_nonzero_with_one_clear_line(tmp_path, body, key):
    config = tmp_path / "node.toml"
    config.write_text(body)
    result = serve(config)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert key in lines[0] and "Traceback" not in result.stderr


def test_unwritable_runtime_dir_is_refused(tmp_path):
    # /proc refuses new directories even to root, which CI runs as.
    config = write_config(str(tmp_path), "unwritable")
    config.write_text(config.read_text().replace(f'runtime_dir = "{tmp_path}"', 'runtime_dir = "/proc/ecd-x"'))
    result = serve(config)
    assert result.returncode == 2
    assert "node.runtime_dir: /proc/ecd-x is not writable" in result.stderr


def test_runtime_dir_that_is_a_file_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    config = write_config(str(tmp_path), "rtfile")
    config.write_text(config.read_text().replace(f'runtime_dir = "{tmp_path}"',
                                                 f'runtime_dir = "{blocker}/sub"'))
    result = serve(config)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "node.runtime_dir" in result.stderr


def test_endpoint_in_use_by_another_process_is_refused(tmp_path):
    path = tmp_path / "ecd.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()
    try:
        result = serve(write_config(str(tmp_path), f"busy{os.getpid()}"))
    finally:
        listener.close()
    assert result.returncode == 2
    assert "control.endpoint" in result.stderr and "in use" in result.stderr
    assert shm_files(f"busy{os.getpid()}") == []  # refused before creating anything


def test_second_daemon_for_the_same_node_is_refused(daemon):
    result = serve(daemon.config)
    assert result.returncode == 2 and "another ecd daemon" in result.stderr
    assert daemon.alive()
    with daemon.client() as c:
        assert c.ping() > 0


def test_check_config_prints_effective_config(tmp_path):
    config = write_config(str(tmp_path), "cc", size="512MiB")
    result = subprocess.run([sys.executable, "-m", "ecd", "check-config", str(config)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0
    assert 'size = "512MiB"' in result.stdout and "write_ttl" in result.stdout
