"""A small ctypes binding to the CUDA *driver* API (libcuda.so.1), and the daemon's GPU arenas.

libcuda.so.1 ships with the NVIDIA driver on every GPU node, whatever toolkit (if any) is
installed, so this adds no dependency and never imports torch. Every call runs with the
device's *primary* context pushed (retained once per device, pushed and popped around the
call): torch uses that same context, so pointers made here are usable by torch on that device,
and the calling thread's own current context is left as it was. One lock serialises the calls.

Imported only when `[pool.cuda]` is configured (daemon) or a client meets a CUDA tensor.
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Protocol, cast

from ..errors import EcdError
from .cuda_vmm import VmmCalls, VmmMapping

if TYPE_CHECKING:  # pragma: no cover
    from ..config import CudaPoolSection

LIBCUDA = "libcuda.so.1"

CUDA_SUCCESS = 0
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1
CU_MEMHOSTREGISTER_PORTABLE = 0x1
CU_POINTER_ATTRIBUTE_SYNC_MEMOPS = 6
CU_IPC_HANDLE_SIZE = 64

CUresult = ctypes.c_int
CUdevice = ctypes.c_int
CUcontext = ctypes.c_void_p
CUdeviceptr = ctypes.c_uint64  # unsigned 64-bit on every 64-bit platform (cuda.h: unsigned long long)


class CUuuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_char * 16)]


class CUipcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * CU_IPC_HANDLE_SIZE)]


class CudaUnavailable(EcdError):
    """CUDA cannot be used on this node: no libcuda.so.1, cuInit failed, or no devices."""


class CudaError(EcdError):
    """A CUDA driver call failed; the message names the call, the error and its description."""

    def __init__(self, message: str = "", *, result: int = 0) -> None:
        super().__init__(message)
        self.result = result


def format_uuid(raw: bytes) -> str:
    """16 raw bytes -> "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as `nvidia-smi -L` prints it."""
    if len(raw) != 16:
        raise ValueError(f"a CUDA device UUID is 16 bytes, got {len(raw)}")
    h = bytes(raw).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _proto(lib: ctypes.CDLL, name: str, *argtypes, optional: bool = False):
    try:
        fn = getattr(lib, name)
    except AttributeError:
        if optional:
            return None
        raise CudaUnavailable(f"{LIBCUDA} has no {name}: the NVIDIA driver is too old") from None
    fn.restype = CUresult
    fn.argtypes = list(argtypes)
    return fn


