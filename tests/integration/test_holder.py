"""The holder (ecd/daemon/restart/holder.py) with real processes: a real holder, "daemons" that
keep a real sealed memfd and are SIGKILLed, new ones that take it back and read the same bytes;
the hold clock, release and SIGTERM returning the memory; one holder per node; hostile peers."""
from __future__ import annotations

import array
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import pytest

from conftest import REPO, line_within, wait_for
from ecd.daemon.restart.holder_client import HolderKeeper
from ecd.daemon.restart.holder_wire import socket_path
from ecd.daemon.restart.keeper import KeeperUnavailable
from ecd.memory.memfd import POOL_SEALS, MemfdFile

ACTOR = [sys.executable, str(Path(__file__).with_name("keeper_actor.py"))]
HOLDER = [sys.executable, "-m", "ecd.daemon.restart.holder"]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
SIZE = 1 << 20
_nodes = itertools.count()


def memfd_holders(name: str) -> list[int]:
    """Pids with a descriptor of the memfd called `name` open."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        if any(link.startswith(f"/memfd:{name} ") or link == f"/memfd:{name}" for link in links):
            pids.append(int(pid))
    return pids


def gone(pid: int) -> bool:
    """Exited (a zombie whose parent died is gone too: it holds nothing)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return any(line.split()[1] == "Z" for line in status if line.startswith("State:"))
    except OSError:
        return True


class Node:
    def __init__(self, directory: str) -> None:
        self.name = f"k{os.getpid()}x{next(_nodes)}"
        self.dir = directory
        self.socket = socket_path(directory, self.name)
        self.procs: list[subprocess.Popen] = []
        self.log_path = os.path.join(directory, f"{self.name}.log")

    def holder(self, hold: float = 30.0, wait: bool = True) -> subprocess.Popen:
        proc = subprocess.Popen(HOLDER + ["--node", self.name, "--runtime-dir", self.dir, "--hold", str(hold)],
                                env=ENV, stdout=subprocess.DEVNULL, stderr=open(self.log_path, "a"))
        self.procs.append(proc)
        if wait:
            assert wait_for(lambda: self.answers() or proc.poll() is not None, 10), self.log()
            assert proc.poll() is None, self.log()
        return proc

    def answers(self) -> bool:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
            return probe.connect_ex(self.socket) == 0

    def log(self) -> str:
        return Path(self.log_path).read_text() if os.path.exists(self.log_path) else ""

    def actor(self, *args: str, env: dict | None = None) -> subprocess.Popen:
        proc = subprocess.Popen(ACTOR + list(args), env={**ENV, **(env or {})}, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(self.log_path, "a"))
        self.procs.append(proc)
        return proc

    def keep(self, seed: int, mode: str = "holder", named: str = "", env: dict | None = None) -> tuple[subprocess.Popen, dict]:
        proc = self.actor("keep-holder", self.name, self.dir, str(seed), str(SIZE), mode, *([named] if named else []),
                          env=env)
        said = json.loads(line_within(proc, 30))
        assert "kept" in said, said
        return proc, said

    def take(self, busy_wait: float = 10.0) -> tuple[subprocess.Popen, dict]:
        proc = self.actor("take-holder", self.name, self.dir, str(busy_wait))
        return proc, json.loads(line_within(proc, 30))

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.fixture
def node():
    directory = tempfile.mkdtemp(prefix="ecdk", dir="/tmp")
    os.chmod(directory, 0o755)  # the other-uid test's peer must reach the socket's file
    made = Node(directory)
    yield made
    made.cleanup()
    if made.answers():  # a holder a test's daemon spawned: let it go
        HolderKeeper(made.name, directory, spawn=False).release()
    shutil.rmtree(directory)


def finish(proc: subprocess.Popen, word: str) -> None:
    proc.stdin.write(word + "\n")
    proc.stdin.flush()
    assert json.loads(line_within(proc, 30)) == {"done": word}
    assert proc.wait(10) == 0


def test_pool_survives_a_killed_daemon_and_comes_back_bit_identical(node):
    holder = node.holder(hold=30)
    daemon, said = node.keep(seed=1)
    assert said["kept"]["pool.0"]["seals"] & POOL_SEALS == POOL_SEALS
    daemon.kill()
    daemon.wait()
    assert wait_for(lambda: "daemon gone" in node.log(), 10), node.log()
    assert holder.poll() is None
    assert memfd_holders("ecd-test-1") == [holder.pid]  # the holder alone keeps the pool now
    second, taken = node.take()
    assert taken["taken"] == said["kept"], taken  # same size, same bytes, still sealed
    assert taken["holder_pid"] == holder.pid
    second.kill()  # the new daemon dies too: the holder goes on holding
    second.wait()
    third, again = node.take()
    assert again["taken"] == said["kept"]
    finish(third, "release")
    assert holder.wait(10) == 0
    assert memfd_holders("ecd-test-1") == []
    assert "let go of 1 descriptor(s) of 1048576 bytes" in node.log()


