"""On a GPU node: the daemon started with `[pool.cuda]` announces one arena per device whose
UUID is the one torch reports for it, and whose export (an IPC handle, or a file descriptor from
the fd socket) opens in another process (this one) to device memory torch can read and write.
Skipped without CUDA."""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def torch_uuid(ordinal: int) -> str:
    uuid = str(torch.cuda.get_device_properties(ordinal).uuid)
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


@pytest.fixture(params=["ipc", "fd"])
def cuda_daemon(daemon_factory, request):
    devices = list(range(min(torch.cuda.device_count(), 2)))
    return daemon_factory("64MiB", f'[pool.cuda]\ndevices = {devices}\nsize = "64MiB"\nexport = "{request.param}"\n')


def open_arena(driver, ordinal: int, arena, endpoint: str, welcome) -> tuple[int, object]:
    """(base pointer, what to close it with) of an arena, as ecd.client.cuda opens it."""
    if arena.export == "ipc":
        assert len(arena.handle) == 64
        ptr = driver.ipc_open_handle(ordinal, arena.handle)
        return ptr, lambda: driver.ipc_close_handle(ordinal, ptr)
    from ecd import fd_passing
    assert arena.handle == b"" and welcome.fd_socket
    path = os.path.join(os.path.dirname(endpoint[len("ipc://"):]), welcome.fd_socket)
    _, items = fd_passing.receive(path, 5.0)
    try:
        (fd,) = [fd for item, fd in items if item.kind == "arena" and item.index == arena.index]
        mapping = driver.vmm.import_fd(ordinal, fd, arena.size)
    finally:
        for _, fd in items:
            os.close(fd)
    return mapping.ptr, lambda: driver.vmm.unmap(mapping)


def test_arena_uuids_match_torch_and_handles_open(cuda_daemon):
    from ecd.memory.cuda import load_driver
    from ecd.protocol import PROTOCOL_VERSION, Alloc, AllocItem, Bye, Extent, Hello, Welcome, encoder, \
        reply_decoder
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(cuda_daemon.endpoint)
    decoder = reply_decoder()
    try:
        sock.send(encoder.encode(Hello(1, PROTOCOL_VERSION, os.getpid(), "gpu-test")))
        welcome = decoder.decode(sock.recv())
        assert isinstance(welcome, Welcome)
        count = min(torch.cuda.device_count(), 2)
        assert len(welcome.arenas) == count
        assert [a.index for a in welcome.arenas] == list(range(len(welcome.pools), len(welcome.pools) + count))
        by_uuid = {torch_uuid(i): i for i in range(torch.cuda.device_count())}
        driver = load_driver()
        for arena in welcome.arenas:
            assert arena.device_uuid in by_uuid, (arena.device_uuid, by_uuid)
            ordinal = by_uuid[arena.device_uuid]
            assert driver.device_uuid(ordinal) == arena.device_uuid
            assert arena.size == 64 << 20
            torch.cuda.set_device(ordinal)
            torch.cuda.synchronize()
            ptr, close = open_arena(driver, ordinal, arena, cuda_daemon.endpoint, welcome)
            try:
                # write through torch into the opened arena and read it back through a second view
                sock.send(encoder.encode(Alloc(2, "ns", [AllocItem("k", "uint8", [4096], 4096)],
                                               arena=arena.index)))
                (ext,) = decoder.decode(sock.recv()).results
                assert isinstance(ext, Extent) and ext.pool == arena.index
                src = torch.arange(4096, device=f"cuda:{ordinal}", dtype=torch.int32).to(torch.uint8)
                dst = _tensor_at(ptr + ext.offset, 4096, ordinal)
                dst.copy_(src)
                torch.cuda.synchronize()
                assert torch.equal(_tensor_at(ptr + ext.offset, 4096, ordinal).cpu(), src.cpu())
            finally:
                close()
    finally:
        sock.send(encoder.encode(Bye(0)))
        sock.close(linger=1000)
        ctx.term()


def _tensor_at(ptr: int, nbytes: int, ordinal: int):
    """A uint8 CUDA tensor over raw device memory (no ownership), via __cuda_array_interface__."""
    class Raw:
        __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                    "version": 3, "strides": None}
    with torch.cuda.device(ordinal):
        return torch.as_tensor(Raw(), device=f"cuda:{ordinal}")
