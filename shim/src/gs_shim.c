/*
 * libgpuslice.so: CUDA driver API and NVML interception.
 *
 * The shim exports the driver's own symbol names, so a program linked against libcuda (or resolving
 * through the global scope) calls the shim first; it overrides dlsym() so handles obtained with
 * dlopen("libcuda.so.1") resolve to the shim too; and it rewrites what cuGetProcAddress(_v2) returns,
 * which is how the CUDA 12/13 runtime resolves every entry point. Real entry points are looked up
 * through the shim's own handle on libcuda.so.1 / libnvidia-ml.so.1, never via RTLD_NEXT.
 */
#define _GNU_SOURCE
#define NVML_NO_UNVERSIONED_FUNC_DEFS /* every versioned entry point under its own name */
#include "gs_shim.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda.h>
#include <nvml.h>

#include "gs_procs.h"
#include "gs_table.h"

/*
 * The config path, fixed at build time. It sits in a marked, fixed-size array so that
 * `gpuslice shim run` can write a private copy of this library pointing at another file (a tenant
 * cannot: in a container the library is injected read-only and /etc/ld.so.preload names it).
 * Layout: GS_CONFIG_MARKER, then a NUL-terminated path, NUL-padded to GS_CONFIG_SLOT bytes.
 */
#ifndef GS_DEFAULT_CONFIG_PATH
#define GS_DEFAULT_CONFIG_PATH "/etc/gpuslice/slice.conf"
#endif
#define GS_CONFIG_MARKER "@@GPUSLICE_CONFIG_PATH@@"
#define GS_CONFIG_SLOT 4096
__attribute__((used, aligned(64))) volatile char gs_config_slot[GS_CONFIG_SLOT] =
    GS_CONFIG_MARKER GS_DEFAULT_CONFIG_PATH;

_Atomic int gs_mode = GS_MODE_UNINIT;
gs_config gs_cfg;
gs_region gs_reg;
char gs_util_path[GS_PATH_MAX];

static gs_table tab_dptr;  /* device pointers: cuMemAlloc*, managed, async, pools, IPC opens */
static gs_table tab_vmm;   /* VMM handles held by the application -> gs_phys* */
static gs_table tab_map;   /* VMM mapping start addresses -> gs_vmap* */
static gs_table tab_array; /* CUarray and CUmipmappedArray handles */
static gs_table tab_pool;  /* pools created with a non-device location (their allocations are free) */
static gs_table tab_graph; /* graphs with memory alloc nodes -> their bytes */
static gs_table tab_gexec; /* executable graphs with memory -> bytes | GS_GEXEC_BACKED once launched */
static _Atomic int has_exports; /* this process exported memory for IPC: frees drop its export records */

static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER;

void gs_log(const char *fmt, ...)
{
    char buf[1024];
    int n = snprintf(buf, sizeof(buf), "gpuslice[%d]: ", (int)getpid());
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(buf + n, sizeof(buf) - (size_t)n - 1, fmt, ap);
    va_end(ap);
    size_t len = (size_t)n + (m < 0 ? 0 : (size_t)m);
    if (len > sizeof(buf) - 2) len = sizeof(buf) - 2;
    buf[len++] = '\n';
    (void)!write(2, buf, len);
}

/* ------------------------------------------------------------------------------------------------
 * Real entry points
 * ---------------------------------------------------------------------------------------------- */

typedef struct {
    const char *name;
    void *wrapper; /* NULL: looked up for the shim's own use, never substituted */
    void **real;
} gs_sym;

/* Every driver function the shim wraps. Legacy (v1) and per-thread-stream (_ptsz) variants are
 * listed too: each is a distinct entry point an application can reach. */
#define GS_CUDA_WRAPPED(X)                                                                               \
    X(cuMemAlloc) X(cuMemAlloc_v2) X(cuMemAllocPitch) X(cuMemAllocPitch_v2) X(cuMemAllocManaged)         \
    X(cuMemFree) X(cuMemFree_v2) X(cuMemAllocAsync) X(cuMemAllocAsync_ptsz) X(cuMemFreeAsync)            \
    X(cuMemFreeAsync_ptsz) X(cuMemPoolCreate) X(cuMemPoolDestroy) X(cuMemAllocFromPoolAsync)             \
    X(cuMemAllocFromPoolAsync_ptsz) X(cuMemCreate) X(cuMemRelease) X(cuMemMap) X(cuMemUnmap)               \
    X(cuMemRetainAllocationHandle) X(cuArrayCreate) X(cuArrayCreate_v2)   \
    X(cuArray3DCreate) X(cuArray3DCreate_v2) X(cuArrayDestroy) X(cuMipmappedArrayCreate) X(cuMipmappedArrayDestroy)         \
    X(cuIpcGetMemHandle) X(cuIpcOpenMemHandle) X(cuIpcOpenMemHandle_v2) X(cuIpcCloseMemHandle) X(cuMemGetInfo)                \
    X(cuMemGetInfo_v2) X(cuDeviceTotalMem) X(cuDeviceTotalMem_v2) X(cuCtxCreate) X(cuCtxCreate_v2)       \
    X(cuCtxCreate_v3) X(cuCtxCreate_v4) X(cuDevicePrimaryCtxRetain) X(cuCtxDestroy_v2)                 \
    X(cuDevicePrimaryCtxRelease) X(cuDevicePrimaryCtxRelease_v2) X(cuDevicePrimaryCtxReset)              \
    X(cuDevicePrimaryCtxReset_v2) X(cuLaunchKernel)                    \
    X(cuLaunchKernel_ptsz) X(cuLaunchKernelEx) X(cuLaunchKernelEx_ptsz) X(cuLaunchCooperativeKernel)     \
    X(cuLaunchCooperativeKernel_ptsz) X(cuGraphLaunch) X(cuGraphLaunch_ptsz) X(cuLaunch) X(cuLaunchGrid) \
    X(cuLaunchGridAsync) X(cuGetProcAddress) X(cuGetProcAddress_v2) X(cuCtxSetLimit) X(cuMemPoolTrimTo)           \
    X(cuMemPoolSetAttribute) X(cuGraphAddMemAllocNode) X(cuGraphInstantiateWithFlags)                      \
    X(cuGraphInstantiateWithParams) X(cuGraphExecDestroy) X(cuGraphDestroy) X(cuDeviceGraphMemTrim)        \
    X(cuImportExternalMemory) X(cuDestroyExternalMemory)

#define GS_CUDA_HELPERS(X)                                                                               \
    X(cuCtxGetDevice) X(cuDeviceGetCount) X(cuDeviceGetUuid) X(cuDeviceGetUuid_v2)                      \
    X(cuMemGetAddressRange_v2) X(cuCtxGetCurrent) X(cuDevicePrimaryCtxGetState) X(cuCtxGetLimit)          \
    X(cuDeviceGetAttribute) X(cuDeviceGetMemPool) X(cuMemPoolGetAttribute)

#define GS_NVML_WRAPPED(X)                                                                               \
    X(nvmlDeviceGetMemoryInfo) X(nvmlDeviceGetMemoryInfo_v2) X(nvmlDeviceGetComputeRunningProcesses)       \
    X(nvmlDeviceGetComputeRunningProcesses_v2) X(nvmlDeviceGetComputeRunningProcesses_v3)                  \
    X(nvmlDeviceGetGraphicsRunningProcesses) X(nvmlDeviceGetGraphicsRunningProcesses_v2)                   \
    X(nvmlDeviceGetGraphicsRunningProcesses_v3) X(nvmlDeviceGetProcessUtilization)                         \
    X(nvmlDeviceGetUtilizationRates)
#define GS_NVML_HELPERS(X)                                                                               \
    X(nvmlDeviceGetUUID) X(nvmlInit_v2) X(nvmlDeviceGetHandleByUUID) X(nvmlDeviceGetComputeRunningProcesses_v3)

#define GS_DECLARE_REAL(name) static __typeof__(&name) real_##name;
GS_CUDA_WRAPPED(GS_DECLARE_REAL)
GS_CUDA_HELPERS(GS_DECLARE_REAL)
GS_NVML_WRAPPED(GS_DECLARE_REAL)
GS_NVML_HELPERS(GS_DECLARE_REAL)

#define GS_SYM_WRAPPED(name) {#name, (void *)&name, (void **)&real_##name},
#define GS_SYM_HELPER(name) {#name, NULL, (void **)&real_##name},
static gs_sym cuda_syms[] = {GS_CUDA_WRAPPED(GS_SYM_WRAPPED) GS_CUDA_HELPERS(GS_SYM_HELPER)};
static gs_sym nvml_syms[] = {GS_NVML_WRAPPED(GS_SYM_WRAPPED) GS_NVML_HELPERS(GS_SYM_HELPER)};
#define GS_NSYMS(a) (sizeof(a) / sizeof((a)[0]))

typedef void *(*dlsym_fn)(void *, const char *);
static dlsym_fn real_dlsym;
static void *cuda_handle, *nvml_handle;
static _Atomic int cuda_ready, nvml_ready;
static pthread_mutex_t resolve_lock = PTHREAD_MUTEX_INITIALIZER;

/* dlsym runs inside sanitizer runtimes' own start-up, before their shadow memory exists: the code on
 * that path must not be instrumented. */
#define GS_NO_SANITIZE __attribute__((no_sanitize_address, no_sanitize_thread))

GS_NO_SANITIZE static void find_real_dlsym(void)
{
    if (real_dlsym) return;
    /* glibc >= 2.34 versions dlsym GLIBC_2.34; older ones GLIBC_2.2.5. */
    real_dlsym = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (!real_dlsym) real_dlsym = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
}

__attribute__((constructor)) static void gs_constructor(void)
{
    find_real_dlsym();
}

/* Resolves a library's real entry points once. With load=0 only an already-loaded library is used
 * (dlsym must not pull the driver into processes that merely look up a "cu" name). The loader is
 * called outside any lock of ours: dlopen/dlsym take the loader's lock, and a library constructor
 * running under it may itself call dlsym, so holding our lock across them could deadlock. */
#define GS_MAX_SYMS 128
static int resolve_lib(const char *soname, void **handle, gs_sym *syms, size_t n, _Atomic int *ready, int load)
{
    if (atomic_load_explicit(ready, memory_order_acquire)) return 0;
    find_real_dlsym();
    if (real_dlsym == NULL || n > GS_MAX_SYMS) return -1;
    void *h = dlopen(soname, RTLD_NOW | RTLD_LOCAL | (load ? 0 : RTLD_NOLOAD));
    if (h == NULL) return -1;
    void *found[GS_MAX_SYMS];
    for (size_t i = 0; i < n; i++) found[i] = real_dlsym(h, syms[i].name);
    pthread_mutex_lock(&resolve_lock);
    if (!atomic_load(ready)) {
        *handle = h;
        for (size_t i = 0; i < n; i++) *syms[i].real = found[i];
        atomic_store_explicit(ready, 1, memory_order_release);
    } else {
        dlclose(h); /* another thread published first; drop our extra reference */
    }
    pthread_mutex_unlock(&resolve_lock);
    return 0;
}

static inline int cuda_real(void)
{
    if (GS_LIKELY(atomic_load_explicit(&cuda_ready, memory_order_acquire))) return 0;
    return resolve_lib("libcuda.so.1", &cuda_handle, cuda_syms, GS_NSYMS(cuda_syms), &cuda_ready, 1);
}

static inline int nvml_real(void)
{
    if (GS_LIKELY(atomic_load_explicit(&nvml_ready, memory_order_acquire))) return 0;
    return resolve_lib("libnvidia-ml.so.1", &nvml_handle, nvml_syms, GS_NSYMS(nvml_syms), &nvml_ready, 1);
}

void *gs_real_nvml(const char *name)
{
    if (nvml_real() != 0) return NULL;
    return real_dlsym(nvml_handle, name);
}

/* Maps a real driver entry point to the shim's wrapper for it; anything else is returned as is. */
static void *substitute(void *fn, gs_sym *syms, size_t n)
{
    if (fn == NULL) return NULL;
    for (size_t i = 0; i < n; i++)
        if (syms[i].wrapper != NULL && *syms[i].real == fn) return syms[i].wrapper;
    return fn;
}

/* The shim's wrapper for an entry point named `name`, NULL when it wraps none by that name. */
static void *wrapper_named(const char *name, gs_sym *syms, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (syms[i].wrapper != NULL && strcmp(syms[i].name, name) == 0) return syms[i].wrapper;
    return NULL;
}

/* 1 when `base` names an entry point the shim wraps in some variant (cuMemAlloc: cuMemAlloc_v2, ...). */
static int wraps_base(const char *base)
{
    size_t n = strlen(base);
    for (size_t i = 0; i < GS_NSYMS(cuda_syms); i++) {
        const char *w = cuda_syms[i].name;
        if (cuda_syms[i].wrapper != NULL && strncmp(w, base, n) == 0 &&
            (w[n] == '\0' || (w[n] == '_' && (w[n + 1] == 'v' || strcmp(w + n, "_ptsz") == 0))))
            return 1;
    }
    return 0;
}