def test_hold_expiry_returns_the_memory_and_unlinks_the_named_file(node):
    named = f"/dev/shm/ecd-test-{node.name}"
    holder = node.holder(hold=0.5)
    daemon, said = node.keep(seed=2, named=named)
    assert said["kept"]["pool.1"]["size"] == SIZE and os.path.exists(named)
    finish(daemon, "close")  # the daemon exits without a final stop: the clock starts
    assert holder.wait(10) == 0, node.log()
    assert not os.path.exists(named)
    assert memfd_holders("ecd-test-2") == []
    assert "expired: let go of 2 descriptor(s)" in node.log()
    assert not os.path.exists(node.socket)


def test_expiry_spares_a_new_file_under_the_same_name(node):
    named = f"/dev/shm/ecd-test-{node.name}"
    holder = node.holder(hold=3.0)
    daemon, _ = node.keep(seed=3, named=named)
    daemon.kill()
    daemon.wait()
    os.unlink(named)  # someone made another file of that name meanwhile: not the holder's to remove
    Path(named).write_bytes(b"someone else's")
    try:
        assert holder.wait(10) == 0
        assert Path(named).read_bytes() == b"someone else's"
        assert "unlinked 0 file(s)" in node.log()
    finally:
        os.unlink(named)


def test_a_new_daemon_cancels_the_clock(node):
    holder = node.holder(hold=1.5)
    daemon, said = node.keep(seed=4)
    second = node.actor("take-holder", node.name, node.dir, "20")  # waiting for the lease, started
    time.sleep(0.5)
    daemon.kill()  # it takes over within the hold: the clock stops while it holds the lease
    taken = json.loads(line_within(second, 30))
    time.sleep(2.5)
    assert holder.poll() is None, node.log()
    assert taken["taken"] == said["kept"]
    finish(second, "close")
    assert holder.wait(10) == 0  # its own clock ran out once it left


def test_release_and_sigterm_let_go_at_once(node):
    named = f"/dev/shm/ecd-test-{node.name}"
    holder = node.holder(hold=600)
    daemon, _ = node.keep(seed=5, named=named)
    finish(daemon, "release")
    assert holder.wait(10) == 0
    assert not os.path.exists(named) and memfd_holders("ecd-test-5") == []
    holder = node.holder(hold=600)
    daemon, _ = node.keep(seed=6, named=named)
    finish(daemon, "close")
    holder.send_signal(signal.SIGTERM)
    assert holder.wait(10) == 0
    assert not os.path.exists(named) and memfd_holders("ecd-test-6") == []
    assert "SIGTERM: let go of 2 descriptor(s)" in node.log()


def test_one_holder_per_node_and_a_stale_socket_is_replaced(node):
    os.mkdir(os.path.dirname(node.socket), 0o700)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as dead:
        dead.bind(node.socket)  # a socket file nobody listens on: a holder that was SIGKILLed
    node.holder()
    assert "replaced a stale holder socket" in node.log()
    second = node.holder(wait=False)
    assert second.wait(10) == 1
    assert f"another holder already holds node '{node.name}'" in node.log()
    for command in (["-m", "ecd", "hold"], ["-m", "ecd.daemon.restart.holder"]):
        cli = subprocess.run([sys.executable, "-X", "importtime", *command, "--node", node.name,
                              "--runtime-dir", node.dir], env=ENV, capture_output=True, text=True, timeout=60)
        assert cli.returncode == 1 and "another holder already holds" in cli.stderr, cli.stderr[-2000:]
        imported = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in cli.stderr.splitlines()
                    if line.startswith("import time:")}
        assert "msgspec" in imported and not imported & {"torch", "zmq", "numpy"}, command  # it starts fast
    assert node.answers()