class Driver:
    """The driver entry points ecd uses, bound with exact ctypes signatures."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p = ctypes.POINTER
        self._lib = lib
        self._lock = threading.RLock()
        self._cuGetErrorName = _proto(lib, "cuGetErrorName", CUresult, p(ctypes.c_char_p))
        self._cuGetErrorString = _proto(lib, "cuGetErrorString", CUresult, p(ctypes.c_char_p))
        self._cuInit = _proto(lib, "cuInit", ctypes.c_uint)
        self._cuDeviceGetCount = _proto(lib, "cuDeviceGetCount", p(ctypes.c_int))
        self._cuDeviceGet = _proto(lib, "cuDeviceGet", p(CUdevice), ctypes.c_int)
        # _v2 (CUDA 11.4+) gives a MIG instance's own UUID, as cudaDeviceProp.uuid (torch) does.
        self._cuDeviceGetUuid = (_proto(lib, "cuDeviceGetUuid_v2", p(CUuuid), CUdevice, optional=True)
                                 or _proto(lib, "cuDeviceGetUuid", p(CUuuid), CUdevice))
        self._cuDevicePrimaryCtxRetain = _proto(lib, "cuDevicePrimaryCtxRetain", p(CUcontext), CUdevice)
        self._cuDevicePrimaryCtxRelease = (
            _proto(lib, "cuDevicePrimaryCtxRelease_v2", CUdevice, optional=True)
            or _proto(lib, "cuDevicePrimaryCtxRelease", CUdevice))
        self._cuCtxPushCurrent = _proto(lib, "cuCtxPushCurrent_v2", CUcontext)
        self._cuCtxPopCurrent = _proto(lib, "cuCtxPopCurrent_v2", p(CUcontext))
        self._cuCtxGetCurrent = _proto(lib, "cuCtxGetCurrent", p(CUcontext))
        self._cuMemAlloc = _proto(lib, "cuMemAlloc_v2", p(CUdeviceptr), ctypes.c_size_t)
        self._cuMemFree = _proto(lib, "cuMemFree_v2", CUdeviceptr)
        self._cuPointerSetAttribute = _proto(lib, "cuPointerSetAttribute", ctypes.c_void_p, ctypes.c_int,
                                             CUdeviceptr, optional=True)
        self._cuIpcGetMemHandle = _proto(lib, "cuIpcGetMemHandle", p(CUipcMemHandle), CUdeviceptr)
        # The handle is passed BY VALUE (a 64-byte struct); _v2 since CUDA 11.0, same signature.
        self._cuIpcOpenMemHandle = (
            _proto(lib, "cuIpcOpenMemHandle_v2", p(CUdeviceptr), CUipcMemHandle, ctypes.c_uint, optional=True)
            or _proto(lib, "cuIpcOpenMemHandle", p(CUdeviceptr), CUipcMemHandle, ctypes.c_uint))
        self._cuIpcCloseMemHandle = _proto(lib, "cuIpcCloseMemHandle", CUdeviceptr)
        self._cuMemHostRegister = _proto(lib, "cuMemHostRegister_v2", ctypes.c_void_p, ctypes.c_size_t,
                                         ctypes.c_uint)
        self._cuMemHostUnregister = _proto(lib, "cuMemHostUnregister", ctypes.c_void_p)
        self._contexts: dict[int, int] = {}  # ordinal -> retained primary context
        self._uuids: dict[int, str] = {}
        self.vmm = VmmCalls(self, lib)  # device memory exported as file descriptors

    # ---- plumbing -----------------------------------------------------------------------

    def _describe(self, result: int) -> str:
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        if self._cuGetErrorName(result, ctypes.byref(name)) != CUDA_SUCCESS or not name.value:
            return f"CUDA error {result}"
        described = f"{name.value.decode()} ({result})"
        if self._cuGetErrorString(result, ctypes.byref(text)) == CUDA_SUCCESS and text.value:
            described += f": {text.value.decode()}"
        return described

    def _check(self, call: str, result: int) -> None:
        if result != CUDA_SUCCESS:
            raise CudaError(f"{call}: {self._describe(result)}", result=result)

    def init(self) -> None:
        """cuInit and at least one device, or CudaUnavailable saying why."""
        result = self._cuInit(0)
        if result != CUDA_SUCCESS:
            raise CudaUnavailable(f"cuInit failed: {self._describe(result)}")
        if self.device_count() == 0:
            raise CudaUnavailable("the driver sees no CUDA devices (check CUDA_VISIBLE_DEVICES)")

    def _device(self, ordinal: int) -> int:
        count = self.device_count()
        if not 0 <= ordinal < count:
            raise CudaError(f"no CUDA device {ordinal}: {count} visible")
        device = CUdevice()
        self._check("cuDeviceGet", self._cuDeviceGet(ctypes.byref(device), ordinal))
        return device.value

    def _context(self, ordinal: int) -> int:
        ctx = self._contexts.get(ordinal)
        if ctx is None:
            handle = CUcontext()
            self._check("cuDevicePrimaryCtxRetain",
                        self._cuDevicePrimaryCtxRetain(ctypes.byref(handle), self._device(ordinal)))
            ctx = self._contexts[ordinal] = cast(int, handle.value)  # not NULL: _check raised otherwise
        return ctx

    def _in_context(self, ordinal: int, call: str, fn, *args) -> None:
        """Run `fn(*args)` with the device's primary context current, then restore the caller's."""
        with self._lock:
            self._check("cuCtxPushCurrent_v2", self._cuCtxPushCurrent(self._context(ordinal)))
            try:
                result = fn(*args)
            finally:
                popped = CUcontext()
                self._check("cuCtxPopCurrent_v2", self._cuCtxPopCurrent(ctypes.byref(popped)))
            self._check(call, result)

    # ---- devices ------------------------------------------------------------------------

    def device_count(self) -> int:
        count = ctypes.c_int()
        with self._lock:
            self._check("cuDeviceGetCount", self._cuDeviceGetCount(ctypes.byref(count)))
        return count.value

    def device_uuid(self, ordinal: int) -> str:
        with self._lock:
            uuid = self._uuids.get(ordinal)
            if uuid is None:
                raw = CUuuid()
                self._check("cuDeviceGetUuid", self._cuDeviceGetUuid(ctypes.byref(raw), self._device(ordinal)))
                uuid = self._uuids[ordinal] = format_uuid(ctypes.string_at(ctypes.addressof(raw), 16))
            return uuid

    def ordinal_of(self, uuid: str) -> int | None:
        wanted = uuid.strip().lower()
        for ordinal in range(self.device_count()):
            if self.device_uuid(ordinal).lower() == wanted:
                return ordinal
        return None

    # ---- device memory and IPC ----------------------------------------------------------

    def mem_alloc(self, ordinal: int, size: int) -> int:
        ptr = CUdeviceptr()
        self._in_context(ordinal, "cuMemAlloc_v2", self._cuMemAlloc, ctypes.byref(ptr), size)
        if self._cuPointerSetAttribute is not None:
            # Memory shared across processes: make synchronous copies into it strictly synchronous
            # (what the CUDA IPC guide recommends for exported allocations). Best effort.
            one = ctypes.c_uint(1)
            with self._lock:
                self._cuCtxPushCurrent(self._context(ordinal))
                self._cuPointerSetAttribute(ctypes.byref(one), CU_POINTER_ATTRIBUTE_SYNC_MEMOPS, ptr)
                self._cuCtxPopCurrent(ctypes.byref(CUcontext()))
        return ptr.value

    def mem_free(self, ordinal: int, ptr: int) -> None:
        self._in_context(ordinal, "cuMemFree_v2", self._cuMemFree, CUdeviceptr(ptr))

    def ipc_get_handle(self, ordinal: int, ptr: int) -> bytes:
        handle = CUipcMemHandle()
        self._in_context(ordinal, "cuIpcGetMemHandle", self._cuIpcGetMemHandle, ctypes.byref(handle),
                         CUdeviceptr(ptr))
        return ctypes.string_at(ctypes.addressof(handle), CU_IPC_HANDLE_SIZE)

    def ipc_open_handle(self, ordinal: int, handle: bytes) -> int:
        if len(handle) != CU_IPC_HANDLE_SIZE:
            raise CudaError(f"cuIpcOpenMemHandle_v2: a handle is {CU_IPC_HANDLE_SIZE} bytes, got {len(handle)}")
        value = CUipcMemHandle()
        ctypes.memmove(ctypes.addressof(value), bytes(handle), CU_IPC_HANDLE_SIZE)
        ptr = CUdeviceptr()
        self._in_context(ordinal, "cuIpcOpenMemHandle_v2", self._cuIpcOpenMemHandle, ctypes.byref(ptr),
                         value, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        return ptr.value

    def ipc_close_handle(self, ordinal: int, ptr: int) -> None:
        self._in_context(ordinal, "cuIpcCloseMemHandle", self._cuIpcCloseMemHandle, CUdeviceptr(ptr))

    # ---- device memory exported as a file descriptor (cuda_vmm.py) ------------------------

    def fd_export_supported(self, ordinal: int) -> bool:
        return self.vmm.fd_export_supported(ordinal)

    def vmm_alloc_exported(self, ordinal: int, size: int) -> tuple[VmmMapping, int]:
        """`size` bytes (rounded up to the device's granularity) mapped here and exported: (the
        mapping, its file descriptor)."""
        grain = self.vmm.granularity(ordinal)
        return self.vmm.create_exported(ordinal, -(-size // grain) * grain)

    def vmm_free(self, mapping: VmmMapping) -> None:
        self.vmm.unmap(mapping)

    # ---- pinned host memory -------------------------------------------------------------

    def host_register(self, ptr: int, size: int) -> None:
        """Page-lock an existing host mapping for DMA (portable: every context sees it pinned)."""
        with self._lock:
            self._check("cuMemHostRegister_v2", self._host_call(
                self._cuMemHostRegister, ctypes.c_void_p(ptr), size, CU_MEMHOSTREGISTER_PORTABLE))

    def host_unregister(self, ptr: int) -> None:
        with self._lock:
            self._check("cuMemHostUnregister", self._host_call(self._cuMemHostUnregister, ctypes.c_void_p(ptr)))

    def _host_call(self, fn, *args) -> int:
        """Host registration needs *a* current context; PORTABLE makes it valid in all of them.
        The caller's current context if it has one (torch's, usually), else a primary context
        this driver already holds, else device 0's: never create a context on an unused GPU."""
        current = CUcontext()
        self._check("cuCtxGetCurrent", self._cuCtxGetCurrent(ctypes.byref(current)))
        if current.value:
            return fn(*args)
        ctx = next(iter(self._contexts.values())) if self._contexts else self._context(0)
        self._check("cuCtxPushCurrent_v2", self._cuCtxPushCurrent(ctx))
        try:
            return fn(*args)
        finally:
            self._check("cuCtxPopCurrent_v2", self._cuCtxPopCurrent(ctypes.byref(CUcontext())))

    def close(self) -> None:
        """Release the primary contexts this driver retained (after freeing what lives in them)."""
        with self._lock:
            for ordinal, _ in list(self._contexts.items()):
                self._cuDevicePrimaryCtxRelease(self._device(ordinal))
            self._contexts.clear()


