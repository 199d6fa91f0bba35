/* ecd._copy: one bytes copy into a writable buffer (a pool mapping), with non-temporal stores for
 * large copies.
 *
 * glibc's memcpy uses ordinary stores below its non-temporal threshold (3/4 of the L3 share), so
 * a put of a few to tens of MiB into the pool goes through the cache: it reads each destination
 * line before writing it and evicts everything the daemon and the client use next (the Publish
 * round trip after a 16 MiB copy cost ~400 us instead of ~100 us). Nobody on this core reads the
 * pool extent right after a put, so for copies of at least `stream_min` bytes the stores bypass
 * the cache (SSE2 `movntdq`, AVX2 `vmovntdq` where the CPU has it, chosen once at import).
 * The streaming loops also prefetch the source non-temporally a little ahead (PREFETCH_AHEAD).
 * Smaller copies, and every CPU that is not x86, use memcpy. An sfence at the end orders the
 * streamed bytes before any later store (the Publish that makes them visible to readers).
 * A get's copy out of the pool into a new tensor goes through here too: the same reasons hold
 * for a destination of several MiB (a 16 MiB get: ~0.6-0.7x the time of numpy's copy).
 *
 * copy(dst, dst_offset, src, stream_min=STREAM_MIN, isa=None): dst[dst_offset:dst_offset + len(src)]
 * = src. `dst`: a writable contiguous buffer; `src`: a contiguous buffer (bytes, numpy array,
 * mmap); they must not overlap. `isa` picks a routine other than the CPU's best (one of ISAS: the
 * tests run each). The GIL is released while a large copy runs; both buffers stay exported
 * meanwhile, so neither can be closed or resized under it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define ECD_X86 1
#include <immintrin.h>
#endif

/* Below this many bytes the copy fits the caches and memcpy is as fast or faster (measured on the
 * development VM, a Zen 5 EPYC with 2 MiB L2 and 32 MiB L3: streaming wins from ~4 MiB). */
#define STREAM_MIN_DEFAULT (4 << 20)
/* Copies this small keep the GIL: releasing and taking it back costs more than they do. */
#define NOGIL_MIN (64 << 10)
/* How far ahead of the loads the source is prefetched, non-temporally (PREFETCHNTA): the loads
 * find their lines already on the way instead of waiting for DRAM one miss at a time, and the
 * source, read once, does not push the daemon's and the client's working sets out of the caches
 * (a 16 MiB put from a source the caches had let go of: 12-19% faster than without, on the
 * development VM; distances of 512-2048 bytes did about as well). */
#define PREFETCH_AHEAD 1024

typedef void (*stream_fn)(char *dst, const char *src, size_t n);

#ifdef ECD_X86
/* Aligns dst to 16 bytes with memcpy, streams 64-byte blocks, memcpys the tail. A prefetch past
 * the end of src is harmless: prefetches never fault. */
__attribute__((target("sse2"))) static void stream_sse2(char *dst, const char *src, size_t n)
{
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    for (; n >= 64; n -= 64, src += 64, dst += 64) {
        _mm_prefetch(src + PREFETCH_AHEAD, _MM_HINT_NTA);
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    _mm_sfence();
    memcpy(dst, src, n);
}

/* The same with 32-byte registers and 128-byte blocks. */
__attribute__((target("avx2"))) static void stream_avx2(char *dst, const char *src, size_t n)
{
    size_t head = (32 - ((uintptr_t)dst & 31)) & 31;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    for (; n >= 128; n -= 128, src += 128, dst += 128) {
        _mm_prefetch(src + PREFETCH_AHEAD, _MM_HINT_NTA);
        _mm_prefetch(src + PREFETCH_AHEAD + 64, _MM_HINT_NTA);
        __m256i a = _mm256_loadu_si256((const __m256i *)src);
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + 96));
        _mm256_stream_si256((__m256i *)dst, a);
        _mm256_stream_si256((__m256i *)(dst + 32), b);
        _mm256_stream_si256((__m256i *)(dst + 64), c);
        _mm256_stream_si256((__m256i *)(dst + 96), d);
    }
    _mm_sfence();
    memcpy(dst, src, n);
}
#endif

static stream_fn stream = NULL; /* the CPU's best; NULL: no streaming stores (memcpy always) */
static int has_avx2 = 0;

