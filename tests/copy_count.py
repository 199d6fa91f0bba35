"""How many copies of an entry a call makes, seen by the allocators themselves, not by a mock.

A copy of N bytes needs a destination of N bytes. `observe(fn, nbytes)` runs fn and records every
buffer of at least `nbytes` made meanwhile by:
- torch (the profiler's memory records: each storage allocated, by the op that allocated it,
  on the CPU and, where CUDA runs, on a device: torch.cuda.memory_stats's allocation count);
- Python (tracemalloc: bytes, bytearrays and numpy arrays, which numpy reports to it): a
  staging copy through any of these shows as a peak of at least `nbytes` above the start.
It also counts torch's own copy ops (aten::copy_: a host-to-device or device-to-device copy is
one). `pool_overlaps(client, tensor)` says whether a tensor's storage lies in the client's
mappings of the daemon's host pool (a view, not a copy).
"""
from __future__ import annotations

import tracemalloc
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile


@dataclass
class Observed:
    result: Any
    torch_buffers: list[str] = field(default_factory=list)  # "op (bytes)" of each storage >= nbytes
    device_allocations: int = 0  # storages allocated on CUDA devices (torch's caching allocator)
    python_peak: int = 0  # most bytes Python-tracked objects (bytes, numpy arrays) held above the start
    torch_copies: int = 0  # aten::copy_ calls

    def buffers_of_at_least(self, nbytes: int) -> int:
        """Destinations big enough for a copy: torch storages, device ones, Python staging."""
        return len(self.torch_buffers) + self.device_allocations + (self.python_peak >= nbytes)


def _device_allocations() -> int:
    if not torch.cuda.is_available():
        return 0
    return sum(torch.cuda.memory_stats(d).get("allocation.all.allocated", 0)
               for d in range(torch.cuda.device_count()))


def observe(fn: Callable[[], Any], nbytes: int) -> Observed:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    devices_before = _device_allocations()
    with profile(activities=activities, profile_memory=True) as prof:
        tracemalloc.start()  # inside: what the profiler builds when it stops is not fn's
        try:
            start = tracemalloc.get_traced_memory()[0]
            result = fn()
            peak = tracemalloc.get_traced_memory()[1] - start
        finally:
            tracemalloc.stop()
    devices = _device_allocations() - devices_before
    observed = Observed(result, device_allocations=devices, python_peak=peak)
    for event in prof.events():
        if event.name == "aten::copy_":
            observed.torch_copies += 1
        # self memory: an op's own allocation, not its children's again (aten::clone allocates
        # through aten::empty_strided); "[memory]" records carry allocations made outside any op
        allocated = event.cpu_memory_usage if event.name == "[memory]" else event.self_cpu_memory_usage
        if allocated >= nbytes:
            observed.torch_buffers.append(f"{event.name} ({allocated} bytes)")
    return observed


def _address(buf) -> int:
    """A mapping's address (read-only ones too: numpy does not need a writable buffer)."""
    return np.frombuffer(buf, np.uint8, count=1).ctypes.data


def pool_overlaps(client, tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s storage lies in any of `client`'s mappings of the host pool."""
    if tensor.device.type != "cpu":
        return False
    storage = tensor.untyped_storage()
    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    mapping = client.mapping
    for buf in list(mapping.rw) + list(mapping.ro):
        base = _address(buf)
        if start < base + len(buf) and base < end:
            return True
    return False
