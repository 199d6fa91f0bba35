"""`[pool.cuda] export = "fd"` end to end without a GPU: a daemon on the fake driver
(tests/fake_cuda.py, devices that export memory as file descriptors) announces its arenas as
exported, hands each arena's descriptor out on the fd socket beside the pools' (so a client in
another pod or pid namespace can import it), a real Client keeps them for its CUDA plane, and bad
or impossible settings refuse the start with one line. On a GPU: tests/gpu/test_vmm_export.py."""
from __future__ import annotations

import os
import signal
import sys

import pytest

from conftest import REPO, shm_files
from ecd import fd_passing
from ecd.protocol import PROTOCOL_VERSION, Hello, Welcome

sys.path.insert(0, str(REPO / "tests"))
from fake_cuda import UUIDS  # noqa: E402
from test_cuda_arenas import FakeCudaDaemon, Raw  # noqa: E402

CUDA = f'[pool.cuda]\ndevices = ["{UUIDS[1]}", 0]\nsize = "4MiB"\n'
FD = {"ECD_FAKE_CUDA_FD": "1"}


def first_bytes(fd: int) -> bytes:
    return os.pread(fd, 64, 0).rstrip(b"\0")


@pytest.fixture
def fd_daemon():
    d = FakeCudaDaemon("16MiB", CUDA)
    d.start(env=FD)
    yield d
    d.cleanup()


def test_arenas_travel_as_descriptors_on_the_fd_socket(fd_daemon):
    raw = Raw(fd_daemon.endpoint)
    try:
        welcome = raw.ask(Hello(1, PROTOCOL_VERSION, os.getpid(), "test"))
        assert isinstance(welcome, Welcome), welcome
        host = len(welcome.pools)
        assert [(a.index, a.device_uuid, a.size, a.handle, a.export) for a in welcome.arenas] == [
            (host, UUIDS[1], 4 << 20, b"", "fd"), (host + 1, UUIDS[0], 4 << 20, b"", "fd")]
        assert welcome.fd_socket
    finally:
        raw.close()
    path = os.path.join(fd_daemon.runtime_dir, welcome.fd_socket)
    header, items = fd_passing.receive(path, 5.0)
    try:
        assert header.epoch == welcome.epoch
        arenas = {item.index: (item.size, fd) for item, fd in items if item.kind == "arena"}
        assert sorted(arenas) == [host, host + 1]
        # each descriptor is the daemon's allocation on that arena's device
        assert first_bytes(arenas[host][1]) == b"fake arena on device 1"
        assert first_bytes(arenas[host + 1][1]) == b"fake arena on device 0"
        assert {size for size, _ in arenas.values()} == {4 << 20}
        assert [item.kind for item, _ in items].count("pool") == host
    finally:
        for _, fd in items:
            os.close(fd)


def test_a_client_keeps_the_arena_descriptors_for_its_cuda_plane(fd_daemon):
    with fd_daemon.client() as c:
        fds = dict(c.mapping.arena_fds)
        host = len(c.welcome.pools)
        assert sorted(fds) == [host, host + 1]
        assert first_bytes(fds[host]) == b"fake arena on device 1"
        import torch
        c.put("t", torch.arange(1000))  # the host pool works as ever beside them
        assert torch.equal(c.get("t"), torch.arange(1000))
    for fd in fds.values():  # closed with the client's mapping
        with pytest.raises(OSError):
            os.fstat(fd)
    assert fd_daemon.stop(signal.SIGTERM) == 0
    log = open(fd_daemon.alloc_log).read().splitlines()
    allocs = sorted(line.split()[2] for line in log if line.startswith("alloc"))
    assert len(allocs) == 2 and allocs == sorted(line.split()[2] for line in log if line.startswith("free")), log
    assert shm_files(fd_daemon.node) == []


@pytest.mark.parametrize("extra, env, backing, expected", [
    ('export = "fd"\n', {}, "",
     'ecd: cannot start: pool.cuda.export = "fd": device(s) [1, 0] cannot export memory as a POSIX file descriptor'),
    ('export = "fd"\n', FD, "named",
     'pool.cuda.export: "fd" hands the arenas out on the fd socket, which needs [pool.host] backing = "memfd"'),
    ('export = "posix"\n', FD, "", 'pool.cuda.export: must be "auto", "fd" or "ipc", got \'posix\''),
])
def test_impossible_exports_refuse_the_start_with_one_line(extra, env, backing, expected):
    d = FakeCudaDaemon("16MiB", CUDA + extra, backing=backing)
    try:
        with pytest.raises(RuntimeError, match="exited with 2"):
            d.start(env=env)
        assert expected in d.log(), d.log()
        assert shm_files(d.node) == []
    finally:
        d.cleanup()


def test_ipc_export_still_chosen_when_asked(tmp_path):
    d = FakeCudaDaemon("16MiB", CUDA + 'export = "ipc"\n')
    try:
        d.start(env=FD)
        with d.client() as c:
            assert [a.export for a in c.welcome.arenas] == ["ipc", "ipc"]
            assert all(len(a.handle) == 64 for a in c.welcome.arenas) and c.mapping.arena_fds == {}
    finally:
        d.cleanup()


ARENA_READER = """
import json, os, sys
from ecd import Client
c = Client(sys.argv[1], timeout=10)
print(json.dumps({"pid": os.getpid(), "arenas": {str(index): os.pread(fd, 64, 0).rstrip(b"\\0").decode()
                                              for index, fd in c.mapping.arena_fds.items()}}))
c.close()
"""


