/*
 * Fake libcuda.so.1, its core: devices, contexts, linear and pool memory, IPC, graph memory, events
 * (the other API families are in cuda_*.c), over host memory. Device memory is anonymous host memory mapped per allocation (MAP_NORESERVE: pages
 * exist only once touched); exporting it for IPC moves it onto a memfd at the same address, so another
 * process can open the handle like on a real GPU. Kernels are
 * not executed: a module's "PTX" may say `// gpuslice-fake: duration_us=N`, and each launch of its
 * functions occupies the device for N microseconds on a timeline shared by all processes (that is
 * what NVML utilization reports). Error codes are the driver's.
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "fake_cuda.h"
#include "fake_module.h"
#include "fake_health.h"

_Atomic int initialized;
__thread struct CUctx_st *current_ctx;
alloc *buckets[NBUCKETS];
pthread_mutex_t alloc_lock = PTHREAD_MUTEX_INITIALIZER;
const uint64_t limit_default[LIM_N] = {8u << 20, 1024, 1u << 20};
struct CUctx_st primary_ctx[FAKE_MAX_GPUS];
vmm_alloc *vmm_live; /* handles are checked against this list, never dereferenced blindly */
pthread_mutex_t vmm_lock = PTHREAD_MUTEX_INITIALIZER;
struct CUmemPoolHandle_st default_pool[FAKE_MAX_GPUS];
struct CUmemPoolHandle_st *pools; /* device pools created by cuMemPoolCreate */
pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
pthread_mutex_t primary_lock = PTHREAD_MUTEX_INITIALIZER; /* primary contexts and context limits */
uint64_t graph_spare[FAKE_MAX_GPUS], graph_backed[FAKE_MAX_GPUS]; /* under pool_lock */


fake_system *sys(void)
{
    return fake_system_get();
}

int valid_dev(CUdevice d)
{
    return d >= 0 && d < sys()->count;
}

/* ---------------------------------------------------------------- memory accounting of the card */

