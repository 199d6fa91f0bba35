"""SGLang HiCache L3 backends side by side: ecd's EcdHiCacheStorage against SGLang 0.5.23's own
`file` backend (HiCacheFile, on /dev/shm and on a disk directory) and `shm` backend (HiCacheShm).

Each backend is made by SGLang's StorageBackendFactory and driven the way SGLang's cache controller
drives it, against a real SGLang host KV pool (MHATokenToKVPoolHost, page_first, over a real
MHATokenToKVPool on "cpu"; tests/sglang/sglang_env.py builds both):
  backup:   ecd (extra_config interface_v1: 1) batch_set_v1(keys, host_indices);
            file/shm (the controller's generic path) batch_set(keys, [pool.get_data_page(i)])
  exists:   batch_exists(keys) (the prefetch's first step)
  prefetch: ecd batch_get_v1(keys, host_indices); file/shm batch_get(keys, dummy flat pages) then
            pool.set_from_flat_data_page for each page found (as _generic_page_get does)
Every timed operation is PAIRED: a memcpy of the same bytes (the pages' bytes, host pool to host
pool) is timed right before it, and the figure is the operation's time over that memcpy's; the
backends alternate inside each repetition, in rotating order. Medians over the repetitions.
Loaded bytes are checked against the pages stored (a wrong byte fails the run).

Then the cross-process hit rate: this process backs up pages through one backend instance; a
second process ("another SGLang server on the node": its own host pool, its own backend made by
the factory from the same config) asks batch_exists for them and loads them, checking the bytes.

    make bench-sglang                       # ~3-6 min on 2 vCPUs
    .venv-sglang/bin/python benchmarks/bench_sglang.py --reps 60 --batch-reps 9 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "sglang"))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from bench_daemon import BenchDaemon, write_results  # noqa: E402

# page geometries: tokens per page, layers, kv heads, head dim (bf16, K and V)
GEOMETRIES = {
    "small": dict(page_size=64, layers=2, heads=8, head_dim=64),   # 256 KiB a page
    "large": dict(page_size=64, layers=8, heads=8, head_dim=64),   # 1 MiB a page
}
BATCH = 128  # SGLang's STORAGE_BATCH_SIZE is 128 pages
BACKENDS = ("ecd", "file-shm", "file-disk", "shm")


def page_bytes(g: dict) -> int:
    return 2 * g["page_size"] * g["layers"] * g["heads"] * g["head_dim"] * 2


def host_pool(g: dict, pages: int):
    import sglang_env
    from sglang_env import mha_host_pool
    # the pools are built inside SGLang's own host_memory_budget_scope (see sglang_env): room for the
    # large pages' pool (258 MiB) and its device pool
    sglang_env.POOL_BUDGET_BYTES = max(sglang_env.POOL_BUDGET_BYTES, 2 * pages * page_bytes(g))
    # the host pool is hicache_ratio (2.0) times the device pool: device tokens = half the pages wanted
    return mha_host_pool("page_first", tokens=pages * g["page_size"] // 2, page_size=g["page_size"],
                         dtype=torch.bfloat16, heads=g["heads"], head_dim=g["head_dim"], layers=g["layers"])


def make(name: str, pool, endpoint: str, dirs: dict):
    """A backend as SGLang's cache controller makes it (factory, then register_mem_pool_host)."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang_env import USER_CONFIG, storage_config
    if name == "ecd":
        backend = StorageBackendFactory.create_backend(
            "dynamic", storage_config({**USER_CONFIG, "endpoint": endpoint}), pool)
    elif name.startswith("file"):
        backend = StorageBackendFactory.create_backend(
            "file", storage_config({"file_storage_path": dirs[name]}), pool)
    else:
        backend = StorageBackendFactory.create_backend("shm", storage_config({}), pool)
    backend.register_mem_pool_host(pool)
    return backend


class Driver:
    """The cache controller's calls for one backend (zero-copy v1 for ecd, generic for the others)."""

    def __init__(self, name: str, backend, pool) -> None:
        self.name, self.backend, self.pool, self.ps = name, backend, pool, pool.page_size
        self.v1 = name == "ecd"

    def indices(self, first_page: int, n: int) -> torch.Tensor:
        return torch.arange(first_page * self.ps, (first_page + n) * self.ps, dtype=torch.int64)

    def store(self, keys: list[str], first_page: int) -> bool:
        if self.v1:
            return all(self.backend.batch_set_v1(keys, self.indices(first_page, len(keys))))
        data = [self.pool.get_data_page((first_page + i) * self.ps) for i in range(len(keys))]
        return bool(self.backend.batch_set(keys, data))

    def exists(self, keys: list[str]) -> int:
        return int(self.backend.batch_exists(keys))

    def load(self, keys: list[str], first_page: int) -> int:
        if self.v1:
            ok = self.backend.batch_get_v1(keys, self.indices(first_page, len(keys)))
            return next((i for i, x in enumerate(ok) if not x), len(keys))
        dummy = [self.pool.get_dummy_flat_data_page() for _ in keys]
        got = self.backend.batch_get(keys, dummy)
        n = 0
        for i, page in enumerate(got or []):
            if page is None:
                break
            self.pool.set_from_flat_data_page((first_page + i) * self.ps, page)
            n += 1
        return n