typedef struct {
    const char *base;
    int since;
    const char *fn, *ptsz;
} gs_proc;
#define GS_PROC(base, since, fn) {#base, since, #fn, NULL},
#define GS_PROC_PTSZ(base, since, fn, ptsz) {#base, since, #fn, #ptsz},
static const gs_proc procs[] = {GS_DRIVER_PROCS(GS_PROC, GS_PROC_PTSZ)};

/*
 * cuGetProcAddress handed out a pointer that is not the driver's exported symbol of any wrapped
 * variant (real drivers may return internal entry points). Decide by name which variant the caller
 * gets for (symbol, cudaVersion, flags) and return the shim's wrapper for it; a wrapped entry point
 * whose variant cannot be told is refused, never passed through unenforced.
 */
static CUresult procaddr_by_name(const char *symbol, void **pfn, int version, cuuint64_t flags)
{
    if (symbol == NULL || !wraps_base(symbol)) return CUDA_SUCCESS; /* nothing of ours: keep it */
    const gs_proc *best = NULL;
    for (size_t i = 0; i < sizeof(procs) / sizeof(procs[0]); i++)
        if (strcmp(procs[i].base, symbol) == 0 && procs[i].since <= version && (!best || procs[i].since > best->since))
            best = &procs[i];
    void *w = NULL;
    if (best != NULL) {
        const char *name = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) && best->ptsz ? best->ptsz : best->fn;
        w = wrapper_named(name, cuda_syms, GS_NSYMS(cuda_syms));
        if (w == NULL && !wraps_base(name)) return CUDA_SUCCESS; /* a variant the shim has no business with */
    }
    if (w == NULL) {
        gs_log("cuGetProcAddress(%s): the driver's entry point is unknown to the shim; refusing it", symbol);
        *pfn = NULL;
        return CUDA_ERROR_NOT_FOUND;
    }
    *pfn = w;
    return CUDA_SUCCESS;
}

/* A wrapped name that resolves to something other than the driver's own symbol comes from another
 * copy of the driver (a copied libcuda.so.1 opened by path, a bundled libnvidia-ml): the caller gets
 * the shim's wrapper, which calls the driver the shim enforces over, never the copy unwrapped. */
static void *dlsym_driver(void *handle, const char *symbol)
{
    void *fn = real_dlsym(handle, symbol);
    if (fn == NULL) return NULL;
    gs_sym *syms = symbol[0] == 'c' ? cuda_syms : nvml_syms;
    size_t n = symbol[0] == 'c' ? GS_NSYMS(cuda_syms) : GS_NSYMS(nvml_syms);
    void *w = wrapper_named(symbol, syms, n);
    if (w == NULL) return fn; /* not an entry point the shim wraps */
    if (fn == w) return fn;   /* the shim's own export */
    /* Load our driver if needed: the wrapper must have a real entry point to call. */
    if (symbol[0] == 'c') (void)resolve_lib("libcuda.so.1", &cuda_handle, cuda_syms, n, &cuda_ready, 1);
    else (void)resolve_lib("libnvidia-ml.so.1", &nvml_handle, nvml_syms, n, &nvml_ready, 1);
    return w;
}

/* Every other lookup is a tail call into the real dlsym, so glibc sees the application's return
 * address: RTLD_NEXT keeps meaning "after the caller", not "after the shim". */
GS_EXPORT GS_NO_SANITIZE void *dlsym(void *restrict handle, const char *restrict symbol)
{
    if (__builtin_expect(real_dlsym == NULL, 0)) find_real_dlsym();
    int driver_name = symbol[0] == 'c' ? symbol[1] == 'u'
                                       : symbol[0] == 'n' && symbol[1] == 'v' && symbol[2] == 'm' && symbol[3] == 'l';
    if (handle == RTLD_NEXT || !driver_name) return real_dlsym(handle, symbol);
    return dlsym_driver(handle, symbol);
}

/* ------------------------------------------------------------------------------------------------
 * Initialization: config, usage region, tables. Runs on the first intercepted call, not at load, so
 * that processes which never touch the GPU (a shell under /etc/ld.so.preload) pay nothing.
 * ---------------------------------------------------------------------------------------------- */

static _Atomic uint64_t ctx_charged; /* bit per device ordinal: context overhead charged */
static void gs_vmm_after_fork_child(void);
static void gs_ctx_after_fork_child(void);
static void gs_usage_after_fork_child(void);

/* A forked child owns none of its parent's driver objects, entry or locks: start it from scratch. */
static void after_fork_child(void)
{
    gs_region_after_fork_child(&gs_reg);
    gs_table_clear(&tab_dptr);
    gs_table_clear(&tab_vmm);
    gs_table_clear(&tab_map);
    gs_table_clear(&tab_array);
    gs_vmm_after_fork_child();
    atomic_store(&ctx_charged, 0);
    gs_ctx_after_fork_child();
    gs_usage_after_fork_child();
    pthread_mutex_init(&init_lock, NULL);
    pthread_mutex_init(&resolve_lock, NULL);
    gs_throttle_after_fork_child();
}

void gs_init_slow(void)
{
    pthread_mutex_lock(&init_lock);
    if (atomic_load(&gs_mode) != GS_MODE_UNINIT) {
        pthread_mutex_unlock(&init_lock);
        return;
    }
    char path[GS_CONFIG_SLOT];
    size_t off = sizeof(GS_CONFIG_MARKER) - 1, i = 0;
    for (; off + i < GS_CONFIG_SLOT - 1 && gs_config_slot[off + i] != '\0'; i++) path[i] = gs_config_slot[off + i];
    path[i] = '\0';
    /* Derived from the trusted config path, never from anything the tenant can write. */
    const char *slash = strrchr(path, '/');
    size_t dirlen = slash ? (size_t)(slash - path) : 0;
    if (dirlen + sizeof("/utilization") <= sizeof(gs_util_path)) {
        memcpy(gs_util_path, path, dirlen);
        memcpy(gs_util_path + dirlen, "/utilization", sizeof("/utilization"));
    }

    char err[512];
    int mode = GS_MODE_ACTIVE;
    if (gs_config_load(path, &gs_cfg, err, sizeof(err)) != 0) {
        gs_log("slice config %s is unusable (%s); this process gets no GPU memory (fail closed)", path, err);
        mode = GS_MODE_FAIL_CLOSED;
    } else if (gs_region_open(&gs_reg, &gs_cfg, err, sizeof(err)) != 0) {
        gs_log("%s; this process gets no GPU memory (fail closed)", err);
        mode = GS_MODE_FAIL_CLOSED;
    } else if (gs_table_init(&tab_dptr, 18) != 0 || gs_table_init(&tab_vmm, 14) != 0 || gs_table_init(&tab_map, 16) != 0 ||
               gs_table_init(&tab_array, 14) != 0 || gs_table_init(&tab_pool, 10) != 0 ||
               gs_table_init(&tab_graph, 10) != 0 || gs_table_init(&tab_gexec, 12) != 0) {
        gs_log("cannot map allocation tables; this process gets no GPU memory (fail closed)");
        mode = GS_MODE_FAIL_CLOSED;
    }
    if (mode != GS_MODE_ACTIVE || gs_cfg.compute_share >= 100) atomic_store(&gs_throttle_started, 1);
    pthread_atfork(NULL, NULL, after_fork_child);
    atomic_store_explicit(&gs_mode, mode, memory_order_release);
    pthread_mutex_unlock(&init_lock);
}

/* ------------------------------------------------------------------------------------------------
 * Which devices the slice covers: the one whose UUID is in the config. Memory on any other device
 * is refused while a limit is configured (the tenant holds no slice there).
 * ---------------------------------------------------------------------------------------------- */

#define GS_MAX_DEVICES 64
static _Atomic signed char dev_state[GS_MAX_DEVICES]; /* 0 unknown, 1 slice, 2 other */
static _Atomic int only_device_is_slice;               /* 1: one device, the slice's: skip lookups */

static int device_is_slice(CUdevice dev)
{
    if (gs_cfg.memory_bytes == GS_UNLIMITED) return 1;
    if (dev < 0 || dev >= GS_MAX_DEVICES) return 0;
    signed char s = atomic_load_explicit(&dev_state[dev], memory_order_relaxed);
    if (GS_LIKELY(s != 0)) return s == 1;
    CUuuid uuid;
    CUresult rc = CUDA_ERROR_NOT_FOUND;
    if (real_cuDeviceGetUuid_v2) rc = real_cuDeviceGetUuid_v2(&uuid, dev);
    if (rc != CUDA_SUCCESS && real_cuDeviceGetUuid) rc = real_cuDeviceGetUuid(&uuid, dev);
    if (rc != CUDA_SUCCESS) return 0;
    s = memcmp(uuid.bytes, gs_cfg.gpu_uuid, 16) == 0 ? 1 : 2;
    atomic_store_explicit(&dev_state[dev], s, memory_order_relaxed);
    int count = 0;
    if (s == 1 && real_cuDeviceGetCount && real_cuDeviceGetCount(&count) == CUDA_SUCCESS && count == 1)
        atomic_store_explicit(&only_device_is_slice, 1, memory_order_relaxed);
    return s == 1;
}

static int current_device(CUdevice *dev)
{
    return real_cuCtxGetDevice != NULL && real_cuCtxGetDevice(dev) == CUDA_SUCCESS ? 0 : -1;
}

/* 1 when memory on the current context's device counts against the slice and may be allocated. */
static inline int current_device_is_slice(void)
{
    if (GS_LIKELY(atomic_load_explicit(&only_device_is_slice, memory_order_relaxed))) return 1;
    CUdevice dev;
    /* Without a current context the driver call fails on its own; reserve anyway and roll back. */
    if (real_cuCtxGetDevice == NULL || real_cuCtxGetDevice(&dev) != CUDA_SUCCESS) return 1;
    return device_is_slice(dev);
}

static _Atomic int pool_slack; /* some stream-ordered pool may hold more than its live allocations */
static void pools_settle(void);

/* Before refusing: memory pools gave back to the driver may still be charged; settle, then retry. */
static CUresult reserve_retry(uint64_t bytes)
{
    if (atomic_load_explicit(&pool_slack, memory_order_relaxed)) {
        pools_settle();
        if (gs_region_reserve(&gs_reg, bytes) == 0) return CUDA_SUCCESS;
    }
    return CUDA_ERROR_OUT_OF_MEMORY;
}

/* Reserves bytes for an allocation on the current device: CUDA_SUCCESS or CUDA_ERROR_OUT_OF_MEMORY.
 * `settle` 0: the caller holds the pool lock (no settling). */