/* The card's accounting is the double's (fake_common): through the host daemon when it serves. */
CUresult charge(int dev, uint64_t size)
{
    if (fake_health_cuda_error(dev)) return (CUresult)fake_health_cuda_error(dev); /* a failed card */
    return fake_charge(sys()->state[dev], size) == 0 ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

void uncharge(int dev, uint64_t size)
{
    fake_uncharge(sys()->state[dev], size);
}

void track_alloc(const alloc *rec)
{
    alloc *a = malloc(sizeof(*a));
    if (!a) abort();
    *a = *rec;
    pthread_mutex_lock(&alloc_lock);
    unsigned b = (unsigned)((a->ptr >> 12) % NBUCKETS);
    a->next = buckets[b];
    buckets[b] = a;
    pthread_mutex_unlock(&alloc_lock);
}

void track(uint64_t ptr, uint64_t size, int dev, int kind)
{
    track_alloc(&(alloc){ptr, size, dev, kind, -1, 0, current_ctx, 0, NULL});
}

alloc *untrack(uint64_t ptr)
{
    pthread_mutex_lock(&alloc_lock);
    unsigned b = (unsigned)((ptr >> 12) % NBUCKETS);
    for (alloc **pp = &buckets[b]; *pp; pp = &(*pp)->next) {
        if ((*pp)->ptr == ptr) {
            alloc *a = *pp;
            *pp = a->next;
            pthread_mutex_unlock(&alloc_lock);
            return a;
        }
    }
    pthread_mutex_unlock(&alloc_lock);
    return NULL;
}

int find_range(uint64_t ptr, uint64_t *base, uint64_t *size)
{
    int found = 0;
    pthread_mutex_lock(&alloc_lock);
    for (unsigned b = 0; b < NBUCKETS && !found; b++)
        for (alloc *a = buckets[b]; a; a = a->next)
            if (ptr >= a->ptr && ptr < a->ptr + a->size) {
                *base = a->ptr;
                *size = a->size;
                found = 1;
                break;
            }
    pthread_mutex_unlock(&alloc_lock);
    return found;
}

int find_alloc(uint64_t ptr, alloc *out)
{
    int found = 0;
    pthread_mutex_lock(&alloc_lock);
    for (unsigned b = 0; b < NBUCKETS && !found; b++)
        for (alloc *a = buckets[b]; a; a = a->next)
            if (ptr >= a->ptr && ptr < a->ptr + (a->size ? a->size : 1)) {
                *out = *a;
                found = 1;
                break;
            }
    pthread_mutex_unlock(&alloc_lock);
    return found;
}

CUresult current_dev(CUdevice *dev)
{
    if (current_ctx == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    *dev = current_ctx->dev;
    return CUDA_SUCCESS;
}

uint64_t rounded(uint64_t size)
{
    return (size + PAGE_ALIGN - 1) & ~(PAGE_ALIGN - 1);
}

CUresult device_alloc(uint64_t *out, uint64_t size, int dev)
{
    CUresult rc = charge(dev, size);
    if (rc != CUDA_SUCCESS) return rc;
    void *p = mmap(NULL, rounded(size), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
        uncharge(dev, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *out = (uint64_t)(uintptr_t)p;
    track(*out, size, dev, K_LINEAR);
    return CUDA_SUCCESS;
}


void device_free(alloc *a)
{
    if (a->kind == K_VMM_MAP) { /* back to a reserved, inaccessible range */
        mmap((void *)(uintptr_t)a->ptr, a->size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1,
             0);
        vmm_unref((vmm_alloc *)(uintptr_t)(uint64_t)a->shared_fd_handle, 0);
        free(a);
        return;
    }
    munmap((void *)(uintptr_t)a->ptr, rounded(a->size));
    if (a->shared_fd >= 0) close(a->shared_fd);
    if (a->kind == K_LINEAR || a->kind == K_MODULE) uncharge(a->dev, a->size);
    if (a->kind == K_POOL) { /* back to its pool: still reserved */
        pthread_mutex_lock(&pool_lock);
        ((struct CUmemPoolHandle_st *)a->shared_fd_handle)->in_use -= a->size;
        pthread_mutex_unlock(&pool_lock);
    }
    free(a);
}

/* Destroying a context frees every allocation made in it, as the driver does. */
void free_ctx_allocs(struct CUctx_st *c)
{
    alloc *gone = NULL;
    pthread_mutex_lock(&alloc_lock);
    for (unsigned b = 0; b < NBUCKETS; b++)
        for (alloc **pp = &buckets[b]; *pp;) {
            alloc *a = *pp;
            if (a->ctx == c && a->kind != K_VMM_MAP && a->kind != K_POOL) {
                *pp = a->next;
                a->next = gone;
                gone = a;
            } else {
                pp = &a->next;
            }
        }
    pthread_mutex_unlock(&alloc_lock);
    while (gone) {
        alloc *next = gone->next;
        device_free(gone);
        gone = next;
    }
}

/* ---------------------------------------------------------------- init, version, devices */

FAKE_EXPORT CUresult cuInit(unsigned int flags)
{
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    fake_system *s = sys();
    if (s == NULL) return CUDA_ERROR_NO_DEVICE;
    if (!fake_kernel_time_spec_ok()) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&primary_lock);
    if (!atomic_load(&initialized)) fake_cuda_select_devices(s); /* MIG devices, CUDA_VISIBLE_DEVICES */
    if (!atomic_load(&initialized))
        for (int i = 0; i < s->count; i++) {
            primary_ctx[i] = (struct CUctx_st){CTX_MAGIC, i, 1, 0, {0}};
            default_pool[i] = (struct CUmemPoolHandle_st){CU_MEM_LOCATION_TYPE_DEVICE, i, 0, 0, 0, 0, 0, 1, NULL};
        }
    atomic_store(&initialized, 1);
    pthread_mutex_unlock(&primary_lock);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuDriverGetVersion(int *v)
{
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    fake_system *s = sys();
    *v = s ? s->cuda_driver_version : 12020;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuDeviceGetCount(int *count)
{
    CHECK_INIT();
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    *count = sys()->count;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuDeviceGet(CUdevice *dev, int ordinal)
{
    CHECK_INIT();
    if (!dev) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(ordinal)) return CUDA_ERROR_INVALID_DEVICE;
    *dev = ordinal;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    CHECK_INIT();
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "%s", sys()->gpus[dev].name);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev)
{
    CHECK_INIT();
    if (!uuid) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    memcpy(uuid->bytes, sys()->gpus[dev].uuid_bytes, 16);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)
{
    return cuDeviceGetUuid_v2(uuid, dev);
}

FAKE_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    CHECK_INIT();
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = sys()->gpus[dev].memory_bytes;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev)
{
    size_t b = 0;
    CUresult rc = cuDeviceTotalMem_v2(&b, dev);
    if (rc == CUDA_SUCCESS) *bytes = b > 0xffffffffu ? 0xffffffffu : (unsigned int)b;
    return rc;
}

FAKE_EXPORT CUresult cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev)
{
    CHECK_INIT();
    if (!pciBusId || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    const fake_gpu *g = &sys()->gpus[dev];
    snprintf(pciBusId, (size_t)len, "%04x:%02x:%02x.0", g->pci_domain, g->pci_bus, g->pci_device);
    return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------- contexts */

static uint64_t limit_cost(CUdevice dev, int which, uint64_t value)
{
    return which == LIM_STACK ? value * (uint64_t)sys()->gpus[dev].multiprocessors * THREADS_PER_SM : value;
}

/* A context's memory: its own cost plus what its limits take above the defaults. */
static CUresult ctx_memory_charge(struct CUctx_st *c)
{
    for (int i = 0; i < LIM_N; i++) c->limits[i] = limit_default[i];
    const fake_gpu *g = &sys()->gpus[c->dev];
    if (g->context_create_us) usleep(g->context_create_us);
    CUresult rc = g->context_bytes ? charge(c->dev, g->context_bytes) : CUDA_SUCCESS;
    if (rc == CUDA_SUCCESS) fake_contexts_add(sys()->state[c->dev], 1);
    return rc;
}

static void ctx_limits_reset(struct CUctx_st *c)
{
    for (int i = 0; i < LIM_N; i++) {
        uint64_t now = limit_cost(c->dev, i, c->limits[i]), dflt = limit_cost(c->dev, i, limit_default[i]);
        if (now > dflt) uncharge(c->dev, now - dflt);
        c->limits[i] = limit_default[i];
    }
}

static void ctx_memory_uncharge(struct CUctx_st *c)
{
    ctx_limits_reset(c);
    uint64_t b = sys()->gpus[c->dev].context_bytes;
    if (b) uncharge(c->dev, b);
    fake_contexts_add(sys()->state[c->dev], -1);
}

FAKE_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    CHECK_INIT();
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&primary_lock);
    if (primary_ctx[dev].refcount == 0) { /* the first retain creates the primary context */
        primary_ctx[dev].magic = CTX_MAGIC;
        primary_ctx[dev].dev = dev;
        primary_ctx[dev].primary = 1;
        CUresult rc = ctx_memory_charge(&primary_ctx[dev]);
        if (rc != CUDA_SUCCESS) {
            pthread_mutex_unlock(&primary_lock);
            return rc;
        }
    }
    __atomic_add_fetch(&primary_ctx[dev].refcount, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_unlock(&primary_lock);
    *pctx = &primary_ctx[dev];
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    CHECK_INIT();
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&primary_lock);
    if (__atomic_load_n(&primary_ctx[dev].refcount, __ATOMIC_SEQ_CST) <= 0) {
        pthread_mutex_unlock(&primary_lock);
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    if (__atomic_sub_fetch(&primary_ctx[dev].refcount, 1, __ATOMIC_SEQ_CST) == 0) {
        free_ctx_allocs(&primary_ctx[dev]); /* the last release destroys the primary context */
        ctx_memory_uncharge(&primary_ctx[dev]);
        fake_cls_context_gone(&primary_ctx[dev]);
    }
    pthread_mutex_unlock(&primary_lock);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active)
{
    CHECK_INIT();
    if (!flags || !active) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    *flags = 0;
    *active = __atomic_load_n(&primary_ctx[dev].refcount, __ATOMIC_SEQ_CST) > 0;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    CHECK_INIT();
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    free_ctx_allocs(&primary_ctx[dev]);
    fake_cls_context_gone(&primary_ctx[dev]);
    pthread_mutex_lock(&primary_lock);
    if (primary_ctx[dev].refcount > 0) ctx_limits_reset(&primary_ctx[dev]); /* limits back to defaults */
    pthread_mutex_unlock(&primary_lock);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuDevicePrimaryCtxReset(CUdevice dev)
{
    return cuDevicePrimaryCtxReset_v2(dev);
}

FAKE_EXPORT CUresult cuDevicePrimaryCtxRelease(CUdevice dev)
{
    return cuDevicePrimaryCtxRelease_v2(dev);
}

static CUresult ctx_create(CUcontext *pctx, CUdevice dev)
{
    CHECK_INIT();
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    if (fake_health_cuda_error(dev)) return (CUresult)fake_health_cuda_error(dev); /* a failed card */
    struct CUctx_st *c = calloc(1, sizeof(*c));
    if (!c) return CUDA_ERROR_OUT_OF_MEMORY;
    *c = (struct CUctx_st){CTX_MAGIC, dev, 0, 1, {0}};
    CUresult rc = ctx_memory_charge(c);
    if (rc != CUDA_SUCCESS) {
        free(c);
        return rc;
    }
    current_ctx = c;
    *pctx = c;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    (void)flags;
    return ctx_create(pctx, dev);
}

FAKE_EXPORT CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    return cuCtxCreate_v2(pctx, flags, dev);
}

FAKE_EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *p, int n, unsigned int flags, CUdevice dev)
{
    (void)p;
    (void)n;
    (void)flags;
    return ctx_create(pctx, dev);
}

FAKE_EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *p, unsigned int flags, CUdevice dev)
{
    (void)p;
    (void)flags;
    return ctx_create(pctx, dev);
}

FAKE_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    CHECK_INIT();
    if (!ctx || ctx->magic != CTX_MAGIC || ctx->primary) return CUDA_ERROR_INVALID_CONTEXT;
    if (current_ctx == ctx) current_ctx = NULL;
    free_ctx_allocs(ctx);
    fake_cls_context_gone(ctx);
    ctx_memory_uncharge(ctx);
    ctx->magic = 0;
    free(ctx);
    return CUDA_SUCCESS;
}

