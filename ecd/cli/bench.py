"""`ecd bench`: drive a running daemon with K client processes and measure what they see.

Each worker (a spawned process with its own ecd.Client) loops put and/or get over the chosen
sizes, cycling through 64 keys per size under `bench/{pid}/{size index}/{slot}`, until the run
time is over or the parent says stop. Latencies go into log-spaced histograms (2% wide), so a
long run costs no more memory than a short one. The parent waits for every worker to connect
before starting the clock, shows progress, and evicts every key its workers could have written,
whatever happened (Ctrl-C included).
"""
from __future__ import annotations

import math
import multiprocessing as mp
import os
import queue
import signal
import time
from typing import Callable

from .output import human_size
from ..errors import DaemonUnavailable, EcdError

KEYS_PER_SIZE = 64
_HIST_MIN_S = 1e-7
_HIST_LOG_BASE = math.log(1.02)
_STARTUP_GRACE_S = 60.0  # spawned workers import torch and map the pools before they are ready


class BenchError(EcdError):
    """A worker could not run (the daemon refused it, or it died)."""


def bench_key(pid: int, size_index: int, slot: int) -> str:
    return f"bench/{pid}/{size_index}/{slot}"


def _bucket(seconds: float) -> int:
    return 0 if seconds <= _HIST_MIN_S else int(math.log(seconds / _HIST_MIN_S) / _HIST_LOG_BASE)


class _Series:
    """Count, errors, exact min/max and a sparse latency histogram of one (op, size)."""

    __slots__ = ("count", "errors", "lo", "hi", "hist")

    def __init__(self) -> None:
        self.count, self.errors, self.lo, self.hi = 0, 0, math.inf, 0.0
        self.hist: dict[int, int] = {}

    def add(self, seconds: float) -> None:
        self.count += 1
        self.lo = min(self.lo, seconds)
        self.hi = max(self.hi, seconds)
        b = _bucket(seconds)
        self.hist[b] = self.hist.get(b, 0) + 1

    def merge(self, other: dict) -> None:
        self.count += other["count"]
        self.errors += other["errors"]
        self.lo = min(self.lo, other["lo"])
        self.hi = max(self.hi, other["hi"])
        for b, n in other["hist"].items():
            self.hist[b] = self.hist.get(b, 0) + n

    def as_dict(self) -> dict:
        return {"count": self.count, "errors": self.errors, "lo": self.lo, "hi": self.hi, "hist": self.hist}

    def quantile(self, q: float) -> float | None:
        if not self.count:
            return None
        rank, seen = q * self.count, 0
        for b in sorted(self.hist):
            seen += self.hist[b]
            if seen >= rank:
                # the bucket's geometric middle, kept inside what was actually measured
                return min(max(_HIST_MIN_S * math.exp((b + 0.5) * _HIST_LOG_BASE), self.lo), self.hi)
        return self.hi