def test_spawned_holder_outlives_its_daemon_and_leaves_nothing_after_release(node):
    daemon, said = node.keep(seed=7, mode="spawn", env={"TEST_HOLD": "30"})
    holder_pid = said["holder_pid"]
    assert holder_pid and not gone(holder_pid)
    daemon.kill()  # SIGKILL: the holder is in its own session, it does not go with it
    daemon.wait()
    time.sleep(0.3)
    assert not gone(holder_pid)
    second, taken = node.take()
    assert taken["taken"] == said["kept"] and taken["holder_pid"] == holder_pid
    finish(second, "release")
    assert wait_for(lambda: gone(holder_pid), 10)
    assert memfd_holders("ecd-test-7") == [] and not os.path.exists(node.socket)


def test_a_running_daemons_lease_is_not_taken_from_it(node):
    node.holder()
    daemon, said = node.keep(seed=8)
    _, refused = node.take(busy_wait=0.5)
    assert f"a daemon (pid {daemon.pid}) holds the pool" in refused.get("error", ""), refused
    waiting = node.actor("take-holder", node.name, node.dir, "20")
    time.sleep(0.5)
    daemon.kill()  # the old daemon ends: the waiting one takes over
    taken = json.loads(line_within(waiting, 30))
    assert taken.get("taken") == said["kept"], taken


def test_no_holder_answers_is_a_clear_error(node):
    keeper = HolderKeeper(node.name, node.dir, spawn=False, external_wait=0.3)
    with pytest.raises(KeeperUnavailable, match=f"no holder answers on {node.socket}.*ecd hold --node {node.name}"):
        keeper.take()
    keeper.release()  # nothing held, nothing to do


def raw(node: Node) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(node.socket)  # blocking: waits for room in the holder's backlog
    sock.settimeout(10)
    return sock


def ask(node: Node, payload: bytes | dict, fds: list[int] = (), sock: socket.socket | None = None) -> str:
    """Send one message on a new connection (or `sock`); the holder's error text ("" if none came)."""
    sock = sock or raw(node)
    data = payload if isinstance(payload, bytes) else msgspec.msgpack.encode(payload)
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    sock.sendmsg([data], ancillary)
    reply = sock.recv(1 << 16)
    return msgspec.msgpack.decode(reply).get("error", "") if reply else ""


def _recv_now(sock: socket.socket) -> bytes | None:
    try:
        return sock.recv(1 << 16, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return None


def held_links(pid: int, wanted: tuple[str, ...]) -> list[str]:
    """The targets of `pid`'s descriptors that contain any of `wanted`."""
    links = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:  # closed meanwhile
            continue
        if any(w in target for w in wanted):
            links.append(target)
    return links


def test_hostile_inputs_leave_the_holder_holding(node):
    holder = node.holder(hold=60)
    daemon, said = node.keep(seed=9)
    daemon.kill()
    daemon.wait()
    spare = MemfdFile.create_sealed("ecd-test-spare", 4096)
    r, w = os.pipe()
    sent = ("memfd:ecd-test-spare", f"pipe:[{os.fstat(r).st_ino}]")  # what hostile peers send it
    assert "malformed request" in ask(node, b"\xc1\xff garbage")
    assert "malformed request" in ask(node, {"version": 1, "op": 5})
    assert "malformed request" in ask(node, {"version": 1, "op": "keep", "names": "pool.0"})
    assert "malformed request" in ask(node, [1, "take"])
    assert "speaks holder wire version 99" in ask(node, {"version": 99, "op": "take"})
    assert "unknown op 'steal'" in ask(node, {"version": 1, "op": "steal"})
    assert "take carries no descriptors" in ask(node, {"version": 1, "op": "take"}, [spare.fd])
    assert "0 name(s) for 1 descriptor(s)" in ask(node, {"version": 1, "op": "keep"}, [spare.fd])
    assert "2 name(s) for 1 descriptor(s)" in ask(node, {"version": 1, "op": "keep", "names": ["a", "b"]}, [spare.fd])
    assert "without spaces or ':'" in ask(node, {"version": 1, "op": "keep", "names": ["a:b"]}, [spare.fd])
    assert "absolute path" in ask(node, {"version": 1, "op": "keep", "names": ["a"], "unlink": ["x"]}, [spare.fd])
    assert "not a regular file" in ask(node, {"version": 1, "op": "keep", "names": ["a"]}, [r])
    many = [spare.fd] * 201
    assert "at most 200" in ask(node, {"version": 1, "op": "keep", "names": [f"p{i}" for i in range(201)]}, many)
    # a keep left unfinished, and a peer that says nothing: both dropped after a while
    unfinished = raw(node)
    unfinished.sendmsg([msgspec.msgpack.encode({"version": 1, "op": "keep", "names": ["a"], "last": False})],
                       [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [spare.fd]).tobytes())])
    silent = raw(node)
    crowd = [raw(node) for _ in range(70)]  # more connections than the holder takes at once (64)
    for c in crowd:
        c.setblocking(False)  # a socket with a timeout waits for data even when told MSG_DONTWAIT
    refusals: list[str] = []
    waiting = list(crowd)
    deadline = time.monotonic() + 10.0  # a loaded machine: the holder accepts them in its own time
    while sum("connections open" in text for text in refusals) < 8 and time.monotonic() < deadline:
        time.sleep(0.1)
        for c in list(waiting):
            try:
                refusals.append(msgspec.msgpack.decode(c.recv(1 << 16, socket.MSG_DONTWAIT))["error"])
                waiting.remove(c)
            except BlockingIOError:
                pass  # taken in (it will be dropped for its silence), or not accepted yet
    time.sleep(0.3)  # and no more than 8
    refusals += [msgspec.msgpack.decode(data)["error"] for c in waiting
                 if (data := _recv_now(c)) is not None]
    # on a loaded machine the ones it took in may already have been dropped for their silence
    crowded = [text for text in refusals if "64 connections open" in text]
    assert len(crowded) == 8 and all("64 connections open" in text or "said nothing" in text
                                     for text in refusals), refusals
    for c in crowd:
        c.close()
    for sock in (unfinished, silent):
        assert "said nothing (or left a keep unfinished)" in msgspec.msgpack.decode(sock.recv(1 << 16))["error"]
        assert sock.recv(1 << 16) == b""  # and closed
    for sock in (unfinished, silent):
        sock.close()
    os.close(r)
    os.close(w)
    spare.unlink()
    assert holder.poll() is None, node.log()
    # Exactly the descriptors hostile peers sent, not a count: the holder's own sockets come and go
    # (the dead daemon's connection, the crowd's) as a loaded machine gets round to them.
    assert wait_for(lambda: not held_links(holder.pid, sent), 15), \
        f"the holder kept a descriptor a hostile peer sent: {held_links(holder.pid, sent)}"
    second, taken = node.take()
    assert taken["taken"] == said["kept"], taken  # still the same pool, byte for byte