static inline CUresult reserve_current_ex(uint64_t bytes, int settle)
{
    int mode = gs_ensure_init();
    if (GS_UNLIKELY(mode != GS_MODE_ACTIVE)) return CUDA_ERROR_OUT_OF_MEMORY;
    if (GS_UNLIKELY(!current_device_is_slice())) {
        gs_region_count_refused(&gs_reg);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (GS_LIKELY(gs_region_reserve(&gs_reg, bytes) == 0)) return CUDA_SUCCESS;
    return settle ? reserve_retry(bytes) : CUDA_ERROR_OUT_OF_MEMORY;
}

static inline CUresult reserve_current(uint64_t bytes)
{
    return reserve_current_ex(bytes, 1);
}

static CUresult reserve_on(CUdevice dev, uint64_t bytes)
{
    int mode = gs_ensure_init();
    if (mode != GS_MODE_ACTIVE) return CUDA_ERROR_OUT_OF_MEMORY;
    if (!device_is_slice(dev)) {
        gs_region_count_refused(&gs_reg);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return gs_region_reserve(&gs_reg, bytes) == 0 ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

static inline void release(uint64_t bytes)
{
    gs_region_release(&gs_reg, bytes);
}

/* Records a charged object; if the table is full the allocation cannot be credited later, so it is
 * undone by the caller (returns -1). */
static inline int remember(gs_table *t, uint64_t key, uint64_t bytes)
{
    if (GS_LIKELY(gs_table_put(t, key, bytes) == 0)) return 0;
    gs_log("allocation table full; refusing allocation");
    return -1;
}

/* ------------------------------------------------------------------------------------------------
 * Which context an allocation belongs to. The driver frees every allocation of a context when the
 * context goes (cuCtxDestroy, cuDevicePrimaryCtxReset, the last cuDevicePrimaryCtxRelease), so a
 * device-pointer entry carries its context's index in the top 16 bits of its value (bytes below).
 * ---------------------------------------------------------------------------------------------- */

#define GS_BYTES_MASK ((1ull << 40) - 1)
#define GS_POOL_SHIFT 40 /* bits 40..47: 1 + the stream-ordered pool record an allocation came from */
#define GS_POOL_OF(v) ((unsigned)((v) >> GS_POOL_SHIFT) & 0xffu)
#define GS_MAX_CTX 4096
static _Atomic uintptr_t ctx_slots[GS_MAX_CTX]; /* index -> CUcontext; 0 is "none" */
static _Atomic unsigned ctx_count = 1;
static pthread_mutex_t ctx_lock = PTHREAD_MUTEX_INITIALIZER;
static __thread uintptr_t tl_ctx;
static __thread unsigned tl_idx;
/* Device memory a context holds besides allocations: its own cost (measured at the process's first
 * context) and what cuCtxSetLimit added above the limits it started with. Indexed like ctx_slots. */
enum { GS_LIM_HEAP, GS_LIM_STACK, GS_LIM_FIFO, GS_LIM_N };
static _Atomic uint64_t ctx_cost[GS_MAX_CTX];
static _Atomic uint64_t ctx_limit_charged[GS_MAX_CTX][GS_LIM_N];
static _Atomic uint64_t ctx_limit_base[GS_MAX_CTX][GS_LIM_N]; /* the limit before the first set, +1 */

static unsigned ctx_find(uintptr_t c)
{
    unsigned n = atomic_load_explicit(&ctx_count, memory_order_acquire);
    for (unsigned i = 1; i < n; i++)
        if (atomic_load_explicit(&ctx_slots[i], memory_order_relaxed) == c) return i;
    return 0;
}

static unsigned ctx_index(uintptr_t c)
{
    if (GS_LIKELY(c == tl_ctx && c != 0)) return tl_idx;
    if (c == 0) return 0;
    unsigned i = ctx_find(c);
    if (i == 0) {
        pthread_mutex_lock(&ctx_lock);
        i = ctx_find(c);
        unsigned n = atomic_load(&ctx_count);
        if (i == 0 && n < GS_MAX_CTX) { /* beyond that: untagged, i.e. credited only by its free */
            atomic_store_explicit(&ctx_slots[n], c, memory_order_relaxed);
            atomic_store_explicit(&ctx_count, n + 1, memory_order_release);
            i = n;
        }
        pthread_mutex_unlock(&ctx_lock);
    }
    tl_ctx = c;
    tl_idx = i;
    return i;
}

static void gs_ctx_after_fork_child(void)
{
    memset((void *)ctx_cost, 0, sizeof(ctx_cost));
    memset((void *)ctx_limit_charged, 0, sizeof(ctx_limit_charged));
    memset((void *)ctx_limit_base, 0, sizeof(ctx_limit_base));
    atomic_store(&ctx_count, 1);
    tl_ctx = 0;
    tl_idx = 0;
    pthread_mutex_init(&ctx_lock, NULL);
}

/* The table value for `bytes` allocated in the calling thread's current context. */
static inline uint64_t in_current_ctx(uint64_t bytes)
{
    CUcontext c = NULL;
    if (GS_LIKELY(real_cuCtxGetCurrent != NULL)) (void)real_cuCtxGetCurrent(&c);
    return bytes | (uint64_t)ctx_index((uintptr_t)c) << 48;
}

static void pool_freed(unsigned slot, uint64_t bytes);

/* A table value's bytes go back to the slice, or to the pool they came from (which keeps them). */
static inline void credit_entry(uint64_t v)
{
    if (GS_UNLIKELY(GS_POOL_OF(v) != 0)) pool_freed(GS_POOL_OF(v) - 1, v & GS_BYTES_MASK);
    else release(v & GS_BYTES_MASK);
}

static void context_bytes_add(int64_t delta)
{
    int self = atomic_load(&gs_reg.self);
    if (self >= 0) atomic_fetch_add(&gs_reg.entries[self].context_bytes, (uint64_t)delta);
}

/* Credits what a context's limits took above the ones it started with (the driver resets them with
 * the context: destroy, primary reset, last primary release). */
static void credit_context_limits(unsigned idx)
{
    if (idx == 0 || atomic_load(&gs_mode) != GS_MODE_ACTIVE) return;
    for (int i = 0; i < GS_LIM_N; i++) {
        uint64_t b = atomic_exchange(&ctx_limit_charged[idx][i], 0);
        atomic_store(&ctx_limit_base[idx][i], 0);
        if (b) {
            release(b);
            context_bytes_add(-(int64_t)b);
        }
    }
}

/* The context itself is gone (destroy, last primary release): its own cost and its limits. */
static void credit_context_memory(unsigned idx)
{
    if (idx == 0 || atomic_load(&gs_mode) != GS_MODE_ACTIVE) return;
    credit_context_limits(idx);
    uint64_t b = atomic_exchange(&ctx_cost[idx], 0);
    if (b) {
        release(b);
        context_bytes_add(-(int64_t)b);
    }
}

/* Credits every allocation the driver freed with context `idx`. Rare: a scan of the table is fine. */
static void credit_context(unsigned idx)
{
    if (idx == 0 || atomic_load(&gs_mode) != GS_MODE_ACTIVE) return;
    for (uint64_t i = 0; i <= tab_dptr.mask; i++) {
        uint64_t k = atomic_load_explicit(&tab_dptr.slots[i].key, memory_order_acquire), v;
        if (k <= GS_TABLE_TOMB || atomic_load(&tab_dptr.slots[i].val) >> 48 != idx) continue;
        if (gs_table_take(&tab_dptr, k, &v) == 0) credit_entry(v);
    }
}

/* ------------------------------------------------------------------------------------------------
 * Linear allocations
 * ---------------------------------------------------------------------------------------------- */

#define NEED_REAL(name)                                                                                  \
    do {                                                                                                 \
        if (GS_UNLIKELY(cuda_real() != 0 || real_##name == NULL)) return CUDA_ERROR_NOT_INITIALIZED;     \
    } while (0)

/* Takes a pointer out of the table before the driver frees it (so the address cannot be handed out
 * again and re-inserted in between) and puts it back if the driver refuses the free. */
#define FREE_WITH_CREDIT(table, key, call)                                                               \
    do {                                                                                                 \
        uint64_t bytes_ = 0;                                                                             \
        int known_ = atomic_load_explicit(&gs_mode, memory_order_relaxed) == GS_MODE_ACTIVE &&           \
                     gs_table_take(&(table), (uint64_t)(key), &bytes_) == 0;                             \
        CUresult rc_ = (call);                                                                           \
        if (known_) {                                                                                    \
            if (rc_ == CUDA_SUCCESS && GS_UNLIKELY(atomic_load_explicit(&has_exports, memory_order_relaxed))) \
                gs_region_export_drop(&gs_reg, (uint64_t)(key));                                         \
            if (rc_ == CUDA_SUCCESS) credit_entry(bytes_);                                               \
            else (void)gs_table_put(&(table), (uint64_t)(key), bytes_);                                  \
        }                                                                                                \
        return rc_;                                                                                      \
    } while (0)

GS_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    NEED_REAL(cuMemAlloc_v2);
    if (GS_UNLIKELY(bytesize == 0 || dptr == NULL)) return real_cuMemAlloc_v2(dptr, bytesize);
    CUresult rc = reserve_current(bytesize);
    if (GS_UNLIKELY(rc != CUDA_SUCCESS)) return rc;
    rc = real_cuMemAlloc_v2(dptr, bytesize);
    if (GS_UNLIKELY(rc != CUDA_SUCCESS)) {
        release(bytesize);
        return rc;
    }
    if (GS_UNLIKELY(remember(&tab_dptr, *dptr, in_current_ctx(bytesize)) != 0)) {
        real_cuMemFree_v2(*dptr);
        release(bytesize);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return rc;
}

GS_EXPORT CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize)
{
    NEED_REAL(cuMemAlloc);
    if (bytesize == 0 || dptr == NULL) return real_cuMemAlloc(dptr, bytesize);
    CUresult rc = reserve_current(bytesize);
    if (rc != CUDA_SUCCESS) return rc;
    rc = real_cuMemAlloc(dptr, bytesize);
    if (rc != CUDA_SUCCESS) {
        release(bytesize);
        return rc;
    }
    if (remember(&tab_dptr, *dptr, in_current_ctx(bytesize)) != 0) {
        if (real_cuMemFree) real_cuMemFree(*dptr);
        release(bytesize);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return rc;
}

GS_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    NEED_REAL(cuMemAllocManaged);
    if (bytesize == 0 || dptr == NULL) return real_cuMemAllocManaged(dptr, bytesize, flags);
    CUresult rc = reserve_current(bytesize);
    if (rc != CUDA_SUCCESS) return rc;
    rc = real_cuMemAllocManaged(dptr, bytesize, flags);
    if (rc != CUDA_SUCCESS) {
        release(bytesize);
        return rc;
    }
    if (remember(&tab_dptr, *dptr, in_current_ctx(bytesize)) != 0) {
        real_cuMemFree_v2(*dptr);
        release(bytesize);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return rc;
}

/* Pitch is chosen by the driver: reserve an estimate, then settle on pitch * height. */
static CUresult alloc_pitch(CUresult (*fn)(CUdeviceptr *, size_t *, size_t, size_t, unsigned int),
                            CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height, unsigned int elem)
{
    if (width == 0 || height == 0 || dptr == NULL || pitch == NULL) return fn(dptr, pitch, width, height, elem);
    uint64_t estimate = (((uint64_t)width + 511) & ~(uint64_t)511) * height;
    CUresult rc = reserve_current(estimate);
    if (rc != CUDA_SUCCESS) return rc;
    rc = fn(dptr, pitch, width, height, elem);
    if (rc != CUDA_SUCCESS) {
        release(estimate);
        return rc;
    }
    uint64_t actual = (uint64_t)*pitch * height;
    if (actual > estimate && gs_region_reserve(&gs_reg, actual - estimate) != 0) {
        real_cuMemFree_v2(*dptr);
        release(estimate);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (actual < estimate) release(estimate - actual);
    if (remember(&tab_dptr, *dptr, in_current_ctx(actual)) != 0) {
        real_cuMemFree_v2(*dptr);
        release(actual);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return CUDA_SUCCESS;
}

GS_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                                      unsigned int ElementSizeBytes)
{
    NEED_REAL(cuMemAllocPitch_v2);
    return alloc_pitch(real_cuMemAllocPitch_v2, dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
}

GS_EXPORT CUresult cuMemAllocPitch(CUdeviceptr_v1 *dptr, unsigned int *pPitch, unsigned int WidthInBytes,
                                   unsigned int Height, unsigned int ElementSizeBytes)
{
    NEED_REAL(cuMemAllocPitch);
    if (WidthInBytes == 0 || Height == 0 || dptr == NULL || pPitch == NULL)
        return real_cuMemAllocPitch(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    /* The legacy entry point cannot describe more than 4 GiB; reserve its worst case up front. */
    uint64_t worst = (((uint64_t)WidthInBytes + 511) & ~(uint64_t)511) * Height;
    CUresult rc = reserve_current(worst);
    if (rc != CUDA_SUCCESS) return rc;
    rc = real_cuMemAllocPitch(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    if (rc != CUDA_SUCCESS) {
        release(worst);
        return rc;
    }
    uint64_t actual = (uint64_t)*pPitch * Height;
    if (actual > worst && gs_region_reserve(&gs_reg, actual - worst) != 0) {
        if (real_cuMemFree) real_cuMemFree(*dptr);
        release(worst);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (actual < worst) release(worst - actual);
    if (remember(&tab_dptr, *dptr, in_current_ctx(actual)) != 0) {
        if (real_cuMemFree) real_cuMemFree(*dptr);
        release(actual);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return CUDA_SUCCESS;
}

GS_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    NEED_REAL(cuMemFree_v2);
    FREE_WITH_CREDIT(tab_dptr, dptr, real_cuMemFree_v2(dptr));
}

GS_EXPORT CUresult cuMemFree(CUdeviceptr_v1 dptr)
{
    NEED_REAL(cuMemFree);
    FREE_WITH_CREDIT(tab_dptr, dptr, real_cuMemFree(dptr));
}

/* ------------------------------------------------------------------------------------------------
 * Stream-ordered allocations and pools
 * ---------------------------------------------------------------------------------------------- */

/*
 * A stream-ordered pool keeps memory reserved after cuMemFreeAsync (up to its release threshold,
 * until a synchronization or cuMemPoolTrimTo gives it back): the slice is charged the pool's reserved
 * high-water, not its live allocations. Each device pool gets a record: `used` (its live allocations,
 * as the shim charged them) and `charged` (what the slice pays for it, >= used). An allocation charges
 * only what exceeds the pool's slack (charged - used); a free lowers `used` and credits nothing. The
 * slack is settled against the driver's CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT after cuMemPoolTrimTo
 * and cuMemPoolSetAttribute, when memory is reported, and before an allocation is refused.
 */
#define GS_MAX_POOLS 255
typedef struct {
    uintptr_t pool; /* 0: free record */
    uint64_t used, charged;
} gs_pool_rec;
static gs_pool_rec pool_recs[GS_MAX_POOLS];
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;

/* Caller holds pool_lock. -1 when every record is taken (the allocation is then charged alone). */
static int pool_slot(uintptr_t pool, int create)
{
    int free_slot = -1;
    for (int i = 0; i < GS_MAX_POOLS; i++) {
        if (pool_recs[i].pool == pool) return i;
        if (pool_recs[i].pool == 0 && free_slot < 0) free_slot = i;
    }
    if (create && free_slot >= 0) pool_recs[free_slot] = (gs_pool_rec){pool, 0, 0};
    return create ? free_slot : -1;
}

static void pool_freed(unsigned slot, uint64_t bytes)
{
    pthread_mutex_lock(&pool_lock);
    if (slot < GS_MAX_POOLS && pool_recs[slot].pool != 0) {
        pool_recs[slot].used -= bytes < pool_recs[slot].used ? bytes : pool_recs[slot].used;
        atomic_store(&pool_slack, 1);
    } else {
        release(bytes); /* its pool was destroyed meanwhile */
    }
    pthread_mutex_unlock(&pool_lock);
}

/* Credits what pools hold above both their live allocations and what the driver still reserves. */
static void pools_settle(void)
{
    if (!atomic_exchange(&pool_slack, 0) || real_cuMemPoolGetAttribute == NULL) return;
    pthread_mutex_lock(&pool_lock);
    int slack_left = 0;
    for (int i = 0; i < GS_MAX_POOLS; i++) {
        gs_pool_rec *r = &pool_recs[i];
        if (r->pool == 0 || r->charged <= r->used) continue;
        cuuint64_t reserved = 0;
        if (real_cuMemPoolGetAttribute((CUmemoryPool)r->pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved) !=
            CUDA_SUCCESS)
            continue;
        uint64_t keep = reserved > r->used ? reserved : r->used;
        if (r->charged > keep) {
            release(r->charged - keep);
            r->charged = keep;
        }
        if (r->charged > r->used) slack_left = 1;
    }
    if (slack_left) atomic_store(&pool_slack, 1);
    pthread_mutex_unlock(&pool_lock);
}

/* Reserve for `size` bytes from `pool`; *tag gets the table tag, *charged what the slice paid now. */
static CUresult pool_reserve(CUmemoryPool pool, uint64_t size, uint64_t *tag, uint64_t *charged)
{
    *tag = 0;
    *charged = size;
    if (pool == NULL) return reserve_current(size);
    gs_pool_rec *r;
    uint64_t need;
    for (int attempt = 0;; attempt++) {
        pthread_mutex_lock(&pool_lock);
        int slot = pool_slot((uintptr_t)pool, 1);
        if (slot < 0) {
            pthread_mutex_unlock(&pool_lock);
            return reserve_current(size);
        }
        r = &pool_recs[slot];
        uint64_t slack = r->charged - r->used;
        need = size > slack ? size - slack : 0;
        if (need == 0 || reserve_current_ex(need, 0) == CUDA_SUCCESS) break;
        pthread_mutex_unlock(&pool_lock);
        if (attempt == 1 || !atomic_load(&pool_slack)) return CUDA_ERROR_OUT_OF_MEMORY;
        pools_settle();
    }
    r->charged += need;
    r->used += size;
    pthread_mutex_unlock(&pool_lock);
    *tag = (uint64_t)(r - pool_recs + 1) << GS_POOL_SHIFT;
    *charged = need;
    return CUDA_SUCCESS;
}

static void pool_unreserve(uint64_t tag, uint64_t size, uint64_t charged)
{
    if (tag == 0) {
        release(charged);
        return;
    }
    pthread_mutex_lock(&pool_lock);
    gs_pool_rec *r = &pool_recs[GS_POOL_OF(tag) - 1];
    r->used -= size;
    r->charged -= charged;
    release(charged);
    pthread_mutex_unlock(&pool_lock);
}

static CUresult alloc_from(CUmemoryPool pool, CUresult (*fn)(CUdeviceptr *, size_t, CUmemoryPool, CUstream),
                           CUresult (*fn_async)(CUdeviceptr *, size_t, CUstream), CUdeviceptr *dptr, size_t size,
                           CUstream stream)
{
    uint64_t tag, charged;
    CUresult rc = pool_reserve(pool, size, &tag, &charged);
    if (rc != CUDA_SUCCESS) return rc;
    rc = fn ? fn(dptr, size, pool, stream) : fn_async(dptr, size, stream);
    if (rc != CUDA_SUCCESS) {
        pool_unreserve(tag, size, charged);
        return rc;
    }
    if (remember(&tab_dptr, *dptr, tag ? (size | tag) : in_current_ctx(size)) != 0) {
        real_cuMemFreeAsync(*dptr, stream);
        pool_unreserve(tag, size, charged);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return rc;
}

static CUresult alloc_async(CUresult (*fn)(CUdeviceptr *, size_t, CUstream), CUdeviceptr *dptr, size_t size,
                            CUstream stream)
{
    if (size == 0 || dptr == NULL) return fn(dptr, size, stream);
    if (gs_ensure_init() != GS_MODE_ACTIVE) return CUDA_ERROR_OUT_OF_MEMORY;
    /* cuMemAllocAsync takes from the device's current pool. */
    CUdevice dev;
    CUmemoryPool pool = NULL;
    if (real_cuDeviceGetMemPool == NULL || current_device(&dev) != 0 || real_cuDeviceGetMemPool(&pool, dev) != CUDA_SUCCESS)
        pool = NULL;
    return alloc_from(pool, NULL, fn, dptr, size, stream);
}

GS_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    NEED_REAL(cuMemAllocAsync);
    return alloc_async(real_cuMemAllocAsync, dptr, bytesize, hStream);
}

GS_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    NEED_REAL(cuMemAllocAsync_ptsz);
    return alloc_async(real_cuMemAllocAsync_ptsz, dptr, bytesize, hStream);
}

GS_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep)
{
    NEED_REAL(cuMemPoolTrimTo);
    CUresult rc = real_cuMemPoolTrimTo(pool, minBytesToKeep);
    if (rc == CUDA_SUCCESS && atomic_load(&gs_mode) == GS_MODE_ACTIVE) {
        atomic_store(&pool_slack, 1);
        pools_settle();
    }
    return rc;
}

GS_EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    NEED_REAL(cuMemPoolSetAttribute);
    CUresult rc = real_cuMemPoolSetAttribute(pool, attr, value);
    if (rc == CUDA_SUCCESS && attr == CU_MEMPOOL_ATTR_RELEASE_THRESHOLD && atomic_load(&gs_mode) == GS_MODE_ACTIVE) {
        atomic_store(&pool_slack, 1);
        pools_settle();
    }
    return rc;
}

GS_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
    NEED_REAL(cuMemFreeAsync);
    FREE_WITH_CREDIT(tab_dptr, dptr, real_cuMemFreeAsync(dptr, hStream));
}

GS_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream)
{
    NEED_REAL(cuMemFreeAsync_ptsz);
    FREE_WITH_CREDIT(tab_dptr, dptr, real_cuMemFreeAsync_ptsz(dptr, hStream));
}

GS_EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *poolProps)
{
    NEED_REAL(cuMemPoolCreate);
    CUresult rc = real_cuMemPoolCreate(pool, poolProps);
    if (rc == CUDA_SUCCESS && poolProps != NULL && poolProps->location.type != CU_MEM_LOCATION_TYPE_DEVICE &&
        gs_ensure_init() == GS_MODE_ACTIVE)
        (void)gs_table_put(&tab_pool, (uint64_t)(uintptr_t)*pool, 1);
    return rc;
}

GS_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    NEED_REAL(cuMemPoolDestroy);
    CUresult rc = real_cuMemPoolDestroy(pool);
    uint64_t v;
    if (rc == CUDA_SUCCESS && atomic_load(&gs_mode) == GS_MODE_ACTIVE) {
        (void)gs_table_take(&tab_pool, (uint64_t)(uintptr_t)pool, &v);
        pthread_mutex_lock(&pool_lock); /* the pool's reserved memory goes with it */
        int slot = pool_slot((uintptr_t)pool, 0);
        if (slot >= 0) {
            release(pool_recs[slot].charged - pool_recs[slot].used); /* live ones are credited by their free */
            pool_recs[slot].pool = 0;
        }
        pthread_mutex_unlock(&pool_lock);
    }
    return rc;
}

static int pool_is_host(CUmemoryPool pool)
{
    uint64_t key = (uint64_t)(uintptr_t)pool, i = gs_table_hash(key) & tab_pool.mask;
    for (uint64_t n = 0; n <= tab_pool.mask; n++, i = (i + 1) & tab_pool.mask) {
        uint64_t k = atomic_load(&tab_pool.slots[i].key);
        if (k == GS_TABLE_EMPTY) return 0;
        if (k == key) return 1;
    }
    return 0;
}

static CUresult alloc_from_pool(CUresult (*fn)(CUdeviceptr *, size_t, CUmemoryPool, CUstream), CUdeviceptr *dptr,
                                size_t size, CUmemoryPool pool, CUstream stream)
{
    if (size == 0 || dptr == NULL) return fn(dptr, size, pool, stream);
    int mode = gs_ensure_init();
    if (mode != GS_MODE_ACTIVE) return CUDA_ERROR_OUT_OF_MEMORY;
    if (pool_is_host(pool)) return fn(dptr, size, pool, stream);
    return alloc_from(pool, fn, NULL, dptr, size, stream);
}

GS_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream)
{
    NEED_REAL(cuMemAllocFromPoolAsync);
    return alloc_from_pool(real_cuMemAllocFromPoolAsync, dptr, bytesize, pool, hStream);
}

GS_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                                CUstream hStream)
{
    NEED_REAL(cuMemAllocFromPoolAsync_ptsz);
    return alloc_from_pool(real_cuMemAllocFromPoolAsync_ptsz, dptr, bytesize, pool, hStream);
}

/* ------------------------------------------------------------------------------------------------
 * Virtual memory management. Only physical memory on a device location counts, and it is charged for
 * its physical lifetime: the driver frees it when the application holds no handle to it (cuMemCreate
 * and each cuMemRetainAllocationHandle are undone by one cuMemRelease) and no mapping of it is left
 * (cuMemUnmap). create -> map -> release therefore stays charged until the last unmap. VMM calls are
 * not on a hot path: one mutex orders them, held across the driver call so that a handle value the
 * driver reissues cannot meet a stale table entry.
 * ---------------------------------------------------------------------------------------------- */

typedef struct {
    uint64_t bytes;
    int handle_refs, map_refs;
} gs_phys;

typedef struct gs_vmap {
    uint64_t va, size;
    gs_phys *phys;
    struct gs_vmap *prev, *next;
} gs_vmap;

static pthread_mutex_t vmm_lock = PTHREAD_MUTEX_INITIALIZER;
static gs_vmap *vmaps; /* every live mapping, for cuMemRetainAllocationHandle of an inner address */

static void gs_vmm_after_fork_child(void)
{
    pthread_mutex_init(&vmm_lock, NULL);
    vmaps = NULL; /* the parent's records (leaked in the child: none of its mappings are ours) */
}

/* Caller holds vmm_lock. Credits the physical memory once nothing refers to it any more. */
static void phys_maybe_free(gs_phys *ph)
{
    if (ph->handle_refs > 0 || ph->map_refs > 0) return;
    release(ph->bytes);
    free(ph);
}

GS_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                               unsigned long long flags)
{
    NEED_REAL(cuMemCreate);
    if (prop == NULL || handle == NULL || size == 0 || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return real_cuMemCreate(handle, size, prop, flags);
    CUresult rc = reserve_on(prop->location.id, size);
    if (rc != CUDA_SUCCESS) return rc;
    gs_phys *ph = malloc(sizeof(*ph));
    if (ph == NULL) {
        release(size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *ph = (gs_phys){size, 1, 0};
    pthread_mutex_lock(&vmm_lock);
    rc = real_cuMemCreate(handle, size, prop, flags);
    if (rc == CUDA_SUCCESS && remember(&tab_vmm, *handle, (uint64_t)(uintptr_t)ph) != 0) {
        real_cuMemRelease(*handle);
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    }
    pthread_mutex_unlock(&vmm_lock);
    if (rc != CUDA_SUCCESS) {
        free(ph);
        release(size);
    }
    return rc;
}

GS_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    NEED_REAL(cuMemRelease);
    if (atomic_load_explicit(&gs_mode, memory_order_relaxed) != GS_MODE_ACTIVE) return real_cuMemRelease(handle);
    pthread_mutex_lock(&vmm_lock);
    CUresult rc = real_cuMemRelease(handle);
    uint64_t v;
    if (rc == CUDA_SUCCESS && gs_table_get(&tab_vmm, handle, &v) == 0) {
        gs_phys *ph = (gs_phys *)(uintptr_t)v;
        if (--ph->handle_refs == 0) {
            (void)gs_table_take(&tab_vmm, handle, &v); /* the handle value is the driver's to reissue */
            phys_maybe_free(ph);
        }
    }
    pthread_mutex_unlock(&vmm_lock);
    return rc;
}

GS_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                            unsigned long long flags)
{
    NEED_REAL(cuMemMap);
    if (atomic_load_explicit(&gs_mode, memory_order_relaxed) != GS_MODE_ACTIVE)
        return real_cuMemMap(ptr, size, offset, handle, flags);
    gs_vmap *m = malloc(sizeof(*m));
    if (m == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&vmm_lock);
    CUresult rc = real_cuMemMap(ptr, size, offset, handle, flags);
    uint64_t v;
    if (rc == CUDA_SUCCESS && gs_table_get(&tab_vmm, handle, &v) == 0) {
        gs_phys *ph = (gs_phys *)(uintptr_t)v;
        *m = (gs_vmap){ptr, size, ph, NULL, vmaps};
        if (remember(&tab_map, ptr, (uint64_t)(uintptr_t)m) != 0) {
            /* untracked, the mapping would free the memory's charge early: refuse it */
            if (real_cuMemUnmap) real_cuMemUnmap(ptr, size);
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            if (vmaps) vmaps->prev = m;
            vmaps = m;
            ph->map_refs++;
            m = NULL;
        }
    }
    pthread_mutex_unlock(&vmm_lock);
    free(m);
    return rc;
}

GS_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    NEED_REAL(cuMemUnmap);
    if (atomic_load_explicit(&gs_mode, memory_order_relaxed) != GS_MODE_ACTIVE) return real_cuMemUnmap(ptr, size);
    pthread_mutex_lock(&vmm_lock);
    CUresult rc = real_cuMemUnmap(ptr, size);
    /* the range may span several mappings, each unmapped whole */
    for (uint64_t p = ptr, v; rc == CUDA_SUCCESS && p < (uint64_t)ptr + size;) {
        if (gs_table_take(&tab_map, p, &v) != 0) break; /* memory the shim did not charge */
        gs_vmap *m = (gs_vmap *)(uintptr_t)v;
        if (m->prev) m->prev->next = m->next;
        else vmaps = m->next;
        if (m->next) m->next->prev = m->prev;
        p += m->size;
        m->phys->map_refs--;
        phys_maybe_free(m->phys);
        free(m);
    }
    pthread_mutex_unlock(&vmm_lock);
    return rc;
}

