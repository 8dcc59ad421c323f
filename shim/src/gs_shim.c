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

static gs_table tab_dptr;  /* device pointers: cuMemAlloc*, managed, async, pools, IPC opens */
static gs_table tab_vmm;   /* cuMemCreate handles */
static gs_table tab_array; /* CUarray and CUmipmappedArray handles */
static gs_table tab_pool;  /* pools created with a non-device location (their allocations are free) */

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
    X(cuMemAllocFromPoolAsync_ptsz) X(cuMemCreate) X(cuMemRelease) X(cuArrayCreate) X(cuArrayCreate_v2)   \
    X(cuArray3DCreate) X(cuArray3DCreate_v2) X(cuArrayDestroy) X(cuMipmappedArrayCreate) X(cuMipmappedArrayDestroy)         \
    X(cuIpcOpenMemHandle) X(cuIpcOpenMemHandle_v2) X(cuIpcCloseMemHandle) X(cuMemGetInfo)                \
    X(cuMemGetInfo_v2) X(cuDeviceTotalMem) X(cuDeviceTotalMem_v2) X(cuCtxCreate) X(cuCtxCreate_v2)       \
    X(cuCtxCreate_v3) X(cuCtxCreate_v4) X(cuDevicePrimaryCtxRetain) X(cuLaunchKernel)                    \
    X(cuLaunchKernel_ptsz) X(cuLaunchKernelEx) X(cuLaunchKernelEx_ptsz) X(cuLaunchCooperativeKernel)     \
    X(cuLaunchCooperativeKernel_ptsz) X(cuGraphLaunch) X(cuGraphLaunch_ptsz) X(cuLaunch) X(cuLaunchGrid) \
    X(cuLaunchGridAsync) X(cuGetProcAddress) X(cuGetProcAddress_v2)

#define GS_CUDA_HELPERS(X)                                                                               \
    X(cuCtxGetDevice) X(cuDeviceGetCount) X(cuDeviceGetUuid) X(cuDeviceGetUuid_v2)                      \
    X(cuMemGetAddressRange_v2) X(cuCtxDestroy_v2) X(cuDevicePrimaryCtxRelease_v2)

#define GS_NVML_WRAPPED(X) X(nvmlDeviceGetMemoryInfo) X(nvmlDeviceGetMemoryInfo_v2)
#define GS_NVML_HELPERS(X) X(nvmlDeviceGetUUID)

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

