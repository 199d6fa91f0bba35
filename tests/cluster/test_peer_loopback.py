"""Loopback is not "trusted": every local user can reach a peer port on 127.0.0.1.

A peer plane without CURVE is refused at start unless `[cluster] insecure = true` says so, and
with CURVE a local user of another uid, outside the daemon's group (`nobody`), gets nothing: no
welcome, no lookup, no byte from the data port. With `insecure = true` the same user reads the
entry, which is exactly what the setting's warning says it opens."""
from __future__ import annotations

import json
import os
import pwd
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peerutil import cluster_toml, free_port

from ecd.curve import load_public_key, write_keypair

ECD = [sys.executable, "-m", "ecd"]
REPO = Path(__file__).resolve().parents[2]
INTRUDER = Path(__file__).resolve().parent / "peer_intruder.py"
SECRET = torch.arange(64, dtype=torch.uint8) * 3  # another tenant's entry


NOBODY = pwd.getpwnam("nobody").pw_uid


def intrude(*args: str) -> dict:
    """peer_intruder.py as user nobody (another uid, not in the daemon's group: the daemon runs as
    root here); its JSON verdict, less the uid it checked it ran as."""
    proc = subprocess.run([sys.executable, str(INTRUDER), "--uid", str(NOBODY), *args], capture_output=True,
                          text=True, timeout=60, cwd="/", env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    verdict = json.loads(proc.stdout)
    assert verdict.pop("uid") == NOBODY, verdict
    return verdict


def _data_port(daemon) -> int:
    match = re.search(r"peer plane on \S+ \(data: [^:]+:(\d+)", daemon.log())
    assert match, daemon.log()
    return int(match.group(1))


def _config(tmp_path: Path, cluster_lines: str) -> Path:
    path = tmp_path / "node.toml"
    path.write_text(f'[node]\nname = "lbcfg"\nruntime_dir = "{tmp_path}"\n[control]\n'
                    f'endpoint = "ipc://{tmp_path}/ecd.sock"\n[cluster]\n{cluster_lines}\n')
    return path


def test_loopback_peer_plane_needs_curve_or_an_explicit_insecure(tmp_path):
    path = _config(tmp_path, f'listen = "tcp://127.0.0.1:{free_port()}"')
    for command in (["check-config", str(path)], ["serve", "--config", str(path)]):
        proc = subprocess.run(ECD + command, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, (command, proc.stdout, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr
        assert "cluster.listen: tcp://127.0.0.1:" in lines[0], lines
        for needle in ("no authentication", "cluster.curve_secret_key", "cluster.insecure = true",
                       "every local user", "read every entry"):
            assert needle in lines[0], lines[0]
    ok = _config(tmp_path, f'listen = "tcp://127.0.0.1:{free_port()}"\ninsecure = true')
    assert subprocess.run(ECD + ["check-config", str(ok)], capture_output=True, timeout=60).returncode == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the intruder as another uid")
def test_insecure_says_what_it_opens_and_opens_it(daemon_factory):
    """`insecure = true` on loopback: a start-up warning naming what it opens, and indeed a local
    user of another uid reads another tenant's entry through the peer plane."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    owner = daemon_factory(size="64MiB", extra=cluster_toml(endpoint, [], insecure=True))
    assert re.search(r"WARNING.*cluster.insecure = true.*no authentication.*every local user.*read every entry",
                     owner.log()), owner.log()
    with owner.client(namespace="tenant-a") as c:
        c.put("secret", SECRET)
    stolen = intrude("steal", endpoint, "tenant-a", "secret")
    assert stolen == {"hello": "welcome", "lookup": "offer", "status": 0, "data": SECRET.numpy().tobytes().hex()}


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the intruder as another uid")
def test_curve_on_loopback_gives_another_local_user_nothing(tmp_path, daemon_factory):
    public, secret = write_keypair(str(tmp_path / "keys"), "owner")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "friend.key").write_text(Path(write_keypair(str(tmp_path / "keys"), "friend")[0]).read_text())
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    owner = daemon_factory(size="64MiB", extra=cluster_toml(
        endpoint, [], f'curve_secret_key = "{secret}"\ncurve_allowed_keys = "{allowed}"\n'))
    assert "cluster.insecure" not in owner.log()
    with owner.client(namespace="tenant-a") as c:
        c.put("secret", SECRET)
    server_key = load_public_key(public).decode()  # public: an intruder may well know it
    # plaintext: the CURVE server never completes the handshake; a key of its own: not allowed
    assert intrude("steal", endpoint, "tenant-a", "secret") == {"hello": "silent"}
    assert intrude("steal", endpoint, "tenant-a", "secret", server_key) == {"hello": "silent"}
    # the data port without a token the owner granted: refused, not a byte of any entry
    guessed = intrude("guess", "127.0.0.1", str(_data_port(owner)))
    assert guessed.get("status", 1) != 0 and not guessed.get("data"), guessed
    assert "refused a CURVE client" in owner.log()
    with owner.client() as c:
        assert c.stats()["transfer_leases"] == 0
    assert owner.alive()
