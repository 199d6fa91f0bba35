"""The client's copy into pool memory: ecd._copy (every routine the CPU has, memcpy and streaming
stores) and the numpy fallback write exactly the source's bytes, at every size and alignment, and
nothing outside the destination range; the routine for large copies is chosen by a calibration or
forced by ECD_COPY_ROUTINE (ecd/client/copy_strategy.py)."""
from __future__ import annotations

import mmap
import os
import subprocess
import sys

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
    assert "memcpy" in _copy.ROUTINES
    for routine in _copy.ROUTINES:
        for dst_off, src_off in OFFSETS if size < 4 * MIB else OFFSETS[:3]:
            # stream_min=0: the streaming routine even for the smallest copies (head, body, tail)
            check_copy(lambda b, o, s: _copy.copy(b, o, s, stream_min=0, routine=routine), size, dst_off, src_off)
    check_copy(_copy.copy, size, 3, 5)  # the default: memcpy below the large routine's threshold


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
        _copy.copy(buf, 0, b"x", routine="no-such-routine")
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
        for routine in _copy.ROUTINES:
            for length in (size, size - 1, size - 100):  # ending at, or just before, the guard page
                dst = bytearray(length)
                _copy.copy(dst, 0, src[size - length:], stream_min=0, routine=routine)
                assert np.array_equal(np.frombuffer(dst, np.uint8), src[size - length:])
        del src
    finally:
        libc.mprotect(base + size, page, mmap.PROT_READ | mmap.PROT_WRITE)




def test_views_of_read_only_pool_memory_warn_nothing_and_leave_the_filters_alone(tmp_path):
    """torch warns (once per process) that it cannot enforce a read-only buffer. Views of the
    read-only pool mapping must neither surface that to an engine running with -W error (or a
    test runner that turns warnings into errors after ecd is imported) nor change the process's
    warning filters. A fresh interpreter: torch raises the warning once per process."""
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


# ---- many entries in one call (issue 26: put_many / get_many of hundreds of KV blocks) ----------

@needs_ext
def test_copy_many_in_and_out_copy_every_range_and_refuse_a_bad_one_before_copying():
    src = [torch.from_numpy(pattern(n, n + 1)) for n in (0, 1, 255, 4096, 4097)]
    offsets = [0, 7, 300, 1024, 9000]
    buf = mmap.mmap(-1, 16384)
    buf[:] = bytes([FILL]) * len(buf)
    _copy.copy_many_in(buf, offsets, [t.data_ptr() for t in src], [t.numel() for t in src])
    view = np.frombuffer(buf, np.uint8)
    for off, t in zip(offsets, src):
        assert (view[off:off + t.numel()] == t.numpy()).all()
    assert view[9000 + 4097] == FILL and view[6] == FILL  # nothing outside the ranges
    back = [torch.empty(t.numel(), dtype=torch.uint8) for t in src]
    _copy.copy_many_out(buf, offsets, [t.data_ptr() for t in back], [t.numel() for t in back])
    assert all(torch.equal(a, b) for a, b in zip(src, back))
    before = bytes(buf)
    ok = torch.from_numpy(pattern(16, 3))
    for offsets_, sizes in [([0, 16380], [16, 16]), ([0, -1], [16, 1]), ([0, 0], [16, -5])]:
        with pytest.raises(ValueError):
            _copy.copy_many_in(buf, offsets_, [ok.data_ptr()] * 2, sizes)
    assert bytes(buf) == before  # the first (good) range was not copied either
    with pytest.raises(ValueError, match="same length"):
        _copy.copy_many_in(buf, [0], [ok.data_ptr(), ok.data_ptr()], [16])
    with pytest.raises(ValueError, match="address 0"):
        _copy.copy_many_out(buf, [0], [0], [16])


