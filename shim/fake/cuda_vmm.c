/*
 * Virtual memory management (physical allocations on memfds mapped into reserved ranges), external
 * memory and arrays of the fake libcuda.so.1.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fake_cuda.h"

/* ---------------------------------------------------------------- VMM */

FAKE_EXPORT CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *prop,
                                                   CUmemAllocationGranularity_flags option)
{
    (void)option;
    CHECK_INIT();
    if (!g || !prop) return CUDA_ERROR_INVALID_VALUE;
    *g = 2u << 20;
    return CUDA_SUCCESS;
}

static vmm_alloc *vmm_of(CUmemGenericAllocationHandle h)
{
    pthread_mutex_lock(&vmm_lock);
    vmm_alloc *v = vmm_live;
    while (v && (uintptr_t)v != (uintptr_t)h) v = v->next;
    pthread_mutex_unlock(&vmm_lock);
    return v;
}

/* Drops one reference; the physical memory goes with the last one (like the driver). */
void vmm_unref(vmm_alloc *v, int handle_ref)
{
    pthread_mutex_lock(&vmm_lock);
    if (handle_ref) v->handle_refs--;
    else v->map_refs--;
    int last = v->handle_refs == 0 && v->map_refs == 0;
    if (last)
        for (vmm_alloc **pp = &vmm_live; *pp; pp = &(*pp)->next)
            if (*pp == v) {
                *pp = v->next;
                break;
            }
    pthread_mutex_unlock(&vmm_lock);
    if (!last) return;
    if (v->charged) uncharge(v->dev, v->size);
    close(v->fd);
    v->magic = 0;
    free(v);
}

