"""transport "tcp": a pull done on the daemon's event loop, over a data connection from the pool.

Why: a pull on a worker thread costs two hand-offs, loop -> thread and thread -> loop, each a
wake-up and, on a busy machine, a wait for a CPU or for the GIL (measured: 70-90 us of a 1 MiB
pull's ~500 us on loopback, and now and then milliseconds when the thread waits for the GIL).
Here the request goes out and the answer comes in on the loop, with the same wire and the same
checks as TcpTransport._exchange (tcp.py): the bytes still go from the socket straight into the
extent (`recv_into` a view of the pool mapping), in a reader callback that reads until EAGAIN and
never blocks, so a slow or dead owner costs the loop nothing but a timer. The loop writes into an
extent only inside that callback: once pull_on_loop returns or raises (cancelled too), nothing
writes into the items any more.

Only where nothing would block and the loop stays free: a plain (not TLS) connection already in
the pool, and at most LOOP_MAX_BYTES in all (where a fixed cost matters; a large transfer's copy
is better spent on a thread than on the loop that serves every client), read at most
READ_PER_TURN bytes per turn of the loop. Otherwise (none pooled, TLS, larger, the daemon
stopping, or a pooled connection that turns out closed before the owner answered a byte) it
returns None and the caller pulls on a thread (TcpTransport.pull), which connects, handshakes
and retries. Timeouts as on the thread: no byte for `io_timeout`,
or the transfer's deadline, is TransferError("timeout").
"""
from __future__ import annotations

import asyncio
import socket
import time
from typing import TYPE_CHECKING, Any

from .base import PullItem, TransferError
from .tcp_gate import ITEM_HEAD, MAGIC, REQUEST_HEAD, STATUS_BAD_TOKEN, STATUS_OK

if TYPE_CHECKING:  # pragma: no cover
    from .tcp import TcpTransport

LOOP_MAX_BYTES = 4 << 20  # larger transfers go to a thread: their fixed cost is noise, their copy is not
READ_PER_TURN = 1 << 20  # bytes one reader callback takes before letting the loop's other work run


async def pull_on_loop(transport: "TcpTransport", host: str, port: int, items: list[PullItem],
                       deadline: float) -> int | None:
    """Bytes received into every item, TransferError, or None: pull on a thread instead."""
    if transport.tls is not None or transport.stopping or sum(i.nbytes for i in items) > LOOP_MAX_BYTES:
        return None
    where = (host, port)
    sock = transport.checkout_pooled(where)
    if sock is None:
        return None
    loop = asyncio.get_running_loop()
    reader = _Reader(loop, sock, items, transport.io_timeout)
    ok = False
    try:
        sock.setblocking(False)
        async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
            try:
                await loop.sock_sendall(sock, REQUEST_HEAD.pack(MAGIC, len(items)) + b"".join(i.token for i in items))
            except OSError as exc:
                raise TransferError("connection", f"data request to {host}:{port} failed: {exc.strerror or exc}"
                                    ) from None
            received = await reader.start()
        ok = True
        return received
    except TimeoutError:
        raise _with_progress(TransferError("timeout", f"transfer deadline passed after {reader.answered} bytes "
                                                      "of the owner's answer"), reader.answered) from None
    except TransferError as exc:
        if exc.reason == "connection" and not reader.answered:
            return None  # the owner closed it before answering: nothing of this transfer happened
        raise _with_progress(exc, reader.answered) from None
    finally:
        reader.stop()  # from here on nothing writes into the items
        if ok:
            transport.checkin(where, sock)
        else:
            transport.drop(sock)


def _with_progress(exc: TransferError, answered: int) -> TransferError:
    exc.progress = answered  # type: ignore[attr-defined]
    return exc


class _Reader:
    """The owner's answer, read as it comes: per item a head (status, nbytes), then its bytes
    straight into its extent."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, items: list[PullItem],
                 io_timeout: float) -> None:
        self.loop, self.sock, self.items, self.io_timeout = loop, sock, items, io_timeout
        self.fd = sock.fileno()
        self.head = bytearray(ITEM_HEAD.size)
        self.index = 0  # the item being read
        self.view: memoryview = memoryview(self.head)  # what is being filled now: a head or an extent
        self.in_head = True
        self.got = 0  # bytes of `view` filled
        self.answered = 0  # bytes of the owner's answer read so far
        self.received = 0  # bytes of entries
        self.future: asyncio.Future = loop.create_future()
        self.reading = False
        self.timer: asyncio.TimerHandle | None = None
        self.extent: list[memoryview] = []  # views of the pool mapping: released at the end

    def start(self) -> asyncio.Future:
        self.on_readable()  # what has come already (often all of a small answer)
        if not self.future.done():
            self.loop.add_reader(self.fd, self.on_readable)
            self.reading = True
            self.timer = self.loop.call_later(self.io_timeout, self.check_stall, self.answered)
        return self.future

    def on_readable(self) -> None:
        budget = self.answered + READ_PER_TURN  # then the fd, still readable, brings us back
        try:
            while not self.future.done() and self.answered < budget:
                try:
                    n = self.sock.recv_into(self.view[self.got:])
                except (BlockingIOError, InterruptedError):
                    return
                except OSError as exc:
                    raise TransferError("connection", f"data connection failed: {exc.strerror or exc}") from None
                if n == 0:
                    raise TransferError("connection", f"peer closed the data connection after {self.answered} "
                                                      "bytes of its answer")
                self.got += n
                self.answered += n
                if self.got == len(self.view):
                    self.advance()
        except TransferError as exc:
            self.finish(exc)

    def advance(self) -> None:
        """`view` is full: a head read (on to its bytes), or an item's bytes (on to the next)."""
        item = self.items[self.index]
        if self.in_head:
            status, nbytes = ITEM_HEAD.unpack(self.head)
            if status == STATUS_BAD_TOKEN:
                raise TransferError("refused", "the owner did not accept the token (expired or used)")
            if status != STATUS_OK or nbytes != item.nbytes:
                raise TransferError("protocol", f"owner announced {nbytes} bytes (status {status}), "
                                                f"expected {item.nbytes}")
            if nbytes:
                self.release_extent()
                whole = memoryview(item.buf)
                self.extent = [whole, whole[item.offset:item.offset + nbytes]]
                self.view, self.in_head, self.got = self.extent[1], False, 0
                return
        self.received += item.nbytes
        self.index += 1
        self.view, self.in_head, self.got = memoryview(self.head), True, 0
        self.release_extent()
        if self.index == len(self.items):
            self.finish(self.received)

    def check_stall(self, answered_before: int) -> None:
        """Every io_timeout: no byte since the last look fails the pull, as a thread's recv would."""
        if self.future.done():
            return
        if self.answered == answered_before:
            self.finish(TransferError("timeout", f"no data for {self.io_timeout:.1f}s ({self.answered} bytes "
                                                 "of the owner's answer)"))
            return
        self.timer = self.loop.call_later(self.io_timeout, self.check_stall, self.answered)

    def finish(self, outcome: Any) -> None:
        self.stop()
        if not self.future.done():
            if isinstance(outcome, BaseException):
                self.future.set_exception(outcome)
            else:
                self.future.set_result(outcome)

    def stop(self) -> None:
        if self.reading:
            self.reading = False
            self.loop.remove_reader(self.fd)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.view = memoryview(self.head)
        self.release_extent()

    def release_extent(self) -> None:
        for view in reversed(self.extent):  # the slice, then the view it was cut from
            view.release()  # the pool mapping must have no export left when it is unmapped
        self.extent = []
