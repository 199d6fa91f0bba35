#!/usr/bin/env python3
"""bench_core.py's bulk hand-off section alone (put in process A + view in process B, the floor
and the references), for the sizes asked: the figure of issue 26's target "put(A)+view(B) of
16 MiB <= 1.2x memcpy" in seconds instead of bench_core's minutes, so that it can be repeated
and alternated with another tree's run (PYTHONPATH) on a noisy machine.

  python benchmarks/bench_handoff.py [--sizes 16] [--reps N] [--json PATH]

Prints, per size, bench_core's ratios (`handoff_e2e_paired_median`: the median of per-rep
end-to-end / memcpy ratios; `handoff_floor_paired_median`: the same for the copy + one bare
round trip) and the p50s they come from. Starts its own daemon, stops it with SIGTERM.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

import bench_core as core
from bench_daemon import BenchDaemon, write_results

from ecd.memory.host import ShmFile

KEPT_P50 = ("memcpy", "memcpy_cold_dst", "put_seq", "view_seq", "handoff_e2e", "handoff_floor", "put_1proc", "get_1proc")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="16", help="MiB, comma separated, each one of bench_core's SIZES_MIB")
    ap.add_argument("--reps", type=int, default=0, help="timed reps per size (default: bench_core's)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    for mib in sizes:
        if mib not in core.SIZES_MIB:
            ap.error(f"--sizes: {mib} MiB is not one of bench_core's sizes {core.SIZES_MIB}")
        if args.reps:
            core.REPS[mib] = args.reps
    workdir = tempfile.mkdtemp(prefix="ecd-bench-handoff-")
    daemon = BenchDaemon(workdir)
    procs: list = []
    res: dict = {"env": {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg()}, "copy": {}}
    bad = 0
    try:
        c = daemon.connect(timeout=0.5)

        start = core.child_starter(procs)

        echo_endpoint = f"ipc://{daemon.runtime_dir}/echo.sock"
        echo = start(core._echo_server, echo_endpoint, "REP")
        consumer = start(core._consumer, daemon.endpoint)
        if core.recv(echo, 120) != "ready" or core.recv(consumer, 120) != "ready":
            raise RuntimeError("a benchmark process did not start")
        diag_name = f"ecd-bench-handoff.{os.getpid()}"
        created = ShmFile.create(diag_name, max(sizes) * core.MIB)
        try:
            diag = ShmFile.attach(diag_name, max(sizes) * core.MIB, writable=True, populate=True)
        finally:
            created.unlink()
        for mib in sizes:
            full = core.bench_copies(c, consumer, mib, diag.buf, echo_endpoint)
            bad += full["bad_payloads"]
            res["copy"][str(mib)] = {"ratio": full["ratio"], "bad_payloads": full["bad_payloads"],
                                     "p50_us": {k: full[k]["p50_us"] for k in KEPT_P50}}
        consumer.send(("stop",))
        c.close()
    finally:
        for pr in procs:
            if pr.is_alive():
                pr.terminate()
        rc = daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    res["env"]["loadavg_end"] = os.getloadavg()
    for mib, r in res["copy"].items():
        ratio, p50 = r["ratio"], r["p50_us"]
        print(f"{mib} MiB: put(A)+view(B) {ratio['handoff_e2e_paired_median']:.2f}x memcpy (paired median; "
              f"target <= {core.TARGET_HANDOFF_RATIO}x), floor {ratio['handoff_floor_paired_median']:.2f}x; p50 us: "
              + ", ".join(f"{k} {v:.0f}" for k, v in p50.items()))
    print(f"daemon exit code {rc}; load average {res['env']['loadavg_start'][0]:.1f} -> {res['env']['loadavg_end'][0]:.1f}")
    if bad:
        print(f"ERROR: {bad} hand-offs delivered the wrong payload")
    ok = rc == 0 and not bad
    if ok and args.json:
        write_results(args.json, res)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