_driver: Driver | None = None
_driver_lock = threading.Lock()


def load_driver() -> Driver:
    """The process's Driver (cached after the first success), or CudaUnavailable saying why."""
    global _driver
    with _driver_lock:
        if _driver is None:
            try:
                lib = ctypes.CDLL(LIBCUDA)
            except OSError as exc:
                why = "not found" if "No such file" in str(exc) else f"cannot be loaded ({exc})"
                raise CudaUnavailable(f"{LIBCUDA} {why}") from None
            driver = Driver(lib)
            driver.init()
            _driver = driver
        return _driver


# ---- the daemon's arenas (the handle registry) ----------------------------------------------

class DriverApi(Protocol):
    """What the arenas need of a Driver (tests pass a fake)."""

    def device_count(self) -> int: ...
    def device_uuid(self, ordinal: int) -> str: ...
    def ordinal_of(self, uuid: str) -> int | None: ...
    def mem_alloc(self, ordinal: int, size: int) -> int: ...
    def mem_free(self, ordinal: int, ptr: int) -> None: ...
    def ipc_get_handle(self, ordinal: int, ptr: int) -> bytes: ...
    def fd_export_supported(self, ordinal: int) -> bool: ...
    def vmm_alloc_exported(self, ordinal: int, size: int) -> tuple[VmmMapping, int]: ...
    def vmm_free(self, mapping: VmmMapping) -> None: ...


