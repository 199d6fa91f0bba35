"""Neighbours that tried to take the daemon down or pin another tenant's memory (issue 11).

Each test runs the real daemon and real attacking processes (tests/security/attacker.py), and
checks while the attack runs that another client is still served (put, get and ping each within
a second), that the daemon's memory and file descriptors stay bounded, and afterwards that what
the attacker held came back."""
from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import line_within, metric, proc_memory_kib, scrape_metrics, wait_for
from ecd import Client

ATTACKER = Path(__file__).resolve().parent / "attacker.py"
MiB = 1 << 20


def rss_bytes(pid: int) -> int:
    return proc_memory_kib(pid)["VmRSS"] * 1024


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def attack(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ATTACKER), *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)



def kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


class Bystander(threading.Thread):
    """An honest client in its own thread doing put, get and ping in a loop; records the slowest."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(daemon=True)
        self.client = Client(endpoint, namespace="bystander", timeout=10.0)
        self.stop = threading.Event()
        self.rounds = 0
        self.slowest = 0.0
        self.error: BaseException | None = None

    def run(self) -> None:
        tensor = torch.arange(1 << 14, dtype=torch.float32)  # 64 KiB: through the pool
        try:
            while not self.stop.is_set():
                for op in (lambda: self.client.put("k", tensor),
                           lambda: torch.equal(self.client.get("k"), tensor) or 1 / 0,
                           self.client.ping):
                    started = time.monotonic()
                    op()
                    self.slowest = max(self.slowest, time.monotonic() - started)
                self.rounds += 1
                time.sleep(0.01)
        except BaseException as exc:  # reported by finish()
            self.error = exc

    def finish(self) -> None:
        self.stop.set()
        self.join(30)
        self.client.close()
        assert self.error is None, f"the honest client failed during the attack: {self.error!r}"
        assert self.rounds >= 5, f"the honest client got only {self.rounds} rounds done"
        assert self.slowest < 1.0, f"an honest put/get/ping took {self.slowest:.2f}s during the attack"


@pytest.fixture(autouse=True)
def many_files():
    """This test process opens many sockets; the daemon raises its own limit itself."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_client_that_never_reads_its_replies_is_disconnected_not_buffered(daemon_factory):
    """Before: 4 such clients took the daemon from 69 MB to 4.65 GB and the OOM killer."""
    d = daemon_factory(extra='[limits]\nclient_queue_bytes = "8MiB"')
    with d.client() as c:  # 1000 entries with long keys: each Keys reply is ~250 KB
        for batch in range(4):
            c.put_many({f"{'k' * 200}-{batch}-{i}": torch.zeros(4) for i in range(250)})
    before = rss_bytes(d.proc.pid)
    attackers = [attack("unread", d.endpoint, "50000") for _ in range(4)]
    bystander = Bystander(d.endpoint)
    try:
        for a in attackers:
            assert line_within(a) == "sent"
        bystander.start()
        peak = before
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            assert d.alive()
            peak = max(peak, rss_bytes(d.proc.pid))
            time.sleep(0.1)
        bystander.finish()
        def closed_for_backlog() -> float:
            return metric(scrape_metrics(d.metrics_port), "ecd_connections_closed_total", reason="client_backlog")
        wait_for(lambda: closed_for_backlog() >= 4, timeout=10)
        closed = closed_for_backlog()
        print(f"daemon RSS {before / MiB:.0f} MiB -> peak {peak / MiB:.0f} MiB; "
              f"{closed:.0f} connections closed for unread replies; bystander slowest {bystander.slowest * 1e3:.0f} ms")
        # 4 connections x 8 MiB budget, plus what the allocator keeps: nowhere near the GBs of before
        assert peak - before < 4 * 8 * MiB + 48 * MiB, (before, peak)
        # and the daemon stopped working for them: of their 200k requests it answered a few dozen
        # each before closing them (before: it answered all, as fast as its CPU allowed)
        handled = metric(scrape_metrics(d.metrics_port), "ecd_requests_total", op="keys", outcome="ok")
        assert handled < 4 * 200, handled
        assert closed >= 4, "\n".join(l for l in d.log().splitlines() if "connection" in l or "session" in l)
        assert "bytes of replies unread, limits.client_queue_bytes=8388608" in d.log()
    finally:
        kill_all(attackers)
    with d.client() as c:
        assert c.ping() > 0
        assert c.stats()["entries_ready"] == 1001