GS_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
    NEED_REAL(cuMemRetainAllocationHandle);
    if (atomic_load_explicit(&gs_mode, memory_order_relaxed) != GS_MODE_ACTIVE)
        return real_cuMemRetainAllocationHandle(handle, addr);
    pthread_mutex_lock(&vmm_lock);
    CUresult rc = real_cuMemRetainAllocationHandle(handle, addr);
    if (rc == CUDA_SUCCESS && handle != NULL) {
        uint64_t v;
        gs_phys *ph = NULL;
        if (gs_table_get(&tab_vmm, *handle, &v) == 0) {
            ph = (gs_phys *)(uintptr_t)v;
        } else { /* every handle was released; the mapping still knows the allocation */
            for (gs_vmap *m = vmaps; m != NULL && ph == NULL; m = m->next)
                if ((uint64_t)(uintptr_t)addr >= m->va && (uint64_t)(uintptr_t)addr < m->va + m->size) ph = m->phys;
            if (ph != NULL && remember(&tab_vmm, *handle, (uint64_t)(uintptr_t)ph) != 0) ph = NULL;
        }
        if (ph != NULL) ph->handle_refs++;
    }
    pthread_mutex_unlock(&vmm_lock);
    return rc;
}

/* ------------------------------------------------------------------------------------------------
 * Arrays. The size is estimated from the descriptor (elements x channels x element size).
 * ---------------------------------------------------------------------------------------------- */

