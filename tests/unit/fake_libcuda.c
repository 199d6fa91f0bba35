/* A stand-in for libcuda.so.1 with the exact C signatures of the driver entry points ecd binds,
 * so the ctypes marshalling of ecd/memory/cuda.py (64-bit CUdeviceptr, the 64-byte
 * CUipcMemHandle passed by value, primary-context push/pop) is tested on machines without a GPU.
 * Built by tests/unit/test_cuda_driver.py with the system C compiler. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;
typedef struct { char bytes[16]; } CUuuid;
typedef struct { char reserved[64]; } CUipcMemHandle;

#define NDEV 2
static int initialized, depth, fail_next;
static CUcontext stack[64];
static char ctx_storage[NDEV];
static CUdeviceptr next_ptr = 0x7f0000000000ULL;  /* above 2^32: catches a 32-bit truncation */
static void *last_host_ptr; static size_t last_host_size; static unsigned last_flags;
static CUcontext alloc_ctx; static unsigned long long last_alloc_size;
static int retained[NDEV];

int fake_depth(void) { return depth; }
int fake_retained(int d) { return retained[d]; }
unsigned fake_last_flags(void) { return last_flags; }
void *fake_last_host_ptr(void) { return last_host_ptr; }
size_t fake_last_host_size(void) { return last_host_size; }
int fake_alloc_device(void) { return alloc_ctx ? (int)((char *)alloc_ctx - ctx_storage) : -1; }
unsigned long long fake_last_alloc_size(void) { return last_alloc_size; }
void fake_fail_next(int code) { fail_next = code; }
void fake_set_current(int d) { depth = 0; if (d >= 0) stack[depth++] = &ctx_storage[d]; }

static int take_failure(void) { int f = fail_next; fail_next = 0; return f; }

CUresult cuGetErrorName(CUresult e, const char **s) {
    switch (e) { case 1: *s = "CUDA_ERROR_INVALID_VALUE"; return 0;
                 case 2: *s = "CUDA_ERROR_OUT_OF_MEMORY"; return 0;
                 case 100: *s = "CUDA_ERROR_NO_DEVICE"; return 0; }
    *s = 0; return 1;
}
CUresult cuGetErrorString(CUresult e, const char **s) {
    switch (e) { case 1: *s = "invalid argument"; return 0;
                 case 2: *s = "out of memory"; return 0;
                 case 100: *s = "no CUDA-capable device is detected"; return 0; }
    *s = 0; return 1;
}
CUresult cuInit(unsigned int flags) { if (flags) return 1; initialized = 1; return take_failure(); }
CUresult cuDeviceGetCount(int *n) { *n = NDEV; return 0; }
CUresult cuDeviceGet(CUdevice *d, int ordinal) { if (ordinal < 0 || ordinal >= NDEV) return 1; *d = ordinal; return 0; }
CUresult cuDeviceGetUuid_v2(CUuuid *u, CUdevice d) { for (int i = 0; i < 16; i++) u->bytes[i] = (char)(0xa0 + 16 * d + i); return 0; }
CUresult cuDeviceGetUuid(CUuuid *u, CUdevice d) { return cuDeviceGetUuid_v2(u, d); }
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) { retained[d]++; *c = &ctx_storage[d]; return 0; }
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { retained[d]--; return 0; }
CUresult cuCtxPushCurrent_v2(CUcontext c) { stack[depth++] = c; return 0; }
CUresult cuCtxPopCurrent_v2(CUcontext *c) { if (!depth) return 1; *c = stack[--depth]; return 0; }
CUresult cuCtxGetCurrent(CUcontext *c) { *c = depth ? stack[depth - 1] : 0; return 0; }
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t size) {
    int f = take_failure(); if (f) return f;
    if (!depth) return 201; /* CUDA_ERROR_INVALID_CONTEXT */
    alloc_ctx = stack[depth - 1]; last_alloc_size = size;
    *p = next_ptr; next_ptr += (size + 0xfffff) & ~0xfffffULL; return 0;
}
CUresult cuMemFree_v2(CUdeviceptr p) { return (p >> 40) == 0x7f && depth ? 0 : 1; }
CUresult cuPointerSetAttribute(const void *value, int attr, CUdeviceptr p) { return attr == 6 && *(const unsigned *)value == 1 ? 0 : 1; }
CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p) {
    if (!depth) return 201;
    for (int i = 0; i < 64; i++) h->reserved[i] = (char)(i * 3 + 1);
    memcpy(h->reserved, &p, 8);
    return 0;
}
/* Checks every byte of the by-value handle: a handle passed by pointer would not match. */
CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, CUipcMemHandle h, unsigned int flags) {
    if (!depth) return 201;
    for (int i = 8; i < 64; i++) if (h.reserved[i] != (char)(i * 3 + 1)) return 1;
    last_flags = flags;
    CUdeviceptr orig; memcpy(&orig, h.reserved, 8);
    *p = orig + 0x100000000000ULL; return 0;
}
CUresult cuIpcCloseMemHandle(CUdeviceptr p) { return (p >> 40) == 0x8f && depth ? 0 : 1; }
CUresult cuMemHostRegister_v2(void *p, size_t size, unsigned int flags) {
    if (!depth) return 201;
    last_host_ptr = p; last_host_size = size; last_flags = flags; return 0;
}
CUresult cuMemHostUnregister(void *p) { return p == last_host_ptr && depth ? 0 : 1; }

