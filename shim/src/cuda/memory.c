/*
 * Counted allocations: linear, pitched, managed, arrays, IPC opens, external memory; and memory
 * reporting (cuMemGetInfo, cuDeviceTotalMem).
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
 * Linear allocations
 * ---------------------------------------------------------------------------------------------- */

GS_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    NEED_REAL(cuMemAlloc_v2);
    if (GS_UNLIKELY(bytesize == 0 || dptr == NULL)) return real_cuMemAlloc_v2(dptr, bytesize);
    GS_CHARGE(reserve_current, bytesize, real_cuMemAlloc_v2(dptr, bytesize), tab_dptr, *dptr, in_current_ctx(bytesize),
              real_cuMemFree_v2(*dptr));
}

GS_EXPORT CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize)
{
    NEED_REAL(cuMemAlloc);
    if (bytesize == 0 || dptr == NULL) return real_cuMemAlloc(dptr, bytesize);
    GS_CHARGE(reserve_current, bytesize, real_cuMemAlloc(dptr, bytesize), tab_dptr, *dptr, in_current_ctx(bytesize),
              if (real_cuMemFree) real_cuMemFree(*dptr));
}

GS_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    NEED_REAL(cuMemAllocManaged);
    if (bytesize == 0 || dptr == NULL) return real_cuMemAllocManaged(dptr, bytesize, flags);
    GS_CHARGE(reserve_current, bytesize, real_cuMemAllocManaged(dptr, bytesize, flags), tab_dptr, *dptr,
              in_current_ctx(bytesize), real_cuMemFree_v2(*dptr));
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
    GS_CHARGE(reserve_current, bytes, call, tab_array, (uintptr_t)*(handle), bytes, destroy(*(handle)))

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
 * External memory (Vulkan, EGL, ... allocations imported into CUDA): memory the slice uses that no
 * CUDA allocation of it paid for. Charged at import by the descriptor's size, credited at destroy.
 * ---------------------------------------------------------------------------------------------- */

GS_EXPORT CUresult cuImportExternalMemory(CUexternalMemory *extMem_out, const CUDA_EXTERNAL_MEMORY_HANDLE_DESC *desc)
{
    NEED_REAL(cuImportExternalMemory);
    if (extMem_out == NULL || desc == NULL || desc->size == 0) return real_cuImportExternalMemory(extMem_out, desc);
    GS_CHARGE(reserve_current, desc->size, real_cuImportExternalMemory(extMem_out, desc), tab_array,
              (uintptr_t)*extMem_out, desc->size, real_cuDestroyExternalMemory(*extMem_out));
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