static uint64_t format_bytes(CUarray_format f)
{
    switch (f) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8:
        return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF:
        return 2;
    default:
        return 4; /* 32-bit formats, and a conservative bound for the packed/compressed ones */
    }
}

static uint64_t max1(size_t v)
{
    return v == 0 ? 1 : (uint64_t)v;
}

static uint64_t array3d_bytes(const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    uint64_t depth = max1(d->Depth);
    if (d->Flags & CUDA_ARRAY3D_CUBEMAP) depth = (d->Flags & CUDA_ARRAY3D_LAYERED) ? depth : 6;
    return max1(d->Width) * max1(d->Height) * depth * format_bytes(d->Format) * max1(d->NumChannels);
}

#define ARRAY_CREATE(realfn, handle, bytes, call, destroy)                                               \
    do {                                                                                                 \
        CUresult rc_ = reserve_current(bytes);                                                           \
        if (rc_ != CUDA_SUCCESS) return rc_;                                                             \
        rc_ = (call);                                                                                    \
        if (rc_ != CUDA_SUCCESS) {                                                                       \
            release(bytes);                                                                              \
            return rc_;                                                                                  \
        }                                                                                                \
        if (remember(&tab_array, (uint64_t)(uintptr_t)*(handle), bytes) != 0) {                          \
            destroy(*(handle));                                                                          \
            release(bytes);                                                                              \
            return CUDA_ERROR_OUT_OF_MEMORY;                                                             \
        }                                                                                                \
        return CUDA_SUCCESS;                                                                             \
    } while (0)

GS_EXPORT CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *pAllocateArray)
{
    NEED_REAL(cuArrayCreate_v2);
    if (pHandle == NULL || pAllocateArray == NULL) return real_cuArrayCreate_v2(pHandle, pAllocateArray);
    uint64_t bytes = max1(pAllocateArray->Width) * max1(pAllocateArray->Height) *
                     format_bytes(pAllocateArray->Format) * max1(pAllocateArray->NumChannels);
    ARRAY_CREATE(real_cuArrayCreate_v2, pHandle, bytes, real_cuArrayCreate_v2(pHandle, pAllocateArray),
                 real_cuArrayDestroy);
}

GS_EXPORT CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *pAllocateArray)
{
    NEED_REAL(cuArray3DCreate_v2);
    if (pHandle == NULL || pAllocateArray == NULL) return real_cuArray3DCreate_v2(pHandle, pAllocateArray);
    uint64_t bytes = array3d_bytes(pAllocateArray);
    ARRAY_CREATE(real_cuArray3DCreate_v2, pHandle, bytes, real_cuArray3DCreate_v2(pHandle, pAllocateArray),
                 real_cuArrayDestroy);
}

/* The legacy (v1) descriptors have 32-bit dimensions; they are entry points of their own. */
GS_EXPORT CUresult cuArrayCreate(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR_v1 *pAllocateArray)
{
    NEED_REAL(cuArrayCreate);
    if (pHandle == NULL || pAllocateArray == NULL) return real_cuArrayCreate(pHandle, pAllocateArray);
    uint64_t bytes = max1(pAllocateArray->Width) * max1(pAllocateArray->Height) *
                     format_bytes(pAllocateArray->Format) * max1(pAllocateArray->NumChannels);
    ARRAY_CREATE(real_cuArrayCreate, pHandle, bytes, real_cuArrayCreate(pHandle, pAllocateArray), real_cuArrayDestroy);
}

GS_EXPORT CUresult cuArray3DCreate(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR_v1 *pAllocateArray)
{
    NEED_REAL(cuArray3DCreate);
    if (pHandle == NULL || pAllocateArray == NULL) return real_cuArray3DCreate(pHandle, pAllocateArray);
    CUDA_ARRAY3D_DESCRIPTOR d = {pAllocateArray->Width, pAllocateArray->Height, pAllocateArray->Depth,
                                 pAllocateArray->Format, pAllocateArray->NumChannels, pAllocateArray->Flags};
    uint64_t bytes = array3d_bytes(&d);
    ARRAY_CREATE(real_cuArray3DCreate, pHandle, bytes, real_cuArray3DCreate(pHandle, pAllocateArray),
                 real_cuArrayDestroy);
}

GS_EXPORT CUresult cuArrayDestroy(CUarray hArray)
{
    NEED_REAL(cuArrayDestroy);
    FREE_WITH_CREDIT(tab_array, (uintptr_t)hArray, real_cuArrayDestroy(hArray));
}

GS_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle,
                                          const CUDA_ARRAY3D_DESCRIPTOR *pMipmappedArrayDesc,
                                          unsigned int numMipmapLevels)
{
    NEED_REAL(cuMipmappedArrayCreate);
    if (pHandle == NULL || pMipmappedArrayDesc == NULL)
        return real_cuMipmappedArrayCreate(pHandle, pMipmappedArrayDesc, numMipmapLevels);
    CUDA_ARRAY3D_DESCRIPTOR level = *pMipmappedArrayDesc;
    uint64_t bytes = 0;
    for (unsigned int i = 0; i < (numMipmapLevels ? numMipmapLevels : 1); i++) {
        bytes += array3d_bytes(&level);
        level.Width = level.Width > 1 ? level.Width / 2 : level.Width;
        level.Height = level.Height > 1 ? level.Height / 2 : level.Height;
        if (!(level.Flags & CUDA_ARRAY3D_LAYERED)) level.Depth = level.Depth > 1 ? level.Depth / 2 : level.Depth;
    }
    ARRAY_CREATE(real_cuMipmappedArrayCreate, pHandle, bytes,
                 real_cuMipmappedArrayCreate(pHandle, pMipmappedArrayDesc, numMipmapLevels),
                 real_cuMipmappedArrayDestroy);
}

GS_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray hMipmappedArray)
{
    NEED_REAL(cuMipmappedArrayDestroy);
    FREE_WITH_CREDIT(tab_array, (uintptr_t)hMipmappedArray, real_cuMipmappedArrayDestroy(hMipmappedArray));
}

/* ------------------------------------------------------------------------------------------------
 * IPC: an opened handle maps memory into this slice; its size is known only after opening.
 * ---------------------------------------------------------------------------------------------- */

static uint64_t ipc_key(const CUipcMemHandle *h)
{
    uint64_t k = 0xcbf29ce484222325ull; /* FNV-1a over the handle's bytes */
    for (size_t i = 0; i < sizeof(h->reserved); i++) k = (k ^ (unsigned char)h->reserved[i]) * 0x100000001b3ull;
    return k ? k : 1;
}

/* Memory exported by a process of this slice is already charged to the slice: remember it so that
 * an open by another process of the slice is not charged twice. */
GS_EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr)
{
    NEED_REAL(cuIpcGetMemHandle);
    CUresult rc = real_cuIpcGetMemHandle(pHandle, dptr);
    uint64_t v;
    if (rc == CUDA_SUCCESS && pHandle != NULL && atomic_load(&gs_mode) == GS_MODE_ACTIVE &&
        gs_table_get(&tab_dptr, dptr, &v) == 0) {
        atomic_store(&has_exports, 1);
        gs_region_export_add(&gs_reg, ipc_key(pHandle), dptr);
    }
    return rc;
}

