/*
 * Modules, libraries, functions and launches of the fake libcuda.so.1. Images are chosen as the
 * driver chooses (fatbin.c): a cubin for the device's architecture, else PTX the simulated driver
 * can JIT, else CUDA_ERROR_NO_BINARY_FOR_GPU / CUDA_ERROR_UNSUPPORTED_PTX_VERSION. Functions are
 * found by name in the chosen cubin's symbol table or PTX's .entry list. Kernels are not executed:
 * each launch occupies the device on the timeline NVML utilization is computed from, for the first
 * rule of GPUSLICE_FAKE_KERNEL_TIME that names the function (a fixed time, or a time per thread of
 * the launch's grid), else the module's duration (a PTX comment `// gpuslice-fake: duration_us=N`),
 * else 10 us. Real compiled kernels (nvcc, NVRTC) carry no comment, so the variable is how a test
 * gives them the time a GPU would take.
 * A module's variables (__device__, __constant__) get device memory of the module's context at the
 * load, charged to the card like an allocation and initialized from the image; the unload, or the
 * context's destruction, frees it.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fnmatch.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "fake_cuda.h"
#include "fake_health.h"
#include "fake_module.h"
#include "../src/fatbin.h"
#include "../src/image_globals.h"

#define DEFAULT_DURATION_NS 10000ull
#define DURATION_TAG "gpuslice-fake: duration_us="
#define MAX_ENTRIES 256

static uint64_t duration_of(const void *image, size_t size)
{
    const char *tag = memmem(image, size, DURATION_TAG, strlen(DURATION_TAG));
    if (!tag) return DEFAULT_DURATION_NS;
    return strtoull(tag + strlen(DURATION_TAG), NULL, 10) * 1000ull;
}

/* GPUSLICE_FAKE_KERNEL_TIME: `GLOB=TIME[,GLOB=TIME...]`, TIME a number with ns, us, ms or s, or
 * that per thread (`2ns/thread`: times blocks times threads per block of each launch). GLOB is an
 * fnmatch(3) pattern over the function's name as the image names it (a C++ kernel's mangled name).
 * Read at the first cuInit; a spec that cannot be read makes cuInit fail rather than time kernels
 * other than the test asked. */
#define KERNEL_TIME_ENV "GPUSLICE_FAKE_KERNEL_TIME"
#define MAX_TIME_RULES 32
struct time_rule {
    char glob[256];
    uint64_t ns;
    int per_thread;
};
static struct time_rule time_rules[MAX_TIME_RULES];
static int ntime_rules;
static int time_rules_bad;
static pthread_once_t time_rules_once = PTHREAD_ONCE_INIT;

static int parse_time(const char *v, size_t len, uint64_t *ns, int *per_thread)
{
    char buf[64];
    if (len == 0 || len >= sizeof(buf)) return -1;
    memcpy(buf, v, len);
    buf[len] = '\0';
    char *end = NULL;
    errno = 0;
    double n = strtod(buf, &end);
    if (errno || end == buf || !(n >= 0) || n > 1e12) return -1;
    static const struct {
        const char *unit;
        double ns;
    } units[] = {{"ns", 1}, {"us", 1e3}, {"ms", 1e6}, {"s", 1e9}};
    for (size_t i = 0; i < sizeof(units) / sizeof(units[0]); i++) {
        size_t ul = strlen(units[i].unit);
        if (strncmp(end, units[i].unit, ul) != 0) continue;
        const char *rest = end + ul;
        if (*rest && strcmp(rest, "/thread") != 0) continue;
        *per_thread = *rest != '\0';
        *ns = (uint64_t)(n * units[i].ns + 0.5);
        return 0;
    }
    return -1;
}

static void load_time_rules(void)
{
    const char *spec = getenv(KERNEL_TIME_ENV);
    if (!spec) return;
    const char *p = spec;
    while (*p) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        while (len && (*p == ' ' || *p == '\t')) p++, len--;
        while (len && (p[len - 1] == ' ' || p[len - 1] == '\t')) len--;
        if (len) {
            const char *eq = memrchr(p, '=', len);
            struct time_rule r = {0};
            size_t glen = eq ? (size_t)(eq - p) : 0;
            if (!eq || glen == 0 || glen >= sizeof(r.glob) || ntime_rules == MAX_TIME_RULES ||
                parse_time(eq + 1, len - glen - 1, &r.ns, &r.per_thread) != 0) {
                fprintf(stderr,
                        "fake NVIDIA driver: %s: cannot read \"%.*s\" (want GLOB=TIME, TIME like 200ms, 50us or "
                        "2ns/thread; at most %d rules)\n",
                        KERNEL_TIME_ENV, (int)len, p, MAX_TIME_RULES);
                time_rules_bad = 1;
                return;
            }
            memcpy(r.glob, p, glen);
            time_rules[ntime_rules++] = r;
        }
        if (!comma) break;
        p = comma + 1;
    }
}

int fake_kernel_time_spec_ok(void)
{
    pthread_once(&time_rules_once, load_time_rules);
    return !time_rules_bad;
}

/* The rule that times a function of that name, or -1 (its module's duration). */
static int time_rule_of(const char *name)
{
    pthread_once(&time_rules_once, load_time_rules);
    for (int i = 0; i < ntime_rules; i++)
        if (fnmatch(time_rules[i].glob, name, 0) == 0) return i;
    return -1;
}

uint64_t fake_kernel_duration(const struct CUfunc_st *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                              unsigned by, unsigned bz)
{
    if (f->time_rule < 0) return f->duration_ns;
    const struct time_rule *r = &time_rules[f->time_rule];
    if (!r->per_thread) return r->ns;
    uint64_t threads = (uint64_t)gx * gy * gz * bx * by * bz;
    return threads && r->ns > UINT64_MAX / threads ? UINT64_MAX : r->ns * threads;
}