/* ---- CUDA virtual memory management (ecd/memory/cuda_vmm.py): a cuMemCreate'd allocation is a
 * memfd here, exported as a real descriptor; every struct field ecd fills is checked. ---- */
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct { int type; int id; } CUmemLocation;
typedef struct { unsigned char compressionType, gpuDirectRDMACapable; unsigned short usage; unsigned char reserved[4]; } CUmemAllocFlags;
typedef struct { int type; int requestedHandleTypes; CUmemLocation location; void *win32HandleMetaData; CUmemAllocFlags allocFlags; } CUmemAllocationProp;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;
#define GRAIN (2ULL << 20)
static int vmm_unsupported, live_handles, reserved_ranges, mapped_ranges, last_import_fd = -1;
static CUdeviceptr next_va = 0x7e0000000000ULL;
void fake_vmm_unsupported(int v) { vmm_unsupported = v; }
int fake_live_handles(void) { return live_handles; }
int fake_reserved_ranges(void) { return reserved_ranges; }
int fake_mapped_ranges(void) { return mapped_ranges; }
int fake_last_import_fd(void) { return last_import_fd; }
static int prop_ok(const CUmemAllocationProp *p) {
    /* pinned, POSIX fd, on a device that exists, nothing else set */
    return p->type == 1 && p->requestedHandleTypes == 1 && p->location.type == 1 && p->location.id >= 0
        && p->location.id < NDEV && p->win32HandleMetaData == 0 && p->allocFlags.usage == 0;
}
CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice d) {
    if (d < 0 || d >= NDEV) return 1;
    *v = (attr == 102 || attr == 103) ? !vmm_unsupported : 0; return 0;
}
CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *p, int option) {
    if (!prop_ok(p) || option != 0) return 1;
    *g = GRAIN; return 0;
}
/* The handle is the memfd's descriptor plus 1000 (so a handle mistaken for an fd fails). */
CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *p, unsigned long long flags) {
    int f = take_failure(); if (f) return f;
    if (!depth) return 201;
    if (!prop_ok(p) || flags || !size || size % GRAIN) return 1;
    int fd = memfd_create("fake-cuda-vmm", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size)) return 2;
    dprintf(fd, "fake vmm device %d", p->location.id); /* what an importer can check it got */
    *h = (CUmemGenericAllocationHandle)fd + 1000; live_handles++; return 0;
}
CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
    if (!depth || h < 1000) return 1;
    close((int)(h - 1000)); live_handles--; return 0;
}
CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h, int type, unsigned long long flags) {
    int f = take_failure(); if (f) return f;
    if (!depth || h < 1000 || type != 1 || flags) return 1;
    int fd = dup((int)(h - 1000)); if (fd < 0) return 2;
    *(int *)out = fd; return 0;
}
/* The descriptor arrives as the pointer-sized value of the fd itself. */
CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *os_handle, int type) {
    if (!depth || type != 1) return 1;
    int fd = dup((int)(intptr_t)os_handle); if (fd < 0) return 1;
    last_import_fd = (int)(intptr_t)os_handle;
    *h = (CUmemGenericAllocationHandle)fd + 1000; live_handles++; return 0;
}
CUresult cuMemAddressReserve(CUdeviceptr *p, size_t size, size_t align, CUdeviceptr addr, unsigned long long flags) {
    if (!depth || size % GRAIN || align || addr || flags) return 1;
    *p = next_va; next_va += size; reserved_ranges++; return 0;
}
CUresult cuMemAddressFree(CUdeviceptr p, size_t size) { if (!depth || (p >> 40) != 0x7e) return 1; reserved_ranges--; return 0; }
CUresult cuMemMap(CUdeviceptr p, size_t size, size_t offset, CUmemGenericAllocationHandle h, unsigned long long flags) {
    int f = take_failure(); if (f) return f;
    if (!depth || (p >> 40) != 0x7e || offset || flags || h < 1000) return 1;
    mapped_ranges++; return 0;
}
CUresult cuMemUnmap(CUdeviceptr p, size_t size) { if (!depth || (p >> 40) != 0x7e) return 1; mapped_ranges--; return 0; }
static int last_access[NDEV + 1]; static size_t last_access_count;
size_t fake_last_access_count(void) { return last_access_count; }
int fake_last_access(int i) { return last_access[i]; }
/* Every descriptor of the array is checked: read-write on a device that exists, none twice. */
CUresult cuMemSetAccess(CUdeviceptr p, size_t size, const CUmemAccessDesc *d, size_t count) {
    if (!depth || count < 1 || count > NDEV) return 1;
    for (size_t i = 0; i < count; i++) {
        if (d[i].location.type != 1 || d[i].location.id < 0 || d[i].location.id >= NDEV || d[i].flags != 3) return 1;
        for (size_t j = 0; j < i; j++) if (d[j].location.id == d[i].location.id) return 1;
        last_access[i] = d[i].location.id;
    }
    last_access_count = count; return 0;
}