static PyObject *copy(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"dst", "dst_offset", "src", "stream_min", "isa", NULL};
    PyObject *dst_obj, *src_obj;
    Py_ssize_t offset, stream_min = STREAM_MIN_DEFAULT;
    const char *isa = NULL;
    Py_buffer dst, src;
    stream_fn routine = stream;
    (void)self;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OnO|nz:copy", kwlist, &dst_obj, &offset, &src_obj,
                                     &stream_min, &isa))
        return NULL;
    if (isa != NULL) {
        if (strcmp(isa, "memcpy") == 0)
            routine = NULL;
#ifdef ECD_X86
        else if (strcmp(isa, "sse2") == 0 && stream != NULL)
            routine = stream_sse2;
        else if (strcmp(isa, "avx2") == 0 && has_avx2)
            routine = stream_avx2;
#endif
        else
            return PyErr_Format(PyExc_ValueError, "copy routine %s is not available here", isa);
    }
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_WRITABLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    if (offset < 0 || offset > dst.len || src.len > dst.len - offset) {
        PyErr_Format(PyExc_ValueError, "copy of %zd bytes at offset %zd does not fit a buffer of %zd bytes",
                     src.len, offset, dst.len);
        PyBuffer_Release(&src);
        PyBuffer_Release(&dst);
        return NULL;
    }
    char *d = (char *)dst.buf + offset;
    const char *s = (const char *)src.buf;
    size_t n = (size_t)src.len;
    stream_fn fn = (routine != NULL && src.len >= stream_min) ? routine : NULL;
    if (n >= NOGIL_MIN) {
        Py_BEGIN_ALLOW_THREADS
        if (fn != NULL)
            fn(d, s, n);
        else
            memcpy(d, s, n);
        Py_END_ALLOW_THREADS
    } else if (fn != NULL) {
        fn(d, s, n);
    } else if (n) {
        memcpy(d, s, n);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    Py_RETURN_NONE;
}

/* ---- many small copies in one call (issue 26: per-entry cost) ----------------------------------
 *
 * copy_many_in(dst, offsets, addresses, sizes): for each i, dst[offsets[i]:offsets[i] + sizes[i]]
 * = the sizes[i] bytes at memory address addresses[i]; copy_many_out(src, offsets, addresses,
 * sizes): the sizes[i] bytes at addresses[i] = src[offsets[i]:offsets[i] + sizes[i]]. `dst`/`src`
 * is a buffer (the pool mapping), the addresses are those of live contiguous tensors the caller
 * holds (tensor.data_ptr()): what a put_many or get_many of hundreds of KV blocks does with one
 * call instead of one Python-level copy (and its buffer and tensor objects) per entry. Every range
 * is checked against the buffer before anything is copied: a bad one raises ValueError with
 * nothing written. Pieces of at least STREAM_MIN go into the buffer with non-temporal stores, as
 * copy() does. The GIL is released while the copies run if they add up to NOGIL_MIN. */
typedef struct {
    Py_ssize_t *offsets, *sizes;
    char **addresses;
    Py_ssize_t n, total;
} many_args;

static void many_free(many_args *m)
{
    PyMem_Free(m->offsets);
    PyMem_Free(m->sizes);
    PyMem_Free(m->addresses);
}

static int many_parse(PyObject *offsets_obj, PyObject *addresses_obj, PyObject *sizes_obj, Py_ssize_t buf_len,
                      many_args *m)
{
    PyObject *offs = NULL, *addrs = NULL, *sizes = NULL;
    int rc = -1;
    memset(m, 0, sizeof(*m));
    offs = PySequence_Fast(offsets_obj, "offsets must be a sequence of ints");
    addrs = offs ? PySequence_Fast(addresses_obj, "addresses must be a sequence of ints") : NULL;
    sizes = addrs ? PySequence_Fast(sizes_obj, "sizes must be a sequence of ints") : NULL;
    if (sizes == NULL)
        goto done;
    m->n = PySequence_Fast_GET_SIZE(offs);
    if (PySequence_Fast_GET_SIZE(addrs) != m->n || PySequence_Fast_GET_SIZE(sizes) != m->n) {
        PyErr_SetString(PyExc_ValueError, "offsets, addresses and sizes must have the same length");
        goto done;
    }
    m->offsets = PyMem_New(Py_ssize_t, m->n + 1);
    m->sizes = PyMem_New(Py_ssize_t, m->n + 1);
    m->addresses = PyMem_New(char *, m->n + 1);
    if (m->offsets == NULL || m->sizes == NULL || m->addresses == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < m->n; i++) {
        Py_ssize_t off = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(offs, i));
        Py_ssize_t size = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(sizes, i));
        void *addr = PyLong_AsVoidPtr(PySequence_Fast_GET_ITEM(addrs, i));
        if (PyErr_Occurred())
            goto done;
        if (off < 0 || size < 0 || off > buf_len || size > buf_len - off) {
            PyErr_Format(PyExc_ValueError, "copy %zd of %zd bytes at offset %zd does not fit a buffer of %zd bytes",
                         i, size, off, buf_len);
            goto done;
        }
        if (size > 0 && addr == NULL) {
            PyErr_Format(PyExc_ValueError, "copy %zd: address 0 for %zd bytes", i, size);
            goto done;
        }
        m->offsets[i] = off;
        m->sizes[i] = size;
        m->addresses[i] = (char *)addr;
        m->total += size;
    }
    rc = 0;
