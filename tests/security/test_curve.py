"""CURVE on tcp://: keygen, allowed/unknown/plaintext clients, the start-time rule, bad key files."""
from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import time

import pytest
import torch
import zmq.auth

from ecd import AuthenticationFailed, Client
from secutil import ecd, keygen, metric, serve_error, start_tcp, wait_for, write_node_toml


@pytest.fixture
def keys(tmp_path):
    """server pair, an allowed client pair (its .key in allowed/), a stranger's pair."""
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    server_pub, server_sec = keygen(tmp_path / "server", "server")
    client_pub, client_sec = keygen(tmp_path / "clients", "engine1")
    shutil.copy(client_pub, allowed / "engine1.key")
    stranger_pub, stranger_sec = keygen(tmp_path / "clients", "stranger")
    return {"allowed": allowed, "server_pub": server_pub, "server_sec": server_sec,
            "client_sec": client_sec, "stranger_pub": stranger_pub, "stranger_sec": stranger_sec}


def curve_control(keys) -> str:
    return f'curve_secret_key = "{keys["server_sec"]}"\ncurve_allowed_keys = "{keys["allowed"]}"\n'


# ---- keygen -------------------------------------------------------------------------------------

def test_keygen_writes_a_pair_with_safe_modes_and_refuses_to_overwrite(tmp_path):
    out = tmp_path / "new" / "dir"
    result = ecd("keygen", str(out), "--name", "node7")
    assert result.returncode == 0, result.stderr
    public, secret = out / "node7.key", out / "node7.key_secret"
    assert str(public) in result.stdout and str(secret) in result.stdout
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) & 0o022 == 0
    pub1, sec1 = zmq.auth.load_certificate(str(secret))
    assert zmq.auth.load_certificate(str(public)) == (pub1, None)
    assert len(pub1) == 40 and len(sec1) == 40
    assert zmq.curve_public(sec1) == pub1

    again = ecd("keygen", str(out), "--name", "node7")
    assert again.returncode == 2
    assert "exists" in again.stderr and "--force" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1
    assert zmq.auth.load_certificate(str(secret)) == (pub1, sec1)  # untouched

    forced = ecd("keygen", str(out), "--name", "node7", "--force")
    assert forced.returncode == 0, forced.stderr
    pub2, _ = zmq.auth.load_certificate(str(secret))
    assert pub2 != pub1
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert not [n for n in os.listdir(out) if ".tmp-" in n]


# ---- handshakes against a real daemon ------------------------------------------------------------

def test_allowed_key_works_unknown_and_plaintext_clients_are_refused(daemon_factory, keys):
    d = daemon_factory(start=False)
    endpoint = start_tcp(d, control=curve_control(keys))

    with Client(endpoint, timeout=10.0, curve_secret_key=str(keys["client_sec"]),
                curve_server_key=str(keys["server_pub"])) as c:
        small, big = torch.arange(100, dtype=torch.int32), torch.randn(1 << 18)
        c.put("small", small)
        c.put("big", big)  # 1 MiB: through the pool (this host is the daemon's node)
        assert torch.equal(c.get("small"), small)
        assert torch.equal(c.get("big"), big)
        assert c.exists(["big", "nope"]) == [True, False]

    # The server key as Z85 text works too.
    server_z85 = zmq.auth.load_certificate(str(keys["server_pub"]))[0].decode()
    with Client(endpoint, timeout=10.0, curve_secret_key=str(keys["client_sec"]),
                curve_server_key=server_z85) as c:
        assert c.ping() > 0

    with pytest.raises(AuthenticationFailed, match="refused this client's key"):
        Client(endpoint, timeout=30.0, curve_secret_key=str(keys["stranger_sec"]),
               curve_server_key=str(keys["server_pub"]))

    with pytest.raises(AuthenticationFailed, match="handshake"):
        Client(endpoint, timeout=30.0)  # plaintext

    with pytest.raises(AuthenticationFailed, match="curve_server_key"):  # not the daemon's key
        Client(endpoint, timeout=30.0, curve_secret_key=str(keys["client_sec"]),
               curve_server_key=str(keys["stranger_pub"]))

    assert "refused a CURVE client" in d.log()
    assert metric(d, "ecd_auth_rejected_total") >= 1  # the stranger (a plaintext client never reaches ZAP)
    assert d.alive()

    # SIGHUP re-reads the allowed keys: the stranger gets in.
    shutil.copy(keys["stranger_pub"], keys["allowed"] / "stranger.key")
    d.proc.send_signal(signal.SIGHUP)
    assert wait_for(lambda: "allowed CURVE client key(s)" in d.log())
    with Client(endpoint, timeout=10.0, curve_secret_key=str(keys["stranger_sec"]),
                curve_server_key=str(keys["server_pub"])) as c:
        assert torch.equal(c.get("small"), small)
        assert c.stats()["errors"].get("auth_rejected", 0) >= 1



