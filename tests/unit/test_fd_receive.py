"""The client's end of the fd socket against a real listener whose queue is full: a burst of
clients (or a flood) must make a new one wait for room, within its timeout, not fail at once."""
from __future__ import annotations

import array
import os
import socket
import threading
import time

import msgspec
import pytest

from ecd.fd_passing import FD_WIRE_VERSION, FdBatch, FdFetchError, FdItem, receive


def full_listener(path: str) -> tuple[socket.socket, list[socket.socket]]:
    """A SEQPACKET listener that accepts nothing, and queued connections until the next one would
    not fit (the kernel refuses a non-blocking connect then with EAGAIN)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(0)
    queued = []
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.setblocking(False)
        try:
            s.connect(path)
        except BlockingIOError:
            s.close()
            return listener, queued
        queued.append(s)


def test_a_full_listen_queue_is_waited_for(tmp_path):
    path = str(tmp_path / "fds")
    listener, queued = full_listener(path)
    r, w = os.pipe()

    def serve_late():  # the daemon gets to its queue 0.3 s later: it answers everyone
        time.sleep(0.3)
        header = msgspec.msgpack.encode(FdBatch(FD_WIRE_VERSION, 7, [FdItem("ring", 0, 1)]))
        for _ in range(len(queued) + 1):
            conn, _ = listener.accept()
            conn.sendmsg([header], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [r]))])
            conn.close()

    server = threading.Thread(target=serve_late)
    server.start()
    try:
        batch, got = receive(path, timeout=5.0)
        assert batch.epoch == 7 and [item.kind for item, _ in got] == ["ring"]
        for _, fd in got:
            os.close(fd)
    finally:
        server.join(10)
        for s in queued + [listener]:
            s.close()
        os.close(r)
        os.close(w)


def test_a_queue_that_stays_full_fails_within_the_timeout_with_the_reason(tmp_path):
    path = str(tmp_path / "fds")
    listener, queued = full_listener(path)
    try:
        start = time.monotonic()
        with pytest.raises(FdFetchError, match="listen queue stayed full for 0.3 s"):
            receive(path, timeout=0.3)
        assert time.monotonic() - start < 2.0
    finally:
        for s in queued + [listener]:
            s.close()