def test_a_client_in_another_pid_namespace_gets_the_arenas(fd_daemon):
    """What a client in another pod sees: its own pid namespace (it is pid 1 there), the socket
    directory shared; the arena descriptors reach it as the pool's do."""
    import json
    import shutil
    import subprocess
    unshare = shutil.which("unshare")
    prefix = [unshare, "--pid", "--fork", "--mount-proc"] if unshare else []
    if not prefix or subprocess.run([*prefix, "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot make a pid namespace here (unshare --pid needs root or user namespaces)")
    out = subprocess.run([*prefix, sys.executable, "-c", ARENA_READER, fd_daemon.endpoint], capture_output=True,
                         text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["pid"] == 1  # really another pid namespace
    with fd_daemon.client() as c:
        host = len(c.welcome.pools)
    assert seen["arenas"] == {str(host): "fake arena on device 1", str(host + 1): "fake arena on device 0"}


def fake_arena_fds() -> list[str]:
    """This process's descriptors of the fake driver's arenas (memfds named fake-cuda-arena-N)."""
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass  # the listing's own descriptor
    return sorted(link for link in links if "fake-cuda-arena" in link)


def test_a_restarted_daemon_hands_new_arenas_and_the_old_descriptors_close(fd_daemon):
    with fd_daemon.client() as c:
        first = dict(c.mapping.arena_fds)
        assert len(fake_arena_fds()) == 2
        epoch = c.welcome.epoch
        assert fd_daemon.stop(signal.SIGTERM) == 0
        fd_daemon.start(env=FD)
        c.ping()  # reconnects: a new epoch, new arenas
        assert c.welcome.epoch != epoch
        assert sorted(c.mapping.arena_fds) == sorted(first)
        assert len(fake_arena_fds()) == 2  # the old run's two are closed, the new run's two kept
        assert first_bytes(c.mapping.arena_fds[len(c.welcome.pools)]) == b"fake arena on device 1"
    assert fake_arena_fds() == []


def test_a_missing_or_wrong_sized_arena_descriptor_is_refused_and_nothing_leaks():
    """What a client does with a daemon (or an impostor on its socket) whose fd batch does not
    match its Welcome: ProtocolError naming the arena, and none of the duplicates kept open."""
    from ecd.client.mapping import arena_descriptors
    from ecd.errors import ProtocolError
    from ecd.protocol import ArenaInfo
    arenas = [ArenaInfo(3, UUIDS[0], 4 << 20, b"", "fd"), ArenaInfo(4, UUIDS[1], 4 << 20, b"", "fd"),
              ArenaInfo(5, UUIDS[1], 4 << 20, bytes(64), "ipc")]
    memfds = [os.memfd_create(f"arena{i}") for i in range(2)]
    try:
        good = {("arena", 3): (4 << 20, memfds[0]), ("arena", 4): (4 << 20, memfds[1])}
        open_before = len(os.listdir("/proc/self/fd"))
        for broken, why in (({("arena", 3): good["arena", 3]}, "sent arena 4 as None bytes"),
                            ({**good, ("arena", 4): (2 << 20, memfds[1])}, "sent arena 4 as 2097152 bytes")):
            with pytest.raises(ProtocolError, match=why):
                arena_descriptors(_WelcomeArenas(arenas), broken, "/run/ecd/ecd.sock.fds")
            assert len(os.listdir("/proc/self/fd")) == open_before  # the first arena's duplicate closed
        kept = arena_descriptors(_WelcomeArenas(arenas), good, "/run/ecd/ecd.sock.fds")
        assert sorted(kept) == [3, 4] and kept[3] not in memfds  # duplicates, the ipc arena left out
        for fd in kept.values():
            os.close(fd)
    finally:
        for fd in memfds:
            os.close(fd)


class _WelcomeArenas:
    """The one field of a Welcome that arena_descriptors reads."""

    def __init__(self, arenas) -> None:
        self.arenas = arenas


@pytest.mark.parametrize("export, fd_devices, warned", [("auto", False, True), ("ipc", False, False),
                                                         ("auto", True, False)])
def test_the_log_says_how_each_arena_is_exported_and_warns_when_auto_falls_back(export, fd_devices, warned):
    d = FakeCudaDaemon("16MiB", CUDA + f'export = "{export}"\n')
    try:
        d.start(env=FD if fd_devices else {})
        chosen = "fd" if fd_devices else "ipc"
        assert d.log().count(f"bytes, export {chosen}") == 2, d.log()
        assert ("auto chose CUDA IPC handles" in d.log()) == warned
    finally:
        d.cleanup()


@pytest.mark.parametrize("env", [{}, FD], ids=["ipc", "fd"])
def test_an_arena_that_does_not_fit_is_one_line_and_frees_the_others(env):
    d = FakeCudaDaemon("16MiB", CUDA)
    try:
        with pytest.raises(RuntimeError, match="exited with 2"):
            d.start(env={**env, "ECD_FAKE_CUDA_FAIL_ALLOC_ON": "0"})  # the second device listed
        assert ("ecd: cannot start: pool.cuda.size: cannot allocate and export 4194304 bytes on each of devices "
                "[1, 0]: cuMemAlloc_v2: CUDA_ERROR_OUT_OF_MEMORY (2): out of memory") in d.log(), d.log()
        log = open(d.alloc_log).read().splitlines()
        assert [line.split()[:2] for line in log] == [["alloc", "1"], ["free", "1"]]  # the first one went back
        assert shm_files(d.node) == []
    finally:
        d.cleanup()
