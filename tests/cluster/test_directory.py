"""The fleet directory ([cluster] directory): real daemons on 127.0.0.1 and a real redis-server
started by the test (tests/redis_server.py), never any other address."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import wait_for
from ecd.config import load_config
from ecd.curve import write_keypair
from ecd.daemon.peer.directory_store import holders, live_nodes
from ecd.errors import ConfigError
from ecd.protocol import EncoderMeta, PutInline
from peerutil import cluster_toml, free_port
from redis_server import RedisServer, redis_server, redis_with_password  # noqa: F401 - the fixtures

TTL = 3.0  # the shortest directory_ttl the config takes: a dead node is gone in about this


def directory_toml(url: str, extra: str = "") -> str:
    return f'directory = "{url}"\ndirectory_ttl = "{TTL}s"\ndirectory_timeout = "0.5s"\n{extra}'


def start_fleet(daemon_factory, url: str, n: int, extra: str = "") -> list:
    """n daemons with no static peers, each registered in the directory at `url`."""
    nodes = []
    for _ in range(n):
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        d = daemon_factory(size="32MiB", extra=cluster_toml(endpoint, [], directory_toml(url, extra)))
        d.peer_endpoint = endpoint
        nodes.append(d)
    return nodes


def peers_up(d) -> set[str]:
    with d.client() as c:
        return {p["node"] for p in c.stats()["peers"] if p["state"] == "up"}


def peer_nodes(d) -> set[str]:
    with d.client() as c:
        return {p["node"] for p in c.stats()["peers"]}


def put_encoder(d, key: str, value: float, ns: str = "default") -> torch.Tensor:
    """A put that says EncoderMeta (an encoder-cache entry: the directory's default key map)."""
    t = torch.full((64,), value, dtype=torch.float32)
    with d.client() as c:
        c.request(PutInline(0, ns, key, "float32", [64], t.numpy().tobytes(), meta=EncoderMeta(key, 4)))
    return t


def directory_stats(d) -> dict:
    with d.client() as c:
        return c.stats()["directory"]


def test_three_daemons_find_each_other_with_no_static_peers(daemon_factory, redis_server):
    a, b, c = start_fleet(daemon_factory, redis_server.url, 3)
    names = {a.node, b.node, c.node}
    assert wait_for(lambda: all(peers_up(d) == names - {d.node} for d in (a, b, c)), timeout=20)
    assert set(live_nodes(redis_server.client())) == names
    stats = directory_stats(a)
    assert stats["up"] and set(stats["nodes"]) == names and stats["counts"]["errors"] == 0
    record = redis_server.client().hgetall(f"ecd:node:{b.node}")
    assert record["endpoint"] == b.peer_endpoint and record["epoch"] and record["health"] == "ok"
    out = subprocess.run([sys.executable, "-m", "ecd", "status", "--config", str(a.config)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "directory redis://" in out.stdout and "3 live node(s)" in out.stdout and b.node in out.stdout


def test_fetch_by_directory_lookup_asks_only_the_holder(daemon_factory, redis_server):
    a, b, c = start_fleet(daemon_factory, redis_server.url, 3)
    assert wait_for(lambda: len(peers_up(a)) == 2, timeout=20)
    t = put_encoder(b, "img-1", 7.0)
    with b.client() as cb:
        cb.put("plain", torch.ones(8))  # no EncoderMeta: not in the directory by default
    client = redis_server.client()
    assert wait_for(lambda: holders(client, "default", ["img-1"]) == [[b.node]], timeout=10)
    assert holders(client, "default", ["plain"]) == [[]]
    with a.client() as ca:
        assert ca.fetch("img-1") is True
        assert torch.equal(ca.get("img-1"), t)
    stats = directory_stats(a)
    assert stats["counts"]["lookups"] == 1 and stats["counts"]["found"] == 1
    assert stats["routed"] == {b.node: 1}  # fetched from the holder the lookup named
    with a.client() as ca:
        peers = {p["node"]: p for p in ca.stats()["peers"]}
    assert peers[b.node]["fetched_entries"] == 1 and peers[c.node]["fetched_entries"] == 0
    with c.client() as cc:  # C was not asked: no lease, no send
        assert {p["node"]: p["served_entries"] for p in cc.stats()["peers"]}.get(a.node, 0) == 0
    # The metadata came with the bytes: A's copy is an encoder-cache entry too, now in the directory.
    assert wait_for(lambda: sorted(holders(client, "default", ["img-1"])[0]) == sorted([a.node, b.node]), timeout=10)
    # A key the directory does not know: the old way (every peer asked), a second lookup.
    with a.client() as ca:
        assert ca.fetch("plain") is True
    assert directory_stats(a)["counts"]["unknown"] == 1


def test_a_killed_daemon_drops_out_after_the_ttl(daemon_factory, redis_server):
    a, b, c = start_fleet(daemon_factory, redis_server.url, 3)
    put_encoder(c, "img-c", 1.0)
    client = redis_server.client()
    assert wait_for(lambda: len(live_nodes(client)) == 3 and holders(client, "default", ["img-c"]) == [[c.node]],
             timeout=20)
    c.stop(signal.SIGKILL)
    killed = time.monotonic()
    assert wait_for(lambda: c.node not in live_nodes(client), timeout=TTL + 5)
    gone = time.monotonic() - killed
    assert gone <= TTL + 1.0, gone
    assert holders(client, "default", ["img-c"]) == [[]]  # its keys are not offered any more
    assert wait_for(lambda: c.node not in peer_nodes(a), timeout=TTL + 5)
    assert wait_for(lambda: client.scard("ecd:k:7:default:img-c") == 0, timeout=TTL + 5)  # pruned: forgotten


def test_a_fetch_in_flight_when_its_holder_leaves_fails_cleanly(daemon_factory, redis_server):
    """The holder is SIGKILLed; A fetches its key until the directory drops it. A fetch whose
    request to the dead holder was still waiting when the directory closed that link answers
    "not local" with a reason: it is not a cancelled task (once answered "daemon is shutting
    down"), and A serves on."""
    a, b, c = start_fleet(daemon_factory, redis_server.url, 3)
    put_encoder(c, "img-c", 1.0)
    client = redis_server.client()
    assert wait_for(lambda: len(peers_up(a)) == 2 and holders(client, "default", ["img-c"]) == [[c.node]],
                    timeout=20)
    c.stop(signal.SIGKILL)
    outcomes = []
    with a.client() as ca:
        while c.node in live_nodes(client) or c.node in peer_nodes(a):
            outcome = ca.fetch_detailed("img-c", timeout=10.0)
            assert not outcome.local and outcome.reason, outcome
            outcomes.append(outcome.reason)
        assert outcomes
        ca.put("still-serving", torch.ones(4))
        assert torch.equal(ca.get("still-serving"), torch.ones(4))


@pytest.mark.parametrize("keys", ["encoder"])
def test_store_killed_and_restarted_empty(daemon_factory, redis_server, keys):
    a, b = start_fleet(daemon_factory, redis_server.url, 2)
    assert wait_for(lambda: peers_up(a) == {b.node}, timeout=20)
    put_encoder(b, "img-1", 1.0)
    client = redis_server.client()
    assert wait_for(lambda: holders(client, "default", ["img-1"]) == [[b.node]], timeout=10)
    redis_server.kill()
    assert wait_for(lambda: not directory_stats(a)["up"] and not directory_stats(b)["up"], timeout=10)
    # Both keep serving: puts, gets, and fetches from the peers they knew (the old way).
    t2 = put_encoder(b, "img-2", 2.0)
    with a.client() as ca:
        ca.put("local", torch.ones(4))
        assert torch.equal(ca.get("local"), torch.ones(4))
        assert ca.fetch(["img-1", "img-2"]) == [True, True]
        assert torch.equal(ca.get("img-2"), t2)
    assert "unreachable" in a.log()
    redis_server.start()  # empty: nothing was saved
    client = redis_server.client()
    assert wait_for(lambda: set(live_nodes(client)) == {a.node, b.node}, timeout=15)
    # registered again and resynced: every encoder entry each holds is findable again
    assert wait_for(lambda: [sorted(x) for x in holders(client, "default", ["img-1", "img-2"])]
             == [sorted([a.node, b.node])] * 2, timeout=15)
    assert directory_stats(a)["up"] and directory_stats(a)["counts"]["errors"] >= 1


def test_wrong_password_then_fixed_on_sighup(daemon_factory, redis_with_password):
    server = redis_with_password
    wrong = server.write_password_file("wrong", "not-the-password")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    extra = directory_toml(server.url, f'directory_password_file = "{wrong}"')
    d = daemon_factory(size="32MiB", extra=cluster_toml(endpoint, [], extra))
    with d.client() as c:  # it serves, without the directory
        c.put("k", torch.ones(4))
        assert torch.equal(c.get("k"), torch.ones(4))
    assert wait_for(lambda: "unreachable" in d.log(), timeout=10)
    assert not directory_stats(d)["up"]
    assert "AuthenticationError" in d.log()  # why, in the log
    server.write_password_file("wrong", server.password)  # the operator fixes the file: SIGHUP
    os.chmod(wrong, 0o600)
    d.proc.send_signal(signal.SIGHUP)
    assert wait_for(lambda: directory_stats(d)["up"], timeout=15)
    assert live_nodes(server.client()) == [d.node]


def test_unreachable_store_at_start_then_up(daemon_factory):
    server = RedisServer()  # not started: nothing listens on its port
    try:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        d = daemon_factory(size="32MiB", extra=cluster_toml(endpoint, [], directory_toml(server.url)))
        with d.client() as c:
            c.put("k", torch.ones(4))
            assert c.fetch("absent") is False  # the directory down: the old way, no peer holds it
        assert wait_for(lambda: "unreachable" in d.log(), timeout=10)
        server.start()
        assert wait_for(lambda: directory_stats(d)["up"], timeout=15)  # it retried, with backoff
        assert live_nodes(server.client()) == [d.node]
    finally:
        server.stop()


def test_a_password_file_readable_by_others_is_warned_about(daemon_factory, redis_with_password):
    server = redis_with_password
    os.chmod(server.password_file, 0o644)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    extra = directory_toml(server.url, f'directory_password_file = "{server.password_file}"')
    d = daemon_factory(size="32MiB", extra=cluster_toml(endpoint, [], extra))
    assert wait_for(lambda: directory_stats(d)["up"], timeout=15)
    assert "readable by group or others" in d.log()


def cluster_error(**fields) -> str:
    base = {"listen": "tcp://127.0.0.1:7480", "insecure": True, "directory": "redis://127.0.0.1:6379/0"}
    base.update(fields)
    with pytest.raises(ConfigError) as info:
        load_config({"cluster": {k: v for k, v in base.items() if v is not None}})
    return str(info.value)


@pytest.mark.parametrize("fields, words", [
    ({"directory": "redis://user:pw@127.0.0.1:6379/0"}, "must not hold credentials"),
    ({"directory": "redis://127.0.0.1:6379/0?password=x"}, "must not hold credentials"),
    ({"directory": "http://127.0.0.1:6379"}, "directory:"),
    ({"listen": None}, "needs listen"),
    ({"directory_ttl": "1s"}, "directory_ttl"),
    ({"directory_timeout": "6s"}, "a third of directory_ttl"),
    ({"directory_keys": "kv"}, "directory_keys"),
    ({"directory_prefix": "a b"}, "directory_prefix"),
    ({"directory": "", "directory_password_file": "/x"}, "directory_password_file"),
    ({"listen": "tcp://0.0.0.0:7480"}, "advertise"),
])
def test_bad_directory_settings_are_refused_with_reasons(fields, words):
    assert words in cluster_error(**fields)


def test_directory_settings_that_load():
    for url in ("redis://127.0.0.1:6379/2", "rediss://cache.example:6380/0", "unix:///run/redis.sock?db=3"):
        cfg = load_config({"cluster": {"listen": "tcp://127.0.0.1:7480", "insecure": True, "directory": url,
                                       "directory_keys": "all"}})
        assert cfg.cluster.directory == url and float(cfg.cluster.directory_ttl) == 15.0


def test_with_curve_the_directory_cannot_introduce_a_key(tmp_path, daemon_factory, redis_server):
    """A node's public key comes from the directory only if the operator admitted it too."""
    keys = {}
    for name in ("a", "b", "c"):
        public, secret = write_keypair(str(tmp_path / name), name)
        allowed = tmp_path / f"{name}-allowed"
        allowed.mkdir()
        keys[name] = (public, secret, allowed)
    for admits, admitted in (("a", "b"), ("b", "a"), ("b", "c"), ("c", "a"), ("c", "b")):  # a does not admit c
        (keys[admits][2] / f"{admitted}.key").write_text(Path(keys[admitted][0]).read_text())
    nodes = {}
    for name in ("a", "b", "c"):
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        curve = f'curve_secret_key = "{keys[name][1]}"\ncurve_allowed_keys = "{keys[name][2]}"\n'
        nodes[name] = daemon_factory(size="32MiB", extra=cluster_toml(endpoint, [], directory_toml(redis_server.url,
                                                                                                    curve)))
    a, b, c = nodes["a"], nodes["b"], nodes["c"]
    assert wait_for(lambda: peers_up(b) == {a.node, c.node}, timeout=20)
    assert wait_for(lambda: "not in cluster.curve_allowed_keys" in a.log(), timeout=10)
    assert peer_nodes(a) == {b.node} and peers_up(a) == {b.node}  # c is live, but not a peer of a
    assert set(directory_stats(a)["nodes"]) == {a.node, b.node, c.node}


def test_a_restarted_daemon_registers_what_it_adopted(daemon_factory, redis_server):
    # directory_keys = "all": the restart journal does not keep an entry's meta (an adopted entry
    # has none), so with "encoder" an adopted encoder entry is not findable until put again
    a, b = start_fleet(daemon_factory, redis_server.url, 2, 'directory_keys = "all"')
    put_encoder(b, "img-1", 3.0)
    client = redis_server.client()
    assert wait_for(lambda: holders(client, "default", ["img-1"]) == [[b.node]], timeout=10)
    b.stop()  # a clean stop leaves the directory at once
    assert wait_for(lambda: b.node not in live_nodes(client), timeout=2)
    b.start()  # adopts its pool ([restart]): the entry is still there, and findable again
    with b.client() as cb:
        assert cb.exists("img-1")
    assert wait_for(lambda: holders(client, "default", ["img-1"]) == [[b.node]], timeout=3 * TTL)
