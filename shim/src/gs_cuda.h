/*
 * What the CUDA and NVML interception files share (src/cuda/, src/nvml/, src/gs_init.c): the
 * lists of wrapped entry points and the real ones they call, the allocation tables, and the one
 * charging sequence every counted path follows (GS_CHARGE: reserve -> call the driver -> remember ->
 * undo on any failure; FREE_WITH_CREDIT for the way back). Everything here is process-local and
 * hidden (the library is built with -fvisibility=hidden; only GS_EXPORT symbols are exported).
 */
#ifndef GS_CUDA_H
#define GS_CUDA_H

#ifndef NVML_NO_UNVERSIONED_FUNC_DEFS
#define NVML_NO_UNVERSIONED_FUNC_DEFS /* every versioned entry point under its own name */
#endif
#include <cuda.h>
#include <nvml.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "gs_shim.h"
#include "gs_table.h"

/* ------------------------------------------------------------------------------------------------
 * Entry points (defined in cuda/hook.c)
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
    X(cuGraphInstantiateWithParams) X(cuGraphInstantiateWithParams_ptsz) X(cuGraphInstantiate)             \
    X(cuGraphInstantiate_v2) X(cuGraphClone) X(cuGraphAddNode) X(cuGraphAddNode_v2) X(cuGraphExecDestroy)  \
    X(cuGraphDestroy) X(cuDeviceGraphMemTrim) X(cuImportExternalMemory) X(cuDestroyExternalMemory)          \
    X(cuModuleLoad) X(cuModuleLoadData) X(cuModuleLoadDataEx) X(cuModuleLoadFatBinary) X(cuLibraryLoadData)     \
    X(cuLibraryLoadFromFile) X(cuModuleUnload) X(cuLibraryUnload)

#define GS_CUDA_HELPERS(X)                                                                               \
    X(cuCtxGetDevice) X(cuDeviceGetCount) X(cuDeviceGetUuid) X(cuDeviceGetUuid_v2)                      \
    X(cuMemGetAddressRange_v2) X(cuCtxGetCurrent) X(cuDevicePrimaryCtxGetState) X(cuCtxGetLimit)          \
    X(cuDeviceGetAttribute) X(cuDeviceGetMemPool) X(cuMemPoolGetAttribute) X(cuDriverGetVersion)

#define GS_NVML_WRAPPED(X)                                                                               \
    X(nvmlDeviceGetMemoryInfo) X(nvmlDeviceGetMemoryInfo_v2) X(nvmlDeviceGetComputeRunningProcesses)       \
    X(nvmlDeviceGetComputeRunningProcesses_v2) X(nvmlDeviceGetComputeRunningProcesses_v3)                  \
    X(nvmlDeviceGetGraphicsRunningProcesses) X(nvmlDeviceGetGraphicsRunningProcesses_v2)                   \
    X(nvmlDeviceGetGraphicsRunningProcesses_v3) X(nvmlDeviceGetMPSComputeRunningProcesses)                 \
    X(nvmlDeviceGetMPSComputeRunningProcesses_v2) X(nvmlDeviceGetMPSComputeRunningProcesses_v3)            \
    X(nvmlDeviceGetRunningProcessDetailList) X(nvmlDeviceGetProcessUtilization)                           \
    X(nvmlDeviceGetProcessesUtilizationInfo) X(nvmlDeviceGetUtilizationRates)
#define GS_NVML_HELPERS(X)                                                                               \
    X(nvmlDeviceGetUUID) X(nvmlInit_v2) X(nvmlDeviceGetHandleByUUID) X(nvmlDeviceGetComputeRunningProcesses_v3)

#define GS_DECLARE_REAL(name) extern __typeof__(&name) real_##name;
GS_CUDA_WRAPPED(GS_DECLARE_REAL)
GS_CUDA_HELPERS(GS_DECLARE_REAL)
GS_NVML_WRAPPED(GS_DECLARE_REAL)
GS_NVML_HELPERS(GS_DECLARE_REAL)

/* A runtime asked for entry points as of `cuda_version` (cuda/module.c: records a runtime of a newer
 * CUDA major than the driver's, which will refuse to start). */
void gs_module_runtime_version(int cuda_version);
/* A context went: credits the variables of the modules the driver unloaded with it (cuda/module.c). */
void gs_module_context_gone(unsigned ctx);

extern _Atomic int gs_cuda_ready, gs_nvml_ready;
int gs_cuda_resolve(void); /* resolves every real entry point of libcuda.so.1 once; 0 on success */
int gs_nvml_resolve(void);

static inline int cuda_real(void)
{
    if (GS_LIKELY(atomic_load_explicit(&gs_cuda_ready, memory_order_acquire))) return 0;
    return gs_cuda_resolve();
}

static inline int nvml_real(void)
{
    if (GS_LIKELY(atomic_load_explicit(&gs_nvml_ready, memory_order_acquire))) return 0;
    return gs_nvml_resolve();
}

