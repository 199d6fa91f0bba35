"""CURVE on the peer plane (both ways: the owner admits only allowed peer keys, the puller only
talks to the peer key it was given), SIGHUP re-reading peers, and the [cluster] config rules."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peerutil import cluster, cluster_toml, free_port  # noqa: F401 - the fixture

from conftest import wait_for
from ecd.config import load_config
from ecd.curve import write_keypair
from ecd.errors import ConfigError

ECD = [sys.executable, "-m", "ecd"]


def _keys(tmp_path: Path, name: str) -> tuple[str, str, Path]:
    public, secret = write_keypair(str(tmp_path / name), name)
    allowed = tmp_path / f"{name}-allowed"
    allowed.mkdir()
    return public, secret, allowed


def _curve(secret: str, allowed: Path, peer: str, peer_key: str) -> str:
    return (f'curve_secret_key = "{secret}"\ncurve_allowed_keys = "{allowed}"\n'
            f'[cluster.peer_keys]\n"{peer}" = "{peer_key}"\n')


def test_curve_both_ways(tmp_path, daemon_factory):
    a_pub, a_sec, a_allowed = _keys(tmp_path, "a")
    b_pub, b_sec, b_allowed = _keys(tmp_path, "b")
    c_pub, c_sec, _ = _keys(tmp_path, "c")  # a key nobody allows
    (a_allowed / "b.key").write_text(Path(b_pub).read_text())  # a admits b; b admits nobody
    ea, eb = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    a = daemon_factory(size="64MiB", extra=cluster_toml(ea, [eb], _curve(a_sec, a_allowed, eb, b_pub)))
    b = daemon_factory(size="64MiB", extra=cluster_toml(eb, [ea], _curve(b_sec, b_allowed, ea, a_pub)))
    with a.client() as ca, b.client() as cb:
        ca.put("x", torch.arange(10))
        cb.put("y", torch.arange(20))
        # b -> a: a admits b's key, and b checks a's server key: works
        assert cb.fetch("x", peer=ea, timeout=5) is True
        assert torch.equal(cb.get("x"), torch.arange(10))
        # a -> b: b does not admit a's key: refused, at once rather than at the timeout
        assert ca.fetch("y", peer=eb, timeout=5) is False
        peers = {p["endpoint"]: p for p in ca.stats()["peers"]}
        assert peers[eb]["state"] == "refused", (ca.stats(), a.log())
        assert ca.stats()["fetch_failures"].get("refused", 0) >= 1
        # SIGHUP after allowing a: now it works
        (b_allowed / "a.key").write_text(Path(a_pub).read_text())
        b.proc.send_signal(signal.SIGHUP)
        assert wait_for(lambda: ca.fetch("y", peer=eb, timeout=3), timeout=30)
    # a puller that expects another server key (c's) for a refuses a: the server is checked too
    ed = f"tcp://127.0.0.1:{free_port()}"
    d_pub, d_sec, d_allowed = _keys(tmp_path, "d")
    (a_allowed / "d.key").write_text(Path(d_pub).read_text())
    a.proc.send_signal(signal.SIGHUP)
    d = daemon_factory(size="64MiB", extra=cluster_toml(ed, [ea], _curve(d_sec, d_allowed, ea, c_pub)))
    with d.client() as cd:
        assert cd.fetch("x", peer=ea, timeout=4) is False
    # and a puller without CURVE at all gets nothing from a CURVE owner
    e = daemon_factory(size="64MiB", extra=cluster_toml(f"tcp://127.0.0.1:{free_port()}", [ea]))
    with e.client() as ce:
        assert ce.fetch("x", peer=ea, timeout=4) is False


def test_sighup_rereads_peers(cluster):
    a, b, c = cluster(3, peers=False)
    with a.client() as ca, c.client() as cc:
        ca.put("k", torch.ones(3))
        with pytest.raises(Exception, match="cluster.peers is empty"):
            cc.fetch("k", timeout=3)
        text = Path(c.config).read_text().replace("peers = []", f'peers = ["{a.peer_endpoint}"]')
        Path(c.config).write_text(text)
        c.proc.send_signal(signal.SIGHUP)
        assert wait_for(lambda: "applied cluster.peers" in c.log(), timeout=10)
        assert cc.fetch("k", timeout=5) is True


@pytest.mark.parametrize("table, key", [
    ({"listen": "0.0.0.0:1"}, "cluster.listen"),
    ({"listen": "tcp://127.0.0.1:7480", "peers": ["10.0.0.1:7480"]}, "cluster.peers"),
    ({"listen": "tcp://127.0.0.1:7480", "peers": ["tcp://a:1", "tcp://a:1"]}, "cluster.peers"),
    ({"listen": "tcp://127.0.0.1:7480", "transport": "nixl", "tls": True}, "cluster.tls"),
    ({"listen": "tcp://127.0.0.1:7480", "transport": "udp"}, "cluster.transport"),
    ({"listen": "tcp://127.0.0.1:7480", "curve_secret_key": "/k"}, "cluster.curve_allowed_keys"),
    ({"listen": "tcp://127.0.0.1:7480", "curve_secret_key": "/k", "curve_allowed_keys": "/d",
      "peers": ["tcp://10.0.0.2:7480"]}, "cluster.peer_keys"),
    ({"listen": "tcp://127.0.0.1:7480", "fetch_timeout": 0}, "cluster.fetch_timeout"),
    ({"listen": "tcp://127.0.0.1:7480", "max_inflight": 0}, "cluster.max_inflight"),
    ({"listen": "tcp://127.0.0.1:7480", "max_leases_per_peer": 0}, "cluster.max_leases_per_peer"),
    ({"listen": "tcp://127.0.0.1:7480", "peer_queue_bytes": "64KiB"}, "cluster.peer_queue_bytes"),
    ({"listen": "tcp://127.0.0.1:7480", "colour": "red"}, "cluster.colour"),
])
def test_bad_cluster_values_name_the_key(table, key):
    with pytest.raises(ConfigError) as info:
        load_config({"cluster": table})
    assert str(info.value).startswith(key), str(info.value)


def test_derived_data_port():
    cfg = load_config({"cluster": {"listen": "tcp://127.0.0.1:7480"}}).cluster
    assert cfg.data_listen == "tcp://127.0.0.1:7481"
    assert load_config({"cluster": {"listen": "tcp://127.0.0.1:0"}}).cluster.data_listen == "tcp://127.0.0.1:0"


@pytest.mark.parametrize("cluster_text, needle", [
    ('listen = "tcp://0.0.0.0:7480"', "cluster.listen: tcp://0.0.0.0:7480 has no authentication"),
    ('listen = "tcp://127.0.0.1:7480"', "cluster.listen: tcp://127.0.0.1:7480 has no authentication"),
    ('listen = "tcp://127.0.0.1:7480"\npeers = ["bogus"]', "cluster.peers: each must be tcp://HOST:PORT"),
    ('listen = "tcp://127.0.0.1:7480"\ndata_listen = "tcp://127.0.0.2:7481"\ninsecure = true',
     "cluster.data_listen: must be on listen's host (127.0.0.1) or a wildcard"),
    ('listen = "tcp://127.0.0.1:7480"\ntransport = "nixl"\ntls = true\ninsecure = true', 'cluster.tls: applies to transport "tcp" only'),
    ('peers = ["tcp://127.0.0.1:7481"]', "cluster.peers: set cluster.listen too"),
])
def test_config_errors_are_one_line_exit_2(tmp_path, cluster_text, needle):
    path = tmp_path / "node.toml"
    path.write_text(f'[node]\nname = "cfgtest"\nruntime_dir = "{tmp_path}"\n[cluster]\n{cluster_text}\n')
    for command in (["check-config", str(path)], ["serve", "--config", str(path)]):
        proc = subprocess.run(ECD + command, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, (command, proc.stdout, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], proc.stderr
    ok = tmp_path / "ok.toml"
    ok.write_text(f'[node]\nname = "cfgtest"\nruntime_dir = "{tmp_path}"\n[cluster]\n'
                  'listen = "tcp://0.0.0.0:7480"\ninsecure = true\n')
    assert subprocess.run(ECD + ["check-config", str(ok)], capture_output=True, timeout=60).returncode == 0


@pytest.mark.parametrize("advertise", ["tcp://0.0.0.0:7480", "tcp://10.0.0.5:0", "10.0.0.5:7480"])
def test_advertise_must_be_dialable(advertise):
    with pytest.raises(ConfigError) as info:
        load_config({"cluster": {"listen": "tcp://127.0.0.1:7480", "advertise": advertise}})
    assert str(info.value).startswith("cluster.advertise"), str(info.value)


def test_clients_are_told_the_advertised_endpoint(cluster):
    """Behind NAT or a wildcard bind, the endpoint other nodes dial is not `listen`: clients (the
    vLLM connectors put it in kv_transfer_params) learn `advertise`; without it, `listen`."""
    a, b = cluster(2, extra=['advertise = "tcp://192.0.2.7:7480"', ""])
    with a.client() as ca, b.client() as cb:
        assert ca.cluster_listen == "tcp://192.0.2.7:7480"
        assert cb.cluster_listen == b.peer_endpoint
