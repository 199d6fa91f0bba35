"""transport = "nixl" between real daemons: bit-identical fetches, absent keys, an owner or a puller
SIGKILLed mid-fetch, and the start-up errors.

UCX may bind and advertise every interface it finds, and no traffic may ever leave loopback on
this machine: the daemons run only inside a network namespace that has nothing but `lo`, with
`UCX_TLS=tcp UCX_NET_DEVICES=lo`. `test_nixl_in_a_network_namespace` makes that namespace
(`unshare -n`, root) and runs this module's `inner` tests in it, in a child pytest; they refuse
to run anywhere else (and check that `lo` is the only interface). Where NIXL does not import or
namespaces cannot be made, that test skips and says why.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from peerutil import BIG_KEYS as KEYS
from peerutil import cluster  # noqa: F401 - the fixture
from peerutil import fetch_concurrently, fetch_in_thread, leases_back, put_big

from conftest import wait_for, write_config
from ecd.errors import DaemonUnavailable, KeyNotFound

INNER = os.environ.get("ECD_NIXL_NETNS") == "1"
NIXL = 'transport = "nixl"'
ROOT = Path(__file__).resolve().parents[2]

# Outside the namespace these are deselected (tests/conftest.py), not skipped: nothing to report.
inner = pytest.mark.netns_inner


def _nixl_missing() -> str | None:
    from ecd.transport.nixl import NixlUnavailable, load_nixl
    try:
        load_nixl()
    except NixlUnavailable as exc:
        return str(exc)
    return None


def _namespace_missing() -> str | None:
    if os.geteuid() != 0:
        return "not root: `unshare -n` needs CAP_SYS_ADMIN"
    for tool in ("unshare", "ip"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    probe = subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"], capture_output=True, text=True,
                           timeout=30)
    if probe.returncode != 0:
        return f"cannot make a network namespace: {probe.stderr.strip() or probe.returncode}"
    return None


@pytest.mark.skipif(INNER, reason="already inside the namespace")
@pytest.mark.timeout(900)  # the whole inner suite (~1 min here; each inner test has its own 120 s)
def test_nixl_in_a_network_namespace():
    missing = _nixl_missing() or _namespace_missing()
    if missing:
        pytest.skip(f"transport nixl not tested: {missing}")
    env = dict(os.environ, ECD_NIXL_NETNS="1", UCX_TLS="tcp", UCX_NET_DEVICES="lo")
    script = 'ip link set lo up && exec "$0" -m pytest -q -p no:cacheprovider -rs --tb=short -k "$2" "$1"'
    proc = subprocess.run(["unshare", "-n", "sh", "-c", script, sys.executable, __file__,
                           "not in_a_network_namespace and not does_not_import"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    print(out[-12000:])  # with a failure: its short traceback, then its daemons' state and log tails
    assert proc.returncode == 0, out[-12000:]
    summary = out.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, summary


@pytest.fixture
def only_lo():
    """Never talk NIXL where another interface exists (if_nameindex sees this namespace's)."""
    names = sorted(name for _, name in socket.if_nameindex())
    if names != ["lo"]:
        pytest.fail(f"nixl tests must run in a namespace with only lo, found {names}")
    for var in ("UCX_TLS", "UCX_NET_DEVICES"):
        assert os.environ.get(var), f"{var} is not set"


@inner
def test_fetch_from_named_peer_is_bit_identical(only_lo, cluster):
    a, b = cluster(2, extra=[NIXL, NIXL])
    tensors = {
        "f32": torch.randn(1000, 37),
        "bf16": torch.randn(4096, 17).to(torch.bfloat16),
        "i64": torch.randint(-2**62, 2**62, (333,), dtype=torch.int64),
        "u8": torch.randint(0, 256, (5 << 20,), dtype=torch.uint8),
        "big": torch.randn(20 << 20),  # 80 MiB: many UCX fragments
        "empty": torch.empty(0, 4),
    }
    with a.client() as ca, b.client() as cb:
        for key, t in tensors.items():
            ca.put(key, t, checksum=key != "u8")  # one without a checksum: the bytes must still match
        keys = list(tensors) + ["absent"]
        assert cb.fetch(keys, peer=a.peer_endpoint, timeout=20) == [True] * len(tensors) + [False]
        for key, t in tensors.items():
            got = cb.get(key)
            assert got.dtype == t.dtype and got.shape == t.shape
            if t.numel():
                assert torch.equal(got.view(torch.uint8), t.view(torch.uint8)), key
        assert cb.fetch(["absent", "f32"], peer=a.node, timeout=10) == [False, True]
        # the owner's leases come back by peer_done (asynchronous), and it counts what it served
        assert leases_back(ca, timeout=10), ca.stats()
        served = wait_for(lambda: {p["node"]: p for p in ca.stats()["peers"]}.get(b.node), timeout=15)
        assert served["served_entries"] == len(tensors), served
        sb = cb.stats()
        assert sb["entries_writing"] == 0 and sb["fetches_in_flight"] == 0 and not sb["fetch_failures"], sb
        # a local put and a second fetch after the owner rewrote a key: the new bytes
        ca.put("f32", torch.zeros(3))
        cb.delete(["f32"])
        assert cb.fetch(["f32"], peer=a.peer_endpoint, timeout=10) == [True]
        assert torch.equal(cb.get("f32"), torch.zeros(3))
    assert "transport nixl" in b.log()


@inner
def test_configured_peers_first_holder_wins_and_concurrent_fetches_pull_once(only_lo, cluster):
    a, b, c = cluster(3, extra=[NIXL, NIXL, NIXL])
    with a.client() as ca, b.client() as cb, c.client() as cc:
        ca.put("only-a", torch.arange(100, dtype=torch.float64))
        cb.put("only-b", torch.arange(50, dtype=torch.int32))
        ca.put("both", torch.ones(10))
        cb.put("both", torch.ones(10))
        ca.put("hot", torch.randn(4 << 20))  # 16 MiB
        assert cc.fetch(["only-a", "only-b", "both", "nowhere"], timeout=20) == [True, True, True, False]
        assert torch.equal(cc.get("only-a"), torch.arange(100, dtype=torch.float64))
        assert torch.equal(cc.get("only-b"), torch.arange(50, dtype=torch.int32))
        results = fetch_concurrently(c, "hot", a.peer_endpoint)
        assert results == [True] * 6
        assert torch.equal(cc.get("hot"), ca.get("hot"))
        for client in (ca, cb):  # the loser's lease on "both" was released, the winners' done
            assert leases_back(client, timeout=10), client.stats()
        served = wait_for(lambda: {p["node"]: p for p in ca.stats()["peers"]}.get(c.node), timeout=15)
        served_b = wait_for(lambda: {p["node"]: p for p in cb.stats()["peers"]}.get(c.node), timeout=15)
        # only-a, only-b, "both" from whichever won, and "hot" once: 4 in all
        assert served["served_entries"] + served_b["served_entries"] == 4, (served, served_b)


@inner
def test_owner_restart_reloads_its_agent(only_lo, cluster):
    a, b = cluster(2, extra=[NIXL, NIXL])
    with a.client() as ca, b.client() as cb:
        ca.put("x", torch.arange(10))
        assert cb.fetch(["x"], peer=a.peer_endpoint, timeout=10) == [True]
    a.stop()
    a.start()  # same endpoint, new epoch: a new NIXL agent, whose metadata the puller loads
    with a.client() as ca, b.client() as cb:
        ca.put("y", torch.arange(20))
        assert wait_for(lambda: cb.fetch(["y"], peer=a.peer_endpoint, timeout=5) == [True], timeout=20)
        assert torch.equal(cb.get("y"), torch.arange(20))


@inner
def test_owner_killed_mid_fetch(only_lo, cluster):
    a, b = cluster(2, size="1GiB", extra=[NIXL, NIXL])
    with a.client() as ca:
        put_big(ca)
    # The puller connects to the owner's agent once welcomed; the owner dies mid-READ on that
    # connection (UCX itself aborts a process whose peer dies while it connects: docs/operating.md).
    assert wait_for(lambda: "NIXL: connected to agent" in b.log(), timeout=30), b.log()[-3000:]
    with b.client() as watcher:
        thread, out = fetch_in_thread(b, a.peer_endpoint, timeout=20)
        assert wait_for(lambda: watcher.stats()["entries_writing"] > 0, timeout=30, interval=0.005), \
            "the transfer never started"
        a.stop(signal.SIGKILL)
        thread.join(40)
        assert b.alive(), f"the puller died (UCX aborted?): {b.log()[-3000:]}"
        assert not thread.is_alive(), "the fetch hung"
        assert out["elapsed"] < 20 + 10, (out, b.log()[-4000:])
        assert out["result"] == [False] * len(KEYS), out
        for key in KEYS:  # nothing half visible
            with pytest.raises(KeyNotFound):
                watcher.get(key)
        s = watcher.stats()
        assert s["entries_writing"] == 0 and s["read_leases"] == 0 and s["fetches_in_flight"] == 0, s
        assert s["entries_ready"] == 0 and s["used_bytes"] - s["reserved_bytes"] == 0, s
        assert s["fetch_failures"].get("connection", 0) >= 1, (s["fetch_failures"], b.log()[-3000:])
        watcher.put("after", torch.ones(4))  # the node keeps serving
        assert torch.equal(watcher.get("after"), torch.ones(4))


@inner
def test_owner_stopped_mid_read_times_out_cleanly(only_lo, cluster):
    """SIGSTOP mid-READ: nothing moves, the deadline passes, the READ is cancelled before the
    extents are dropped; once the owner runs again, fetches work (its agent is loaded afresh)."""
    a, b = cluster(2, size="1GiB", extra=[NIXL, NIXL])
    with a.client() as ca:
        put_big(ca)
    with b.client() as watcher:
        thread, out = fetch_in_thread(b, a.peer_endpoint, timeout=4)
        assert wait_for(lambda: watcher.stats()["entries_writing"] > 0, timeout=30, interval=0.002), \
            "the transfer never started"
        a.proc.send_signal(signal.SIGSTOP)
        try:
            thread.join(30)
            assert not thread.is_alive(), "the fetch hung"
            assert out["elapsed"] < 4 + 5, out
            s = watcher.stats()
            # the READ may have finished before the stop took hold: then the keys are whole
            if out["result"] != [True] * len(KEYS):
                assert s["fetch_failures"], s
            for key, ok in zip(KEYS, out["result"]):
                if not ok:
                    with pytest.raises(KeyNotFound):
                        watcher.get(key)
            assert s["entries_writing"] == 0 and s["read_leases"] == 0 and s["fetches_in_flight"] == 0, s
        finally:
            a.proc.send_signal(signal.SIGCONT)
        assert wait_for(lambda: watcher.fetch(KEYS, peer=a.peer_endpoint, timeout=20) == [True] * len(KEYS),
                        timeout=60)
        for i, key in enumerate(KEYS):
            assert torch.equal(watcher.get(key)[:4], torch.full((4,), i, dtype=torch.float32))


@inner
def test_puller_killed_mid_fetch_gives_the_owners_leases_back(only_lo, cluster):
    a, b = cluster(2, size="1GiB", extra=[NIXL, NIXL])
    # The owner is a peer of the puller too: it connects ahead to the puller's agent once
    # welcomed. The puller must not die inside that window (UCX aborts a process whose peer dies
    # while it connects: docs/operating.md); CI once killed it there, and the owner was gone.
    assert wait_for(lambda: "NIXL: connected to agent" in a.log() or "cannot connect ahead" in a.log(),
                    timeout=30), a.log()[-3000:]
    with a.client() as ca:
        put_big(ca)
        thread, out = fetch_in_thread(b, a.peer_endpoint, timeout=8, client_timeout=3)
        assert wait_for(lambda: ca.stats()["transfer_leases"] > 0, timeout=30, interval=0.005)
        b.stop(signal.SIGKILL)
        assert a.alive(), f"the owner died with its puller (UCX aborted?): {a.log()[-3000:]}"
        # no peer_done ever comes: the session goes silent (peer_ttl = 3 s) and the leases go back
        assert leases_back(ca, timeout=20), ca.stats()
        assert ca.delete(KEYS) == [True] * len(KEYS)
        s = ca.stats()
        assert s["used_bytes"] - s["reserved_bytes"] == 0 and s["entries_retired"] == 0, s
    # The killed daemon's client gives up within its own timeout, never hangs; and no client
    # thread may outlive the test (pyzmq torn down under it at exit aborts the process).
    thread.join(60)
    assert not thread.is_alive(), "the client of the killed puller hung"
    assert isinstance(out.get("error"), DaemonUnavailable), out


@inner
def test_tcp_and_nixl_peers_refuse_each_other(only_lo, cluster):
    a, b = cluster(2, extra=["", NIXL])
    with a.client() as ca, b.client() as cb:
        ca.put("k", torch.ones(3))
        assert cb.fetch(["k"], peer=a.peer_endpoint, timeout=5) == [False]
        assert cb.stats()["fetch_failures"].get("refused", 0) >= 1


def test_nixl_that_does_not_import_is_a_one_line_start_error(tmp_path):
    """transport = "nixl" where NIXL cannot import: exit 2, one line naming cluster.transport."""
    shadow = tmp_path / "shadow"
    for name in ("nixl", "nixl_cu12", "nixl_cu13"):  # each import fails, as on a host without it
        (shadow / name).mkdir(parents=True)
        (shadow / name / "__init__.py").write_text("raise ImportError('not here (test)')\n")
    runtime = tempfile.mkdtemp(prefix="ecd-", dir="/tmp")  # a unix socket path must be short
    path = write_config(runtime, f"nixlcfg{os.getpid()}", "16MiB",
                        '[cluster]\nlisten = "tcp://127.0.0.1:0"\ntransport = "nixl"\ninsecure = true\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shadow), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "ecd", "serve", "--config", str(path)], capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    shutil.rmtree(runtime, ignore_errors=True)
    assert len(lines) == 1 and "cluster.transport:" in lines[0] and "nixl-cu12" in lines[0], proc.stderr
