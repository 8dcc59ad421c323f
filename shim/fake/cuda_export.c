/*
 * cuGetExportTable: the driver's private tables NVIDIA's CUDA runtime asks for by UUID before it
 * does anything else. Each table is an array of pointers; most start with their own size in bytes.
 * What the runtime calls in them, as documented publicly by projects that reimplement the driver
 * (ZLUDA's "dark API" notes) and checked here against libcudart 12.9 and 13.0:
 *
 *   runtime interface        1 load a module from a __fatBinC_Wrapper_t, 2 a device's primary context
 *                            (without retaining it), 6 / 8 module loads with extra arguments (the
 *                            fatbin wrapper or the fatbin itself), 7 a notification, 12 load the
 *                            JIT compilers
 *   tools callback hooks     2 / 6 hand out buffers the runtime fills with its callback state
 *   tools TLS                its size only
 *   context-local storage    0 put (key, value, destructor), 1 delete, 2 get: per-context values;
 *                            the destructors run when the context goes (reset, destroy, last release)
 *   context create bypass    1 cuCtxCreate_v2
 *   device extended          5 an extended attribute query, 13 a per-device flag (0)
 *   context checks           2 check a context (0: nothing to report), 3 (0)
 *   integrity check          1: for a request version ending in 0 or 1 a fixed answer; otherwise a
 *                            keyed MD2 (HMAC, RFC 2104 over RFC 1319) of the driver version, the
 *                            request's version and time, the calling process and thread, the tables'
 *                            addresses and every device's UUID and PCI location, as publicly
 *                            described. libcudart 12.9 and 13.0 ask with their own version (12090,
 *                            13000: the fixed answers) and, in these tests, did not refuse a wrong one.
 *
 * A slot nobody documented answers CUDA_ERROR_NOT_SUPPORTED and says which slot it was (on stderr
 * with GPUSLICE_FAKE_TRACE=1), so an unexpected call is visible instead of a crash.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fake_cuda.h"
#include "fake_module.h"

typedef void (*cls_dtor)(CUcontext, void *, void *);

/* ---------------------------------------------------------------- context-local storage */

typedef struct cls_entry {
    CUcontext ctx;
    void *key, *value;
    cls_dtor dtor;
    struct cls_entry *next;
} cls_entry;

static cls_entry *cls_head;
static pthread_mutex_t cls_lock = PTHREAD_MUTEX_INITIALIZER;

static CUresult ctx_or_current(CUcontext *ctx)
{
    if (*ctx) return CUDA_SUCCESS;
    *ctx = (CUcontext)current_ctx;
    return *ctx ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

static CUresult cls_put(CUcontext ctx, void *key, void *value, cls_dtor dtor)
{
    CUresult rc = ctx_or_current(&ctx);
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&cls_lock);
    for (cls_entry *e = cls_head; e; e = e->next)
        if (e->ctx == ctx && e->key == key) {
            e->value = value;
            e->dtor = dtor;
            pthread_mutex_unlock(&cls_lock);
            return CUDA_SUCCESS;
        }
    cls_entry *e = malloc(sizeof(*e));
    if (!e) {
        pthread_mutex_unlock(&cls_lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *e = (cls_entry){ctx, key, value, dtor, cls_head};
    cls_head = e;
    pthread_mutex_unlock(&cls_lock);
    return CUDA_SUCCESS;
}

static CUresult cls_delete(CUcontext ctx, void *key)
{
    CUresult rc = ctx_or_current(&ctx);
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&cls_lock);
    for (cls_entry **pp = &cls_head; *pp; pp = &(*pp)->next)
        if ((*pp)->ctx == ctx && (*pp)->key == key) {
            cls_entry *e = *pp;
            *pp = e->next;
            free(e);
            break;
        }
    pthread_mutex_unlock(&cls_lock);
    return CUDA_SUCCESS;
}

static CUresult cls_get(void **value, CUcontext ctx, void *key)
{
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = ctx_or_current(&ctx);
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&cls_lock);
    for (cls_entry *e = cls_head; e; e = e->next)
        if (e->ctx == ctx && e->key == key) {
            *value = e->value;
            pthread_mutex_unlock(&cls_lock);
            return CUDA_SUCCESS;
        }
    pthread_mutex_unlock(&cls_lock);
    return CUDA_ERROR_INVALID_HANDLE;
}