def _worker(index: int, endpoint: str, timeout: float, namespace: str, sizes: list[int], op: str,
            seconds: float, messages, go, stop, counts, client_options: dict) -> None:
    """One bench client process. Reports ("ready"|"done"|"error", index, payload) on `messages`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and tells us to stop
    try:
        import torch

        from ..client.client import Client
        from ..errors import KeyNotFound

        client = Client(endpoint, namespace=namespace, timeout=timeout, name=f"ecd-bench-{index}",
                        **client_options)
        pid = os.getpid()
        tensors = [torch.ones(size, dtype=torch.uint8) for size in sizes]
        if op == "get":  # something to read: one entry per size
            for si, t in enumerate(tensors):
                client.put(bench_key(pid, si, 0), t)
        messages.put(("ready", index, pid))
        while not go.wait(0.1):
            if stop.is_set():
                return
        series = {(name, si): _Series() for name in ("put", "get") for si in range(len(sizes))}
        started = time.monotonic()
        deadline = started + seconds
        i = done = 0
        clock = time.perf_counter
        while not stop.is_set() and time.monotonic() < deadline:
            si = i % len(sizes)
            key = bench_key(pid, si, (i // len(sizes)) % KEYS_PER_SIZE)
            i += 1
            if op in ("put", "both"):
                s = series[("put", si)]
                t0 = clock()
                try:
                    client.put(key, tensors[si])
                    s.add(clock() - t0)
                except DaemonUnavailable:
                    raise
                except EcdError:
                    s.errors += 1  # e.g. PoolFull: counted, the run goes on
                    continue
                done += 1
            if op in ("get", "both"):
                key = key if op == "both" else bench_key(pid, si, 0)
                s = series[("get", si)]
                t0 = clock()
                try:
                    client.get(key)
                    s.add(clock() - t0)
                except KeyNotFound:  # evicted under pool pressure: put it back, untimed
                    s.errors += 1
                    try:
                        client.put(key, tensors[si])
                    except DaemonUnavailable:
                        raise
                    except EcdError:
                        pass
                    continue
                except DaemonUnavailable:
                    raise
                except EcdError:
                    s.errors += 1
                    continue
                done += 1
            counts[index] = done
        elapsed = time.monotonic() - started
        client.close()
        messages.put(("done", index, {"elapsed": elapsed,
                                      "series": {f"{k[0]}:{k[1]}": v.as_dict() for k, v in series.items()}}))
    except DaemonUnavailable as exc:
        messages.put(("error", index, ("unreachable", str(exc))))
    except EcdError as exc:
        messages.put(("error", index, ("daemon", f"{type(exc).__name__}: {exc}")))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, never a silent hang
        messages.put(("error", index, ("crash", f"{type(exc).__name__}: {exc}")))


def run_bench(endpoint: str, timeout: float, sizes: list[int], clients: int, seconds: float, op: str,
              namespace: str, progress: Callable | None = None, client_options: dict | None = None) -> dict:
    """Run the benchmark; returns the result document. `progress(phase, fraction, ops)` is called
    a few times a second (phase "start" while workers connect, then "run"). `client_options` go
    to every Client (e.g. the CURVE keys)."""
    from ..client.client import Client

    client_options = client_options or {}
    admin = Client(endpoint, namespace=namespace, timeout=timeout, name="ecd-bench", populate=False,
                   **client_options)
    restore = _interrupt_on_signals()
    try:
        segment = max(cap for cap, _ in admin.stats()["pools"])
        too_big = [s for s in sizes if s > segment]
        if too_big:
            raise ValueError(f"--size {human_size(too_big[0])} does not fit in the daemon's largest pool "
                             f"segment ({human_size(segment)})")
        ctx = mp.get_context("spawn")
        messages, go, stop = ctx.Queue(), ctx.Event(), ctx.Event()
        counts = ctx.Array("q", clients, lock=False)
        procs = [ctx.Process(target=_worker, daemon=True, name=f"ecd-bench-{i}",
                             args=(i, endpoint, timeout, namespace, sizes, op, seconds, messages, go, stop, counts,
                                   client_options))
                 for i in range(clients)]
        results: dict[int, dict] = {}
        interrupted = False
        try:
            for p in procs:
                p.start()
            _wait_for(messages, procs, "ready", _STARTUP_GRACE_S + timeout, results,
                      lambda: progress and progress("start", len(results) / clients, 0))
            results.clear()
            go.set()
            t0 = time.monotonic()

            def tick() -> None:
                if progress:
                    progress("run", min(1.0, (time.monotonic() - t0) / seconds), sum(counts))
            try:
                _wait_for(messages, procs, "done", seconds + 2 * timeout + 10, results, tick)
            except KeyboardInterrupt:  # stop early, but report what was measured so far
                interrupted = True
                stop.set()
                _wait_for(messages, procs, "done", 2 * timeout + 5, results, lambda: None)
        finally:
            stop.set()
            for p in procs:
                p.join(5)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
            cleanup = _cleanup(admin, [p.pid for p in procs if p.pid], len(sizes), namespace)
        return _report(endpoint, namespace, clients, seconds, op, sizes, results, cleanup, interrupted)
    finally:
        restore()
        admin.close()


def _interrupt_on_signals() -> Callable[[], None]:
    """SIGTERM (and SIGINT, even where a shell started us with it ignored) stop the run the way
    Ctrl-C does: workers stop, keys are evicted. Returns what puts the old handlers back."""
    import threading
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    old = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    return restore


def _wait_for(messages, procs, what: str, limit_s: float, results: dict, tick: Callable) -> None:
    """Collect one `what` message per worker into results; raise on a worker's error or death."""
    deadline = time.monotonic() + limit_s
    while len(results) < len(procs):
        tick()
        try:
            kind, index, payload = messages.get(timeout=0.1)
        except queue.Empty:
            dead = [p for i, p in enumerate(procs) if i not in results and p.exitcode is not None]
            if dead:
                raise BenchError(f"bench worker {dead[0].name} exited with {dead[0].exitcode}") from None
            if time.monotonic() > deadline:
                raise BenchError(f"bench workers not {what} within {limit_s:.0f}s") from None
            continue
        if kind == "error":
            why, message = payload
            if why == "unreachable":
                raise DaemonUnavailable(message)
            raise BenchError(f"bench worker {index} failed: {message}")
        if kind == what:
            results[index] = payload
    tick()


