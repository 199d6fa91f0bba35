"""A client that reads locally (client/local_read.py) across an adopting restart: the new daemon
reuses the adopted extents, the client has not talked to it yet and still maps the old run's
ring. The old ring has no event for what the new daemon did, so the new daemon must not serve
(nor free an adopted extent) while a client can still trust that ring: it waits until the old
ring's last heartbeat is READER_TRUST_S old. Without that wait (the `no-ring-wait` mutant), a
get right after the restart returns another entry's bytes."""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import Actor, wait_for
from ecd.memory.ring import READER_TRUST_S

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "chaos"))
from local_read_churn import CHURN_SCRIPT  # noqa: E402

NUMEL = 256 * 1024  # 1 MiB of float32: eight fill the 8 MiB pool
KEYS = 8


@pytest.mark.parametrize("mutant", ["none", "no-ring-wait"])
def test_a_local_get_right_after_an_adopting_restart_never_reads_a_reused_extent(daemon_factory, mutant):
    # The mutant shows only if the reader's gets come within READER_TRUST_S of the kill: on a
    # loaded machine a run may be slower than that, so it gets up to three tries to be fast enough.
    for _ in range(3 if mutant != "none" else 1):
        d = daemon_factory(size="8MiB")
        answers, took = restart_and_read(d, mutant)
        if mutant == "none":
            assert answers == ["missing"] * KEYS, answers
            assert took >= READER_TRUST_S or "waiting" in d.log()
            return
        if took < READER_TRUST_S:
            assert "mismatch" in answers, f"the mutant went unseen: {answers}"
            return
        d.stop()
    raise AssertionError("too slow to show the mutant three times (the old ring was no longer trusted)")


def restart_and_read(d, mutant: str) -> tuple[list[str], float]:
    """Entries put and read locally, the daemon killed and restarted (adopting) at once, the
    entries deleted and their extents put into: the reader's gets of the old keys, and how long
    after the kill they were answered."""
    producer, reader, other = Actor(d.endpoint), Actor(d.endpoint), Actor(d.endpoint)
    try:
        for k in range(KEYS):
            assert producer.ask(f"put r{k} {k} {NUMEL}") == "ok"
        for k in range(KEYS):  # the first get learns where the entry is; the second reads it locally
            assert reader.ask(f"get r{k} {k} {NUMEL}") == "ok"
            assert reader.ask(f"get r{k} {k} {NUMEL}") == "ok"
        # The next run waits, warm, for the go (a restart faster than a cold Python start).
        old, go = d.proc, Path(d.runtime_dir) / "go"
        standby = threading.Thread(target=d.start, kwargs={"prefix": (
            sys.executable, CHURN_SCRIPT, "daemon", mutant, "--after", str(go), "--")})
        standby.start()
        assert wait_for(lambda: Path(f"{go}.ready").exists(), timeout=30)
        old.kill()
        old.wait()
        killed = time.monotonic()
        go.touch()
        standby.join(60)
        assert d.proc is not old and d.proc.poll() is None, d.log()
        print(f"restarted in {time.monotonic() - killed:.2f}s")
        with d.client() as c:
            assert c.delete([f"r{k}" for k in range(KEYS)]) == [True] * KEYS
        for k in range(KEYS):  # into the extents the deleted entries held
            assert other.ask(f"put s{k} {100 + k} {NUMEL}") == "ok"
        answers = [reader.ask(f"get r{k} {k} {NUMEL}") for k in range(KEYS)]
        took = time.monotonic() - killed
        print(f"{mutant}: the reader's gets {took:.2f}s after the kill: {answers}")
        return answers, took
    finally:
        for actor in (producer, reader, other):
            actor.proc.kill()
            actor.proc.wait()
