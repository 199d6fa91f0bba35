"""Moving CPU tensors in and out of pool memory without torch's copy kernels.

torch CPU copies on small VMs pay a flat intra-op threading cost (~8 ms for 1 MiB with 2
threads here), and changing torch's thread count would change the engine's global settings, so
copies go through numpy views of the same memory (a plain memcpy for contiguous data). dtypes
numpy lacks (bfloat16, float8) are viewed as unsigned integers of the same width: bytes are bytes.

A contiguous tensor goes into the pool, and a get's copy comes out of it, through `write_bytes`:
the compiled ecd._copy where it was built (non-temporal stores from 4 MiB up, so a large copy
neither reads the destination's lines first nor evicts what the client and daemon use next; the
source prefetched ahead), else numpy's copy (memcpy).
"""
from __future__ import annotations

import logging
import warnings

import numpy as np
import torch
import xxhash

from ..errors import InvalidRequest
from ..integrity import EMPTY_CHECKSUM, checksum, finish
from ..protocol import DTYPE_ITEMSIZE

TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in DTYPE_ITEMSIZE if hasattr(torch, name)
}
_DTYPE_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}
_SAME_WIDTH_UINT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Copies that also checksum go in pieces this big: each piece is hashed while it is still in the
# L2 cache, instead of reading the whole destination back from L3/DRAM after the copy.
CHECKSUM_CHUNK = 256 << 10


def _spend_read_only_warning() -> None:
    """torch warns, once per process, that it cannot enforce a read-only buffer: a read-only
    mapping of the pool is the point. That one warning is spent here, at import, silenced, so no
    view raises it whatever filters the engine or its test runner (-W error) installs later.
    Not a warnings.catch_warnings() around each view: that replaces and restores the
    process-wide filter list (documented as not thread-safe) and cost 15-30 us of a view on a
    cold cache (the hand-off's consumer, right after a 16 MiB copy)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.frombuffer(b"\0", dtype=torch.uint8)  # bytes: a read-only buffer


_spend_read_only_warning()
# and should a later torch warn on every call, not from ecd's own views
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning,
                        module=r"ecd\.client\.")

# The compiled copy (ecd._copy, built from ecd/_copy.c by setup.py), or None: installed without a
# C compiler, numpy's memcpy does the same, a bit slower. Tests set it to None to check the fallback.
try:
    from .. import _copy as compiled_copy
except ImportError:
    compiled_copy = None
    logging.getLogger(__name__).debug("ecd._copy is not built: copies into the pool use numpy")


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise InvalidRequest(f"dtype {dtype} is not supported by ecd") from None


def torch_dtype(name: str) -> torch.dtype:
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise InvalidRequest(f"dtype {name!r} is not supported by this torch") from None


def _numpy_view(tensor: torch.Tensor) -> np.ndarray:
    """A numpy array sharing `tensor`'s memory and strides (any dtype, contiguous or not)."""
    try:
        return tensor.numpy()
    except TypeError:  # bfloat16, float8_*: same-width integers carry the same bytes
        width = tensor.element_size()
        if width not in _SAME_WIDTH_UINT:  # pragma: no cover - every listed dtype has a width
            raise
        return tensor.view(_SAME_WIDTH_UINT[width]).numpy()


def host_tensor(tensor: torch.Tensor) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise InvalidRequest(f"expected a torch.Tensor, got {type(tensor).__name__}")
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()  # GPU arenas come with the CUDA data plane; stage through host
    if tensor.is_sparse or tensor.is_quantized or tensor.layout != torch.strided:
        raise InvalidRequest("only dense strided tensors can be stored")
    if tensor.is_conj() or tensor.is_neg():
        tensor = tensor.resolve_conj().resolve_neg()
    return tensor


def write_bytes(buf, offset: int, src: np.ndarray) -> None:
    """buf[offset:offset + src.size] = src, a flat contiguous uint8 array."""
    if compiled_copy is not None:
        compiled_copy.copy(buf, offset, src)
    else:
        np.copyto(np.frombuffer(buf, np.uint8, count=src.size, offset=offset), src)