static CUresult vmm_new(CUmemGenericAllocationHandle *handle, uint64_t size, int dev, int charged, int fd)
{
    vmm_alloc *v = calloc(1, sizeof(*v));
    if (!v) return CUDA_ERROR_OUT_OF_MEMORY;
    *v = (vmm_alloc){VMM_MAGIC, size, dev, charged, fd, 1, 0, NULL};
    pthread_mutex_lock(&vmm_lock);
    v->next = vmm_live;
    vmm_live = v;
    pthread_mutex_unlock(&vmm_lock);
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)v;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                                 unsigned long long flags)
{
    CHECK_INIT();
    if (!handle || !prop || flags != 0 || size == 0 || size % (2u << 20) != 0) return CUDA_ERROR_INVALID_VALUE;
    int dev = -1;
    if (prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE) {
        if (!valid_dev(prop->location.id)) return CUDA_ERROR_INVALID_DEVICE;
        dev = prop->location.id;
        CUresult rc = charge(dev, size);
        if (rc != CUDA_SUCCESS) return rc;
    }
    int fd = memfd_create("fake-gpu-vmm", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
        if (fd >= 0) close(fd);
        if (dev >= 0) uncharge(dev, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUresult rc = vmm_new(handle, size, dev, dev >= 0, fd);
    if (rc != CUDA_SUCCESS) {
        close(fd);
        if (dev >= 0) uncharge(dev, size);
    }
    return rc;
}

FAKE_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    CHECK_INIT();
    vmm_alloc *v = vmm_of(handle);
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&vmm_lock);
    int ok = v->handle_refs > 0;
    pthread_mutex_unlock(&vmm_lock);
    if (!ok) return CUDA_ERROR_INVALID_VALUE;
    vmm_unref(v, 1);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                         unsigned long long flags)
{
    (void)alignment;
    (void)addr;
    CHECK_INIT();
    if (!ptr || size == 0 || size % (2u << 20) != 0 || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    void *p = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    *ptr = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    CHECK_INIT();
    if (!ptr || size == 0) return CUDA_ERROR_INVALID_VALUE;
    uint64_t base, sz;
    if (find_range(ptr, &base, &sz) || find_range(ptr + size - 1, &base, &sz)) return CUDA_ERROR_INVALID_VALUE; /* still mapped */
    munmap((void *)(uintptr_t)ptr, size);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                              unsigned long long flags)
{
    CHECK_INIT();
    vmm_alloc *v = vmm_of(handle);
    if (!v || !ptr || size == 0 || flags != 0 || offset + size > v->size || size % (2u << 20) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t base, sz;
    if (find_range(ptr, &base, &sz)) return CUDA_ERROR_INVALID_VALUE; /* already mapped */
    pthread_mutex_lock(&vmm_lock);
    int alive = v->handle_refs > 0; /* mapping needs a handle the application still holds */
    if (alive) v->map_refs++;
    pthread_mutex_unlock(&vmm_lock);
    if (!alive) return CUDA_ERROR_INVALID_VALUE;
    if (mmap((void *)(uintptr_t)ptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, v->fd, (off_t)offset) ==
        MAP_FAILED) {
        vmm_unref(v, 0);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    track_alloc(&(alloc){ptr, size, v->dev, K_VMM_MAP, -1, (uintptr_t)v, NULL, 0, NULL});
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    CHECK_INIT();
    if (!ptr || size == 0) return CUDA_ERROR_INVALID_VALUE;
    /* the range may span several mappings, each unmapped whole */
    for (CUdeviceptr p = ptr; p < ptr + size;) {
        alloc *a = untrack(p);
        if (!a || a->kind != K_VMM_MAP) {
            if (a) {
                track_alloc(a); /* put back as it was: its context, export and backing kept */
                free(a);
            }
            return CUDA_ERROR_INVALID_VALUE;
        }
        p += a->size;
        device_free(a);
    }
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    CHECK_INIT();
    if (!ptr || size == 0 || !desc || count == 0) return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
    CHECK_INIT();
    if (!handle || !addr) return CUDA_ERROR_INVALID_VALUE;
    vmm_alloc *v = NULL;
    pthread_mutex_lock(&alloc_lock);
    for (unsigned b = 0; b < NBUCKETS && !v; b++)
        for (alloc *a = buckets[b]; a; a = a->next)
            if (a->kind == K_VMM_MAP && (uintptr_t)addr >= a->ptr && (uintptr_t)addr < a->ptr + a->size) {
                v = (vmm_alloc *)a->shared_fd_handle;
                break;
            }
    pthread_mutex_unlock(&alloc_lock);
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&vmm_lock);
    v->handle_refs++;
    pthread_mutex_unlock(&vmm_lock);
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)v;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemExportToShareableHandle(void *shareable, CUmemGenericAllocationHandle handle,
                                                  CUmemAllocationHandleType type, unsigned long long flags)
{
    CHECK_INIT();
    vmm_alloc *v = vmm_of(handle);
    if (!v || !shareable || flags != 0 || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_INVALID_VALUE;
    int fd = fcntl(v->fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
    *(int *)shareable = fd;
    return CUDA_SUCCESS;
}

/* The importer gets a handle to the same physical memory (the exporter's: not charged again). */
FAKE_EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                                    CUmemAllocationHandleType type)
{
    CHECK_INIT();
    if (!handle || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_INVALID_VALUE;
    int fd = fcntl((int)(intptr_t)osHandle, F_DUPFD_CLOEXEC, 0);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0 || st.st_size <= 0) {
        if (fd >= 0) close(fd);
        return CUDA_ERROR_INVALID_VALUE;
    }
    CUresult rc = vmm_new(handle, (uint64_t)st.st_size, current_ctx ? current_ctx->dev : 0, 0, fd);
    if (rc != CUDA_SUCCESS) close(fd);
    return rc;
}

/* ---------------------------------------------------------------- external memory */

/* Memory another API (Vulkan, EGL) allocated, imported by file descriptor. The double charges the
 * card nothing for it: in a real process the exporting API's allocation already holds it. */
FAKE_EXPORT CUresult cuImportExternalMemory(CUexternalMemory *ext, const CUDA_EXTERNAL_MEMORY_HANDLE_DESC *desc)
{
    CHECK_INIT();
    if (!ext || !desc || desc->size == 0 || desc->type != CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD ||
        desc->handle.fd < 0)
        return CUDA_ERROR_INVALID_VALUE;
    struct CUextMemory_st *m = calloc(1, sizeof(*m));
    if (!m) return CUDA_ERROR_OUT_OF_MEMORY;
    m->fd = desc->handle.fd; /* the driver owns the descriptor after a successful import */
    m->size = desc->size;
    *ext = m;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuDestroyExternalMemory(CUexternalMemory ext)
{
    CHECK_INIT();
    if (!ext) return CUDA_ERROR_INVALID_HANDLE;
    close(ext->fd);
    free(ext);
    return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------- arrays */

static uint64_t fmt_bytes(CUarray_format f)
{
    switch (f) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8: return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF: return 2;
    default: return 4;
    }
}

static uint64_t nz(size_t v)
{
    return v ? v : 1;
}

static CUresult array_new(uint64_t size, void **out, size_t objsize, size_t row, size_t height, size_t depth)
{
    CHECK_INIT();
    CUdevice dev;
    CUresult rc = current_dev(&dev);
    if (rc != CUDA_SUCCESS) return rc;
    rc = charge(dev, size);
    if (rc != CUDA_SUCCESS) return rc;
    struct CUarray_st *a = calloc(1, objsize);
    if (!a) {
        uncharge(dev, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    a->size = size;
    a->dev = dev;
    if (row) {
        void *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) {
            free(a);
            uncharge(dev, size);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        a->data = m;
        a->row = row;
        a->height = height;
        a->depth = depth;
    }
    *out = a;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuArrayCreate_v2(CUarray *ph, const CUDA_ARRAY_DESCRIPTOR *d)
{
    if (!ph || !d || d->Width == 0 || (d->NumChannels != 1 && d->NumChannels != 2 && d->NumChannels != 4))
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t row = d->Width * fmt_bytes(d->Format) * d->NumChannels;
    return array_new(row * nz(d->Height), (void **)ph, sizeof(struct CUarray_st), row, nz(d->Height), 1);
}

static uint64_t a3d_bytes(const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    uint64_t depth = nz(d->Depth);
    if ((d->Flags & CUDA_ARRAY3D_CUBEMAP) && !(d->Flags & CUDA_ARRAY3D_LAYERED)) depth = 6;
    return nz(d->Width) * nz(d->Height) * depth * fmt_bytes(d->Format) * nz(d->NumChannels);
}

FAKE_EXPORT CUresult cuArray3DCreate_v2(CUarray *ph, const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    if (!ph || !d || d->Width == 0 || (d->NumChannels != 1 && d->NumChannels != 2 && d->NumChannels != 4))
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t row = d->Width * fmt_bytes(d->Format) * nz(d->NumChannels);
    uint64_t bytes = a3d_bytes(d);
    return array_new(bytes, (void **)ph, sizeof(struct CUarray_st), row, nz(d->Height), bytes / row / nz(d->Height));
}

FAKE_EXPORT CUresult cuArrayCreate(CUarray *ph, const CUDA_ARRAY_DESCRIPTOR_v1 *d)
{
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    CUDA_ARRAY_DESCRIPTOR v2 = {d->Width, d->Height, d->Format, d->NumChannels};
    return cuArrayCreate_v2(ph, &v2);
}

FAKE_EXPORT CUresult cuArray3DCreate(CUarray *ph, const CUDA_ARRAY3D_DESCRIPTOR_v1 *d)
{
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    CUDA_ARRAY3D_DESCRIPTOR v2 = {d->Width, d->Height, d->Depth, d->Format, d->NumChannels, d->Flags};
    return cuArray3DCreate_v2(ph, &v2);
}

/* Frees what array_new made (arrays and mipmapped arrays are laid out alike). */
static CUresult array_free(struct CUarray_st *a)
{
    CHECK_INIT();
    if (!a) return CUDA_ERROR_INVALID_HANDLE;
    uncharge(a->dev, a->size);
    if (a->data) munmap(a->data, a->size);
    free(a);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuArrayDestroy(CUarray h)
{
    return array_free(h);
}

FAKE_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *ph, const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned int levels)
{
    if (!ph || !d || d->Width == 0 || levels == 0) return CUDA_ERROR_INVALID_VALUE;
    CUDA_ARRAY3D_DESCRIPTOR l = *d;
    uint64_t total = 0;
    for (unsigned int i = 0; i < levels; i++) {
        total += a3d_bytes(&l);
        l.Width = l.Width > 1 ? l.Width / 2 : l.Width;
        l.Height = l.Height > 1 ? l.Height / 2 : l.Height;
        if (!(l.Flags & CUDA_ARRAY3D_LAYERED)) l.Depth = l.Depth > 1 ? l.Depth / 2 : l.Depth;
    }
    return array_new(total, (void **)ph, sizeof(struct CUmipmappedArray_st), 0, 0, 0);
}

FAKE_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray h)
{
    return array_free((struct CUarray_st *)(void *)h);
}


/* ---------------------------------------------------------------- copies into and out of arrays */

/* Where a side of a 3-D copy starts, its pitch and its rows per slice; an array side must contain the copy. */
static CUresult copy_side(CUmemorytype t, const void *host, CUdeviceptr dev, CUarray arr, size_t x, size_t y, size_t z,
                          size_t pitch, size_t height, const CUDA_MEMCPY3D *c, char **base, size_t *p, size_t *h)
{
    size_t depth = c->Depth ? c->Depth : 1, rows = c->Height ? c->Height : 1;
    switch (t) {
    case CU_MEMORYTYPE_HOST: *base = (char *)host; break;
    case CU_MEMORYTYPE_DEVICE:
    case CU_MEMORYTYPE_UNIFIED: *base = (char *)(uintptr_t)dev; break;
    case CU_MEMORYTYPE_ARRAY:
        if (!arr || !arr->data) return CUDA_ERROR_INVALID_HANDLE;
        if (x + c->WidthInBytes > arr->row || y + rows > arr->height || z + depth > arr->depth)
            return CUDA_ERROR_INVALID_VALUE; /* outside the array */
        *base = arr->data;
        pitch = arr->row;
        height = arr->height;
        break;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
    if (!*base) return CUDA_ERROR_INVALID_VALUE;
    if (t != CU_MEMORYTYPE_ARRAY && (pitch < c->WidthInBytes || (depth > 1 && height < rows)))
        return CUDA_ERROR_INVALID_VALUE;
    *base += (z * height + y) * pitch + x;
    *p = pitch;
    *h = height;
    return CUDA_SUCCESS;
}

CUresult fake_copy3d(const CUDA_MEMCPY3D *c)
{
    CHECK_INIT();
    if (!c) return CUDA_ERROR_INVALID_VALUE;
    char *s, *d;
    size_t sp, sh, dp, dh;
    CUresult rc = copy_side(c->srcMemoryType, c->srcHost, c->srcDevice, c->srcArray, c->srcXInBytes, c->srcY, c->srcZ,
                            c->srcPitch, c->srcHeight, c, &s, &sp, &sh);
    if (rc == CUDA_SUCCESS)
        rc = copy_side(c->dstMemoryType, c->dstHost, c->dstDevice, c->dstArray, c->dstXInBytes, c->dstY, c->dstZ,
                       c->dstPitch, c->dstHeight, c, &d, &dp, &dh);
    if (rc != CUDA_SUCCESS) return rc;
    size_t depth = c->Depth ? c->Depth : 1, rows = c->Height ? c->Height : 1;
    for (size_t z = 0; z < depth; z++)
        for (size_t y = 0; y < rows; y++) memmove(d + (z * dh + y) * dp, s + (z * sh + y) * sp, c->WidthInBytes);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemcpy3D_v2(const CUDA_MEMCPY3D *c) { return fake_copy3d(c); }
FAKE_EXPORT CUresult cuMemcpy3D_v2_ptds(const CUDA_MEMCPY3D *c) { return fake_copy3d(c); }
FAKE_EXPORT CUresult cuMemcpy3DAsync_v2(const CUDA_MEMCPY3D *c, CUstream s)
{
    (void)s;
    return fake_copy3d(c);
}
FAKE_EXPORT CUresult cuMemcpy3DAsync_v2_ptsz(const CUDA_MEMCPY3D *c, CUstream s)
{
    (void)s;
    return fake_copy3d(c);
}

/* A 1-D copy addresses an array as its bytes in order; [off, off+n) must lie inside it. */
static CUresult array_bytes(CUarray a, size_t off, size_t n, char **p)
{
    CHECK_INIT();
    if (!a || !a->data) return CUDA_ERROR_INVALID_HANDLE;
    if (off > a->size || n > a->size - off) return CUDA_ERROR_INVALID_VALUE;
    *p = a->data + off;
    return CUDA_SUCCESS;
}

static CUresult move(void *dst, const void *src, size_t n)
{
    if (n && (!dst || !src)) return CUDA_ERROR_INVALID_VALUE;
    if (n) memmove(dst, src, n);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemcpyHtoA_v2(CUarray dst, size_t off, const void *src, size_t n)
{
    char *p;
    CUresult rc = array_bytes(dst, off, n, &p);
    return rc != CUDA_SUCCESS ? rc : move(p, src, n);
}
FAKE_EXPORT CUresult cuMemcpyAtoH_v2(void *dst, CUarray src, size_t off, size_t n)
{
    char *p;
    CUresult rc = array_bytes(src, off, n, &p);
    return rc != CUDA_SUCCESS ? rc : move(dst, p, n);
}
FAKE_EXPORT CUresult cuMemcpyDtoA_v2(CUarray dst, size_t off, CUdeviceptr src, size_t n)
{
    return cuMemcpyHtoA_v2(dst, off, (const void *)(uintptr_t)src, n);
}
FAKE_EXPORT CUresult cuMemcpyAtoD_v2(CUdeviceptr dst, CUarray src, size_t off, size_t n)
{
    return cuMemcpyAtoH_v2((void *)(uintptr_t)dst, src, off, n);
}
FAKE_EXPORT CUresult cuMemcpyAtoA_v2(CUarray dst, size_t doff, CUarray src, size_t soff, size_t n)
{
    char *d, *s;
    CUresult rc = array_bytes(dst, doff, n, &d);
    if (rc == CUDA_SUCCESS) rc = array_bytes(src, soff, n, &s);
    return rc != CUDA_SUCCESS ? rc : move(d, s, n);
}
FAKE_EXPORT CUresult cuMemcpyHtoAAsync_v2(CUarray dst, size_t off, const void *src, size_t n, CUstream s)
{
    (void)s;
    return cuMemcpyHtoA_v2(dst, off, src, n);
}
FAKE_EXPORT CUresult cuMemcpyAtoHAsync_v2(void *dst, CUarray src, size_t off, size_t n, CUstream s)
{
    (void)s;
    return cuMemcpyAtoH_v2(dst, src, off, n);
}
FAKE_EXPORT CUresult cuMemcpyHtoA_v2_ptds(CUarray d, size_t o, const void *s, size_t n) { return cuMemcpyHtoA_v2(d, o, s, n); }
FAKE_EXPORT CUresult cuMemcpyAtoH_v2_ptds(void *d, CUarray s, size_t o, size_t n) { return cuMemcpyAtoH_v2(d, s, o, n); }
FAKE_EXPORT CUresult cuMemcpyDtoA_v2_ptds(CUarray d, size_t o, CUdeviceptr s, size_t n) { return cuMemcpyDtoA_v2(d, o, s, n); }
FAKE_EXPORT CUresult cuMemcpyAtoD_v2_ptds(CUdeviceptr d, CUarray s, size_t o, size_t n) { return cuMemcpyAtoD_v2(d, s, o, n); }
FAKE_EXPORT CUresult cuMemcpyAtoA_v2_ptds(CUarray d, size_t doff, CUarray s, size_t soff, size_t n)
{
    return cuMemcpyAtoA_v2(d, doff, s, soff, n);
}
FAKE_EXPORT CUresult cuMemcpyHtoAAsync_v2_ptsz(CUarray d, size_t o, const void *s, size_t n, CUstream st)
{
    return cuMemcpyHtoAAsync_v2(d, o, s, n, st);
}
FAKE_EXPORT CUresult cuMemcpyAtoHAsync_v2_ptsz(void *d, CUarray s, size_t o, size_t n, CUstream st)
{
    return cuMemcpyAtoHAsync_v2(d, s, o, n, st);
}