static int limit_index(CUlimit limit)
{
    switch (limit) {
    case CU_LIMIT_MALLOC_HEAP_SIZE: return LIM_HEAP;
    case CU_LIMIT_STACK_SIZE: return LIM_STACK;
    case CU_LIMIT_PRINTF_FIFO_SIZE: return LIM_FIFO;
    default: return -1;
    }
}

FAKE_EXPORT CUresult cuCtxSetLimit(CUlimit limit, size_t value)
{
    CHECK_INIT();
    if (!current_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    int i = limit_index(limit);
    if (i < 0) return limit == CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT || limit == CU_LIMIT_MAX_L2_FETCH_GRANULARITY ||
                              limit == CU_LIMIT_PERSISTING_L2_CACHE_SIZE || limit == CU_LIMIT_DEV_RUNTIME_SYNC_DEPTH
                          ? CUDA_SUCCESS
                          : CUDA_ERROR_UNSUPPORTED_LIMIT;
    struct CUctx_st *c = current_ctx;
    pthread_mutex_lock(&primary_lock);
    uint64_t dflt = limit_cost(c->dev, i, limit_default[i]);
    uint64_t old = limit_cost(c->dev, i, c->limits[i]), want = limit_cost(c->dev, i, value);
    old = old > dflt ? old - dflt : 0;
    want = want > dflt ? want - dflt : 0;
    CUresult rc = CUDA_SUCCESS;
    if (want > old) rc = charge(c->dev, want - old);
    else if (old > want) uncharge(c->dev, old - want);
    if (rc == CUDA_SUCCESS) c->limits[i] = value;
    pthread_mutex_unlock(&primary_lock);
    return rc;
}

FAKE_EXPORT CUresult cuCtxGetLimit(size_t *pvalue, CUlimit limit)
{
    CHECK_INIT();
    if (!pvalue) return CUDA_ERROR_INVALID_VALUE;
    if (!current_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    int i = limit_index(limit);
    if (i < 0) return CUDA_ERROR_UNSUPPORTED_LIMIT;
    *pvalue = current_ctx->limits[i];
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuCtxSetCurrent(CUcontext ctx)
{
    CHECK_INIT();
    if (ctx && ctx->magic != CTX_MAGIC) return CUDA_ERROR_INVALID_CONTEXT;
    current_ctx = ctx;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    CHECK_INIT();
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    *pctx = current_ctx;
    return CUDA_SUCCESS;
}

/* The calling thread's context stack: current_ctx is its top, these are the ones below it. */
#define CTX_STACK_MAX 64
static __thread struct CUctx_st *ctx_below[CTX_STACK_MAX];
static __thread int ctx_depth;

FAKE_EXPORT CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    CHECK_INIT();
    if (!ctx || ctx->magic != CTX_MAGIC) return CUDA_ERROR_INVALID_CONTEXT;
    if (ctx_depth == CTX_STACK_MAX) return CUDA_ERROR_OUT_OF_MEMORY;
    ctx_below[ctx_depth++] = current_ctx;
    current_ctx = ctx;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *pctx)
{
    CHECK_INIT();
    if (!current_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    if (pctx) *pctx = current_ctx;
    current_ctx = ctx_depth > 0 ? ctx_below[--ctx_depth] : NULL;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuCtxPushCurrent(CUcontext ctx)
{
    return cuCtxPushCurrent_v2(ctx);
}

FAKE_EXPORT CUresult cuCtxPopCurrent(CUcontext *pctx)
{
    return cuCtxPopCurrent_v2(pctx);
}

FAKE_EXPORT CUresult cuCtxGetDevice(CUdevice *dev)
{
    CHECK_INIT();
    if (!dev) return CUDA_ERROR_INVALID_VALUE;
    return current_dev(dev);
}

void wait_device_idle(CUdevice dev)
{
    uint64_t until = fake_busy_until(sys()->state[dev]);
    uint64_t now = fake_now_ns();
    if (until > now) {
        struct timespec ts = {.tv_sec = (time_t)((until - now) / 1000000000ull),
                              .tv_nsec = (long)((until - now) % 1000000000ull)};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
        }
    }
}

/* What a synchronization does to stream-ordered pools: memory above the release threshold that no
 * allocation uses goes back to the card. */
static void pool_shrink_locked(struct CUmemPoolHandle_st *p, uint64_t keep)
{
    if (keep < p->in_use) keep = p->in_use;
    if (p->reserved > keep) {
        uncharge(p->id, p->reserved - keep);
        p->reserved = keep;
    }
}

void pools_release(CUdevice dev)
{
    pthread_mutex_lock(&pool_lock);
    if (dev >= 0 && dev < FAKE_MAX_GPUS) pool_shrink_locked(&default_pool[dev], default_pool[dev].threshold);
    for (struct CUmemPoolHandle_st *p = pools; p; p = p->next)
        if (p->id == dev) pool_shrink_locked(p, p->threshold);
    pthread_mutex_unlock(&pool_lock);
}

FAKE_EXPORT CUresult cuCtxSynchronize(void)
{
    CHECK_INIT();
    CUdevice dev;
    CUresult rc = current_dev(&dev);
    if (rc != CUDA_SUCCESS) return rc;
    if (fake_health_cuda_error(dev)) return (CUresult)fake_health_cuda_error(dev); /* a failed card */
    wait_device_idle(dev);
    pools_release(dev);
    return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------- memory */

FAKE_EXPORT CUresult cuMemGetInfo_v2(size_t *free_b, size_t *total_b)
{
    CHECK_INIT();
    CUdevice dev;
    CUresult rc = current_dev(&dev);
    if (rc != CUDA_SUCCESS) return rc;
    if (!free_b || !total_b) return CUDA_ERROR_INVALID_VALUE;
    fake_dev_state *s = sys()->state[dev];
    fake_lock(s);
    uint64_t used = fake_used_locked(s);
    fake_unlock(s);
    uint64_t total = sys()->gpus[dev].memory_bytes;
    *total_b = total;
    *free_b = used < total ? total - used : 0;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemGetInfo(unsigned int *free_b, unsigned int *total_b)
{
    size_t f = 0, t = 0;
    CUresult rc = cuMemGetInfo_v2(&f, &t);
    if (rc == CUDA_SUCCESS) {
        *free_b = f > 0xffffffffu ? 0xffffffffu : (unsigned int)f;
        *total_b = t > 0xffffffffu ? 0xffffffffu : (unsigned int)t;
    }
    return rc;
}

static CUresult alloc_current(CUdeviceptr *dptr, size_t size)
{
    CHECK_INIT();
    if (!dptr || size == 0) return CUDA_ERROR_INVALID_VALUE;
    CUdevice dev;
    CUresult rc = current_dev(&dev);
    if (rc != CUDA_SUCCESS) return rc;
    uint64_t p;
    rc = device_alloc(&p, size, dev);
    if (rc == CUDA_SUCCESS) *dptr = (CUdeviceptr)p;
    return rc;
}

FAKE_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    return alloc_current(dptr, bytesize);
}

FAKE_EXPORT CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize)
{
    /* 32-bit device pointers cannot address the heap above 4 GiB: legacy callers get an error. */
    (void)dptr;
    (void)bytesize;
    CHECK_INIT();
    return CUDA_ERROR_NOT_SUPPORTED;
}

FAKE_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    if (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = alloc_current(dptr, bytesize);
    if (rc == CUDA_SUCCESS) {
        pthread_mutex_lock(&alloc_lock);
        for (alloc *a = buckets[(unsigned)((*dptr >> 12) % NBUCKETS)]; a; a = a->next)
            if (a->ptr == *dptr) a->managed = 1;
        pthread_mutex_unlock(&alloc_lock);
    }
    return rc;
}

FAKE_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t width, size_t height,
                                        unsigned int elem)
{
    CHECK_INIT();
    if (!pPitch || width == 0 || height == 0 || (elem != 4 && elem != 8 && elem != 16)) return CUDA_ERROR_INVALID_VALUE;
    size_t pitch = (width + 511) & ~(size_t)511;
    CUresult rc = alloc_current(dptr, pitch * height);
    if (rc == CUDA_SUCCESS) *pPitch = pitch;
    return rc;
}

FAKE_EXPORT CUresult cuMemAllocPitch(CUdeviceptr_v1 *dptr, unsigned int *pPitch, unsigned int w, unsigned int h,
                                     unsigned int e)
{
    (void)dptr;
    (void)pPitch;
    (void)w;
    (void)h;
    (void)e;
    CHECK_INIT();
    return CUDA_ERROR_NOT_SUPPORTED;
}

static CUresult free_ptr(CUdeviceptr dptr, int want_kind_linear)
{
    CHECK_INIT();
    if (dptr == 0) return CUDA_SUCCESS;
    alloc *a = untrack(dptr);
    if (!a) return CUDA_ERROR_INVALID_VALUE;
    if (a->kind == K_MODULE || (want_kind_linear && (a->kind == K_IPC || a->kind == K_VMM_MAP))) {
        track_alloc(a); /* put back as it was: its context, export and backing kept */
        free(a);
        return CUDA_ERROR_INVALID_VALUE;
    }
    device_free(a);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    return free_ptr(dptr, 1);
}

FAKE_EXPORT CUresult cuMemFree(CUdeviceptr_v1 dptr)
{
    return free_ptr(dptr, 1);
}

FAKE_EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr)
{
    CHECK_INIT();
    uint64_t base, size;
    if (!find_range(dptr, &base, &size)) return CUDA_ERROR_NOT_FOUND;
    if (pbase) *pbase = base;
    if (psize) *psize = size;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n)
{
    CHECK_INIT();
    uint64_t base, size;
    if (!find_range(dst, &base, &size) || dst + n > base + size) return CUDA_ERROR_INVALID_VALUE;
    memcpy((void *)(uintptr_t)dst, src, n);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n)
{
    CHECK_INIT();
    uint64_t base, size;
    if (!find_range(src, &base, &size) || src + n > base + size) return CUDA_ERROR_INVALID_VALUE;
    memcpy(dst, (void *)(uintptr_t)src, n);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char v, size_t n)
{
    CHECK_INIT();
    uint64_t base, size;
    if (!find_range(dst, &base, &size) || dst + n > base + size) return CUDA_ERROR_INVALID_VALUE;
    if (discard_zero_fill(dst, &v, 1, n)) return CUDA_SUCCESS;
    memset((void *)(uintptr_t)dst, v, n);
    return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------- streams, pools, async */

FAKE_EXPORT CUresult cuStreamCreate(CUstream *ph, unsigned int flags)
{
    CHECK_INIT();
    if (!ph) return CUDA_ERROR_INVALID_VALUE;
    if (!current_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    struct CUstream_st *s = calloc(1, sizeof(*s));
    if (!s) return CUDA_ERROR_OUT_OF_MEMORY;
    s->ctx = current_ctx;
    s->flags = flags;
    *ph = s;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuStreamDestroy_v2(CUstream h)
{
    CHECK_INIT();
    if (!h) return CUDA_ERROR_INVALID_HANDLE;
    free(h);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuStreamSynchronize(CUstream h)
{
    CHECK_INIT();
    CUdevice dev;
    if (stream_dev(h, &dev) != CUDA_SUCCESS) return CUDA_ERROR_INVALID_CONTEXT;
    wait_device_idle(dev);
    pools_release(dev);
    return CUDA_SUCCESS;
}

CUresult stream_dev(CUstream s, CUdevice *dev)
{
    if (s && s != CU_STREAM_LEGACY && s != CU_STREAM_PER_THREAD) {
        *dev = s->ctx->dev;
        return CUDA_SUCCESS;
    }
    return current_dev(dev);
}

/* An allocation from a device pool: reuses what the pool keeps reserved, charges the card for the rest. */
static CUresult pool_alloc(struct CUmemPoolHandle_st *pool, CUdeviceptr *dptr, size_t size)
{
    pthread_mutex_lock(&pool_lock);
    uint64_t spare = pool->reserved - pool->in_use;
    if (spare < size) {
        CUresult rc = charge(pool->id, size - spare);
        if (rc != CUDA_SUCCESS) {
            pthread_mutex_unlock(&pool_lock);
            return rc;
        }
        pool->reserved += size - spare;
    }
    pool->in_use += size;
    if (pool->reserved > pool->reserved_high) pool->reserved_high = pool->reserved;
    if (pool->in_use > pool->used_high) pool->used_high = pool->in_use;
    pthread_mutex_unlock(&pool_lock);
    void *p = mmap(NULL, rounded(size), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
        pthread_mutex_lock(&pool_lock);
        pool->in_use -= size;
        pthread_mutex_unlock(&pool_lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *dptr = (CUdeviceptr)(uintptr_t)p;
    track_alloc(&(alloc){*dptr, size, pool->id, K_POOL, -1, (uintptr_t)pool, NULL, 0, NULL});
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t size, CUstream s)
{
    CHECK_INIT();
    if (!dptr || size == 0) return CUDA_ERROR_INVALID_VALUE;
    CUdevice dev;
    CUresult rc = stream_dev(s, &dev);
    if (rc != CUDA_SUCCESS) return rc;
    return pool_alloc(&default_pool[dev], dptr, size);
}

FAKE_EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev)
{
    CHECK_INIT();
    if (!pool) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    *pool = &default_pool[dev];
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev)
{
    return cuDeviceGetDefaultMemPool(pool, dev);
}

FAKE_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep)
{
    CHECK_INIT();
    if (!pool) return CUDA_ERROR_INVALID_VALUE;
    if (pool->type != CU_MEM_LOCATION_TYPE_DEVICE) return CUDA_SUCCESS;
    pthread_mutex_lock(&pool_lock);
    pool_shrink_locked(pool, minBytesToKeep);
    pthread_mutex_unlock(&pool_lock);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    CHECK_INIT();
    if (!pool || !value) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&pool_lock);
    CUresult rc = CUDA_SUCCESS;
    switch (attr) {
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: pool->threshold = *(cuuint64_t *)value; break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: pool->reserved_high = pool->reserved; break; /* reset */
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH: pool->used_high = pool->in_use; break;
    case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES: break;
    default: rc = CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&pool_lock);
    return rc;
}

FAKE_EXPORT CUresult cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    CHECK_INIT();
    if (!pool || !value) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&pool_lock);
    CUresult rc = CUDA_SUCCESS;
    cuuint64_t *v = value;
    switch (attr) {
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: *v = pool->threshold; break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: *v = pool->reserved; break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: *v = pool->reserved_high; break;
    case CU_MEMPOOL_ATTR_USED_MEM_CURRENT: *v = pool->in_use; break;
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH: *v = pool->used_high; break;
    default: rc = CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&pool_lock);
    return rc;
}

FAKE_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t size, CUstream s)
{
    return cuMemAllocAsync(dptr, size, s);
}

FAKE_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream s)
{
    (void)s;
    return free_ptr(dptr, 1);
}

