"""The vLLM connectors' shared lazy Client and back-off (ecd/integrations/vllm/lazy_client.py),
against a fake Client and a real unix socket standing in for the daemon's. Needs no vLLM."""
from __future__ import annotations

import logging
import os
import socket
import time

import pytest

from ecd.errors import DaemonUnavailable, KeyNotFound
from ecd.integrations.vllm import lazy_client
from ecd.integrations.vllm.lazy_client import BACKOFF_FIRST_S, BACKOFF_MAX_S, LazyClient, socket_path
from ecd.integrations.vllm.ratelimit import RateLimitedLog
from ecd.integrations.vllm.settings import ConnectorSettings

logger = logging.getLogger("test.lazy_client")


class FakeClient:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


class Factory:
    def __init__(self) -> None:
        self.made: list[FakeClient] = []
        self.fail: BaseException | None = None

    def __call__(self, settings, namespace, name, populate):
        assert (namespace, name) == ("ns", "test-client")
        if self.fail is not None:
            raise self.fail
        self.made.append(FakeClient())
        return self.made[-1]


@pytest.fixture
def daemon_socket(tmp_path):
    """A listening unix socket where the daemon's would be; close() it to 'kill' the daemon."""
    path = str(tmp_path / "ecd.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(16)
    yield path, sock
    sock.close()


def holder(endpoint: str, factory: Factory) -> LazyClient:
    return LazyClient(ConnectorSettings(endpoint=endpoint), "ns", "test-client",
                      RateLimitedLog(logger, 30.0), factory=factory)


def expire(h: LazyClient) -> None:
    h.end_back_off()  # as if the back-off period were over


def test_made_on_first_use_then_reused(daemon_socket):
    path, _ = daemon_socket
    f = Factory()
    h = holder(f"ipc://{path}", f)
    assert f.made == []  # nothing at construction
    assert h.call("op", lambda c: c) is f.made[0]
    assert h.call("op", lambda c: c) is f.made[0] and len(f.made) == 1
    h.close()
    assert f.made[0].closed
    assert h.call("op", lambda c: c) is f.made[1]  # a later call makes a new one


def test_nothing_listening_backs_off_doubling_and_a_success_resets_it(daemon_socket, caplog):
    path, sock = daemon_socket
    sock.close()  # a killed daemon: the file stays, connections are refused
    assert os.path.exists(path)
    f = Factory()
    h = holder(f"ipc://{path}", f)
    with caplog.at_level(logging.WARNING, logger=logger.name):
        periods = []
        for _ in range(8):
            assert h.call("lookup", lambda c: True) is None
            periods.append(h.retry_at)
            assert h.backing_off and h.call("lookup", lambda c: True) is None  # no attempt meanwhile
            expire(h)
    assert f.made == []  # never waited in a Client's hello
    assert h.next_backoff_s == BACKOFF_MAX_S
    assert [r.getMessage() for r in caplog.records].count(
        f"ecd daemon unavailable during lookup (nothing listening on {path}): treated as a miss; "
        f"next try in {BACKOFF_FIRST_S:.2g}s") == 1  # logged once per interval, not per attempt
    os.unlink(path)
    again = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    again.bind(path)
    again.listen(1)
    try:
        assert h.call("lookup", lambda c: 42) == 42  # back
        assert h.next_backoff_s == BACKOFF_FIRST_S
    finally:
        again.close()


def test_daemon_unavailable_drops_the_client_other_ecd_errors_keep_it(daemon_socket):
    path, _ = daemon_socket
    f = Factory()
    h = holder(f"ipc://{path}", f)

    def raises(exc):
        def fn(client):
            raise exc
        return fn

    assert h.call("load", raises(KeyNotFound("gone"))) is None
    assert not f.made[0].closed and not h.backing_off  # a miss, the client stays
    assert h.call("load", raises(DaemonUnavailable("timeout"))) is None
    assert f.made[0].closed and h.backing_off
    assert h.call("load", lambda c: c) is None  # backing off: no new client
    expire(h)
    assert h.call("load", lambda c: c) is f.made[1]


def test_an_unexpected_error_drops_the_client_and_is_logged_with_its_traceback(daemon_socket, caplog):
    path, _ = daemon_socket
    f = Factory()
    h = holder(f"ipc://{path}", f)
    with caplog.at_level(logging.WARNING, logger=logger.name):
        assert h.call("save", lambda c: 1 / 0) is None
    assert f.made[0].closed and h.backing_off
    (record,) = caplog.records
    assert record.levelno == logging.ERROR and record.exc_info is not None
    assert "ecd save failed unexpectedly (ZeroDivisionError" in record.getMessage()


def test_a_removed_socket_drops_the_live_client_without_a_call(daemon_socket):
    path, _ = daemon_socket
    f = Factory()
    h = holder(f"ipc://{path}", f)
    assert h.get("op") is f.made[0]
    os.unlink(path)  # a stopped daemon removes its socket
    called = []
    assert h.call("op", called.append) is None
    assert called == [] and f.made[0].closed and h.backing_off


def test_a_daemon_restarted_on_the_same_socket_gets_a_new_client_at_once(daemon_socket):
    """A killed daemon leaves its socket file; the new one binds a new file there. The Client of
    the old one is dropped on its next use (another inode, one stat) and a new one made at once,
    without a back-off: the old daemon's event ring must not answer for the new daemon."""
    path, sock = daemon_socket
    f = Factory()
    h = holder(f"ipc://{path}", f)
    assert h.get("op") is f.made[0]
    sock.close()  # killed: the file stays
    assert h.get("op") is f.made[0]  # the same socket file: nothing seen yet (round trips fail)
    time.sleep(0.02)  # a restart takes far longer than the file times' clock tick (a few ms)
    os.unlink(path)  # the new daemon replaces the file with its own socket
    new = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        new.bind(path)
        new.listen(16)
        assert h.get("op") is f.made[1] and f.made[0].closed and not h.backing_off
        assert h.get("op") is f.made[1]  # and kept
    finally:
        new.close()


def test_a_failed_connect_backs_off(daemon_socket):
    path, _ = daemon_socket
    f = Factory()
    f.fail = DaemonUnavailable("no answer within 5s")
    h = holder(f"ipc://{path}", f)
    assert h.get("op") is None and h.backing_off
    f.fail = None
    assert h.get("op") is None  # still backing off
    expire(h)
    assert h.get("op") is f.made[0]


def test_a_failure_of_an_old_client_does_not_drop_its_replacement(daemon_socket):
    path, _ = daemon_socket
    f = Factory()
    h = holder(f"ipc://{path}", f)
    old = h.get("op")
    h.failed("op", DaemonUnavailable("x"))
    expire(h)
    new = h.get("op")
    assert new is not old
    h.failed("op", DaemonUnavailable("late, from another thread"), old)
    assert h.get("op") is new and not new.closed


def test_endpoints_without_a_socket_file_are_not_probed(monkeypatch):
    assert socket_path("ipc:///run/ecd/ecd.sock") == "/run/ecd/ecd.sock"
    assert socket_path("ipc://@ecd") is None and socket_path("tcp://10.0.0.1:5555") is None
    monkeypatch.setattr(lazy_client, "listening", lambda path: pytest.fail("probed"))
    for endpoint in ("ipc://@ecd-abstract", "tcp://127.0.0.1:1"):
        f = Factory()
        h = holder(endpoint, f)
        assert h.call("op", lambda c: c) is f.made[0]
        assert h.call("op", lambda c: c) is f.made[0]  # and no stat drops it


def test_skipping_corrupt_drops_each_corrupt_key_and_reads_the_rest_again():
    from ecd.errors import IntegrityError
    keys = ["a", "bad1", "c", "bad2", "e"]
    reads: list[list[str]] = []

    def read(picked: list[int]) -> list[str]:
        asked = [keys[i] for i in picked]
        reads.append(asked)
        for k in asked:  # as a verifying get_many: raises for the first corrupt entry it meets
            if k.startswith("bad"):
                raise IntegrityError("corrupt", key=k)
        return asked

    got, corrupt = lazy_client.skipping_corrupt(keys, read)
    assert got == ["a", "c", "e"] and corrupt == [1, 3]
    assert reads == [keys, ["a", "c", "bad2", "e"], ["a", "c", "e"]]

    def truncated(picked: list[int]) -> list[str]:  # a pool cut under the reader: names no key
        raise IntegrityError("host pool segment 0 was truncated")

    with pytest.raises(IntegrityError):
        lazy_client.skipping_corrupt(keys, truncated)
    assert lazy_client.skipping_corrupt([], lambda picked: picked) == ([], [])