def _many_sources() -> list[torch.Tensor]:
    """Contiguous, empty, bf16, rows of a paged cache (strided below the outermost dimension, as
    PagedKV.gather hands them) and a transposed tensor (no contiguous rows: numpy copies it)."""
    g = torch.Generator().manual_seed(5)
    paged = torch.randn(3, 8, 4, 16, generator=g).to(torch.float16)  # [layers, blocks, ...]
    stacked = paged.permute(1, 0, 2, 3)  # [blocks, layers, ...]: each block's layers are apart
    return [torch.randn(33, generator=g), torch.empty(0, 5), torch.randn(4, 7, generator=g).to(torch.bfloat16),
            stacked[2], stacked[5], torch.randn(6, 5, generator=g).t(), torch.arange(3, dtype=torch.int64)]


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
def test_copy_many_into_and_out_round_trip_every_layout(monkeypatch, compiled):
    if compiled and _copy is None:
        pytest.skip("ecd._copy is not built")
    if not compiled:
        monkeypatch.setattr(tensors, "compiled_copy", None)
    sources = _many_sources()
    assert tensors.contiguous_pieces(sources[3])[1:] == (4 * 16 * 2, 8 * 4 * 16 * 2)  # a row per layer
    assert tensors.contiguous_pieces(sources[5]) is None
    sizes = [t.numel() * t.element_size() for t in sources]
    offsets, at = [], 512
    for size in sizes:
        offsets.append(at)
        at += size + 256
    buf = mmap.mmap(-1, at)
    one_by_one = tensors.copy_many_into(buf, offsets, sources)
    assert one_by_one == ([5] if compiled else list(range(len(sources))))
    dtypes = [tensors.dtype_name(t.dtype) for t in sources]
    shapes = [list(t.shape) for t in sources]
    copies = tensors.copy_many_out(buf, offsets, sizes, dtypes, shapes)
    views = tensors.PoolViews([buf])
    for t, copy, off, size, dtype, shape in zip(sources, copies, offsets, sizes, dtypes, shapes):
        assert copy.dtype == t.dtype and copy.shape == t.shape and torch.equal(copy, t)
        view = views.view(0, off, size, dtype, shape)
        assert view.dtype == t.dtype and view.shape == t.shape and torch.equal(view, t)
        assert torch.equal(view, tensors.view_of(buf, off, size, dtype, shape))


def test_pool_views_are_zero_copy_and_take_odd_offsets_the_slow_way():
    buf = mmap.mmap(-1, 8192)
    views = tensors.PoolViews([buf])
    v = views.view(0, 4096, 64, "float32", [4, 4])
    np.frombuffer(buf, np.float32)[1024] = 7.5  # the first element of the view, written through the buffer
    assert v[0, 0].item() == 7.5
    odd = views.view(0, 6, 8, "float32", [2])  # not a multiple of the itemsize: torch.frombuffer instead
    assert odd.shape == (2,)
    assert views.view(0, 0, 4, "float32", []).shape == ()  # a scalar


def test_a_location_whose_size_does_not_match_its_shape_is_refused_not_copied_past_the_tensor():
    """copy_many_out copies by address and PoolViews strides over the whole pool: a location that
    names more bytes than its shape holds must raise, not write past a tensor or read another
    entry's bytes (view_of and numpy refused it by their own checks)."""
    from ecd.errors import ProtocolError
    buf = mmap.mmap(-1, 8192)
    with pytest.raises(ProtocolError):
        tensors.copy_many_out(buf, [0, 64], [16, 4096], ["float32", "float32"], [[4], [8]])
    with pytest.raises(ProtocolError):
        tensors.PoolViews([buf]).view(0, 256, 4096, "float32", [8])


@needs_ext
def test_copy_many_in_streams_a_large_piece_exactly():
    """A piece of at least STREAM_MIN goes with non-temporal stores, the small ones with memcpy."""
    big, small = torch.from_numpy(pattern(_copy.STREAM_MIN + 77, 9)), torch.from_numpy(pattern(100, 10))
    buf = mmap.mmap(-1, GUARD + _copy.STREAM_MIN + 77 + 3 + 100 + GUARD)
    buf[:] = bytes([FILL]) * len(buf)
    at_big, at_small = GUARD + 3, GUARD + 3 + big.numel()
    _copy.copy_many_in(buf, [at_big, at_small], [big.data_ptr(), small.data_ptr()], [big.numel(), 100])
    view = np.frombuffer(buf, np.uint8)
    assert (view[at_big:at_small] == big.numpy()).all() and (view[at_small:at_small + 100] == small.numpy()).all()
    assert (view[:at_big] == FILL).all() and (view[at_small + 100:] == FILL).all()


# ---- which routine large copies use (ecd/client/copy_strategy.py) -------------------------------

@needs_ext
@pytest.mark.parametrize("size", [0, 1, 4097, 4 * MIB + 5])
def test_batched_copies_are_exact_with_every_routine(size):
    """copy_many_in/out/between with each routine forced (large pieces and a small one beside)."""
    for routine in _copy.ROUTINES:
        src = [torch.from_numpy(pattern(n, n + 7)) for n in (size, 33)]
        offsets = [64, 64 + size + 100]
        buf = mmap.mmap(-1, offsets[1] + 33 + 64)
        buf[:] = bytes([FILL]) * len(buf)
        _copy.copy_many_in(buf, offsets, [t.data_ptr() for t in src], [t.numel() for t in src], routine=routine)
        view = np.frombuffer(buf, np.uint8)
        assert all((view[o:o + t.numel()] == t.numpy()).all() for o, t in zip(offsets, src)), routine
        assert view[63] == FILL and view[64 + size] == FILL and view[-64] == FILL
        back = [torch.empty(t.numel(), dtype=torch.uint8) for t in src]
        _copy.copy_many_out(buf, offsets, [t.data_ptr() for t in back], [t.numel() for t in back], routine=routine)
        assert all(torch.equal(a, b) for a, b in zip(src, back)), routine
        again = [torch.zeros(t.numel(), dtype=torch.uint8) for t in src]
        _copy.copy_many_between([t.data_ptr() for t in again], [t.data_ptr() for t in back],
                                [t.numel() for t in back], routine=routine)
        assert all(torch.equal(a, b) for a, b in zip(src, again)), routine
        del view
        buf.close()
    with pytest.raises(ValueError, match="not available"):
        _copy.copy_many_between([], [], [], routine="nt-quantum")


