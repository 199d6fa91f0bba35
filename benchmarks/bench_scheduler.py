#!/usr/bin/env python3
"""The vLLM scheduler's connector hooks: what each costs the engine's scheduling loop.

The scheduler runs in the engine's own process and its time is every waiting request's time to
first token, so its hooks should cost no more than a file-based connector's (issue 26, item 2).
This times, with real vLLM 0.33 connector objects (the CPU build; `make bench-scheduler`), the
hooks vLLM's Scheduler calls for one request after its producer saved it:

  EC  "lookup": ensure_cache_available + has_cache_item + update_state_after_alloc +
      build_connector_meta, for a request with one image; "finish": request_finished
  KV  "lookup": get_num_new_matched_tokens + update_state_after_alloc + build_connector_meta for a
      2048-token prompt (127 blocks to load); "finish": request_finished

for ecd's connectors and vLLM's ECExampleConnector / ExampleConnector (safetensors files under
/dev/shm), taking turns request by request, each beside a bare pyzmq REQ/REP round trip over
ipc taken right before it (the reference: what a design that asks the daemon once per hook
would pay at least). Reports p50 per hook in µs and the median of per-sample ratios
ecd ÷ example. Starts its own daemon (`python -m ecd serve`), SIGTERM at the end. No targets
asserted: figures only.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_vllm as bv  # noqa: E402  (sets the vLLM environment before importing it)
import torch  # noqa: E402
import zmq  # noqa: E402
from bench_daemon import BenchDaemon, write_results  # noqa: E402

now_ns = time.perf_counter_ns


class BareRoundTrip:
    """A bare pyzmq REQ/REP echo over ipc in a thread of this process: the reference."""

    def __init__(self, workdir: str) -> None:
        self.ctx = zmq.Context.instance()
        endpoint = f"ipc://{workdir}/echo.sock"
        self.rep = self.ctx.socket(zmq.REP)
        self.rep.bind(endpoint)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        self.req = self.ctx.socket(zmq.REQ)
        self.req.connect(endpoint)

    def _serve(self) -> None:
        while True:
            msg = self.rep.recv()
            self.rep.send(msg)
            if msg == b"stop":
                return

    def sample(self) -> int:
        t0 = now_ns()
        self.req.send(b"x" * 64)
        self.req.recv()
        return now_ns() - t0

    def close(self) -> None:
        self.req.send(b"stop")
        self.req.recv()
        self.thread.join()
        self.req.close(0)
        self.rep.close(0)


def ec_rep(producer, consumer: bv.ECConsumer, mm_hash: str, t: dict) -> None:
    producer.save_caches({mm_hash: bv.embeddings(16)}, mm_hash)
    req = bv.image_request(f"r-{mm_hash}", mm_hash, 16)
    t0 = now_ns()
    consumer.lookup(req)
    t1 = now_ns()
    consumer.scheduler.request_finished(req)
    t2 = now_ns()
    t["lookup"], t["finish"] = t1 - t0, t2 - t1


def kv_rep(engine: bv.KVEngine, prompt: list[int], block_ids: list[int], req_id: str, t: dict) -> None:
    s = engine.scheduler
    req = bv.kv_request(req_id, prompt)
    blocks = bv.KVCacheBlocks(([bv.KVCacheBlock(b) for b in block_ids],))
    t0 = now_ns()
    n, _ = s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, blocks, n)
    req.num_computed_tokens = n
    s.build_connector_meta(bv.scheduler_output([bv.NewRequestData.from_request(req, (block_ids,))],
                                               {req.request_id: req.num_tokens - n}))
    t1 = now_ns()
    s.request_finished(req, block_ids)
    t2 = now_ns()
    if n != (bv.PROMPT - 1) // bv.BS * bv.BS:
        raise RuntimeError(f"{type(s).__name__}: matched {n} tokens, expected every loadable block")
    t["lookup"], t["finish"] = t1 - t0, t2 - t1


def summarize(samples: dict[str, dict[str, list[int]]], refs: dict[str, list[int]]) -> dict:
    out: dict = {}
    for hook in ("lookup", "finish"):
        row = {name: statistics.median(s[hook]) / 1e3 for name, s in samples.items()}
        ratio = statistics.median(a / b for a, b in zip(samples["ecd"][hook], samples["example"][hook]))
        per_rt = statistics.median(a / r for a, r in zip(samples["ecd"][hook], refs["ecd"]))
        out[hook] = {"p50_us": row, "ecd_over_example": ratio, "ecd_over_bare_round_trip": per_rt}
    out["bare_round_trip_p50_us"] = statistics.median(refs["ecd"] + refs["example"]) / 1e3
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=200, help="requests per connector and case (default 200)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args()
    workdir = tempfile.mkdtemp(prefix="ecd-bench-sched-", dir="/tmp")
    shm = tempfile.mkdtemp(prefix="ecd-bench-sched-", dir="/dev/shm")
    daemon = BenchDaemon(workdir, node_prefix="benchsched", pool="2GiB")
    bare = None
    res: dict = {"env": {"cpus": os.cpu_count(), "vllm": bv.vllm.__version__, "reps": args.reps,
                         "loadavg_start": os.getloadavg()}}
    try:
        daemon.connect(name="bench-sched").close()
        bare = BareRoundTrip(workdir)
        model_dir = bv.write_model(os.path.join(workdir, "model"))
        kinds = {"ecd": ("ecd", ""), "example": ("example", os.path.join(shm, "ec"))}
        os.makedirs(kinds["example"][1])
        ec = {}
        for name, (kind, storage) in kinds.items():
            config = bv.vllm_config(model_dir, ec=bv.ec_transfer(kind, "ec_producer", daemon.endpoint, storage))
            ec[name] = (bv.ECConnectorFactory.create_connector(config, bv.ECConnectorRole.WORKER),
                        bv.ECConsumer(model_dir, kind, daemon.endpoint, storage))
        kv_config = bv.kv_cache_config(bv.vllm_config(model_dir))
        cache = bv.allocate_kv_cache(kv_config, torch.device("cpu"), bv.KVCacheLayout.LBHNC)
        kv_transfer = {
            "ecd": {"kv_connector": "EcdKVConnector", "kv_connector_module_path": "ecd.integrations.vllm",
                    "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": {"endpoint": daemon.endpoint}},
            "example": {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                        "kv_connector_extra_config": {"shared_storage_path": os.path.join(shm, "kv")}}}
        kv = {name: bv.KVEngine(model_dir, tr, cache, kv_config) for name, tr in kv_transfer.items()}
        block_ids = list(range(1, 1 + bv.KV_BLOCKS))
        prompt = torch.randint(10, 30000, (bv.PROMPT,), generator=torch.Generator().manual_seed(7)).tolist()
        for name, engine in kv.items():  # the producer's save: once, outside the timing
            engine.step(bv.kv_request(f"{name}-save", prompt), block_ids, {}, "save")
        names = list(kinds)
        for case in ("ec", "kv"):
            samples = {n: {"lookup": [], "finish": []} for n in names}
            refs: dict[str, list[int]] = {n: [] for n in names}
            for i in range(args.reps + 5):
                for name in names[i % 2:] + names[:i % 2]:  # who goes first alternates
                    t: dict = {}
                    ref = bare.sample()
                    if case == "ec":
                        ec_rep(*ec[name], f"img-{i}-{name}", t)
                    else:
                        kv_rep(kv[name], prompt, block_ids, f"{name}-{i}", t)
                    if i >= 5:  # warm-up: the lazy clients connect, files get cached
                        refs[name].append(ref)
                        for hook in ("lookup", "finish"):
                            samples[name][hook].append(t[hook])
            res[case] = summarize(samples, refs)
        for producer, consumer in ec.values():
            producer.shutdown()
            consumer.scheduler.shutdown()
            consumer.worker.shutdown()
        for engine in kv.values():
            engine.scheduler.shutdown()
            engine.worker.shutdown()
    finally:
        if bare is not None:
            bare.close()
        res["daemon_exit_code"] = daemon.stop()
        res["env"]["loadavg_end"] = os.getloadavg()
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    print(f"\nvLLM scheduler hooks, p50 µs ({args.reps} requests per connector, taking turns; "
          f"load average {res['env']['loadavg_start'][0]:.1f} -> {res['env']['loadavg_end'][0]:.1f}; "
          f"a bare pyzmq round trip {res['ec']['bare_round_trip_p50_us']:.0f} µs)\n")
    print("| case | hook | ecd | example | ecd ÷ example (median per pair) | ecd ÷ bare round trip |")
    print("|---|---|---:|---:|---:|---:|")
    for case, what in (("ec", "EC, one image"), ("kv", "KV, 2048 tokens (127 blocks)")):
        for hook in ("lookup", "finish"):
            r = res[case][hook]
            print(f"| {what} | {hook} | {r['p50_us']['ecd']:.1f} | {r['p50_us']['example']:.1f} | "
                  f"{r['ecd_over_example']:.2f} | {r['ecd_over_bare_round_trip']:.2f} |")
    if args.json:
        write_results(args.json, res)
    return 0 if res["daemon_exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
