"""A peer that floods the owner's control port with lookups (issue 23, attack 1).

The attacker is its own process (peer_attacker.py) on a raw DEALER. While it floods, an honest
client of the owner (a fresh Hello, put, get), an honest peer's fetch and the owner's /metrics
must each be served within their timeouts, and the owner's memory must stay bounded.
Before the fix, 70 lookups each naming one 1000-byte key 16,384 times, never read, took the
owner's RSS up by more than a GiB and stalled everything else for tens of seconds."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from peer_attacker import flood_key
from peerutil import cluster  # noqa: F401 - the fixture

from conftest import line_within, metric, proc_memory_kib, scrape_metrics, wait_for

ATTACKER = Path(__file__).resolve().parent / "peer_attacker.py"
MiB = 1 << 20
NS = "flood"
RSS_BOUND = 300 * MiB  # the bound the test asserts
RSS_ABORT = 700 * MiB  # unfixed daemons get there: the flood is stopped rather than the machine
HONEST_TIMEOUT = 5.0  # the honest parties' own timeouts (client requests, fetches, scrapes)


def rss_bytes(pid: int) -> int:
    return proc_memory_kib(pid)["VmRSS"] * 1024


def attack(endpoint: str, messages: int, distinct: int, repeat: int, read: bool,
           ttl_s: float = 60.0, pipelined: bool = False) -> subprocess.Popen:
    mode = "2" if pipelined else "1" if read else "0"
    return subprocess.Popen([sys.executable, str(ATTACKER), "lookups", endpoint, NS, str(messages),
                             str(distinct), str(repeat), mode, str(ttl_s)],
                            stdout=subprocess.PIPE, text=True)



def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def put_flood_keys(daemon, n: int) -> None:
    with daemon.client(namespace=NS, timeout=30) as c:
        for start in range(0, n, 512):
            c.put_many({flood_key(i): torch.zeros(4) for i in range(start, min(n, start + 512))})


class Honest(threading.Thread):
    """In a loop: a new client of the owner (Hello), put, get; the puller's client fetches a key
    the owner holds; the owner's /metrics is scraped. Each within HONEST_TIMEOUT; records the
    slowest round and every failure."""

    def __init__(self, owner, puller) -> None:
        super().__init__(daemon=True)
        self.owner, self.puller = owner, puller
        self.stop = threading.Event()
        self.rounds = 0
        self.slowest = 0.0
        self.laps: dict[str, float] = {}
        self.failures: list[str] = []

    def run(self) -> None:
        tensor = torch.arange(1 << 12, dtype=torch.float32)
        while not self.stop.is_set():
            key = f"honest-{self.rounds}"
            started = time.monotonic()
            try:
                with self.owner.client(namespace=NS, timeout=HONEST_TIMEOUT) as c:  # Hello
                    c.put(key, tensor)
                    assert torch.equal(c.get(key), tensor)
                self.lap("client", started)
                with self.puller.client(namespace=NS, timeout=HONEST_TIMEOUT + 2) as p:
                    assert p.fetch(key, peer=self.owner.peer_endpoint, timeout=HONEST_TIMEOUT) is True
                    assert torch.equal(p.get(key), tensor)
                self.lap("fetch", started)
                scrape_metrics(self.owner.metrics_port)
                self.lap("metrics", started)
            except Exception as exc:  # noqa: BLE001 - reported by finish()
                self.failures.append(f"round {self.rounds}: {exc!r}")
            self.slowest = max(self.slowest, time.monotonic() - started)
            self.rounds += 1
            time.sleep(0.05)

    def lap(self, what: str, since: float) -> None:
        """The slowest time from the round's start to the end of `what` (for the report)."""
        self.laps[what] = max(self.laps.get(what, 0.0), time.monotonic() - since)

    def finish(self) -> None:
        self.stop.set()
        self.join(60)
        laps = ", ".join(f"{k} {v:.2f}s" for k, v in self.laps.items())
        print(f"honest rounds {self.rounds}, slowest {self.slowest:.2f}s ({laps}), failures {len(self.failures)}")
        assert not self.failures, self.failures[:5]
        assert self.rounds >= 3, f"only {self.rounds} honest rounds got done"


def watch_rss(owner, attacker: subprocess.Popen, seconds: float) -> tuple[int, int]:
    """Sample the owner's RSS while the flood runs: (before, peak). Stops the attacker if the
    owner passes RSS_ABORT (an unfixed daemon would take the machine's memory)."""
    before = peak = rss_bytes(owner.proc.pid)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert owner.alive(), owner.log()[-3000:]
        peak = max(peak, rss_bytes(owner.proc.pid))
        if peak - before > RSS_ABORT:
            stop(attacker)
            break
        time.sleep(0.1)
    return before, peak


def serve_failures(owner, reason: str) -> float:
    return metric(scrape_metrics(owner.metrics_port), "ecd_transfer_failures_total", reason=reason)


