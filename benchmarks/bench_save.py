#!/usr/bin/env python3
"""The EC hand-off's data path, one encoder output at a time: ecd against vLLM's ECExampleConnector.

An EC producer's `save_caches` is one Client.put of a bf16 encoder output (576 x 4096 = 4.5 MiB
for one image of a LLaVA-sized model, 2304 x 4096 = 18 MiB for a large one); ECExampleConnector
writes the same tensor with safetensors.torch.save_file into a new directory per mm_hash, and its
consumer reads it back with safetensors.torch.load_file. This benchmark times, for each size,
rep by rep in an order that rotates every rep:

  save:  memcpy (np.copyto into a pre-faulted buffer: the reference), ecd put (a new key each
         rep, as each image has its own mm_hash), save_file into /dev/shm and into /tmp;
  load:  ecd get (a new CPU tensor: what EcdECConnector's start_load_caches gets on a CPU
         engine), load_file from /dev/shm and from /tmp (the files the save wrote), each
         followed by a read of one byte per 4 KiB page: safetensors maps the file and its
         pages fault in on first use, which the engine pays when the encoder output is used.

Before every sample the source is rewritten (as the encoder just wrote it). Each sample is
divided by the memcpy taken in the same rep (paired ratios); the table gives their medians and
the median of the per-rep ecd / ECExampleConnector ratios. It starts its own daemon
(benchmarks/bench_daemon.py) and stops it with SIGTERM.

  make bench-save, or: .venv-vllm/bin/python benchmarks/bench_save.py [--reps N] [--sizes 576,2304]
  [--json PATH] (safetensors, which vLLM brings, is needed: the vLLM venv has it)
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time

import numpy as np
import safetensors.torch
import torch

from bench_daemon import BenchDaemon, write_results

MIB = 1 << 20
HIDDEN = 4096  # the encoder output's width (a 7B model's hidden size)
SAVES = ("memcpy", "ecd_put", "st_save_shm", "st_save_tmp")
LOADS = ("ecd_get", "st_load_shm", "st_load_tmp")
now_ns = time.perf_counter_ns


def example_save(root: str, mm_hash: str, tensor: torch.Tensor) -> str:
    """What ECExampleConnector.save_caches does for one item: a folder per mm_hash, one file."""
    folder = os.path.join(root, mm_hash)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "encoder_cache.safetensors")
    safetensors.torch.save_file({"ec_cache": tensor.detach().cpu()}, path)
    return path


def touch_pages(tensor: torch.Tensor) -> int:
    """Read one byte of every 4 KiB page of `tensor` (faults in a lazily mapped file)."""
    return int(np.add.reduce(tensor.view(torch.uint8).numpy().reshape(-1)[::4096], dtype=np.int64))


def bench_size(c, rows: int, reps: int, warm: int, roots: dict[str, str]) -> dict:
    master = torch.randn(rows, HIDDEN).to(torch.bfloat16)
    src = master.clone()
    src_bytes = src.view(torch.uint8).numpy().reshape(-1)
    master_bytes = master.view(torch.uint8).numpy().reshape(-1)
    ref_dst = np.ones_like(src_bytes)  # pre-faulted
    nbytes = src_bytes.size
    samples: dict[str, list[int]] = {name: [] for name in SAVES + LOADS}
    bad = 0

    def fresh_source(i: int) -> None:
        np.copyto(src_bytes, master_bytes)  # as the encoder wrote it just now
        src_bytes[:8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)

    for i in range(warm + reps):
        key = f"mm{rows}-{i}"
        files: dict[str, str] = {}
        order = SAVES[i % len(SAVES):] + SAVES[:i % len(SAVES)]
        for name in order:
            fresh_source(i)
            t0 = now_ns()
            if name == "memcpy":
                np.copyto(ref_dst, src_bytes)
            elif name == "ecd_put":
                c.put(key, src)
            else:
                files[name] = example_save(roots[name], key, src)
            samples[name].append(now_ns() - t0)
        order_l = LOADS[i % len(LOADS):] + LOADS[:i % len(LOADS)]
        for name in order_l:
            t0 = now_ns()
            if name == "ecd_get":
                out = c.get(key)
            else:
                out = safetensors.torch.load_file(files[name.replace("load", "save")], device="cpu")["ec_cache"]
            touch_pages(out)
            samples[name].append(now_ns() - t0)
            bad += not torch.equal(out.view(torch.uint8).reshape(-1)[:8], src.view(torch.uint8).reshape(-1)[:8])
            del out
        c.delete(key)
        for path in files.values():
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    for v in samples.values():
        del v[:warm]
    memcpy = np.array(samples["memcpy"], dtype=float)
    res: dict = {"rows": rows, "hidden": HIDDEN, "dtype": "bfloat16", "nbytes": nbytes, "reps": reps,
                 "bad_payloads": bad,
                 "p50_us": {k: float(np.median(v)) / 1e3 for k, v in samples.items()}}
    res["paired_vs_memcpy"] = {k: float(np.median(np.array(v) / memcpy)) for k, v in samples.items() if k != "memcpy"}
    res["paired_ecd_vs_example"] = {
        "save_vs_shm": float(np.median(np.array(samples["ecd_put"]) / np.array(samples["st_save_shm"]))),
        "save_vs_tmp": float(np.median(np.array(samples["ecd_put"]) / np.array(samples["st_save_tmp"]))),
        "load_vs_shm": float(np.median(np.array(samples["ecd_get"]) / np.array(samples["st_load_shm"]))),
        "load_vs_tmp": float(np.median(np.array(samples["ecd_get"]) / np.array(samples["st_load_tmp"]))),
    }
    return res


def report(results: list[dict]) -> None:
    print(f"\nEC hand-off data path, bf16 [rows x {HIDDEN}], p50 in us and paired median ratio to memcpy")
    print(f"{'':26}" + "".join(f"{r['rows']:>6} rows ({r['nbytes'] / MIB:.1f} MiB)" for r in results))
    for name in SAVES + LOADS:
        cells = []
        for r in results:
            ratio = r["paired_vs_memcpy"].get(name)
            cells.append(f"{r['p50_us'][name]:>9.0f} us" + (f" {ratio:5.2f}x" if ratio is not None else "       "))
        print(f"{name:26}" + "".join(f"{cell:>24}" for cell in cells))
    print("\necd / ECExampleConnector (median of per-rep ratios; < 1: ecd faster)")
    for what in ("save_vs_shm", "save_vs_tmp", "load_vs_shm", "load_vs_tmp"):
        print(f"  {what:24}" + "".join(f"{r['paired_ecd_vs_example'][what]:>24.2f}" for r in results))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=60, help="timed repetitions per size (default 60)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--sizes", default="576,2304", help="encoder output rows, comma separated")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args()
    workdir = tempfile.mkdtemp(prefix="ecd-bench-save-")
    roots = {"st_save_shm": tempfile.mkdtemp(prefix="ecd-bench-save-", dir="/dev/shm"),
             "st_save_tmp": os.path.join(workdir, "example")}
    daemon = BenchDaemon(workdir)
    rc, ok = -1, False
    try:
        c = daemon.connect()
        res = {"env": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                       "loadavg_start": os.getloadavg()},
               "sizes": [bench_size(c, int(rows), args.reps, args.warmup, roots) for rows in args.sizes.split(",")]}
        res["env"]["loadavg_end"] = os.getloadavg()
        c.close()
        report(res["sizes"])
        bad = sum(r["bad_payloads"] for r in res["sizes"])
        if bad:
            print(f"ERROR: {bad} loads returned the wrong bytes")
        ok = not bad
    finally:
        rc = daemon.stop()
        shutil.rmtree(roots["st_save_shm"], ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"daemon stopped with SIGTERM: exit code {rc}; load average {os.getloadavg()[0]:.2f}")
    if ok and args.json:
        res["daemon_exit_code"] = rc
        write_results(args.json, res)
    return 0 if ok and rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
