"""ecd/cli/doctor.py's checks, one by one, on controlled inputs: a fake cgroup tree and mountinfo, rlimit
pairs, directories of chosen modes, a fake CUDA driver. (tests/ops/test_doctor.py runs `ecd doctor`
and `ecd serve` for real.)"""
from __future__ import annotations

import os
import resource
from pathlib import Path

import pytest

from ecd.cli import doctor
from ecd.config import load_config
from ecd.cli.doctor import (MemoryLimit, cgroup_memory_limit, check_cuda, check_memlock, check_memory,
                        check_open_files, check_shm, check_socket_dir)

MiB = 1 << 20


def config(**sections):
    return load_config(sections)


def fake_cgroupfs(tmp_path: Path, membership: str, mount: str, limits: dict[str, str]) -> tuple[str, str]:
    """/proc/self/cgroup and /proc/self/mountinfo files naming a cgroupfs under tmp_path, with a
    limit file written in each directory of `limits` (relative to the mount)."""
    (tmp_path / "cgroup").write_text(membership)
    (tmp_path / "mountinfo").write_text(mount.format(root=tmp_path))
    for rel, text in limits.items():
        directory, name = os.path.split(rel)
        (tmp_path / directory).mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text + "\n")
    return str(tmp_path / "cgroup"), str(tmp_path / "mountinfo")


V1_MOUNTS = ("31 23 0:28 / {root} rw,relatime - tmpfs tmpfs rw,mode=755\n"
             "35 31 0:32 / {root}/memory rw,relatime - cgroup cgroup rw,memory\n"
             "40 31 0:37 / {root}/unified rw,relatime - cgroup2 cgroup2 rw\n")
V1_CGROUP = "9:name=systemd:/\n4:memory:/kube/pod1\n1:cpu:/\n0::/\n"
V1_UNLIMITED = "9223372036854771712"


def test_v1_limit_is_the_smallest_of_the_cgroup_and_its_ancestors(tmp_path):
    files = fake_cgroupfs(tmp_path, V1_CGROUP, V1_MOUNTS, {
        "memory/memory.limit_in_bytes": V1_UNLIMITED,
        "memory/kube/memory.limit_in_bytes": str(128 * MiB),
        "memory/kube/pod1/memory.limit_in_bytes": V1_UNLIMITED})
    limit = cgroup_memory_limit(*files)
    assert limit == MemoryLimit(128 * MiB, f"{tmp_path}/memory/kube/memory.limit_in_bytes")


def test_v1_unlimited_everywhere_is_no_limit(tmp_path):
    files = fake_cgroupfs(tmp_path, V1_CGROUP, V1_MOUNTS, {
        "memory/memory.limit_in_bytes": V1_UNLIMITED, "memory/kube/pod1/memory.limit_in_bytes": V1_UNLIMITED})
    assert cgroup_memory_limit(*files) is None


def test_v2_memory_max_under_a_mount_rooted_below_the_hierarchy(tmp_path):
    # a container's view: the cgroup2 mount shows the hierarchy from /kube on
    files = fake_cgroupfs(tmp_path, "0::/kube/pod2\n",
                          "40 31 0:37 /kube {root}/cg rw,relatime - cgroup2 cgroup2 rw\n",
                          {"cg/memory.max": "max", "cg/pod2/memory.max": str(256 * MiB)})
    assert cgroup_memory_limit(*files) == MemoryLimit(256 * MiB, f"{tmp_path}/cg/pod2/memory.max")


def test_no_cgroupfs_is_no_limit(tmp_path):
    assert cgroup_memory_limit(str(tmp_path / "absent"), str(tmp_path / "absent2")) is None
    files = fake_cgroupfs(tmp_path, "0::/x\n", "31 23 0:28 / {root} rw - tmpfs tmpfs rw\n", {})
    assert cgroup_memory_limit(*files) is None


