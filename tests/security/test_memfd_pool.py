"""`[pool.host] backing = "memfd"`: the pool reaches clients as sealed memfds over the fd socket.

- A client in its own IPC, mount and pid namespaces, with a /dev/shm of its own, as another uid
  (what a container with no host namespaces is), puts, gets and views 16 MiB zero-copy through
  nothing but the socket directory; in the named mode the same client finds no pool.
- A client that holds the pool's descriptors cannot change their size (EPERM both ways), nor get
  the ring writable, and the daemon serves on with every byte intact.
- The fd socket is found beside the control socket path as the client knows it (a pod may mount
  the directory elsewhere), and a missing one is a clear error naming its path.
"""
from __future__ import annotations

import json
import os
import pwd
import shlex
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

from conftest import REPO, shm_files
from secutil import write_node_toml

from ecd.errors import DaemonUnavailable
from ecd.config import LeasesSection
from ecd.memory.entry_index import slot_area_bytes
from ecd.writes.submission import area_bytes

# segment 0 holds the submission area (memfd pools: ecd/writes/submission.py) and the read slots
# (memory/entry_index.py) after its share of the pool
SLOT_AREA = (slot_area_bytes(LeasesSection().slot_sessions, LeasesSection().read_slots)
             + area_bytes(LeasesSection().slot_sessions, LeasesSection().submit_records))

NS_CLIENT = Path(__file__).resolve().parent / "memfd_ns_client.py"
NOBODY = pwd.getpwnam("nobody").pw_uid
NBYTES = 16 << 20


def pattern(nbytes: int, mul: int, mod: int) -> torch.Tensor:
    return ((torch.arange(nbytes, dtype=torch.int64) * mul) % mod).to(torch.uint8)


