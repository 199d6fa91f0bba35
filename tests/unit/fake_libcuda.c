/* A stand-in for libcuda.so.1 with the exact C signatures of the driver entry points ecd binds,
 * so the ctypes marshalling of ecd/memory/cuda.py (64-bit CUdeviceptr, the 64-byte
 * CUipcMemHandle passed by value, primary-context push/pop) is tested on machines without a GPU.
 * Built by tests/unit/test_cuda_driver.py with the system C compiler. */
#include <stdint.h>
#include <string.h>

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