void fake_cls_context_gone(CUcontext ctx)
{
    cls_entry *gone = NULL;
    pthread_mutex_lock(&cls_lock);
    for (cls_entry **pp = &cls_head; *pp;) {
        cls_entry *e = *pp;
        if (e->ctx == ctx) {
            *pp = e->next;
            e->next = gone;
            gone = e;
        } else {
            pp = &e->next;
        }
    }
    pthread_mutex_unlock(&cls_lock);
    while (gone) { /* destructors run outside the lock: they may call back into the driver */
        cls_entry *next = gone->next;
        if (gone->dtor) gone->dtor(ctx, gone->key, gone->value);
        free(gone);
        gone = next;
    }
}

/* ---------------------------------------------------------------- keyed MD2 (RFC 1319, RFC 2104) */

static const unsigned char md2_s[256] = {
    41,  46,  67,  201, 162, 216, 124, 1,   61,  54,  84,  161, 236, 240, 6,   19,  98,  167, 5,   243, 192, 199,
    115, 140, 152, 147, 43,  217, 188, 76,  130, 202, 30,  155, 87,  60,  253, 212, 224, 22,  103, 66,  111, 24,
    138, 23,  229, 18,  190, 78,  196, 214, 218, 158, 222, 73,  160, 251, 245, 142, 187, 47,  238, 122, 169, 104,
    121, 145, 21,  178, 7,   63,  148, 194, 16,  137, 11,  34,  95,  33,  128, 127, 93,  154, 90,  144, 50,  39,
    53,  62,  204, 231, 191, 247, 151, 3,   255, 25,  48,  179, 72,  165, 181, 209, 215, 94,  146, 42,  172, 86,
    170, 198, 79,  184, 56,  210, 150, 164, 125, 182, 118, 252, 107, 226, 156, 116, 4,   241, 69,  157, 112, 89,
    100, 113, 135, 32,  134, 91,  207, 101, 230, 45,  168, 2,   27,  96,  37,  173, 174, 176, 185, 246, 28,  70,
    97,  105, 52,  64,  126, 15,  85,  71,  163, 35,  221, 81,  175, 58,  195, 92,  249, 206, 186, 197, 234, 38,
    44,  83,  13,  110, 133, 40,  132, 9,   211, 223, 205, 244, 65,  129, 77,  82,  106, 220, 55,  200, 108, 193,
    171, 250, 36,  225, 123, 8,   12,  189, 177, 74,  120, 136, 149, 139, 227, 99,  232, 109, 233, 203, 213, 254,
    59,  0,   29,  57,  242, 239, 183, 14,  102, 88,  208, 228, 166, 119, 114, 248, 235, 117, 75,  10,  49,  68,
    80,  180, 143, 237, 31,  26,  219, 153, 141, 51,  159, 17,  131, 20};

typedef struct {
    unsigned char x[48], c[16], buf[16];
    unsigned n;
} md2_ctx;

static void md2_block(md2_ctx *m, const unsigned char *b)
{
    unsigned char l = m->c[15];
    for (int j = 0; j < 16; j++) {
        m->x[16 + j] = b[j];
        m->x[32 + j] = m->x[j] ^ b[j];
        l = m->c[j] ^= md2_s[b[j] ^ l];
    }
    unsigned t = 0;
    for (int j = 0; j < 18; j++) {
        for (int k = 0; k < 48; k++) t = m->x[k] ^= md2_s[t];
        t = (t + (unsigned)j) & 0xff;
    }
}

static void md2_init(md2_ctx *m)
{
    memset(m, 0, sizeof(*m));
}

static void md2_update(md2_ctx *m, const void *data, size_t len)
{
    const unsigned char *p = data;
    while (len--) {
        m->buf[m->n++] = *p++;
        if (m->n == 16) {
            md2_block(m, m->buf);
            m->n = 0;
        }
    }
}

static void md2_final(md2_ctx *m, unsigned char out[16])
{
    unsigned char pad[16];
    unsigned k = 16 - m->n;
    memset(pad, (int)k, k);
    md2_update(m, pad, k);
    unsigned char c[16];
    memcpy(c, m->c, 16);
    md2_update(m, c, 16);
    memcpy(out, m->x, 16);
}

/* Exposed for the self-test (tests/shim/test_cudart.py checks RFC 1319's vectors through it). */
FAKE_EXPORT void gpuslice_fake_md2(const void *data, size_t len, unsigned char out[16])
{
    md2_ctx m;
    md2_init(&m);
    md2_update(&m, data, len);
    md2_final(&m, out);
}

/* The key both sides use (one MD2 block). */
static const unsigned char integrity_key[16] = {0x14, 0x6a, 0xdd, 0xae, 0x53, 0xa9, 0xa7, 0x52,
                                                0xaa, 0x08, 0x41, 0x36, 0x0b, 0xf5, 0x5a, 0x9f};