def _why_no_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "needs root: unshare of the ipc/mount/pid namespaces and the drop to user nobody"
    if shutil.which("unshare") is None:
        return "the unshare tool (util-linux) is not installed"
    probe = subprocess.run(["unshare", "--ipc", "--mount", "--pid", "--fork", "sh", "-c",
                            "mount -t tmpfs -o size=1m tmpfs /dev/shm"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"unshare --ipc --mount --pid is not permitted here: {probe.stderr.strip()}"
    return None


def _run_client(*args: str, namespaces: bool, uid: int | None) -> dict:
    client = [sys.executable, str(NS_CLIENT), *(["--uid", str(uid)] if uid is not None else []), *args]
    if namespaces:  # a private tmpfs on /dev/shm, in its own mount namespace: the daemon's files are not there
        script = "mount -t tmpfs -o size=1m tmpfs /dev/shm && exec " + shlex.join(client)
        client = ["unshare", "--ipc", "--mount", "--pid", "--fork", "sh", "-c", script]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(client, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _start_for_nobody(daemon_factory, backing: str, control: str = ""):
    """A daemon whose runtime dir, control socket and fd socket belong to group nogroup (user
    nobody's), the only thing the namespaced client shares with it."""
    d = daemon_factory(start=False, backing=backing)
    run_dir = os.path.join(d.runtime_dir, "run")  # created by the daemon, 0770 nogroup
    os.chmod(d.runtime_dir, 0o711)  # mkdtemp's 0700 would keep nobody out of the path
    write_node_toml(d, runtime_dir=run_dir, endpoint=f"ipc://{run_dir}/ecd.sock", node='group = "nogroup"',
                    control=control)
    d.start()
    return d


@pytest.mark.parametrize("backing", ["memfd", "named"])
def test_client_in_its_own_namespaces_as_another_uid_puts_gets_and_views_16mib(daemon_factory, backing):
    why = _why_no_namespaces()
    if why is not None:
        pytest.skip(why)
    d = _start_for_nobody(daemon_factory, backing)
    with d.client() as host:
        host.put("from-host", pattern(NBYTES, 1, 251))
    endpoint = d.endpoint
    verdict = _run_client("roundtrip", endpoint, "from-host", str(NBYTES), namespaces=True, uid=NOBODY)
    assert verdict.pop("uid") == NOBODY
    assert verdict.pop("pid") == 1, "not in a pid namespace of its own"
    assert verdict.pop("shm") == [], "its /dev/shm is not private"
    if backing == "named":  # the pool's files are in the host's /dev/shm, out of its sight
        assert "PoolNotVisible" in verdict["error"] and "is not visible from this process" in verdict["error"], verdict
        return
    assert verdict.pop("view_mapping").startswith("r--s"), verdict  # read-only, shared: the pool itself
    assert verdict == {"local": True, "get_exact": True, "view_exact": True}, verdict
    with d.client() as host:
        assert torch.equal(host.get("from-ns"), pattern(NBYTES, 7, 253))
    assert shm_files(d.node) == [f"ecd.{d.node}.lock"]  # no pool or ring file in the host's /dev/shm


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the client as user nobody")
def test_the_fd_socket_admits_as_the_control_socket_does(daemon_factory):
    """`[control] allowed_uids`: a uid it does not name, in the socket's group, gets no descriptor
    from the fd socket either (it could map the pool without ever saying hello)."""
    d = _start_for_nobody(daemon_factory, "memfd", control="allowed_uids = [12345]")
    fds = d.endpoint[len("ipc://"):] + ".fds"
    verdict = _run_client("attack", fds, namespaces=False, uid=NOBODY)
    assert "refused this client: uid 65534" in verdict["error"] and "control.allowed_uids" in verdict["error"], verdict
    assert "kinds" not in verdict
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=5).read().decode()
    assert 'ecd_pool_fd_handouts_total{outcome="refused"} 1.0' in metrics
    assert d.log().count("fd socket: refused the pool") == 1
    d.stop()
    write_node_toml(d, runtime_dir=os.path.dirname(fds), endpoint=d.endpoint, node='group = "nogroup"',
                    control=f"allowed_uids = [{NOBODY}]")
    d.start()
    assert _run_client("attack", fds, namespaces=False, uid=NOBODY)["kinds"] == ["doorbell", "pool", "ring"]


def test_view_maps_the_daemons_memfd_read_only(daemon):
    with daemon.client() as c:
        c.put("k", pattern(1 << 20, 1, 251))
        with c.view("k") as view:
            with open("/proc/self/maps") as maps:
                line = next(x for x in maps if int(x.split("-")[0], 16) <= view.data_ptr()
                            < int(x.split(" ")[0].split("-")[1], 16))
    assert " r--s " in line and f"/memfd:ecd.{daemon.node}.0" in line, line


def test_received_pool_descriptors_cannot_be_resized_and_the_ring_cannot_be_written(daemon):
    with daemon.client() as c:
        before = pattern(NBYTES, 1, 251)
        c.put("before", before)
    # a separate process, the daemon's own uid (root here: the worst case; seals bind root too)
    verdict = _run_client("attack", daemon.socket_path + ".fds", namespaces=False, uid=None)
    assert verdict["kinds"] == ["doorbell", "pool", "ring"], verdict
    assert verdict["shrink"] == "EPERM" and verdict["grow"] == "EPERM", verdict
    assert verdict["pool_size_after"] == (64 << 20) + SLOT_AREA, verdict
    assert verdict["ring_map_rw"] == "EACCES", verdict  # the descriptor is O_RDONLY
    # re-opened read-write through /proc, it is still sealed against writes
    assert verdict["ring_reopen_rw"] in ("done", "EACCES"), verdict
    if verdict["ring_reopen_rw"] == "done":
        assert verdict["ring_reopened_map_rw"] == "EPERM" and verdict["ring_reopened_write"] == "EPERM", verdict
    assert daemon.alive()
    with daemon.client() as c:
        assert torch.equal(c.get("before"), before)
        c.put("after", pattern(NBYTES, 7, 253))
        assert torch.equal(c.get("after"), pattern(NBYTES, 7, 253))
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=5).read().decode()
    assert 'ecd_pool_fd_handouts_total{outcome="sent"} 3.0' in metrics, metrics
    assert "ecd_pool_truncations_total 0.0" in metrics


def test_fd_socket_is_found_beside_the_control_socket_as_the_client_knows_it(daemon):
    elsewhere = daemon.runtime_dir + "-mount"  # the same directory, at another path (a pod's mount)
    os.symlink(daemon.runtime_dir, elsewhere)
    try:
        with daemon.client() as c:
            c.put("k", pattern(1 << 20, 3, 7))
        from ecd import Client
        with Client(f"ipc://{elsewhere}/ecd.sock", timeout=5.0) as c:
            assert c.mapping.local and c.mapping.sealed
            assert torch.equal(c.get("k"), pattern(1 << 20, 3, 7))
    finally:
        os.unlink(elsewhere)


def test_a_missing_fd_socket_is_a_clear_error_naming_it(daemon):
    os.unlink(daemon.socket_path + ".fds")
    with pytest.raises(DaemonUnavailable) as err:
        daemon.client()
    assert daemon.socket_path + ".fds" in str(err.value), err.value
    assert "No such file" in str(err.value), err.value
    assert daemon.alive()