/* Chooses what runs from a fatbin: the entry's data (decompressed) in *image, its kind in *kind. */
static CUresult pick_from_fatbin(const void *fatbin, const fake_gpu *g, void **image, size_t *size, int *kind)
{
    fatbin_entry entries[MAX_ENTRIES];
    unsigned isa[MAX_ENTRIES];
    int n = fatbin_entries(fatbin, entries, MAX_ENTRIES);
    if (n < 0) return CUDA_ERROR_INVALID_IMAGE;
    if (n > MAX_ENTRIES) n = MAX_ENTRIES;
    void *data[MAX_ENTRIES] = {0};
    for (int i = 0; i < n; i++) { /* a PTX entry's ISA version decides whether this driver can JIT it */
        isa[i] = 0;
        if (entries[i].kind != FATBIN_PTX || entries[i].compression == FATBIN_ZSTD) continue;
        data[i] = malloc(entries[i].raw_size + 1);
        if (!data[i] || fatbin_entry_data(&entries[i], data[i], entries[i].raw_size) != 0) {
            free(data[i]);
            data[i] = NULL;
            continue;
        }
        ((char *)data[i])[entries[i].raw_size] = '\0';
        isa[i] = ptx_isa_version(data[i], entries[i].raw_size);
    }
    int why = 0;
    int pick = fatbin_pick(entries, isa, n, g->cc_major, g->cc_minor, ptx_isa_max_for_driver(sys()->cuda_driver_version),
                           &why);
    CUresult rc = CUDA_SUCCESS;
    if (pick < 0) {
        rc = why == 222 ? CUDA_ERROR_UNSUPPORTED_PTX_VERSION : CUDA_ERROR_NO_BINARY_FOR_GPU;
    } else if (data[pick]) {
        *image = data[pick];
        data[pick] = NULL;
        *size = entries[pick].raw_size;
        *kind = entries[pick].kind;
    } else if (entries[pick].compression == FATBIN_ZSTD) { /* runs, but its functions cannot be listed here */
        *image = NULL;
        *size = 0;
        *kind = 0;
    } else {
        *image = malloc(entries[pick].raw_size + 1);
        if (!*image) rc = CUDA_ERROR_OUT_OF_MEMORY;
        else if (fatbin_entry_data(&entries[pick], *image, entries[pick].raw_size) != 0) rc = CUDA_ERROR_INVALID_IMAGE;
        else {
            ((char *)*image)[entries[pick].raw_size] = '\0';
            *size = entries[pick].raw_size;
            *kind = entries[pick].kind;
        }
        if (rc != CUDA_SUCCESS) free(*image);
    }
    for (int i = 0; i < n; i++) free(data[i]);
    return rc;
}


static void module_free(CUmodule m);

/* ---------------------------------------------------------------- module variables */