static CUresult ipc_open(CUresult (*fn)(CUdeviceptr *, CUipcMemHandle, unsigned int), CUdeviceptr *pdptr,
                         CUipcMemHandle handle, unsigned int flags)
{
    int mode = gs_ensure_init();
    if (mode != GS_MODE_ACTIVE) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = fn(pdptr, handle, flags);
    if (rc != CUDA_SUCCESS) return rc;
    if (gs_region_export_known(&gs_reg, ipc_key(&handle))) return CUDA_SUCCESS; /* the slice's own memory */
    CUdeviceptr base = 0;
    size_t size = 0;
    if (real_cuMemGetAddressRange_v2 == NULL || real_cuMemGetAddressRange_v2(&base, &size, *pdptr) != CUDA_SUCCESS) {
        real_cuIpcCloseMemHandle(*pdptr);
        gs_log("cannot size an IPC memory handle; refusing it");
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (reserve_current(size) != CUDA_SUCCESS) {
        real_cuIpcCloseMemHandle(*pdptr);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (remember(&tab_dptr, *pdptr, in_current_ctx(size)) != 0) {
        real_cuIpcCloseMemHandle(*pdptr);
        release(size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return CUDA_SUCCESS;
}

GS_EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags)
{
    NEED_REAL(cuIpcOpenMemHandle_v2);
    if (real_cuIpcCloseMemHandle == NULL) return CUDA_ERROR_NOT_INITIALIZED;
    return ipc_open(real_cuIpcOpenMemHandle_v2, pdptr, handle, Flags);
}

GS_EXPORT CUresult cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags)
{
    NEED_REAL(cuIpcOpenMemHandle);
    if (real_cuIpcCloseMemHandle == NULL) return CUDA_ERROR_NOT_INITIALIZED;
    return ipc_open(real_cuIpcOpenMemHandle, pdptr, handle, Flags);
}

GS_EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr dptr)
{
    NEED_REAL(cuIpcCloseMemHandle);
    FREE_WITH_CREDIT(tab_dptr, dptr, real_cuIpcCloseMemHandle(dptr));
}

/* ------------------------------------------------------------------------------------------------
 * Contexts: the first context on a device charges the configured context overhead once per process.
 * ---------------------------------------------------------------------------------------------- */

/* 0: charged or nothing to charge; -1: the slice has no room for a context. */
static int charge_context(CUdevice dev)
{
    if (gs_ensure_init() != GS_MODE_ACTIVE) return 0; /* allocations are refused anyway */
    if (dev < 0 || dev >= 64 || !device_is_slice(dev)) return 0;
    uint64_t bit = 1ull << dev;
    if (atomic_fetch_or(&ctx_charged, bit) & bit) return 0;
    /* Attaching to the region here lists the process even before it allocates. */
    if (gs_region_reserve(&gs_reg, gs_cfg.context_overhead_bytes) != 0) {
        atomic_fetch_and(&ctx_charged, ~bit);
        return -1;
    }
    int self = atomic_load(&gs_reg.self);
    if (self >= 0) atomic_fetch_add(&gs_reg.entries[self].context_bytes, gs_cfg.context_overhead_bytes);
    return 0;
}

/*
 * A context's own device memory (the driver's per-context state, the default heap/stack/printf
 * reservations) is measured as the driver reports it, once per process, at its first context: what
 * NVML's process list shows for the one process that appeared or grew across the creation (or, when
 * that is ambiguous because other processes changed meanwhile, the device's used memory). Every later
 * context is charged the same, and credited when the driver destroys it. The same comparison tells the
 * process its pid as NVML reports it (the host pid inside a PID namespace), which NVML's process lists
 * are filtered by.
 */
#define GS_SNAP_PROCS 128
typedef struct {
    int ok;
    uint64_t dev_used;
    unsigned n;
    nvmlProcessInfo_t procs[GS_SNAP_PROCS];
} gs_mem_snap;

static _Atomic uint64_t ctx_measured; /* cost + 1 once measured */
static _Atomic int32_t own_host_pid;
static pthread_mutex_t measure_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t primary_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic uintptr_t nvml_slice_dev; /* nvmlDevice_t of the slice's GPU, once looked up */

static nvmlDevice_t slice_nvml_device(void)
{
    uintptr_t d = atomic_load(&nvml_slice_dev);
    if (d) return (nvmlDevice_t)d;
    nvmlDevice_t h;
    if (nvml_real() != 0 || !real_nvmlInit_v2 || !real_nvmlDeviceGetHandleByUUID || real_nvmlInit_v2() != NVML_SUCCESS ||
        real_nvmlDeviceGetHandleByUUID(gs_cfg.gpu_uuid_text, &h) != NVML_SUCCESS)
        return NULL;
    atomic_store(&nvml_slice_dev, (uintptr_t)h);
    return h;
}

static void mem_snap(gs_mem_snap *s)
{
    s->ok = 0;
    nvmlDevice_t d = slice_nvml_device();
    nvmlMemory_t m;
    if (d == NULL || real_nvmlDeviceGetMemoryInfo == NULL || real_nvmlDeviceGetMemoryInfo(d, &m) != NVML_SUCCESS) return;
    s->dev_used = m.used;
    s->n = GS_SNAP_PROCS;
    if (real_nvmlDeviceGetComputeRunningProcesses_v3 == NULL ||
        real_nvmlDeviceGetComputeRunningProcesses_v3(d, &s->n, s->procs) != NVML_SUCCESS)
        s->n = 0;
    s->ok = 1;
}

static uint64_t snap_used_of(const gs_mem_snap *s, unsigned pid)
{
    for (unsigned i = 0; i < s->n; i++)
        if (s->procs[i].pid == pid) return s->procs[i].usedGpuMemory;
    return 0;
}

#define GS_MAX_CTX_COST (4ull << 30) /* a bound on a believable figure */

static uint64_t measure_cost(const gs_mem_snap *a, const gs_mem_snap *b)
{
    if (!a->ok || !b->ok) return 0;
    unsigned grown = 0, pid = 0;
    uint64_t delta = 0;
    for (unsigned i = 0; i < b->n; i++) {
        uint64_t before = snap_used_of(a, b->procs[i].pid);
        if (b->procs[i].usedGpuMemory > before) {
            grown++;
            pid = b->procs[i].pid;
            delta = b->procs[i].usedGpuMemory - before;
        }
    }
    if (grown == 1) {
        atomic_store(&own_host_pid, (int32_t)pid);
    } else {
        delta = b->dev_used > a->dev_used ? b->dev_used - a->dev_used : 0;
    }
    return delta > GS_MAX_CTX_COST ? 0 : delta;
}

static void note_host_pid(void)
{
    int self = atomic_load(&gs_reg.self);
    int32_t h = atomic_load(&own_host_pid);
    if (self >= 0 && h > 0) atomic_store(&gs_reg.entries[self].host_pid, h);
}

typedef struct {
    int measuring;
    gs_mem_snap before;
} gs_ctx_op;

/* Before the driver creates a context on `dev`. */
static void ctx_begin(gs_ctx_op *op, CUdevice dev)
{
    op->measuring = 0;
    if (gs_ensure_init() != GS_MODE_ACTIVE || atomic_load(&ctx_measured) || !device_is_slice(dev)) return;
    pthread_mutex_lock(&measure_lock);
    if (atomic_load(&ctx_measured)) {
        pthread_mutex_unlock(&measure_lock);
        return;
    }
    op->measuring = 1;
    mem_snap(&op->before);
}

/* After it: measure (first time), then charge the configured overhead and the context's cost. A
 * refusal returns CUDA_ERROR_OUT_OF_MEMORY and the caller undoes the creation. */
static CUresult ctx_end(gs_ctx_op *op, CUresult rc, CUdevice dev, CUcontext ctx)
{
    if (op->measuring) {
        if (rc == CUDA_SUCCESS) {
            gs_mem_snap *after = malloc(sizeof(*after));
            uint64_t cost = 0;
            if (after) {
                mem_snap(after);
                cost = measure_cost(&op->before, after);
                free(after);
            }
            atomic_store(&ctx_measured, cost + 1);
        }
        pthread_mutex_unlock(&measure_lock);
    }
    if (rc != CUDA_SUCCESS) return rc;
    if (charge_context(dev) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
    uint64_t m = atomic_load(&ctx_measured);
    if (m > 1 && gs_ensure_init() == GS_MODE_ACTIVE && device_is_slice(dev)) {
        if (gs_region_reserve(&gs_reg, m - 1) != 0 && reserve_retry(m - 1) != CUDA_SUCCESS) {
            gs_region_count_refused(&gs_reg);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        atomic_fetch_add(&ctx_cost[ctx_index((uintptr_t)ctx)], m - 1);
        context_bytes_add((int64_t)(m - 1));
    }
    note_host_pid();
    return CUDA_SUCCESS;
}

#define CTX_CREATE(call, dev)                                                                            \
    do {                                                                                                 \
        gs_ctx_op op_;                                                                                   \
        ctx_begin(&op_, dev);                                                                            \
        CUresult drv_ = (call);                                                                          \
        CUresult rc_ = ctx_end(&op_, drv_, dev, drv_ == CUDA_SUCCESS ? *pctx : NULL);                    \
        if (drv_ == CUDA_SUCCESS && rc_ != CUDA_SUCCESS) { /* no room for it: undo the creation */       \
            if (real_cuCtxDestroy_v2) real_cuCtxDestroy_v2(*pctx);                                       \
            *pctx = NULL;                                                                                \
        }                                                                                                \
        return rc_;                                                                                      \
    } while (0)

GS_EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    NEED_REAL(cuCtxCreate_v2);
    CTX_CREATE(real_cuCtxCreate_v2(pctx, flags, dev), dev);
}

GS_EXPORT CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    NEED_REAL(cuCtxCreate);
    CTX_CREATE(real_cuCtxCreate(pctx, flags, dev), dev);
}

GS_EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams,
                                  unsigned int flags, CUdevice dev)
{
    NEED_REAL(cuCtxCreate_v3);
    CTX_CREATE(real_cuCtxCreate_v3(pctx, paramsArray, numParams, flags, dev), dev);
}

GS_EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *ctxCreateParams, unsigned int flags,
                                  CUdevice dev)
{
    NEED_REAL(cuCtxCreate_v4);
    CTX_CREATE(real_cuCtxCreate_v4(pctx, ctxCreateParams, flags, dev), dev);
}

static _Atomic uintptr_t primary_of[GS_MAX_DEVICES]; /* each device's primary context, once retained */

static int primary_active(CUdevice dev)
{
    unsigned flags = 0;
    int active = 1;
    if (real_cuDevicePrimaryCtxGetState == NULL || real_cuDevicePrimaryCtxGetState(dev, &flags, &active) != CUDA_SUCCESS)
        return 1;
    return active;
}

static unsigned primary_idx(CUdevice dev)
{
    return dev >= 0 && dev < GS_MAX_DEVICES ? ctx_find(atomic_load(&primary_of[dev])) : 0;
}

/* The retain that makes the primary context active creates it (and its memory). */
GS_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    NEED_REAL(cuDevicePrimaryCtxRetain);
    pthread_mutex_lock(&primary_lock);
    int creates = !primary_active(dev);
    gs_ctx_op op = {0};
    if (creates) ctx_begin(&op, dev);
    CUresult drv = real_cuDevicePrimaryCtxRetain(pctx, dev), rc = drv;
    if (creates) rc = ctx_end(&op, drv, dev, drv == CUDA_SUCCESS ? *pctx : NULL);
    else if (drv == CUDA_SUCCESS && charge_context(dev) != 0) rc = CUDA_ERROR_OUT_OF_MEMORY;
    if (drv == CUDA_SUCCESS && rc != CUDA_SUCCESS) {
        if (real_cuDevicePrimaryCtxRelease_v2) real_cuDevicePrimaryCtxRelease_v2(dev);
        *pctx = NULL;
    }
    if (rc == CUDA_SUCCESS && pctx != NULL && dev >= 0 && dev < GS_MAX_DEVICES)
        atomic_store(&primary_of[dev], (uintptr_t)*pctx);
    pthread_mutex_unlock(&primary_lock);
    return rc;
}

GS_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    NEED_REAL(cuCtxDestroy_v2);
    unsigned idx = ctx_find((uintptr_t)ctx);
    CUresult rc = real_cuCtxDestroy_v2(ctx);
    if (rc == CUDA_SUCCESS) {
        credit_context(idx);
        credit_context_memory(idx);
    }
    return rc;
}

/* The last release destroys the primary context; the driver says whether it is still active. */
#define PRIMARY_RELEASE(name)                                                                            \
    do {                                                                                                 \
        NEED_REAL(name);                                                                                 \
        pthread_mutex_lock(&primary_lock);                                                               \
        CUresult rc_ = real_##name(dev);                                                                 \
        if (rc_ == CUDA_SUCCESS && !primary_active(dev)) {                                               \
            credit_context(primary_idx(dev));                                                            \
            credit_context_memory(primary_idx(dev));                                                     \
        }                                                                                                \
        pthread_mutex_unlock(&primary_lock);                                                             \
        return rc_;                                                                                      \
    } while (0)

GS_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    PRIMARY_RELEASE(cuDevicePrimaryCtxRelease_v2);
}

GS_EXPORT CUresult cuDevicePrimaryCtxRelease(CUdevice dev)
{
    PRIMARY_RELEASE(cuDevicePrimaryCtxRelease);
}

/* A reset frees the context's allocations and resets its limits; if the context is no longer
 * active afterwards, its own memory went too. */
#define PRIMARY_RESET(name)                                                                              \
    do {                                                                                                 \
        NEED_REAL(name);                                                                                 \
        pthread_mutex_lock(&primary_lock);                                                               \
        CUresult rc_ = real_##name(dev);                                                                 \
        if (rc_ == CUDA_SUCCESS) {                                                                       \
            credit_context(primary_idx(dev));                                                            \
            if (primary_active(dev)) credit_context_limits(primary_idx(dev));                            \
            else credit_context_memory(primary_idx(dev));                                                \
        }                                                                                                \
        pthread_mutex_unlock(&primary_lock);                                                             \
        return rc_;                                                                                      \
    } while (0)

GS_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    PRIMARY_RESET(cuDevicePrimaryCtxReset_v2);
}

GS_EXPORT CUresult cuDevicePrimaryCtxReset(CUdevice dev)
{
    PRIMARY_RESET(cuDevicePrimaryCtxReset);
}

/* cuCtxSetLimit: the malloc heap, the per-thread stack (times every thread the device holds
 * resident) and the printf FIFO are device memory the driver reserves. A limit raised above what the
 * context started with charges the difference before the driver is asked; lowering credits it. */
static int limit_kind(CUlimit limit)
{
    switch (limit) {
    case CU_LIMIT_MALLOC_HEAP_SIZE: return GS_LIM_HEAP;
    case CU_LIMIT_STACK_SIZE: return GS_LIM_STACK;
    case CU_LIMIT_PRINTF_FIFO_SIZE: return GS_LIM_FIFO;
    default: return -1;
    }
}

static uint64_t limit_bytes(int kind, uint64_t value, CUdevice dev)
{
    if (kind != GS_LIM_STACK) return value;
    int sms = 0, threads = 0;
    if (real_cuDeviceGetAttribute == NULL ||
        real_cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev) != CUDA_SUCCESS ||
        real_cuDeviceGetAttribute(&threads, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, dev) != CUDA_SUCCESS)
        return value * 2048 * 128; /* unknown device: a large one */
    return value * (uint64_t)(sms > 0 ? sms : 1) * (uint64_t)(threads > 0 ? threads : 1);
}

