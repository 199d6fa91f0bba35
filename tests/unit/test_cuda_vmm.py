"""ecd/memory/cuda_vmm.py without a GPU: the ctypes marshalling of the CUDA virtual memory calls
against tests/unit/fake_libcuda.c, where a cuMemCreate'd allocation is a memfd exported as a real
descriptor and every struct field ecd fills (CUmemAllocationProp, CUmemAccessDesc) is checked.
What a real driver does with them is tested in tests/gpu/test_vmm_export.py."""
from __future__ import annotations

import ctypes
import mmap
import os
import stat

import pytest

from ecd.memory.cuda import CudaArenas, CudaError, choose_export
from ecd.memory.cuda_vmm import CUmemAccessDesc, CUmemAllocationProp

from test_cuda_driver import driver, fake  # noqa: F401  (fixtures: the fake libcuda and a Driver on it)


def fd_text(fd: int) -> bytes:
    with mmap.mmap(fd, 4096, prot=mmap.PROT_READ) as m:
        return m[:32].rstrip(b"\0")


def test_struct_layouts_match_cuda_h():
    # cuda.h: {int type; int requestedHandleTypes; CUmemLocation location; void *win32HandleMetaData;
    # struct {uchar, uchar, ushort, uchar[4]} allocFlags} and {CUmemLocation location; int flags}
    assert CUmemAllocationProp.win32HandleMetaData.offset == 16
    assert CUmemAllocationProp.allocFlags.offset == 24
    assert ctypes.sizeof(CUmemAllocationProp) == 32
    assert ctypes.sizeof(CUmemAccessDesc) == 12


def test_export_then_import_in_the_primary_context(driver, fake):  # noqa: F811
    assert driver.fd_export_supported(0) and driver.fd_export_supported(1)
    mapping, fd = driver.vmm_alloc_exported(1, 3 << 20)
    try:
        assert mapping.size == 4 << 20  # rounded up to the device's granularity (2 MiB in the fake)
        assert mapping.ptr >= 0x7E0000000000  # a full 64-bit CUdeviceptr
        assert stat.S_ISREG(os.fstat(fd).st_mode) and fd_text(fd) == b"fake vmm device 1"
        assert fake.fake_depth() == 0  # every call pushed and popped the primary context
        assert (fake.fake_live_handles(), fake.fake_reserved_ranges(), fake.fake_mapped_ranges()) == (1, 1, 1)
        assert fake.fake_last_access_count() == 1 and fake.fake_last_access(0) == 1  # its own device
        imported = driver.vmm.import_fd(1, fd, mapping.size, peers=(0, 1))
        assert fake.fake_last_import_fd() == fd  # the descriptor's value, passed as the handle
        # read-write from the arena's device first, then each peer once (copies between devices)
        assert fake.fake_last_access_count() == 2
        assert (fake.fake_last_access(0), fake.fake_last_access(1)) == (1, 0)
        assert imported.ptr != mapping.ptr and imported.size == mapping.size
        assert (fake.fake_live_handles(), fake.fake_mapped_ranges()) == (2, 2)
        driver.vmm.unmap(imported)
        driver.vmm_free(mapping)
        assert (fake.fake_live_handles(), fake.fake_reserved_ranges(), fake.fake_mapped_ranges()) == (0, 0, 0)
        assert fd_text(fd) == b"fake vmm device 1"  # the exported descriptor outlives the mappings
    finally:
        os.close(fd)


def test_a_failed_map_leaves_nothing_behind(driver, fake):  # noqa: F811
    fake.fake_fail_next(2)  # cuMemCreate: out of memory
    with pytest.raises(CudaError, match=r"^cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY \(2\)"):
        driver.vmm_alloc_exported(0, 2 << 20)
    before = os.listdir("/proc/self/fd")
    fake.fake_fail_next(0)
    mapping, fd = driver.vmm_alloc_exported(0, 2 << 20)
    driver.vmm_free(mapping)
    os.close(fd)
    assert (fake.fake_live_handles(), fake.fake_reserved_ranges(), fake.fake_mapped_ranges()) == (0, 0, 0)
    assert os.listdir("/proc/self/fd") == before
    with pytest.raises(CudaError, match="cuMemImportFromShareableHandle"):
        driver.vmm.import_fd(0, 987654, 2 << 20)  # not a descriptor
    assert fake.fake_depth() == 0 and fake.fake_live_handles() == 0


def test_arenas_exported_as_descriptors_and_freed(driver, fake):  # noqa: F811
    assert choose_export(driver, [0, 1], "auto", fd_socket=True) == "fd"
    assert choose_export(driver, [0, 1], "auto", fd_socket=False) == "ipc"
    assert choose_export(driver, [0, 1], "ipc", fd_socket=True) == "ipc"
    with pytest.raises(CudaError, match=r'^pool.cuda.export = "fd": it needs the fd socket'):
        choose_export(driver, [0], "fd", fd_socket=False)
    arenas = CudaArenas(driver, [1, 0], 2 << 20, "fd")
    fds = [a.fd for a in arenas]
    assert [a.export for a in arenas] == ["fd", "fd"] and [a.handle for a in arenas] == [b"", b""]
    assert [fd_text(fd) for fd in fds] == [b"fake vmm device 1", b"fake vmm device 0"]
    arenas.close()
    assert fake.fake_live_handles() == 0
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)  # the daemon's descriptors are closed with the arenas


def test_devices_without_fd_export(driver, fake):  # noqa: F811
    fake.fake_vmm_unsupported(1)
    try:
        assert not driver.fd_export_supported(0)
        assert choose_export(driver, [0, 1], "auto", fd_socket=True) == "ipc"
        with pytest.raises(CudaError, match=r"device\(s\) \[0, 1\] cannot export memory as a POSIX file descriptor"):
            choose_export(driver, [0, 1], "fd", fd_socket=True)
    finally:
        fake.fake_vmm_unsupported(0)