def test_a_key_refused_after_a_daemon_restart_is_reported_at_once(daemon_factory, keys):
    """ZMQ reconnects a CURVE client by itself; when the restarted daemon no longer allows its key
    the next call must say so (AuthenticationFailed), not wait out its timeout."""
    d = daemon_factory(start=False)
    endpoint = start_tcp(d, control=curve_control(keys))
    c = Client(endpoint, timeout=60.0, curve_secret_key=str(keys["client_sec"]),
               curve_server_key=str(keys["server_pub"]))
    try:
        c.put("k", torch.ones(10))
        assert d.stop() == 0
        (keys["allowed"] / "engine1.key").unlink()  # the restarted daemon does not know it any more
        write_node_toml(d, endpoint=endpoint, control=curve_control(keys))
        d.start()
        started = time.monotonic()
        with pytest.raises(AuthenticationFailed, match="refused this client's key"):
            c.exists("k")
        assert time.monotonic() - started < 30  # reported by the handshake, well before the 60 s timeout
    finally:
        c.close()


def test_cli_takes_curve_keys_from_options_and_environment(daemon_factory, keys):
    d = daemon_factory(start=False)
    endpoint = start_tcp(d, control=curve_control(keys))
    ok = ecd("status", "--endpoint", endpoint, "--interval", "0", "--json",
             "--curve-secret-key", str(keys["client_sec"]), "--curve-server-key", str(keys["server_pub"]))
    assert ok.returncode == 0, ok.stderr
    env = {**os.environ, "ECD_CURVE_SECRET_KEY": str(keys["client_sec"]),
           "ECD_CURVE_SERVER_KEY": str(keys["server_pub"])}
    import subprocess
    import sys
    via_env = subprocess.run([sys.executable, "-m", "ecd", "keys", "--endpoint", endpoint, "--json"],
                             capture_output=True, text=True, env=env, timeout=60)
    assert via_env.returncode == 0, via_env.stderr
    refused = ecd("status", "--endpoint", endpoint, "--interval", "0", "--timeout", "30",
                  "--curve-secret-key", str(keys["stranger_sec"]), "--curve-server-key", str(keys["server_pub"]))
    assert refused.returncode == 1
    assert "authentication failed" in refused.stderr
    half = ecd("status", "--endpoint", endpoint, "--curve-secret-key", str(keys["client_sec"]))
    assert half.returncode == 2 and "--curve-server-key" in half.stderr
    # bench: its worker processes connect with the same keys (tcp on this node maps the pool)
    bench = ecd("bench", "--endpoint", endpoint, "--clients", "2", "--seconds", "0.5", "--size", "64KiB",
                "--json", "--curve-secret-key", str(keys["client_sec"]), "--curve-server-key", str(keys["server_pub"]))
    assert bench.returncode == 0, bench.stderr
    assert json.loads(bench.stdout)["total"]["ops"] > 0
    bench_half = ecd("bench", "--endpoint", endpoint, "--curve-server-key", str(keys["server_pub"]))
    assert bench_half.returncode == 2 and "--curve-secret-key" in bench_half.stderr


# ---- start-time rules ---------------------------------------------------------------------------

def test_non_loopback_tcp_without_curve_is_refused_unless_insecure(daemon_factory, tmp_path):
    d = daemon_factory(start=False)
    write_node_toml(d, endpoint="tcp://0.0.0.0:5599")
    check = ecd("check-config", str(d.config))
    assert check.returncode == 2
    line = check.stderr.strip()
    assert len(line.splitlines()) == 1
    assert "control.endpoint" in line and "not a loopback address" in line and "insecure" in line
    # `ecd serve` refuses with the same line, before binding anything.
    rc, err = serve_error(d.config)
    assert rc == 2 and "control.endpoint" in err and "not a loopback address" in err
    assert len(err.strip().splitlines()) == 1

    write_node_toml(d, endpoint="tcp://10.1.2.3:5599", control="insecure = true")
    ok = ecd("check-config", str(d.config))
    assert ok.returncode == 0, ok.stderr
    assert "insecure = true" in ok.stdout

    for loopback in ("tcp://127.0.0.1:5599", "tcp://localhost:5599"):
        write_node_toml(d, endpoint=loopback)
        assert ecd("check-config", str(d.config)).returncode == 0


@pytest.mark.parametrize("which, problem", [
    ("secret_is_public", "control.curve_secret_key"),
    ("secret_missing", "control.curve_secret_key"),
    ("secret_garbage", "control.curve_secret_key"),
    ("allowed_missing", "control.curve_allowed_keys"),
    ("allowed_garbage", "control.curve_allowed_keys"),
    ("only_one", "control.curve_allowed_keys"),
])
def test_bad_key_config_is_a_one_line_start_error(daemon_factory, keys, tmp_path, which, problem):
    secret, allowed = str(keys["server_sec"]), str(keys["allowed"])
    if which == "secret_is_public":
        secret = str(keys["server_pub"])
    elif which == "secret_missing":
        secret = str(tmp_path / "nope.key_secret")
    elif which == "secret_garbage":
        secret = str(tmp_path / "garbage")
        (tmp_path / "garbage").write_text("hello\n")
    elif which == "allowed_missing":
        allowed = str(tmp_path / "no-such-dir")
    elif which == "allowed_garbage":
        (keys["allowed"] / "broken.key").write_text('curve\n    public-key = "short"\n')
    control = f'curve_secret_key = "{secret}"\n' + ("" if which == "only_one" else f'curve_allowed_keys = "{allowed}"\n')
    d = daemon_factory(start=False)
    write_node_toml(d, endpoint="tcp://127.0.0.1:0", control=control)
    rc, err = serve_error(d.config)
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert problem in err, err
    check = ecd("check-config", str(d.config))
    assert check.returncode == 2 and problem in check.stderr
