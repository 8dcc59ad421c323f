/*
 * Stream-ordered allocations and memory pools: charged by the pools' reserved high-water.
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

void pool_freed(unsigned slot, uint64_t bytes)
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
void pools_settle(void)
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


/* A forked child holds none of its parent's pools. */
void gs_pool_after_fork_child(void)
{
    memset(pool_recs, 0, sizeof(pool_recs));
    atomic_store(&pool_slack, 0);
    pthread_mutex_init(&pool_lock, NULL);
}