class DeviceNotFound(EcdError):
    """A configured device is not visible to this process; the message lists the visible ones."""


def visible_devices(driver: DriverApi) -> str:
    count = driver.device_count()
    listed = ", ".join(f"{i} {driver.device_uuid(i)}" for i in range(count))
    return f"{count} visible: {listed}" if count else "none visible"


def resolve_devices(driver: DriverApi, devices: Iterable[int | str]) -> list[int]:
    """Configured devices (ordinals or "GPU-…" UUIDs) -> ordinals in this process, in order.
    An unknown device, or two entries naming the same device, raise DeviceNotFound."""
    ordinals: list[int] = []
    count = driver.device_count()
    for device in devices:
        if isinstance(device, int):
            ordinal = device if 0 <= device < count else None
        else:
            ordinal = driver.ordinal_of(device)
        if ordinal is None:
            raise DeviceNotFound(f"no CUDA device {device!r} on this node ({visible_devices(driver)})")
        if ordinal in ordinals:
            raise DeviceNotFound(f"{device!r} is device {ordinal} ({driver.device_uuid(ordinal)}), "
                                 "which is already listed")
        ordinals.append(ordinal)
    return ordinals


@dataclass
class Arena:
    """One daemon-owned device allocation, exported once at start: as a legacy CUDA IPC `handle`
    (export "ipc": importers must share the daemon's pid and IPC namespaces), or as a file
    descriptor `fd` handed out on the fd socket (export "fd": any process that reaches it)."""

    ordinal: int
    uuid: str
    size: int
    ptr: int = field(repr=False)
    handle: bytes = field(repr=False, default=b"")
    export: str = "ipc"
    fd: int = -1
    vmm: VmmMapping | None = field(repr=False, default=None)

    @property
    def label(self) -> str:
        return f"cuda{self.ordinal}"  # the `pool` label of its metrics


