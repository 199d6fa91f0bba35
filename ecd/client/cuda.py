"""The client's CUDA data plane: daemon-owned GPU arenas and host-pool copies to and from devices.

Imported by ecd.Client only when a CUDA tensor or an arena entry is involved, so a CPU-only
client never loads it (nor initialises CUDA). One `CudaPlane` per daemon epoch:

- arenas are matched to this process's devices by UUID (`map_arenas`), since ordinals differ
  between processes under different CUDA_VISIBLE_DEVICES; an arena on a device this process
  cannot see is simply not local (its entries cannot be read from here);
- each arena's IPC handle is opened once, lazily, and its base pointer cached; entries are
  zero-copy CUDA tensors over [base + offset, nbytes) built through `__cuda_array_interface__`;
- the first copy between a device and the host pool registers this process's writable shm
  mappings with cuMemHostRegister, so those copies run asynchronously at DMA speed;
- every copy is enqueued on the caller's current stream (of the device involved); a `CopyBatch`
  records an event on each stream it used and waits for it: puts commit, and gets release their
  lease, only after the bytes are really there.

Checksums of bytes on a GPU are computed by staging them to host memory (one extra device-to-host
copy: slow, meant for debugging and verify namespaces, not the hot path).
"""
from __future__ import annotations

import threading
import warnings
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch

from ..errors import EcdError, InvalidRequest
from ..integrity import EMPTY_CHECKSUM, checksum
from ..memory.cuda import format_uuid as raw_uuid
from ..memory.cuda_vmm import VmmMapping
from ..protocol import ArenaInfo, Extent
from .tensors import _numpy_view, dtype_name, host_tensor, torch_dtype

HOST = -1  # choose_tier's answer for the host pool (Alloc.arena's value for it too)
TIERS = (None, "host", "cuda")


# ---- pure helpers (unit-tested on CPU) -------------------------------------------------------

def format_uuid(value) -> str:
    """A device UUID as nvidia-smi prints it: "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx".

    Accepts torch's `_CudaDeviceProperties.uuid` (an object with `.bytes`, or whose str() is
    the bare UUID), 16 raw bytes, or a string with or without the "GPU-"/"MIG-" prefix."""
    if isinstance(value, str):
        text = value.strip()
    elif isinstance(value, (bytes, bytearray)) and len(value) == 16:
        return raw_uuid(bytes(value))  # the daemon's spelling, from the same 16 bytes
    elif getattr(value, "bytes", None) is not None and len(value.bytes) == 16:
        # torch's _CUuuid.bytes is a list of 16 ints in some versions, bytes in others
        return raw_uuid(bytes(value.bytes))
    else:
        text = str(value).strip()
    prefix = "GPU-"
    for known in ("GPU-", "MIG-"):
        if text[:4].upper() == known:
            prefix, text = known, text[4:]
            break
    return prefix + text.lower()


def map_arenas(arenas: Iterable[ArenaInfo], local_uuids: list[str]) -> dict[int, int]:
    """{arena pool index: this process's device ordinal} for the arenas on devices it can see.

    `local_uuids[i]` is the UUID of local ordinal i. Arenas on other devices are left out."""
    ordinal_of = {format_uuid(u): i for i, u in enumerate(local_uuids)}
    out: dict[int, int] = {}
    for arena in arenas:
        ordinal = ordinal_of.get(format_uuid(arena.device_uuid))
        if ordinal is not None:
            out[arena.index] = ordinal
    return out


def arenas_by_ordinal(by_pool: Mapping[int, int]) -> dict[int, int]:
    """{local ordinal: arena pool index}; two arenas on one device: the lower index serves puts."""
    out: dict[int, int] = {}
    for pool in sorted(by_pool):
        out.setdefault(by_pool[pool], pool)
    return out


