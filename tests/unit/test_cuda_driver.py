"""ecd.memory.cuda without a GPU: format_uuid, load_driver's CudaUnavailable, and the ctypes
marshalling of every entry point against a C stand-in for libcuda.so.1 (fake_libcuda.c) built
with the system C compiler. What a real driver does with the calls is tested in tests/gpu."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from ecd.errors import EcdError
from ecd.memory import cuda
from ecd.memory.cuda import CudaError, CudaUnavailable, Driver, format_uuid

HERE = Path(__file__).resolve().parent


def test_format_uuid_matches_nvidia_smi():
    raw = bytes.fromhex("8d0b3c5e1f2a4b6c9d7e0f1a2b3c4d5e")
    assert format_uuid(raw) == "GPU-8d0b3c5e-1f2a-4b6c-9d7e-0f1a2b3c4d5e"
    assert format_uuid(bytes(16)) == "GPU-00000000-0000-0000-0000-000000000000"
    with pytest.raises(ValueError):
        format_uuid(b"short")


def test_errors_are_ecd_errors():
    assert issubclass(CudaUnavailable, EcdError) and issubclass(CudaError, EcdError)


def test_load_driver_without_libcuda(monkeypatch):
    try:
        ctypes.CDLL(cuda.LIBCUDA)
    except OSError:
        pass
    else:
        pytest.skip("this machine has libcuda.so.1")
    monkeypatch.setattr(cuda, "_driver", None)
    with pytest.raises(CudaUnavailable, match=r"^libcuda\.so\.1 not found$"):
        cuda.load_driver()


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the fake libcuda")
    out = tmp_path_factory.mktemp("fakecuda") / "libcuda.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(out), str(HERE / "fake_libcuda.c")], check=True)
    lib = ctypes.CDLL(str(out))
    lib.fake_last_host_ptr.restype = ctypes.c_void_p
    lib.fake_last_host_size.restype = ctypes.c_size_t
    lib.fake_last_alloc_size.restype = ctypes.c_ulonglong
    lib.fake_last_flags.restype = ctypes.c_uint
    return lib


@pytest.fixture
def driver(fake):
    fake.fake_set_current(-1)
    d = Driver(fake)
    d.init()
    yield d
    d.close()


def test_devices_and_uuids(driver, fake):
    assert driver.device_count() == 2
    assert driver.device_uuid(0) == "GPU-a0a1a2a3-a4a5-a6a7-a8a9-aaabacadaeaf"
    assert driver.device_uuid(1) == "GPU-b0b1b2b3-b4b5-b6b7-b8b9-babbbcbdbebf"
    assert driver.ordinal_of("GPU-B0B1B2B3-B4B5-B6B7-B8B9-BABBBCBDBEBF") == 1
    assert driver.ordinal_of("GPU-00000000-0000-0000-0000-000000000000") is None
    with pytest.raises(CudaError, match="no CUDA device 5"):
        driver.device_uuid(5)


def test_alloc_runs_in_the_devices_primary_context_and_restores_the_callers(driver, fake):
    fake.fake_set_current(-1)
    ptr = driver.mem_alloc(1, 3 << 30)
    assert ptr >= 0x7F0000000000  # a full 64-bit CUdeviceptr, not truncated to 32 bits
    assert fake.fake_alloc_device() == 1
    assert fake.fake_last_alloc_size() == 3 << 30  # size_t, not int
    assert fake.fake_depth() == 0  # pushed and popped
    assert fake.fake_retained(1) == 1
    driver.mem_alloc(1, 4096)
    assert fake.fake_retained(1) == 1  # retained once per device
    fake.fake_set_current(0)  # the caller (torch) has device 0's context current
    driver.mem_free(1, ptr)
    assert fake.fake_depth() == 1  # its context is current again
    fake.fake_set_current(-1)


def test_ipc_handle_round_trip_by_value(driver, fake):
    ptr = driver.mem_alloc(0, 1 << 20)
    handle = driver.ipc_get_handle(0, ptr)
    assert isinstance(handle, bytes) and len(handle) == 64
    assert int.from_bytes(handle[:8], "little") == ptr
    opened = driver.ipc_open_handle(0, handle)  # the fake checks all 64 bytes arrived by value
    assert opened == ptr + 0x100000000000
    assert fake.fake_last_flags() == cuda.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
    driver.ipc_close_handle(0, opened)
    with pytest.raises(CudaError, match="64 bytes"):
        driver.ipc_open_handle(0, handle[:32])
    corrupted = handle[:20] + b"\0" + handle[21:]
    with pytest.raises(CudaError, match=r"^cuIpcOpenMemHandle_v2: CUDA_ERROR_INVALID_VALUE \(1\): invalid argument$"):
        driver.ipc_open_handle(0, corrupted)
    assert fake.fake_depth() == 0  # popped even when the call failed


def test_error_message_names_call_error_and_description(driver, fake):
    fake.fake_fail_next(2)
    with pytest.raises(CudaError) as info:
        driver.mem_alloc(0, 1 << 40)
    assert str(info.value) == "cuMemAlloc_v2: CUDA_ERROR_OUT_OF_MEMORY (2): out of memory"
    assert info.value.result == 2


def test_init_failure_is_unavailable(fake):
    d = Driver(fake)
    fake.fake_fail_next(100)
    with pytest.raises(CudaUnavailable, match=r"cuInit failed: CUDA_ERROR_NO_DEVICE \(100\)"):
        d.init()


def test_host_register_portable_and_context_handling(driver, fake):
    buf = ctypes.create_string_buffer(1 << 16)
    addr = ctypes.addressof(buf)
    fake.fake_set_current(-1)  # no current context: one is pushed for the call and popped
    driver.host_register(addr, len(buf))
    assert fake.fake_last_host_ptr() == addr and fake.fake_last_host_size() == len(buf)
    assert fake.fake_last_flags() == cuda.CU_MEMHOSTREGISTER_PORTABLE
    assert fake.fake_depth() == 0
    fake.fake_set_current(1)  # the caller's context is used as it is
    driver.host_unregister(addr)
    assert fake.fake_depth() == 1
    fake.fake_set_current(-1)
    with pytest.raises(CudaError, match="cuMemHostUnregister"):
        driver.host_unregister(addr + 4096)


def test_close_releases_primary_contexts(fake):
    d = Driver(fake)
    d.init()
    before = fake.fake_retained(0)
    d.mem_alloc(0, 4096)
    assert fake.fake_retained(0) == before + 1
    d.close()
    assert fake.fake_retained(0) == before
