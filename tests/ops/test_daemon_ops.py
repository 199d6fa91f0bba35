"""Metrics, health, sd_notify, graceful drain, signals and reload against a real `ecd serve`."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

import ecd
from conftest import holders_of_this_run, metric, shm_files, wait_for
from ecd.protocol import Alloc, AllocItem, Commit


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()




def test_metrics_follow_what_clients_do(daemon, actors):
    port = daemon.metrics_port
    assert port
    producer = actors(daemon.endpoint)
    with daemon.client() as c:
        assert producer.ask("put a 1 300000") == "ok"
        c.get("a")  # located through the ring's entry index: no request; reported before the next
        with pytest.raises(ecd.KeyNotFound):
            c.get("missing")
        with c.view("a"):  # a read slot, no request: counted as a read lease all the same
            c.ping()  # the report of the view (a local read) goes before this request
            status, body = http_get(port, "/metrics")
            assert status == 200
            assert metric(body, "ecd_leases", kind="read") == 1
        assert metric(body, "ecd_requests_total", op="acquire", outcome="ok") == 1  # "missing"
        assert metric(body, "ecd_local_reads_total") == 2
        assert metric(body, "ecd_lookups_total", result="hit") == 2
        assert metric(body, "ecd_lookups_total", result="miss") == 1
        assert metric(body, "ecd_written_bytes_total") == 1_200_000
        assert metric(body, "ecd_read_bytes_total") == 2_400_000
        assert metric(body, "ecd_entries", state="ready") == 1
        assert metric(body, "ecd_pool_capacity_bytes", pool="host0") == 64 << 20
        assert metric(body, "ecd_pool_used_bytes", pool="host0") >= 1_200_000
        assert metric(body, "ecd_clients") == 2
        assert metric(body, "ecd_request_duration_seconds_count", op="acquire") == 1
        assert metric(body, "ecd_request_duration_seconds_bucket", op="acquire", le="1.0") == 1
        assert metric(body, "ecd_build_info", version=ecd.__version__) == 1
        assert abs(metric(body, "ecd_start_time_seconds") - time.time()) < 600
        producer.kill()
        assert wait_for(lambda: metric(http_get(port, "/metrics")[1], "ecd_clients") == 1)
        c.delete("a")
        body = http_get(port, "/metrics")[1]
        assert metric(body, "ecd_evictions_total", reason="deleted") == 1


def test_healthz_and_nothing_else_on_the_port(daemon):
    port = daemon.metrics_port
    assert http_get(port, "/healthz") == (200, "ok\n")
    assert http_get(port, "/admin")[0] == 404
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", data=b"x", method="POST")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=5)
    assert info.value.code == 405
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:  # garbage is answered 400
        s.sendall(b"\x00\x01garbage\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 400")
    assert daemon.alive()


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (Debian package prometheus)")
def test_promtool_accepts_a_scrape_taken_under_load(daemon):
    stop = threading.Event()

    def load() -> None:
        with daemon.client() as c:
            i = 0
            while not stop.is_set():
                c.put(f"k{i % 50}", torch.full((20_000,), float(i)))
                c.get(f"k{i % 50}")
                c.exists([f"k{i % 50}", "nope"], pin_s=1)
                i += 1

    worker = threading.Thread(target=load)
    worker.start()
    try:
        time.sleep(0.5)
        body = http_get(daemon.metrics_port, "/metrics")[1]
    finally:
        stop.set()
        worker.join(30)
    result = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert metric(body, "ecd_submission_records_total", outcome="committed") >= 0  # load really ran
    assert metric(body, "ecd_lookups_total", result="hit") > 0


@pytest.mark.parametrize("backing", ["memfd", "named"])
def test_metrics_port_in_use_is_a_clear_startup_error(daemon_factory, backing):
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    try:
        d = daemon_factory(start=False, backing=backing)
        d.config.write_text(d.config.read_text().replace('listen = "127.0.0.1:0"',
                                                         f'listen = "127.0.0.1:{blocker.getsockname()[1]}"'))
        result = subprocess.run([os.sys.executable, "-m", "ecd", "serve", "--config", str(d.config)],
                                capture_output=True, text=True, timeout=30)
    finally:
        blocker.close()
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "metrics.listen" in result.stderr
    # refused after its pool was made, before the keeper got it: nothing of it is left anywhere
    assert shm_files(d.node) == []
    assert not [pid for pid in holders_of_this_run() if d.node.encode() in open(f"/proc/{pid}/cmdline", "rb").read()]


class NotifySocket:
    """A real unix datagram socket standing in for systemd's NOTIFY_SOCKET."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.2)
        self.messages: list[str] = []

    def collect(self, until, timeout: float = 10.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not until(self.messages):
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except socket.timeout:
                pass
        return self.messages


def test_sd_notify_ready_status_watchdog_and_stopping(daemon_factory):
    d = daemon_factory(start=False)
    notify = NotifySocket(os.path.join(d.runtime_dir, "notify.sock"))
    env = dict(os.environ, NOTIFY_SOCKET=notify.path, WATCHDOG_USEC="400000")
    started = time.monotonic()
    d.start(env=env)
    msgs = notify.collect(lambda m: any("READY=1" in x for x in m))
    ready = next(x for x in msgs if "READY=1" in x)
    assert "STATUS=" in ready and "entries" in ready
    assert os.path.exists(d.socket_path)  # READY only once the socket is bound and pools exist
    msgs = notify.collect(lambda m: sum("WATCHDOG=1" in x for x in m) >= 3, timeout=5)
    assert sum("WATCHDOG=1" in x for x in msgs) >= 3  # every 0.2 s: half of WATCHDOG_USEC
    assert time.monotonic() - started < 15
    d.proc.send_signal(signal.SIGTERM)
    msgs = notify.collect(lambda m: any("STOPPING=1" in x for x in m))
    assert any("STOPPING=1" in x for x in msgs)
    assert d.stop() == 0


def test_sigterm_drains_puts_in_progress_and_refuses_new_writes(daemon_factory):
    d = daemon_factory(extra="")
    with d.client() as writer, d.client() as other:
        # a put in progress: allocated, not yet committed
        reply = writer.request(Alloc(0, "default", [AllocItem("late", "uint8", [1000], 1000)]))
        generation = reply.results[0].generation
        d.proc.send_signal(signal.SIGTERM)
        port = d.metrics_port
        assert wait_for(lambda: http_get(port, "/healthz")[0] == 503)
        assert "draining" in http_get(port, "/healthz")[1]
        with pytest.raises(ecd.ShuttingDown):
            other.put("new", torch.ones(100_000))
        assert other.exists("late") is False
        assert d.alive()  # waiting for the put in progress
        writer.request(Commit(0, [generation]))  # it may still finish
        assert d.proc.wait(10) == 0
    assert "draining" in d.log()


def test_shutdown_grace_ends_the_drain_and_a_second_signal_cuts_it_short(daemon_factory):
    d = daemon_factory(extra="")
    d.config.write_text(d.config.read_text().replace('log_level = "debug"',
                                                     'log_level = "debug"\nshutdown_grace = "1s"'))
    d.stop()
    d.start()
    with d.client() as c:
        c.request(Alloc(0, "default", [AllocItem("stuck", "uint8", [10], 10)]))
        started = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(10) == 0
        assert 0.9 < time.monotonic() - started < 5  # waited for the grace period, then left
    d.start()
    with d.client() as c:
        c.request(Alloc(0, "default", [AllocItem("stuck", "uint8", [10], 10)]))
        d.config.write_text(d.config.read_text().replace('shutdown_grace = "1s"', 'shutdown_grace = "60s"'))
        d.proc.send_signal(signal.SIGHUP)  # grace is runtime-changeable
        assert wait_for(lambda: "applied node.shutdown_grace" in d.log())
        started = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert d.alive()
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(10) == 0
        assert time.monotonic() - started < 5
    assert "again: stopping now" in d.log()
    from conftest import shm_files
    assert shm_files(d.node) == []


def test_sighup_applies_runtime_keys_and_names_the_rest(daemon):
    text = daemon.config.read_text()
    daemon.config.write_text(text.replace('log_level = "debug"', 'log_level = "warning"')
                             .replace('size = "64MiB"', 'size = "32MiB"')
                             + '\n[limits]\nmax_batch = 7\n')
    daemon.proc.send_signal(signal.SIGHUP)
    assert wait_for(lambda: "cannot change pool.host.size" in daemon.log())
    assert "applied" in daemon.log() and "limits.max_batch=7" in daemon.log()
    with daemon.client() as c:
        with pytest.raises(ecd.LimitExceeded, match="max_batch=7"):
            c.get_many([f"k{i}" for i in range(8)])
        assert c.stats()["capacity_bytes"] == 64 << 20  # the pool did not change
    daemon.config.write_text("[node\n")  # broken: logged, nothing changes
    daemon.proc.send_signal(signal.SIGHUP)
    assert wait_for(lambda: "not reloading" in daemon.log())
    assert daemon.alive()


def test_logs_have_no_timestamps_under_journald(daemon_factory):
    d = daemon_factory(start=False)
    d.start(env=dict(os.environ, JOURNAL_STREAM="8:1234"))
    line = next(l for l in d.log().splitlines() if "serving node" in l)
    assert line.startswith("INFO ecd.daemon: serving node")


def test_a_lapped_ring_reader_is_counted(daemon_factory):
    d = daemon_factory(extra="[ring]\nslots = 64\npresence_buckets = 1024\n")
    with d.client(submit=False) as reader, d.client() as writer:
        reader.put("mine", torch.ones(100_000))  # a cached location (the put's reply): the reader follows the ring
        for i in range(100):  # more events than the ring holds
            writer.put(f"w{i}", torch.ones(10))
        assert reader.exists("mine") is True
        reader.ping()  # the overrun report went out on this connection before the ping
        body = http_get(d.metrics_port, "/metrics")[1]
        assert metric(body, "ecd_ring_reader_overruns_total") == 1
        assert metric(body, "ecd_ring_events_total") >= 101