@needs_ext
def test_set_large_routes_copies_by_size_and_refuses_what_it_cannot_use():
    before = _copy.large()
    try:
        _copy.set_large("memcpy", 0)
        assert _copy.large() == ("memcpy", 0)
        streaming = [r for r in _copy.ROUTINES if r != "memcpy"]
        if streaming:
            _copy.set_large(streaming[0], 8 * MIB)
            assert _copy.large() == (streaming[0], 8 * MIB)
            check_copy(_copy.copy, 8 * MIB + 3, 5, 1)  # the streaming routine, through the default path
            check_copy(_copy.copy, 8 * MIB - 1, 5, 1)  # memcpy, just below the threshold
        with pytest.raises(ValueError, match="not available"):
            _copy.set_large("no-such-routine", 0)
        with pytest.raises(ValueError, match=">= 0"):
            _copy.set_large("memcpy", -1)
        assert _copy.large()[0] in _copy.ROUTINES
    finally:
        _copy.set_large(*before)


@needs_ext
def test_calibration_picks_streaming_only_where_it_beat_memcpy():
    from ecd.client import copy_strategy
    s = copy_strategy.calibrate(sizes=(4 * MIB, 8 * MIB), rounds=3)
    assert s.routine in _copy.ROUTINES and s.ratios, s
    measured = [size for size in s.ratios]
    assert measured == sorted(measured) and set(measured) <= {4 * MIB, 8 * MIB}
    if s.routine == "memcpy":
        assert all(min(by.values()) >= copy_strategy.WIN for by in s.ratios.values()), s.describe()
    else:  # the threshold is the first size at which the chosen routine won, and nothing before it did
        assert s.from_bytes == measured[-1] and s.ratios[s.from_bytes][s.routine] < copy_strategy.WIN, s.describe()
        assert all(min(s.ratios[size].values()) >= copy_strategy.WIN for size in measured[:-1]), s.describe()
    assert s.describe().startswith("memcpy" if s.routine == "memcpy" else s.routine)


def _strategy_in_a_fresh_process(env_value: str | None, script: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "ECD_COPY_ROUTINE"}
    if env_value is not None:
        env["ECD_COPY_ROUTINE"] = env_value
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)


@needs_ext
def test_the_first_large_copy_calibrates_once_and_the_variable_forces_a_routine():
    script = ("import numpy as np, torch\n"
              "from ecd import _copy\n"
              "from ecd.client import copy_strategy, tensors\n"
              "assert copy_strategy.current() is None or copy_strategy.current().decided_by.startswith('forced')\n"
              "buf = bytearray(5 << 20)\n"
              "tensors.copy_into(buf, 0, torch.ones(1024))  # small: decides nothing\n"
              "print(copy_strategy.pending)\n"
              "tensors.copy_into(buf, 0, torch.ones(5 << 18))  # 5 MiB\n"
              "s = copy_strategy.current()\n"
              "assert bytes(buf[:4]) == bytes(np.float32(1).tobytes())\n"
              "print(copy_strategy.pending, s.routine, s.decided_by.split(':')[0], _copy.large()[0], sep='|')\n")
    auto = _strategy_in_a_fresh_process(None, script)
    assert auto.returncode == 0, auto.stderr[-2000:]
    first, second = auto.stdout.split("\n")[:2]
    pending, routine, how, large = second.split("|")
    assert first == "True" and pending == "False" and how == "calibrated" and routine == large, auto.stdout
    for value, expect in [("memcpy", "memcpy"), ("stream", None)]:
        out = _strategy_in_a_fresh_process(value, script)
        assert out.returncode == 0, out.stderr[-2000:]
        first, second = out.stdout.split("\n")[:2]
        pending, routine, how, large = second.split("|")
        assert first == "False" and how == f"forced by ECD_COPY_ROUTINE={value}" and routine == large
        assert routine == expect if expect else routine.startswith("nt-") and "prefetch" not in routine
    bad = _strategy_in_a_fresh_process("fastest-please", "from ecd import Client")
    assert bad.returncode != 0 and "ECD_COPY_ROUTINE='fastest-please': expected auto, memcpy" in bad.stderr