/* The module's variables from its image, laid out one after another at their alignment. */
static CUresult module_vars_list(struct CUmod_st *m, image_global **out, int *count, uint64_t *bytes)
{
    *out = NULL;
    *count = 0;
    *bytes = 0;
    int n = 0;
    if (m->kind == FATBIN_CUBIN) n = cubin_globals(m->image, m->size, NULL, 0);
    else if (m->kind == FATBIN_PTX) n = ptx_globals(m->image, m->size, NULL, 0);
    if (n < 0) return CUDA_ERROR_INVALID_IMAGE;
    if (n == 0) return CUDA_SUCCESS;
    image_global *g = calloc((size_t)n, sizeof(*g));
    if (!g) return CUDA_ERROR_OUT_OF_MEMORY;
    if (m->kind == FATBIN_CUBIN) n = cubin_globals(m->image, m->size, g, n);
    else n = ptx_globals(m->image, m->size, g, n);
    m->globals = calloc((size_t)n, sizeof(*m->globals));
    if (!m->globals) {
        free(g);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    uint64_t at = 0;
    for (int i = 0; i < n; i++) {
        at = image_global_place(at, &g[i]);
        m->globals[i].name = strdup(g[i].name);
        if (!m->globals[i].name) {
            free(g);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        m->globals[i].offset = at;
        m->globals[i].size = g[i].size;
        m->globals[i].managed = g[i].managed;
        m->nglobals = (unsigned)i + 1;
        at += g[i].size;
    }
    *out = g;
    *count = n;
    *bytes = at;
    return CUDA_SUCCESS;
}

/* Device memory for the module's variables in the current context, with their initial values. */
static CUresult module_vars_back(struct CUmod_st *m, const image_global *g, int n)
{
    if (m->data_bytes == 0) return CUDA_SUCCESS;
    CUresult rc = charge(m->dev, m->data_bytes);
    if (rc != CUDA_SUCCESS) return rc;
    void *p = mmap(NULL, rounded(m->data_bytes), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (p == MAP_FAILED) {
        uncharge(m->dev, m->data_bytes);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    for (int i = 0; g && i < n; i++) {
        unsigned char *dst = (unsigned char *)p + m->globals[i].offset;
        if (g[i].init) memcpy(dst, g[i].init, g[i].size);
        else if (g[i].ptx_init) ptx_global_init(&g[i], dst);
    }
    m->data = (uint64_t)(uintptr_t)p;
    track_alloc(&(alloc){m->data, m->data_bytes, m->dev, K_MODULE, -1, (uintptr_t)m, current_ctx, 0, NULL});
    return CUDA_SUCCESS;
}

static CUresult module_vars_load(struct CUmod_st *m)
{
    image_global *g = NULL;
    int n = 0;
    CUresult rc = module_vars_list(m, &g, &n, &m->data_bytes);
    if (rc == CUDA_SUCCESS) rc = module_vars_back(m, g, n);
    free(g);
    return rc;
}

/* 1 if the module's memory is still there: a context's destruction frees its modules' memory. */
static int module_vars_live(struct CUmod_st *m)
{
    alloc a;
    return m->data && find_alloc(m->data, &a) && a.ptr == m->data && a.kind == K_MODULE &&
           a.shared_fd_handle == (uintptr_t)m;
}

static void module_vars_free(struct CUmod_st *m)
{
    if (!module_vars_live(m)) return; /* gone with its context */
    alloc *a = untrack(m->data);
    if (a) device_free(a);
    m->data = 0;
}

CUresult fake_module_load(CUmodule *module, const void *image, int how)
{
    (void)how;
    CHECK_INIT();
    if (!module || !image) return CUDA_ERROR_INVALID_VALUE;
    if (!current_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    const fake_gpu *g = &sys()->gpus[current_ctx->dev];
    unsigned dev_arch = (unsigned)(g->cc_major * 10 + g->cc_minor);
    void *chosen = NULL;
    size_t size = 0;
    int kind = 0;
    CUresult rc = CUDA_SUCCESS;
    switch (image_type_of(image)) {
    case IMAGE_FATBIN:
    case IMAGE_WRAPPER: rc = pick_from_fatbin(fatbin_of(image), g, &chosen, &size, &kind); break;
    case IMAGE_CUBIN: {
        const unsigned char *p = image;
        uint64_t shoff, end;
        uint16_t shnum;
        memcpy(&shoff, p + 0x28, 8);
        memcpy(&shnum, p + 0x3c, 2);
        end = shoff + (uint64_t)shnum * 64; /* the section headers come last in a cubin */
        int specific = 0;
        unsigned a = cubin_arch(image, (size_t)end, &specific);
        if (a == 0) return CUDA_ERROR_INVALID_IMAGE;
        if (specific ? a != dev_arch : a / 10 != (unsigned)g->cc_major || a > dev_arch)
            return CUDA_ERROR_NO_BINARY_FOR_GPU;
        chosen = malloc((size_t)end);
        if (!chosen) return CUDA_ERROR_OUT_OF_MEMORY;
        memcpy(chosen, image, (size_t)end);
        size = (size_t)end;
        kind = FATBIN_CUBIN;
        break;
    }
    case IMAGE_PTX: {
        size = strlen(image);
        unsigned isa = ptx_isa_version(image, size), target = ptx_target(image, size);
        if (isa > ptx_isa_max_for_driver(sys()->cuda_driver_version)) return CUDA_ERROR_UNSUPPORTED_PTX_VERSION;
        if (target > dev_arch) return CUDA_ERROR_NO_BINARY_FOR_GPU;
        chosen = malloc(size + 1);
        if (!chosen) return CUDA_ERROR_OUT_OF_MEMORY;
        memcpy(chosen, image, size + 1);
        kind = FATBIN_PTX;
        break;
    }
    default: return CUDA_ERROR_INVALID_IMAGE;
    }
    if (rc != CUDA_SUCCESS) return rc;
    struct CUmod_st *m = calloc(1, sizeof(*m));
    if (!m) {
        free(chosen);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    m->magic = MOD_MAGIC;
    m->image = chosen;
    m->size = size;
    m->kind = kind;
    m->dev = current_ctx->dev;
    m->duration_ns = chosen ? duration_of(chosen, size) : DEFAULT_DURATION_NS;
    rc = module_vars_load(m);
    if (rc != CUDA_SUCCESS) {
        module_free(m);
        return rc;
    }
    *module = m;
    return CUDA_SUCCESS;
}

static int valid_module(CUmodule m)
{
    return m && m->magic == MOD_MAGIC;
}

/* 1 if the module has a kernel of that name (or its functions cannot be listed). */
static int module_has(CUmodule m, const char *name)
{
    if (m->kind == FATBIN_CUBIN) return cubin_has_function(m->image, m->size, name) == 1;
    if (m->kind == FATBIN_PTX) return ptx_has_entry(m->image, m->size, name) != 0;
    return 1;
}

static void module_free(CUmodule m)
{
    m->magic = 0;
    module_vars_free(m);
    for (unsigned i = 0; i < m->nglobals; i++) free(m->globals[i].name);
    free(m->globals);
    free(m->image);
    free(m);
}

FAKE_EXPORT CUresult cuModuleLoadData(CUmodule *module, const void *image)
{
    return fake_module_load(module, image, FAKE_LOAD_DRIVER);
}

FAKE_EXPORT CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int n, CUjit_option *options,
                                        void **values)
{
    (void)n;
    (void)options;
    (void)values;
    return fake_module_load(module, image, FAKE_LOAD_DRIVER);
}

/* The driver tells the image's kind from its bytes, whichever call hands it over: a plain cubin or
 * PTX loads here as through cuModuleLoadData (XLA loads every kernel it compiles, a cubin, this way). */
FAKE_EXPORT CUresult cuModuleLoadFatBinary(CUmodule *module, const void *fatbin)
{
    return fake_module_load(module, fatbin, FAKE_LOAD_DRIVER);
}

static void *read_whole_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *buf = NULL;
    size_t cap = 0, n = 0;
    for (;;) {
        if (n + 4096 + 1 > cap) {
            cap = cap ? cap * 2 : 65536;
            char *nb = realloc(buf, cap);
            if (!nb) {
                free(buf);
                fclose(f);
                return NULL;
            }
            buf = nb;
        }
        size_t r = fread(buf + n, 1, 4096, f);
        n += r;
        if (r < 4096) break;
    }
    fclose(f);
    buf[n] = '\0';
    *len = n;
    return buf;
}

FAKE_EXPORT CUresult cuModuleLoad(CUmodule *module, const char *fname)
{
    CHECK_INIT();
    if (!module || !fname) return CUDA_ERROR_INVALID_VALUE;
    size_t len = 0;
    void *data = read_whole_file(fname, &len);
    if (!data) return CUDA_ERROR_FILE_NOT_FOUND;
    CUresult rc = fake_module_load(module, data, FAKE_LOAD_DRIVER);
    free(data);
    return rc;
}

FAKE_EXPORT CUresult cuModuleUnload(CUmodule m)
{
    CHECK_INIT();
    if (!valid_module(m)) return CUDA_ERROR_INVALID_HANDLE;
    module_free(m);
    return CUDA_SUCCESS;
}

static CUresult new_function(struct CUfunc_st **out, CUmodule m, const char *name, int magic)
{
    struct CUfunc_st *fn = calloc(1, sizeof(*fn));
    if (!fn) return CUDA_ERROR_OUT_OF_MEMORY;
    fn->magic = magic;
    fn->duration_ns = m->duration_ns;
    fn->time_rule = time_rule_of(name);
    fn->dev = m->dev;
    fn->mod = m;
    snprintf(fn->name, sizeof(fn->name), "%s", name);
    *out = fn;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name)
{
    CHECK_INIT();
    if (!f || !name) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_module(m)) return CUDA_ERROR_INVALID_HANDLE;
    if (!module_has(m, name)) return CUDA_ERROR_NOT_FOUND;
    return new_function(f, m, name, FUNC_MAGIC);
}

/* A variable by name: its address and size (either pointer may be NULL, not both). A library's module
 * whose context went gets its memory again in the current one, as a library is loaded into each
 * context that uses it; a plain module's is gone with its context. */
static CUresult module_global(CUdeviceptr *dptr, size_t *bytes, CUmodule m, const char *name, int managed)
{
    if (!name || (!dptr && !bytes)) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_module(m)) return CUDA_ERROR_INVALID_HANDLE;
    unsigned i = 0;
    while (i < m->nglobals && (strcmp(m->globals[i].name, name) != 0 || m->globals[i].managed != managed)) i++;
    if (i == m->nglobals) return CUDA_ERROR_NOT_FOUND;
    if (!module_vars_live(m)) {
        if (!m->library) return CUDA_ERROR_CONTEXT_IS_DESTROYED;
        if (!current_ctx) return CUDA_ERROR_INVALID_CONTEXT;
        image_global *g = NULL;
        int n = 0;
        if (m->kind == FATBIN_CUBIN) n = cubin_globals(m->image, m->size, NULL, 0);
        else n = ptx_globals(m->image, m->size, NULL, 0);
        if (n > 0 && (g = calloc((size_t)n, sizeof(*g))) != NULL) {
            if (m->kind == FATBIN_CUBIN) n = cubin_globals(m->image, m->size, g, n);
            else n = ptx_globals(m->image, m->size, g, n);
        }
        if (n > (int)m->nglobals) n = (int)m->nglobals;
        m->dev = current_ctx->dev;
        m->data = 0;
        CUresult rc = module_vars_back(m, g, g ? n : 0);
        free(g);
        if (rc != CUDA_SUCCESS) return rc;
    }
    if (dptr) *dptr = m->data + m->globals[i].offset;
    if (bytes) *bytes = m->globals[i].size;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuModuleGetGlobal_v2(CUdeviceptr *dptr, size_t *bytes, CUmodule m, const char *name)
{
    CHECK_INIT();
    return module_global(dptr, bytes, m, name, 0);
}

FAKE_EXPORT CUresult cuModuleGetLoadingMode(CUmoduleLoadingMode *mode)
{
    if (!mode) return CUDA_ERROR_INVALID_VALUE;
    *mode = CU_MODULE_LAZY_LOADING;
    return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------- libraries and kernels */

#define LIB_MAGIC 0x4c494231
struct CUlib_st {
    int magic;
    struct CUmod_st *mod;
};

FAKE_EXPORT CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jit_options,
                                       void **jit_values, unsigned int njit, CUlibraryOption *lib_options,
                                       void **lib_values, unsigned int nlib)
{
    (void)jit_options;
    (void)jit_values;
    (void)njit;
    (void)lib_options;
    (void)lib_values;
    (void)nlib;
    CHECK_INIT();
    if (!library || !code) return CUDA_ERROR_INVALID_VALUE;
    /* A library is context-independent; the double loads it for the current device (or device 0). */
    struct CUctx_st *saved = current_ctx;
    if (!current_ctx) current_ctx = &primary_ctx[0];
    CUmodule m = NULL;
    CUresult rc = fake_module_load(&m, code, FAKE_LOAD_DRIVER);
    current_ctx = saved;
    if (rc != CUDA_SUCCESS) return rc;
    struct CUlib_st *l = calloc(1, sizeof(*l));
    if (!l) {
        module_free(m);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    l->magic = LIB_MAGIC;
    l->mod = m;
    m->library = 1;
    *library = l;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuLibraryLoadFromFile(CUlibrary *library, const char *fname, CUjit_option *jo, void **jv,
                                           unsigned int nj, CUlibraryOption *lo, void **lv, unsigned int nl)
{
    CHECK_INIT();
    if (!library || !fname) return CUDA_ERROR_INVALID_VALUE;
    size_t len = 0;
    void *data = read_whole_file(fname, &len);
    if (!data) return CUDA_ERROR_FILE_NOT_FOUND;
    CUresult rc = cuLibraryLoadData(library, data, jo, jv, nj, lo, lv, nl);
    free(data);
    return rc;
}

static int valid_library(CUlibrary l)
{
    return l && l->magic == LIB_MAGIC;
}

FAKE_EXPORT CUresult cuLibraryUnload(CUlibrary l)
{
    CHECK_INIT();
    if (!valid_library(l)) return CUDA_ERROR_INVALID_HANDLE;
    l->magic = 0;
    module_free(l->mod);
    free(l);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuLibraryGetKernel(CUkernel *k, CUlibrary l, const char *name)
{
    CHECK_INIT();
    if (!k || !name) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_library(l)) return CUDA_ERROR_INVALID_HANDLE;
    if (!module_has(l->mod, name)) return CUDA_ERROR_NOT_FOUND;
    return new_function((struct CUfunc_st **)k, l->mod, name, KERNEL_MAGIC);
}

FAKE_EXPORT CUresult cuLibraryGetModule(CUmodule *m, CUlibrary l)
{
    CHECK_INIT();
    if (!m) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_library(l)) return CUDA_ERROR_INVALID_HANDLE;
    *m = l->mod;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuLibraryGetGlobal(CUdeviceptr *dptr, size_t *bytes, CUlibrary l, const char *name)
{
    CHECK_INIT();
    if (!valid_library(l)) return CUDA_ERROR_INVALID_HANDLE;
    return module_global(dptr, bytes, l->mod, name, 0);
}

/* __managed__ variables (PTX `.attribute(.managed)`); a cubin's are not told apart here. */
FAKE_EXPORT CUresult cuLibraryGetManaged(CUdeviceptr *dptr, size_t *bytes, CUlibrary l, const char *name)
{
    CHECK_INIT();
    if (!valid_library(l)) return CUDA_ERROR_INVALID_HANDLE;
    return module_global(dptr, bytes, l->mod, name, 1);
}

FAKE_EXPORT CUresult cuKernelGetFunction(CUfunction *f, CUkernel k)
{
    CHECK_INIT();
    if (!f) return CUDA_ERROR_INVALID_VALUE;
    struct CUfunc_st *kk = (struct CUfunc_st *)k;
    if (!kk || kk->magic != KERNEL_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    if (!current_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    CUresult rc = new_function(f, kk->mod, kk->name, FUNC_MAGIC);
    if (rc == CUDA_SUCCESS) (*f)->dev = current_ctx->dev;
    return rc;
}

FAKE_EXPORT CUresult cuKernelGetName(const char **name, CUkernel k)
{
    struct CUfunc_st *kk = (struct CUfunc_st *)k;
    if (!name) return CUDA_ERROR_INVALID_VALUE;
    if (!kk || kk->magic != KERNEL_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    *name = kk->name;
    return CUDA_SUCCESS;
}

static int valid_function(CUfunction f)
{
    return f && (f->magic == FUNC_MAGIC || f->magic == KERNEL_MAGIC);
}

FAKE_EXPORT CUresult cuFuncGetName(const char **name, CUfunction f)
{
    if (!name) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_function(f)) return CUDA_ERROR_INVALID_HANDLE;
    *name = f->name;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuFuncGetModule(CUmodule *m, CUfunction f)
{
    if (!m) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_function(f)) return CUDA_ERROR_INVALID_HANDLE;
    *m = f->mod;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuFuncIsLoaded(CUfunctionLoadingState *state, CUfunction f)
{
    if (!state) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_function(f)) return CUDA_ERROR_INVALID_HANDLE;
    *state = CU_FUNCTION_LOADING_STATE_LOADED;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuFuncLoad(CUfunction f)
{
    return valid_function(f) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

static CUresult func_attribute(int *v, CUfunction_attribute a, CUfunction f)
{
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_function(f)) return CUDA_ERROR_INVALID_HANDLE;
    const fake_gpu *g = &sys()->gpus[f->dev >= 0 && f->dev < sys()->count ? f->dev : 0];
    int arch = g->cc_major * 10 + g->cc_minor;
    switch (a) {
    case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *v = 1024; break;
    case CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES:
    case CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES:
    case CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES: *v = 0; break;
    case CU_FUNC_ATTRIBUTE_NUM_REGS: *v = 16; break;
    case CU_FUNC_ATTRIBUTE_PTX_VERSION:
    case CU_FUNC_ATTRIBUTE_BINARY_VERSION: *v = arch; break;
    case CU_FUNC_ATTRIBUTE_CACHE_MODE_CA: *v = 0; break;
    case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: *v = 49152; break;
    case CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT: *v = -1; break;
    default: *v = 0; break;
    }
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuFuncGetAttribute(int *v, CUfunction_attribute a, CUfunction f)
{
    CHECK_INIT();
    return func_attribute(v, a, f);
}

FAKE_EXPORT CUresult cuKernelGetAttribute(int *v, CUfunction_attribute a, CUkernel k, CUdevice dev)
{
    (void)dev;
    CHECK_INIT();
    return func_attribute(v, a, (CUfunction)k);
}

FAKE_EXPORT CUresult cuFuncSetAttribute(CUfunction f, CUfunction_attribute a, int v)
{
    (void)a;
    (void)v;
    CHECK_INIT();
    return valid_function(f) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

FAKE_EXPORT CUresult cuKernelSetAttribute(CUfunction_attribute a, int v, CUkernel k, CUdevice dev)
{
    (void)dev;
    return cuFuncSetAttribute((CUfunction)k, a, v);
}

FAKE_EXPORT CUresult cuFuncSetCacheConfig(CUfunction f, CUfunc_cache c)
{
    (void)c;
    CHECK_INIT();
    return valid_function(f) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

FAKE_EXPORT CUresult cuKernelSetCacheConfig(CUkernel k, CUfunc_cache c, CUdevice dev)
{
    (void)dev;
    return cuFuncSetCacheConfig((CUfunction)k, c);
}

FAKE_EXPORT CUresult cuFuncSetSharedMemConfig(CUfunction f, CUsharedconfig c)
{
    (void)c;
    CHECK_INIT();
    return valid_function(f) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

/* ---------------------------------------------------------------- occupancy */

static int blocks_per_sm(CUfunction f, int block, size_t smem)
{
    int dev = f && f->dev >= 0 && f->dev < sys()->count ? f->dev : 0;
    int threads = 0, blocks = 0, shared = 0;
    cuDeviceGetAttribute(&threads, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, dev);
    cuDeviceGetAttribute(&blocks, CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR, dev);
    cuDeviceGetAttribute(&shared, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR, dev);
    if (block <= 0) return 0;
    int warps = (block + 31) / 32;
    int n = threads / (warps * 32);
    if (n > blocks) n = blocks;
    if (smem && (int)(shared / (int)smem) < n) n = shared / (int)smem;
    return n;
}

FAKE_EXPORT CUresult cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int *n, CUfunction f, int block, size_t smem,
                                                                          unsigned int flags)
{
    (void)flags;
    CHECK_INIT();
    if (!n) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_function(f)) return CUDA_ERROR_INVALID_HANDLE;
    *n = blocks_per_sm(f, block, smem);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *n, CUfunction f, int block, size_t smem)
{
    return cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(n, f, block, smem, 0);
}

FAKE_EXPORT CUresult cuOccupancyMaxPotentialBlockSizeWithFlags(int *grid, int *block, CUfunction f,
                                                               CUoccupancyB2DSize smem_fn, size_t smem, int limit,
                                                               unsigned int flags)
{
    (void)flags;
    CHECK_INIT();
    if (!grid || !block) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_function(f)) return CUDA_ERROR_INVALID_HANDLE;
    int b = limit > 0 && limit < 1024 ? limit : 1024;
    size_t s = smem_fn ? smem_fn(b) : smem;
    int sms = sys()->gpus[f->dev >= 0 && f->dev < sys()->count ? f->dev : 0].multiprocessors;
    *block = b;
    *grid = blocks_per_sm(f, b, s) * sms;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuOccupancyMaxPotentialBlockSize(int *grid, int *block, CUfunction f, CUoccupancyB2DSize smem_fn,
                                                      size_t smem, int limit)
{
    return cuOccupancyMaxPotentialBlockSizeWithFlags(grid, block, f, smem_fn, smem, limit, 0);
}

FAKE_EXPORT CUresult cuOccupancyAvailableDynamicSMemPerBlock(size_t *smem, CUfunction f, int blocks, int block)
{
    (void)block;
    CHECK_INIT();
    if (!smem || blocks <= 0) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_function(f)) return CUDA_ERROR_INVALID_HANDLE;
    int optin = 0;
    cuDeviceGetAttribute(&optin, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, f->dev);
    *smem = (size_t)optin;
    return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------- launches */

CUresult occupy(CUdevice dev, uint64_t duration_ns)
{
    if (fake_health_cuda_error(dev)) return (CUresult)fake_health_cuda_error(dev); /* a failed card */
    uint64_t end = fake_record_busy(sys()->state[dev], duration_ns);
    uint64_t now = fake_now_ns();
    /* The launch queue is full: block like the driver, until the device is booked no more than
     * QUEUE_AHEAD_NS ahead, but never past this kernel's own start: a kernel longer than that returns
     * once it begins, and the stream's synchronization waits for the rest (as a driver's launch of
     * one long kernel returns at once). */
    uint64_t release = end - QUEUE_AHEAD_NS, start = end - duration_ns;
    if (duration_ns > QUEUE_AHEAD_NS) release = start;
    if (end > now + QUEUE_AHEAD_NS && release > now) {
        uint64_t wait = release - now;
        struct timespec ts = {.tv_sec = (time_t)(wait / 1000000000ull), .tv_nsec = (long)(wait % 1000000000ull)};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
        }
    }
    return CUDA_SUCCESS;
}

/* A launch into a capturing stream becomes a kernel node of the capture's graph instead of running. */
static CUresult launch_on(CUstream s, CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                          unsigned bz)
{
    CHECK_INIT();
    if (!current_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    if (!valid_function(f)) return CUDA_ERROR_INVALID_HANDLE;
    if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0 || (uint64_t)bx * by * bz > 1024)
        return CUDA_ERROR_INVALID_VALUE;
    if (s && s != CU_STREAM_LEGACY && s != CU_STREAM_PER_THREAD && s->capturing) {
        struct CUgraphNode_st *n = fake_graph_node(s->capture_graph, CU_GRAPH_NODE_TYPE_KERNEL);
        if (!n) return CUDA_ERROR_OUT_OF_MEMORY;
        n->duration_ns = fake_kernel_duration(f, gx, gy, gz, bx, by, bz);
        s->capture_graph->duration_ns += n->duration_ns;
        return CUDA_SUCCESS;
    }
    return occupy(current_ctx->dev, fake_kernel_duration(f, gx, gy, gz, bx, by, bz));
}

FAKE_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                                    unsigned int by, unsigned int bz, unsigned int shmem, CUstream s, void **params,
                                    void **extra)
{
    (void)shmem;
    (void)params;
    (void)extra;
    return launch_on(s, f, gx, gy, gz, bx, by, bz);
}

FAKE_EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                         unsigned int bx, unsigned int by, unsigned int bz, unsigned int shmem,
                                         CUstream s, void **params, void **extra)
{
    return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra);
}

FAKE_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **params, void **extra)
{
    (void)params;
    (void)extra;
    if (!c) return CUDA_ERROR_INVALID_VALUE;
    return launch_on(c->hStream, f, c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX, c->blockDimY, c->blockDimZ);
}

FAKE_EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *c, CUfunction f, void **params, void **extra)
{
    return cuLaunchKernelEx(c, f, params, extra);
}

FAKE_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                               unsigned int bx, unsigned int by, unsigned int bz, unsigned int shmem,
                                               CUstream s, void **params)
{
    (void)shmem;
    (void)params;
    return launch_on(s, f, gx, gy, gz, bx, by, bz);
}

FAKE_EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                                    unsigned int bx, unsigned int by, unsigned int bz,
                                                    unsigned int shmem, CUstream s, void **params)
{
    return cuLaunchCooperativeKernel(f, gx, gy, gz, bx, by, bz, shmem, s, params);
}

/* A host function runs once the stream's earlier work is done: here, when the device is idle. */
FAKE_EXPORT CUresult cuLaunchHostFunc(CUstream s, CUhostFn fn, void *data)
{
    CHECK_INIT();
    if (!fn) return CUDA_ERROR_INVALID_VALUE;
    CUdevice dev;
    CUresult rc = stream_dev(s, &dev);
    if (rc != CUDA_SUCCESS) return rc;
    wait_device_idle(dev);
    fn(data);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuLaunchHostFunc_ptsz(CUstream s, CUhostFn fn, void *data)
{
    return cuLaunchHostFunc(s, fn, data);
}

/* ---------------------------------------------------------------- listing a module's kernels */

/* The n-th `.entry` of a PTX image (n from 0): its name in name[256], the text after it in *rest; 0 if none. */
static int ptx_entry(const char *ptx, size_t size, unsigned n, char *name, const char **rest)
{
    const char *s = ptx, *end = ptx + size;
    unsigned i = 0;
    while (s < end) {
        const char *e = memmem(s, (size_t)(end - s), ".entry", 6);
        if (!e) return 0;
        s = e + 6;
        if ((e > ptx && e[-1] != ' ' && e[-1] != '\t' && e[-1] != '\n') || (s < end && *s != ' ' && *s != '\t'))
            continue;
        while (s < end && (*s == ' ' || *s == '\t')) s++;
        size_t len = 0;
        while (s + len < end && len < 255 && (s[len] == '_' || s[len] == '$' || (s[len] >= '0' && s[len] <= '9') ||
                                              ((s[len] | 32) >= 'a' && (s[len] | 32) <= 'z')))
            len++;
        if (len == 0 || i++ != n) continue;
        memcpy(name, s, len);
        name[len] = '\0';
        if (rest) *rest = s + len;
        return 1;
    }
    return 0;
}

/* How many kernels a module lists: PTX .entry directives. A cubin's are not listed here. */
static CUresult module_count(CUmodule m, unsigned *count)
{
    if (m->kind != FATBIN_PTX) return CUDA_ERROR_NOT_SUPPORTED; /* see shim/README.md: PTX modules only */
    char name[256];
    unsigned n = 0;
    while (ptx_entry(m->image, m->size, n, name, NULL)) n++;
    *count = n;
    return CUDA_SUCCESS;
}

static CUresult module_list(CUmodule m, struct CUfunc_st **out, unsigned n, int magic)
{
    unsigned have = 0;
    CUresult rc = module_count(m, &have);
    if (rc != CUDA_SUCCESS) return rc;
    if (n > have) return CUDA_ERROR_INVALID_VALUE;
    char name[256];
    for (unsigned i = 0; i < n; i++) {
        ptx_entry(m->image, m->size, i, name, NULL);
        if ((rc = new_function(&out[i], m, name, magic)) != CUDA_SUCCESS) return rc;
    }
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuModuleGetFunctionCount(unsigned int *count, CUmodule m)
{
    CHECK_INIT();
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_module(m)) return CUDA_ERROR_INVALID_HANDLE;
    return module_count(m, count);
}

FAKE_EXPORT CUresult cuModuleEnumerateFunctions(CUfunction *functions, unsigned int n, CUmodule m)
{
    CHECK_INIT();
    if (!functions) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_module(m)) return CUDA_ERROR_INVALID_HANDLE;
    return module_list(m, functions, n, FUNC_MAGIC);
}

FAKE_EXPORT CUresult cuLibraryGetKernelCount(unsigned int *count, CUlibrary l)
{
    CHECK_INIT();
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_library(l)) return CUDA_ERROR_INVALID_HANDLE;
    return module_count(l->mod, count);
}

FAKE_EXPORT CUresult cuLibraryEnumerateKernels(CUkernel *kernels, unsigned int n, CUlibrary l)
{
    CHECK_INIT();
    if (!kernels) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_library(l)) return CUDA_ERROR_INVALID_HANDLE;
    return module_list(l->mod, (struct CUfunc_st **)kernels, n, KERNEL_MAGIC);
}

