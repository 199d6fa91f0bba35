"""The operator CLI (`ecd status|keys|evict|bench|version`) run as a real process against a real daemon."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from conftest import wait_for

from ecd import KeyNotFound, __version__


# As if piped from a shell: pytest's terminal width (COLUMNS=80 here) must not narrow the tables.
ENV = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}


def ecd(*args, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ecd", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def ecd_json(*args) -> tuple[int, dict]:
    result = ecd(*args, "--json")
    assert "Traceback" not in result.stderr, result.stderr
    return result.returncode, json.loads(result.stdout)


def one_line(result: subprocess.CompletedProcess) -> str:
    """The single stderr line a failing command must print (and nothing on stdout, no traceback)."""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("ecd: "), lines[0]
    return lines[0]


def test_version():
    result = ecd("version")
    assert result.returncode == 0 and result.stdout.strip() == __version__


@pytest.mark.timing
def test_status_of_an_idle_daemon_shows_zero_ops_per_s(daemon):
    rc, doc = ecd_json("status", "--config", daemon.config, "--interval", "0.5")
    assert rc == 0
    assert doc["node"] == daemon.node and doc["version"] == __version__ and doc["endpoint"] == daemon.endpoint
    assert doc["ops_per_s"] == 0  # the command's own two Stats requests are not counted
    assert 0.45 < doc["interval_s"] < 2
    assert doc["capacity_bytes"] == 64 << 20 and doc["used_pct"] == 0
    assert doc["pools"] == [{"segment": 0, "capacity_bytes": 64 << 20, "used_bytes": 0, "used_pct": 0.0}]
    assert doc["entries"] == {"ready": 0, "writing": 0, "retired": 0, "reservations": 0, "reserved_bytes": 0}
    assert doc["clients"] == 0 and doc["hit_rate"] is None and doc["hits"] == doc["misses"] == 0

    text = ecd("status", "--endpoint", daemon.endpoint, "--interval", "0.2")
    assert text.returncode == 0, text.stderr
    out = text.stdout
    assert f"node {daemon.node}" in out and "0.0 ops/s" in out and "64 MiB" in out
    assert "0 ready" in out and "n/a (no lookups yet)" in out and "total" in out


@pytest.mark.timing
def test_status_hit_rate_holds_and_ops_per_s_under_load(daemon):
    with daemon.client() as c, daemon.client() as pinger:
        c.put("a", torch.ones(1 << 18))  # 1 MiB
        for _ in range(3):
            c.get("a")
        with pytest.raises(KeyNotFound):
            c.get("nope")
        pings, stop = [0], threading.Event()

        def ping() -> None:
            while not stop.is_set():
                pinger.ping()
                pings[0] += 1
                time.sleep(0.01)

        thread = threading.Thread(target=ping)
        with c.view("a"):  # a 4th hit, and a read (a read slot) while status runs
            c.ping()  # the view asked nothing: the report of it goes before this request
            thread.start()
            started = time.monotonic()
            try:
                rc, doc = ecd_json("status", "--endpoint", daemon.endpoint, "--interval", "1")
            finally:
                stop.set()
                thread.join()
            rate = pings[0] / (time.monotonic() - started)
    assert rc == 0
    assert doc["hits"] == 4 and doc["misses"] == 1 and doc["hit_rate"] == pytest.approx(0.8)
    assert doc["read_leases"] == 1 and doc["clients"] == 2 and doc["entries"]["ready"] == 1
    assert doc["used_bytes"] >= 1 << 20 and doc["pools"][0]["used_pct"] > 0
    # the pinger's requests, and nothing else, make up the rate
    assert 0.4 * rate < doc["ops_per_s"] < 1.6 * rate, (doc["ops_per_s"], rate)


def test_keys_table_json_limit_and_namespace(daemon):
    with daemon.client() as c, daemon.client(namespace="other") as o:
        c.put("big", torch.ones(3 << 17))  # 1.5 MiB of float32
        c.put("small", torch.zeros(4, 5, dtype=torch.float16))
        o.put("x", torch.ones(10, dtype=torch.int64))
        text = ecd("keys", "--endpoint", daemon.endpoint)
        rc, doc = ecd_json("keys", "--endpoint", daemon.endpoint, "--namespace", "default", "--limit", "1")
        rc_all, everything = ecd_json("keys", "--endpoint", daemon.endpoint)
    assert text.returncode == 0, text.stderr
    rows = [line for line in text.stdout.splitlines() if "│" in line]
    assert len(rows) == 3
    big = next(r for r in rows if " big " in r)
    assert "default" in big and "1.5 MiB" in big and "float32" in big and "[393216]" in big
    assert any("other" in r and " x " in r and "int64" in r and "80 B" in r for r in rows)
    assert "showing 3 of 3" in text.stdout
    assert rc == 0 and doc["total"] == 2 and doc["shown"] == 1
    (entry,) = doc["entries"]
    assert entry["ns"] == "default" and entry["key"] == "big" and entry["nbytes"] == 3 << 19
    assert entry["dtype"] == "float32" and entry["shape"] == [3 << 17] and entry["readers"] == 0
    assert rc_all == 0 and everything["total"] == 3
    assert [(e["ns"], e["key"]) for e in everything["entries"]] == [("default", "big"), ("default", "small"),
                                                                    ("other", "x")]


def test_evict_by_key_by_namespace_and_all(daemon):
    with daemon.client() as c, daemon.client(namespace="ns2") as n:
        for key in ("k1", "k2", "k3"):
            c.put(key, torch.ones(100))
        n.put("a", torch.ones(100))
        n.put("b", torch.ones(100))
        other = daemon.client(namespace="ns3")
        other.put("z", torch.ones(100))

        by_key = ecd("evict", "k1", "k2", "gone", "--endpoint", daemon.endpoint)
        assert by_key.returncode == 0, by_key.stderr
        assert "evicted 2 entries" in by_key.stdout and "missing 1: gone" in by_key.stdout
        assert c.exists(["k1", "k2", "k3"]) == [False, False, True]

        rc, doc = ecd_json("evict", "--namespace", "ns2", "--endpoint", daemon.endpoint)
        assert rc == 0 and doc["evicted"] == 2 and doc["refused"] == [] and doc["namespace"] == "ns2"
        assert n.exists(["a", "b"]) == [False, False] and c.exists("k3") and other.exists("z")

        rc, doc = ecd_json("evict", "--all", "--endpoint", daemon.endpoint)
        assert rc == 0 and doc["evicted"] == 2 and doc["all"] is True
        assert not c.exists("k3") and not other.exists("z")
        other.close()


def test_evict_refuses_a_leased_entry_and_force_waits_for_the_reader(daemon):
    with daemon.client() as c:
        c.put("held", torch.ones(1000))
        c.put("free", torch.ones(1000))
        with c.view("held") as view:
            refused = ecd("evict", "held", "free", "--endpoint", daemon.endpoint)
            assert refused.returncode == 1, refused.stdout + refused.stderr
            assert "refused 1" in refused.stdout and "held" in refused.stdout and "evicted 1 entry" in refused.stdout
            assert c.exists(["held", "free"]) == [True, False]

            # --force evicts at once, then waits until this reader lets go; the view is released
            # only after the eviction is seen, so the CLI is certain to find the reader still there
            proc = subprocess.Popen([sys.executable, "-m", "ecd", "evict", "held", "--force", "--wait", "20",
                                     "--json", "--endpoint", daemon.endpoint],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
            assert wait_for(lambda: not c.exists("held"), timeout=15), "forced eviction never happened"
            assert float(view.sum()) == 1000  # the reader's bytes stay valid while it holds them
            assert proc.poll() is None, "evict --force returned while the reader still held the entry"
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    doc = json.loads(out)
    assert doc["evicted"] == 1 and doc["refused"] == [] and doc["drained"] is True
    assert len(doc["draining"]) == 1 and doc["still_held"] == 0  # it saw the reader, then its release


def test_force_drain_that_times_out_exits_1(daemon):
    with daemon.client() as c:
        c.put("held", torch.ones(1000))
        with c.view("held"):
            started = time.monotonic()
            rc, doc = ecd_json("evict", "held", "--force", "--wait", "0.5", "--endpoint", daemon.endpoint)
            assert time.monotonic() - started < 20
    assert rc == 1
    assert doc["evicted"] == 1 and doc["drained"] is False and doc["still_held"] == 1
    assert doc["drain_wait_s"] >= 0.5


@pytest.mark.parametrize("args", [
    ["evict"],
    ["evict", "--all", "k"],
    ["evict", "--all", "--namespace", "x"],
    ["bench", "--size", "lots"],
    ["bench", "--size", "0"],
    ["keys", "--limit", "0"],
    ["status", "--bogus"],
    ["status", "--config", "node.toml", "--endpoint", "ipc:///tmp/x.sock"],
])
def test_usage_errors_exit_2(args):
    result = ecd(*args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr and result.stdout == ""


@pytest.mark.parametrize("command", [["status"], ["keys"], ["evict", "k"]])
def test_unreachable_daemon_exits_3_quickly_with_one_line(tmp_path, command):
    endpoint = f"ipc://{tmp_path}/nobody.sock"
    started = time.monotonic()
    result = ecd(*command, "--endpoint", endpoint, "--timeout", "30")  # no socket: no waiting at all
    assert time.monotonic() - started < 15
    assert result.returncode == 3 and result.stdout == ""
    assert one_line(result).startswith(f"ecd: daemon unreachable at {endpoint} (--endpoint): no daemon socket at "
                                       f"{tmp_path}/nobody.sock: is `ecd serve` running"), result.stderr
    import socket
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:  # a socket where nothing answers
        silent.bind(f"{tmp_path}/nobody.sock")
        silent.listen(1)
        result = ecd(*command, "--endpoint", endpoint, "--timeout", "0.5")
    assert result.returncode == 3 and result.stdout == ""
    assert one_line(result) == (f"ecd: daemon unreachable at {endpoint} (--endpoint): no answer within 0.5s "
                                "(is `ecd serve` running?)")


@pytest.mark.parametrize("body, message", [
    ("[node\n", "not valid TOML"),
    ('[control]\nendpoint = "http://x"\n', "control.endpoint"),
    (None, "file not found"),
])
def test_bad_config_exits_2_with_one_line(tmp_path, body, message):
    config = tmp_path / "node.toml"
    if body is not None:
        config.write_text(body)
    result = ecd("status", "--config", config)
    assert result.returncode == 2
    line = one_line(result)
    assert line.startswith(f"ecd: config error (--config {config}): ") and message in line


def test_bench_json_gives_sane_numbers_and_leaves_no_keys(daemon):
    with daemon.client() as c:
        c.put("mine", torch.ones(10))  # an unrelated entry the bench must not touch
        started = time.monotonic()
        rc, doc = ecd_json("bench", "--size", "4KiB", "--size", "64KiB", "--clients", "2", "--seconds", "1",
                           "--endpoint", daemon.endpoint)
        took = time.monotonic() - started
        total, left = c.keys(namespace="ecd-bench")
        assert c.exists("mine")
    assert rc == 0 and took < 45
    assert total == 0 and left == []
    assert doc["cleanup"]["left"] == 0 and doc["cleanup"]["evicted"] > 0
    assert doc["clients"] == 2 and doc["op"] == "both" and doc["sizes"] == [4096, 65536]
    assert 0.9 < doc["elapsed_s"] < 30  # it ran for --seconds 1 (bound only catches a runaway)
    assert [(r["op"], r["size"]) for r in doc["results"]] == [("put", 4096), ("put", 65536), ("get", 4096),
                                                              ("get", 65536)]
    for r in doc["results"]:
        assert r["ops"] > 10 and r["errors"] == 0, r
        assert r["ops_per_s"] == pytest.approx(r["ops"] / doc["elapsed_s"])
        assert r["gb_per_s"] == pytest.approx(r["ops"] * r["size"] / doc["elapsed_s"] / 1e9)
        assert 0 < r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"] <= r["max_ms"] < 5000, r
    assert doc["total"]["ops"] == sum(r["ops"] for r in doc["results"])


def test_bench_against_no_daemon_exits_3(tmp_path):
    result = ecd("bench", "--size", "4KiB", "--clients", "1", "--seconds", "1",
                 "--endpoint", f"ipc://{tmp_path}/nobody.sock", "--timeout", "0.5")
    assert result.returncode == 3 and "daemon unreachable" in one_line(result)


def imported_modules(importtime_stderr: str) -> set[str]:
    """Every module a `python -X importtime` run imported, from its stderr."""
    return {line.rsplit("|", 1)[1].strip() for line in importtime_stderr.splitlines()
            if line.startswith("import time:") and "|" in line}


def test_admin_commands_import_neither_torch_nor_numpy(daemon, tmp_path):
    """The operator commands are messages and tables: torch (seconds to import) and numpy (the
    event ring's reader) stay out, so `ecd keys` answers in a fraction of a second."""
    with daemon.client() as c:
        c.put("k", torch.ones(10))
    ep = ["--endpoint", daemon.endpoint]
    commands = [["version"], ["check-config", daemon.config], ["keygen", tmp_path / "keys", "--name", "op"],
                ["status", *ep, "--interval", "0"], ["keys", *ep], ["keys", *ep, "--json"],
                ["evict", "nope", *ep], ["evict", "--all", "--force", "--wait", "1", *ep]]
    for args in commands:
        result = subprocess.run([sys.executable, "-X", "importtime", "-m", "ecd", *map(str, args)],
                                capture_output=True, text=True, timeout=60, env=ENV)
        assert result.returncode == 0, (args, result.stderr[-2000:])
        modules = imported_modules(result.stderr)
        assert "ecd.cli.commands" in modules, args  # importtime did report
        heavy = sorted(m for m in modules if m.split(".")[0] in ("torch", "numpy"))
        assert not heavy, f"`ecd {' '.join(map(str, args))}` imported {heavy[:5]}"
        if args[0] == "keys" and "--json" not in args:
            assert "showing 1 of 1" in result.stdout and " k " in result.stdout, result.stdout
        if args[0] == "evict" and "--all" in args:
            assert "evicted 1 entry" in result.stdout, result.stdout


def test_keys_by_endpoint_against_a_running_daemon(daemon):
    with daemon.client() as c:
        c.put("emb-1", torch.zeros(2, 3, dtype=torch.bfloat16))
        result = ecd("keys", "--endpoint", daemon.endpoint)
        rc, doc = ecd_json("keys", "--endpoint", daemon.endpoint)
    assert result.returncode == 0, result.stderr
    (row,) = [line for line in result.stdout.splitlines() if "│" in line and "emb-1" in line]
    assert "default" in row and "bfloat16" in row and "[2, 3]" in row and "12 B" in row
    assert rc == 0 and doc["total"] == 1 and doc["entries"][0]["key"] == "emb-1"
    assert doc["entries"][0]["shape"] == [2, 3] and doc["entries"][0]["nbytes"] == 12