def test_pool_larger_than_the_limit_is_an_error_naming_the_limit_and_the_fix():
    cfg = config(pool={"host": {"size": "256MiB"}})
    found = check_memory(cfg, MemoryLimit(128 * MiB, "/sys/fs/cgroup/memory.max"))
    assert found.level == "error" and found.key == "pool.host.size"
    assert "the cgroup memory limit is 128MiB (/sys/fs/cgroup/memory.max)" in found.message
    assert "256MiB host pool" in found.message and "raise the limit" in found.message
    assert "shrink pool.host.size" not in found.message  # nothing of the pool would fit
    # a limit that holds the daemon but not this pool: how far to shrink it
    found = check_memory(cfg, MemoryLimit(300 * MiB, "/x"))
    assert found.level == "error"
    room = 300 * MiB - sum(n for k, n in doctor.memory_needed(cfg).items() if k != "host pool")
    assert f"shrink pool.host.size to at most {doctor.format_bytes(room - room % MiB)}" in found.message


def test_headroom_counts_the_daemon_and_the_spill_buffer(tmp_path):
    cfg = config(pool={"host": {"size": "64MiB"}})
    parts = doctor.memory_needed(cfg)
    assert parts["daemon"] == doctor.DAEMON_BASE_BYTES + 64 * MiB  # limits.max_message_bytes
    fits = sum(parts.values())
    assert check_memory(cfg, MemoryLimit(fits, "/x")).level == "ok"
    assert check_memory(cfg, MemoryLimit(fits - 1, "/x")).level == "error"
    assert check_memory(cfg, None).level == "ok"
    disk = config(pool={"host": {"size": "64MiB"}, "disk": {"path": str(tmp_path), "size": "16MiB"}})
    assert doctor.memory_needed(disk)["spill buffer"] == 256 * MiB


def test_unwritable_lock_directory_is_an_error():
    found = check_shm(config(), lock_dir="/proc")  # /proc refuses new files even to root
    assert [f.level for f in found] == ["error"]
    assert found[0].key == "/proc" and "not writable" in found[0].message


def test_named_backing_needs_room_in_dev_shm(tmp_path):
    named_small = config(node={"name": "docshm"}, pool={"host": {"size": "4MiB", "backing": "named"}})
    assert [f.level for f in check_shm(named_small, str(tmp_path), str(tmp_path))] == ["ok"]
    huge = config(pool={"host": {"size": "16TiB", "backing": "named"}})
    found = check_shm(huge, str(tmp_path), str(tmp_path))
    assert [f.level for f in found] == ["error"] and "backing = \"memfd\"" in found[0].message
    # memfd: /dev/shm holds only the lock, whatever the pool's size
    assert [f.level for f in check_shm(config(pool={"host": {"size": "16TiB"}}), str(tmp_path), str(tmp_path))] \
        == ["ok"]


CUDA = {"devices": [0], "size": "2MiB"}


def test_memlock_is_checked_only_where_the_pool_is_pinned():
    small = (64 << 10, 64 << 10)
    assert check_memlock(config(), small, ipc_lock=False) == []
    found = check_memlock(config(pool={"host": {"size": "64MiB"}, "cuda": CUDA}), small, ipc_lock=False)
    assert [f.level for f in found] == ["warning"]
    assert "64KiB (hard 64KiB) cannot pin the 64MiB host pool" in found[0].message
    assert "cuMemHostRegister" in found[0].message and "LimitMEMLOCK=infinity" in found[0].message
    nixl = config(cluster={"listen": "tcp://127.0.0.1:7480", "transport": "nixl", "insecure": True})
    assert "UCX" in check_memlock(nixl, small, ipc_lock=False)[0].message
    cuda = config(pool={"cuda": CUDA})
    assert check_memlock(cuda, small, ipc_lock=True)[0].level == "ok"
    assert check_memlock(cuda, (resource.RLIM_INFINITY,) * 2, ipc_lock=False)[0].level == "ok"


