"""What every chaos scenario must leave true, checked by one helper: `assert_healthy(daemon)`.

1. no corrupted read: every entry the daemon holds is read back and compared with the payload
   its key determines (chaos_worker.payload);
2. no leaked lease or extent: once the scenario's clients are gone, no read/write leases, waiters,
   retired entries or reservations remain, and the pool's used bytes are exactly the entries'
   (stats and the /metrics exposition agree);
3. a brand-new client process can put, get, view and delete;
4. after the daemon stops (SIGTERM, exit 0) and its holder lets the pool go, no file of its node
   is left in /dev/shm.
"""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from chaos_worker import matches
from conftest import metric_samples, scrape_metrics, shm_files, wait_for
from ecd.memory.allocator import align_up

WORKER = Path(__file__).resolve().parent / "chaos_worker.py"


class Worker:
    """A chaos_worker.py process; stdout is read line by line (or left in a file)."""

    def __init__(self, *args: str, stdout_file: str | None = None) -> None:
        self._out = open(stdout_file, "w") if stdout_file else None
        self.proc = subprocess.Popen([sys.executable, str(WORKER), *args], stdin=subprocess.PIPE,
                                     stdout=self._out or subprocess.PIPE, text=True, bufsize=1)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def read(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited with {self.proc.wait()}")
        return line.strip()

    def ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.read()

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a stopped process dies on SIGKILL too, but be explicit
            self.proc.kill()
        self.proc.wait()
        if self._out:
            self._out.close()


def serving_worker(endpoint: str, namespace: str = "default") -> Worker:
    w = Worker("serve", endpoint, namespace)
    assert w.read() == "ready", "worker did not start"
    return w


def stopped(pid: int) -> bool:
    """The process is in the stopped state (SIGSTOP took effect)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def scrape(port: int) -> dict[str, float]:
    """The /metrics exposition as {series: value}."""
    return metric_samples(scrape_metrics(port))


def _quiescent(c, pins: int):
    s = c.stats()
    ok = (s["clients"] == 1 and s["read_leases"] == 0 and s["waiters"] == 0 and s["entries_writing"] == 0
          and s["entries_retired"] == 0 and s["reservations"] == 0 and s["reserved_bytes"] == 0
          and s["pins"] == pins)
    return ok and s


def check_accounting(daemon, c, pins: int = 0) -> dict:
    """Leases, writes, waiters all gone; used bytes == the live entries' (aligned) bytes."""
    stats = wait_for(lambda: _quiescent(c, pins), timeout=15.0)
    if not stats:
        s = c.stats()
        raise AssertionError("leaked state once the scenario's clients were gone: " + ", ".join(
            f"{k}={s[k]}" for k in ("clients", "read_leases", "waiters", "entries_writing", "entries_retired",
                                    "reservations", "reserved_bytes", "pins")))
    total, entries = c.keys(None, limit=1_000_000)
    assert total == len(entries) == stats["entries_ready"]
    entry_bytes = sum(align_up(max(e["nbytes"], 1)) for e in entries)
    leased = stats["leased_bytes"]  # the checking client's put leases (the only session left)
    assert stats["used_bytes"] - leased == entry_bytes, (
        f"pool used {stats['used_bytes']} bytes ({leased} leased) but the {total} live entries hold "
        f"{entry_bytes}: leaked extents")
    assert sum(used for _, used in stats["pools"]) == stats["used_bytes"]
    assert all(e["readers"] == 0 for e in entries)
    if daemon.metrics_port:
        m = scrape(daemon.metrics_port)
        assert m['ecd_leases{kind="read"}'] == 0 and m['ecd_leases{kind="write"}'] == 0
        assert m["ecd_waiters"] == 0 and m['ecd_entries{state="writing"}'] == 0
        assert m['ecd_entries{state="ready"}'] == total
        assert sum(v for k, v in m.items() if k.startswith("ecd_pool_used_bytes{")) == entry_bytes + m["ecd_leased_bytes"]
    assert stats["errors"].get("unhandled", 0) == 0, stats["errors"]
    return stats


def check_reads(daemon, c) -> int:
    """Every entry reads back as exactly its key's payload; returns how many were checked."""
    from ecd import Client, KeyNotFound
    _, entries = c.keys(None, limit=1_000_000)
    clients = {}
    try:
        for e in entries:
            ns, key = e["ns"], e["key"]
            assert "#" in key, f"{ns}/{key}: chaos tests write only keys of the form NAME#NUMEL"
            if ns not in clients:
                clients[ns] = Client(daemon.endpoint, namespace=ns, timeout=10.0)
            try:
                got = clients[ns].get(key)
            except KeyNotFound:
                continue  # evicted meanwhile: not a wrong read
            assert matches(key, got), f"corrupted read of {ns}/{key}"
    finally:
        for client in clients.values():
            client.close()
    return len(entries)


def check_fresh_process(daemon) -> None:
    result = subprocess.run([sys.executable, str(WORKER), "probe", daemon.endpoint],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def check_stop_leaves_nothing(daemon) -> None:
    assert daemon.alive(), f"the daemon died: {daemon.log()[-3000:]}"
    assert daemon.stop(signal.SIGTERM, timeout=30) == 0
    # The pool and its journal stay for the next run ([restart]: held by the holder); the ring,
    # the socket and the lock go with the daemon. Once the holder lets go, nothing is left.
    assert not [name for name in shm_files(daemon.node) if name.endswith((".ring", ".lock"))], shm_files(daemon.node)
    daemon.release_pool()
    left = wait_for(lambda: shm_files(daemon.node) == [], timeout=5.0)
    assert left, f"left in /dev/shm after the daemon stopped and its holder let go: {shm_files(daemon.node)}"
    assert "Traceback" not in daemon.log(), daemon.log()[-3000:]


def assert_healthy(daemon, pins: int = 0, stop: bool = True) -> None:
    """The four invariants, in an order that lets each see the others' leftovers: call it once
    the scenario's own clients are gone (killed, closed or stopped). `pins`: pins still expected
    (pins of live-but-finished scenario clients that were never released)."""
    assert daemon.alive(), f"the daemon died: {daemon.log()[-3000:]}"
    from ecd import Client
    with Client(daemon.endpoint, timeout=10.0) as c:
        check_fresh_process(daemon)
        check_accounting(daemon, c, pins)
        check_reads(daemon, c)
        c.ping()  # the reads' fire-and-forget releases are handled before this returns
        check_accounting(daemon, c, pins)
    if stop:
        check_stop_leaves_nothing(daemon)
