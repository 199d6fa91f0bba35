"""SystemdKeeper (ecd/daemon/restart/fdstore.py) against the service manager's side of systemd's
documented protocols, played by this test because no systemd runs as PID 1 here: sd_notify(3)'s
FDSTORE=1 / FDNAME= / FDSTOREREMOVE=1 datagrams with SCM_RIGHTS on $NOTIFY_SOCKET, and
sd_listen_fds(3)'s hand-back to the next run (descriptors from fd 3 on, $LISTEN_FDS,
$LISTEN_FDNAMES, $LISTEN_PID = the new process's pid, set through `sh -c 'export LISTEN_PID=$$; exec ...'`
as systemd sets it in the process it forks). A real "daemon" process stores a sealed memfd and
exits; a real new process gets it back and reads the same bytes."""
from __future__ import annotations

import array
import fcntl
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from ecd.daemon.restart.fdstore import SystemdKeeper
from ecd.daemon.restart.keeper import KeeperUnavailable
from ecd.memory.memfd import POOL_SEALS, MemfdFile

ACTOR = [sys.executable, str(Path(__file__).with_name("keeper_actor.py"))]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


class ServiceManager:
    """systemd's part: a datagram notify socket that keeps what FDSTORE=1 sends, by FDNAME, drops
    what FDSTOREREMOVE=1 names, and starts a service process with the store at fd 3 on."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self.store: list[tuple[str, int]] = []
        self.messages: list[dict[str, str]] = []

    def pump(self) -> list[dict[str, str]]:
        """Every datagram waiting, applied to the store; returns their fields."""
        got = []
        while True:
            fds = array.array("i")
            try:
                data, ancillary, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(768 * fds.itemsize),
                                                          socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
            fields = dict(line.split("=", 1) for line in data.decode().split("\n") if line)
            name = fields.get("FDNAME", "stored")
            if fields.get("FDSTORE") == "1":
                self.store.extend((name, fd) for fd in fds)
            else:
                for fd in fds:
                    os.close(fd)  # systemd closes descriptors sent without FDSTORE=1
            if fields.get("FDSTOREREMOVE") == "1":
                for gone in [fd for n, fd in self.store if n == name]:
                    os.close(gone)
                self.store = [(n, fd) for n, fd in self.store if n != name]
            got.append({**fields, "fds": str(len(fds))})
        self.messages.extend(got)
        return got

    def names(self) -> list[str]:
        return [name for name, _ in self.store]

    def start(self, *args: str, listen_pid: str = "$$", extra: list[tuple[str, int]] = ()) -> dict:
        """The next run: the store (and `extra`) at fd 3.., LISTEN_* set; its one JSON line."""
        passed = list(extra) + self.store
        env = {**ENV, "NOTIFY_SOCKET": self.address, "LISTEN_FDS": str(len(passed)),
               "LISTEN_FDNAMES": ":".join(name for name, _ in passed)}

        def place() -> None:  # in the child, before exec: each descriptor to its number, inheritable
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3 + len(passed) + 64) for _, fd in passed]
            for i, fd in enumerate(high):
                os.dup2(fd, 3 + i)
            for fd in high:
                os.close(fd)

        # close_fds=False: Popen would close fd 3.. after place(); Python's own descriptors are CLOEXEC anyway
        out = subprocess.run(["sh", "-c", f'export LISTEN_PID={listen_pid}; exec "$@"', "sh", *ACTOR, *args], env=env,
                             preexec_fn=place, close_fds=False, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def close(self) -> None:
        for _, fd in self.store:
            os.close(fd)
        self.sock.close()


@pytest.fixture
def manager(tmp_path):
    made = ServiceManager(str(tmp_path / "notify"))
    yield made
    made.close()


def test_a_stored_pool_comes_back_to_the_next_run_bit_identical(manager):
    daemon = subprocess.run(ACTOR + ["keep-systemd", "20", str(1 << 20)], capture_output=True, text=True,
                            env={**ENV, "NOTIFY_SOCKET": manager.address, "FDSTORE": "8"}, timeout=60)
    assert daemon.returncode == 0, daemon.stderr
    kept = json.loads(daemon.stdout)["kept"]  # the daemon has exited: only the store holds the memfds
    messages = manager.pump()
    assert sorted(manager.names()) == ["ecd-journal", "ecd-pool.0"]
    assert all(m["FDSTORE"] == "1" and m["FDPOLL"] == "0" and m["fds"] == "1" for m in messages), messages
    other = socket.socket()  # a socket-activation descriptor of the unit: not ours, left alone
    got = manager.start("take-systemd", extra=[("ecd.socket", other.fileno())])
    other.close()
    assert got["taken"] == kept and kept["pool.0"]["seals"] & POOL_SEALS == POOL_SEALS
    assert sorted(got["fds"].values()) == [4, 5]  # fd 3 is the socket's, the pool's follow
    assert all(got["cloexec"].values()), got["cloexec"]
    assert got["env_left"] == [] and got["again"] == {}  # sd_listen_fds(unset_environment=1), once


def test_descriptors_for_another_process_are_not_taken(manager):
    subprocess.run(ACTOR + ["keep-systemd", "21", "4096"], env={**ENV, "NOTIFY_SOCKET": manager.address},
                   check=True, capture_output=True, timeout=60)
    manager.pump()
    got = manager.start("take-systemd", listen_pid="1")  # $LISTEN_PID names someone else
    assert got["taken"] == {} and got["env_left"] == []


def test_keep_replaces_by_name_and_release_empties_the_store(tmp_path):
    manager = ServiceManager("@" + str(tmp_path / "abstract"))  # an abstract $NOTIFY_SOCKET, as systemd's own
    try:
        env = {"NOTIFY_SOCKET": manager.address, "FDSTORE": "2"}
        keeper = SystemdKeeper(env)
        assert keeper.take() == {}
        a, b, c = (MemfdFile.create_sealed(f"ecd-test-{n}", 4096) for n in "abc")
        keeper.keep({"pool.0": a.fd, "pool.1": b.fd})
        assert [(m["FDNAME"], m["fds"]) for m in manager.pump()] == [("ecd-pool.0", "1"), ("ecd-pool.1", "1")]
        keeper.keep({"pool.0": a.fd})  # pool.0 is already there: only pool.1's removal is said
        assert manager.pump() == [{"FDSTOREREMOVE": "1", "FDNAME": "ecd-pool.1", "fds": "0"}]
        keeper.keep({"pool.0": c.fd})  # another file under the name: out with the old, in with the new
        assert [(m.get("FDSTOREREMOVE"), m.get("FDSTORE")) for m in manager.pump()] == [("1", None), (None, "1")]
        assert manager.names() == ["ecd-pool.0"]
        with pytest.raises(KeeperUnavailable, match="FileDescriptorStoreMax=2 is smaller than the 3"):
            keeper.keep({"pool.0": a.fd, "pool.1": b.fd, "journal": c.fd})
        with pytest.raises(KeeperUnavailable, match="without spaces or ':'"):
            keeper.keep({"pool:0": a.fd})
        assert manager.pump() == []  # refused before anything was sent
        keeper.release()
        manager.pump()
        assert manager.store == []
        keeper.close()
        for f in (a, b, c):
            f.unlink()
    finally:
        manager.close()


def test_keeper_systemd_needs_a_notify_socket():
    with pytest.raises(KeeperUnavailable, match="NOTIFY_SOCKET"):
        SystemdKeeper({})
    with pytest.raises(KeeperUnavailable, match="cannot reach systemd's notify socket"):
        memfd = MemfdFile.create_sealed("ecd-test-nowhere", 4096)
        try:
            SystemdKeeper({"NOTIFY_SOCKET": "/nonexistent/notify"}).keep({"pool.0": memfd.fd})
        finally:
            memfd.unlink()