/* A kernel's i-th parameter from its PTX .entry list: `.param .u64 p` (by type), `.param .align A .b8
 * p[N]` (N bytes aligned to A); offsets aligned to each parameter's alignment, as the ABI lays them. */
static CUresult param_info(CUfunction f, size_t index, size_t *offset, size_t *size)
{
    if (!offset && !size) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_function(f)) return CUDA_ERROR_INVALID_HANDLE;
    if (!f->mod || f->mod->kind != FATBIN_PTX) return CUDA_ERROR_NOT_SUPPORTED; /* PTX modules only */
    char name[256];
    const char *rest = NULL;
    unsigned n = 0;
    while (ptx_entry(f->mod->image, f->mod->size, n, name, &rest) && strcmp(name, f->name) != 0) n++;
    if (strcmp(name, f->name) != 0 || !rest) return CUDA_ERROR_NOT_FOUND;
    const char *end = (const char *)f->mod->image + f->mod->size;
    while (rest < end && *rest != '(' && *rest != '{') rest++;
    if (rest >= end || *rest != '(') return CUDA_ERROR_INVALID_VALUE; /* no parameters */
    const char *close = memchr(rest, ')', (size_t)(end - rest));
    if (!close) return CUDA_ERROR_INVALID_IMAGE;
    size_t off = 0, i = 0;
    for (const char *p = rest; p < close;) {
        const char *q = memmem(p, (size_t)(close - p), ".param", 6);
        if (!q) break;
        const char *next = memchr(q, ',', (size_t)(close - q));
        if (!next) next = close;
        size_t len = (size_t)(next - q), sz = 0, align = 0;
        char decl[512];
        snprintf(decl, sizeof(decl), "%.*s", (int)(len < sizeof(decl) ? len : sizeof(decl) - 1), q);
        const char *al = strstr(decl, ".align"), *br = strchr(decl, '[');
        if (al) align = strtoul(al + 6, NULL, 10);
        if (br) sz = strtoul(br + 1, NULL, 10);
        if (!br) {
            if (strstr(decl, "64")) sz = 8;
            else if (strstr(decl, "32")) sz = 4;
            else if (strstr(decl, "16")) sz = 2;
            else sz = 1;
        }
        if (!align) align = br ? 1 : sz;
        off = (off + align - 1) / align * align;
        if (i == index) {
            if (offset) *offset = off;
            if (size) *size = sz;
            return CUDA_SUCCESS;
        }
        off += sz;
        i++;
        p = next;
    }
    return CUDA_ERROR_INVALID_VALUE; /* index past the last parameter */
}