@pytest.mark.skipif(os.geteuid() != 0, reason="a peer of another uid is made by dropping root's privileges: "
                                               "needs to run as root")
def test_a_peer_of_another_uid_is_refused(node):
    holder = node.holder()
    daemon, said = node.keep(seed=10)
    daemon.kill()
    daemon.wait()
    nobody = 65534
    first = node.actor("--uid", str(nobody), "raw-connect", node.dir, node.name)
    assert first.wait(90) == 0, node.log()
    blocked = json.loads(first.stdout.read())
    assert blocked == {"connect": "EACCES", "uid": nobody}  # the directory's 0700, the socket's 0600 stop it first
    os.chmod(os.path.dirname(node.socket), 0o711)  # without those layers, the holder's own check
    os.chmod(node.socket, 0o666)  # (SO_PEERCRED) refuses it
    # 90 s: a process that imports torch (ecd does) can take long to start on a loaded machine
    second = node.actor("--uid", str(nobody), "raw-connect", node.dir, node.name)
    try:
        refused = json.loads(line_within(second, 90))
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the holder's log: {node.log()}") from None
    assert refused["connect"] == "ok" and refused["fds"] == 0, refused
    assert f"uid {nobody} may not use the holder of node '{node.name}'" in refused["reply"]
    assert holder.poll() is None
    os.chmod(os.path.dirname(node.socket), 0o700)
    second, taken = node.take()
    assert taken["taken"] == said["kept"]


def test_hundreds_of_descriptors_travel_in_batches_and_a_smaller_keep_closes_the_rest(node):
    holder = node.holder()
    keeper = HolderKeeper(node.name, node.dir, spawn=False)
    assert keeper.take() == {}
    files = [MemfdFile.create_sealed(f"ecd-test-batch-{i}", 4096) for i in range(450)]  # 3 batches of <= 200
    for i, f in enumerate(files):
        f.buf[:8] = i.to_bytes(8, "little")
    baseline = len(os.listdir(f"/proc/{holder.pid}/fd"))
    keeper.keep({f"pool.{i}": f.fd for i, f in enumerate(files)})
    assert len(os.listdir(f"/proc/{holder.pid}/fd")) == baseline + 450
    keeper.close()
    inodes = {f"pool.{i}": os.fstat(f.fd).st_ino for i, f in enumerate(files)}
    for f in files:
        f.unlink()
    again = HolderKeeper(node.name, node.dir, spawn=False)
    taken = again.take()
    assert {name: os.fstat(fd).st_ino for name, fd in taken.items()} == inodes
    assert all(os.pread(fd, 8, 0) == int(name[5:]).to_bytes(8, "little") for name, fd in taken.items())
    again.keep({name: fd for name, fd in taken.items() if int(name[5:]) < 10})
    assert wait_for(lambda: len(os.listdir(f"/proc/{holder.pid}/fd")) == baseline + 10, 5)
    for fd in taken.values():
        os.close(fd)
    again.release()
    assert holder.wait(10) == 0
    assert "let go of 10 descriptor(s) of 40960 bytes" in node.log()


