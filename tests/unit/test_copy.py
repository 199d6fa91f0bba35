"""The client's copy into pool memory: ecd._copy (streaming stores from STREAM_MIN up, every routine
the CPU has) and the numpy fallback write exactly the source's bytes, at every size and alignment,
and nothing outside the destination range."""
from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch

from ecd.client import tensors

try:
    from ecd import _copy
except ImportError:  # built by `pip install -e .` (setup.py) where a C compiler is present
    _copy = None

needs_ext = pytest.mark.skipif(_copy is None, reason="ecd._copy is not built (no C compiler at install time)")

MIB = 1 << 20
SIZES = [0, 1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 257, 4095, 4096, 4097,
         MIB - 1, MIB, MIB + 1, 16 * MIB + 7]
OFFSETS = [(0, 0), (1, 0), (0, 1), (7, 3), (15, 17), (31, 33), (64, 5)]  # (dst, src) misalignment
GUARD = 256  # bytes either side of the destination range that must stay untouched
FILL = 0xA5


def pattern(n: int, seed: int) -> np.ndarray:
    """n bytes no shifted or truncated copy reproduces (a counter would repeat every 256)."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def check_copy(copy, size: int, dst_off: int, src_off: int) -> None:
    """copy(buf, offset, src) must make buf[offset:offset + size] == src and leave the rest as it was."""
    backing = pattern(size + src_off, size + src_off)
    src = backing[src_off:]  # a view starting src_off bytes into an aligned allocation
    assert src.size == size
    buf = mmap.mmap(-1, GUARD + dst_off + size + GUARD)  # page-aligned: dst_off is the misalignment
    buf[:] = bytes([FILL]) * len(buf)
    copy(buf, GUARD + dst_off, src)
    out = np.frombuffer(buf, np.uint8)
    start, end = GUARD + dst_off, GUARD + dst_off + size
    mismatch = np.flatnonzero(out[start:end] != src)
    assert mismatch.size == 0, f"size {size}, offsets {dst_off}/{src_off}: first wrong byte at {mismatch[:1]}"
    assert (out[:start] == FILL).all() and (out[end:] == FILL).all(), "wrote outside the destination"
    del out
    buf.close()


@needs_ext
@pytest.mark.parametrize("size", SIZES)
def test_compiled_copy_is_exact_with_every_routine(size):
    assert _copy.ISA in _copy.ISAS
    for isa in _copy.ISAS:
        for dst_off, src_off in OFFSETS if size < 4 * MIB else OFFSETS[:3]:
            # stream_min=0: the streaming routine even for the smallest copies (head, body, tail)
            check_copy(lambda b, o, s: _copy.copy(b, o, s, stream_min=0, isa=isa), size, dst_off, src_off)
    check_copy(_copy.copy, size, 3, 5)  # the default: memcpy below STREAM_MIN, streaming above


@needs_ext
def test_compiled_copy_refuses_what_does_not_fit():
    buf = bytearray(16)
    with pytest.raises(ValueError):
        _copy.copy(buf, 8, b"x" * 9)
    with pytest.raises(ValueError):
        _copy.copy(buf, -1, b"x")
    with pytest.raises(ValueError):
        _copy.copy(buf, 17, b"")
    with pytest.raises(ValueError):
        _copy.copy(buf, 0, b"x", isa="no-such-routine")
    with pytest.raises((TypeError, BufferError)):
        _copy.copy(b"read-only", 0, b"x")  # not a writable buffer
    with pytest.raises((TypeError, BufferError, ValueError)):
        _copy.copy(buf, 0, np.arange(8, dtype=np.uint8)[::2])  # not contiguous
    _copy.copy(buf, 16, b"")  # an empty copy at the end fits
    assert buf == bytearray(16)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy-fallback"])
@pytest.mark.parametrize("size", [0, 1, 15, 16, 4095, MIB - 1, MIB + 1, 4 * MIB + 3, 16 * MIB + 7])
def test_copy_into_writes_the_tensor_bytes(monkeypatch, compiled, size):
    """copy_into (put's copy) gives the same bytes through ecd._copy and through numpy."""
    if compiled and _copy is None:
        pytest.skip("ecd._copy is not built")
    if not compiled:
        monkeypatch.setattr(tensors, "compiled_copy", None)
    assert (tensors.compiled_copy is not None) == compiled

    def copy(buf, offset, src):
        assert tensors.copy_into(buf, offset, torch.from_numpy(src)) == 0

    for dst_off, src_off in [(0, 0), (1, 3), (13, 1)]:
        check_copy(copy, size, dst_off, src_off)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy-fallback"])
def test_copy_into_other_dtypes_and_layouts(monkeypatch, compiled):
    if compiled and _copy is None:
        pytest.skip("ecd._copy is not built")
    if not compiled:
        monkeypatch.setattr(tensors, "compiled_copy", None)
    t = torch.arange(3 * 1024 * 1024, dtype=torch.float32).reshape(1024, 3072)
    for src in (t.to(torch.bfloat16), t, t.t(), t[:, ::2]):  # bfloat16, contiguous, transposed, strided
        nbytes = src.numel() * src.element_size()
        buf = bytearray(nbytes + 5)
        assert tensors.copy_into(buf, 5, src) == 0
        back = tensors.view_of(buf, 5, nbytes, tensors.dtype_name(src.dtype), list(src.shape))
        assert torch.equal(back, src)



@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy-fallback"])
@pytest.mark.parametrize("size", [1, 4095, 4 * MIB - 1, 4 * MIB, 4 * MIB + 3, 16 * MIB + 7])
def test_copy_out_gives_the_pool_bytes(monkeypatch, compiled, size):
    """copy_out (get's copy into a new tensor) through ecd._copy (streaming from STREAM_MIN) and
    through numpy, from unaligned pool offsets."""
    if compiled and _copy is None:
        pytest.skip("ecd._copy is not built")
    if not compiled:
        monkeypatch.setattr(tensors, "compiled_copy", None)
    for offset in (0, 1, 4099):
        src = pattern(offset + size, size + offset)
        out = tensors.copy_out(src, offset, size, "uint8", [size])
        assert np.array_equal(out.numpy(), src[offset:])


@needs_ext
def test_streaming_copy_reads_nothing_past_its_source():
    """The streaming loops prefetch ahead of the source: at the very end of a mapping, with an
    inaccessible page right after, the copy must neither fault nor read it."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    size = 4 * MIB
    region = mmap.mmap(-1, size + page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    assert libc.mprotect(base + size, page, 0) == 0, ctypes.get_errno()  # PROT_NONE after the source
    try:
        src = np.frombuffer(region, np.uint8, count=size)
        src[:] = pattern(size, 11)
        for isa in _copy.ISAS:
            for length in (size, size - 1, size - 100):  # ending at, or just before, the guard page
                dst = bytearray(length)
                _copy.copy(dst, 0, src[size - length:], stream_min=0, isa=isa)
                assert np.array_equal(np.frombuffer(dst, np.uint8), src[size - length:])
        del src
    finally:
        libc.mprotect(base + size, page, mmap.PROT_READ | mmap.PROT_WRITE)




def test_views_of_read_only_pool_memory_warn_nothing_and_leave_the_filters_alone(tmp_path):
    """torch warns (once per process) that it cannot enforce a read-only buffer. Views of the
    read-only pool mapping must neither surface that to an engine running with -W error (or a
    test runner that turns warnings into errors after ecd is imported) nor change the process's
    warning filters. A fresh interpreter: torch raises the warning once per process."""
    import subprocess
    import sys
    script = tmp_path / "view.py"
    script.write_text(
        "import mmap, warnings\n"
        "from ecd.client import cuda, tensors\n"
        "warnings.simplefilter('error')  # after import, as a test runner's -W error does per test\n"
        "filters = list(warnings.filters)\n"
        "ro = mmap.mmap(-1, 1 << 16, prot=mmap.PROT_READ)\n"
        "for _ in range(3):\n"
        "    assert tensors.view_of(ro, 4096, 4096, 'float32', [32, 32]).shape == (32, 32)\n"
        "    assert cuda.host_bytes(ro, 0, 16).numel() == 16\n"
        "assert warnings.filters == filters, 'a view changed the warning filters'\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-W", "error::UserWarning", str(script)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
