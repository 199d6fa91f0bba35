"""Issue 23, attack 2: a neighbour holds connections to an owner's data port (transport "tcp")
without ever presenting a live token, to take the transfer slots honest fetches need.

A real attacker process keeps 40 connections open to the owner's data port, reopening each one
the owner closes: each sends one byte, or a request head with a garbage first token (and never
the rest), or nothing at all. Before the fix the first two took every served connection for the
whole I/O timeout and honest fetches failed at once ("connection"); now a connection waits for
its first request's head and first token on the transport's one gate thread (bounded, with a
deadline) and takes a served slot only with a live token. The in-process checks: the same with
TLS (the TLS handshake is part of the deadline), and what the gate counts.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import pytest
import torch
from peerutil import cluster  # noqa: F401 - the fixture

from conftest import wait_for
from ecd.transport import Grant, PullItem
from ecd.transport.tcp import ITEM_HEAD, MAGIC, REQUEST_HEAD, STATUS_BAD_TOKEN, TcpTransport
from ecd.transport.tls import load_tls, write_tls_pair

HOGS = 40
KEYS = [f"honest-{i}" for i in range(5)]

# The attacker: HOGS connections, each reopened as soon as the owner closes it, until stdin closes.
HOG = r"""
import os, select, socket, struct, sys
host, port, n, how = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
def hog():
    s = socket.create_connection((host, port))
    if how == "byte":
        s.sendall(b"E")
    elif how == "garbage":  # a head that claims 16 tokens, one garbage token, then silence
        s.sendall(struct.pack("!4sI", b"ECD2", 16) + os.urandom(32))
    return s
socks = [hog() for _ in range(n)]
print("ready", flush=True)
reopened = 0
while True:
    ready, _, _ = select.select(socks + [sys.stdin], [], [], 1.0)
    if sys.stdin in ready:
        break
    for s in ready:
        try:
            s.recv(4096)
        except OSError:
            pass
        s.close()
        socks[socks.index(s)] = hog()
        reopened += 1
print("reopened", reopened, flush=True)
"""


def data_port(d) -> int:
    """The owner's data port, from its start-up line ("... (data: 127.0.0.1:PORT, transport tcp)")."""
    found = wait_for(lambda: re.search(r"\(data: [^ ]+:(\d+), transport tcp\)", d.log()), timeout=10)
    assert found, d.log()
    return int(found.group(1))


def start_hog(port: int, how: str, n: int = HOGS) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOG, "127.0.0.1", str(port), str(n), how],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def stop_hog(proc: subprocess.Popen) -> str:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.close()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return proc.stdout.read().strip()


@pytest.mark.parametrize("how", ["byte", "garbage", "nothing"])
def test_hogged_data_port_still_serves_honest_fetches(cluster, how):
    a, b = cluster(2)  # request_timeout = 2 s: the owner's I/O timeout
    data = {key: torch.full((1 << 18,), i, dtype=torch.float32) for i, key in enumerate(KEYS)}  # 1 MiB
    with a.client() as ca:
        for key, t in data.items():
            ca.put(key, t)
    hog = start_hog(data_port(a), how)
    try:
        time.sleep(0.3)  # every hog connection is in: accepted, its byte read
        fetched = 0
        with b.client() as cb:
            for key in KEYS:
                started = time.monotonic()
                ok = cb.fetch(key, peer=a.peer_endpoint, timeout=4)
                assert time.monotonic() - started < 4 + 2
                if ok:
                    assert torch.equal(cb.get(key), data[key])
                    fetched += 1
                time.sleep(0.5)  # spread over the gate's deadline (1 s): the hogs come and go meanwhile
            failures = cb.stats()["fetch_failures"]
        print(f"[{how}] honest fetches: {fetched} of {len(KEYS)} while {HOGS} hog connections were held; "
              f"puller's failures: {failures}")
        assert hog.poll() is None, "the attacker was cut off altogether"
    finally:
        print(f"[{how}] attacker: {stop_hog(hog)}")
    assert fetched == len(KEYS), failures
    expected = "serve_refused" if how == "garbage" else "serve_handshake_timeout"
    with a.client() as ca:  # the owner counted what it turned away, and keeps serving
        assert wait_for(lambda: ca.stats()["fetch_failures"].get(expected, 0) >= HOGS, timeout=5), \
            ca.stats()["fetch_failures"]
        print(f"[{how}] owner's failure counts: {ca.stats()['fetch_failures']}")
        ca.put("after", torch.ones(4))
    assert a.alive() and b.alive()