def test_release_from_outside_the_lease_is_refused(node):
    holder = node.holder()
    daemon, said = node.keep(seed=11)
    with pytest.raises(KeeperUnavailable, match=f"refused to release: a daemon \\(pid {daemon.pid}\\) holds the pool"):
        HolderKeeper(node.name, node.dir, spawn=False).release()
    assert holder.poll() is None
    finish(daemon, "release")
    assert holder.wait(10) == 0


FAKE_HOLDER = r"""
import json, os, socket, sys
path, uid, where = sys.argv[1], int(sys.argv[2]), sys.argv[3]
sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
if where == "in-the-daemons-directory":  # bound by root (as if it could), listening as uid
    sock.bind(path)
os.setgroups([]); os.setgid(uid); os.setuid(uid)  # before listen(): SO_PEERCRED names who listened
if where == "in-a-directory-of-its-own":  # made where the holder's directory would be
    os.mkdir(os.path.dirname(path), 0o755)
    sock.bind(path)
sock.listen(4)
print("listening", flush=True)
sock.settimeout(4)  # then it reports what it got
got = {"connections": 0, "bytes": 0, "fds": 0}
try:
    while True:
        conn, _ = sock.accept()
        got["connections"] += 1
        conn.settimeout(2)
        try:
            while True:
                data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 64)
                if not data and not fds:
                    break
                got["bytes"] += len(data); got["fds"] += len(fds)
                for fd in fds:
                    os.close(fd)
        except (TimeoutError, OSError):
            pass
except TimeoutError:
    pass
print(json.dumps(got), flush=True)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="the impostor drops from root to another uid")
@pytest.mark.parametrize("where", ["in-a-directory-of-its-own", "in-the-daemons-directory"])
def test_a_holder_socket_of_another_uid_is_never_trusted(node, where):
    """Issue 40, attack 1: a user who may create names in the runtime directory binds its own
    socket under the holder's name. The daemon's side must neither take a (forged) pool from it nor
    hand it the real one, and say why, having sent nothing. Two layers: the holder's socket lives in
    a directory only the daemon's uid owns and may write (a directory the attacker made is
    refused), and the listener's uid (SO_PEERCRED) must be the daemon's or root's (checked even
    where the directory is right). Fails before the checks: take() asked the impostor and keep()
    sent it the memfd."""
    os.chmod(node.dir, 0o777)  # the attack's premise: a runtime directory others can create names in
    if where == "in-the-daemons-directory":
        os.mkdir(os.path.dirname(node.socket), 0o700)
        reason = f"served by uid {nobody_uid()} .* no pool is taken from it or handed to it"
    else:
        reason = (f"the holder's directory is not private .*belongs to uid {nobody_uid()}.* no pool is taken from a "
                  f"socket there or handed to it")
    fake = subprocess.Popen([sys.executable, "-c", FAKE_HOLDER, node.socket, str(nobody_uid()), where], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    node.procs.append(fake)
    assert line_within(fake, 30) == "listening", fake.stderr.read()
    keeper = HolderKeeper(node.name, node.dir, spawn=False, external_wait=0.5)
    with pytest.raises(KeeperUnavailable, match=reason):
        keeper.take()
    pool = MemfdFile.create_sealed("impostor-test", SIZE, seals=POOL_SEALS)
    try:
        with pytest.raises(KeeperUnavailable, match=reason):
            keeper.keep({"pool.0": pool.fd})
    finally:
        keeper.close()
        pool.unlink()
    report = json.loads(line_within(fake, 40))
    assert report["bytes"] == 0 and report["fds"] == 0, report  # it said nothing, if it was even reached
    if where == "in-a-directory-of-its-own":  # and a holder refuses to serve from there
        holder = node.holder(wait=False)
        assert holder.wait(30) == 2
        assert "the holder's directory is not private" in node.log()


def nobody_uid() -> int:
    return 65534
