/* ecd._copy: the client's bytes copies into and out of pool memory: glibc's memcpy, or
 * non-temporal (streaming) stores for large copies where they are faster on this CPU.
 *
 * Why streaming at all: glibc's memcpy uses ordinary stores below its non-temporal threshold (3/4
 * of the L3 share it believes in: 288 MiB on a VM that reports 384 MiB), so a put of a few to
 * tens of MiB goes through the cache: it reads each destination line before writing it and
 * evicts what the daemon and the client use next. On an AMD EPYC (Zen 5) streaming stores copy 16
 * MiB in 0.75-0.85x memcpy's time. Why not always: on an Intel Xeon (ERMS/FSRM) the same routine
 * with a non-temporal source prefetch was 2.6x slower than memcpy, and on the AMD streaming
 * loses below ~16 MiB. What wins depends on the CPU, so this module decides nothing by itself:
 * copies of `large_from` bytes or more use `large_routine` (set_large), memcpy below; both start
 * as memcpy, and ecd/client/copy_strategy.py sets them from a calibration on this machine (or from
 * ECD_COPY_ROUTINE).
 *
 * copy(dst, dst_offset, src, stream_min=STREAM_MIN, routine=None): dst[dst_offset:dst_offset +
 * len(src)] = src; dst a writable contiguous buffer, src a contiguous buffer, not overlapping.
 * `routine` (one of ROUTINES) is used from stream_min up instead of the large routine (tests and
 * the calibration); without it, the large routine from large_from up (stream_min unused). The GIL is
 * released while a large copy runs; both buffers stay exported meanwhile, so neither can be closed
 * or resized under it. Every streaming routine ends with an sfence: the streamed bytes are ordered
 * before any later store (the Publish that makes them visible to readers).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define ECD_X86 1
#include <immintrin.h>
#endif

/* STREAM_MIN: where a routine named by the caller starts (copy's default stream_min, and every
 * batched piece), and large_from until set_large moves it: streaming never wins in the caches. */
#define STREAM_MIN_DEFAULT (4 << 20)
/* Copies this small keep the GIL: releasing and taking it back costs more than they do. */
#define NOGIL_MIN (64 << 10)
/* How far ahead of the loads the -prefetch routines prefetch the source, non-temporally. */
#define PREFETCH_AHEAD 1024
typedef void (*copy_fn)(char *dst, const char *src, size_t n);

static void plain_memcpy(char *dst, const char *src, size_t n)
{
    memcpy(dst, src, n);
}

#ifdef ECD_X86
/* Aligns dst with memcpy, streams blocks of four registers, memcpys the tail. A prefetch past the
 * end of src is harmless: prefetches never fault. `prefetch` is a constant in each instance. */
#define STREAM_BODY(REG, LOADU, STOREU_NT, WIDTH)                                                 \
    size_t head = (WIDTH - ((uintptr_t)dst & (WIDTH - 1))) & (WIDTH - 1);                         \
    if (head > n)                                                                                 \
        head = n;                                                                                 \
    memcpy(dst, src, head);                                                                       \
    dst += head;                                                                                  \
    src += head;                                                                                  \
    n -= head;                                                                                    \
    for (; n >= 4 * WIDTH; n -= 4 * WIDTH, src += 4 * WIDTH, dst += 4 * WIDTH) {                  \
        if (prefetch)                                                                             \
            for (int p = 0; p < 4 * WIDTH; p += 64)                                               \
                _mm_prefetch(src + PREFETCH_AHEAD + p, _MM_HINT_NTA);                             \
        REG a = LOADU((const REG *)src);                                                          \
        REG b = LOADU((const REG *)(src + WIDTH));                                                \
        REG c = LOADU((const REG *)(src + 2 * WIDTH));                                            \
        REG d = LOADU((const REG *)(src + 3 * WIDTH));                                            \
        STOREU_NT((REG *)dst, a);                                                                 \
        STOREU_NT((REG *)(dst + WIDTH), b);                                                       \
        STOREU_NT((REG *)(dst + 2 * WIDTH), c);                                                   \
        STOREU_NT((REG *)(dst + 3 * WIDTH), d);                                                   \
    }                                                                                             \
    _mm_sfence();                                                                                 \
    memcpy(dst, src, n);

