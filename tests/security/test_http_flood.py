"""A flood of idle TCP connections to the metrics port: the daemon sheds them instead of running
out of file descriptors (at its fd limit, libzmq aborts the daemon when the next engine connects
to the control socket)."""
from __future__ import annotations

import os
import resource
import socket
import threading
import time

import pytest
import torch

from conftest import metric, scrape_metrics

FLOOD = 1600
MAX_CONNECTIONS = 64  # MetricsServer's default
# The common default soft limit; the daemon inherits it from this process.
DAEMON_NOFILE = 1024


def daemon_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.timing
def test_idle_connection_flood_is_shed_and_the_daemon_keeps_serving(daemon_factory):
    d = daemon_factory(start=False)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(DAEMON_NOFILE, hard), hard))
    try:
        d.start()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    # This process holds the flood's client ends.
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    assert hard >= FLOOD + 200, f"hard fd limit {hard} too low for the flood"
    pid = d.proc.pid

    # The daemon's fd count, sampled throughout the flood: its peak is what matters.
    peak_fds = daemon_fds(pid)
    flooding = threading.Event()

    def sample() -> None:
        nonlocal peak_fds
        while not flooding.is_set():
            try:
                peak_fds = max(peak_fds, daemon_fds(pid))
            except FileNotFoundError:  # the daemon died: the alive() check below reports it
                return
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    flood: list[socket.socket] = []
    try:
        for _ in range(FLOOD):  # non-blocking: the kernel completes them as the daemon accepts
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", d.metrics_port))
            flood.append(s)
        time.sleep(1.0)  # all held and idle

        started = time.monotonic()
        body = scrape_metrics(d.metrics_port)  # raises unless 200
        scrape_s = time.monotonic() - started
        assert scrape_s < 2.0, f"/metrics took {scrape_s:.2f}s under the flood"

        with d.client() as c:  # a new engine on the ipc control socket
            c.put("k", torch.arange(16, dtype=torch.float32))
            assert torch.equal(c.get("k"), torch.arange(16, dtype=torch.float32))
        assert d.alive(), d.log()[-2000:]
        assert metric(body, "ecd_http_connections_shed_total", reason="oldest_closed") > 0
    finally:
        flooding.set()
        sampler.join()
        for s in flood:
            s.close()
    assert peak_fds < MAX_CONNECTIONS + 100, f"daemon peaked at {peak_fds} fds under the flood"
    print(f"\ndaemon fds peak {peak_fds}, /metrics under the flood in {scrape_s * 1000:.0f} ms")

    time.sleep(0.5)
    assert d.alive(), d.log()[-2000:]
    body = scrape_metrics(d.metrics_port)
    assert metric(body, "ecd_http_connections") <= 1  # the scrape itself
    with d.client() as c:
        assert torch.equal(c.get("k"), torch.arange(16, dtype=torch.float32))
