"""Sessions the daemon cannot watch by pid: heartbeats and session_ttl; pid namespaces; clients
on another host (pools not mapped)."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import torch
import zmq

from actor import make_tensor
from ecd import Client, InvalidRequest
from ecd.memory.host import ShmError
from ecd.protocol import PROTOCOL_VERSION, Hello, Welcome, encoder, reply_decoder
from secutil import metric, start_tcp, wait_for, write_node_toml

NUMEL = 1 << 16  # 256 KiB of float32: through the pool, not inline


def test_silent_tcp_client_is_reclaimed_heartbeating_idle_client_keeps_its_holds(daemon_factory, actors):
    d = daemon_factory(start=False)
    endpoint = start_tcp(d, leases='session_ttl = "2s"')
    holder = Client(endpoint, timeout=10.0)  # goes idle holding a view and a pin
    observer = Client(endpoint, timeout=10.0)
    try:
        assert holder.welcome.heartbeat_s == pytest.approx(2 / 3)
        holder.put("a", make_tensor(1, NUMEL))
        holder.put("b", make_tensor(2, NUMEL))
        holder.put("c", make_tensor(3, NUMEL))
        actor = actors(endpoint)
        assert actor.ask("view-hold a 1 %d" % NUMEL) == "holding"
        with holder.view("b") as view_b:
            assert holder.exists("c", pin_s=600) is True
            session = holder.session_id
            assert observer.stats()["read_leases"] == 2

            os.kill(actor.proc.pid, signal.SIGSTOP)
            try:
                reclaimed = wait_for(lambda: observer.stats()["read_leases"] == 1, timeout=60)
                assert reclaimed, observer.stats()
                assert metric(d, "ecd_leases_reclaimed_total", reason="session_ttl") >= 1
                assert "not watchable) silent" in d.log()
                # The idle holder keeps heartbeating: over several TTLs its view and pin stay.
                deadline = time.monotonic() + 6
                while time.monotonic() < deadline:
                    s = observer.stats()
                    assert (s["read_leases"], s["pins"], s["clients"]) == (1, 1, 2), s
                    time.sleep(0.2)
                assert torch.equal(view_b, make_tensor(2, NUMEL))
            finally:
                os.kill(actor.proc.pid, signal.SIGCONT)
        assert holder.session_id == session  # never had to say hello again
        assert holder.stats()["read_leases"] == 0  # its release is ordered before its next request
        # The reclaimed client notices nothing: NOT_REGISTERED, a new hello, the retried request.
        assert actor.ask("drop") == "ok"
        assert actor.ask("get a 1 %d" % NUMEL) == "ok"
        assert wait_for(lambda: observer.stats()["read_leases"] == 0)
    finally:
        holder.close()
        observer.close()


def _hello(endpoint: str, pid: int, pid_ns: int) -> tuple[zmq.Socket, Welcome]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)
    sock.send(encoder.encode(Hello(1, PROTOCOL_VERSION, pid, "raw", pid_ns)))
    assert sock.poll(20_000), "no welcome"
    welcome = reply_decoder().decode(sock.recv())
    assert isinstance(welcome, Welcome), welcome
    return sock, welcome


def test_a_local_clients_pid_comes_from_the_kernel_not_from_its_hello(daemon_factory, monkeypatch):
    """Hello.pid and Hello.pid_ns are claims; the ipc connection's SO_PEERCRED is the kernel's
    record. Naming another process keeps nothing alive, and a session ends with its connection."""
    d = daemon_factory(start=False)
    write_node_toml(d, leases='session_ttl = "60s"')
    d.start()
    own_ns = os.stat("/proc/self/ns/pid").st_ino
    sleepers = [subprocess.Popen(["sleep", "600"]) for _ in range(3)]
    socks = []
    try:
        same, w_same = _hello(d.endpoint, sleepers[0].pid, own_ns)
        foreign, w_foreign = _hello(d.endpoint, sleepers[1].pid, own_ns + 1)
        legacy, w_legacy = _hello(d.endpoint, sleepers[2].pid, 0)  # an old client: no pid_ns
        socks += [same, foreign, legacy]
        # all three are this test process to the kernel: watched, no heartbeats needed
        assert w_same.heartbeat_s == w_foreign.heartbeat_s == w_legacy.heartbeat_s == 0
        with d.client() as observer:
            assert observer.stats()["clients"] == 4
            for p in sleepers:  # the pids they named exit: nothing of theirs goes
                p.kill()
                p.wait()
            time.sleep(0.5)
            assert observer.stats()["clients"] == 4
            for sock in socks:  # their connections close (no Bye): their sessions go at once
                sock.close(0)
            assert wait_for(lambda: observer.stats()["clients"] == 1, timeout=2), observer.stats()
        assert d.log().count("hello says pid") >= 3
    finally:
        for s in socks:
            s.close(0)
        for p in sleepers:
            if p.poll() is None:
                p.kill()

    # A Client that believes it is in another pid namespace is still watched by the kernel's pid.
    import ecd.protocol
    monkeypatch.setattr(ecd.protocol, "pid_namespace", lambda: own_ns + 1)
    with d.client() as c:
        assert c.welcome.heartbeat_s == 0 and not c.heartbeating
        assert c.ping()


@pytest.mark.parametrize("why", ["no_files", "other_daemons_ring"])
def test_client_off_the_daemons_node_does_control_operations_and_refuses_bulk_ones(daemon_factory, monkeypatch, why):
    import ecd.client.client
    import ecd.client.mapping as mapping
    daemon = daemon_factory(backing="named")  # what a client sees of the pool's /dev/shm files
    # A tcp client: one over ipc:// is on this host, and refused at connect instead
    # (tests/ops/test_doctor.py)
    monkeypatch.setattr(ecd.client.client, "same_host", lambda endpoint: False)
    if why == "no_files":
        def attach(cls, name, *args, **kwargs):
            raise ShmError(f"cannot open /dev/shm/{name}: No such file or directory")
        monkeypatch.setattr(mapping.ShmFile, "attach", classmethod(attach))
        monkeypatch.setattr(mapping, "shm_path", lambda name: f"/nonexistent/{name}")
    else:  # a same-named daemon on this host: its ring carries another epoch
        class ForeignRing(mapping.RingReader):
            @property
            def epoch(self) -> int:
                return 12345
        monkeypatch.setattr(mapping, "RingReader", ForeignRing)

    small = torch.arange(64, dtype=torch.int64)
    with daemon.client() as remote:
        assert not remote.mapping.local
        assert remote.ping() > 0
        remote.put("small", small)
        remote.put_many({"s1": small, "s2": small + 1})
        assert remote.exists(["small", "s1", "nope"]) == [True, True, False]
        assert remote.keys()[0] == 3
        assert remote.stats()["entries_ready"] == 3
        for bulk in (lambda: remote.put("big", torch.zeros(1 << 20)),
                     lambda: remote.put_many({"x": small, "y": torch.zeros(1 << 20)}),
                     lambda: remote.get("small"), lambda: remote.get_many(["small"]),
                     lambda: remote.view("small").__enter__()):
            with pytest.raises(InvalidRequest, match="pools are not mapped: this client is not on the daemon's node"):
                bulk()
        assert remote.delete("s2") is True
        assert remote.evict(["s1"])["evicted"] == 1
    monkeypatch.undo()
    with daemon.client() as local:
        assert local.mapping.local
        assert torch.equal(local.get("small"), small)
        stats = local.stats()
        assert stats["read_leases"] == 0 and stats["entries_ready"] == 1 and stats["entries_writing"] == 0