__attribute__((target("sse2"))) static inline void stream_sse2(char *dst, const char *src, size_t n, int prefetch)
{
    STREAM_BODY(__m128i, _mm_loadu_si128, _mm_stream_si128, 16)
}

__attribute__((target("avx2"))) static inline void stream_avx2(char *dst, const char *src, size_t n, int prefetch)
{
    STREAM_BODY(__m256i, _mm256_loadu_si256, _mm256_stream_si256, 32)
}

__attribute__((target("sse2"))) static void nt_sse2(char *d, const char *s, size_t n) { stream_sse2(d, s, n, 0); }
__attribute__((target("sse2"))) static void nt_sse2_pf(char *d, const char *s, size_t n) { stream_sse2(d, s, n, 1); }
__attribute__((target("avx2"))) static void nt_avx2(char *d, const char *s, size_t n) { stream_avx2(d, s, n, 0); }
__attribute__((target("avx2"))) static void nt_avx2_pf(char *d, const char *s, size_t n) { stream_avx2(d, s, n, 1); }
#endif

/* Every routine this build knows; `fn` NULL where this CPU lacks it (set at import). */
enum { R_MEMCPY, R_NT_SSE2, R_NT_SSE2_PF, R_NT_AVX2, R_NT_AVX2_PF, N_ROUTINES };
static struct {
    const char *name;
    copy_fn fn;
} routines[N_ROUTINES] = {
    {"memcpy", plain_memcpy}, {"nt-sse2", NULL}, {"nt-sse2-prefetch", NULL},
    {"nt-avx2", NULL}, {"nt-avx2-prefetch", NULL},
};

/* Copies of large_from bytes or more use large_routine (set_large); memcpy until it is set. */
static int large_routine = R_MEMCPY;
static size_t large_from = STREAM_MIN_DEFAULT;

/* The routine for a copy of n bytes: `forced` (if given) from stream_min up, else the large
 * routine from large_from up; memcpy below. */
static copy_fn routine_for(size_t n, size_t stream_min, int forced)
{
    if (forced >= 0)
        return n >= stream_min ? routines[forced].fn : plain_memcpy;
    return n >= large_from ? routines[large_routine].fn : plain_memcpy;
}

/* Whether the pages at the start, middle and end of dst are already in memory (mincore: three
 * syscalls, ~1 us, for a copy of megabytes). Streaming into pages never touched loses to memcpy
 * (6-13% on the AMD: the kernel zeroes each page through the cache on first touch, where memcpy's
 * stores then hit and streaming stores must evict), so such a copy (a get's fresh tensor of 64
 * MiB, which the allocator maps new) uses memcpy. */
static int dst_is_warm(char *dst, size_t n)
{
    static long page = 0;
    unsigned char resident;
    if (page <= 0)
        page = sysconf(_SC_PAGESIZE);
    char *probes[3] = {dst, dst + n / 2, dst + n - 1};
    for (int i = 0; i < 3; i++) {
        void *start = (void *)((uintptr_t)probes[i] & ~(uintptr_t)(page - 1));
        if (mincore(start, (size_t)page, &resident) == 0 && !(resident & 1))
            return 0;
    }
    return 1;
}

/* fn(dst, src, n), falling back to memcpy where fn streams into pages not yet in memory. */
static void run_copy(copy_fn fn, char *dst, const char *src, size_t n)
{
    if (fn != plain_memcpy && !dst_is_warm(dst, n))
        fn = plain_memcpy;
    fn(dst, src, n);
}

/* routine name (or None) -> index; -1 with ValueError set if this CPU has no such routine. */
static int routine_index(const char *name, int *index)
{
    *index = -1;
    if (name == NULL)
        return 0;
    for (int r = 0; r < N_ROUTINES; r++)
        if (routines[r].fn != NULL && strcmp(name, routines[r].name) == 0) {
            *index = r;
            return 0;
        }
    PyErr_Format(PyExc_ValueError, "copy routine %s is not available here (ROUTINES lists those that are)", name);
    return -1;
}

