"""Moving CPU tensors in and out of pool memory without torch's copy kernels.

torch CPU copies on small VMs pay a flat intra-op threading cost (~8 ms for 1 MiB with 2
threads here), and changing torch's thread count would change the engine's global settings, so
copies go through numpy views of the same memory (a plain memcpy for contiguous data). dtypes
numpy lacks (bfloat16, float8) are viewed as unsigned integers of the same width: bytes are bytes.

A contiguous tensor goes into the pool, and a get's copy comes out of it, through `write_bytes`:
the compiled ecd._copy where it was built, else numpy's copy (memcpy). ecd._copy uses memcpy, or
non-temporal stores for large copies where a calibration at the first large copy showed them
faster on this machine (copy_strategy.py): such a copy neither reads the destination's lines
first nor evicts what the client and daemon use next.
"""
from __future__ import annotations

import functools
import logging
import math
import warnings

import numpy as np
import torch
import xxhash

from ..errors import InvalidRequest, ProtocolError
from ..integrity import EMPTY_CHECKSUM, checksum, finish
from ..protocol import DTYPE_ITEMSIZE
from . import copy_strategy

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
compiled_copy = copy_strategy.compiled_copy
if compiled_copy is None:
    logging.getLogger(__name__).debug("ecd._copy is not built: copies into the pool use numpy")


def _choose_large_copy(largest: int) -> None:
    """Before the first copy of STREAM_MIN bytes or more: which routine large copies use here."""
    if largest >= copy_strategy.STREAM_MIN:
        copy_strategy.choose()


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
    if tensor.requires_grad:  # (a new tensor object per put otherwise: it shows at hundreds a put_many)
        tensor = tensor.detach()
    if not tensor.is_cpu:
        tensor = tensor.cpu()  # GPU arenas come with the CUDA data plane; stage through host
    if tensor.is_sparse or tensor.is_quantized or tensor.layout != torch.strided:
        raise InvalidRequest("only dense strided tensors can be stored")
    if tensor.is_conj() or tensor.is_neg():
        tensor = tensor.resolve_conj().resolve_neg()
    return tensor


def write_bytes(buf, offset: int, src: np.ndarray) -> None:
    """buf[offset:offset + src.size] = src, a flat contiguous uint8 array."""
    if compiled_copy is not None:
        if copy_strategy.pending:
            _choose_large_copy(src.size)
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


# (shape, strides) -> whether a tensor of that layout is contiguous below its outermost dimension
_ROWS_CONTIGUOUS: dict[tuple[torch.Size, tuple[int, ...]], bool] = {}


def contiguous_pieces(tensor: torch.Tensor) -> tuple[int, int, int] | None:
    """(address, piece bytes, stride bytes) of a host tensor whose bytes lie in equal contiguous
    pieces: one piece for a contiguous tensor, one per row of the outermost dimension for a
    tensor contiguous below it (a KV block of every layer, viewed in a paged cache whose layers
    share one allocation). None for any other layout (numpy copies those)."""
    if tensor.is_contiguous() or tensor.numel() == 0:
        nbytes = tensor.numel() * tensor.element_size()
        return tensor.data_ptr(), nbytes, nbytes
    if tensor.dim() < 2:
        return None
    layout = (tensor.shape, tensor.stride())
    rows = _ROWS_CONTIGUOUS.get(layout)
    if rows is None:  # asked once per layout: a KV save's hundreds of blocks share one
        rows = tensor[0].is_contiguous()
        if len(_ROWS_CONTIGUOUS) < 1024:
            _ROWS_CONTIGUOUS[layout] = rows
    if not rows:
        return None  # rows overlapping in the source (a stride below a row, even 0) still read right
    item = tensor.element_size()
    return tensor.data_ptr(), tensor[0].numel() * item, tensor.stride(0) * item


