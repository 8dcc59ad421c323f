/*
 * Virtual memory management, charged by physical allocation lifetime.
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

void gs_vmm_after_fork_child(void)
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