FAKE_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream s)
{
    return cuMemFreeAsync(dptr, s);
}

FAKE_EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props)
{
    CHECK_INIT();
    if (!pool || !props || props->allocType != CU_MEM_ALLOCATION_TYPE_PINNED) return CUDA_ERROR_INVALID_VALUE;
    if (props->location.type == CU_MEM_LOCATION_TYPE_DEVICE && !valid_dev(props->location.id))
        return CUDA_ERROR_INVALID_DEVICE;
    if (props->location.type != CU_MEM_LOCATION_TYPE_DEVICE && props->location.type != CU_MEM_LOCATION_TYPE_HOST &&
        props->location.type != CU_MEM_LOCATION_TYPE_HOST_NUMA)
        return CUDA_ERROR_INVALID_VALUE;
    struct CUmemPoolHandle_st *p = calloc(1, sizeof(*p));
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    p->type = props->location.type;
    p->id = props->location.id;
    if (p->type == CU_MEM_LOCATION_TYPE_DEVICE) {
        pthread_mutex_lock(&pool_lock);
        p->next = pools;
        pools = p;
        pthread_mutex_unlock(&pool_lock);
    }
    *pool = p;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    CHECK_INIT();
    if (!pool || pool->is_default) return CUDA_ERROR_INVALID_VALUE;
    if (pool->type == CU_MEM_LOCATION_TYPE_DEVICE) {
        pthread_mutex_lock(&pool_lock);
        for (struct CUmemPoolHandle_st **pp = &pools; *pp; pp = &(*pp)->next)
            if (*pp == pool) {
                *pp = pool->next;
                break;
            }
        if (pool->reserved) uncharge(pool->id, pool->reserved); /* (live allocations die with it here) */
        pthread_mutex_unlock(&pool_lock);
    }
    free(pool);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream s)
{
    (void)s;
    CHECK_INIT();
    if (!dptr || !pool || size == 0) return CUDA_ERROR_INVALID_VALUE;
    if (pool->type == CU_MEM_LOCATION_TYPE_DEVICE) return pool_alloc(pool, dptr, size);
    void *p = mmap(NULL, rounded(size), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    *dptr = (CUdeviceptr)(uintptr_t)p;
    track(*dptr, size, 0, K_HOST_POOL);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream s)
{
    return cuMemAllocFromPoolAsync(dptr, size, pool, s);
}

/* ---------------------------------------------------------------- IPC */

typedef struct {
    char magic[8];
    int32_t pid;
    int32_t fd;
    uint64_t offset, size;
    int32_t dev;
} ipc_wire;

/* Moves an allocation onto a memfd at the same address (copying the pages that exist), so that
 * another process can map it. Caller holds alloc_lock. */
static int share_locked(alloc *a)
{
    if (a->shared_fd >= 0) return 0;
    uint64_t len = rounded(a->size);
    int fd = memfd_create("fake-gpu-ipc", MFD_CLOEXEC);
    if (fd < 0) return -1;
    if (ftruncate(fd, (off_t)len) != 0) {
        close(fd);
        return -1;
    }
    void *tmp = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (tmp == MAP_FAILED) {
        close(fd);
        return -1;
    }
    unsigned char vec[256];
    for (uint64_t off = 0; off < len; off += sizeof(vec) * PAGE_ALIGN) {
        uint64_t n = len - off < sizeof(vec) * PAGE_ALIGN ? len - off : sizeof(vec) * PAGE_ALIGN;
        if (mincore((void *)(uintptr_t)(a->ptr + off), n, vec) != 0) continue;
        for (uint64_t pg = 0; pg < n / PAGE_ALIGN; pg++)
            if (vec[pg] & 1)
                memcpy((char *)tmp + off + pg * PAGE_ALIGN, (void *)(uintptr_t)(a->ptr + off + pg * PAGE_ALIGN),
                       PAGE_ALIGN);
    }
    munmap(tmp, len);
    if (mmap((void *)(uintptr_t)a->ptr, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
        close(fd);
        return -1;
    }
    a->shared_fd = fd;
    return 0;
}

FAKE_EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *handle, CUdeviceptr dptr)
{
    CHECK_INIT();
    if (!handle) return CUDA_ERROR_INVALID_VALUE;
    ipc_wire w = {{'F', 'A', 'K', 'E', 'I', 'P', 'C', '1'}, (int32_t)getpid(), -1, 0, 0, 0};
    pthread_mutex_lock(&alloc_lock);
    unsigned b = (unsigned)((dptr >> 12) % NBUCKETS);
    alloc *a = buckets[b];
    while (a && a->ptr != dptr) a = a->next;
    if (a && a->kind == K_LINEAR && share_locked(a) == 0) {
        w.fd = a->shared_fd;
        w.size = a->size;
        w.dev = a->dev;
    }
    pthread_mutex_unlock(&alloc_lock);
    if (w.fd < 0) return CUDA_ERROR_INVALID_VALUE;
    memset(handle, 0, sizeof(*handle));
    memcpy(handle->reserved, &w, sizeof(w));
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int flags)
{
    CHECK_INIT();
    if (!pdptr || flags != CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) return CUDA_ERROR_INVALID_VALUE;
    ipc_wire w;
    memcpy(&w, handle.reserved, sizeof(w));
    if (memcmp(w.magic, "FAKEIPC1", 8) != 0) return CUDA_ERROR_INVALID_VALUE;
    if (w.pid == (int32_t)getpid()) return CUDA_ERROR_INVALID_CONTEXT; /* as the driver: not in the exporter */
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/fd/%d", w.pid, w.fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) return CUDA_ERROR_INVALID_VALUE;
    void *p = mmap(NULL, rounded(w.size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)w.offset);
    close(fd);
    if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    *pdptr = (CUdeviceptr)(uintptr_t)p;
    track(*pdptr, w.size, w.dev, K_IPC);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int flags)
{
    return cuIpcOpenMemHandle_v2(pdptr, handle, flags);
}

FAKE_EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr dptr)
{
    CHECK_INIT();
    alloc *a = untrack(dptr);
    if (!a) return CUDA_ERROR_INVALID_VALUE;
    if (a->kind != K_IPC) {
        track_alloc(a); /* put back as it was: its context, export and backing kept */
        free(a);
        return CUDA_ERROR_INVALID_VALUE;
    }
    device_free(a);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuGraphCreate(CUgraph *g, unsigned int flags)
{
    CHECK_INIT();
    if (!g || flags) return CUDA_ERROR_INVALID_VALUE;
    *g = calloc(1, sizeof(struct CUgraph_st));
    return *g ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}


FAKE_EXPORT CUresult cuGraphAddKernelNode_v2(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                                             const CUDA_KERNEL_NODE_PARAMS *p)
{
    CHECK_INIT();
    if (!node || !g || !p || !p->func || p->func->magic != FUNC_MAGIC || fake_graph_deps(g, NULL, deps, ndeps))
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t d = fake_kernel_duration(p->func, p->gridDimX, p->gridDimY, p->gridDimZ, p->blockDimX, p->blockDimY,
                                      p->blockDimZ);
    g->duration_ns += d;
    *node = fake_graph_node(g, CU_GRAPH_NODE_TYPE_KERNEL);
    if (!*node) return CUDA_ERROR_OUT_OF_MEMORY;
    (*node)->duration_ns = d;
    (*node)->nin = ndeps;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuGraphAddMemAllocNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                                            CUDA_MEM_ALLOC_NODE_PARAMS *p)
{
    CHECK_INIT();
    if (!node || !g || !p || p->bytesize == 0 || p->poolProps.location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
        !valid_dev(p->poolProps.location.id) || g->owned || fake_graph_deps(g, NULL, deps, ndeps))
        return CUDA_ERROR_INVALID_VALUE;
    void *va = mmap(NULL, rounded(p->bytesize), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                    -1, 0);
    if (va == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    p->dptr = (CUdeviceptr)(uintptr_t)va; /* (the virtual range is never returned: a test double) */
    g->mem_bytes += p->bytesize;
    *node = fake_graph_node(g, CU_GRAPH_NODE_TYPE_MEM_ALLOC);
    if (!*node) return CUDA_ERROR_OUT_OF_MEMORY;
    (*node)->mem_bytes = p->bytesize;
    (*node)->nin = ndeps;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuGraphAddMemFreeNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                                           CUdeviceptr dptr)
{
    CHECK_INIT();
    if (!node || !g || !dptr || g->owned || fake_graph_deps(g, NULL, deps, ndeps)) return CUDA_ERROR_INVALID_VALUE;
    *node = fake_graph_node(g, CU_GRAPH_NODE_TYPE_MEM_FREE);
    if (!*node) return CUDA_ERROR_OUT_OF_MEMORY;
    (*node)->nin = ndeps;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuDeviceGraphMemTrim(CUdevice dev)
{
    CHECK_INIT();
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&pool_lock);
    if (graph_spare[dev]) uncharge(dev, graph_spare[dev]);
    graph_spare[dev] = 0;
    pthread_mutex_unlock(&pool_lock);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuDeviceGetGraphMemAttribute(CUdevice dev, CUgraphMem_attribute attr, void *value)
{
    CHECK_INIT();
    if (!valid_dev(dev) || !value) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&pool_lock);
    CUresult rc = CUDA_SUCCESS;
    switch (attr) {
    case CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT: *(cuuint64_t *)value = graph_spare[dev] + graph_backed[dev]; break;
    case CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT: *(cuuint64_t *)value = graph_backed[dev]; break;
    default: rc = CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&pool_lock);
    return rc;
}

FAKE_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *e, CUgraph g, unsigned long long flags)
{
    (void)flags;
    CHECK_INIT();
    if (!e || !g || g->owned) return CUDA_ERROR_INVALID_VALUE;
    if (!current_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    struct CUgraphExec_st *x = calloc(1, sizeof(*x));
    if (!x) return CUDA_ERROR_OUT_OF_MEMORY;
    x->duration_ns = g->duration_ns;
    x->dev = current_ctx->dev;
    x->mem_bytes = g->mem_bytes;
    if (fake_graph_exec_take_ops(x, g) != CUDA_SUCCESS) {
        free(x);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *e = x;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuGraphLaunch(CUgraphExec e, CUstream s)
{
    (void)s;
    CHECK_INIT();
    if (!e) return CUDA_ERROR_INVALID_VALUE;
    if (e->mem_bytes && !e->backed) { /* first launch: physical memory for its alloc nodes */
        pthread_mutex_lock(&pool_lock);
        uint64_t from_spare = graph_spare[e->dev] < e->mem_bytes ? graph_spare[e->dev] : e->mem_bytes;
        CUresult rc = from_spare < e->mem_bytes ? charge(e->dev, e->mem_bytes - from_spare) : CUDA_SUCCESS;
        if (rc == CUDA_SUCCESS) {
            graph_spare[e->dev] -= from_spare;
            graph_backed[e->dev] += e->mem_bytes;
            e->backed = 1;
        }
        pthread_mutex_unlock(&pool_lock);
        if (rc != CUDA_SUCCESS) return rc;
    }
    for (size_t i = 0; i < e->nops; i++) fake_graph_op_run(&e->ops[i]);
    return occupy(e->dev, e->duration_ns);
}

FAKE_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec e, CUstream s)
{
    return cuGraphLaunch(e, s);
}

FAKE_EXPORT CUresult cuGraphExecDestroy(CUgraphExec e)
{
    CHECK_INIT();
    if (e && e->backed) { /* back to the device's graph pool, still reserved */
        pthread_mutex_lock(&pool_lock);
        graph_backed[e->dev] -= e->mem_bytes;
        graph_spare[e->dev] += e->mem_bytes;
        pthread_mutex_unlock(&pool_lock);
    }
    if (e) fake_graph_exec_free_ops(e);
    free(e);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuGraphDestroy(CUgraph g)
{
    CHECK_INIT();
    if (g && g->owned) return CUDA_ERROR_INVALID_VALUE; /* moved into a child graph node: its parent's */
    fake_graph_free(g);
    return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------- events */

FAKE_EXPORT CUresult cuEventCreate(CUevent *ph, unsigned int flags)
{
    (void)flags;
    CHECK_INIT();
    if (!ph) return CUDA_ERROR_INVALID_VALUE;
    if (!current_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    *ph = calloc(1, sizeof(struct CUevent_st));
    return *ph ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

FAKE_EXPORT CUresult cuEventRecord(CUevent e, CUstream s)
{
    CHECK_INIT();
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    CUdevice dev;
    CUresult rc = stream_dev(s, &dev);
    if (rc != CUDA_SUCCESS) return rc;
    uint64_t now = fake_now_ns(), until = fake_busy_until(sys()->state[dev]);
    e->t_ns = until > now ? until : now;
    e->dev = dev;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuEventSynchronize(CUevent e)
{
    CHECK_INIT();
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    uint64_t now = fake_now_ns();
    if (e->t_ns > now) {
        uint64_t wait = e->t_ns - now;
        struct timespec ts = {.tv_sec = (time_t)(wait / 1000000000ull), .tv_nsec = (long)(wait % 1000000000ull)};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
        }
    }
    pools_release(e->dev);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuEventElapsedTime(float *ms, CUevent start, CUevent end)
{
    CHECK_INIT();
    if (!ms || !start || !end) return CUDA_ERROR_INVALID_HANDLE;
    if (start->t_ns == 0 || end->t_ns == 0) return CUDA_ERROR_INVALID_HANDLE;
    uint64_t now = fake_now_ns();
    if (start->t_ns > now || end->t_ns > now) return CUDA_ERROR_NOT_READY;
    *ms = (float)((double)((int64_t)end->t_ns - (int64_t)start->t_ns) / 1e6);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuEventDestroy_v2(CUevent e)
{
    CHECK_INIT();
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    free(e);
    return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------- errors */

typedef struct {
    CUresult code;
    const char *name, *text;
} err_entry;

static const err_entry errors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    /* the rest of what the double answers: a client names an error it gets (cuda-core's CUDAError
     * says "UNEXPECTED ERROR CODE" when the driver cannot name it) */
    {CUDA_ERROR_INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {CUDA_ERROR_UNSUPPORTED_PTX_VERSION, "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
     "the provided PTX was compiled with an unsupported toolchain."},
    {CUDA_ERROR_NO_BINARY_FOR_GPU, "CUDA_ERROR_NO_BINARY_FOR_GPU",
     "no kernel image is available for execution on the device"},
    {CUDA_ERROR_INVALID_PTX, "CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"},
    {CUDA_ERROR_ILLEGAL_STATE, "CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state"},
    {CUDA_ERROR_FILE_NOT_FOUND, "CUDA_ERROR_FILE_NOT_FOUND", "file not found"},
    {CUDA_ERROR_UNSUPPORTED_LIMIT, "CUDA_ERROR_UNSUPPORTED_LIMIT", "limit is not supported on this architecture"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
    {CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
     "operation not permitted when stream is capturing"},
    {CUDA_ERROR_OPERATING_SYSTEM, "CUDA_ERROR_OPERATING_SYSTEM", "OS call failed or operation not supported on this OS"},
    {CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
     "pointer does not correspond to a registered memory region"},
    {CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
     "part or all of the requested memory range is already mapped"},
    {CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE, "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE",
     "the graph update was not performed because it included changes which violated constraints specific to "
     "instantiated graph update"},
    {CUDA_ERROR_ECC_UNCORRECTABLE, "CUDA_ERROR_ECC_UNCORRECTABLE", "uncorrectable ECC error encountered"},
    {CUDA_ERROR_CONTEXT_IS_DESTROYED, "CUDA_ERROR_CONTEXT_IS_DESTROYED", "context is destroyed"},
};

FAKE_EXPORT CUresult cuGetErrorName(CUresult e, const char **s)
{
    if (!s) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof(errors) / sizeof(errors[0]); i++)
        if (errors[i].code == e) {
            *s = errors[i].name;
            return CUDA_SUCCESS;
        }
    *s = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

FAKE_EXPORT CUresult cuGetErrorString(CUresult e, const char **s)
{
    if (!s) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof(errors) / sizeof(errors[0]); i++)
        if (errors[i].code == e) {
            *s = errors[i].text;
            return CUDA_SUCCESS;
        }
    *s = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}
