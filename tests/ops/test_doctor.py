"""`ecd doctor` and `ecd serve`'s preflight as real processes, and the clear errors of clients that
cannot reach the daemon's socket or pool: a daemon in a real memory cgroup smaller than its pool,
/dev/shm read-only in a mount namespace of its own, a client running as `nobody`, a client with a
/dev/shm of its own. What needs root, a writable cgroupfs or `unshare` skips, saying why."""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import pwd
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from conftest import REPO, DaemonProcess, shm_files

ECD = [sys.executable, "-m", "ecd"]
CLIENT = Path(__file__).resolve().parent / "doctor_client.py"
MiB = 1 << 20
_cgroups = itertools.count()


def run(argv: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def needs_root(why: str) -> None:
    if os.geteuid() != 0:
        pytest.skip(f"{why} needs root (CI runs as root in its container)")


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[Path]:
    """A child of this process's memory cgroup (v1's memory controller, or v2's) limited to
    `limit` bytes; skips where none can be made."""
    needs_root("creating a memory cgroup")
    parent = None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            parent, limit_name = Path("/sys/fs/cgroup/memory" + path), "memory.limit_in_bytes"
            break
        if hierarchy == "0" and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
            parent, limit_name = Path("/sys/fs/cgroup" + path), "memory.max"
    if parent is None or not parent.is_dir():
        pytest.skip("no memory cgroup of this process found under /sys/fs/cgroup")
    child = parent / f"ecd-test-{os.getpid()}-{next(_cgroups)}"
    try:
        child.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a cgroup under {parent}: {exc.strerror}")
    try:
        try:
            (child / limit_name).write_text(str(limit))
        except OSError as exc:
            pytest.skip(f"cannot set {child / limit_name} (no memory controller there?): {exc.strerror}")
        yield child
    finally:
        for _ in range(100):  # its processes may take a moment to leave
            try:
                child.rmdir()
                break
            except OSError:
                time.sleep(0.05)


def in_cgroup(cgroup: Path, argv: list[str]) -> list[str]:
    return ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh", *argv]


def with_private_shm(argv: list[str], options: str) -> list[str]:
    """argv in a mount namespace of its own with a fresh tmpfs (mounted with `options`) on /dev/shm."""
    needs_root("a mount namespace with its own /dev/shm")
    if shutil.which("unshare") is None:
        pytest.skip("the unshare tool (util-linux) is not installed")
    probe = run(["unshare", "--mount", "--propagation", "private", "true"])
    if probe.returncode != 0:
        pytest.skip(f"unshare --mount fails here: {probe.stderr.strip()}")
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            f'mount -t tmpfs -o {options} tmpfs /dev/shm && exec "$@"', "sh", *argv]


def cannot_start_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr
    return [line for line in stderr.splitlines() if line.startswith("ecd: ")]


@pytest.fixture
def node(tmp_path_factory) -> Iterator[DaemonProcess]:
    made: list[DaemonProcess] = []

    def make(size: str = "64MiB", extra: str = "") -> DaemonProcess:
        d = DaemonProcess(size, extra)
        made.append(d)
        return d
    yield make  # type: ignore[misc]
    for d in made:
        d.cleanup()


def test_doctor_on_a_good_config_prints_ok_and_exits_0(node):
    d = node()
    os.chmod(d.runtime_dir, 0o770)  # mkdtemp's 0700 would keep node.group out (a warning)
    result = run([*ECD, "doctor", "--config", str(d.config)])
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1].startswith("OK"), result.stdout
    assert any(line.startswith("ok: pool.host.size: ") for line in lines), result.stdout
    assert any(line.startswith("ok: control.endpoint: ") for line in lines), result.stdout
    assert "error:" not in result.stdout + result.stderr
    # what is not ok goes to stderr; on this config only the host's own limits may warn
    assert all(line.startswith("warning: RLIMIT_") for line in result.stderr.splitlines()), result.stderr


def test_doctor_and_serve_agree_on_a_socket_directory_that_does_not_exist(node, tmp_path):
    d = node()
    d.config.write_text(d.config.read_text().replace(f'endpoint = "{d.endpoint}"',
                                                     f'endpoint = "ipc://{tmp_path}/absent/ecd.sock"'))
    doctor = run([*ECD, "doctor", "--config", str(d.config)])
    assert doctor.returncode == 1
    problem = next(line for line in doctor.stderr.splitlines() if line.startswith("error: "))
    assert problem == f"error: control.endpoint: directory of {tmp_path}/absent/ecd.sock does not exist: " \
                      "create it, or put the socket in node.runtime_dir"
    serve = run([*ECD, "serve", "--config", str(d.config)])
    assert serve.returncode == 2
    assert cannot_start_lines(serve.stderr) == ["ecd: cannot start: " + problem[len("error: "):]]