def test_many_sessions_from_one_process_are_refused_and_closed_ones_reclaimed_at_once(daemon):
    """Before: 600 sessions from one process aborted the daemon after 283 (EMFILE in libzmq), and
    sessions whose socket closed without Bye lived as long as their process."""
    with daemon.client() as observer:
        baseline_clients = observer.stats()["clients"]
        baseline_fds = open_fds(daemon.proc.pid)
        attacker = attack("sessions", daemon.endpoint, "600")
        bystander = Bystander(daemon.endpoint)
        bystander.start()
        try:
            report = line_within(attacker, timeout=120)
            assert report.startswith("welcomed=64 refused=536 silent=0"), report
            assert "limits.max_clients_per_pid=64" in report
            assert observer.stats()["clients"] == baseline_clients + 1 + 64  # + the bystander
            fds = open_fds(daemon.proc.pid)
            # 600 connections (the refused ones stay connected) + one pidfd for the process
            assert fds - baseline_fds < 600 + 16, (baseline_fds, fds)
            body = scrape_metrics(daemon.metrics_port)
            assert metric(body, "ecd_sessions_refused_total", limit="max_clients_per_pid") == 536
            attacker.stdin.write("close\n")
            attacker.stdin.flush()
            assert line_within(attacker) == "closed"
            started = time.monotonic()
            # The process lives on; its closed connections' sessions go at once.
            assert wait_for(lambda: observer.stats()["clients"] == baseline_clients + 1, timeout=5)
            print(f"daemon fds {baseline_fds} -> {fds} with 600 connections; 64 sessions reclaimed "
                  f"{time.monotonic() - started:.2f}s after their sockets closed")
            assert attacker.poll() is None
            assert wait_for(lambda: open_fds(daemon.proc.pid) < baseline_fds + 16, timeout=5)
            bystander.finish()
        finally:
            kill_all([attacker])


def test_connections_past_max_connections_are_shed_and_engines_still_connect(daemon_factory):
    d = daemon_factory(extra="[limits]\nmax_connections = 300")
    baseline_fds = open_fds(d.proc.pid)
    bystander = Bystander(d.endpoint)
    bystander.start()
    peak, sampling = [baseline_fds], threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            peak[0] = max(peak[0], open_fds(d.proc.pid))
            time.sleep(0.005)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    attacker = attack("raw-connections", d.endpoint[len("ipc://"):], "3000")
    try:
        report = line_within(attacker, timeout=120)
        assert wait_for(lambda: metric(scrape_metrics(d.metrics_port), "ecd_connections_closed_total",
                                       reason="over_capacity") >= 3000 - 300, timeout=10)
        sampling.set()
        sampler.join()
        assert d.alive()
        with Client(d.endpoint, timeout=10.0) as late:  # an engine arriving after the flood
            late.put("late", torch.ones(8))
            assert torch.equal(late.get("late"), torch.ones(8))
        body = scrape_metrics(d.metrics_port)
        shed = metric(body, "ecd_connections_closed_total", reason="over_capacity")
        print(f"{report}; daemon fds {baseline_fds} -> peak {peak[0]}; {shed:.0f} connections shed")
        assert metric(body, "ecd_connections") <= 300
        # the cap, its pidfds, and the burst libzmq accepts before the daemon's loop sheds it
        # (700 on a loaded machine): far below the 3000 an uncapped daemon holds
        assert peak[0] < baseline_fds + 2 * 300 + 1200, peak
        assert open_fds(d.proc.pid) < baseline_fds + 300 + 16
        bystander.finish()
    finally:
        kill_all([attacker])