GS_EXPORT CUresult cuCtxSetLimit(CUlimit limit, size_t value)
{
    NEED_REAL(cuCtxSetLimit);
    int kind = limit_kind(limit);
    CUcontext c = NULL;
    CUdevice dev;
    size_t old = 0;
    if (kind < 0 || gs_ensure_init() != GS_MODE_ACTIVE || real_cuCtxGetCurrent == NULL || real_cuCtxGetLimit == NULL ||
        real_cuCtxGetCurrent(&c) != CUDA_SUCCESS || c == NULL || current_device(&dev) != 0 || !device_is_slice(dev) ||
        real_cuCtxGetLimit(&old, limit) != CUDA_SUCCESS)
        return real_cuCtxSetLimit(limit, value);
    unsigned idx = ctx_index((uintptr_t)c);
    if (idx == 0) return real_cuCtxSetLimit(limit, value);
    pthread_mutex_lock(&primary_lock); /* orders limit changes (rare) */
    uint64_t base1 = atomic_load(&ctx_limit_base[idx][kind]);
    if (base1 == 0) base1 = (uint64_t)old + 1; /* what the context started with is part of its cost */
    uint64_t base = limit_bytes(kind, base1 - 1, dev), want = limit_bytes(kind, value, dev);
    uint64_t now = atomic_load(&ctx_limit_charged[idx][kind]), next = want > base ? want - base : 0;
    if (next > now && gs_region_reserve(&gs_reg, next - now) != 0 && reserve_retry(next - now) != CUDA_SUCCESS) {
        gs_region_count_refused(&gs_reg);
        pthread_mutex_unlock(&primary_lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUresult rc = real_cuCtxSetLimit(limit, value);
    if (rc == CUDA_SUCCESS) {
        if (now > next) release(now - next);
        atomic_store(&ctx_limit_base[idx][kind], base1);
        atomic_store(&ctx_limit_charged[idx][kind], next);
        context_bytes_add((int64_t)next - (int64_t)now);
    } else if (next > now) {
        release(next - now); /* undo the reservation */
    }
    pthread_mutex_unlock(&primary_lock);
    return rc;
}

/* ------------------------------------------------------------------------------------------------
 * Graph memory nodes. The driver gives an executable graph's alloc nodes physical memory at its first
 * launch and keeps it across launches; destroying the executable returns it to the device's graph
 * pool, which keeps it reserved until cuDeviceGraphMemTrim. So: a graph remembers its alloc nodes'
 * bytes, an instantiation inherits them, the first launch charges them (taking from the pool's spare
 * first), destroying the executable moves them to the spare, and a trim credits the spare.
 * ---------------------------------------------------------------------------------------------- */

#define GS_GEXEC_BACKED (1ull << 63)
static _Atomic int has_graph_mem; /* some graph has alloc nodes: launches look their executable up */
static _Atomic uint64_t graph_spare;
static pthread_mutex_t graph_lock = PTHREAD_MUTEX_INITIALIZER;

GS_EXPORT CUresult cuGraphAddMemAllocNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                          size_t numDependencies, CUDA_MEM_ALLOC_NODE_PARAMS *nodeParams)
{
    NEED_REAL(cuGraphAddMemAllocNode);
    CUresult rc = real_cuGraphAddMemAllocNode(phGraphNode, hGraph, dependencies, numDependencies, nodeParams);
    if (rc != CUDA_SUCCESS || nodeParams == NULL || gs_ensure_init() != GS_MODE_ACTIVE) return rc;
    pthread_mutex_lock(&graph_lock);
    uint64_t v = 0;
    (void)gs_table_take(&tab_graph, (uint64_t)(uintptr_t)hGraph, &v);
    if (remember(&tab_graph, (uint64_t)(uintptr_t)hGraph, v + nodeParams->bytesize) != 0) rc = CUDA_ERROR_OUT_OF_MEMORY;
    atomic_store(&has_graph_mem, 1);
    pthread_mutex_unlock(&graph_lock);
    return rc;
}

static void graph_instantiated(CUresult rc, CUgraphExec *exec, CUgraph g)
{
    uint64_t v;
    if (rc != CUDA_SUCCESS || exec == NULL || !atomic_load(&has_graph_mem) || atomic_load(&gs_mode) != GS_MODE_ACTIVE)
        return;
    pthread_mutex_lock(&graph_lock);
    if (gs_table_get(&tab_graph, (uint64_t)(uintptr_t)g, &v) == 0 && v != 0)
        (void)remember(&tab_gexec, (uint64_t)(uintptr_t)*exec, v);
    pthread_mutex_unlock(&graph_lock);
}

GS_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags)
{
    NEED_REAL(cuGraphInstantiateWithFlags);
    CUresult rc = real_cuGraphInstantiateWithFlags(phGraphExec, hGraph, flags);
    graph_instantiated(rc, phGraphExec, hGraph);
    return rc;
}

GS_EXPORT CUresult cuGraphInstantiateWithParams(CUgraphExec *phGraphExec, CUgraph hGraph,
                                                CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams)
{
    NEED_REAL(cuGraphInstantiateWithParams);
    CUresult rc = real_cuGraphInstantiateWithParams(phGraphExec, hGraph, instantiateParams);
    graph_instantiated(rc, phGraphExec, hGraph);
    return rc;
}

GS_EXPORT CUresult cuGraphDestroy(CUgraph hGraph)
{
    NEED_REAL(cuGraphDestroy);
    CUresult rc = real_cuGraphDestroy(hGraph);
    uint64_t v;
    if (rc == CUDA_SUCCESS && atomic_load(&has_graph_mem) && atomic_load(&gs_mode) == GS_MODE_ACTIVE) {
        pthread_mutex_lock(&graph_lock);
        (void)gs_table_take(&tab_graph, (uint64_t)(uintptr_t)hGraph, &v);
        pthread_mutex_unlock(&graph_lock);
    }
    return rc;
}

GS_EXPORT CUresult cuGraphExecDestroy(CUgraphExec hGraphExec)
{
    NEED_REAL(cuGraphExecDestroy);
    CUresult rc = real_cuGraphExecDestroy(hGraphExec);
    uint64_t v;
    if (rc == CUDA_SUCCESS && atomic_load(&has_graph_mem) && atomic_load(&gs_mode) == GS_MODE_ACTIVE) {
        pthread_mutex_lock(&graph_lock);
        if (gs_table_take(&tab_gexec, (uint64_t)(uintptr_t)hGraphExec, &v) == 0 && (v & GS_GEXEC_BACKED))
            atomic_fetch_add(&graph_spare, v & ~GS_GEXEC_BACKED); /* kept by the device's graph pool */
        pthread_mutex_unlock(&graph_lock);
    }
    return rc;
}

GS_EXPORT CUresult cuDeviceGraphMemTrim(CUdevice device)
{
    NEED_REAL(cuDeviceGraphMemTrim);
    CUresult rc = real_cuDeviceGraphMemTrim(device);
    if (rc == CUDA_SUCCESS && atomic_load(&gs_mode) == GS_MODE_ACTIVE && device_is_slice(device)) {
        pthread_mutex_lock(&graph_lock);
        release(atomic_exchange(&graph_spare, 0));
        pthread_mutex_unlock(&graph_lock);
    }
    return rc;
}

/* Launching an executable whose memory is not backed yet: reserve -> launch -> mark backed / undo. */
static CUresult graph_launch(CUresult (*fn)(CUgraphExec, CUstream), CUgraphExec g, CUstream s)
{
    uint64_t v, key = (uint64_t)(uintptr_t)g;
    pthread_mutex_lock(&graph_lock);
    if (gs_table_get(&tab_gexec, key, &v) != 0 || (v & GS_GEXEC_BACKED)) {
        pthread_mutex_unlock(&graph_lock);
        return fn(g, s);
    }
    uint64_t spare = atomic_load(&graph_spare), from_spare = spare < v ? spare : v;
    if (from_spare < v && reserve_current(v - from_spare) != CUDA_SUCCESS) {
        pthread_mutex_unlock(&graph_lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    atomic_fetch_sub(&graph_spare, from_spare);
    CUresult rc = fn(g, s);
    if (rc == CUDA_SUCCESS) {
        (void)gs_table_take(&tab_gexec, key, &v);
        (void)gs_table_put(&tab_gexec, key, v | GS_GEXEC_BACKED);
    } else {
        atomic_fetch_add(&graph_spare, from_spare);
        if (from_spare < v) release(v - from_spare);
    }
    pthread_mutex_unlock(&graph_lock);
    return rc;
}

/* A forked child holds none of its parent's pools, graphs or contexts, and has its own pid. */
static void gs_usage_after_fork_child(void)
{
    memset(pool_recs, 0, sizeof(pool_recs));
    atomic_store(&pool_slack, 0);
    gs_table_clear(&tab_graph);
    gs_table_clear(&tab_gexec);
    atomic_store(&graph_spare, 0);
    atomic_store(&own_host_pid, 0);
    pthread_mutex_init(&pool_lock, NULL);
    pthread_mutex_init(&graph_lock, NULL);
    pthread_mutex_init(&measure_lock, NULL);
    pthread_mutex_init(&primary_lock, NULL);
}

/* ------------------------------------------------------------------------------------------------
 * External memory (Vulkan, EGL, ... allocations imported into CUDA): memory the slice uses that no
 * CUDA allocation of it paid for. Charged at import by the descriptor's size, credited at destroy.
 * ---------------------------------------------------------------------------------------------- */

GS_EXPORT CUresult cuImportExternalMemory(CUexternalMemory *extMem_out, const CUDA_EXTERNAL_MEMORY_HANDLE_DESC *desc)
{
    NEED_REAL(cuImportExternalMemory);
    if (extMem_out == NULL || desc == NULL || desc->size == 0) return real_cuImportExternalMemory(extMem_out, desc);
    uint64_t bytes = desc->size;
    CUresult rc = reserve_current(bytes);
    if (rc != CUDA_SUCCESS) return rc;
    rc = real_cuImportExternalMemory(extMem_out, desc);
    if (rc != CUDA_SUCCESS) {
        release(bytes);
        return rc;
    }
    if (remember(&tab_array, (uint64_t)(uintptr_t)*extMem_out, bytes) != 0) {
        real_cuDestroyExternalMemory(*extMem_out);
        release(bytes);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return rc;
}

GS_EXPORT CUresult cuDestroyExternalMemory(CUexternalMemory extMem)
{
    NEED_REAL(cuDestroyExternalMemory);
    FREE_WITH_CREDIT(tab_array, (uintptr_t)extMem, real_cuDestroyExternalMemory(extMem));
}

/* ------------------------------------------------------------------------------------------------
 * Reporting: the slice, not the card.
 * ---------------------------------------------------------------------------------------------- */

/* Fills free/total for the slice on `dev`; returns 0 when the physical values should be kept. */
static int slice_mem_info(CUdevice dev, uint64_t *free_b, uint64_t *total_b)
{
    int mode = gs_ensure_init();
    if (mode == GS_MODE_FAIL_CLOSED) {
        *free_b = 0;
        *total_b = 0;
        return 1;
    }
    if (gs_cfg.memory_bytes == GS_UNLIMITED) return 0;
    if (!device_is_slice(dev)) {
        *free_b = 0;
        *total_b = 0;
        return 1;
    }
    if (GS_UNLIKELY(atomic_load_explicit(&pool_slack, memory_order_relaxed))) pools_settle();
    uint64_t used = gs_region_used_total(&gs_reg);
    *total_b = gs_cfg.memory_bytes;
    *free_b = used < gs_cfg.memory_bytes ? gs_cfg.memory_bytes - used : 0;
    return 1;
}


GS_EXPORT CUresult cuMemGetInfo_v2(size_t *free, size_t *total)
{
    NEED_REAL(cuMemGetInfo_v2);
    size_t pf = 0, pt = 0;
    CUresult rc = real_cuMemGetInfo_v2(&pf, &pt);
    if (rc != CUDA_SUCCESS) return rc;
    CUdevice dev;
    uint64_t sf, st;
    if (current_device(&dev) == 0 && slice_mem_info(dev, &sf, &st)) {
        pf = sf < pf ? sf : pf; /* never promise more than the card has free */
        pt = st < pt || st == 0 ? st : pt; /* nor more than the card has */
    }
    if (free) *free = pf;
    if (total) *total = pt;
    return rc;
}

GS_EXPORT CUresult cuMemGetInfo(unsigned int *free, unsigned int *total)
{
    size_t f = 0, t = 0;
    CUresult rc = cuMemGetInfo_v2(&f, &t);
    if (rc != CUDA_SUCCESS) return rc;
    if (free) *free = f > 0xffffffffu ? 0xffffffffu : (unsigned int)f;
    if (total) *total = t > 0xffffffffu ? 0xffffffffu : (unsigned int)t;
    return rc;
}

GS_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    NEED_REAL(cuDeviceTotalMem_v2);
    CUresult rc = real_cuDeviceTotalMem_v2(bytes, dev);
    uint64_t sf, st;
    if (rc == CUDA_SUCCESS && bytes != NULL && slice_mem_info(dev, &sf, &st) && st < *bytes) *bytes = st;
    return rc;
}

GS_EXPORT CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev)
{
    size_t t = 0;
    CUresult rc = cuDeviceTotalMem_v2(&t, dev);
    if (rc == CUDA_SUCCESS && bytes) *bytes = t > 0xffffffffu ? 0xffffffffu : (unsigned int)t;
    return rc;
}

/* ------------------------------------------------------------------------------------------------
 * Launches: cooperative throttle toward the compute share.
 * ---------------------------------------------------------------------------------------------- */

#define LAUNCH(name, ...)                                                                                \
    do {                                                                                                 \
        NEED_REAL(name);                                                                                 \
        if (GS_UNLIKELY(gs_ensure_init() == GS_MODE_UNINIT)) return CUDA_ERROR_NOT_INITIALIZED;          \
        gs_throttle_before_launch();                                                                     \
        return real_##name(__VA_ARGS__);                                                                 \
    } while (0)

GS_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                                  unsigned int by, unsigned int bz, unsigned int shmem, CUstream s, void **params,
                                  void **extra)
{
    LAUNCH(cuLaunchKernel, f, gx, gy, gz, bx, by, bz, shmem, s, params, extra);
}