def copy_many_into(buf, offsets: list[int], tensors: list[torch.Tensor], nbytes: list[int] | None = None) -> list[int]:
    """copy_into (no checksum) of many host tensors in one call of the compiled copy: what makes a
    put_many of hundreds of small entries cost little more than its memcpy. Tensors of another
    layout, or every tensor without ecd._copy, go one by one. `nbytes`: each tensor's size, where
    the caller has it. Returns the indices copied one by one (none, in the common case)."""
    one_by_one: list[int] = []
    if compiled_copy is None:
        for i, (offset, tensor) in enumerate(zip(offsets, tensors)):
            copy_into(buf, offset, tensor)
            one_by_one.append(i)
        return one_by_one
    dst: list[int] = []
    src: list[int] = []
    sizes: list[int] = []
    for i, (offset, tensor) in enumerate(zip(offsets, tensors)):
        if tensor.is_contiguous():  # the common case, without contiguous_pieces' call
            dst.append(offset)
            src.append(tensor.data_ptr())
            sizes.append(nbytes[i] if nbytes is not None else tensor.numel() * tensor.element_size())
            continue
        pieces = contiguous_pieces(tensor)
        if pieces is None:
            copy_into(buf, offset, tensor)
            one_by_one.append(i)
            continue
        address, piece, stride = pieces
        if piece == stride:  # one contiguous piece
            dst.append(offset)
            src.append(address)
            sizes.append(piece)
            continue
        for row in range(tensor.shape[0]):
            dst.append(offset + row * piece)
            src.append(address + row * stride)
            sizes.append(piece)
    if copy_strategy.pending:
        _choose_large_copy(max(sizes, default=0))
    compiled_copy.copy_many_in(buf, dst, src, sizes)
    return one_by_one


def copy_many_out(buf, offsets: list[int], nbytes: list[int], dtypes: list[str],
                  shapes: list[list[int]]) -> list[torch.Tensor]:
    """copy_out of many entries of one pool mapping: new tensors, filled by one call of the
    compiled copy (numpy, one by one, without it)."""
    if compiled_copy is None:
        return [copy_out(buf, o, n, d, s) for o, n, d, s in zip(offsets, nbytes, dtypes, shapes)]
    dtype_of = TORCH_DTYPES.get
    out = []
    for dtype, shape, size in zip(dtypes, shapes, nbytes):
        tdtype = dtype_of(dtype)
        tensor = torch.empty(shape, dtype=tdtype if tdtype is not None else torch_dtype(dtype))
        if tensor.numel() * tensor.element_size() != size:  # copied by address: never past its end
            raise ProtocolError(f"daemon sent a location of {size} bytes for a {dtype} tensor of shape {shape}")
        out.append(tensor)
    if copy_strategy.pending:
        _choose_large_copy(max(nbytes, default=0))
    compiled_copy.copy_many_out(buf, offsets, [t.data_ptr() for t in out], nbytes)
    return out


def copy_rows_between(dst_addresses: list[int], src_addresses: list[int], sizes: list[int]) -> bool:
    """Many copies between memory the caller holds and has bounds-checked, in one call of the
    compiled copy; False (nothing copied) without it: the caller copies its own way."""
    if compiled_copy is None:
        return False
    if copy_strategy.pending:
        _choose_large_copy(max(sizes, default=0))
    compiled_copy.copy_many_between(dst_addresses, src_addresses, sizes)
    return True


@functools.lru_cache(maxsize=256)  # entries come in a few shapes (KV blocks, embeddings)
def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for d in range(len(shape) - 1, 0, -1):
        strides[d - 1] = strides[d] * shape[d]
    return tuple(strides)


class PoolViews:
    """Zero-copy tensors over entries of pool mappings, for view_many: one typed tensor over each
    whole mapping (per dtype, made on first use) and an as_strided of it per entry, about half
    what a torch.frombuffer per entry costs. Each view keeps its mapping alive, as view_of's do."""

    __slots__ = ("bufs", "_whole")

    def __init__(self, bufs: list) -> None:
        self.bufs = bufs
        self._whole: dict[tuple[int, str], torch.Tensor] = {}

    def view(self, pool: int, offset: int, nbytes: int, dtype: str, shape: list[int]) -> torch.Tensor:
        itemsize = DTYPE_ITEMSIZE[dtype]
        if nbytes == 0 or offset % itemsize:  # (pool offsets are aligned: not for an entry of a pool)
            return view_of(self.bufs[pool], offset, nbytes, dtype, shape)
        whole = self._whole.get((pool, dtype))
        if whole is None:
            buf = self.bufs[pool]
            whole = self._whole[pool, dtype] = torch.frombuffer(buf, dtype=torch_dtype(dtype),
                                                                count=len(buf) // itemsize)
        if math.prod(shape) * itemsize != nbytes:  # a view of exactly the entry's bytes, as view_of's
            raise ProtocolError(f"daemon sent a location of {nbytes} bytes for a {dtype} tensor of shape {shape}")
        return whole.as_strided(shape, _contiguous_strides(tuple(shape)), offset // itemsize)


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