def test_a_forged_pid_cannot_pin_another_namespaces_entries(daemon_factory):
    """Before: Hello(pid=1), lease every entry of "victim", get SIGKILLed: the leases never came
    back and the victim's puts failed with PoolFull until the daemon restarted."""
    d = daemon_factory(size="64MiB")
    victim = Client(d.endpoint, namespace="victim", timeout=10.0)
    try:
        block = torch.ones(5 * MiB // 4, dtype=torch.float32)  # 5 MiB
        keys = [f"v{i}" for i in range(12)]
        for key in keys:
            victim.put(key, block)
        attacker = attack("forged-pid", d.endpoint, "victim", *keys)
        try:
            assert line_within(attacker) == "holding"
            assert victim.stats()["read_leases"] == 12
            attacker.send_signal(signal.SIGKILL)
            attacker.wait()
            started = time.monotonic()
            assert wait_for(lambda: victim.stats()["read_leases"] == 0, timeout=1.0), victim.stats()
            print(f"12 leases of a SIGKILLed client that said pid=1 back in {time.monotonic() - started:.3f}s")
        finally:
            kill_all([attacker])
        # The victim's memory is its own again: 12 new 5 MiB puts evict the old ones.
        for key in keys:
            victim.put(key + "-new", block * 2)
        assert torch.equal(victim.get("v11-new"), block * 2)
        assert "hello says pid 1, the kernel says" in d.log()
    finally:
        victim.close()


def test_forced_eviction_revokes_leases_a_daemon_cannot_watch(daemon_factory):
    """A tcp session's lease has no process behind it the daemon can see: evict --force frees the
    bytes at once instead of waiting for its release (a watched session's lease drains)."""
    from secutil import start_tcp
    d = daemon_factory(start=False)
    endpoint = start_tcp(d)
    remote = Client(endpoint, timeout=10.0)
    try:
        remote.put("held", torch.ones(1 << 16))  # 256 KiB
        with remote.view("held"):
            assert remote.stats()["read_leases"] == 1
            assert remote.evict(["held"], force=True)["evicted"] == 1
            stats = remote.stats()
            # nothing left but what this client holds for its next put (a reservation, a put lease)
            assert (stats["read_leases"], stats["entries_retired"], stats["used_bytes"]) == \
                (0, 0, stats["reserved_bytes"] + stats["leased_bytes"]), stats
    finally:
        remote.close()


def test_key_listings_are_paged_in_bounded_replies(daemon):
    """A listing of a big index is never one huge reply: each page stays near 1 MiB and
    Client.keys follows the pages."""
    import zmq
    from ecd.protocol import PROTOCOL_VERSION, Hello, KeyList, Keys, encoder, reply_decoder
    with daemon.client(namespace="big") as c:
        names = [f"{i:05d}-" + "x" * 900 for i in range(3000)]  # ~2.8 MB of keys
        for start in range(0, len(names), 500):
            c.put_many({name: torch.zeros(1) for name in names[start:start + 500]})
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(daemon.endpoint)
        try:
            sock.send(encoder.encode(Hello(1, PROTOCOL_VERSION, 0)))
            assert sock.poll(10_000)
            sock.recv()
            sock.send(encoder.encode(Keys(2, "big", 1_000_000)))
            assert sock.poll(10_000)
            raw = sock.recv()
        finally:
            sock.close(0)
        page = reply_decoder().decode(raw)
        assert isinstance(page, KeyList) and page.more and page.total == 3000
        assert len(raw) <= (1 << 20) + 4096 and 0 < len(page.entries) < 3000, (len(raw), len(page.entries))
        total, entries = c.keys(namespace="big", limit=5000)
        assert total == 3000 and [e["key"] for e in entries] == names
        total, entries = c.keys(namespace="big", limit=1500)  # a limit across pages
        assert [e["key"] for e in entries] == names[:1500]


def test_a_routing_id_taken_over_by_another_connection_does_not_inherit_the_session(daemon):
    """ZMQ lets a DEALER choose its routing id. One that picks an engine's id gets nothing of the
    engine's session: not while the engine is connected, not after it has gone."""
    import zmq
    from ecd.protocol import (PROTOCOL_VERSION, Acquire, Error, Hello, Ping, Release, Welcome,
                              encoder, reply_decoder)
    from ecd.errors import Code
    decode = reply_decoder().decode
    ctx = zmq.Context.instance()

    def dealer() -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.setsockopt(zmq.ROUTING_ID, b"engine-7")
        sock.connect(daemon.endpoint)
        return sock

    def ask(sock: zmq.Socket, msg, timeout_ms: int = 3000):
        sock.send(encoder.encode(msg))
        return decode(sock.recv()) if sock.poll(timeout_ms) else None

    with daemon.client() as c:
        c.put("secret", torch.ones(4))
        engine = dealer()
        assert isinstance(ask(engine, Hello(1, PROTOCOL_VERSION, 0)), Welcome)
        (loc,) = ask(engine, Acquire(2, "default", ["secret"])).results
        thief = dealer()
        try:
            # While the engine is connected libzmq refuses the duplicate id: no answer, no effect.
            assert ask(thief, Release(3, [loc.generation]), timeout_ms=1000) is None
            assert c.stats()["read_leases"] == 1
            engine.close(0)  # the engine goes; its session and lease go with its connection
            assert wait_for(lambda: c.stats()["read_leases"] == 0, timeout=2)
            # Whatever libzmq makes of the thief's connection now, it is not the engine's session.
            reply = ask(thief, Release(4, [loc.generation]), timeout_ms=2000)
            assert reply is None or (isinstance(reply, Error) and reply.code == Code.NOT_REGISTERED), reply
            fresh = dealer()  # a new connection claiming the id after the engine left
            try:
                reply = ask(fresh, Ping(5), timeout_ms=5000)
                assert isinstance(reply, Error) and reply.code == Code.NOT_REGISTERED, reply
            finally:
                fresh.close(0)
        finally:
            thief.close(0)


@pytest.mark.timing  # a Bye must leave within the client's linger: neighbours' load (the chaos tests' processes) can delay it past that
def test_a_bye_just_before_close_is_a_goodbye_not_a_reclaim(daemon):
    """A connection's DISCONNECTED reaches the daemon before its last messages may have been
    read: the daemon handles those first, so a Bye sent just before close ends the session as a
    goodbye (nothing counted as reclaimed)."""
    with daemon.client() as observer:
        for _ in range(20):
            Client(daemon.endpoint).close()  # Hello ... Bye, then the socket closes at once
        # the last Bye travels on its own connection: the observer's request may overtake it
        assert wait_for(lambda: observer.stats()["clients"] == 1, timeout=10), observer.stats()
        assert observer.stats()["reclaimed_sessions"] == 0, observer.stats()
