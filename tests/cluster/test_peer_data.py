"""The data plane itself (ecd.transport.tcp), in process: one data connection reused across
transfers, a pooled connection the owner closed is replaced, a reused connection never lets a
token be used twice, a dead owner fails cleanly; and TLS between real daemons: bit-identical,
an unpinned certificate refused, missing files a one-line config error."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import torch
from peerutil import cluster_toml, free_port, leases_back

from conftest import wait_for
from ecd.transport import Grant, PullItem, TransferError
from ecd.transport.tcp import ITEM_HEAD, MAGIC, REQUEST_HEAD, STATUS_BAD_TOKEN, STATUS_OK, TcpTransport
from ecd.transport.tls import load_tls, write_tls_pair

ECD = [sys.executable, "-m", "ecd"]
SIZE = 3 << 20


class DirectLoop:
    """Stands in for the event loop: completions run at once, on the transport's thread."""

    def __init__(self) -> None:
        self.reports: list[tuple[int, int, str | None]] = []

    def call_soon_threadsafe(self, fn, *args) -> None:
        if not args:  # the data port's gate reporting connections it turned away: not a transfer
            return
        grants, sent, failure = args
        self.reports.append((len(grants), sent, failure))


@pytest.fixture
def pair():
    """(owner, puller, segment, grant(i) -> token); closed afterwards."""
    segment = bytearray(os.urandom(SIZE))
    loop = DirectLoop()
    owner = TcpTransport("127.0.0.1", 0, loop=loop, io_timeout=2.0)
    owner.serve(lambda pool: segment, lambda *a: None)
    owner.loop_reports = loop.reports  # type: ignore[attr-defined]
    puller = TcpTransport("127.0.0.1", 0, io_timeout=2.0)

    def grant(i: int, offset: int = 0, nbytes: int = SIZE) -> bytes:
        token = os.urandom(32)
        owner.grants.add(Grant(token, 0, offset, nbytes))
        return token

    yield owner, puller, segment, grant
    puller.close()
    owner.close()


def _pull(puller: TcpTransport, owner: TcpTransport, token: bytes, nbytes: int = SIZE) -> bytearray:
    dest = bytearray(nbytes)
    port = owner.bound_address[1]
    puller.pull("127.0.0.1", port, [PullItem(token, dest, 0, nbytes)], time.monotonic() + 5)
    return dest


def test_many_transfers_share_one_data_connection(pair):
    owner, puller, segment, grant = pair
    for i in range(8):
        assert _pull(puller, owner, grant(i)) == segment
    # several entries in one transfer, on the same connection
    dest = bytearray(2 * 1000)
    port = owner.bound_address[1]
    puller.pull("127.0.0.1", port, [PullItem(grant(0, 0, 1000), dest, 0, 1000),
                                    PullItem(grant(0, 5000, 1000), dest, 1000, 1000)], time.monotonic() + 5)
    assert dest == segment[:1000] + segment[5000:6000]
    assert puller.connections_opened == 1
    assert owner.serving_threads == 1  # one owner thread served them all
    assert wait_for(lambda: len(owner.loop_reports) == 9, timeout=5)
    assert [r[2] for r in owner.loop_reports] == [None] * 9  # a completion per transfer, not per connection


def test_pooled_connection_closed_by_owner_is_replaced(pair):
    owner, puller, segment, grant = pair
    owner.idle_timeout = 0.2
    assert _pull(puller, owner, grant(0)) == segment
    time.sleep(0.6)  # the owner closed the idle connection: the puller's pooled one is at EOF
    assert _pull(puller, owner, grant(1)) == segment
    assert puller.connections_opened == 2


def test_pooled_connection_gone_unnoticed_is_retried_once(pair):
    """The owner closes the connection just as the puller sends on it (the stale check passed):
    the transfer goes through on a fresh connection, and its token is used once."""
    owner, puller, segment, grant = pair
    assert _pull(puller, owner, grant(0)) == segment

    # the owner's thread parks the connection after its last send
    waiting = wait_for(owner.waiting_connections, timeout=10)
    assert waiting
    for sock in waiting:
        sock.shutdown(socket.SHUT_RD)  # the owner's thread leaves; the puller has not seen a FIN
    time.sleep(0.1)
    puller.connection_is_stale = lambda sock: False  # as if the FIN came just after the check
    assert _pull(puller, owner, grant(1)) == segment
    assert puller.connections_opened == 2


def test_reused_connection_never_uses_a_token_twice(pair):
    owner, puller, segment, grant = pair
    token = grant(0)
    assert _pull(puller, owner, token) == segment
    with pytest.raises(TransferError) as info:
        _pull(puller, owner, token)  # on the pooled connection: refused, not sent again
    assert info.value.reason == "refused"
    assert puller.connections_opened == 1
    # the same on a raw connection: two requests, one token
    port = owner.bound_address[1]
    token = grant(1, 0, 10)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        statuses = []
        for _ in range(2):
            s.sendall(REQUEST_HEAD.pack(MAGIC, 1) + token)
            status, nbytes = ITEM_HEAD.unpack(s.recv(ITEM_HEAD.size, socket.MSG_WAITALL))
            if nbytes:
                assert s.recv(nbytes, socket.MSG_WAITALL) == segment[:10]
            statuses.append(status)
    assert statuses == [STATUS_OK, STATUS_BAD_TOKEN]
    assert len(owner.grants) == 0


@pytest.mark.timing
def test_dead_owner_with_a_pooled_connection_fails_cleanly(pair):
    owner, puller, segment, grant = pair
    token = grant(1)
    assert _pull(puller, owner, grant(0)) == segment
    owner.close()
    started = time.monotonic()
    with pytest.raises(TransferError) as info:
        _pull(puller, owner, token)
    assert info.value.reason == "connection" and time.monotonic() - started < 2