def choose_tier(tensor_is_cuda: bool, tensor_device_ordinal: int | None, tier: str | None,
                arena_by_ordinal: Mapping[int, int]) -> int:
    """Where a put of this tensor goes: an arena's pool index, or HOST (-1).

    CPU tensors always go to the host pool. A CUDA tensor goes to the arena of its own device;
    with tier=None it falls back to the host pool when that device has no arena, tier="host"
    forces the host pool, and tier="cuda" without an arena for the device is refused."""
    if tier not in TIERS:
        raise InvalidRequest(f"tier must be None, 'host' or 'cuda', got {tier!r}")
    if not tensor_is_cuda or tier == "host":
        return HOST
    arena = arena_by_ordinal.get(tensor_device_ordinal) if tensor_device_ordinal is not None else None
    if arena is not None:
        return arena
    if tier == "cuda":
        have = sorted(arena_by_ordinal)
        raise InvalidRequest(
            f"tier='cuda': the daemon has no arena on this tensor's device cuda:{tensor_device_ordinal} "
            f"(arenas visible to this process are on cuda:{have} under its CUDA_VISIBLE_DEVICES)"
            if have else
            f"tier='cuda': the daemon has no CUDA arena on cuda:{tensor_device_ordinal} ([pool.cuda] "
            f"devices); put with tier=None to fall back to the host pool")
    return HOST


def cai_dict(ptr: int, offset: int, nbytes: int) -> dict:
    """The __cuda_array_interface__ (v3) of nbytes bytes at device address ptr + offset: a flat,
    contiguous uint8 array. No stream: the memory needs no synchronisation to be described."""
    if ptr <= 0 or offset < 0 or nbytes <= 0:
        raise ValueError(f"bad device range: ptr={ptr:#x} offset={offset} nbytes={nbytes}")
    return {"shape": (nbytes,), "typestr": "|u1", "data": (ptr + offset, False), "strides": None,
            "version": 3, "stream": None}


class DeviceBytes:
    """What torch.as_tensor reads a device range from; the tensor keeps it alive."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, ptr: int, offset: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = cai_dict(ptr, offset, nbytes)


def device_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor ready to be copied: dense strided, conj/neg resolved (stays on its device)."""
    tensor = tensor.detach()
    if tensor.is_sparse or tensor.is_quantized or tensor.layout != torch.strided:
        raise InvalidRequest("only dense strided tensors can be stored")
    if tensor.is_conj() or tensor.is_neg():
        tensor = tensor.resolve_conj().resolve_neg()
    return tensor


def buffer_address(buf) -> int:
    """The address of a buffer's first byte (an mmap, read-only or not)."""
    return int(np.frombuffer(buf, np.uint8, count=1).ctypes.data)