done:
    Py_XDECREF(offs);
    Py_XDECREF(addrs);
    Py_XDECREF(sizes);
    if (rc < 0)
        many_free(m);
    return rc;
}

static void many_run(char *base, many_args *m, int into)
{
    for (Py_ssize_t i = 0; i < m->n; i++) {
        size_t n = (size_t)m->sizes[i];
        if (n == 0)
            continue;
        char *pool = base + m->offsets[i];
        if (!into)
            memcpy(m->addresses[i], pool, n);
        else if (stream != NULL && m->sizes[i] >= STREAM_MIN_DEFAULT)
            stream(pool, m->addresses[i], n);
        else
            memcpy(pool, m->addresses[i], n);
    }
}

static PyObject *copy_many(PyObject *args, int into)
{
    PyObject *buf_obj, *offsets, *addresses, *sizes;
    Py_buffer buf;
    many_args m;
    if (!PyArg_ParseTuple(args, into ? "OOOO:copy_many_in" : "OOOO:copy_many_out", &buf_obj, &offsets,
                          &addresses, &sizes))
        return NULL;
    if (PyObject_GetBuffer(buf_obj, &buf, into ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
        return NULL;
    if (many_parse(offsets, addresses, sizes, buf.len, &m) < 0) {
        PyBuffer_Release(&buf);
        return NULL;
    }
    if (m.total >= NOGIL_MIN) {
        Py_BEGIN_ALLOW_THREADS
        many_run((char *)buf.buf, &m, into);
        Py_END_ALLOW_THREADS
    } else {
        many_run((char *)buf.buf, &m, into);
    }
    many_free(&m);
    PyBuffer_Release(&buf);
    Py_RETURN_NONE;
}

static PyObject *copy_many_in(PyObject *self, PyObject *args)
{
    (void)self;
    return copy_many(args, 1);
}

static PyObject *copy_many_out(PyObject *self, PyObject *args)
{
    (void)self;
    return copy_many(args, 0);
}

/* copy_many_between(dst_addresses, src_addresses, sizes): for each i, the sizes[i] bytes at
 * src_addresses[i] to dst_addresses[i], memory of live tensors the caller holds and has checked
 * (PagedKV.scatter: pool views into the blocks of a paged KV cache, a row per layer). */
static PyObject *copy_many_between(PyObject *self, PyObject *args)
{
    PyObject *dst_obj, *src_obj, *sizes_obj, *dsts = NULL, *srcs = NULL, *sizes = NULL, *result = NULL;
    many_args m;
    (void)self;
    memset(&m, 0, sizeof(m));
    if (!PyArg_ParseTuple(args, "OOO:copy_many_between", &dst_obj, &src_obj, &sizes_obj))
        return NULL;
    dsts = PySequence_Fast(dst_obj, "dst_addresses must be a sequence of ints");
    srcs = dsts ? PySequence_Fast(src_obj, "src_addresses must be a sequence of ints") : NULL;
    sizes = srcs ? PySequence_Fast(sizes_obj, "sizes must be a sequence of ints") : NULL;
    if (sizes == NULL)
        goto done;
    m.n = PySequence_Fast_GET_SIZE(dsts);
    if (PySequence_Fast_GET_SIZE(srcs) != m.n || PySequence_Fast_GET_SIZE(sizes) != m.n) {
        PyErr_SetString(PyExc_ValueError, "dst_addresses, src_addresses and sizes must have the same length");
        goto done;
    }
    m.offsets = PyMem_New(Py_ssize_t, m.n + 1); /* unused here */
    m.sizes = PyMem_New(Py_ssize_t, m.n + 1);
    m.addresses = PyMem_New(char *, 2 * m.n + 1); /* sources, then destinations */
    if (m.offsets == NULL || m.sizes == NULL || m.addresses == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < m.n; i++) {
        void *dst = PyLong_AsVoidPtr(PySequence_Fast_GET_ITEM(dsts, i));
        void *src = PyLong_AsVoidPtr(PySequence_Fast_GET_ITEM(srcs, i));
        Py_ssize_t size = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(sizes, i));
        if (PyErr_Occurred())
            goto done;
        if (size < 0 || (size > 0 && (dst == NULL || src == NULL))) {
            PyErr_Format(PyExc_ValueError, "copy %zd: %zd bytes between addresses %p and %p", i, size, src, dst);
            goto done;
        }
        m.sizes[i] = size;
        m.addresses[i] = (char *)src;
        m.addresses[m.n + i] = (char *)dst;
        m.total += size;
    }
    if (m.total >= NOGIL_MIN) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < m.n; i++)
            if (m.sizes[i])
                memcpy(m.addresses[m.n + i], m.addresses[i], (size_t)m.sizes[i]);
        Py_END_ALLOW_THREADS
    } else {
        for (Py_ssize_t i = 0; i < m.n; i++)
            if (m.sizes[i])
                memcpy(m.addresses[m.n + i], m.addresses[i], (size_t)m.sizes[i]);
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    Py_XDECREF(dsts);
    Py_XDECREF(srcs);
    Py_XDECREF(sizes);
    many_free(&m);
    return result;
}

