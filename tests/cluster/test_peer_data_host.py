"""A peer must not steer the puller's daemon into connecting elsewhere: the data host a welcome
announces must be the host the puller dialled for control (or "", meaning that host)."""
from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from peerutil import cluster_toml, free_port

from conftest import REPO

FAKE_PEER = Path(__file__).resolve().parent / "fake_peer.py"


class Listener:
    """A TCP port that counts the connections it is dialled with (and closes each at once)."""

    def __init__(self, host: str) -> None:
        self.sock = socket.create_server((host, 0))
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def fake_peer():
    procs: list[subprocess.Popen] = []

    def start(data_host: str, data_port: int) -> str:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        proc = subprocess.Popen([sys.executable, str(FAKE_PEER), endpoint, data_host, str(data_port)],
                                stdout=subprocess.PIPE, text=True, cwd=REPO)
        procs.append(proc)
        assert proc.stdout.readline().strip() == "ready"
        return endpoint

    yield start
    for proc in procs:
        proc.kill()
        proc.wait(10)


def test_a_welcome_naming_another_data_host_is_refused(daemon_factory, fake_peer):
    elsewhere = Listener("127.0.0.2")  # where the hostile peer tries to send the puller
    honest = Listener("127.0.0.1")  # the host the puller dials: announcing it (as older daemons do) is fine
    try:
        hostile = fake_peer("127.0.0.2", elsewhere.port)
        plain = fake_peer("127.0.0.1", honest.port)
        puller = daemon_factory(size="64MiB", extra=cluster_toml(f"tcp://127.0.0.1:{free_port()}", []))
        with puller.client() as c:
            refused = c.fetch_detailed(["k1", "k2"], peer=hostile, timeout=5)
            assert [(o.local, o.reason) for o in refused] == [(False, "data_host")] * 2, refused
            # the fake peer at the dialled host is dialled (the test would see a connection)...
            tried = c.fetch_detailed("k1", peer=plain, timeout=5)
            assert not tried and tried.reason in ("connection", "timeout"), tried
            assert honest.connections >= 1
            # ...the one that named another host never is, however often it is asked
            assert c.fetch_detailed("k3", peer=hostile, timeout=5).reason == "data_host"
            time.sleep(1.0)  # a connection attempt in flight would have arrived by now
            assert elsewhere.connections == 0
            peers = {p["endpoint"]: p for p in c.stats()["peers"]}
            assert peers[hostile]["state"] == "refused", peers
            assert c.stats()["fetch_failures"].get("data_host", 0) >= 2
            c.put("still", torch.ones(2))  # the daemon serves on
        log = puller.log()
        assert f"peer {hostile} announced its data port at host '127.0.0.2'" in log, log
        assert log.count("announced its data port") == 1  # once, not per ping or fetch
    finally:
        elsewhere.close()
        honest.close()