def weather(owner, puller, attacker: subprocess.Popen) -> None:
    """Honest rounds (Honest) against the owner while the attacker floods it: every round is
    served, and the owner's RSS stays within RSS_BOUND of where it started."""
    honest = Honest(owner, puller)
    assert line_within(attacker) == "hello"
    honest.start()
    before, peak = watch_rss(owner, attacker, 12)
    print(f"owner RSS {before / MiB:.0f} MiB -> peak {peak / MiB:.0f} MiB (+{(peak - before) / MiB:.0f} MiB)")
    honest.finish()
    assert peak - before < RSS_BOUND, f"the owner grew {(peak - before) / MiB:.0f} MiB under the flood"


def test_a_flood_of_one_key_repeated_is_refused_and_the_owner_keeps_serving(cluster):  # noqa: F811
    """The issue's flood: 70 lookups, each one 1000-byte key 16,384 times, never read."""
    owner, puller = cluster(2)
    put_flood_keys(owner, 1)
    attacker = attack(owner.peer_endpoint, 70, 1, 16384, read=False)
    try:
        weather(owner, puller, attacker)
        # each lookup was refused with a reason: a key named twice is leased never, not 16,384 times
        assert serve_failures(owner, "serve_lookup_invalid") >= 1
        assert "names a key more than once" in owner.log()
        assert wait_for(lambda: metric(scrape_metrics(owner.metrics_port), "ecd_transfer_leases") == 0, timeout=10)
    finally:
        stop(attacker)
    assert owner.alive()


def test_a_peer_that_never_reads_its_leases_is_cut_off(cluster):  # noqa: F811
    """Lookups of 4096 distinct keys (~4.5 MB a reply), never read: past
    cluster.peer_queue_bytes of unread replies the owner closes the connection, and the
    session's leases go back at once."""
    owner, puller = cluster(2, extra=['peer_queue_bytes = "16MiB"', ""])
    put_flood_keys(owner, 4096)
    attacker = attack(owner.peer_endpoint, 40, 4096, 1, read=False)
    try:
        weather(owner, puller, attacker)
        assert wait_for(lambda: serve_failures(owner, "serve_backlog") >= 1, timeout=10), owner.log()[-3000:]
        assert "unread replies" in owner.log() and "cluster.peer_queue_bytes" in owner.log()
        # the cut-off session's leases went back (not after their 60 s TTL)
        assert wait_for(lambda: metric(scrape_metrics(owner.metrics_port), "ecd_transfer_leases") == 0, timeout=10)
    finally:
        stop(attacker)
    assert owner.alive()


@pytest.mark.parametrize("distinct, repeat, pipelined, expect", [
    (4096, 1, False, ["leased 4096", "leased 4096", "error 9 "]),  # the third would pass the bound
    # sent back to back: each lookup (leased over several turns of the loop) is done before the
    # next one is looked at, so the bound is checked against all the leases before it
    (4096, 1, True, ["leased 4096", "leased 4096", "error 9 "]),
    (2, 2, False, ["error 6 "]),  # a key named twice
])
def test_lookup_bounds_are_refused_with_a_reason(cluster, distinct, repeat, pipelined, expect):  # noqa: F811
    owner, = cluster(1, peers=False, extra=["max_leases_per_peer = 8192"])
    put_flood_keys(owner, distinct)
    attacker = attack(owner.peer_endpoint, len(expect), distinct, repeat, read=True, pipelined=pipelined)
    try:
        assert line_within(attacker) == "hello"
        lines = [line_within(attacker) for _ in expect]
        for line, want in zip(lines, expect):
            assert line.startswith(want), lines
        if expect[-1].startswith("error 9"):
            assert "cluster.max_leases_per_peer=8192" in lines[-1], lines
            assert serve_failures(owner, "serve_lease_limit") == 1
        else:
            assert "names a key more than once" in lines[-1], lines
        assert line_within(attacker) == f"sent {len(expect)}"
    finally:
        stop(attacker)
    with owner.client() as c:
        assert c.ping() > 0


def test_a_lookups_leases_go_back_at_its_ttl(cluster):  # noqa: F811
    """One timer for a whole lookup's leases (not one per key): still, each goes back at the
    lookup's TTL while the peer's session lives on."""
    owner, = cluster(1, peers=False)
    put_flood_keys(owner, 4096)
    attacker = attack(owner.peer_endpoint, 1, 4096, 1, read=True, ttl_s=1.0)
    try:
        assert line_within(attacker) == "hello"
        assert line_within(attacker) == "leased 4096"
        leases = lambda: metric(scrape_metrics(owner.metrics_port), "ecd_transfer_leases")  # noqa: E731
        assert wait_for(lambda: leases() == 0, timeout=10), leases()
        assert "node 'attacker' ended" not in owner.log()  # the TTL did it, not the session's end
    finally:
        stop(attacker)
