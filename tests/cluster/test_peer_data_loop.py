"""The tcp pull done on the event loop (ecd.transport.tcp_loop), in process, against a real owner
transport or a scripted one: it runs only over a pooled plain connection (None otherwise, and
the caller pulls on a thread), moves bit-identical bytes, never lets a token be used twice, hands
a pooled connection found closed back to the thread path with nothing done, and a stalled or
lying owner fails it cleanly: timeout, protocol, no reader left on the loop, no view of the
destination left exported."""
from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import pytest
from test_peer_data import DirectLoop

from conftest import wait_for
from ecd.transport import Grant, PullItem, TransferError
from ecd.transport.tcp import ITEM_HEAD, REQUEST_HEAD, STATUS_OK, TcpTransport
from ecd.transport.tcp_loop import LOOP_MAX_BYTES

SIZE = 3 << 20


@pytest.fixture
def pair():
    """(owner, puller, segment, grant(offset, nbytes) -> token); closed afterwards."""
    segment = bytearray(os.urandom(SIZE))
    owner = TcpTransport("127.0.0.1", 0, loop=DirectLoop(), io_timeout=2.0)
    owner.serve(lambda pool: segment, lambda *a: None)
    puller = TcpTransport("127.0.0.1", 0, io_timeout=2.0)

    def grant(offset: int = 0, nbytes: int = SIZE) -> bytes:
        token = os.urandom(32)
        owner.grants.add(Grant(token, 0, offset, nbytes))
        return token

    yield owner, puller, segment, grant
    puller.close()
    owner.close()


def _on_loop(puller: TcpTransport, port: int, items: list[PullItem], timeout: float = 5.0):
    async def run():
        return await puller.pull_on_loop("127.0.0.1", port, items, time.monotonic() + timeout)
    return asyncio.run(run())


def test_only_over_a_pooled_connection_then_many_transfers_on_it(pair):
    owner, puller, segment, grant = pair
    port = owner.bound_address[1]
    dest = bytearray(SIZE)
    assert _on_loop(puller, port, [PullItem(grant(), dest, 0, SIZE)]) is None  # nothing pooled: a thread connects
    assert puller.connections_opened == 0
    puller.pull("127.0.0.1", port, [PullItem(grant(), dest, 0, SIZE)], time.monotonic() + 5)
    for _ in range(4):
        dest = bytearray(SIZE)
        assert _on_loop(puller, port, [PullItem(grant(), dest, 0, SIZE)]) == SIZE
        assert dest == segment
    # several entries in one transfer, one of them empty
    dest = bytearray(3000)
    items = [PullItem(grant(0, 1000), dest, 0, 1000), PullItem(grant(7, 0), dest, 1000, 0),
             PullItem(grant(5000, 2000), dest, 1000, 2000)]
    assert _on_loop(puller, port, items) == 3000
    assert dest == segment[:1000] + segment[5000:7000]
    dest.extend(b"x")  # no view of it is left exported (a mapping could not be unmapped)
    assert puller.connections_opened == 1 and owner.serving_threads == 1
    # more than LOOP_MAX_BYTES in one transfer: left to a thread, nothing sent
    tokens = [grant(), grant()]
    assert 2 * SIZE > LOOP_MAX_BYTES
    assert _on_loop(puller, port, [PullItem(t, bytearray(SIZE), 0, SIZE) for t in tokens]) is None
    assert all(t in owner.grants for t in tokens)


def test_a_token_is_never_used_twice(pair):
    owner, puller, segment, grant = pair
    port = owner.bound_address[1]
    token = grant()
    dest = bytearray(SIZE)
    puller.pull("127.0.0.1", port, [PullItem(token, dest, 0, SIZE)], time.monotonic() + 5)
    other = bytearray(SIZE)
    with pytest.raises(TransferError) as info:
        _on_loop(puller, port, [PullItem(token, other, 0, SIZE)])
    assert info.value.reason == "refused"
    assert other == bytearray(SIZE)  # nothing was written
    assert len(owner.grants) == 0


