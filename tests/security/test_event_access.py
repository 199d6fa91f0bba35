"""Who may read the KV events (issue 40, attack 2). A batch names every stored block's prompt token
ids and every namespace's key names: on a tcp endpoint without CURVE, loopback included, a process
of any uid subscribed and replayed them from seq 0. Now a tcp endpoint needs CURVE or an explicit
`insecure = true` (the daemon refuses to start otherwise, saying why), and an ipc endpoint's socket
is the control socket's: 0660, node.group's. The readers are real processes of other uids.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from ecd.protocol import KVBlockMeta
from kv_events import event_dir, events_config
from redis_server import free_port

NOBODY = 65534
SOCKET_GID = 0  # node.group "" is the daemon's primary group: root's here
SECRET_TOKENS = [7001, 7002, 7003, 7004]

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="readers of other uids are made by dropping root's "
                                                           "privileges: these tests need to run as root")

# argv: uid gid groups publish-endpoint replay-endpoint seconds. Drops to the ids, subscribes to
# everything and asks the replay for all from seq 0; prints what it could connect to and every
# token id it read.
READER = r"""
import json, os, socket, sys, time
import msgspec, zmq
uid, gid, groups = int(sys.argv[1]), int(sys.argv[2]), [int(g) for g in sys.argv[3].split(",") if g]
publish, replay, seconds = sys.argv[4], sys.argv[5], float(sys.argv[6])
os.setgroups(groups); os.setgid(gid); os.setuid(uid)
report = {"uid": os.getuid(), "connect": {}, "tokens": [], "batches": 0}
for name, endpoint in (("publish", publish), ("replay", replay)):
    if endpoint.startswith("ipc://"):  # what the kernel says to a plain connect
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(endpoint[len("ipc://"):])
            report["connect"][name] = "ok"
        except OSError as exc:
            report["connect"][name] = os.strerror(exc.errno)
        finally:
            probe.close()
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB); sub.linger = 0; sub.subscribe(b""); sub.connect(publish)
dealer = ctx.socket(zmq.DEALER); dealer.linger = 0; dealer.connect(replay)
dealer.send_multipart([b"", (0).to_bytes(8, "big")])
deadline = time.monotonic() + seconds
poller = zmq.Poller(); poller.register(sub, zmq.POLLIN); poller.register(dealer, zmq.POLLIN)
while time.monotonic() < deadline:
    for sock, _ in poller.poll(100):
        frames = sock.recv_multipart()
        payload = frames[-1]
        try:
            batch = msgspec.msgpack.decode(payload)
        except Exception:
            continue
        if not isinstance(batch, list) or len(batch) < 2:
            continue
        report["batches"] += 1
        for event in batch[1]:
            if isinstance(event, dict) and event.get("type") == "BlockStored":
                report["tokens"].extend(event.get("token_ids") or [])
print(json.dumps(report), flush=True)
"""


def read_as(uid: int, gid: int, groups: tuple[int, ...], publish: str, replay: str, seconds: float = 3.0) -> dict:
    out = subprocess.run([sys.executable, "-c", READER, str(uid), str(gid), ",".join(map(str, groups)), publish,
                          replay, str(seconds)], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["uid"] == uid, report
    return report


@pytest.fixture
def evdir():
    path = event_dir()
    os.chmod(path, 0o755)  # the directory lets anyone reach the sockets: their own modes decide
    yield path
    shutil.rmtree(path, ignore_errors=True)


def put_secret(d) -> None:
    with d.client() as c:
        c.put("secret-block", torch.zeros(16), meta=KVBlockMeta(0x5EC, None, SECRET_TOKENS, 4))


def test_a_tcp_events_endpoint_without_curve_is_refused_even_on_loopback(daemon_factory):
    d = daemon_factory(extra=f'[events]\npublish = "tcp://127.0.0.1:{free_port()}"\n', start=False)
    with pytest.raises(RuntimeError, match="exited") as failed:
        d.start(timeout=30)
    message = str(failed.value)
    assert "events.publish: tcp://127.0.0.1:" in message and "open to every local user" in message, message
    assert "events.insecure = true" in message, message


def test_events_on_ipc_reach_the_group_and_no_one_else(daemon_factory, evdir):
    d = daemon_factory(extra=events_config(evdir))
    put_secret(d)
    for name in ("pub", "replay"):
        st = os.stat(os.path.join(evdir, name))
        assert (oct(st.st_mode & 0o777), st.st_gid) == (oct(0o660), SOCKET_GID), name
    publish, replay = f"ipc://{evdir}/pub", f"ipc://{evdir}/replay"
    outsider = read_as(NOBODY, NOBODY, (), publish, replay)
    assert outsider["connect"] == {"publish": "Permission denied", "replay": "Permission denied"}, outsider
    assert outsider["tokens"] == [] and outsider["batches"] == 0, outsider
    member = read_as(NOBODY, NOBODY, (SOCKET_GID,), publish, replay)  # another uid, in node.group
    assert member["connect"] == {"publish": "ok", "replay": "ok"}, member
    assert set(SECRET_TOKENS) <= set(member["tokens"]), member


def test_insecure_tcp_events_say_what_they_open(daemon_factory):
    """The opt-in is real and loud: every uid reads (as the warning says)."""
    publish, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    d = daemon_factory(extra=f'[events]\npublish = "{publish}"\nreplay = "{replay}"\ninsecure = true\n')
    assert "events.insecure = true" in d.log() and "any local user on loopback" in d.log(), d.log()
    put_secret(d)
    anyone = read_as(NOBODY, NOBODY, (), publish, replay)
    assert set(SECRET_TOKENS) <= set(anyone["tokens"]), anyone