def local_device_uuids() -> list[str]:
    """UUIDs of the devices this process sees, by ordinal ([] without CUDA)."""
    if not torch.cuda.is_available():
        return []
    return [format_uuid(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def _driver():
    try:
        from ..memory.cuda import load_driver
    except ImportError as exc:  # pragma: no cover - the daemon side ships it
        raise InvalidRequest(f"the CUDA driver bindings (ecd.memory.cuda) are missing: {exc}") from None
    return load_driver()


def host_bytes(buf, offset: int, nbytes: int) -> torch.Tensor:
    """A CPU uint8 tensor over buf[offset:offset + nbytes] (no copy)."""
    # read-only buffers: torch's warning that it cannot enforce it is spent at import (tensors.py)
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)


def tensor_checksum(tensor: torch.Tensor) -> int:
    """xxh3-64 of a tensor's bytes in row-major order; GPU tensors are staged to host (slow)."""
    if tensor.numel() == 0:
        return EMPTY_CHECKSUM
    host = tensor.detach().contiguous().cpu().reshape(-1)
    return checksum(_numpy_view(host).view(np.uint8))


# ---- the per-epoch plane --------------------------------------------------------------------

class CudaPlane:
    """One daemon epoch's arenas and host registration, as this process sees them."""

    def __init__(self, epoch: int, arenas: list[ArenaInfo], host_bufs: list, n_host: int,
                 arena_fds: Mapping[int, int] | None = None) -> None:
        """`arena_fds`: pool index -> descriptor of the arenas exported as file descriptors (the
        epoch's mapping owns them; they are only read here, when the arena is first opened)."""
        self.epoch = epoch
        self.arenas = {a.index: a for a in arenas}
        self.n_host = n_host
        self.by_pool = map_arenas(arenas, local_device_uuids()) if arenas else {}
        self.by_ordinal = arenas_by_ordinal(self.by_pool)
        self._host_bufs = host_bufs  # the writable mappings: kept mapped until they are unregistered
        self._arena_fds = dict(arena_fds or {})
        self._bases: dict[int, int] = {}  # arena pool -> base pointer opened in this process
        self._imported: dict[int, VmmMapping] = {}  # arena pool -> its mapping here (export "fd")
        self._registered: list[int] = []  # host addresses registered with the driver
        self._host_state = 0  # 0: not tried, 1: registered, -1: failed (copies still work, slower)
        self._lock = threading.Lock()
        self._closed = False

    # -- placement

    def tier_for(self, tensor: torch.Tensor, tier: str | None) -> int:
        return choose_tier(tensor.is_cuda, tensor.device.index if tensor.is_cuda else None, tier,
                           self.by_ordinal)

    def ordinal_of(self, pool: int) -> int:
        ordinal = self.by_pool.get(pool)
        if ordinal is None:
            arena = self.arenas.get(pool)
            where = f"device {arena.device_uuid}" if arena is not None else f"pool {pool}"
            raise InvalidRequest(
                f"the entry lives in the daemon's CUDA arena on {where}, which this process cannot see "
                f"({'no CUDA' if not torch.cuda.is_available() else 'check CUDA_VISIBLE_DEVICES'}); "
                "read it from a process on that device, or store it with tier='host'")
        return ordinal

    # -- memory

    def arena_base(self, pool: int) -> int:
        """The arena's base pointer in this process: its IPC handle is opened on first use, once."""
        base = self._bases.get(pool)
        if base is not None:
            return base
        ordinal = self.ordinal_of(pool)
        with self._lock:
            if self._closed:
                raise EcdError("client is closed")
            base = self._bases.get(pool)
            if base is None:
                torch.cuda.init()  # the primary context torch uses is the one the handle opens in
                base = self._bases[pool] = self._open_arena(pool, ordinal)
        return base

    def _open_arena(self, pool: int, ordinal: int) -> int:
        """Map the arena into this process: its IPC handle opened, or its descriptor imported."""
        arena = self.arenas[pool]
        if arena.export != "fd":
            return _driver().ipc_open_handle(ordinal, arena.handle)
        fd = self._arena_fds.get(pool)
        if fd is None:
            raise EcdError(f"the daemon exports its CUDA arena {pool} as a file descriptor, and this client "
                           "got none: it reaches the daemon without its fd socket")
        # Copies to the other devices of this process read the arena through their own access.
        peers = tuple(other for other in range(torch.cuda.device_count())
                      if other != ordinal and torch.cuda.can_device_access_peer(other, ordinal))
        mapping = _driver().vmm.import_fd(ordinal, fd, arena.size, peers)
        self._imported[pool] = mapping
        return mapping.ptr

    def arena_bytes(self, pool: int, offset: int, nbytes: int) -> torch.Tensor:
        """A zero-copy CUDA uint8 tensor over the arena's [offset, offset + nbytes)."""
        ordinal = self.ordinal_of(pool)
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", ordinal))
        flat = torch.as_tensor(DeviceBytes(self.arena_base(pool), offset, nbytes),
                               device=torch.device("cuda", ordinal))
        return flat

    def arena_tensor(self, pool: int, offset: int, nbytes: int, dtype: str, shape: list[int]) -> torch.Tensor:
        tdtype = torch_dtype(dtype)
        if nbytes == 0:
            return torch.empty(shape, dtype=tdtype, device=torch.device("cuda", self.ordinal_of(pool)))
        return self.arena_bytes(pool, offset, nbytes).view(tdtype).view(shape)

    def register_host(self) -> None:
        """Register the host pool mappings with the driver once (pinned: async DMA copies)."""
        if self._host_state:
            return
        with self._lock:
            if self._host_state or self._closed:
                return
            try:
                driver = _driver()
                for buf in filter(None, self._host_bufs):  # (None: another tenant's segment)
                    address = buffer_address(buf)
                    driver.host_register(address, len(buf))
                    self._registered.append(address)
                self._host_state = 1
            except EcdError as exc:
                self._host_state = -1
                warnings.warn(f"ecd: cannot register the host pool with CUDA ({exc}); host<->device "
                              "copies stay correct but run at pageable-memory speed", RuntimeWarning,
                              stacklevel=3)

    def host_tensor(self, pool: int, offset: int, nbytes: int, dtype: str, shape: list[int]) -> torch.Tensor:
        """A CPU tensor over the host pool's writable mapping (registered for DMA)."""
        self.register_host()
        tdtype = torch_dtype(dtype)
        if nbytes == 0:
            return torch.empty(shape, dtype=tdtype)
        return host_bytes(self._host_bufs[pool], offset, nbytes).view(tdtype).view(shape)

    def location_tensor(self, pool: int, offset: int, nbytes: int, dtype: str, shape: list[int]) -> torch.Tensor:
        if pool >= self.n_host:
            return self.arena_tensor(pool, offset, nbytes, dtype, shape)
        return self.host_tensor(pool, offset, nbytes, dtype, shape)

    def extent_checksum(self, pool: int, offset: int, nbytes: int) -> int:
        """Checksum of bytes just written to an extent: read in place from the host pool, staged
        to host memory from an arena (slow)."""
        if nbytes == 0:
            return EMPTY_CHECKSUM
        if pool < self.n_host:
            return checksum(self._host_bufs[pool], offset, nbytes)
        return tensor_checksum(self.arena_bytes(pool, offset, nbytes))

    def batch(self) -> "CopyBatch":
        return CopyBatch(self)

    def group_by_tier(self, items: Mapping[str, torch.Tensor], tier: str | None) -> dict[int, dict[str, torch.Tensor]]:
        """A put's items by where they go: an arena's pool index, or HOST (CPU tensors always)."""
        groups: dict[int, dict[str, torch.Tensor]] = {}
        for key, t in items.items():
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t = device_tensor(t)
                arena = self.tier_for(t, tier)
            else:
                t, arena = host_tensor(t), HOST
            groups.setdefault(arena, {})[key] = t
        return groups

    def copy_in_async(self, extents: Sequence[Extent], tensors: Sequence[torch.Tensor]) -> "CopyBatch":
        """Copy tensors into extents on the callers' current streams without waiting: the batch
        returned says when they are done (done(), wait()). The tensors' later work on those
        streams runs after the copies, as with any copy_ there."""
        batch = self.batch()
        try:
            for extent, t in zip(extents, tensors):
                batch.put(extent.pool, extent.offset, t)
            batch.record()
        except BaseException:
            batch.wait_quietly()  # never give an extent back while a copy may still write into it
            raise
        return batch

    def copy_in(self, extents: Sequence[Extent], tensors: Sequence[torch.Tensor], with_checksum: bool) -> list[int]:
        """Copy tensors into extents on the callers' current streams and wait for the copies: the
        bytes are there when this returns (a put may commit). Digests (0 without checksum)."""
        batch = self.copy_in_async(extents, tensors)
        try:
            batch.wait()
        except BaseException:
            batch.wait_quietly()  # never give an extent back while a copy may still write into it
            raise
        if not with_checksum:
            return [0] * len(extents)
        return [self.extent_checksum(e.pool, e.offset, t.numel() * t.element_size())
                for e, t in zip(extents, tensors)]

    def close(self) -> None:
        """Close the arena handles and unregister the host mappings (errors ignored: at exit the
        driver may already be gone, and a restarted daemon's old arenas no longer exist)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            bases, self._bases = self._bases, {}
            registered, self._registered = self._registered, []
        if not bases and not registered:
            return
        try:
            driver = _driver()
        except Exception:
            return
        for pool, base in bases.items():
            try:
                imported = self._imported.pop(pool, None)
                if imported is not None:
                    driver.vmm.unmap(imported)
                else:
                    driver.ipc_close_handle(self.by_pool[pool], base)
            except Exception:
                pass
        for address in registered:
            try:
                driver.host_unregister(address)
            except Exception:
                pass
        self._host_bufs = []


class CopyBatch:
    """Copies enqueued on the caller's current streams, then waited for together.

    Each copy runs on the current stream of the device doing it (torch's rule for copy_), after
    whatever the caller queued there before (so a put copies the finished tensor). `wait()`
    records an event on every stream used and synchronises on it: until then the bytes are not
    there and the entry must be neither committed nor released."""

    def __init__(self, plane: CudaPlane) -> None:
        self.plane = plane
        self.devices: set[int] = set()
        self.events: list = []  # recorded by record(): what done() and wait() look at
        self.used: set[int] = set()  # every device touched (wait_quietly's last resort)

    def _touch(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if t.is_cuda:
                self.devices.add(t.device.index)
                self.used.add(t.device.index)

    def put(self, pool: int, offset: int, tensor: torch.Tensor) -> None:
        """Enqueue tensor -> the extent at (pool, offset): D2D into an arena, D2H into the host pool."""
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            return
        dst = self.plane.location_tensor(pool, offset, nbytes, dtype_name(tensor.dtype), list(tensor.shape))
        if dst.is_cuda and tensor.is_cuda and dst.device != tensor.device:
            raise InvalidRequest(f"arena pool {pool} is on {dst.device}, the tensor on {tensor.device}")
        self._touch(dst, tensor)
        with torch.cuda.device(tensor.device if tensor.is_cuda else dst.device):
            dst.copy_(tensor, non_blocking=True)

    def get(self, src: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Enqueue a copy of src (an arena or host-pool tensor) to a new tensor on `device`."""
        if device.type == "cuda":
            out = torch.empty(src.shape, dtype=src.dtype, device=device)
            self._touch(out, src)
            with torch.cuda.device(device):
                out.copy_(src, non_blocking=True)  # P2P when src is another device's arena
            return out
        out = torch.empty(src.shape, dtype=src.dtype)
        self._touch(src)
        if src.is_cuda:
            with torch.cuda.device(src.device):
                out.copy_(src)  # into pageable memory: synchronous with the host anyway
        else:
            out.copy_(src)
        return out

    def after(self, tensor: torch.Tensor) -> None:
        """Also wait, in wait(), for the work queued so far on tensor's device (e.g. on a view)."""
        self._touch(tensor)

    def record(self) -> None:
        """Mark the end of what was queued so far on the streams used (done() and wait() then
        look at these marks, not at what the streams run later)."""
        for ordinal in sorted(self.devices):
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(ordinal))
            self.events.append(event)
        self.devices.clear()

    def done(self) -> bool:
        """Whether the copies recorded have completed (never blocks)."""
        return all(event.query() for event in self.events)

    def wait(self) -> None:
        """Block until everything queued on the streams used (or recorded) is done."""
        self.record()
        for event in self.events:
            event.synchronize()
        self.events.clear()

    def wait_quietly(self) -> None:
        """wait() on an error path: never let a copy still run into an extent being given back."""
        if not self.devices and not self.events:
            return
        try:
            self.wait()
        except Exception:
            for ordinal in sorted(self.used):
                try:
                    torch.cuda.synchronize(ordinal)
                except Exception:
                    pass
            self.devices.clear()
            self.events.clear()
