#!/usr/bin/env python3
"""Daemon-to-daemon fetch (the peer plane, transport "tcp") against a bare TCP socket on loopback.

Starts two daemons (owner A, puller B) joined by [cluster] on 127.0.0.1. For each size (16 MiB
and 256 MiB by default), a sample is one `Client.fetch` on B of an entry A holds (then the copy
on B is deleted, so the next sample pulls again), and beside it a reference: a separate sender
process `sendall`s the same number of bytes from a pre-faulted buffer and this process
`recv_into`s a pre-faulted buffer, on a fresh connection, as the transport does. Samples
alternate (fetch, reference, fetch, ...); each fetch is divided by the reference taken beside
it, and the median of those ratios (reference time / fetch time = fetch throughput as a share of
the bare socket's) is the figure. Goal: >= 0.8. `--checksum` stores entries with a checksum,
which the puller then verifies (xxh3-64 of every byte, on its transfer thread). `--tls` starts a
second pair with `[cluster] tls = true` (certificates from `ecd keygen --tls`) and adds a TLS
fetch to each sample: its ratio to the bare socket and to the plain fetch beside it. `--nixl`
does the same with a pair of daemons on `[cluster] transport = "nixl"` (NIXL, UCX over TCP on
lo); since UCX may use any interface it finds, the whole run then happens in a network namespace
with only `lo` (the script re-executes itself under `unshare -n`, as root, with
UCX_TLS=tcp UCX_NET_DEVICES=lo) and refuses to run otherwise.
`--breakdown` adds, beside each sample, what a fetch cannot avoid: a Fetch of a key already local
(the client's round trip to its daemon), one of a key no peer holds (that plus one round trip to
the owner's control plane, "not_found"), and the same bytes over an open socket (warm: the
transport reuses its data connections). absent + warm is the floor of a fetch that asks, then
moves the bytes, and tcp / floor the best ratio that design can reach; tcp / (local + warm) the
best of any design that still asks its own daemon (the lookup folded into the data round trip).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_daemon import BenchDaemon, write_results  # noqa: E402

GOAL = 0.8
NIXL_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}


def only_loopback() -> bool:
    return sorted(name for _, name in socket.if_nameindex()) == ["lo"]


def enter_namespace() -> None:
    """--nixl: re-run this script in a new network namespace with only lo up (never returns),
    unless already in one."""
    if only_loopback() and all(os.environ.get(k) == v for k, v in NIXL_ENV.items()):
        return
    if only_loopback():
        os.environ.update(NIXL_ENV)
        return
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        sys.exit("--nixl runs only in a network namespace with just lo: needs root, unshare and ip")
    script = 'ip link set lo up && exec "$0" "$@"'
    os.execvpe("unshare", ["unshare", "-n", "sh", "-c", script, sys.executable, os.path.abspath(__file__)]
               + sys.argv[1:], dict(os.environ, **NIXL_ENV))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sender(port_q, sizes: list[int]) -> None:
    """The reference's owner: per connection, read the size asked for, sendall that many bytes."""
    buf = np.ones(max(sizes), dtype=np.uint8)  # touched: pre-faulted
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port_q.put(listener.getsockname()[1])
    view = memoryview(buf)
    while True:
        conn, _ = listener.accept()
        head = conn.recv(8)
        n = int.from_bytes(head, "big")
        if n == 0:
            conn.close()
            return
        conn.sendall(view[:n])
        conn.close()


def _warm_sender(port_q, sizes: list[int]) -> None:
    """--breakdown's other owner: one connection, many requests (until it closes)."""
    buf = np.ones(max(sizes), dtype=np.uint8)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port_q.put(listener.getsockname()[1])
    view = memoryview(buf)
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        head = conn.recv(8, socket.MSG_WAITALL)
        if len(head) < 8:
            return
        conn.sendall(view[:int.from_bytes(head, "big")])


def reference(port: int, dest: memoryview, n: int) -> float:
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as s:
        _ask(s, dest, n)
    return time.perf_counter() - started


def warm_reference(s: socket.socket, dest: memoryview, n: int) -> float:
    """The same bytes on a connection that is already open (as the transport's pooled ones)."""
    started = time.perf_counter()
    _ask(s, dest, n)
    return time.perf_counter() - started