def choose_export(driver: DriverApi, ordinals: list[int], export: str, fd_socket: bool) -> str:
    """`[pool.cuda] export` resolved: "fd" where every device can export a file descriptor and
    the daemon has an fd socket to hand it out on, else "ipc" ("auto"); "fd" where it cannot
    raises CudaError saying why."""
    if export == "ipc":
        return "ipc"
    if not fd_socket:
        why = "it needs the fd socket ([pool.host] backing = \"memfd\", the default)"
    else:
        unsupported = [o for o in ordinals if not driver.fd_export_supported(o)]
        if not unsupported:
            return "fd"
        why = (f"device(s) {unsupported} cannot export memory as a POSIX file descriptor "
               "(CUDA virtual memory management; driver 450+ on Linux)")
    if export == "fd":
        raise CudaError(f"pool.cuda.export = \"fd\": {why}")
    return "ipc"


def create_arenas(driver: DriverApi, ordinals: list[int], section: "CudaPoolSection", fd_socket: bool,
                  log: logging.Logger) -> "CudaArenas":
    """The daemon's arenas for `[pool.cuda]` (`section`), each logged with its export; a warning
    where "auto" fell back to IPC handles (clients in other pods cannot open them). CudaError
    with the configuration key that cannot be met."""
    size = int(section.size)
    export = choose_export(driver, ordinals, section.export, fd_socket)
    try:
        arenas = CudaArenas(driver, ordinals, size, export)
    except CudaError as exc:
        raise CudaError(f"pool.cuda.size: cannot allocate and export {size} bytes on each of devices {ordinals}: "
                        f"{exc}", result=exc.result) from None
    for arena in arenas:
        log.info("CUDA arena on device %d (%s): %d bytes, export %s", arena.ordinal, arena.uuid, arena.size,
                 arena.export)
    if section.export == "auto" and export == "ipc":
        log.warning("pool.cuda.export: auto chose CUDA IPC handles (the devices cannot export file descriptors, "
                    "or [pool.host] backing is \"named\"): clients in other pods cannot open the arenas")
    return arenas


class CudaArenas:
    """One arena of `size` bytes per device, each exported once (the handle registry). On any
    failure, what was allocated so far is freed before the error propagates."""

    def __init__(self, driver: DriverApi, ordinals: list[int], size: int, export: str = "ipc") -> None:
        self.driver = driver
        self.arenas: list[Arena] = []
        try:
            for ordinal in ordinals:
                uuid = driver.device_uuid(ordinal)
                if export == "fd":
                    mapping, fd = driver.vmm_alloc_exported(ordinal, size)
                    self.arenas.append(Arena(ordinal, uuid, mapping.size, mapping.ptr, export="fd", fd=fd,
                                             vmm=mapping))
                    continue
                ptr = driver.mem_alloc(ordinal, size)
                arena = Arena(ordinal, uuid, size, ptr)
                self.arenas.append(arena)  # freed by close() even if the export fails
                arena.handle = driver.ipc_get_handle(ordinal, ptr)
        except BaseException:
            self.close()
            raise

    def __iter__(self):
        return iter(self.arenas)

    def __len__(self) -> int:
        return len(self.arenas)

    def close(self) -> None:
        """Free every arena (at exit: clients drop their mappings when the daemon's epoch changes;
        an exported arena's memory lives on until every importer has unmapped it)."""
        while self.arenas:
            arena = self.arenas.pop()
            try:
                if arena.vmm is not None:
                    self.driver.vmm_free(arena.vmm)
                else:
                    self.driver.mem_free(arena.ordinal, arena.ptr)
            except CudaError:
                pass  # exiting anyway: the driver reclaims a dead process's memory
            finally:
                if arena.fd >= 0:
                    os.close(arena.fd)
                    arena.fd = -1