FAKE_EXPORT CUresult cuFuncGetParamInfo(CUfunction f, size_t index, size_t *offset, size_t *size)
{
    CHECK_INIT();
    return param_info(f, index, offset, size);
}

FAKE_EXPORT CUresult cuKernelGetParamInfo(CUkernel k, size_t index, size_t *offset, size_t *size)
{
    CHECK_INIT();
    return param_info((CUfunction)k, index, offset, size);
}

/* ---------------------------------------------------------------- the JIT linker, the profiler */

/* A link joins PTX inputs into one PTX image (the inputs' text, in order): the double's cuModuleLoadData
 * loads it and lists every input's kernels. A real driver links into a cubin; other input kinds
 * (cubin, fatbin, object, library) are not joined here. */
#define LINK_MAGIC 0x4c4e4b31
struct CUlinkState_st {
    int magic;
    char *text;
    size_t len;
};

FAKE_EXPORT CUresult cuLinkCreate_v2(unsigned int n, CUjit_option *options, void **values, CUlinkState *out)
{
    (void)n;
    (void)options;
    (void)values;
    CHECK_INIT();
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    if (!current_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    struct CUlinkState_st *s = calloc(1, sizeof(*s));
    if (!s) return CUDA_ERROR_OUT_OF_MEMORY;
    s->magic = LINK_MAGIC;
    *out = s;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuLinkAddData_v2(CUlinkState s, CUjitInputType type, void *data, size_t size, const char *name,
                                      unsigned int n, CUjit_option *options, void **values)
{
    (void)name;
    (void)n;
    (void)options;
    (void)values;
    CHECK_INIT();
    if (!s || s->magic != LINK_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    if (!data || !size) return CUDA_ERROR_INVALID_VALUE;
    if (type != CU_JIT_INPUT_PTX) {
        const char *t = getenv("GPUSLICE_FAKE_TRACE");
        if (t && t[0] == '1') fprintf(stderr, "fake NVIDIA driver: cuLinkAddData joins PTX inputs only\n");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    size_t len = strnlen(data, size);
    if (!ptx_isa_version(data, len)) return CUDA_ERROR_INVALID_PTX;
    if (ptx_isa_version(data, len) > ptx_isa_max_for_driver(sys()->cuda_driver_version))
        return CUDA_ERROR_UNSUPPORTED_PTX_VERSION;
    char *grown = realloc(s->text, s->len + len + 2);
    if (!grown) return CUDA_ERROR_OUT_OF_MEMORY;
    memcpy(grown + s->len, data, len);
    s->len += len;
    grown[s->len++] = '\n';
    grown[s->len] = '\0';
    s->text = grown;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuLinkAddFile_v2(CUlinkState s, CUjitInputType type, const char *path, unsigned int n,
                                      CUjit_option *options, void **values)
{
    CHECK_INIT();
    if (!s || s->magic != LINK_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    if (!path) return CUDA_ERROR_INVALID_VALUE;
    size_t len = 0;
    void *data = read_whole_file(path, &len);
    if (!data) return CUDA_ERROR_FILE_NOT_FOUND;
    CUresult rc = len ? cuLinkAddData_v2(s, type, data, len, path, n, options, values) : CUDA_ERROR_INVALID_VALUE;
    free(data);
    return rc;
}

FAKE_EXPORT CUresult cuLinkComplete(CUlinkState s, void **image, size_t *size)
{
    CHECK_INIT();
    if (!s || s->magic != LINK_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    if (!image || !size) return CUDA_ERROR_INVALID_VALUE;
    if (!s->text) return CUDA_ERROR_INVALID_VALUE; /* nothing added */
    *image = s->text; /* owned by the link state, as the driver's output is */
    *size = s->len + 1;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuLinkDestroy(CUlinkState s)
{
    CHECK_INIT();
    if (!s || s->magic != LINK_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    s->magic = 0;
    free(s->text);
    free(s);
    return CUDA_SUCCESS;
}

/* With no profiler attached the driver answers success and records nothing. */
FAKE_EXPORT CUresult cuProfilerStart(void);
FAKE_EXPORT CUresult cuProfilerStart(void)
{
    CHECK_INIT();
    return current_ctx ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}
FAKE_EXPORT CUresult cuProfilerStop(void);
FAKE_EXPORT CUresult cuProfilerStop(void)
{
    CHECK_INIT();
    return current_ctx ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}