static void *dlsym_driver(void *handle, const char *symbol)
{
    void *fn = real_dlsym(handle, symbol);
    if (fn == NULL) return NULL;
    if (symbol[0] == 'c') {
        if (resolve_lib("libcuda.so.1", &cuda_handle, cuda_syms, GS_NSYMS(cuda_syms), &cuda_ready, 0) == 0)
            return substitute(fn, cuda_syms, GS_NSYMS(cuda_syms));
    } else if (resolve_lib("libnvidia-ml.so.1", &nvml_handle, nvml_syms, GS_NSYMS(nvml_syms), &nvml_ready, 0) == 0) {
        return substitute(fn, nvml_syms, GS_NSYMS(nvml_syms));
    }
    return fn;
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

static void after_fork_child(void)
{
    gs_region_after_fork_child(&gs_reg);
    gs_table_clear(&tab_dptr);
    gs_table_clear(&tab_vmm);
    gs_table_clear(&tab_array);
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

    char err[512];
    int mode = GS_MODE_ACTIVE;
    if (gs_config_load(path, &gs_cfg, err, sizeof(err)) != 0) {
        gs_log("slice config %s is unusable (%s); this process gets no GPU memory (fail closed)", path, err);
        mode = GS_MODE_FAIL_CLOSED;
    } else if (gs_region_open(&gs_reg, &gs_cfg, err, sizeof(err)) != 0) {
        gs_log("%s; this process gets no GPU memory (fail closed)", err);
        mode = GS_MODE_FAIL_CLOSED;
    } else if (gs_table_init(&tab_dptr, 18) != 0 || gs_table_init(&tab_vmm, 14) != 0 ||
               gs_table_init(&tab_array, 14) != 0 || gs_table_init(&tab_pool, 10) != 0) {
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

/* 1 when memory on the current context's device counts against the slice and may be allocated. */
static inline int current_device_is_slice(void)
{
    if (GS_LIKELY(atomic_load_explicit(&only_device_is_slice, memory_order_relaxed))) return 1;
    CUdevice dev;
    /* Without a current context the driver call fails on its own; reserve anyway and roll back. */
    if (real_cuCtxGetDevice == NULL || real_cuCtxGetDevice(&dev) != CUDA_SUCCESS) return 1;
    return device_is_slice(dev);
}

/* Reserves bytes for an allocation on the current device: CUDA_SUCCESS or CUDA_ERROR_OUT_OF_MEMORY. */
static inline CUresult reserve_current(uint64_t bytes)
{
    int mode = gs_ensure_init();
    if (GS_UNLIKELY(mode != GS_MODE_ACTIVE)) return CUDA_ERROR_OUT_OF_MEMORY;
    if (GS_UNLIKELY(!current_device_is_slice())) {
        gs_region_count_refused(&gs_reg);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return gs_region_reserve(&gs_reg, bytes) == 0 ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
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

static inline void forget_and_credit(gs_table *t, uint64_t key)
{
    uint64_t bytes;
    if (atomic_load_explicit(&gs_mode, memory_order_relaxed) == GS_MODE_ACTIVE && gs_table_take(t, key, &bytes) == 0)
        release(bytes);
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
            if (rc_ == CUDA_SUCCESS) release(bytes_);                                                    \
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
    if (GS_UNLIKELY(remember(&tab_dptr, *dptr, bytesize) != 0)) {
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
    if (remember(&tab_dptr, *dptr, bytesize) != 0) {
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
    if (remember(&tab_dptr, *dptr, bytesize) != 0) {
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
    if (remember(&tab_dptr, *dptr, actual) != 0) {
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
    if (remember(&tab_dptr, *dptr, actual) != 0) {
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

static CUresult alloc_async(CUresult (*fn)(CUdeviceptr *, size_t, CUstream), CUdeviceptr *dptr, size_t size,
                            CUstream stream)
{
    if (size == 0 || dptr == NULL) return fn(dptr, size, stream);
    CUresult rc = reserve_current(size);
    if (rc != CUDA_SUCCESS) return rc;
    rc = fn(dptr, size, stream);
    if (rc != CUDA_SUCCESS) {
        release(size);
        return rc;
    }
    if (remember(&tab_dptr, *dptr, size) != 0) {
        real_cuMemFreeAsync(*dptr, stream);
        release(size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return rc;
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
    if (rc == CUDA_SUCCESS && atomic_load(&gs_mode) == GS_MODE_ACTIVE)
        (void)gs_table_take(&tab_pool, (uint64_t)(uintptr_t)pool, &v);
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
    if (gs_ensure_init() == GS_MODE_ACTIVE && pool_is_host(pool)) return fn(dptr, size, pool, stream);
    CUresult rc = reserve_current(size);
    if (rc != CUDA_SUCCESS) return rc;
    rc = fn(dptr, size, pool, stream);
    if (rc != CUDA_SUCCESS) {
        release(size);
        return rc;
    }
    if (remember(&tab_dptr, *dptr, size) != 0) {
        real_cuMemFreeAsync(*dptr, stream);
        release(size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return rc;
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
 * Virtual memory management: only physical memory on a device location counts.
 * ---------------------------------------------------------------------------------------------- */

GS_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                               unsigned long long flags)
{
    NEED_REAL(cuMemCreate);
    if (prop == NULL || handle == NULL || size == 0 || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return real_cuMemCreate(handle, size, prop, flags);
    CUresult rc = reserve_on(prop->location.id, size);
    if (rc != CUDA_SUCCESS) return rc;
    rc = real_cuMemCreate(handle, size, prop, flags);
    if (rc != CUDA_SUCCESS) {
        release(size);
        return rc;
    }
    if (remember(&tab_vmm, *handle, size) != 0) {
        real_cuMemRelease(*handle);
        release(size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return rc;
}

GS_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    NEED_REAL(cuMemRelease);
    FREE_WITH_CREDIT(tab_vmm, handle, real_cuMemRelease(handle));
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

static CUresult ipc_open(CUresult (*fn)(CUdeviceptr *, CUipcMemHandle, unsigned int), CUdeviceptr *pdptr,
                         CUipcMemHandle handle, unsigned int flags)
{
    int mode = gs_ensure_init();
    if (mode != GS_MODE_ACTIVE) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = fn(pdptr, handle, flags);
    if (rc != CUDA_SUCCESS) return rc;
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
    if (remember(&tab_dptr, *pdptr, size) != 0) {
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

static _Atomic uint64_t ctx_charged; /* bit per device ordinal */

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

#define CTX_CREATE(call, dev)                                                                            \
    do {                                                                                                 \
        CUresult rc_ = (call);                                                                           \
        if (rc_ == CUDA_SUCCESS && charge_context(dev) != 0) {                                           \
            if (real_cuCtxDestroy_v2) real_cuCtxDestroy_v2(*pctx);                                       \
            *pctx = NULL;                                                                                \
            return CUDA_ERROR_OUT_OF_MEMORY;                                                             \
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

GS_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    NEED_REAL(cuDevicePrimaryCtxRetain);
    CUresult rc = real_cuDevicePrimaryCtxRetain(pctx, dev);
    if (rc == CUDA_SUCCESS && charge_context(dev) != 0) {
        if (real_cuDevicePrimaryCtxRelease_v2) real_cuDevicePrimaryCtxRelease_v2(dev);
        *pctx = NULL;
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return rc;
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
    uint64_t used = gs_region_used_total(&gs_reg);
    *total_b = gs_cfg.memory_bytes;
    *free_b = used < gs_cfg.memory_bytes ? gs_cfg.memory_bytes - used : 0;
    return 1;
}

static int current_device(CUdevice *dev)
{
    return real_cuCtxGetDevice != NULL && real_cuCtxGetDevice(dev) == CUDA_SUCCESS ? 0 : -1;
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
        pt = st;
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
    if (rc == CUDA_SUCCESS && bytes != NULL && slice_mem_info(dev, &sf, &st)) *bytes = st;
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

GS_EXPORT CUresult cuGraphLaunch(CUgraphExec g, CUstream s)
{
    LAUNCH(cuGraphLaunch, g, s);
}

GS_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec g, CUstream s)
{
    LAUNCH(cuGraphLaunch_ptsz, g, s);
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
    if (rc == CUDA_SUCCESS && pfn != NULL) *pfn = substitute(*pfn, cuda_syms, GS_NSYMS(cuda_syms));
    return rc;
}

GS_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    NEED_REAL(cuGetProcAddress);
    CUresult rc = real_cuGetProcAddress(symbol, pfn, cudaVersion, flags);
    if (rc == CUDA_SUCCESS && pfn != NULL) *pfn = substitute(*pfn, cuda_syms, GS_NSYMS(cuda_syms));
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
        memory->total = total;
        memory->used = used;
        memory->free = total - used;
    }
    return rc;
}

GS_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    if (nvml_real() != 0 || real_nvmlDeviceGetMemoryInfo_v2 == NULL) return NVML_ERROR_LIBRARY_NOT_FOUND;
    nvmlReturn_t rc = real_nvmlDeviceGetMemoryInfo_v2(device, memory);
    uint64_t total, used;
    if (rc == NVML_SUCCESS && memory != NULL && nvml_slice_info(device, &total, &used)) {
        memory->total = total;
        memory->reserved = 0;
        memory->used = used;
        memory->free = total - used;
    }
    return rc;
}