class DirectLoop:
    """Stands in for the event loop: callbacks run at once, on the transport's thread."""

    def __init__(self) -> None:
        self.reports: list[tuple[int, int, str | None]] = []

    def call_soon_threadsafe(self, fn, *args) -> None:
        fn(*args)

    def on_sent(self, grants, sent, failure) -> None:
        self.reports.append((len(grants), sent, failure))


def _tls_pair(tmp_path):
    for name in ("a", "b"):
        write_tls_pair(str(tmp_path), name)
    for me, peer in (("a", "b"), ("b", "a")):
        (tmp_path / f"{me}-allowed").mkdir()
        (tmp_path / f"{me}-allowed" / f"{peer}.crt").write_text((tmp_path / f"{peer}.crt").read_text())
    return [load_tls(str(tmp_path / f"{n}.crt"), str(tmp_path / f"{n}.crt_secret"), str(tmp_path / f"{n}-allowed"))
            for n in ("a", "b")]


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_gate_admits_only_live_tokens_in_process(tmp_path, tls):
    """max_inflight = 1: four served slots, 40 hogs of each kind, and honest pulls on fresh
    connections all go through; the gate counts what it turned away."""
    owner_tls, puller_tls = _tls_pair(tmp_path) if tls else (None, None)
    segment = bytearray(os.urandom(1 << 20))
    loop = DirectLoop()
    owner = TcpTransport("127.0.0.1", 0, max_inflight=1, io_timeout=3.0, loop=loop, tls=owner_tls)
    port = owner.serve(lambda pool: segment, loop.on_sent)[1]
    hogs: list[socket.socket] = []
    try:
        for i in range(HOGS):
            s = socket.create_connection(("127.0.0.1", port))
            if i % 3 == 0:
                s.sendall(b"E")
            elif i % 3 == 1:
                s.sendall(REQUEST_HEAD.pack(MAGIC, 16) + os.urandom(32))
            hogs.append(s)
        time.sleep(0.2)
        for _ in range(5):
            puller = TcpTransport("127.0.0.1", 0, io_timeout=3.0, tls=puller_tls)  # a fresh connection each
            try:
                token = os.urandom(32)
                owner.grants.add(Grant(token, 0, 0, len(segment)))
                dest = bytearray(len(segment))
                puller.pull("127.0.0.1", port, [PullItem(token, dest, 0, len(dest))], time.monotonic() + 3)
                assert dest == segment
            finally:
                puller.close()
        if not tls:  # a garbage first token is answered "refused" (status 1) at once, then closed
            with socket.create_connection(("127.0.0.1", port), timeout=3) as s:
                s.sendall(REQUEST_HEAD.pack(MAGIC, 1) + os.urandom(32))
                assert ITEM_HEAD.unpack(s.recv(ITEM_HEAD.size, socket.MSG_WAITALL)) == (STATUS_BAD_TOKEN, 0)
                assert s.recv(1) == b""
        # the silent and one-byte hogs are closed when the handshake deadline passes
        assert wait_for(lambda: owner.refusals.get("handshake_timeout", 0) >= 2 * HOGS // 3, timeout=5), owner.refusals
        assert owner.serving_threads <= owner.max_conns
    finally:
        for s in hogs:
            s.close()
        owner.close()
    counted = [r for r in loop.reports if r[0] == 0]
    assert counted and all(r[2] in ("handshake_timeout", "refused", "shed", "busy", "protocol") for r in counted)
    assert sum(owner.refusals.values()) == len(counted)


def test_handshaking_connections_are_bounded(tmp_path):
    """Past max_handshaking the oldest unauthenticated connection is closed for the new one."""
    loop = DirectLoop()
    owner = TcpTransport("127.0.0.1", 0, max_inflight=1, io_timeout=3.0, loop=loop)
    owner.max_handshaking = 8
    port = owner.serve(lambda pool: bytearray(10), loop.on_sent)[1]
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
    try:
        assert wait_for(lambda: owner.refusals.get("shed", 0) == 12, timeout=5), owner.refusals
        socks[0].settimeout(3)
        assert socks[0].recv(1) == b""  # the oldest went first
    finally:
        for s in socks:
            s.close()
        owner.close()
    assert loop.reports.count((0, 0, "shed")) == 12  # each one counted through on_sent, as serve_shed
