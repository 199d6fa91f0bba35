"""A Python stand-in for ecd.memory.cuda.Driver (no GPU needed), and a launcher that runs
`ecd serve` with it: `python tests/fake_cuda.py serve --config node.toml`.

The launcher's fake logs every allocation and free to $ECD_FAKE_CUDA_LOG (one line each), so a
test can check the daemon freed its arenas at exit."""
from __future__ import annotations

import os
import sys

UUIDS = ["GPU-8d0b3c5e-1f2a-4b6c-9d7e-0f1a2b3c4d5e", "GPU-11111111-2222-3333-4444-555555555555"]


class FakeDriver:
    def __init__(self, uuids=UUIDS, fail_alloc_on: int | None = None, log: str | None = None,
                 fd_export: bool = False) -> None:
        """`fd_export`: devices that export memory as file descriptors (a memfd per allocation,
        its first bytes naming the device), so `[pool.cuda] export = "auto"` picks "fd"."""
        self.uuids = list(uuids)
        self.fd_export = fd_export
        self.fail_alloc_on = fail_alloc_on
        self.log = log
        self.live: dict[int, tuple[int, int]] = {}  # ptr -> (ordinal, size)
        self.next_ptr = 0x7F00_0000_0000

    def _note(self, line: str) -> None:
        if self.log:
            with open(self.log, "a") as f:
                f.write(line + "\n")

    def device_count(self) -> int:
        return len(self.uuids)

    def device_uuid(self, ordinal: int) -> str:
        return self.uuids[ordinal]

    def ordinal_of(self, uuid: str) -> int | None:
        lowered = [u.lower() for u in self.uuids]
        return lowered.index(uuid.lower()) if uuid.lower() in lowered else None

    def mem_alloc(self, ordinal: int, size: int) -> int:
        from ecd.memory.cuda import CudaError
        if ordinal == self.fail_alloc_on:
            raise CudaError("cuMemAlloc_v2: CUDA_ERROR_OUT_OF_MEMORY (2): out of memory", result=2)
        ptr = self.next_ptr
        self.next_ptr += size
        self.live[ptr] = (ordinal, size)
        self._note(f"alloc {ordinal} {ptr:#x} {size}")
        return ptr

    def mem_free(self, ordinal: int, ptr: int) -> None:
        assert self.live.pop(ptr)[0] == ordinal
        self._note(f"free {ordinal} {ptr:#x}")

    def ipc_get_handle(self, ordinal: int, ptr: int) -> bytes:
        assert ptr in self.live
        return ptr.to_bytes(8, "little") + bytes([ordinal]) * 56

    def fd_export_supported(self, ordinal: int) -> bool:
        return self.fd_export

    def vmm_alloc_exported(self, ordinal: int, size: int):
        from ecd.memory.cuda_vmm import VmmMapping
        ptr = self.mem_alloc(ordinal, size)
        fd = os.memfd_create(f"fake-cuda-arena-{ordinal}", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        os.pwrite(fd, f"fake arena on device {ordinal}".encode(), 0)
        return VmmMapping(ordinal, ptr, size, handle=ptr), fd

    def vmm_free(self, mapping) -> None:
        self.mem_free(mapping.ordinal, mapping.ptr)


class Raw:
    """A bare DEALER speaking the protocol, one request at a time."""

    def __init__(self, endpoint: str) -> None:
        import zmq  # here: the launcher below (the daemon) needs none of it

        from ecd.protocol import reply_decoder
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 5000)
        self.sock.connect(endpoint)
        self.decoder = reply_decoder()

    def ask(self, request):
        from ecd.protocol import encoder
        self.sock.send(encoder.encode(request))
        return self.decoder.decode(self.sock.recv())

    def close(self) -> None:
        from ecd.protocol import Bye, encoder
        self.sock.send(encoder.encode(Bye(0)))  # the session's writes go now, not at session_ttl
        self.sock.close(linger=1000)
        self.ctx.term()


if __name__ == "__main__":
    from ecd.memory import cuda
    fail_on = os.environ.get("ECD_FAKE_CUDA_FAIL_ALLOC_ON")  # a device whose allocation fails (out of memory)
    driver = FakeDriver(log=os.environ.get("ECD_FAKE_CUDA_LOG"), fd_export=os.environ.get("ECD_FAKE_CUDA_FD") == "1",
                        fail_alloc_on=int(fail_on) if fail_on else None)
    cuda.load_driver = lambda: driver
    from ecd.cli.commands import app
    sys.exit(app(prog_name="ecd"))
