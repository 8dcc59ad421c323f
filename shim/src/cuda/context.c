/*
 * Contexts: which context an allocation belongs to, what a context costs (measured at the first
 * one), cuCtxSetLimit, and crediting what the driver frees when a context goes.
 */
#define _GNU_SOURCE
#include "../gs_cuda.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

/* ------------------------------------------------------------------------------------------------
 * Which context an allocation belongs to. The driver frees every allocation of a context when the
 * context goes (cuCtxDestroy, cuDevicePrimaryCtxReset, the last cuDevicePrimaryCtxRelease), so a
 * device-pointer entry carries its context's index in the top 16 bits of its value (bytes below).
 * ---------------------------------------------------------------------------------------------- */

static _Atomic uintptr_t ctx_slots[GS_MAX_CTX]; /* index -> CUcontext; 0 is "none" */
static _Atomic unsigned ctx_count = 1;
static pthread_mutex_t ctx_lock = PTHREAD_MUTEX_INITIALIZER;
__thread uintptr_t tl_ctx;
__thread unsigned tl_idx;
/* Device memory a context holds besides allocations: its own cost (measured at the process's first
 * context) and what cuCtxSetLimit added above the limits it started with. Indexed like ctx_slots. */
static _Atomic uint64_t ctx_cost[GS_MAX_CTX];
static _Atomic uint64_t ctx_limit_charged[GS_MAX_CTX][GS_LIM_N];
static _Atomic uint64_t ctx_limit_base[GS_MAX_CTX][GS_LIM_N]; /* the limit before the first set, +1 */

unsigned ctx_find(uintptr_t c)
{
    unsigned n = atomic_load_explicit(&ctx_count, memory_order_acquire);
    for (unsigned i = 1; i < n; i++)
        if (atomic_load_explicit(&ctx_slots[i], memory_order_relaxed) == c) return i;
    return 0;
}