def test_tls_transfer_and_an_unpinned_certificate(tmp_path):
    for name in ("a", "b", "c"):
        write_tls_pair(str(tmp_path), name)
    for me, peer in (("a", "b"), ("b", "a"), ("c", "a")):
        (tmp_path / f"{me}-allowed").mkdir()
        (tmp_path / f"{me}-allowed" / f"{peer}.crt").write_text((tmp_path / f"{peer}.crt").read_text())

    def tls(name):
        return load_tls(str(tmp_path / f"{name}.crt"), str(tmp_path / f"{name}.crt_secret"),
                        str(tmp_path / f"{name}-allowed"))
    segment = bytearray(os.urandom(SIZE))
    owner = TcpTransport("127.0.0.1", 0, loop=DirectLoop(), tls=tls("a"), io_timeout=2.0)
    owner.serve(lambda pool: segment, lambda *a: None)
    good, bad = TcpTransport("127.0.0.1", 0, tls=tls("b")), TcpTransport("127.0.0.1", 0, tls=tls("c"))
    try:
        for _ in range(3):
            token = os.urandom(32)
            owner.grants.add(Grant(token, 0, 0, SIZE))
            assert _pull(good, owner, token) == segment
        assert good.connections_opened == 1
        token = os.urandom(32)
        owner.grants.add(Grant(token, 0, 0, SIZE))
        with pytest.raises(TransferError) as info:
            _pull(bad, owner, token)  # c pins a, but a does not pin c
        assert info.value.reason == "refused", info.value
        assert len(owner.grants) == 1  # the token was never presented
    finally:
        good.close()
        bad.close()
        owner.close()


def _tls_lines(tmp_path, me: str) -> str:
    return (f'tls = true\ntls_cert = "{tmp_path}/{me}.crt"\ntls_key = "{tmp_path}/{me}.crt_secret"\n'
            f'tls_allowed_certs = "{tmp_path}/{me}-allowed"\n')


def test_tls_fetch_between_daemons_is_bit_identical(tmp_path, daemon_factory):
    for name in ("a", "b", "c"):
        write_tls_pair(str(tmp_path), name)
    for me, peers in (("a", "b"), ("b", "a"), ("c", "a")):
        (tmp_path / f"{me}-allowed").mkdir()
        (tmp_path / f"{me}-allowed" / f"{peers}.crt").write_text((tmp_path / f"{peers}.crt").read_text())
    ea, eb, ec = (f"tcp://127.0.0.1:{free_port()}" for _ in range(3))
    a = daemon_factory(size="128MiB", extra=cluster_toml(ea, [eb], _tls_lines(tmp_path, "a")))
    b = daemon_factory(size="128MiB", extra=cluster_toml(eb, [ea], _tls_lines(tmp_path, "b")))
    c = daemon_factory(size="64MiB", extra=cluster_toml(ec, [ea], _tls_lines(tmp_path, "c")))
    t = torch.randint(0, 256, (20 << 20,), dtype=torch.uint8)
    with a.client() as ca, b.client() as cb, c.client() as cc:
        ca.put("x", t, checksum=True)
        ca.put("y", torch.randn(1000, 3))
        assert cb.fetch(["x", "y"], peer=ea, timeout=20) == [True, True]
        assert torch.equal(cb.get("x", verify=True), t)
        assert torch.equal(cb.get("y"), ca.get("y"))
        # c's certificate is not pinned by a: refused, and nothing is left behind on either side
        assert cc.fetch("y", peer=ea, timeout=5) is False
        assert cc.stats()["fetch_failures"].get("refused", 0) >= 1
        # a's side of the refused handshake, and the release of c's lease, may come after c's answer
        assert wait_for(lambda: "data connection refused" in a.log(), timeout=10)
        assert leases_back(ca, timeout=10), ca.stats()
        assert cc.stats()["entries_writing"] == 0


@pytest.mark.parametrize("lines, needle", [
    ('tls = true', "cluster.tls_cert: tls = true needs it"),
    ('tls = true\ntls_cert = "/nonexistent/n.crt"\ntls_key = "/nonexistent/n.crt_secret"\n'
     'tls_allowed_certs = "/nonexistent"', "cluster.tls_cert: /nonexistent/n.crt is not a readable file"),
    ('tls = true\ncurve_secret_key = "KEYS/n.key_secret"\ncurve_allowed_keys = "KEYS"\n',
     "cluster.tls_cert: KEYS/n.crt is not a readable file"),
])
def test_tls_without_its_files_is_one_line_exit_2(tmp_path, lines, needle):
    keys = tmp_path / "keys"
    subprocess.run(ECD + ["keygen", str(keys), "--name", "n"], check=True, capture_output=True, timeout=60)
    lines, needle = lines.replace("KEYS", str(keys)), needle.replace("KEYS", str(keys))
    path = tmp_path / "node.toml"
    insecure = "" if "curve_secret_key" in lines else "insecure = true\n"  # the TLS error, not CURVE's
    path.write_text(f'[node]\nname = "tlscfg"\nruntime_dir = "{tmp_path}"\n[cluster]\n'
                    f'listen = "tcp://127.0.0.1:{free_port()}"\n{insecure}{lines}\n')
    for command in (["check-config", str(path)], ["serve", "--config", str(path)]):
        proc = subprocess.run(ECD + command, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, (command, proc.stdout, proc.stderr)
        out = proc.stderr.strip().splitlines()
        assert len(out) == 1 and needle in out[0], proc.stderr