def _copy_hashing(dst: np.ndarray, src: np.ndarray) -> int:
    """dst[:] = src (flat uint8 arrays), hashing each piece of dst right after it is written."""
    h = xxhash.xxh3_64()
    with memoryview(dst) as mv:  # type: ignore[arg-type]  # numpy stubs: ndarray.__buffer__ only on 3.12+
        for start in range(0, dst.size, CHECKSUM_CHUNK):
            end = start + CHECKSUM_CHUNK
            np.copyto(dst[start:end], src[start:end])
            h.update(mv[start:end])
    return finish(h.intdigest())


def copy_into(buf, offset: int, tensor: torch.Tensor, *, with_checksum: bool = False) -> int:
    """Write `tensor`'s elements, in row-major order, to buf[offset:offset + nbytes]. With
    `with_checksum`, returns the checksum of the bytes written (read back from `buf`), else 0."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return EMPTY_CHECKSUM if with_checksum else 0
    if tensor.is_contiguous():
        src = _numpy_view(tensor.reshape(-1)).view(np.uint8)
        if with_checksum:  # ordinary stores: each piece is hashed from the cache right after
            return _copy_hashing(np.frombuffer(buf, np.uint8, count=nbytes, offset=offset), src)
        write_bytes(buf, offset, src)
    else:
        src = _numpy_view(tensor)
        dst = np.frombuffer(buf, np.uint8, count=nbytes, offset=offset)
        np.copyto(dst.view(src.dtype).reshape(src.shape), src)
        if with_checksum:
            return checksum(buf, offset, nbytes)
    return 0


def copy_out(buf, offset: int, nbytes: int, dtype: str, shape: list[int]) -> torch.Tensor:
    """A new tensor holding a copy of buf[offset:offset + nbytes]."""
    return copy_out_checked(buf, offset, nbytes, dtype, shape, with_checksum=False)[0]


def copy_out_checked(buf, offset: int, nbytes: int, dtype: str, shape: list[int], *,
                     with_checksum: bool = True) -> tuple[torch.Tensor, int]:
    """(a new tensor holding a copy of buf[offset:offset + nbytes], the checksum of the copy's
    bytes or 0): hashing the copy, not the source, checks exactly the bytes handed back."""
    out = torch.empty(shape, dtype=torch_dtype(dtype))
    digest = EMPTY_CHECKSUM if with_checksum else 0
    if nbytes:
        src = np.frombuffer(buf, np.uint8, count=nbytes, offset=offset)
        dst = _numpy_view(out.reshape(-1)).view(np.uint8)
        if with_checksum:
            digest = _copy_hashing(dst, src)
        else:
            write_bytes(dst, 0, src)  # a 16 MiB get: 0.85x np.copyto's time into a fresh tensor
    return out, digest


def view_of(buf, offset: int, nbytes: int, dtype: str, shape: list[int]) -> torch.Tensor:
    """A zero-copy tensor over buf[offset:offset + nbytes] (keeps `buf` alive)."""
    tdtype = torch_dtype(dtype)
    if nbytes == 0:
        return torch.empty(shape, dtype=tdtype)
    itemsize = DTYPE_ITEMSIZE[dtype]
    return torch.frombuffer(buf, dtype=tdtype, count=nbytes // itemsize, offset=offset).view(shape)


def parse_device(device) -> torch.device | None:
    """get()'s `device` argument: None (where the entry lives), "cpu", "cuda", "cuda:N", an int N
    (cuda:N, torch's convention) or a torch.device. Only cpu and cuda devices are accepted; a
    bare "cuda" keeps index None (the caller's current device, resolved when copying)."""
    if device is None:
        return None
    if isinstance(device, bool):
        raise InvalidRequest(f"device must be None, 'cpu', 'cuda[:N]', an int or a torch.device, got {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise InvalidRequest(f"device ordinal must be >= 0, got {device}")
        return torch.device("cuda", device)
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError as exc:
            raise InvalidRequest(f"device {device!r}: {exc}") from None
    if not isinstance(device, torch.device):
        raise InvalidRequest(f"device must be None, 'cpu', 'cuda[:N]', an int or a torch.device, got {device!r}")
    if device.type not in ("cpu", "cuda"):
        raise InvalidRequest(f"ecd copies to cpu or cuda devices, not {device.type!r}")
    if device.type == "cpu":
        return torch.device("cpu")
    return device
