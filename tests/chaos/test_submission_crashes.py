"""Puts without a message under crashes and hostile producers (issue 43, item 5): a producer
killed mid-copy or between record fields leaves nothing visible and its lease space returns; a
daemon killed with records pending or in the middle of carving a lease adopts only committed
entries, bit-identical, with no extent owned twice; a hostile producer's records are each
refused with a reason and the daemon keeps serving. Mutants show the checks can fail."""
from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
import torch

from conftest import REPO, entry_bytes, metric, scrape_metrics, wait_for

CHURN = REPO / "tests" / "chaos" / "submission_churn.py"
N = 16384  # 64 KiB of float32
WRITE_TTL = 3.0  # the quarantine of a killed daemon's unfinished writes, in the restarted one


def churn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(CHURN), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=REPO)


@pytest.mark.parametrize("stage,visible", [("mid-copy", False), ("no-seq", False), ("posted", True)])
def test_a_producer_killed_mid_put_leaves_nothing_half_done(daemon, stage, visible):
    """Killed mid-copy or before its sequence number: nothing visible. Killed after posting the
    whole record: the put is committed as the session ends (its bytes were all copied). Either
    way every leased byte returns."""
    with daemon.client() as c:
        c.put("before", torch.ones(N))
        leased = metric(scrape_metrics(daemon.metrics_port), "ecd_leased_bytes")  # this client's own leases
        proc = churn("producer-killed", daemon.endpoint, stage, "victim")
        assert proc.stdout.readline().strip() == "ready"
        assert metric(scrape_metrics(daemon.metrics_port), "ecd_leased_bytes") > leased
        proc.stdin.write("kill yourself\n")
        proc.stdin.flush()
        assert proc.wait(10) == -signal.SIGKILL
        assert wait_for(lambda: metric(scrape_metrics(daemon.metrics_port), "ecd_leased_bytes") == leased)
        assert c.exists("victim") is visible
        if visible:
            assert torch.equal(c.get("victim"), torch.full((N,), 7.0))
        assert entry_bytes(c.stats()) == (1 + visible) * N * 4
        assert torch.equal(c.get("before"), torch.ones(N))


def hostile_refusals(d) -> dict[str, dict]:
    proc = churn("hostile", d.endpoint)
    out, _ = proc.communicate(timeout=60)
    return {line["case"]: line for line in map(json.loads, out.splitlines())}


def test_every_malformed_record_is_refused_with_a_reason(daemon):
    with daemon.client() as c:
        c.put("victim", torch.full((N,), 3.0))
        cases = hostile_refusals(daemon)
        reasons = {name: case.get("refused") for name, case in cases.items() if name != "after"}
        assert reasons == {"foreign-lease": "StaleGeneration", "outside-lease": "InvalidRequest",
                           "misaligned": "InvalidRequest", "unknown-dtype": "InvalidRequest",
                           "bad-utf8": "InvalidRequest", "unknown-flags": "InvalidRequest",
                           "size-mismatch": "InvalidRequest", "behind-the-front": "InvalidRequest",
                           "bad-meta": "InvalidRequest"}, cases
        assert "not an EntryMeta" in cases["bad-meta"]["message"]
        assert "not in the free part" in cases["outside-lease"]["message"]
        assert "nbytes=100 but shape [1024] of float32 needs 4096" in cases["size-mismatch"]["message"]
        assert "aligned" in cases["misaligned"]["message"]
        assert cases["after"]["ok"]
        assert torch.equal(c.get("victim"), torch.full((N,), 3.0))
        assert not any(c.exists([f"h-{name}" for name in reasons]))
        wait_for(lambda: c.stats()["clients"] == 1)
        assert entry_bytes(c.stats()) == N * 4 + 4096  # victim and "after": nothing else kept


def test_a_daemon_without_the_bounds_check_is_caught(daemon_factory):
    """Mutant: the daemon takes a record's offset wherever it lies."""
    d = daemon_factory(start=False)
    d.start(prefix=(sys.executable, str(CHURN), "daemon", "no-bounds-check", "--"))
    with d.client() as c:
        c.put("victim", torch.full((N,), 3.0))
        cases = hostile_refusals(d)
        assert cases["outside-lease"].get("refused") is None, "the mutant went unseen"


def adopting_daemon(daemon_factory):
    return daemon_factory(size="64MiB", extra=f'[leases]\nwrite_ttl = "{WRITE_TTL:g}s"', start=False)


def test_records_pending_at_a_daemon_kill_are_dropped_and_committed_ones_adopted(daemon_factory):
    d = adopting_daemon(daemon_factory)
    d.start()
    with d.client() as c:
        for i in range(20):
            c.put(f"kept{i}", torch.full((N,), float(i)), wait=False)
        c.flush()
        d.proc.send_signal(signal.SIGSTOP)  # the daemon reads no more records
        for i in range(5):  # 80 KiB: room the leases the daemon granted ahead have
            c.put(f"lost{i}", torch.full((4096,), -1.0), wait=False)
        d.proc.send_signal(signal.SIGKILL)
        d.stop()
    d.start()
    with d.client() as c:
        restart = c.stats()["restart"]
        assert restart["adopted"] and restart["entries"] == 20, restart
        assert not any(c.exists([f"lost{i}" for i in range(5)]))
        for i in range(20):
            assert torch.equal(c.get(f"kept{i}"), torch.full((N,), float(i)))
        # the killed run's leases are quarantined, then free: only the entries stay
        assert wait_for(lambda: "free again" in d.log(), timeout=WRITE_TTL + 10, interval=0.1)
        assert entry_bytes(c.stats()) == 20 * N * 4
        for i in range(40):  # the freed space is used again without touching what was adopted
            c.put(f"new{i}", torch.full((N,), 100.0 + i), wait=False)
        c.flush()
        for i in range(20):
            assert torch.equal(c.get(f"kept{i}"), torch.full((N,), float(i)))
        assert entry_bytes(c.stats()) == 60 * N * 4


@pytest.mark.parametrize("carves", [1, 7])
def test_a_daemon_killed_while_carving_a_lease_owns_every_byte_once(daemon_factory, carves):
    """SIGKILL between a carve's new intent and its entry's record: the restart adopts exactly
    the entries committed before, and no extent twice (the pool's bytes add up)."""
    d = adopting_daemon(daemon_factory)
    d.start(prefix=(sys.executable, str(CHURN), "daemon", f"kill-mid-carve:{carves}", "--"))
    with d.client() as c:
        for i in range(carves + 3):
            try:
                c.put(f"k{i}", torch.full((N,), float(i)), wait=False)
            except Exception:  # the daemon is gone: the rest are lost with it
                break
        assert wait_for(lambda: not d.alive(), timeout=10)
    d.stop()
    d.start()
    with d.client() as c:
        restart = c.stats()["restart"]
        assert restart["adopted"] and restart["entries"] == carves - 1, restart
        present = c.exists([f"k{i}" for i in range(carves + 3)])
        assert present == [i < carves - 1 for i in range(carves + 3)]
        for i in range(carves - 1):
            assert torch.equal(c.get(f"k{i}"), torch.full((N,), float(i)))
        assert wait_for(lambda: "free again" in d.log(), timeout=WRITE_TTL + 10, interval=0.1)
        assert entry_bytes(c.stats()) == (carves - 1) * N * 4
        for i in range(50):
            c.put(f"n{i}", torch.full((N,), 50.0 + i), wait=False)
        c.flush()
        for i in range(carves - 1):
            assert torch.equal(c.get(f"k{i}"), torch.full((N,), float(i)))
        assert entry_bytes(c.stats()) == (carves - 1 + 50) * N * 4