def test_open_files_reports_what_the_hard_limit_holds():
    cfg = config(limits={"max_connections": 4096, "max_clients": 1024})
    found = check_open_files(cfg, (1024, 1024))
    assert found.level == "warning" and found.key == "RLIMIT_NOFILE"
    # (1024 - 256 reserved - 64 metrics) // 2 per connection
    assert "holds 352 of limits.max_connections=4096 and fewer than limits.max_clients=1024" in found.message
    assert "nofile=8512:8512" in found.message
    assert check_open_files(cfg, (1024, 1 << 20)).level == "ok"  # the daemon raises its soft limit


def test_socket_directory_against_group_and_allowed_ids(tmp_path):
    sock_dir = tmp_path / "run"
    sock_dir.mkdir()
    euid, egid = os.geteuid(), os.getegid()
    cfg = config(node={"runtime_dir": str(sock_dir), "group": str(egid)},
                 control={"endpoint": f"ipc://{sock_dir}/ecd.sock"})
    sock_dir.chmod(0o770)
    os.chown(sock_dir, -1, egid)
    assert [f.level for f in check_socket_dir(cfg, egid)] == ["ok"]
    sock_dir.chmod(0o700)  # the group cannot pass
    found = check_socket_dir(cfg, egid)
    assert [(f.level, f.key) for f in found] == [("warning", "node.group")] and "chmod g+x" in found[0].message
    single_user = config(node={"runtime_dir": str(sock_dir)}, control={"endpoint": f"ipc://{sock_dir}/ecd.sock"})
    assert [f.level for f in check_socket_dir(single_user, egid)] == ["ok"]  # no node.group: the owner's uid
    sock_dir.chmod(0o770)
    allowed = config(node={"runtime_dir": str(sock_dir)},
                     control={"endpoint": f"ipc://{sock_dir}/ecd.sock", "allowed_uids": [euid, 54321],
                              "allowed_gids": [54322]})
    found = check_socket_dir(allowed, egid)  # the daemon (its owner) gives them a search entry at start
    assert [f.level for f in found] == ["ok"] and "by ACL entries the daemon gives them" in found[0].message
    real_grantable = doctor.acl_grantable
    doctor.acl_grantable = lambda *args: False  # not the directory's owner, or a filesystem without ACLs
    try:
        found = check_socket_dir(allowed, egid)
        assert [(f.level, f.key) for f in found] == [("warning", "control.allowed_uids"),
                                                     ("warning", "control.allowed_gids")]
        assert "uid 54321 cannot reach the socket; the daemon cannot give it an ACL entry" in found[0].message
        assert f"setfacl -m u:54321:x {sock_dir}" in found[0].message
        sock_dir.chmod(0o771)
        assert [f.level for f in check_socket_dir(allowed, egid)] == ["ok"]
    finally:
        doctor.acl_grantable = real_grantable
    sock_dir.chmod(0o777)
    assert "any user can replace the socket" in check_socket_dir(cfg, egid)[0].message
    sock_dir.chmod(0o770)
    # a daemon uid that may not create files in it (owner root, no rights for others)
    if euid == 0:
        found = check_socket_dir(cfg, egid, euid=54321)
        assert [f.level for f in found] == ["error"] and "cannot create its socket" in found[0].message


def test_what_a_uid_needs(tmp_path):
    from ecd.cli.doctor import check_uid
    listed = config(control={"endpoint": f"ipc://{tmp_path}/ecd.sock", "allowed_uids": [4242]}, node={"group": "0"})
    [found] = check_uid(listed, 0, 4242)
    assert found.level == "ok" and "no group membership needed" in found.message
    [found] = check_uid(listed, 0, 5555)
    assert found.level == "error" and "add 5555 to control.allowed_uids" in found.message
    tenanted = config(control={"endpoint": f"ipc://{tmp_path}/ecd.sock"}, node={"group": "0"},
                      tenants={"team-a": {"uids": [4242]}, "team-b": {"gids": [7001]}, "team-c": {"gids": [7002]}})
    [found] = check_uid(tenanted, 0, 4242)
    assert found.level == "ok" and "uid 4242 (tenant team-a) is admitted" in found.message
    open_node = config(control={"endpoint": f"ipc://{tmp_path}/ecd.sock"}, node={"group": "54999"})
    [found] = check_uid(open_node, 54999, 5555)  # no lists: anyone who reaches the socket, i.e. the group
    assert found.level == "warning" and "supplementalGroups: [54999]" in found.message
    assert "allowed_uids" in found.message