def _cleanup(admin, pids: list[int], n_sizes: int, namespace: str) -> dict:
    """Evict every key the workers could have written (forced: the workers are gone)."""
    keys = [bench_key(pid, si, slot) for pid in pids for si in range(n_sizes) for slot in range(KEYS_PER_SIZE)]
    evicted, batch = 0, max(1, admin.limits.max_batch)
    for start in range(0, len(keys), batch):
        evicted += admin.evict(keys[start:start + batch], namespace=namespace, force=True)["evicted"]
    prefixes = tuple(f"bench/{pid}/" for pid in pids)
    _, left = admin.keys(namespace=namespace, limit=1_000_000)
    return {"evicted": evicted, "left": sum(1 for e in left if e["key"].startswith(prefixes))}


def _report(endpoint, namespace, clients, seconds, op, sizes, results, cleanup, interrupted) -> dict:
    elapsed = max((r["elapsed"] for r in results.values()), default=0.0) or 1e-9
    rows, total_ops, total_bytes, total_errors = [], 0, 0, 0
    names = [n for n in ("put", "get") if op in (n, "both")]
    for name in names:
        for si, size in enumerate(sizes):
            s = _Series()
            for r in results.values():
                s.merge(r["series"][f"{name}:{si}"])
            nbytes = s.count * size
            total_ops, total_bytes, total_errors = total_ops + s.count, total_bytes + nbytes, total_errors + s.errors
            ms = [None if (v := s.quantile(q)) is None else v * 1000 for q in (0.5, 0.9, 0.99)]
            rows.append({"op": name, "size": size, "ops": s.count, "bytes": nbytes,
                         "ops_per_s": s.count / elapsed, "gb_per_s": nbytes / elapsed / 1e9,
                         "p50_ms": ms[0], "p90_ms": ms[1], "p99_ms": ms[2],
                         "max_ms": s.hi * 1000 if s.count else None, "errors": s.errors})
    return {"endpoint": endpoint, "namespace": namespace, "clients": clients, "seconds": seconds,
            "elapsed_s": elapsed, "op": op, "sizes": sizes, "results": rows,
            "total": {"ops": total_ops, "bytes": total_bytes, "ops_per_s": total_ops / elapsed,
                      "gb_per_s": total_bytes / elapsed / 1e9, "errors": total_errors},
            "cleanup": cleanup, "interrupted": interrupted}