GS_EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                       unsigned int bx, unsigned int by, unsigned int bz, unsigned int shmem,
                                       CUstream s, void **params, void **extra)
{
    LAUNCH(cuLaunchKernel_ptsz, f, gx, gy, gz, bx, by, bz, shmem, s, params, extra);
}

GS_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **params, void **extra)
{
    LAUNCH(cuLaunchKernelEx, config, f, params, extra);
}

GS_EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **params, void **extra)
{
    LAUNCH(cuLaunchKernelEx_ptsz, config, f, params, extra);
}

GS_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                             unsigned int bx, unsigned int by, unsigned int bz, unsigned int shmem,
                                             CUstream s, void **params)
{
    LAUNCH(cuLaunchCooperativeKernel, f, gx, gy, gz, bx, by, bz, shmem, s, params);
}

GS_EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                                  unsigned int bx, unsigned int by, unsigned int bz,
                                                  unsigned int shmem, CUstream s, void **params)
{
    LAUNCH(cuLaunchCooperativeKernel_ptsz, f, gx, gy, gz, bx, by, bz, shmem, s, params);
}

#define GRAPH_LAUNCH(name)                                                                               \
    do {                                                                                                 \
        NEED_REAL(name);                                                                                 \
        if (GS_UNLIKELY(gs_ensure_init() == GS_MODE_UNINIT)) return CUDA_ERROR_NOT_INITIALIZED;          \
        gs_throttle_before_launch();                                                                     \
        if (GS_UNLIKELY(atomic_load_explicit(&has_graph_mem, memory_order_relaxed)) &&                   \
            atomic_load(&gs_mode) == GS_MODE_ACTIVE)                                                     \
            return graph_launch(real_##name, g, s);                                                      \
        return real_##name(g, s);                                                                        \
    } while (0)

GS_EXPORT CUresult cuGraphLaunch(CUgraphExec g, CUstream s)
{
    GRAPH_LAUNCH(cuGraphLaunch);
}

GS_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec g, CUstream s)
{
    GRAPH_LAUNCH(cuGraphLaunch_ptsz);
}

GS_EXPORT CUresult cuLaunch(CUfunction f)
{
    LAUNCH(cuLaunch, f);
}

GS_EXPORT CUresult cuLaunchGrid(CUfunction f, int w, int h)
{
    LAUNCH(cuLaunchGrid, f, w, h);
}

GS_EXPORT CUresult cuLaunchGridAsync(CUfunction f, int w, int h, CUstream s)
{
    LAUNCH(cuLaunchGridAsync, f, w, h, s);
}

/* ------------------------------------------------------------------------------------------------
 * cuGetProcAddress: whatever the driver hands out for a wrapped entry point becomes the wrapper.
 * ---------------------------------------------------------------------------------------------- */

GS_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                       CUdriverProcAddressQueryResult *symbolStatus)
{
    NEED_REAL(cuGetProcAddress_v2);
    CUresult rc = real_cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, symbolStatus);
    if (rc == CUDA_SUCCESS && pfn != NULL) {
        void *got = *pfn;
        *pfn = substitute(got, cuda_syms, GS_NSYMS(cuda_syms));
        if (*pfn == got && got != NULL) rc = procaddr_by_name(symbol, pfn, cudaVersion, flags);
        if (rc != CUDA_SUCCESS && symbolStatus) *symbolStatus = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    }
    return rc;
}

GS_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    NEED_REAL(cuGetProcAddress);
    CUresult rc = real_cuGetProcAddress(symbol, pfn, cudaVersion, flags);
    if (rc == CUDA_SUCCESS && pfn != NULL) {
        void *got = *pfn;
        *pfn = substitute(got, cuda_syms, GS_NSYMS(cuda_syms));
        if (*pfn == got && got != NULL) rc = procaddr_by_name(symbol, pfn, cudaVersion, flags);
    }
    return rc;
}

/* ------------------------------------------------------------------------------------------------
 * NVML: memory info of the slice's GPU is the slice.
 * ---------------------------------------------------------------------------------------------- */

static int nvml_slice_info(nvmlDevice_t device, uint64_t *total, uint64_t *used)
{
    int mode = gs_ensure_init();
    if (mode == GS_MODE_FAIL_CLOSED) {
        *total = 0;
        *used = 0;
        return 1;
    }
    if (gs_cfg.memory_bytes == GS_UNLIMITED) return 0;
    char uuid[96] = {0};
    int is_slice = real_nvmlDeviceGetUUID != NULL && real_nvmlDeviceGetUUID(device, uuid, sizeof(uuid)) == NVML_SUCCESS &&
                   strcasecmp(uuid, gs_cfg.gpu_uuid_text) == 0;
    if (!is_slice) {
        *total = 0;
        *used = 0;
        return 1;
    }
    uint64_t u = gs_region_used_total(&gs_reg);
    *total = gs_cfg.memory_bytes;
    *used = u < *total ? u : *total;
    return 1;
}

GS_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    if (nvml_real() != 0 || real_nvmlDeviceGetMemoryInfo == NULL) return NVML_ERROR_LIBRARY_NOT_FOUND;
    nvmlReturn_t rc = real_nvmlDeviceGetMemoryInfo(device, memory);
    uint64_t total, used;
    if (rc == NVML_SUCCESS && memory != NULL && nvml_slice_info(device, &total, &used)) {
        if (total > memory->total) total = memory->total; /* never more than the card */
        if (used > total) used = total;
        uint64_t free_b = total - used;
        memory->free = free_b < memory->free ? free_b : memory->free; /* nor more than it has free */
        memory->total = total;
        memory->used = used;
    }
    return rc;
}

GS_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    if (nvml_real() != 0 || real_nvmlDeviceGetMemoryInfo_v2 == NULL) return NVML_ERROR_LIBRARY_NOT_FOUND;
    nvmlReturn_t rc = real_nvmlDeviceGetMemoryInfo_v2(device, memory);
    uint64_t total, used;
    if (rc == NVML_SUCCESS && memory != NULL && nvml_slice_info(device, &total, &used)) {
        if (total > memory->total) total = memory->total;
        if (used > total) used = total;
        uint64_t free_b = total - used;
        memory->free = free_b < memory->free ? free_b : memory->free;
        memory->total = total;
        memory->reserved = 0;
        memory->used = used;
    }
    return rc;
}

/* ------------------------------------------------------------------------------------------------
 * NVML process lists and utilization: the slice's own processes, its own share.
 * ---------------------------------------------------------------------------------------------- */

/* 1 when the device's per-process figures must be restricted to the slice (0: show the driver's). */
static int nvml_filters(nvmlDevice_t device)
{
    int mode = gs_ensure_init();
    if (mode == GS_MODE_FAIL_CLOSED) return 1;
    (void)device;
    return 1; /* other tenants' processes on the card, or other cards, are never the slice's */
}

static int nvml_pid_visible(nvmlDevice_t device, unsigned int pid)
{
    if (gs_ensure_init() != GS_MODE_ACTIVE) return 0;
    char uuid[96] = {0};
    if (real_nvmlDeviceGetUUID == NULL || real_nvmlDeviceGetUUID(device, uuid, sizeof(uuid)) != NVML_SUCCESS ||
        strcasecmp(uuid, gs_cfg.gpu_uuid_text) != 0)
        return 0; /* a device the slice is not on */
    note_host_pid();
    return gs_region_has_nvml_pid(&gs_reg, (int32_t)pid);
}

typedef nvmlReturn_t (*gs_list_fn)(nvmlDevice_t, unsigned int *, void *);

/* Calls a process-list entry point and keeps the slice's processes (pid is each record's first field). */
static nvmlReturn_t filter_list(gs_list_fn fn, nvmlDevice_t device, unsigned int *count, void *infos, size_t stride)
{
    if (count == NULL || !nvml_filters(device)) return fn(device, count, infos);
    unsigned int cap = infos ? *count : 0, n = 64;
    for (int attempt = 0; attempt < 4; attempt++) {
        char *buf = malloc((size_t)n * stride);
        if (buf == NULL) return NVML_ERROR_MEMORY;
        unsigned int got = n;
        nvmlReturn_t rc = fn(device, &got, buf);
        if (rc == NVML_ERROR_INSUFFICIENT_SIZE) {
            free(buf);
            n = got + 16;
            continue;
        }
        if (rc != NVML_SUCCESS) {
            free(buf);
            return rc;
        }
        unsigned int kept = 0;
        for (unsigned int i = 0; i < got; i++) {
            unsigned int pid;
            memcpy(&pid, buf + (size_t)i * stride, sizeof(pid));
            if (!nvml_pid_visible(device, pid)) continue;
            if (kept < cap) memcpy((char *)infos + (size_t)kept * stride, buf + (size_t)i * stride, stride);
            kept++;
        }
        free(buf);
        *count = kept;
        return kept > cap ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
    }
    return NVML_ERROR_UNKNOWN;
}

#define NVML_LIST(name, type)                                                                            \
    GS_EXPORT nvmlReturn_t name(nvmlDevice_t device, unsigned int *infoCount, type *infos)               \
    {                                                                                                    \
        if (nvml_real() != 0 || real_##name == NULL) return NVML_ERROR_FUNCTION_NOT_FOUND;               \
        return filter_list((gs_list_fn)real_##name, device, infoCount, infos, sizeof(type));             \
    }

NVML_LIST(nvmlDeviceGetComputeRunningProcesses, nvmlProcessInfo_v1_t)
NVML_LIST(nvmlDeviceGetComputeRunningProcesses_v2, nvmlProcessInfo_v2_t)
NVML_LIST(nvmlDeviceGetComputeRunningProcesses_v3, nvmlProcessInfo_t)
NVML_LIST(nvmlDeviceGetGraphicsRunningProcesses, nvmlProcessInfo_v1_t)
NVML_LIST(nvmlDeviceGetGraphicsRunningProcesses_v2, nvmlProcessInfo_v2_t)
NVML_LIST(nvmlDeviceGetGraphicsRunningProcesses_v3, nvmlProcessInfo_t)

typedef struct {
    unsigned long long since;
    nvmlReturn_t (*fn)(nvmlDevice_t, nvmlProcessUtilizationSample_t *, unsigned int *, unsigned long long);
} gs_util_call;
static __thread gs_util_call tl_util;

static nvmlReturn_t util_as_list(nvmlDevice_t device, unsigned int *count, void *samples)
{
    return tl_util.fn(device, samples, count, tl_util.since);
}

GS_EXPORT nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t *utilization,
                                                        unsigned int *processSamplesCount,
                                                        unsigned long long lastSeenTimeStamp)
{
    if (nvml_real() != 0 || real_nvmlDeviceGetProcessUtilization == NULL) return NVML_ERROR_FUNCTION_NOT_FOUND;
    tl_util = (gs_util_call){lastSeenTimeStamp, real_nvmlDeviceGetProcessUtilization};
    return filter_list(util_as_list, device, processSamplesCount, utilization, sizeof(*utilization));
}

/* The card's utilization is other tenants' business: the slice sees its own, as a share of its
 * compute quota (a 25 % slice running flat out reads 100 %). */
GS_EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization)
{
    if (nvml_real() != 0 || real_nvmlDeviceGetUtilizationRates == NULL) return NVML_ERROR_FUNCTION_NOT_FOUND;
    nvmlReturn_t rc = real_nvmlDeviceGetUtilizationRates(device, utilization);
    if (rc != NVML_SUCCESS || utilization == NULL) return rc;
    int mode = gs_ensure_init();
    if (mode == GS_MODE_FAIL_CLOSED) {
        utilization->gpu = utilization->memory = 0;
        return rc;
    }
    if (gs_cfg.memory_bytes == GS_UNLIMITED && gs_cfg.compute_share >= 100) return rc;
    char uuid[96] = {0};
    if (real_nvmlDeviceGetUUID == NULL || real_nvmlDeviceGetUUID(device, uuid, sizeof(uuid)) != NVML_SUCCESS ||
        strcasecmp(uuid, gs_cfg.gpu_uuid_text) != 0) {
        utilization->gpu = utilization->memory = 0;
        return rc;
    }
    double u = gs_slice_utilization();
    if (u < 0) u = 0;
    double share = gs_cfg.compute_share ? (double)gs_cfg.compute_share : 100.0;
    double pct = u * 100.0 / share;
    utilization->gpu = (unsigned int)(pct > 100 ? 100 : pct + 0.5);
    if (utilization->memory > utilization->gpu) utilization->memory = utilization->gpu;
    return rc;
}
