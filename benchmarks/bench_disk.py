#!/usr/bin/env python3
"""The disk tier ([pool.disk]): spill and promote throughput of 16 MiB entries against `dd` with
O_DIRECT on the same directory in the same run; write-through latency; warm-restart time.

Throughput, per sample (--samples, default 7), on a daemon whose host pool holds --batch entries:
- spill: put `batch` entries into a full pool; each evicts one 16 MiB entry, which is spilled.
  Timed from the first put until the daemon reports every spill written (stats polled every
  2 ms). Reference beside it: `dd if=/dev/zero of=DIR/dd.bin bs=16M count=batch oflag=direct`.
- promote: with room in the pool, `view` each spilled entry in turn (a read of the record,
  checked, committed). Reference beside it: `dd if=DIR/dd.bin of=/dev/null bs=16M iflag=direct`.
dd runs just before and just after each ecd figure (the mean of the two is its reference: the
shared VM's disk drifts within seconds); each ecd figure is divided by its own reference and the
median of those ratios is the result (goal >= 0.8: ecd moves the bytes at 80% of
what the device gives one sequential O_DIRECT stream).

Write-through: `put(persist=True)` of one 16 MiB and one 64 KiB entry (write, fsync, rename,
fsync of the directory), beside `dd ... oflag=direct conv=fsync` of the same size.
Restart (--restart-entries, default 10000): that many 16 KiB records are spilled, the daemon is
SIGKILLed and started again; reported: the daemon's re-index time and process start to first
answer, with every record back.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_daemon import BenchDaemon, write_results  # noqa: E402

GOAL = 0.8
MIB = 1 << 20


def dd(args: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(["dd", *args, "status=none"], check=True)
    return time.perf_counter() - started


def sandwich(ecd, ref, between=lambda: None) -> tuple[float, float]:
    """(ecd's time, the reference's) with the reference run just before and just after ecd and
    averaged: the device's speed drifts (a shared VM), and a reference taken on one side only
    pairs ecd with a device faster or slower than the one it had. `between`: undoes what the
    reference left (its file) before the second run."""
    before = ref()
    between()
    ecd_s = ecd()
    after = ref()
    return ecd_s, (before + after) / 2


def wait_spilled(client, spills: int, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        disk = client.stats()["disk"]
        if disk["spills"] >= spills and disk["writes_in_flight"] == 0:
            return disk
        if time.monotonic() > deadline:
            raise RuntimeError(f"spills did not reach {spills}: {disk}")
        time.sleep(0.002)


def throughput(args, work: str, disk_dir: str) -> dict:
    n = 16 * MIB
    pool = f"{args.batch * 16}MiB"  # the a-keys fill it exactly: each b-key put evicts (spills) one
    daemon = BenchDaemon(work, "bdisk", pool=pool, extra=(
        f'\n[pool.disk]\npath = "{disk_dir}"\nsize = "{args.batch * 3 * 16 + 64}MiB"\n'
        f'spill_buffer = "{(args.batch + 2) * 16}MiB"\n'))
    tensors = [torch.randint(0, 255, (n,), dtype=torch.uint8) for _ in range(args.batch)]
    spill_r, promote_r, spill_gbs, promote_gbs, dd_w, dd_r = [], [], [], [], [], []
    try:
        c = daemon.connect(timeout=60)
        assert c.stats()["disk"]["direct_io"] == (not args.buffered), c.stats()["disk"]
        dd_file = os.path.join(disk_dir, "dd.bin")
        for sample in range(args.samples):
            total = args.batch * n
            # the pool fills with a-keys; putting b-keys spills every a-key
            for j, t in enumerate(tensors):
                c.put(f"a{j}", t)
            before = c.stats()["disk"]["spills"]

            def ecd_spill() -> float:
                started = time.perf_counter()
                for j, t in enumerate(tensors):
                    c.put(f"b{j}", t)
                disk = wait_spilled(c, before + args.batch)
                assert not disk["dropped"], disk
                return time.perf_counter() - started

            def dd_write() -> float:
                return dd(["if=/dev/zero", f"of={dd_file}", "bs=16M", f"count={args.batch}", "oflag=direct"])
            spill_s, dd_w_s = sandwich(ecd_spill, dd_write, lambda: os.unlink(dd_file))
            c.delete([f"b{j}" for j in range(args.batch)])  # room: the a-keys come back without evicting

            def ecd_promote() -> float:
                started = time.perf_counter()
                for j in range(args.batch):
                    with c.view(f"a{j}") as v:
                        assert v.numel() == n
                return time.perf_counter() - started

            def dd_read() -> float:
                return dd([f"if={dd_file}", "of=/dev/null", "bs=16M", "iflag=direct"])
            promote_s, dd_r_s = sandwich(ecd_promote, dd_read)
            for j in (0, args.batch - 1):  # the bytes that came back are the bytes put
                assert torch.equal(c.get(f"a{j}"), tensors[j])
            c.delete([f"a{j}" for j in range(args.batch)])
            os.unlink(dd_file)
            spill_r.append(dd_w_s / spill_s)
            promote_r.append(dd_r_s / promote_s)
            spill_gbs.append(total / spill_s / 1e9)
            promote_gbs.append(total / promote_s / 1e9)
            dd_w.append(total / dd_w_s / 1e9)
            dd_r.append(total / dd_r_s / 1e9)
            print(f"sample {sample}: spill {spill_gbs[-1]:.2f} GB/s vs dd {dd_w[-1]:.2f} ({spill_r[-1]:.2f}x); "
                  f"promote {promote_gbs[-1]:.2f} GB/s vs dd {dd_r[-1]:.2f} ({promote_r[-1]:.2f}x)", flush=True)
        persist = write_through(c, disk_dir, args.samples)
    finally:
        daemon.stop()
    med = statistics.median
    return {"entry_bytes": n, "batch": args.batch, "samples": args.samples,
            "spill_gbs": med(spill_gbs), "dd_write_gbs": med(dd_w), "spill_ratio": med(spill_r),
            "promote_gbs": med(promote_gbs), "dd_read_gbs": med(dd_r), "promote_ratio": med(promote_r),
            "spill_ratios": spill_r, "promote_ratios": promote_r, "write_through": persist}


def write_through(c, disk_dir: str, samples: int) -> dict:
    out = {}
    for label, n in (("16MiB", 16 * MIB), ("64KiB", 64 << 10)):
        t = torch.randint(0, 255, (n,), dtype=torch.uint8)
        c.put("wt", t, persist=True)  # warm-up
        ecd_s, dd_s = [], []
        for i in range(samples):
            started = time.perf_counter()
            c.put(f"wt{i}", t, persist=True)
            ecd_s.append(time.perf_counter() - started)
            bs = "16M" if n == 16 * MIB else "64K"
            dd_s.append(dd(["if=/dev/zero", f"of={disk_dir}/wt.bin", f"bs={bs}", "count=1", "oflag=direct",
                            "conv=fsync"]))
            os.unlink(f"{disk_dir}/wt.bin")
        c.delete(["wt"] + [f"wt{i}" for i in range(samples)])
        out[label] = {"ecd_ms": statistics.median(ecd_s) * 1e3, "dd_fsync_ms": statistics.median(dd_s) * 1e3}
        print(f"write-through {label}: put(persist=True) {out[label]['ecd_ms']:.1f} ms p50, dd oflag=direct "
              f"conv=fsync {out[label]['dd_fsync_ms']:.1f} ms p50", flush=True)
    return out


def restart(args, work: str, disk_dir: str) -> dict:
    n = 16 << 10
    extra = f'\n[pool.disk]\npath = "{disk_dir}"\nsize = "{args.restart_entries * 24 // 1024 + 64}MiB"\nmin_spill_size = 0\n'
    daemon = BenchDaemon(work, "brst", pool="32MiB", extra=extra)
    try:
        c = daemon.connect(timeout=60)
        t = torch.randint(0, 255, (n,), dtype=torch.uint8)
        i = 0
        while c.stats()["disk"]["entries"] < args.restart_entries:
            c.put_many({f"r{i + j}": t for j in range(256)})
            i += 256
            wait_spilled(c, 0)
        on_disk = c.stats()["disk"]["entries"]
        c.close()
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait()
        daemon.log.close()
        started = time.perf_counter()
        daemon2 = BenchDaemon(work, "brst", pool="32MiB", extra=extra)
        try:
            c2 = daemon2.connect(timeout=120)
            answered = time.perf_counter() - started
            disk = c2.stats()["disk"]
            assert disk["loaded"] == on_disk, (disk, on_disk)
            assert torch.equal(c2.get("r0"), t)
            c2.close()
        finally:
            daemon2.stop()
    finally:
        if daemon.proc.poll() is None:
            daemon.stop()
    print(f"restart: {on_disk} records re-indexed in {disk['load_s']:.3f}s; process start to first answer "
          f"{answered:.2f}s", flush=True)
    return {"records": on_disk, "reindex_s": disk["load_s"], "start_to_answer_s": answered}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp", help="where the disk tier goes (a local disk: O_DIRECT)")
    parser.add_argument("--samples", type=int, default=7)
    parser.add_argument("--batch", type=int, default=16, help="16 MiB entries per sample")
    parser.add_argument("--restart-entries", type=int, default=10000)
    parser.add_argument("--buffered", action="store_true", help="expect a filesystem without O_DIRECT")
    parser.add_argument("--skip-restart", action="store_true")
    parser.add_argument("--json", default="", help="also write the results here ('-': stdout)")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="ecd-bench-disk-")
    disk_dir = tempfile.mkdtemp(prefix="ecd-bench-tier-", dir=args.dir)
    results: dict = {"goal": GOAL, "dir": args.dir}
    try:
        results["throughput"] = throughput(args, work, disk_dir)
        r = results["throughput"]
        print(f"median over {args.samples} samples: spill {r['spill_gbs']:.2f} GB/s = {r['spill_ratio']:.2f}x dd "
              f"oflag=direct ({r['dd_write_gbs']:.2f}); promote {r['promote_gbs']:.2f} GB/s = "
              f"{r['promote_ratio']:.2f}x dd iflag=direct ({r['dd_read_gbs']:.2f}); goal >= {GOAL}")
        if not args.skip_restart:
            shutil.rmtree(disk_dir)
            os.makedirs(disk_dir)
            results["restart"] = restart(args, work, disk_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(disk_dir, ignore_errors=True)
    if args.json:
        write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
