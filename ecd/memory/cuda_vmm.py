"""CUDA virtual memory management (VMM) calls: device memory exported as a POSIX file descriptor.

A legacy CUDA IPC handle (cuIpcGetMemHandle) names an allocation by the exporting process, so
the importer must be able to see that process (shared pid and IPC namespaces: one pod). A VMM
allocation (cuMemCreate with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) is exported as a file
descriptor instead, which travels like the host pool's memfds, over the daemon's fd socket
(SCM_RIGHTS), into any process that can reach that socket and the GPU: another pod, another pid
namespace. The importer maps it into its own address space (reserve, map, set access).

The exact C layouts of CUmemAllocationProp and CUmemAccessDesc (cuda.h, CUDA 11.0+) are below;
tests/unit/fake_libcuda.c checks them field by field.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cuda import Driver

CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103

CUmemGenericAllocationHandle = ctypes.c_ulonglong


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class CUmemAllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class CUmemAllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", CUmemLocation),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", CUmemAllocFlags)]


class CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", CUmemLocation), ("flags", ctypes.c_int)]


@dataclass
class VmmMapping:
    """Device memory mapped into this process: `ptr` is usable by torch on the device."""

    ordinal: int
    ptr: int
    size: int
    handle: int  # the CUmemGenericAllocationHandle (released when unmapped)


def device_prop(ordinal: int) -> CUmemAllocationProp:
    prop = CUmemAllocationProp()
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    return prop


class VmmCalls:
    """The VMM entry points on a Driver's library, run in the device's primary context.
    `available` is False where the driver predates them (CUDA < 10.2)."""

    def __init__(self, driver: "Driver", lib: ctypes.CDLL) -> None:
        from .cuda import CUdevice, CUdeviceptr, _proto  # cuda.py makes this object
        p = ctypes.POINTER
        self._driver = driver
        size_t, u64 = ctypes.c_size_t, ctypes.c_ulonglong
        self._fns = {
            "cuDeviceGetAttribute": _proto(lib, "cuDeviceGetAttribute", p(ctypes.c_int), ctypes.c_int, CUdevice,
                                           optional=True),
            "cuMemGetAllocationGranularity": _proto(lib, "cuMemGetAllocationGranularity", p(size_t),
                                                    p(CUmemAllocationProp), ctypes.c_int, optional=True),
            "cuMemCreate": _proto(lib, "cuMemCreate", p(CUmemGenericAllocationHandle), size_t,
                                  p(CUmemAllocationProp), u64, optional=True),
            "cuMemRelease": _proto(lib, "cuMemRelease", CUmemGenericAllocationHandle, optional=True),
            "cuMemExportToShareableHandle": _proto(lib, "cuMemExportToShareableHandle", ctypes.c_void_p,
                                                   CUmemGenericAllocationHandle, ctypes.c_int, u64, optional=True),
            # A POSIX fd travels as the pointer-sized value of the descriptor itself.
            "cuMemImportFromShareableHandle": _proto(lib, "cuMemImportFromShareableHandle",
                                                     p(CUmemGenericAllocationHandle), ctypes.c_void_p, ctypes.c_int,
                                                     optional=True),
            "cuMemAddressReserve": _proto(lib, "cuMemAddressReserve", p(CUdeviceptr), size_t, size_t, CUdeviceptr,
                                          u64, optional=True),
            "cuMemAddressFree": _proto(lib, "cuMemAddressFree", CUdeviceptr, size_t, optional=True),
            "cuMemMap": _proto(lib, "cuMemMap", CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, u64,
                               optional=True),
            "cuMemUnmap": _proto(lib, "cuMemUnmap", CUdeviceptr, size_t, optional=True),
            "cuMemSetAccess": _proto(lib, "cuMemSetAccess", CUdeviceptr, size_t, p(CUmemAccessDesc), size_t,
                                     optional=True),
        }
        self.available = all(fn is not None for fn in self._fns.values())

    def _call(self, ordinal: int, name: str, *args) -> None:
        if not self.available:
            from .cuda import CudaError
            raise CudaError(f"{name}: the NVIDIA driver has no CUDA virtual memory management calls (too old)")
        self._driver._in_context(ordinal, name, self._fns[name], *args)

    def fd_export_supported(self, ordinal: int) -> bool:
        """Whether the device can make VMM allocations exportable as POSIX file descriptors."""
        if not self.available:
            return False
        device = self._driver._device(ordinal)
        get = self._fns["cuDeviceGetAttribute"]
        for attribute in (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                          CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED):
            value = ctypes.c_int()
            with self._driver._lock:
                if get(ctypes.byref(value), attribute, device) != 0 or not value.value:
                    return False
        return True

    def granularity(self, ordinal: int) -> int:
        out, prop = ctypes.c_size_t(), device_prop(ordinal)
        self._call(ordinal, "cuMemGetAllocationGranularity", ctypes.byref(out), ctypes.byref(prop),
                   CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        return out.value

    def create_exported(self, ordinal: int, size: int) -> tuple[VmmMapping, int]:
        """Allocate `size` bytes (a multiple of granularity()) on the device, map them here and
        export them: (the mapping, a file descriptor this process owns). On failure nothing is
        left allocated."""
        handle, prop = CUmemGenericAllocationHandle(), device_prop(ordinal)
        self._call(ordinal, "cuMemCreate", ctypes.byref(handle), size, ctypes.byref(prop), 0)
        fd = ctypes.c_int(-1)
        try:
            self._call(ordinal, "cuMemExportToShareableHandle", ctypes.byref(fd), handle,
                       CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
            mapping = self._map(ordinal, handle.value, size)
        except BaseException:
            if fd.value >= 0:
                os.close(fd.value)
            self._call_quietly(ordinal, "cuMemRelease", handle)
            raise
        return mapping, fd.value

    def import_fd(self, ordinal: int, fd: int, size: int, peers: tuple[int, ...] = ()) -> VmmMapping:
        """Map another process's exported allocation (`fd`, `size` bytes, on device `ordinal`)
        into this one, accessible from that device and from `peers` (other devices of this
        process with peer access to it: a copy between devices reads through their mapping). The
        descriptor stays the caller's: the driver holds its own reference once imported."""
        handle = CUmemGenericAllocationHandle()
        self._call(ordinal, "cuMemImportFromShareableHandle", ctypes.byref(handle), ctypes.c_void_p(fd),
                   CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        try:
            return self._map(ordinal, handle.value, size, peers)
        except BaseException:
            self._call_quietly(ordinal, "cuMemRelease", handle)
            raise

    def _map(self, ordinal: int, handle: int, size: int, peers: tuple[int, ...] = ()) -> VmmMapping:
        """Reserve an address range, map the allocation there and make it read-write for the device
        (and `peers`)."""
        from .cuda import CUdeviceptr
        ptr = CUdeviceptr()
        self._call(ordinal, "cuMemAddressReserve", ctypes.byref(ptr), size, 0, CUdeviceptr(0), 0)
        mapped = False
        try:
            self._call(ordinal, "cuMemMap", ptr, size, 0, CUmemGenericAllocationHandle(handle), 0)
            mapped = True
            devices = [ordinal] + [peer for peer in peers if peer != ordinal]
            access = (CUmemAccessDesc * len(devices))()
            for desc, device in zip(access, devices):
                desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE
                desc.location.id = device
                desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            self._call(ordinal, "cuMemSetAccess", ptr, size, access, len(devices))
        except BaseException:
            if mapped:
                self._call_quietly(ordinal, "cuMemUnmap", ptr, size)
            self._call_quietly(ordinal, "cuMemAddressFree", ptr, size)
            raise
        return VmmMapping(ordinal, ptr.value, size, handle)

    def unmap(self, mapping: VmmMapping) -> None:
        """Unmap, release the handle and free the address range (the memory goes when every
        process that mapped it, and every exported descriptor, has let go)."""
        from .cuda import CUdeviceptr
        ptr = CUdeviceptr(mapping.ptr)
        self._call(mapping.ordinal, "cuMemUnmap", ptr, mapping.size)
        self._call(mapping.ordinal, "cuMemRelease", CUmemGenericAllocationHandle(mapping.handle))
        self._call(mapping.ordinal, "cuMemAddressFree", ptr, mapping.size)

    def _call_quietly(self, ordinal: int, name: str, *args) -> None:
        try:
            self._call(ordinal, name, *args)
        except Exception:
            pass  # already failing: the first error is the one to report
