"""Gets, views and pins without a round trip (client/local_read.py, client/pins.py) under
constant churn: a tiny pool, writers replacing, evicting and deleting 64 KiB values that encode
(key, value number), readers getting and viewing them with delays injected between every step of
the read protocol. Zero wrong bytes, no view's bytes change while it is open, no pinned key is
evicted; and the same test against a mutant (no re-check after the copy or the slots; the
daemon's event after the free; the daemon freeing without scanning the read slots; plans blind to
pin slots; a client blind to the plan word) goes wrong, so the test can see the bug it guards against.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import metric, scrape_metrics
from ecd.memory.fence import STRONGLY_ORDERED

CHURN = Path(__file__).resolve().parent / "local_read_churn.py"
KEYS = 96  # 6 MiB of values for a 4 MiB pool: every put evicts
POOL = "4MiB"


def run_churn(d, seconds: float, readers: int, mutant: str = "none", mode: str = "reader",
              delete_share: float = 0.1) -> list[dict]:
    """Two writers and `readers` readers (or pinners: `mode`) at once, each a process of its own;
    their reports."""
    procs = [subprocess.Popen([sys.executable, str(CHURN), "writer", d.endpoint, str(KEYS), str(seconds), str(seed),
                               str(delete_share)], stdout=subprocess.PIPE, text=True) for seed in (1, 2)]
    procs += [subprocess.Popen([sys.executable, str(CHURN), mode, d.endpoint, str(KEYS), str(seconds),
                                str(10 + i), mutant], stdout=subprocess.PIPE, text=True) for i in range(readers)]
    try:
        reports = []
        for p in procs:
            out, _ = p.communicate(timeout=seconds + 60)
            assert p.returncode == 0, (p.args, out)
            reports.append(json.loads(out.strip().splitlines()[-1]))
        return reports
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def start(daemon_factory, daemon_mutant: str = "none"):
    d = daemon_factory(size=POOL, start=False)
    prefix = (sys.executable, str(CHURN), "daemon", daemon_mutant, "--") if daemon_mutant != "none" else ()
    d.start(prefix=prefix)
    return d


def test_local_gets_under_churn_never_return_wrong_bytes(daemon_factory):
    d = start(daemon_factory)
    reports = run_churn(d, seconds=8, readers=3)
    writers, readers = reports[:2], reports[2:]
    print(f"writers {writers}\nreaders {readers}")
    assert sum(w["puts"] for w in writers) > 500, writers  # the churn was on
    assert all(r["wrong"] == 0 for r in readers), readers
    local = sum(r["local"] for r in readers)
    thrown = sum(r["thrown"] for r in readers)
    assert local > 100, readers  # the local route was taken, and passed its checks many times
    assert thrown > 0, readers  # and churn made it throw copies away, which then went to the daemon
    assert sum(r["slotted"] for r in readers) > 0.5 * sum(r["views"] for r in readers), readers  # views held by slots
    body = scrape_metrics(d.metrics_port)
    assert metric(body, "ecd_local_reads_total") > 0  # the daemon heard of them
    assert metric(body, "ecd_evictions_total", reason="replaced") > 0


@pytest.mark.parametrize("client_mutant,daemon_mutant", [
    ("no-recheck", "none"),
    ("none", "late-event"),
    ("none", "no-slot-scan"),
    pytest.param("no-fence", "none", marks=pytest.mark.skipif(
        STRONGLY_ORDERED, reason="x86 keeps loads in order: the fence is no instruction there, so dropping it "
                                 "changes nothing this test could see")),
])
def test_a_mutant_of_the_read_protocol_returns_wrong_bytes(daemon_factory, client_mutant, daemon_mutant):
    d = start(daemon_factory, daemon_mutant)
    readers = run_churn(d, seconds=8, readers=3, mutant=client_mutant)[2:]
    print(f"readers {readers}")
    assert sum(r["wrong"] for r in readers) > 0, f"the mutant went unseen: {readers}"


@pytest.mark.parametrize("client_mutant,daemon_mutant", [
    ("none", "slow-plan"),
    ("no-plan-word", "slow-plan"),
    ("none", "no-pin-scan"),
])
def test_a_pin_in_a_read_slot_keeps_its_entry_under_churn(daemon_factory, client_mutant, daemon_mutant):
    """Pins taken by read slots (client/pins.py) while writers evict without pause (they never
    delete here): every key a pinner was told is pinned is still there when it gets it, with its
    bytes. A daemon whose plans ignore pin slots, or a client that ignores the ring's plan word
    (every daemon here pauses 2 ms between a plan's scan and its evictions), loses pinned keys."""
    d = start(daemon_factory, daemon_mutant)
    pinners = run_churn(d, seconds=8, readers=3, mutant=client_mutant, mode="pinner", delete_share=0.0)[2:]
    print(f"pinners {pinners}")
    lost = sum(p["lost"] for p in pinners)
    if client_mutant == "none" and daemon_mutant == "slow-plan":
        assert sum(p["wrong"] for p in pinners) == 0, pinners
        # the slots took many (the rest met a plan under way, 2 ms of every eviction here, and asked)
        assert sum(p["slotted"] for p in pinners) > 0.1 * sum(p["pinned"] for p in pinners) > 50, pinners
    else:
        assert lost > 0, f"the mutant went unseen: {pinners}"