#define NEED_REAL(name)                                                                                  \
    do {                                                                                                 \
        if (GS_UNLIKELY(cuda_real() != 0 || real_##name == NULL)) return CUDA_ERROR_NOT_INITIALIZED;     \
    } while (0)

/* ------------------------------------------------------------------------------------------------
 * Allocation tables and the slice's devices (gs_init.c)
 * ---------------------------------------------------------------------------------------------- */

extern gs_table tab_dptr;  /* device pointers: cuMemAlloc*, managed, async, pools, IPC opens */
extern gs_table tab_vmm;   /* VMM handles held by the application -> gs_phys* */
extern gs_table tab_map;   /* VMM mapping start addresses -> gs_vmap* */
extern gs_table tab_array; /* CUarray, CUmipmappedArray and CUexternalMemory handles */
extern gs_table tab_pool;  /* pools created with a non-device location (their allocations are free) */
extern gs_table tab_graph; /* graphs with memory alloc nodes -> their bytes */
extern gs_table tab_gexec; /* executable graphs with memory -> bytes | GS_GEXEC_BACKED once launched */
extern _Atomic int has_exports; /* this process exported memory for IPC: frees drop its export records */
extern _Atomic uint64_t ctx_charged; /* bit per device ordinal: configured context overhead charged */

#define GS_MAX_DEVICES 64
extern _Atomic int only_device_is_slice; /* 1: one device, the slice's: skip lookups */
int device_is_slice(CUdevice dev);
int current_device(CUdevice *dev);

/* ------------------------------------------------------------------------------------------------
 * Reserving and crediting bytes
 * ---------------------------------------------------------------------------------------------- */

CUresult reserve_retry(uint64_t bytes); /* settles pools' slack, then retries (cuda/pool.c) */
CUresult reserve_on(CUdevice dev, uint64_t bytes);


/* 1 when memory on the current context's device counts against the slice and may be allocated. */
static inline int current_device_is_slice(void)
{
    if (GS_LIKELY(atomic_load_explicit(&only_device_is_slice, memory_order_relaxed))) return 1;
    CUdevice dev;
    /* Without a current context the driver call fails on its own; reserve anyway and roll back. */
    if (real_cuCtxGetDevice == NULL || real_cuCtxGetDevice(&dev) != CUDA_SUCCESS) return 1;
    return device_is_slice(dev);
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
#define GS_BYTES_MASK ((1ull << 40) - 1)

#define GS_POOL_SHIFT 40 /* bits 40..47: 1 + the stream-ordered pool record an allocation came from */

#define GS_POOL_OF(v) ((unsigned)((v) >> GS_POOL_SHIFT) & 0xffu)

#define GS_MAX_CTX 4096

/* Context tags (cuda/context.c): a device-pointer entry carries its context's index in the top 16
 * bits of its table value, so a context teardown can credit everything the driver freed with it. */
enum { GS_LIM_HEAP, GS_LIM_STACK, GS_LIM_FIFO, GS_LIM_N };
extern __thread uintptr_t tl_ctx;
extern __thread unsigned tl_idx;
unsigned ctx_index_slow(uintptr_t c);

static inline unsigned ctx_index(uintptr_t c)
{
    if (GS_LIKELY(c == tl_ctx && c != 0)) return tl_idx;
    return ctx_index_slow(c);
}

/* The table value for `bytes` allocated in the calling thread's current context. */
static inline uint64_t in_current_ctx(uint64_t bytes)
{
    CUcontext c = NULL;
    if (GS_LIKELY(real_cuCtxGetCurrent != NULL)) (void)real_cuCtxGetCurrent(&c);
    return bytes | (uint64_t)ctx_index((uintptr_t)c) << 48;
}


void pool_freed(unsigned slot, uint64_t bytes); /* cuda/pool.c */

/* A table value's bytes go back to the slice, or to the pool they came from (which keeps them). */
static inline void credit_entry(uint64_t v)
{
    if (GS_UNLIKELY(GS_POOL_OF(v) != 0)) pool_freed(GS_POOL_OF(v) - 1, v & GS_BYTES_MASK);
    else release(v & GS_BYTES_MASK);
}

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

/*
 * The charging sequence of every counted allocation: reserve `bytes` in the slice (refused:
 * CUDA_ERROR_OUT_OF_MEMORY without reaching the driver), make the driver call, remember the object
 * under `key` with table value `val` so its free credits exactly what was charged; if the driver
 * fails the reservation is released, if the table is full the object is undone with `undo` and
 * released. Returns from the enclosing function.
 */
#define GS_CHARGE(reserve, bytes, call, table, key, val, undo)                                           \
    do {                                                                                                 \
        uint64_t gs_bytes_ = (bytes);                                                                    \
        CUresult gs_rc_ = reserve(gs_bytes_);                                                            \
        if (GS_UNLIKELY(gs_rc_ != CUDA_SUCCESS)) return gs_rc_;                                          \
        gs_rc_ = (call);                                                                                 \
        if (GS_UNLIKELY(gs_rc_ != CUDA_SUCCESS)) {                                                       \
            release(gs_bytes_);                                                                          \
            return gs_rc_;                                                                               \
        }                                                                                                \
        if (GS_UNLIKELY(remember(&(table), (uint64_t)(key), (val)) != 0)) {                              \
            undo;                                                                                        \
            release(gs_bytes_);                                                                          \
            return CUDA_ERROR_OUT_OF_MEMORY;                                                             \
        }                                                                                                \
        return CUDA_SUCCESS;                                                                             \
    } while (0)

/* ------------------------------------------------------------------------------------------------
 * Across files
 * ---------------------------------------------------------------------------------------------- */

/* cuda/context.c */
unsigned ctx_find(uintptr_t c);
int charge_context(CUdevice dev);
void note_host_pid(void);
void gs_ctx_after_fork_child(void);

/* cuda/pool.c */
extern _Atomic int pool_slack; /* some stream-ordered pool may hold more than its live allocations */
void pools_settle(void);
void gs_pool_after_fork_child(void);

/* cuda/vmm.c */
void gs_vmm_after_fork_child(void);

/* cuda/graph.c */
extern _Atomic int has_graph_mem; /* some graph has alloc nodes: launches look their executable up */
CUresult graph_launch(CUresult (*fn)(CUgraphExec, CUstream), CUgraphExec g, CUstream s);
void gs_graph_after_fork_child(void);

/* cuda/hook.c */
void gs_hook_after_fork_child(void);

#endif
