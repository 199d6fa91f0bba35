#!/usr/bin/env python3
"""What a hostile neighbour costs everyone else (issue 11): each attack runs for --seconds against
one daemon while an honest client pings that daemon and a twin daemon nobody attacks, turn
about. Each attacked ping is divided by the unattacked ping taken right beside it, on the same
CPUs, so the machine's own noise cancels; the median and p99 of those ratios are the cost of the
attack to others. Also: the attacked daemon's RSS and open fds (start -> peak), and what it shed.

  unread    4 processes each send 50k Keys(limit=1000) over 1000 long keys, never reading
  sessions  one process opens 600 sessions (64 are allowed per process)
  raw       6000 plain connections to the ipc socket that never speak ZMTP (the cap is 4096)
  http      1600 idle TCP connections to the metrics port

The attack processes are tests/security/attacker.py (the same the tests use).

  python benchmarks/neighbours.py [--seconds 10] [--attacks unread,sessions,raw,http] [--json PATH]
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch

from bench_daemon import BenchDaemon, proc_memory_kib, write_results

ATTACKER = Path(__file__).resolve().parent.parent / "tests" / "security" / "attacker.py"
MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss(pid: int) -> int:
    return proc_memory_kib(pid)["VmRSS"] * 1024


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def metrics(port: int) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in body.splitlines():
        if line.startswith(("ecd_connections_closed_total", "ecd_sessions_refused_total",
                            "ecd_http_connections_shed_total")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def start_attack(kind: str, daemon: BenchDaemon, port: int) -> list[subprocess.Popen]:
    def run(*args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(ATTACKER), *args], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL)
    if kind == "unread":
        return [run("unread", daemon.endpoint, "50000") for _ in range(4)]
    if kind == "sessions":
        return [run("sessions", daemon.endpoint, "600")]
    if kind == "raw":
        return [run("raw-connections", daemon.endpoint[len("ipc://"):], "6000")]
    if kind == "http":
        code = (f"import socket, time, resource; h = resource.getrlimit(resource.RLIMIT_NOFILE)[1]; "
                f"resource.setrlimit(resource.RLIMIT_NOFILE, (h, h)); held = []\n"
                f"for _ in range(1600):\n    s = socket.create_connection(('127.0.0.1', {port})); held.append(s)\n"
                f"time.sleep(3600)")
        return [subprocess.Popen([sys.executable, "-c", code])]
    raise SystemExit(f"unknown attack {kind}")


def measure(kind: str, seconds: float, attacked: BenchDaemon, port: int, calm: BenchDaemon) -> dict:
    honest_a, honest_c = attacked.connect(name="honest"), calm.connect(name="honest")
    if kind == "unread":
        with attacked.connect(name="filler") as c:  # Keys replies of ~250 KB
            for batch in range(4):
                c.put_many({f"{'k' * 200}-{batch}-{i}": torch.zeros(4) for i in range(250)})
    pid = attacked.proc.pid
    rss0, fds0 = rss(pid), fds(pid)
    peak = {"rss": rss0, "fds": fds0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak["rss"], peak["fds"] = max(peak["rss"], rss(pid)), max(peak["fds"], fds(pid))
            time.sleep(0.01)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    procs = start_attack(kind, attacked, port)
    ratios, worst = [], 0.0
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            honest_a.ping()
            t1 = time.perf_counter()
            honest_c.ping()
            t2 = time.perf_counter()
            ratios.append((t1 - t0) / (t2 - t1))
            worst = max(worst, t1 - t0)
            time.sleep(0.002)
    finally:
        stop.set()
        sampler.join()
        alive = attacked.proc.poll() is None
        shed = metrics(port) if alive else {}
        for p in procs:
            p.kill()
            p.wait()
        honest_a.close()
        honest_c.close()
    ratios.sort()
    return {"attack": kind, "alive": alive, "pings": len(ratios),
            "ratio_p50": statistics.median(ratios), "ratio_p99": ratios[int(0.99 * (len(ratios) - 1))],
            "slowest_ping_ms": worst * 1e3, "rss_start_mib": rss0 / MiB, "rss_peak_mib": peak["rss"] / MiB,
            "fds_start": fds0, "fds_peak": peak["fds"], "shed": {k: v for k, v in shed.items() if v}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each attack")
    ap.add_argument("--attacks", default="unread,sessions,raw,http")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    results = []
    for kind in args.attacks.split(","):
        work = tempfile.mkdtemp(prefix="ecd-nb-", dir="/tmp")
        port = free_port()
        os.makedirs(f"{work}/a")
        os.makedirs(f"{work}/c")
        attacked = BenchDaemon(f"{work}/a", "nba", pool="256MiB", metrics=f"127.0.0.1:{port}")
        calm = BenchDaemon(f"{work}/c", "nbc", pool="256MiB", metrics="")
        try:
            attacked.connect(name="probe").close()
            calm.connect(name="probe").close()
            r = measure(kind, args.seconds, attacked, port, calm)
        finally:
            attacked.stop()
            calm.stop()
            shutil.rmtree(work, ignore_errors=True)
        results.append(r)
        print(f"{kind:9s} alive={r['alive']} pings={r['pings']} attacked/calm ping p50 {r['ratio_p50']:.2f}x "
              f"p99 {r['ratio_p99']:.2f}x slowest {r['slowest_ping_ms']:.0f} ms | RSS {r['rss_start_mib']:.0f} -> "
              f"{r['rss_peak_mib']:.0f} MiB | fds {r['fds_start']} -> {r['fds_peak']} | shed {r['shed']}", flush=True)
    if args.json:
        write_results(args.json, {"seconds": args.seconds, "results": results})
    if not all(r["alive"] for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