def page_view(pool, page: int) -> torch.Tensor:
    return pool.get_data_page(page * pool.page_size, flat=True)


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def bench_geometry(gname: str, g: dict, endpoint: str, dirs: dict, reps: int, batch_reps: int) -> dict:
    from sglang_env import fill
    pages = 2 * BATCH + 2
    pool = host_pool(g, pages)
    fill(pool, 1234)
    drivers = {b: Driver(b, make(b, pool, endpoint, dirs), pool) for b in BACKENDS}
    flat = pool.kv_buffer.view(-1).view(torch.uint8) if pool.kv_buffer.is_contiguous() else None
    pb = page_bytes(g)
    src_ref = torch.empty(BATCH * pb, dtype=torch.uint8)
    dst_ref = torch.empty_like(src_ref)
    src_ref.copy_(flat[: BATCH * pb] if flat is not None else torch.randint(0, 255, (BATCH * pb,), dtype=torch.uint8))
    samples: dict = {b: {} for b in BACKENDS}
    bad = 0
    seq = 0
    for n, nreps in ((1, reps), (BATCH, batch_reps)):
        for rep in range(nreps + 1):  # rep 0 warms up and is dropped
            order = BACKENDS[rep % len(BACKENDS):] + BACKENDS[:rep % len(BACKENDS)]
            for b in order:
                d = drivers[b]
                seq += 1
                keys = [f"bench-{gname}-{os.getpid()}-{seq}-{i}" for i in range(n)]
                ref = lambda: dst_ref[: n * pb].copy_(src_ref[: n * pb])  # noqa: E731
                r_set, _ = timed(ref)
                t_set, ok = timed(lambda: d.store(keys, 0))  # noqa: B023
                r_ex, _ = timed(ref)
                t_ex, hit = timed(lambda: d.exists(keys))  # noqa: B023
                r_get, _ = timed(ref)
                t_get, got = timed(lambda: d.load(keys, BATCH + 1))  # noqa: B023
                if got:
                    for i in range(got):
                        if not torch.equal(page_view(pool, i), page_view(pool, BATCH + 1 + i)):
                            bad += 1
                if rep:
                    s = samples[b].setdefault(n, {"store": [], "exists": [], "load": [], "hits": [], "ok": []})
                    s["store"].append((t_set, t_set / r_set))
                    s["exists"].append((t_ex, t_ex / r_ex))
                    s["load"].append((t_get, t_get / r_get))
                    s["hits"].append(got / n)
                    s["ok"].append(bool(ok))
                d.backend.clear()
    out = {"geometry": gname, "page_bytes": pb, **g, "backends": {}}
    for b in BACKENDS:
        out["backends"][b] = {}
        for n, s in samples[b].items():
            row = {"reps": len(s["store"]), "load_hit_rate": statistics.mean(s["hits"]), "store_ok": all(s["ok"])}
            for op in ("store", "exists", "load"):
                row[f"{op}_us"] = statistics.median(t for t, _ in s[op]) * 1e6
                row[f"{op}_x_memcpy"] = statistics.median(r for _, r in s[op])
            out["backends"][b][str(n)] = row
    for d in drivers.values():
        if hasattr(d.backend, "close"):
            d.backend.close()
    out["bad_pages"] = bad
    return out


def child(args) -> None:
    """The second server: its own pool and backend; exists + load of the first one's keys."""
    from sglang_env import fill
    g = GEOMETRIES[args.geometry]
    pool = host_pool(g, 2 * args.n + 2)
    ref = host_pool(g, 2 * args.n + 2)
    fill(ref, args.seed)
    d = Driver(args.child, make(args.child, pool, args.endpoint, json.loads(args.dirs)), pool)
    keys = [f"xproc-{args.seed}-{i}" for i in range(args.n)]
    hit = d.exists(keys)
    got = d.load(keys[:hit], 0) if hit else 0
    exact = all(torch.equal(page_view(pool, i), page_view(ref, i)) for i in range(got))
    print(json.dumps({"exists": hit, "loaded": got, "exact": exact}), flush=True)