def test_pool_larger_than_the_cgroup_memory_limit_is_refused_with_one_line(node):
    """Measured on main: the daemon is OOM-killed (exit 137) creating its pool, with no log line."""
    d = node("256MiB")
    with memory_cgroup(128 * MiB) as cgroup:
        doctor = run(in_cgroup(cgroup, [*ECD, "doctor", "--config", str(d.config)]))
        assert doctor.returncode == 1, doctor.stdout + doctor.stderr
        problem = next(line for line in doctor.stderr.splitlines() if line.startswith("error: "))
        assert problem.startswith("error: pool.host.size: the cgroup memory limit is 128MiB ("), problem
        assert "256MiB host pool" in problem and "raise the limit" in problem
        serve = run(in_cgroup(cgroup, [*ECD, "serve", "--config", str(d.config)]))
        assert serve.returncode == 2, serve.stderr
        assert cannot_start_lines(serve.stderr) == ["ecd: cannot start: " + problem[len("error: "):]]
        assert shm_files(d.node) == []  # refused before anything was created


def test_pool_within_the_cgroup_memory_limit_starts_and_serves(node):
    d = node("64MiB")
    with memory_cgroup(512 * MiB) as cgroup:
        doctor = run(in_cgroup(cgroup, [*ECD, "doctor", "--config", str(d.config)]))
        assert doctor.returncode == 0 and doctor.stdout.splitlines()[-1].startswith("OK"), doctor.stdout
        assert "fits the cgroup memory limit 512MiB" in doctor.stdout
        with open(d.log_path, "ab") as log:
            proc = subprocess.Popen(in_cgroup(cgroup, [*ECD, "serve", "--config", str(d.config)]),
                                    stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 30
            while "serving node" not in d.log() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert "serving node" in d.log(), d.log()
            import torch
            with d.client() as client:  # the whole pool touched: within the limit, nothing is killed
                for i in range(3):
                    client.put(f"k{i}", torch.ones(4 * MiB, dtype=torch.uint8))
                assert client.exists(["k0", "k1", "k2"]) == [True, True, True]
        finally:
            proc.terminate()
            assert proc.wait(30) == 0, d.log()


def test_serve_with_a_read_only_dev_shm_gives_one_line_and_exit_2(node):
    """Measured on main: a PermissionError traceback (os.open of the node lock) and exit 1."""
    d = node()
    serve = run(with_private_shm([*ECD, "serve", "--config", str(d.config)], "ro"))
    assert serve.returncode == 2, serve.stderr
    lines = cannot_start_lines(serve.stderr)
    assert len(lines) == 1 and lines[0].startswith("ecd: cannot start: /dev/shm: not writable ("), serve.stderr
    assert "mount a writable tmpfs on /dev/shm" in lines[0]
    doctor = run(with_private_shm([*ECD, "doctor", "--config", str(d.config)], "ro"))
    assert doctor.returncode == 1
    assert "error: " + lines[0][len("ecd: cannot start: "):] in doctor.stderr.splitlines()


NOBODY = pwd.getpwnam("nobody").pw_uid if "nobody" in {p.pw_name for p in pwd.getpwall()} else None


def client_as(uid: int, what: str, endpoint: str, wrap=lambda argv: argv) -> dict:
    argv = wrap([sys.executable, str(CLIENT), "--uid", str(uid), what, endpoint])
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd="/", env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.timing
@pytest.mark.parametrize("blocked_at", ["directory", "socket"])
def test_client_without_permission_is_told_at_once_with_the_reason(node, blocked_at):
    """Measured on main: DaemonUnavailable "no answer ... within 5s" after the whole timeout."""
    needs_root("running a client as another user")
    if NOBODY is None:
        pytest.skip("no user `nobody` on this host")
    d = node()
    d.start()
    socket_path = d.endpoint[len("ipc://"):]
    if blocked_at == "socket":
        os.chmod(d.runtime_dir, 0o755)  # the directory lets it through; the 0660 socket does not
    out = client_as(NOBODY, "control", d.endpoint)
    assert out["uid"] == NOBODY
    assert out["result"] == "SocketPermissionDenied", out
    assert out["seconds"] < 2.0, out  # not the 5 s timeout
    message = out["message"]
    assert message.startswith("permission denied: this process (uid %d, groups [" % NOBODY), message
    if blocked_at == "directory":
        assert f"cannot pass through the directory {d.runtime_dir} (mode 0700, owner uid 0" in message
    else:
        assert f"may not connect to the daemon's socket {socket_path} (mode 0660, owner uid 0" in message
    assert "node.group" in message and "allowed_uids" in message
    assert d.alive()


def test_client_with_its_own_dev_shm_is_refused_at_connect(node):
    """backing = "named" and a client whose /dev/shm is not the daemon's (its own IPC/mount
    namespace, as in a container). Measured on main: Client() connects, told nothing, and a small
    put succeeds inline while anything larger fails later ("not on the daemon's node")."""
    d = node('64MiB"\nbacking = "named')  # a second key in [pool.host]
    d.start()
    argv = [sys.executable, str(CLIENT), "tensors", d.endpoint]
    wrapped = with_private_shm(argv, "rw")
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run(wrapped, capture_output=True, text=True, timeout=120, cwd="/", env=env)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.splitlines()[-1])
    assert out["result"] == "PoolNotVisible", out
    assert out["message"].startswith(f"the daemon's pool file /dev/shm/ecd.{d.node}.ring (not there) is not "
                                     "visible from this process, although it reached the daemon of node "
                                     f"{d.node} at {d.endpoint} on this host"), out
    assert 'backing = "memfd"' in out["message"]
    with d.client() as local:  # nothing got in half-way, and the daemon serves on
        assert local.exists("small") is False
        assert local.stats()["clients"] == 1