def test_socket_directory_missing():
    runtime = config(node={"runtime_dir": "/nonexistent-ecd"}, control={"endpoint": "ipc:///nonexistent-ecd/s"})
    assert [f.level for f in check_socket_dir(runtime, 0)] == ["ok"]  # the daemon creates it
    other = config(control={"endpoint": "ipc:///nonexistent-ecd/s"})
    found = check_socket_dir(other, 0)
    assert [f.level for f in found] == ["error"] and "does not exist" in found[0].message
    assert check_socket_dir(config(control={"endpoint": "tcp://127.0.0.1:5555"}), 0) == []


def test_cuda_with_a_fake_driver():
    from tests.fake_cuda import UUIDS, FakeDriver
    assert check_cuda(config()) == []
    found = check_cuda(config(pool={"cuda": {"devices": [UUIDS[1], 0], "size": "2MiB"}}), FakeDriver())
    assert [f.level for f in found] == ["ok", "warning"] and UUIDS[1] in found[0].message
    assert found[1].key == "pool.cuda.export" and "auto chose ipc" in found[1].message
    found = check_cuda(config(pool={"cuda": {"devices": [7], "size": "2MiB"}}), FakeDriver())
    assert [(f.level, f.key) for f in found] == [("error", "pool.cuda.devices")]
    assert found[0].message.startswith("no CUDA device 7 on this node (2 visible:")


@pytest.mark.parametrize("export, backing, fd_export, expected", [
    ("auto", "memfd", True, ("ok", "fd: arenas are handed out as file descriptors")),
    ("ipc", "memfd", True, ("ok", "ipc: clients must share the daemon's pid and IPC namespaces")),
    ("auto", "named", True, ("warning", "auto chose ipc")),
    ("fd", "memfd", False, ("error", '"fd": device(s) [0] cannot export memory as a POSIX file descriptor')),
])
def test_cuda_export_says_how_arenas_reach_clients(export, backing, fd_export, expected):
    from tests.fake_cuda import FakeDriver
    cfg = config(pool={"host": {"backing": backing}, "cuda": {"devices": [0], "size": "2MiB", "export": export}})
    level, text = expected
    found = check_cuda(cfg, FakeDriver(fd_export=fd_export))
    assert [(f.level, f.key) for f in found][1] == (level, "pool.cuda.export") and text in found[1].message


def test_cuda_driver_missing_is_the_line_serve_prints(monkeypatch):
    import ecd.memory.cuda as cuda
    monkeypatch.setattr(cuda, "_driver", None)
    monkeypatch.setattr(cuda, "LIBCUDA", "libcuda-ecd-absent.so.1")
    found = check_cuda(config(pool={"cuda": {"devices": [0], "size": "2MiB"}}))
    assert [f.line() for f in found] == [
        "pool.cuda: CUDA is not available on this node: libcuda-ecd-absent.so.1 not found"]


@pytest.mark.parametrize("backing", ["memfd", "named"])
def test_backing_key(backing):
    assert config(pool={"host": {"backing": backing}}).pool.host.backing == backing


def test_backing_key_rejects_others():
    from ecd.errors import ConfigError
    with pytest.raises(ConfigError, match="pool.host.backing: must be \"memfd\" or \"named\""):
        config(pool={"host": {"backing": "hugetlb"}})