static PyObject *copy(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"dst", "dst_offset", "src", "stream_min", "routine", NULL};
    PyObject *dst_obj, *src_obj;
    Py_ssize_t offset, stream_min = STREAM_MIN_DEFAULT;
    const char *name = NULL;
    int forced;
    Py_buffer dst, src;
    (void)self;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OnO|nz:copy", kwlist, &dst_obj, &offset, &src_obj,
                                     &stream_min, &name))
        return NULL;
    if (routine_index(name, &forced) < 0)
        return NULL;
    if (stream_min < 0)
        stream_min = 0;
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
    copy_fn fn = routine_for(n, (size_t)stream_min, forced);
    if (n >= NOGIL_MIN) {
        Py_BEGIN_ALLOW_THREADS
        run_copy(fn, d, s, n);
        Py_END_ALLOW_THREADS
    } else if (n) {
        run_copy(fn, d, s, n);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    Py_RETURN_NONE;
}

/* ---- many copies in one call (put_many / get_many of hundreds of KV blocks, PagedKV) -----------
 *
 * copy_many_in(dst, offsets, addresses, sizes, routine=None): for each i, dst[offsets[i]:offsets[i]
 * + sizes[i]] = the sizes[i] bytes at memory address addresses[i]; copy_many_out(src, offsets,
 * addresses, sizes, routine=None): the sizes[i] bytes at addresses[i] = src[offsets[i]:offsets[i] +
 * sizes[i]]. `dst`/`src` is a buffer (the pool mapping), the addresses are those of live contiguous
 * tensors the caller holds (tensor.data_ptr()): one call instead of one Python-level copy (and its
 * buffer and tensor objects) per entry. Every range is checked against the buffer before anything
 * is copied: a bad one raises ValueError with nothing written. copy_many_between(dst_addresses,
 * src_addresses, sizes, routine=None): memory the caller holds and has checked (PagedKV.scatter:
 * pool views into the blocks of a paged KV cache, a row per layer). Each piece is copied as copy()
 * would copy it (`routine` from STREAM_MIN up, else the large routine from large_from up); the GIL is released while
 * the copies run if they add up to NOGIL_MIN. */
typedef struct {
    char **dst, **src;
    Py_ssize_t *sizes;
    Py_ssize_t n, total;
} many_args;

static void many_free(many_args *m)
{
    PyMem_Free(m->dst);
    PyMem_Free(m->src);
    PyMem_Free(m->sizes);
}

/* Fills m from three sequences of ints. buf != NULL: `firsts` are offsets into it (checked), on
 * the side `base_is_dst` says; else both are addresses, firsts the destinations. */
static int many_parse(PyObject *firsts_obj, PyObject *addresses_obj, PyObject *sizes_obj, Py_buffer *buf,
                      int base_is_dst, many_args *m)
{
    char *base = buf != NULL ? (char *)buf->buf : NULL;
    Py_ssize_t buf_len = buf != NULL ? buf->len : 0;
    PyObject *firsts = NULL, *addrs = NULL, *sizes = NULL;
    int rc = -1;
    memset(m, 0, sizeof(*m));
    firsts = PySequence_Fast(firsts_obj, "offsets and addresses must be sequences of ints");
    addrs = firsts ? PySequence_Fast(addresses_obj, "addresses must be a sequence of ints") : NULL;
    sizes = addrs ? PySequence_Fast(sizes_obj, "sizes must be a sequence of ints") : NULL;
    if (sizes == NULL)
        goto done;
    m->n = PySequence_Fast_GET_SIZE(firsts);
    if (PySequence_Fast_GET_SIZE(addrs) != m->n || PySequence_Fast_GET_SIZE(sizes) != m->n) {
        PyErr_SetString(PyExc_ValueError, "the offsets or addresses and the sizes must have the same length");
        goto done;
    }
    m->dst = PyMem_New(char *, m->n + 1);
    m->src = PyMem_New(char *, m->n + 1);
    m->sizes = PyMem_New(Py_ssize_t, m->n + 1);
    if (m->dst == NULL || m->src == NULL || m->sizes == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < m->n; i++) {
        PyObject *first = PySequence_Fast_GET_ITEM(firsts, i);
        Py_ssize_t size = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(sizes, i));
        char *addr = (char *)PyLong_AsVoidPtr(PySequence_Fast_GET_ITEM(addrs, i));
        char *other = buf == NULL ? (char *)PyLong_AsVoidPtr(first) : NULL;
        Py_ssize_t off = buf != NULL ? PyLong_AsSsize_t(first) : 0;
        if (PyErr_Occurred())
            goto done;
        if (size < 0 || (buf != NULL && (off < 0 || off > buf_len || size > buf_len - off))) {
            PyErr_Format(PyExc_ValueError, "copy %zd of %zd bytes at offset %zd does not fit a buffer of %zd bytes",
                         i, size, off, buf_len);
            goto done;
        }
        if (buf != NULL)
            other = base + off;
        if (size > 0 && (addr == NULL || other == NULL)) {
            PyErr_Format(PyExc_ValueError, "copy %zd: address 0 for %zd bytes", i, size);
            goto done;
        }
        m->dst[i] = base_is_dst ? other : addr;
        m->src[i] = base_is_dst ? addr : other;
        m->sizes[i] = size;
        m->total += size;
    }
    rc = 0;