/* Starts one half of an HMAC over MD2: the key XORed with `pad` (0x36 inner, 0x5c outer). */
static void md2_keyed(md2_ctx *m, unsigned char pad)
{
    unsigned char k[16];
    for (int i = 0; i < 16; i++) k[i] = integrity_key[i] ^ pad;
    md2_init(m);
    md2_update(m, k, 16);
}

/* ---------------------------------------------------------------- the tables */

static CUresult dark_unknown(const char *table, int slot)
{
    const char *t = getenv("GPUSLICE_FAKE_TRACE");
    if (t && t[0] == '1') fprintf(stderr, "fake NVIDIA driver: export table %s slot %d called (not modeled)\n", table, slot);
    return CUDA_ERROR_NOT_SUPPORTED;
}

#define UNKNOWN_SLOT(table, slot)                                                                                      \
    static CUresult unknown_##table##_##slot(void)                                                                     \
    {                                                                                                                  \
        return dark_unknown(#table, slot);                                                                             \
    }

typedef struct {
    int magic, version;
    const void *data;
    void *filename_or_fatbins;
} fatbinc_wrapper;

static CUresult rt_module_from_wrapper(CUmodule *module, const fatbinc_wrapper *w)
{
    if (!module || !w) return CUDA_ERROR_INVALID_VALUE;
    if ((unsigned)w->magic != 0x466243B1u) return CUDA_ERROR_INVALID_IMAGE;
    return fake_module_load(module, w->data, FAKE_LOAD_RUNTIME);
}

static CUresult rt_primary_ctx(CUcontext *pctx, CUdevice dev)
{
    CHECK_INIT();
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    *pctx = (CUcontext)&primary_ctx[dev];
    return CUDA_SUCCESS;
}

static CUresult rt_module_from_wrapper_ext(CUmodule *module, const fatbinc_wrapper *w, void *a3, void *a4, unsigned a5)
{
    (void)a3;
    (void)a4;
    (void)a5;
    return rt_module_from_wrapper(module, w);
}

static void rt_notify(size_t arg)
{
    (void)arg;
}

static CUresult rt_module_from_fatbin_ext(const void *fatbin, CUmodule *module, void *a3, void *a4, unsigned a5)
{
    (void)a3;
    (void)a4;
    (void)a5;
    if (!module || !fatbin) return CUDA_ERROR_INVALID_VALUE;
    return fake_module_load(module, fatbin, FAKE_LOAD_RUNTIME);
}

static CUresult rt_load_compilers(void)
{
    return CUDA_SUCCESS;
}

UNKNOWN_SLOT(runtime, 3)
UNKNOWN_SLOT(runtime, 4)
UNKNOWN_SLOT(runtime, 5)
UNKNOWN_SLOT(runtime, 9)
UNKNOWN_SLOT(runtime, 10)
UNKNOWN_SLOT(runtime, 11)

static const void *runtime_table[13] = {
    (void *)(13 * sizeof(void *)),  (void *)rt_module_from_wrapper, (void *)rt_primary_ctx,
    (void *)unknown_runtime_3,      (void *)unknown_runtime_4,      (void *)unknown_runtime_5,
    (void *)rt_module_from_wrapper_ext, (void *)rt_notify,          (void *)rt_module_from_fatbin_ext,
    (void *)unknown_runtime_9,      (void *)unknown_runtime_10,     (void *)unknown_runtime_11,
    (void *)rt_load_compilers,
};

/* The runtime keeps its callback state in these; their contents are the runtime's business. */
static uint64_t hooks_buffer1[1024], hooks_buffer2[14];

static void hooks_buffer_1(void **ptr, size_t *size)
{
    *ptr = hooks_buffer1;
    *size = 1024;
}

static void hooks_buffer_2(void **ptr, size_t *size)
{
    *ptr = hooks_buffer2;
    *size = 14;
}

UNKNOWN_SLOT(hooks, 1)
UNKNOWN_SLOT(hooks, 3)
UNKNOWN_SLOT(hooks, 4)
UNKNOWN_SLOT(hooks, 5)

static const void *hooks_table[7] = {
    (void *)(7 * sizeof(void *)), (void *)unknown_hooks_1, (void *)hooks_buffer_1, (void *)unknown_hooks_3,
    (void *)unknown_hooks_4,      (void *)unknown_hooks_5, (void *)hooks_buffer_2,
};

/* Tools TLS: its size; its slots are undocumented (cuBLASLt 12.8 calls slot 2 before a heuristic
 * query: an answer, not a NULL to jump through). */
UNKNOWN_SLOT(tools_tls, 1)
UNKNOWN_SLOT(tools_tls, 2)
UNKNOWN_SLOT(tools_tls, 3)
static const void *tools_tls_table[4] = {(void *)(4 * sizeof(void *)), (void *)unknown_tools_tls_1,
                                         (void *)unknown_tools_tls_2, (void *)unknown_tools_tls_3};

UNKNOWN_SLOT(cls, 3)
static const void *cls_table[4] = {(void *)cls_put, (void *)cls_delete, (void *)cls_get, (void *)unknown_cls_3};

static CUresult bypass_ctx_create(CUcontext *pctx, unsigned flags, CUdevice dev)
{
    return cuCtxCreate_v2(pctx, flags, dev);
}

static const void *ctx_bypass_table[2] = {(void *)(2 * sizeof(void *)), (void *)bypass_ctx_create};

UNKNOWN_SLOT(heap, 1)
UNKNOWN_SLOT(heap, 2)
static const void *heap_table[3] = {(void *)(3 * sizeof(void *)), (void *)unknown_heap_1, (void *)unknown_heap_2};

static CUresult devext_attribute(CUdevice dev, unsigned attribute, int unknown, size_t result[2])
{
    (void)unknown;
    CHECK_INIT();
    if (!result) return CUDA_ERROR_INVALID_VALUE;
    int v = 0;
    CUresult rc = cuDeviceGetAttribute(&v, (CUdevice_attribute)attribute, dev);
    if (rc != CUDA_SUCCESS) return rc;
    result[0] = (size_t)(unsigned)v;
    result[1] = 0;
    return CUDA_SUCCESS;
}

static CUresult devext_flag(unsigned char *result, CUdevice dev)
{
    CHECK_INIT();
    if (!result) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    *result = 0;
    return CUDA_SUCCESS;
}

#define DEVEXT_UNKNOWN(X) X(1) X(2) X(3) X(4) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(14) X(15) X(16) X(17) X(18) \
    X(19) X(20) X(21) X(22) X(23) X(24) X(25)
#define DEVEXT_SLOT(n) UNKNOWN_SLOT(device_ext, n)
DEVEXT_UNKNOWN(DEVEXT_SLOT)

static const void *devext_table[26] = {
    (void *)(26 * sizeof(void *)), (void *)unknown_device_ext_1,  (void *)unknown_device_ext_2,
    (void *)unknown_device_ext_3,  (void *)unknown_device_ext_4,  (void *)devext_attribute,
    (void *)unknown_device_ext_6,  (void *)unknown_device_ext_7,  (void *)unknown_device_ext_8,
    (void *)unknown_device_ext_9,  (void *)unknown_device_ext_10, (void *)unknown_device_ext_11,
    (void *)unknown_device_ext_12, (void *)devext_flag,           (void *)unknown_device_ext_14,
    (void *)unknown_device_ext_15, (void *)unknown_device_ext_16, (void *)unknown_device_ext_17,
    (void *)unknown_device_ext_18, (void *)unknown_device_ext_19, (void *)unknown_device_ext_20,
    (void *)unknown_device_ext_21, (void *)unknown_device_ext_22, (void *)unknown_device_ext_23,
    (void *)unknown_device_ext_24, (void *)unknown_device_ext_25,
};

static CUresult ctxcheck_context(CUcontext ctx, unsigned *result1, const void **result2)
{
    (void)ctx;
    (void)result2;
    if (result1) *result1 = 0;
    return CUDA_SUCCESS;
}

static unsigned ctxcheck_3(void)
{
    return 0;
}

UNKNOWN_SLOT(ctx_checks, 1)
static const void *ctx_checks_table[4] = {(void *)(4 * sizeof(void *)), (void *)unknown_ctx_checks_1,
                                          (void *)ctxcheck_context, (void *)ctxcheck_3};

static CUresult integrity_check(unsigned version, uint64_t unix_seconds, uint64_t result[2]);
UNKNOWN_SLOT(integrity, 2)
static const void *integrity_table[3] = {(void *)(3 * sizeof(void *)), (void *)integrity_check,
                                         (void *)unknown_integrity_2};

static CUresult integrity_check(unsigned version, uint64_t unix_seconds, uint64_t result[2])
{
    CHECK_INIT();
    if (!result) return CUDA_ERROR_INVALID_VALUE;
    /* Two request versions have fixed answers. */
    if (version % 10 == 0 || version % 10 == 1) {
        result[0] = version % 10 == 0 ? 0x3341181C03CB675Cull : 0x1841181C03CB675Cull;
        result[1] = 0x8ED383AA1F4CD1E8ull;
        return CUDA_SUCCESS;
    }
    struct {
        uint32_t driver_version, version, pid, tid;
        const void *runtime_table, *integrity_table, *check_fn;
        uint64_t unix_seconds;
    } msg = {(uint32_t)sys()->cuda_driver_version,
             version,
             (uint32_t)getpid(),
             (uint32_t)pthread_self(),
             runtime_table,
             integrity_table,
             integrity_table[1],
             unix_seconds};
    unsigned char inner[16];
    md2_ctx m;
    md2_keyed(&m, 0x36);
    md2_update(&m, &msg, sizeof(msg));
    for (int d = 0; d < sys()->count; d++) {
        const fake_gpu *g = &sys()->gpus[d];
        struct {
            unsigned char uuid[16];
            int32_t domain, bus, device;
        } dev = {{0}, (int32_t)g->pci_domain, (int32_t)g->pci_bus, (int32_t)g->pci_device};
        memcpy(dev.uuid, g->uuid_bytes, 16);
        md2_update(&m, &dev, sizeof(dev));
    }
    md2_final(&m, inner);
    md2_keyed(&m, 0x5c);
    md2_update(&m, inner, 16);
    unsigned char out[16];
    md2_final(&m, out);
    memcpy(result, out, 16);
    return CUDA_SUCCESS;
}

typedef struct {
    unsigned char uuid[16];
    const void *table;
    const char *name;
} export_table;

static const export_table tables[] = {
    {{0x6b, 0xd5, 0xfb, 0x6c, 0x5b, 0xf4, 0xe7, 0x4a, 0x89, 0x87, 0xd9, 0x39, 0x12, 0xfd, 0x9d, 0xf9},
     runtime_table, "runtime interface"},
    {{0x42, 0xd8, 0x5a, 0x81, 0x23, 0xf6, 0xcb, 0x47, 0x82, 0x98, 0xf6, 0xe7, 0x8a, 0x3a, 0xec, 0xdc},
     tools_tls_table, "tools TLS"},
    {{0xa0, 0x94, 0x79, 0x8c, 0x2e, 0x74, 0x2e, 0x74, 0x93, 0xf2, 0x08, 0x00, 0x20, 0x0c, 0x0a, 0x66},
     hooks_table, "tools callback hooks"},
    {{0xc6, 0x93, 0x33, 0x6e, 0x11, 0x21, 0xdf, 0x11, 0xa8, 0xc3, 0x68, 0xf3, 0x55, 0xd8, 0x95, 0x93},
     cls_table, "context-local storage"},
    {{0x0c, 0xa5, 0x0b, 0x8c, 0x10, 0x04, 0x92, 0x9a, 0x89, 0xa7, 0xd0, 0xdf, 0x10, 0xe7, 0x72, 0x86},
     ctx_bypass_table, "context create bypass"},
    {{0x19, 0x5b, 0xcb, 0xf4, 0xd6, 0x7d, 0x02, 0x4a, 0xac, 0xc5, 0x1d, 0x29, 0xce, 0xa6, 0x31, 0xae},
     heap_table, "heap access"},
    {{0xb1, 0x05, 0x41, 0xe1, 0xf7, 0xc7, 0xc7, 0x4a, 0x9f, 0x64, 0xf2, 0x23, 0xbe, 0x99, 0xf1, 0xe2},
     devext_table, "device extended"},
    {{0xd4, 0x08, 0x20, 0x55, 0xbd, 0xe6, 0x70, 0x4b, 0x8d, 0x34, 0xba, 0x12, 0x3c, 0x66, 0xe1, 0xf2},
     integrity_table, "integrity check"},
    {{0x26, 0x3e, 0x88, 0x60, 0x7c, 0xd2, 0x61, 0x43, 0x92, 0xf6, 0xbb, 0xd5, 0x00, 0x6d, 0xfa, 0x7e},
     ctx_checks_table, "context checks"},
};

FAKE_EXPORT CUresult cuGetExportTable(const void **table, const CUuuid *id)
{
    if (!table || !id) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof(tables) / sizeof(tables[0]); i++)
        if (memcmp(tables[i].uuid, id->bytes, 16) == 0) {
            *table = tables[i].table;
            return CUDA_SUCCESS;
        }
    const char *t = getenv("GPUSLICE_FAKE_TRACE");
    if (t && t[0] == '1') {
        fprintf(stderr, "fake NVIDIA driver: cuGetExportTable of an unknown table ");
        for (int i = 0; i < 16; i++) fprintf(stderr, "%02x", (unsigned char)id->bytes[i]);
        fprintf(stderr, "\n");
    }
    *table = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}