unsigned ctx_index_slow(uintptr_t c)
{
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





static void context_bytes_add(int64_t delta)
{
    int self = atomic_load(&gs_reg.self);
    if (self >= 0) atomic_fetch_add(&gs_reg.entries[self].context_bytes, (uint64_t)delta);
}

/* Bytes a context held besides allocations go back to the slice and off the process's context bytes. */
static void credit_context_bytes(uint64_t b)
{
    if (!b) return;
    release(b);
    context_bytes_add(-(int64_t)b);
}

/* Credits what a context's limits took above the ones it started with (the driver resets them with
 * the context: destroy, primary reset, last primary release). */
static void credit_context_limits(unsigned idx)
{
    if (idx == 0 || atomic_load(&gs_mode) != GS_MODE_ACTIVE) return;
    for (int i = 0; i < GS_LIM_N; i++) {
        uint64_t b = atomic_exchange(&ctx_limit_charged[idx][i], 0);
        atomic_store(&ctx_limit_base[idx][i], 0);
        credit_context_bytes(b);
    }
}

/* The context itself is gone (destroy, last primary release): its own cost and its limits. */
static void credit_context_memory(unsigned idx)
{
    if (idx == 0 || atomic_load(&gs_mode) != GS_MODE_ACTIVE) return;
    credit_context_limits(idx);
    credit_context_bytes(atomic_exchange(&ctx_cost[idx], 0));
}

/* Credits every allocation the driver freed with context `idx`. Rare: a scan of the table is fine. */
static void credit_context(unsigned idx)
{
    if (idx == 0 || atomic_load(&gs_mode) != GS_MODE_ACTIVE) return;
    gs_module_context_gone(idx); /* the driver unloads the context's modules with it */
    for (uint64_t i = 0; i <= tab_dptr.mask; i++) {
        uint64_t k = atomic_load_explicit(&tab_dptr.slots[i].key, memory_order_acquire), v;
        if (k <= GS_TABLE_TOMB || atomic_load(&tab_dptr.slots[i].val) >> 48 != idx) continue;
        if (gs_table_take(&tab_dptr, k, &v) == 0) credit_entry(v);
    }
}

/* ------------------------------------------------------------------------------------------------
 * Contexts: the first context on a device charges the configured context overhead once per process.
 * ---------------------------------------------------------------------------------------------- */

/* 0: charged or nothing to charge; -1: the slice has no room for a context. */
int charge_context(CUdevice dev)
{
    if (gs_ensure_init() != GS_MODE_ACTIVE) return 0; /* allocations are refused anyway */
    if (dev < 0 || dev >= 64 || !device_is_slice(dev)) return 0;
    uint64_t bit = 1ull << dev;
    if (atomic_fetch_or(&ctx_charged, bit) & bit) return 0;
    gs_region_note_first_use(&gs_reg); /* the slice's GPU is used: not a silent CPU fallback */
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
    int ok, lists; /* lists: the process list could be read */
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
    s->lists = real_nvmlDeviceGetComputeRunningProcesses_v3 != NULL &&
               real_nvmlDeviceGetComputeRunningProcesses_v3(d, &s->n, s->procs) == NVML_SUCCESS;
    if (!s->lists) s->n = 0;
    s->ok = 1;
}

static int snap_has(const gs_mem_snap *s, unsigned pid)
{
    for (unsigned i = 0; i < s->n; i++)
        if (s->procs[i].pid == pid) return 1;
    return 0;
}

#define GS_MAX_CTX_COST (4ull << 30) /* a bound on a believable figure */

/* The process had no context before, so NVML did not list it: it is among the pids the list gained.
 * One new pid: that is this process (its host pid), and what it holds is the context's cost. Several
 * (processes starting together): the smallest holding is the bound that every one of them, this one
 * included, holds at least a context; the pid stays unknown. None: the context costs nothing the
 * driver reports. Without process lists, the device's used memory across the creation. */
static uint64_t measure_cost(const gs_mem_snap *a, const gs_mem_snap *b)
{
    if (!a->ok || !b->ok) return 0;
    uint64_t cost = 0;
    if (a->lists && b->lists) {
        unsigned fresh = 0, pid = 0;
        for (unsigned i = 0; i < b->n; i++) {
            if (snap_has(a, b->procs[i].pid)) continue;
            if (fresh++ == 0 || b->procs[i].usedGpuMemory < cost) {
                cost = b->procs[i].usedGpuMemory;
                pid = b->procs[i].pid;
            }
        }
        if (fresh == 1) atomic_store(&own_host_pid, (int32_t)pid);
    } else {
        cost = b->dev_used > a->dev_used ? b->dev_used - a->dev_used : 0;
    }
    return cost > GS_MAX_CTX_COST ? 0 : cost;
}

void note_host_pid(void)
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

enum primary_drop { PRIMARY_RELEASE, PRIMARY_RESET };

/* The last release destroys the primary context (the driver says whether it is still active): its
 * allocations and its own memory go. A reset frees the context's allocations and resets its limits;
 * if the context is no longer active afterwards, its own memory went too. */
static CUresult primary_drop(CUresult (*real)(CUdevice), CUdevice dev, enum primary_drop how)
{
    pthread_mutex_lock(&primary_lock);
    CUresult rc = real(dev);
    if (rc == CUDA_SUCCESS && (how == PRIMARY_RESET || !primary_active(dev))) {
        unsigned idx = primary_idx(dev);
        credit_context(idx);
        if (how == PRIMARY_RESET && primary_active(dev)) credit_context_limits(idx);
        else credit_context_memory(idx);
    }
    pthread_mutex_unlock(&primary_lock);
    return rc;
}

GS_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    NEED_REAL(cuDevicePrimaryCtxRelease_v2);
    return primary_drop(real_cuDevicePrimaryCtxRelease_v2, dev, PRIMARY_RELEASE);
}

GS_EXPORT CUresult cuDevicePrimaryCtxRelease(CUdevice dev)
{
    NEED_REAL(cuDevicePrimaryCtxRelease);
    return primary_drop(real_cuDevicePrimaryCtxRelease, dev, PRIMARY_RELEASE);
}

GS_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    NEED_REAL(cuDevicePrimaryCtxReset_v2);
    return primary_drop(real_cuDevicePrimaryCtxReset_v2, dev, PRIMARY_RESET);
}

GS_EXPORT CUresult cuDevicePrimaryCtxReset(CUdevice dev)
{
    NEED_REAL(cuDevicePrimaryCtxReset);
    return primary_drop(real_cuDevicePrimaryCtxReset, dev, PRIMARY_RESET);
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

/* A forked child owns none of its parent's contexts and has a pid of its own. */
void gs_ctx_after_fork_child(void)
{
    memset((void *)ctx_cost, 0, sizeof(ctx_cost));
    memset((void *)ctx_limit_charged, 0, sizeof(ctx_limit_charged));
    memset((void *)ctx_limit_base, 0, sizeof(ctx_limit_base));
    atomic_store(&ctx_count, 1);
    tl_ctx = 0;
    tl_idx = 0;
    pthread_mutex_init(&ctx_lock, NULL);
    atomic_store(&own_host_pid, 0); /* a child has its own pid */
    pthread_mutex_init(&measure_lock, NULL);
    pthread_mutex_init(&primary_lock, NULL);
}