done:
    Py_XDECREF(firsts);
    Py_XDECREF(addrs);
    Py_XDECREF(sizes);
    if (rc < 0)
        many_free(m);
    return rc;
}

static void many_run(many_args *m, int forced)
{
    for (Py_ssize_t i = 0; i < m->n; i++)
        if (m->sizes[i])
            run_copy(routine_for((size_t)m->sizes[i], STREAM_MIN_DEFAULT, forced), m->dst[i], m->src[i],
                     (size_t)m->sizes[i]);
}

/* kind: 'i' copy_many_in, 'o' copy_many_out, 'b' copy_many_between */
static PyObject *copy_many(PyObject *args, PyObject *kwargs, char kind)
{
    static char *kwlist[] = {"buf", "offsets", "addresses", "sizes", "routine", NULL};
    static char *between_kwlist[] = {"dst_addresses", "src_addresses", "sizes", "routine", NULL};
    PyObject *buf_obj = NULL, *firsts, *addresses, *sizes;
    const char *name = NULL;
    int forced, got;
    Py_buffer buf = {0};
    many_args m;
    if (kind == 'b')
        got = PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|z:copy_many_between", between_kwlist, &firsts,
                                          &addresses, &sizes, &name);
    else
        got = PyArg_ParseTupleAndKeywords(args, kwargs, kind == 'i' ? "OOOO|z:copy_many_in" : "OOOO|z:copy_many_out",
                                          kwlist, &buf_obj, &firsts, &addresses, &sizes, &name);
    if (!got || routine_index(name, &forced) < 0)
        return NULL;
    if (buf_obj != NULL && PyObject_GetBuffer(buf_obj, &buf, kind == 'i' ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
        return NULL;
    if (many_parse(firsts, addresses, sizes, buf_obj != NULL ? &buf : NULL, kind != 'o', &m) < 0) {
        if (buf_obj != NULL)
            PyBuffer_Release(&buf);
        return NULL;
    }
    if (m.total >= NOGIL_MIN) {
        Py_BEGIN_ALLOW_THREADS
        many_run(&m, forced);
        Py_END_ALLOW_THREADS
    } else {
        many_run(&m, forced);
    }
    many_free(&m);
    if (buf_obj != NULL)
        PyBuffer_Release(&buf);
    Py_RETURN_NONE;
}

static PyObject *copy_many_in(PyObject *self, PyObject *args, PyObject *kwargs)
{
    (void)self;
    return copy_many(args, kwargs, 'i');
}

static PyObject *copy_many_out(PyObject *self, PyObject *args, PyObject *kwargs)
{
    (void)self;
    return copy_many(args, kwargs, 'o');
}

static PyObject *copy_many_between(PyObject *self, PyObject *args, PyObject *kwargs)
{
    (void)self;
    return copy_many(args, kwargs, 'b');
}

/* set_large(routine, from_bytes): copies of from_bytes or more use `routine` when they name none;
 * large() -> (routine, from_bytes). */
static PyObject *set_large(PyObject *self, PyObject *args)
{
    const char *name;
    Py_ssize_t from;
    int index;
    (void)self;
    if (!PyArg_ParseTuple(args, "sn:set_large", &name, &from) || routine_index(name, &index) < 0)
        return NULL;
    if (from < 0)
        return PyErr_Format(PyExc_ValueError, "set_large: from_bytes must be >= 0, got %zd", from);
    large_routine = index;
    large_from = (size_t)from;
    Py_RETURN_NONE;
}

static PyObject *large(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return Py_BuildValue("(sn)", routines[large_routine].name, (Py_ssize_t)large_from);
}

static PyMethodDef methods[] = {
    {"copy", (PyCFunction)(void (*)(void))copy, METH_VARARGS | METH_KEYWORDS,
     "copy(dst, dst_offset, src, stream_min=STREAM_MIN, routine=None)\n--\n\n"
     "dst[dst_offset:dst_offset + len(src)] = src (contiguous buffers, not overlapping): `routine`\n"
     "(one of ROUTINES) from stream_min up if given, else the routine large() names from its size up."},
    {"copy_many_in", (PyCFunction)(void (*)(void))copy_many_in, METH_VARARGS | METH_KEYWORDS,
     "copy_many_in(buf, offsets, addresses, sizes, routine=None)\n--\n\n"
     "buf[offsets[i]:offsets[i] + sizes[i]] = the sizes[i] bytes at address addresses[i], for every i\n"
     "(every range is checked before anything is copied)."},
    {"copy_many_out", (PyCFunction)(void (*)(void))copy_many_out, METH_VARARGS | METH_KEYWORDS,
     "copy_many_out(buf, offsets, addresses, sizes, routine=None)\n--\n\n"
     "the sizes[i] bytes at address addresses[i] = buf[offsets[i]:offsets[i] + sizes[i]], for every i\n"
     "(every range is checked before anything is copied)."},
    {"copy_many_between", (PyCFunction)(void (*)(void))copy_many_between, METH_VARARGS | METH_KEYWORDS,
     "copy_many_between(dst_addresses, src_addresses, sizes, routine=None)\n--\n\n"
     "the sizes[i] bytes at src_addresses[i] to dst_addresses[i], for every i (addresses the caller checked)."},
    {"set_large", set_large, METH_VARARGS,
     "set_large(routine, from_bytes)\n--\n\nCopies of from_bytes or more that name no routine use `routine`."},
    {"large", large, METH_NOARGS, "large() -> (routine, from_bytes)\n--\n\nWhat set_large set (memcpy, STREAM_MIN at import)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "ecd._copy",
    .m_doc = "Bytes copies into and out of pool memory: memcpy, or streaming stores where they win.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__copy(void)
{
    PyObject *names, *m;
#ifdef ECD_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("sse2")) {
        routines[R_NT_SSE2].fn = nt_sse2;
        routines[R_NT_SSE2_PF].fn = nt_sse2_pf;
    }
    if (__builtin_cpu_supports("avx2")) {
        routines[R_NT_AVX2].fn = nt_avx2;
        routines[R_NT_AVX2_PF].fn = nt_avx2_pf;
    }
#endif
    PyObject *list = PyList_New(0);
    for (int r = 0; list != NULL && r < N_ROUTINES; r++) {
        PyObject *name = routines[r].fn ? PyUnicode_FromString(routines[r].name) : NULL;
        if (routines[r].fn && (name == NULL || PyList_Append(list, name) < 0))
            Py_CLEAR(list);
        Py_XDECREF(name);
    }
    names = list ? PyList_AsTuple(list) : NULL;
    Py_XDECREF(list);
    if (names == NULL)
        return NULL;
    if ((m = PyModule_Create(&module)) == NULL || PyModule_AddObject(m, "ROUTINES", names) < 0) {
        Py_DECREF(names);
        Py_XDECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "STREAM_MIN", STREAM_MIN_DEFAULT) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
