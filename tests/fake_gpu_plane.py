"""A client's CUDA plane on a machine without a GPU, for the arena read routes.

The fake driver's daemon (tests/fake_cuda.py, `ECD_FAKE_CUDA_FD=1`) exports each arena as a memfd
of the arena's size and hands it out on the fd socket; nothing else ever touches those bytes, so
they are the arena. `HostArenaPlane` maps them as host memory where ecd.client.cuda.CudaPlane
would open device memory, and its copies behave as a GPU's do: queued on a "stream" (one thread
per process) that runs them in order, each after a random delay of up to `COPY_DELAY_S`, and
finished only when `wait()` returns. So a client that let go of an entry's read slot before its
copy completed would copy bytes the daemon already gave to another put: the arena chaos test
(tests/chaos/test_arena_reads.py) catches it.

`install()` puts it in place of CudaPlane for the clients this process makes next. On a GPU,
tests/gpu/ runs the real plane. `ArenaWriter` puts into an arena as an engine on that device
would (Alloc in the arena, the bytes written into the arena's memory, Commit): a CPU tensor
cannot ask Client.put for an arena."""
from __future__ import annotations

import mmap
import os
import queue
import random
import threading
import time

import torch

from ecd.client import cuda

COPY_DELAY_S = 0.002
_stream: "queue.Queue[tuple] | None" = None
_stream_lock = threading.Lock()


def _run_stream(work: "queue.Queue[tuple]") -> None:
    rng = random.Random()
    while True:
        dst, src, done = work.get()
        if done is not None:
            done.set()
            continue
        time.sleep(rng.uniform(0, COPY_DELAY_S))  # a copy starts when the device gets to it
        dst.copy_(src)


def _enqueue(dst: torch.Tensor | None, src: torch.Tensor | None, done: threading.Event | None = None) -> None:
    global _stream
    with _stream_lock:
        if _stream is None:
            _stream = queue.Queue()
            threading.Thread(target=_run_stream, args=(_stream,), name="fake-cuda-stream", daemon=True).start()
    _stream.put((dst, src, done))


class StreamBatch(cuda.CopyBatch):
    """CopyBatch on the fake stream: get and put are queued, wait blocks until they ran."""

    def put(self, pool: int, offset: int, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes:
            dst = self.plane.location_tensor(pool, offset, nbytes, cuda.dtype_name(tensor.dtype), list(tensor.shape))
            _enqueue(dst, tensor.clone())

    def get(self, src: torch.Tensor, device: torch.device) -> torch.Tensor:
        out = torch.empty(src.shape, dtype=src.dtype)
        _enqueue(out, src)
        return out

    def after(self, tensor: torch.Tensor) -> None:
        pass

    def record(self) -> None:
        self.marks = getattr(self, "marks", [])
        self.marks.append(threading.Event())
        _enqueue(None, None, self.marks[-1])  # an event recorded after everything queued so far

    def done(self) -> bool:
        return all(mark.is_set() for mark in getattr(self, "marks", []))

    def wait(self) -> None:
        self.record()
        for mark in self.marks:
            mark.wait()

    def wait_quietly(self) -> None:
        self.wait()


class HostArenaPlane(cuda.CudaPlane):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.by_pool = {pool: 0 for pool in sorted(self.arenas)}  # every arena on "device 0"
        self._maps: dict[int, mmap.mmap] = {}

    def arena_bytes(self, pool: int, offset: int, nbytes: int) -> torch.Tensor:
        self.ordinal_of(pool)
        mapped = self._maps.get(pool)
        if mapped is None:
            mapped = self._maps[pool] = mmap.mmap(self._arena_fds[pool], self.arenas[pool].size)
        return cuda.host_bytes(mapped, offset, nbytes)

    def register_host(self) -> None:
        self._host_state = 1  # nothing to register without a driver

    def batch(self) -> StreamBatch:
        return StreamBatch(self)

    def close(self) -> None:
        self._maps.clear()  # unmapped once no tensor over them is left
        super().close()


def install() -> None:
    cuda.CudaPlane = HostArenaPlane  # type: ignore[misc]  # Client._cuda_plane looks it up per epoch


class ArenaWriter:
    """A raw protocol session (tests/fake_cuda.py's Raw) that puts into the daemon's first CUDA
    arena (the fake driver's, exported as a memfd: `ECD_FAKE_CUDA_FD=1`)."""

    def __init__(self, endpoint: str, namespace: str = "default") -> None:
        from ecd import fd_passing
        from ecd.protocol import PROTOCOL_VERSION, Hello, Welcome
        from fake_cuda import Raw
        self.ns, self._ids = namespace, iter(range(2, 1 << 62))
        self._raw = Raw(endpoint)
        self.ask = self._raw.ask
        welcome = self.ask(Hello(1, PROTOCOL_VERSION, os.getpid(), "arena-writer"))
        assert isinstance(welcome, Welcome), welcome
        self.arena = welcome.arenas[0]
        path = os.path.join(os.path.dirname(endpoint[len("ipc://"):]), welcome.fd_socket)
        _, items = fd_passing.receive(path, 5.0)
        fds = {item.index: fd for item, fd in items if item.kind == "arena"}
        self.memory = mmap.mmap(fds[self.arena.index], self.arena.size)  # as the engine's device writes it
        for _, fd in items:  # the mapping keeps what it needs
            os.close(fd)

    def put(self, key: str, tensor: torch.Tensor) -> bool:
        """False: the arena had no room (every extent held)."""
        from ecd.protocol import Alloc, AllocItem, Commit, Committed, Extent
        nbytes = tensor.numel() * tensor.element_size()
        (extent,) = self.ask(Alloc(next(self._ids), self.ns, [AllocItem(key, cuda.dtype_name(tensor.dtype),
                                                                        list(tensor.shape), nbytes)],
                                   arena=self.arena.index)).results
        if not isinstance(extent, Extent):
            return False
        cuda.host_bytes(self.memory, extent.offset, nbytes).copy_(tensor.reshape(-1).view(torch.uint8))
        committed = self.ask(Commit(next(self._ids), [extent.generation]))
        assert isinstance(committed, Committed) and committed.results == [None], committed
        return True

    def delete(self, key: str) -> None:
        from ecd.protocol import Delete
        self.ask(Delete(next(self._ids), self.ns, [key]))

    def close(self) -> None:
        self._raw.close()