def _ask(s: socket.socket, dest: memoryview, n: int) -> None:
    s.sendall(n.to_bytes(8, "big"))
    got = 0
    while got < n:
        k = s.recv_into(dest[got:n])
        if not k:
            raise RuntimeError("reference sender closed early")
        got += k


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mib", default="16,256")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--checksum", action="store_true", help="entries carry a checksum the puller verifies")
    parser.add_argument("--tls", action="store_true", help="also measure a pair of daemons with [cluster] tls = true")
    parser.add_argument("--nixl", action="store_true",
                        help="also measure a pair with [cluster] transport = \"nixl\" (in a namespace with only lo)")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time a Fetch of a local key and of an absent one: the floor of a fetch")
    parser.add_argument("--json", default="", help="also write the results here ('-': stdout)")
    args = parser.parse_args()
    if args.nixl:
        enter_namespace()
    sizes = [int(s) << 20 for s in args.sizes_mib.split(",")]
    work = tempfile.mkdtemp(prefix="ecd-bench-fetch-")
    ea, eb = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    pool = f"{max(sizes) * 2 // (1 << 20) + 64}MiB"

    def cluster(listen: str, peer: str) -> str:
        # insecure: a benchmark pair on loopback, without CURVE (any local user could fetch from it)
        return (f'\n[cluster]\nlisten = "{listen}"\ndata_listen = "tcp://127.0.0.1:0"\npeers = ["{peer}"]\n'
                'insecure = true\n'
                f'\n[pool.host]\nsize = "{pool}"\n')
    os.makedirs(f"{work}/a")
    os.makedirs(f"{work}/b")
    a = BenchDaemon(f"{work}/a", "fa", pool=pool, extra=cluster(ea, eb).replace(f'[pool.host]\nsize = "{pool}"\n', ""))
    b = BenchDaemon(f"{work}/b", "fb", pool=pool, extra=cluster(eb, ea).replace(f'[pool.host]\nsize = "{pool}"\n', ""))
    c = d = None
    if args.tls:
        from ecd.transport.tls import write_tls_pair
        for name in ("c", "d"):
            write_tls_pair(work, name)
        for name, peer in (("c", "d"), ("d", "c")):
            os.makedirs(f"{work}/{name}-allowed")
            shutil.copy(f"{work}/{peer}.crt", f"{work}/{name}-allowed/")
        ec, ed = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"

        def tls(name: str) -> str:
            return (f'tls = true\ntls_cert = "{work}/{name}.crt"\ntls_key = "{work}/{name}.crt_secret"\n'
                    f'tls_allowed_certs = "{work}/{name}-allowed"\n')
        os.makedirs(f"{work}/c")
        os.makedirs(f"{work}/d")
        c = BenchDaemon(f"{work}/c", "fc", pool=pool, extra=cluster(ec, ed).replace(f'[pool.host]\nsize = "{pool}"\n', "")
                        + tls("c"))
        d = BenchDaemon(f"{work}/d", "fd", pool=pool, extra=cluster(ed, ec).replace(f'[pool.host]\nsize = "{pool}"\n', "")
                        + tls("d"))
    ne = nf = None
    if args.nixl:
        ee, ef = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        os.makedirs(f"{work}/e")
        os.makedirs(f"{work}/f")
        ne = BenchDaemon(f"{work}/e", "fe", pool=pool, extra=cluster(ee, ef).replace(f'[pool.host]\nsize = "{pool}"\n', "")
                        + 'transport = "nixl"\n')
        nf = BenchDaemon(f"{work}/f", "ff", pool=pool, extra=cluster(ef, ee).replace(f'[pool.host]\nsize = "{pool}"\n', "")
                        + 'transport = "nixl"\n')
    ctx = mp.get_context("spawn")
    port_q = ctx.Queue()
    sender = ctx.Process(target=_sender, args=(port_q, sizes), daemon=True)
    sender.start()
    port = port_q.get(timeout=30)
    dest = np.zeros(max(sizes), dtype=np.uint8)
    dest[:] = 1  # pre-fault, like the pool's pages
    results: dict = {"goal": GOAL, "checksum": args.checksum, "tls": args.tls, "nixl": args.nixl, "sizes": {}}
    try:
        ca, cb = a.connect(timeout=30), b.connect(timeout=30)
        cc, cd = (c.connect(timeout=30), d.connect(timeout=30)) if c and d else (None, None)
        ce, cf = (ne.connect(timeout=30), nf.connect(timeout=30)) if ne and nf else (None, None)
        for n in sizes:
            key = f"e{n}"
            ca.put(key, torch.randint(0, 255, (n,), dtype=torch.uint8), checksum=args.checksum)
            assert cb.fetch(key, peer=ea, timeout=60) is True  # warm-up: links, handshakes, pages
            cb.delete(key)
            tls_s: list[float] = []
            if cc is not None and cd is not None:
                cc.put(key, torch.randint(0, 255, (n,), dtype=torch.uint8), checksum=args.checksum)
                assert cd.fetch(key, peer=ec, timeout=60) is True
                cd.delete(key)
            nixl_s: list[float] = []
            if ce is not None and cf is not None:
                ce.put(key, torch.randint(0, 255, (n,), dtype=torch.uint8), checksum=args.checksum)
                assert cf.fetch(key, peer=ee, timeout=60) is True
                cf.delete(key)
            reference(port, memoryview(dest), n)
            ratios, fetch_s, ref_s = [], [], []
            local_s: list[float] = []
            absent_s: list[float] = []
            warm_s: list[float] = []
            warm = None
            if args.breakdown:
                cb.put("local", torch.zeros(16, dtype=torch.uint8))
                warm_q = ctx.Queue()
                ctx.Process(target=_warm_sender, args=(warm_q, sizes), daemon=True).start()
                warm = socket.create_connection(("127.0.0.1", warm_q.get(timeout=30)))
                warm.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                warm_reference(warm, memoryview(dest), n)
            for _ in range(args.reps):
                if warm is not None:
                    warm_s.append(warm_reference(warm, memoryview(dest), n))
                    started = time.perf_counter()
                    assert cb.fetch("local", peer=ea, timeout=60) is True
                    local_s.append(time.perf_counter() - started)
                    started = time.perf_counter()
                    assert cb.fetch("absent", peer=ea, timeout=60) is False
                    absent_s.append(time.perf_counter() - started)
                if cd is not None:
                    started = time.perf_counter()
                    assert cd.fetch(key, peer=ec, timeout=60) is True
                    tls_s.append(time.perf_counter() - started)
                    cd.delete(key)
                if cf is not None:
                    started = time.perf_counter()
                    assert cf.fetch(key, peer=ee, timeout=60) is True
                    nixl_s.append(time.perf_counter() - started)
                    cf.delete(key)
                started = time.perf_counter()
                ok = cb.fetch(key, peer=ea, timeout=60)
                f = time.perf_counter() - started
                assert ok is True
                cb.delete(key)
                r = reference(port, memoryview(dest), n)
                fetch_s.append(f)
                ref_s.append(r)
                ratios.append(r / f)
            if warm is not None:
                warm.close()  # its sender exits
            row = {"bytes": n, "fetch_ms_median": statistics.median(fetch_s) * 1e3,
                   "tcp_ms_median": statistics.median(ref_s) * 1e3,
                   "fetch_GBps_median": n / statistics.median(fetch_s) / 1e9,
                   "tcp_GBps_median": n / statistics.median(ref_s) / 1e9,
                   "ratio_median": statistics.median(ratios), "ratios": ratios}
            if tls_s:
                row["tls_ms_median"] = statistics.median(tls_s) * 1e3
                row["tls_ratio_to_tcp"] = statistics.median([r / t for r, t in zip(ref_s, tls_s)])
                row["tls_ratio_to_fetch"] = statistics.median([f / t for f, t in zip(fetch_s, tls_s)])
            if nixl_s:
                row["nixl_ms_median"] = statistics.median(nixl_s) * 1e3
                row["nixl_ratio_to_tcp"] = statistics.median([r / t for r, t in zip(ref_s, nixl_s)])
                row["nixl_ratio_to_fetch"] = statistics.median([f / t for f, t in zip(fetch_s, nixl_s)])
            if absent_s:
                row["local_fetch_ms_median"] = statistics.median(local_s) * 1e3
                row["absent_fetch_ms_median"] = statistics.median(absent_s) * 1e3
                row["warm_tcp_ms_median"] = statistics.median(warm_s) * 1e3
                floor = [a + w for a, w in zip(absent_s, warm_s)]
                row["floor_ms_median"] = statistics.median(floor) * 1e3
                row["floor_ratio_median"] = statistics.median([r / f for r, f in zip(ref_s, floor)])
                row["one_round_trip_ratio_median"] = statistics.median([r / (w + x) for r, w, x
                                                                        in zip(ref_s, warm_s, local_s)])
            results["sizes"][f"{n >> 20}MiB"] = row
            verdict = "PASS" if row["ratio_median"] >= GOAL else "MISS"
            print(f"{n >> 20:5d} MiB: fetch {row['fetch_ms_median']:8.1f} ms ({row['fetch_GBps_median']:.2f} GB/s)  "
                  f"bare tcp {row['tcp_ms_median']:8.1f} ms ({row['tcp_GBps_median']:.2f} GB/s)  "
                  f"ratio {row['ratio_median']:.2f} (goal >= {GOAL}) {verdict}")
            if absent_s:
                print(f"{'':9s}floor: local fetch {row['local_fetch_ms_median']:.2f} ms, absent (+ owner round trip) "
                      f"{row['absent_fetch_ms_median']:.2f} ms, warm tcp {row['warm_tcp_ms_median']:.2f} ms; "
                      f"absent + warm tcp {row['floor_ms_median']:.2f} ms: "
                      f"best ratio {row['floor_ratio_median']:.2f} (asking the owner inside the data round "
                      f"trip: {row['one_round_trip_ratio_median']:.2f})")
            if tls_s:
                print(f"{'':9s}tls fetch {row['tls_ms_median']:8.1f} ms ({n / statistics.median(tls_s) / 1e9:.2f} GB/s)  "
                      f"ratio to bare tcp {row['tls_ratio_to_tcp']:.2f}, to plain fetch {row['tls_ratio_to_fetch']:.2f}")
            if nixl_s:
                print(f"{'':8s}nixl fetch {row['nixl_ms_median']:8.1f} ms ({n / statistics.median(nixl_s) / 1e9:.2f} GB/s)  "
                      f"ratio to bare tcp {row['nixl_ratio_to_tcp']:.2f}, to tcp fetch {row['nixl_ratio_to_fetch']:.2f}")
        for client in (ca, cb, cc, cd, ce, cf):
            if client is not None:
                client.close()
    finally:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall((0).to_bytes(8, "big"))
        sender.join(5)
        rc = a.stop() | b.stop() | (c.stop() | d.stop() if c and d else 0) | (ne.stop() | nf.stop() if ne and nf else 0)
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        write_results(args.json, results)
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