static PyMethodDef methods[] = {
    {"copy", (PyCFunction)(void (*)(void))copy, METH_VARARGS | METH_KEYWORDS,
     "copy(dst, dst_offset, src, stream_min=STREAM_MIN, isa=None)\n--\n\n"
     "dst[dst_offset:dst_offset + len(src)] = src (contiguous buffers, not overlapping), with\n"
     "non-temporal stores when len(src) >= stream_min and the CPU has them (ISA: the routine\n"
     "used; isa: one of ISAS instead)."},
    {"copy_many_in", copy_many_in, METH_VARARGS,
     "copy_many_in(dst, offsets, addresses, sizes)\n--\n\n"
     "dst[offsets[i]:offsets[i] + sizes[i]] = the sizes[i] bytes at address addresses[i], for every i\n"
     "(every range is checked before anything is copied)."},
    {"copy_many_between", copy_many_between, METH_VARARGS,
     "copy_many_between(dst_addresses, src_addresses, sizes)\n--\n\n"
     "the sizes[i] bytes at src_addresses[i] to dst_addresses[i], for every i (addresses the caller checked)."},
    {"copy_many_out", copy_many_out, METH_VARARGS,
     "copy_many_out(src, offsets, addresses, sizes)\n--\n\n"
     "the sizes[i] bytes at address addresses[i] = src[offsets[i]:offsets[i] + sizes[i]], for every i\n"
     "(every range is checked before anything is copied)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "ecd._copy",
    .m_doc = "Bytes copies into pool memory; non-temporal stores for large ones.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__copy(void)
{
    const char *isa = "memcpy";
    PyObject *isas;
#ifdef ECD_X86
    __builtin_cpu_init();
    has_avx2 = __builtin_cpu_supports("avx2");
    if (has_avx2) {
        stream = stream_avx2;
        isa = "avx2";
    } else if (__builtin_cpu_supports("sse2")) {
        stream = stream_sse2;
        isa = "sse2";
    }
    if (has_avx2)
        isas = Py_BuildValue("(sss)", "memcpy", "sse2", "avx2");
    else if (stream != NULL)
        isas = Py_BuildValue("(ss)", "memcpy", "sse2");
    else
#endif
        isas = Py_BuildValue("(s)", "memcpy");
    if (isas == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        Py_DECREF(isas);
        return NULL;
    }
    if (PyModule_AddObject(m, "ISAS", isas) < 0) {
        Py_DECREF(isas);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "STREAM_MIN", STREAM_MIN_DEFAULT) < 0 ||
        PyModule_AddStringConstant(m, "ISA", isa) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