def cross_process(endpoint: str, dirs: dict, n: int = 32) -> dict:
    from sglang_env import fill
    g = GEOMETRIES["small"]
    out = {}
    for seed, b in enumerate(BACKENDS, start=100):
        pool = host_pool(g, 2 * n + 2)
        fill(pool, seed)
        d = Driver(b, make(b, pool, endpoint, dirs), pool)
        stored = d.store([f"xproc-{seed}-{i}" for i in range(n)], 0)
        res = subprocess.run([sys.executable, __file__, "--child", b, "--endpoint", endpoint, "--dirs", json.dumps(dirs),
                              "--geometry", "small", "--seed", str(seed), "--n", str(n)],
                             capture_output=True, text=True, timeout=300)
        line = [x for x in res.stdout.splitlines() if x.startswith("{")]
        r = json.loads(line[-1]) if line else {"error": res.stderr[-2000:]}
        r.update(stored=stored, pages=n, hit_rate=r.get("loaded", 0) / n)
        out[b] = r
        d.backend.clear()
        if hasattr(d.backend, "close"):
            d.backend.close()
    return out


def report(results: list[dict], xproc: dict) -> None:
    print("\nmedian time per call, and that time over a memcpy of the same bytes taken right beside it (x memcpy)")
    hdr = f"{'page':>6} {'pages':>5} {'backend':>9} | {'store us':>9} {'x':>6} | {'exists us':>9} {'x':>7} | " \
          f"{'load us':>9} {'x':>6} | {'hit':>4}"
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        for b, rows in r["backends"].items():
            for n, row in rows.items():
                print(f"{r['page_bytes'] // 1024:>5}K {n:>5} {b:>9} | {row['store_us']:>9.0f} {row['store_x_memcpy']:>6.2f} | "
                      f"{row['exists_us']:>9.0f} {row['exists_x_memcpy']:>7.2f} | {row['load_us']:>9.0f} "
                      f"{row['load_x_memcpy']:>6.2f} | {row['load_hit_rate']:>4.0%}")
    print("\nanother process (a second server on the node) asks for the pages this one backed up:")
    for b, r in xproc.items():
        print(f"  {b:>9}: {r.get('loaded', 0)}/{r['pages']} pages loaded ({r['hit_rate']:.0%}), bytes exact: "
              f"{r.get('exact')}{'  ERROR ' + r['error'] if 'error' in r else ''}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=60, help="repetitions of the one-page calls (default 60)")
    ap.add_argument("--batch-reps", type=int, default=9, help=f"repetitions of the {BATCH}-page calls (default 9)")
    ap.add_argument("--geometries", default="small,large")
    ap.add_argument("--disk-dir", default="/var/tmp", help="where the file backend's disk directory goes")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", help=argparse.SUPPRESS)
    ap.add_argument("--dirs", help=argparse.SUPPRESS)
    ap.add_argument("--geometry", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)
    if args.child:
        child(args)
        return 0
    print("command:", " ".join([os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(ROOT)
                                else sys.executable, *sys.argv]))
    workdir = tempfile.mkdtemp(prefix="ecd-bench-sglang-")
    dirs = {"file-shm": tempfile.mkdtemp(prefix="ecd-bench-sglang-", dir="/dev/shm"),
            "file-disk": tempfile.mkdtemp(prefix="ecd-bench-sglang-", dir=args.disk_dir)}
    daemon = BenchDaemon(workdir, pool="1GiB")
    rc, ok = -1, False
    try:
        c = daemon.connect()
        pings = []
        for _ in range(300):
            t0 = time.perf_counter()
            c.ping()
            pings.append(time.perf_counter() - t0)
        c.close()
        ping_us = statistics.median(pings[50:]) * 1e6
        print(f"one bare ecd control round trip (Client.ping), median: {ping_us:.0f} us")
        import sglang
        res: dict = {"env": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                             "sglang": sglang.__version__, "ecd_ping_us": ping_us, "loadavg_start": os.getloadavg(), "dirs": dirs},
                     "results": [bench_geometry(gname, GEOMETRIES[gname], daemon.endpoint, dirs, args.reps, args.batch_reps)
                                 for gname in args.geometries.split(",")]}
        res["cross_process"] = cross_process(daemon.endpoint, dirs)
        res["env"]["loadavg_end"] = os.getloadavg()
        report(res["results"], res["cross_process"])
        bad = sum(r["bad_pages"] for r in res["results"]) + sum(
            1 for r in res["cross_process"].values() if r.get("exact") is False or "error" in r)
        if bad:
            print(f"ERROR: {bad} pages loaded with the wrong bytes (or a second process failed)")
        ok = not bad
    finally:
        rc = daemon.stop()
        for d in (*dirs.values(), workdir):
            shutil.rmtree(d, ignore_errors=True)
    print(f"daemon stopped with SIGTERM: exit code {rc}; load average {os.getloadavg()[0]:.2f}")
    if ok and args.json:
        write_results(args.json, res)
    return 0 if ok and rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