def test_a_pooled_connection_gone_unnoticed_goes_back_to_the_thread_path(pair):
    """The owner closed the connection just as the puller reused it: nothing of the transfer
    happened, so the loop answers None and the thread path sends the token, once."""
    owner, puller, segment, grant = pair
    port = owner.bound_address[1]
    puller.pull("127.0.0.1", port, [PullItem(grant(), bytearray(SIZE), 0, SIZE)], time.monotonic() + 5)
    waiting = wait_for(owner.waiting_connections, timeout=10)
    assert waiting
    for sock in waiting:
        sock.shutdown(socket.SHUT_RDWR)
    time.sleep(0.1)
    puller.connection_is_stale = lambda sock: False  # as if the FIN came just after the check
    token = grant()
    dest = bytearray(SIZE)
    assert _on_loop(puller, port, [PullItem(token, dest, 0, SIZE)]) is None
    assert token in owner.grants  # not taken
    puller.pull("127.0.0.1", port, [PullItem(token, dest, 0, SIZE)], time.monotonic() + 5)
    assert dest == segment and puller.connections_opened == 2


def _record_checkouts(puller: TcpTransport) -> list[int]:
    """The descriptors of the pooled connections the puller takes from now on."""
    used: list[int] = []
    checkout = puller.checkout_pooled

    def recording(where):
        sock = checkout(where)
        if sock is not None:
            used.append(sock.fileno())
        return sock
    puller.checkout_pooled = recording  # type: ignore[method-assign]
    return used


class ScriptedOwner:
    """A data port that answers its first request honestly and then does what `second` says:
    "stall" (reads the request, answers nothing) or "lie" (announces the wrong size)."""

    def __init__(self, second: str) -> None:
        self.second = second
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            for turn in range(2):
                head = conn.recv(REQUEST_HEAD.size + 32, socket.MSG_WAITALL)
                if len(head) < REQUEST_HEAD.size + 32:
                    return
                if turn == 0:
                    conn.sendall(ITEM_HEAD.pack(STATUS_OK, 100) + b"a" * 100)
                elif self.second == "lie":
                    conn.sendall(ITEM_HEAD.pack(STATUS_OK, 99) + b"b" * 99)
            self.done.wait(10)

    def close(self) -> None:
        self.done.set()
        self.listener.close()


@pytest.mark.parametrize("second, reason", [("stall", "timeout"), ("lie", "protocol")])
def test_a_stalled_or_lying_owner_fails_cleanly(second, reason):
    owner = ScriptedOwner(second)
    puller = TcpTransport("127.0.0.1", 0, io_timeout=0.5)
    try:
        puller.pull("127.0.0.1", owner.port, [PullItem(os.urandom(32), bytearray(100), 0, 100)],
                    time.monotonic() + 5)
        dest = bytearray(100)
        used = _record_checkouts(puller)
        loop_readers: list[int] = []

        async def run():
            try:
                return await puller.pull_on_loop("127.0.0.1", owner.port, [PullItem(os.urandom(32), dest, 0, 100)],
                                                 time.monotonic() + 5)
            finally:
                loop = asyncio.get_running_loop()
                loop_readers.extend(fd for fd in used if loop.remove_reader(fd))
        started = time.monotonic()
        with pytest.raises(TransferError) as info:
            asyncio.run(run())
        assert info.value.reason == reason
        assert time.monotonic() - started < 3  # io_timeout, not the deadline
        assert len(used) == 1 and loop_readers == []  # nothing left reading into the extent
        assert puller.checkout_pooled(("127.0.0.1", owner.port)) is None  # the connection was dropped
        dest.extend(b"x")  # no view left exported
    finally:
        puller.close()
        owner.close()


def test_a_cancelled_pull_leaves_nothing_reading():
    owner = ScriptedOwner("stall")
    puller = TcpTransport("127.0.0.1", 0, io_timeout=5.0)
    try:
        puller.pull("127.0.0.1", owner.port, [PullItem(os.urandom(32), bytearray(100), 0, 100)],
                    time.monotonic() + 5)
        dest = bytearray(100)
        used = _record_checkouts(puller)

        async def run():
            task = asyncio.ensure_future(puller.pull_on_loop("127.0.0.1", owner.port,
                                                             [PullItem(os.urandom(32), dest, 0, 100)],
                                                             time.monotonic() + 5))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            loop = asyncio.get_running_loop()
            return [fd for fd in used if loop.remove_reader(fd)]
        assert asyncio.run(run()) == [] and len(used) == 1
        assert puller.checkout_pooled(("127.0.0.1", owner.port)) is None
        dest.extend(b"x")
    finally:
        puller.close()
        owner.close()
