"""examples/epd_cpu run end to end: ecd serve, a monolithic vllm serve, then encoder, prefill and
decode vllm serve servers behind the example's proxy; the request through the proxy must give the
monolithic server's tokens (run.py exits 1 otherwise). Slow (minutes): `-m "not example"`
deselects it; `make test-engine` runs it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from mm_fixtures import require_vllm

require_vllm()

REPO = Path(__file__).resolve().parent.parent.parent


@pytest.mark.example
@pytest.mark.timeout(1200)
def test_epd_cpu_example_runs_end_to_end(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "epd_cpu" / "run.py"),
                           "--workdir", str(tmp_path / "epd")],
                          capture_output=True, text=True, timeout=1100, cwd=str(REPO))
    print(proc.stdout)
    logs = "".join(f"\n--- {p.name}\n" + p.read_text(errors="replace")[-2000:]
                   for p in sorted((tmp_path / "epd" / "logs").glob("*.log")))
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{logs}"
    assert "OK: 16 tokens through encoder -> prefill -> decode" in proc.stdout
    # nothing left running: the example stops every process it started (each names the workdir)
    assert not [pid for pid in _pids_naming(str(tmp_path))], "processes of the example outlived it"


def _pids_naming(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids
