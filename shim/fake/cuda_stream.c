/*
 * Streams, events, copies, host memory, pointer queries and context queries of the fake
 * libcuda.so.1 beyond the core (fake_cuda.c). Device memory is host memory here, so copies and
 * memsets are plain memcpy/memset in whatever direction; asynchronous ones complete at once (kernels
 * do not touch memory, so stream order cannot be observed otherwise), except into a capturing
 * stream, where they become nodes of the captured graph and run at each of its launches.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "fake_cuda.h"

/* ---------------------------------------------------------------- contexts */

FAKE_EXPORT CUresult cuCtxGetApiVersion(CUcontext ctx, unsigned int *version)
{
    CHECK_INIT();
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    if (!ctx) ctx = current_ctx;
    if (!ctx || ctx->magic != CTX_MAGIC) return CUDA_ERROR_INVALID_CONTEXT;
    *version = 3020; /* contexts of the _v2 API */
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuCtxGetFlags(unsigned int *flags)
{
    CHECK_INIT();
    if (!flags) return CUDA_ERROR_INVALID_VALUE;
    if (!current_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    *flags = 0;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuCtxSetFlags(unsigned int flags)
{
    (void)flags;
    CHECK_INIT();
    return current_ctx ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

FAKE_EXPORT CUresult cuCtxGetId(CUcontext ctx, unsigned long long *id)
{
    CHECK_INIT();
    if (!id) return CUDA_ERROR_INVALID_VALUE;
    if (!ctx) ctx = current_ctx;
    if (!ctx || ctx->magic != CTX_MAGIC) return CUDA_ERROR_INVALID_CONTEXT;
    *id = (unsigned long long)(uintptr_t)ctx;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuCtxGetStreamPriorityRange(int *least, int *greatest)
{
    CHECK_INIT();
    if (least) *least = 0;
    if (greatest) *greatest = -5;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuCtxGetCacheConfig(CUfunc_cache *c)
{
    CHECK_INIT();
    if (!c) return CUDA_ERROR_INVALID_VALUE;
    *c = CU_FUNC_CACHE_PREFER_NONE;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuCtxSetCacheConfig(CUfunc_cache c)
{
    (void)c;
    CHECK_INIT();
    return current_ctx ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

FAKE_EXPORT CUresult cuCtxGetSharedMemConfig(CUsharedconfig *c)
{
    CHECK_INIT();
    if (!c) return CUDA_ERROR_INVALID_VALUE;
    *c = CU_SHARED_MEM_CONFIG_FOUR_BYTE_BANK_SIZE;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuCtxSetSharedMemConfig(CUsharedconfig c)
{
    (void)c;
    CHECK_INIT();
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuCtxResetPersistingL2Cache(void)
{
    CHECK_INIT();
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuCtxGetExecAffinity(CUexecAffinityParam *p, CUexecAffinityType type)
{
    CHECK_INIT();
    if (!p || type != CU_EXEC_AFFINITY_TYPE_SM_COUNT) return CUDA_ERROR_INVALID_VALUE;
    if (!current_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    p->type = type;
    p->param.smCount.val = (unsigned)sys()->gpus[current_ctx->dev].multiprocessors;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags)
{
    (void)flags;
    CHECK_INIT();
    return valid_dev(dev) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

FAKE_EXPORT CUresult cuDevicePrimaryCtxSetFlags(CUdevice dev, unsigned int flags)
{
    return cuDevicePrimaryCtxSetFlags_v2(dev, flags);
}

/* ---------------------------------------------------------------- streams */

static int real_stream(CUstream s)
{
    return s && s != CU_STREAM_LEGACY && s != CU_STREAM_PER_THREAD;
}

FAKE_EXPORT CUresult cuStreamCreateWithPriority(CUstream *ph, unsigned int flags, int priority)
{
    CUresult rc = cuStreamCreate(ph, flags);
    if (rc == CUDA_SUCCESS) (*ph)->priority = priority < -5 ? -5 : priority > 0 ? 0 : priority;
    return rc;
}

FAKE_EXPORT CUresult cuStreamDestroy(CUstream s)
{
    return cuStreamDestroy_v2(s);
}

FAKE_EXPORT CUresult cuStreamSynchronize_ptsz(CUstream s)
{
    return cuStreamSynchronize(s);
}

FAKE_EXPORT CUresult cuStreamQuery(CUstream s)
{
    CHECK_INIT();
    CUdevice dev;
    CUresult rc = stream_dev(s, &dev);
    if (rc != CUDA_SUCCESS) return rc;
    return fake_busy_until(sys()->state[dev]) > fake_now_ns() ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuStreamQuery_ptsz(CUstream s)
{
    return cuStreamQuery(s);
}

FAKE_EXPORT CUresult cuStreamGetPriority(CUstream s, int *priority)
{
    CHECK_INIT();
    if (!priority) return CUDA_ERROR_INVALID_VALUE;
    *priority = real_stream(s) ? s->priority : 0;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuStreamGetPriority_ptsz(CUstream s, int *priority)
{
    return cuStreamGetPriority(s, priority);
}

FAKE_EXPORT CUresult cuStreamGetFlags(CUstream s, unsigned int *flags)
{
    CHECK_INIT();
    if (!flags) return CUDA_ERROR_INVALID_VALUE;
    *flags = real_stream(s) ? s->flags : 0;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuStreamGetFlags_ptsz(CUstream s, unsigned int *flags)
{
    return cuStreamGetFlags(s, flags);
}

FAKE_EXPORT CUresult cuStreamGetId(CUstream s, unsigned long long *id)
{
    CHECK_INIT();
    if (!id) return CUDA_ERROR_INVALID_VALUE;
    *id = (unsigned long long)(uintptr_t)s; /* unique while the stream lives; the legacy and per-thread ones: 1, 2 */
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuStreamGetId_ptsz(CUstream s, unsigned long long *id)
{
    return cuStreamGetId(s, id);
}

FAKE_EXPORT CUresult cuStreamGetCtx(CUstream s, CUcontext *ctx)
{
    CHECK_INIT();
    if (!ctx) return CUDA_ERROR_INVALID_VALUE;
    if (real_stream(s)) *ctx = s->ctx;
    else if (!(*ctx = current_ctx)) return CUDA_ERROR_INVALID_CONTEXT;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuStreamGetCtx_ptsz(CUstream s, CUcontext *ctx)
{
    return cuStreamGetCtx(s, ctx);
}

FAKE_EXPORT CUresult cuStreamGetCtx_v2(CUstream s, CUcontext *ctx, CUgreenCtx *green)
{
    if (green) *green = NULL;
    return cuStreamGetCtx(s, ctx);
}

FAKE_EXPORT CUresult cuStreamGetCtx_v2_ptsz(CUstream s, CUcontext *ctx, CUgreenCtx *green)
{
    return cuStreamGetCtx_v2(s, ctx, green);
}

FAKE_EXPORT CUresult cuStreamGetDevice(CUstream s, CUdevice *dev)
{
    CHECK_INIT();
    if (!dev) return CUDA_ERROR_INVALID_VALUE;
    return stream_dev(s, dev);
}

FAKE_EXPORT CUresult cuStreamGetDevice_ptsz(CUstream s, CUdevice *dev)
{
    return cuStreamGetDevice(s, dev);
}

/* Events are recorded at the end of the device's booked timeline, so waiting is already implied. */
FAKE_EXPORT CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned int flags)
{
    (void)s;
    (void)flags;
    CHECK_INIT();
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

FAKE_EXPORT CUresult cuStreamWaitEvent_ptsz(CUstream s, CUevent e, unsigned int flags)
{
    return cuStreamWaitEvent(s, e, flags);
}

FAKE_EXPORT CUresult cuStreamAddCallback(CUstream s, CUstreamCallback cb, void *data, unsigned int flags)
{
    (void)flags;
    CHECK_INIT();
    if (!cb) return CUDA_ERROR_INVALID_VALUE;
    CUdevice dev;
    CUresult rc = stream_dev(s, &dev);
    if (rc != CUDA_SUCCESS) return rc;
    wait_device_idle(dev);
    cb(s, CUDA_SUCCESS, data);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuStreamAddCallback_ptsz(CUstream s, CUstreamCallback cb, void *data, unsigned int flags)
{
    return cuStreamAddCallback(s, cb, data, flags);
}

FAKE_EXPORT CUresult cuStreamAttachMemAsync(CUstream s, CUdeviceptr p, size_t len, unsigned int flags)
{
    (void)s;
    (void)p;
    (void)len;
    (void)flags;
    CHECK_INIT();
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuStreamAttachMemAsync_ptsz(CUstream s, CUdeviceptr p, size_t len, unsigned int flags)
{
    return cuStreamAttachMemAsync(s, p, len, flags);
}

FAKE_EXPORT CUresult cuStreamSetAttribute(CUstream s, CUstreamAttrID attr, const CUstreamAttrValue *v)
{
    (void)s;
    (void)attr;
    CHECK_INIT();
    return v ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FAKE_EXPORT CUresult cuStreamSetAttribute_ptsz(CUstream s, CUstreamAttrID attr, const CUstreamAttrValue *v)
{
    return cuStreamSetAttribute(s, attr, v);
}

FAKE_EXPORT CUresult cuStreamGetAttribute(CUstream s, CUstreamAttrID attr, CUstreamAttrValue *v)
{
    (void)attr;
    CHECK_INIT();
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    memset(v, 0, sizeof(*v));
    if (attr == CU_LAUNCH_ATTRIBUTE_PRIORITY && real_stream(s)) v->priority = s->priority;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuStreamGetAttribute_ptsz(CUstream s, CUstreamAttrID attr, CUstreamAttrValue *v)
{
    return cuStreamGetAttribute(s, attr, v);
}

FAKE_EXPORT CUresult cuStreamCopyAttributes(CUstream dst, CUstream src)
{
    (void)dst;
    (void)src;
    CHECK_INIT();
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuStreamCopyAttributes_ptsz(CUstream dst, CUstream src)
{
    return cuStreamCopyAttributes(dst, src);
}

/* Stream capture: the stream collects what is submitted into a graph (here: an empty one). */
static __thread CUstreamCaptureMode thread_capture_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;

FAKE_EXPORT CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode)
{
    if (!mode) return CUDA_ERROR_INVALID_VALUE;
    CUstreamCaptureMode old = thread_capture_mode;
    thread_capture_mode = *mode;
    *mode = old;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuStreamBeginCapture_v2(CUstream s, CUstreamCaptureMode mode)
{
    (void)mode;
    CHECK_INIT();
    if (!real_stream(s)) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    if (s->capturing) return CUDA_ERROR_ILLEGAL_STATE;
    CUresult rc = cuGraphCreate((CUgraph *)&s->capture_graph, 0);
    if (rc != CUDA_SUCCESS) return rc;
    s->capturing = CU_STREAM_CAPTURE_STATUS_ACTIVE;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuStreamBeginCapture_v2_ptsz(CUstream s, CUstreamCaptureMode mode)
{
    return cuStreamBeginCapture_v2(s, mode);
}

FAKE_EXPORT CUresult cuStreamBeginCapture(CUstream s)
{
    return cuStreamBeginCapture_v2(s, CU_STREAM_CAPTURE_MODE_GLOBAL);
}

FAKE_EXPORT CUresult cuStreamBeginCapture_ptsz(CUstream s)
{
    return cuStreamBeginCapture(s);
}

FAKE_EXPORT CUresult cuStreamEndCapture(CUstream s, CUgraph *graph)
{
    CHECK_INIT();
    if (!graph) return CUDA_ERROR_INVALID_VALUE;
    if (!real_stream(s) || !s->capturing) return CUDA_ERROR_ILLEGAL_STATE;
    *graph = s->capture_graph;
    s->capture_graph = NULL;
    s->capturing = CU_STREAM_CAPTURE_STATUS_NONE;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuStreamEndCapture_ptsz(CUstream s, CUgraph *graph)
{
    return cuStreamEndCapture(s, graph);
}

FAKE_EXPORT CUresult cuStreamIsCapturing(CUstream s, CUstreamCaptureStatus *status)
{
    CHECK_INIT();
    if (!status) return CUDA_ERROR_INVALID_VALUE;
    *status = real_stream(s) ? (CUstreamCaptureStatus)s->capturing : CU_STREAM_CAPTURE_STATUS_NONE;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuStreamIsCapturing_ptsz(CUstream s, CUstreamCaptureStatus *status)
{
    return cuStreamIsCapturing(s, status);
}

FAKE_EXPORT CUresult cuStreamGetCaptureInfo(CUstream s, CUstreamCaptureStatus *status, cuuint64_t *id)
{
    CUresult rc = cuStreamIsCapturing(s, status);
    if (rc == CUDA_SUCCESS && id) *id = real_stream(s) ? (cuuint64_t)(uintptr_t)s->capture_graph : 0;
    return rc;
}

FAKE_EXPORT CUresult cuStreamGetCaptureInfo_ptsz(CUstream s, CUstreamCaptureStatus *status, cuuint64_t *id)
{
    return cuStreamGetCaptureInfo(s, status, id);
}

FAKE_EXPORT CUresult cuStreamGetCaptureInfo_v2(CUstream s, CUstreamCaptureStatus *status, cuuint64_t *id,
                                               CUgraph *graph, const CUgraphNode **deps, size_t *ndeps)
{
    CUresult rc = cuStreamGetCaptureInfo(s, status, id);
    if (rc != CUDA_SUCCESS) return rc;
    if (graph) *graph = real_stream(s) ? s->capture_graph : NULL;
    if (deps) *deps = NULL;
    if (ndeps) *ndeps = 0;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuStreamGetCaptureInfo_v2_ptsz(CUstream s, CUstreamCaptureStatus *status, cuuint64_t *id,
                                                    CUgraph *graph, const CUgraphNode **deps, size_t *ndeps)
{
    return cuStreamGetCaptureInfo_v2(s, status, id, graph, deps, ndeps);
}

FAKE_EXPORT CUresult cuStreamGetCaptureInfo_v3(CUstream s, CUstreamCaptureStatus *status, cuuint64_t *id,
                                               CUgraph *graph, const CUgraphNode **deps, const CUgraphEdgeData **edges,
                                               size_t *ndeps)
{
    if (edges) *edges = NULL;
    return cuStreamGetCaptureInfo_v2(s, status, id, graph, deps, ndeps);
}

FAKE_EXPORT CUresult cuStreamGetCaptureInfo_v3_ptsz(CUstream s, CUstreamCaptureStatus *status, cuuint64_t *id,
                                                    CUgraph *graph, const CUgraphNode **deps,
                                                    const CUgraphEdgeData **edges, size_t *ndeps)
{
    return cuStreamGetCaptureInfo_v3(s, status, id, graph, deps, edges, ndeps);
}

/* ---------------------------------------------------------------- events */

FAKE_EXPORT CUresult cuEventRecord_ptsz(CUevent e, CUstream s)
{
    return cuEventRecord(e, s);
}

FAKE_EXPORT CUresult cuEventRecordWithFlags(CUevent e, CUstream s, unsigned int flags)
{
    (void)flags;
    return cuEventRecord(e, s);
}

FAKE_EXPORT CUresult cuEventRecordWithFlags_ptsz(CUevent e, CUstream s, unsigned int flags)
{
    return cuEventRecordWithFlags(e, s, flags);
}

FAKE_EXPORT CUresult cuEventQuery(CUevent e)
{
    CHECK_INIT();
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    return e->t_ns > fake_now_ns() ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuEventElapsedTime_v2(float *ms, CUevent start, CUevent end)
{
    return cuEventElapsedTime(ms, start, end);
}

FAKE_EXPORT CUresult cuEventDestroy(CUevent e)
{
    return cuEventDestroy_v2(e);
}

/* ---------------------------------------------------------------- copies and memsets */

static CUresult copy(void *dst, const void *src, size_t n)
{
    CHECK_INIT();
    if (n && (!dst || !src)) return CUDA_ERROR_INVALID_VALUE;
    if (n) memmove(dst, src, n);
    return CUDA_SUCCESS;
}

#define P(x) ((void *)(uintptr_t)(x))
FAKE_EXPORT CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) { return copy(P(dst), P(src), n); }
FAKE_EXPORT CUresult cuMemcpy_ptds(CUdeviceptr dst, CUdeviceptr src, size_t n) { return copy(P(dst), P(src), n); }
/* An asynchronous copy into a capturing stream becomes a node of the captured graph. */
static CUresult copy_on(CUstream s, void *dst, const void *src, size_t n)
{
    CHECK_INIT();
    if (n && (!dst || !src)) return CUDA_ERROR_INVALID_VALUE;
    if (fake_capture_op(s, CU_GRAPH_NODE_TYPE_MEMCPY, dst, src, n, 1, 0, 0, NULL, 1)) return CUDA_SUCCESS;
    return copy(dst, src, n);
}

FAKE_EXPORT CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s)
{
    return copy_on(s, P(dst), P(src), n);
}
FAKE_EXPORT CUresult cuMemcpyAsync_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s)
{
    return cuMemcpyAsync(dst, src, n, s);
}
FAKE_EXPORT CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr dst, const void *src, size_t n) { return cuMemcpyHtoD_v2(dst, src, n); }
FAKE_EXPORT CUresult cuMemcpyDtoH_v2_ptds(void *dst, CUdeviceptr src, size_t n) { return cuMemcpyDtoH_v2(dst, src, n); }
FAKE_EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) { return copy(P(dst), P(src), n); }
FAKE_EXPORT CUresult cuMemcpyDtoD_v2_ptds(CUdeviceptr dst, CUdeviceptr src, size_t n) { return copy(P(dst), P(src), n); }
FAKE_EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s)
{
    return copy_on(s, P(dst), src, n);
}
FAKE_EXPORT CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr dst, const void *src, size_t n, CUstream s)
{
    return cuMemcpyHtoDAsync_v2(dst, src, n, s);
}
FAKE_EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s)
{
    return copy_on(s, dst, P(src), n);
}
FAKE_EXPORT CUresult cuMemcpyDtoHAsync_v2_ptsz(void *dst, CUdeviceptr src, size_t n, CUstream s)
{
    return cuMemcpyDtoHAsync_v2(dst, src, n, s);
}
FAKE_EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s)
{
    return copy_on(s, P(dst), P(src), n);
}
FAKE_EXPORT CUresult cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s)
{
    return cuMemcpyDtoDAsync_v2(dst, src, n, s);
}
FAKE_EXPORT CUresult cuMemcpyPeer(CUdeviceptr dst, CUcontext dc, CUdeviceptr src, CUcontext sc, size_t n)
{
    (void)dc;
    (void)sc;
    return copy(P(dst), P(src), n);
}
FAKE_EXPORT CUresult cuMemcpyPeerAsync(CUdeviceptr dst, CUcontext dc, CUdeviceptr src, CUcontext sc, size_t n,
                                       CUstream s)
{
    (void)s;
    return cuMemcpyPeer(dst, dc, src, sc, n);
}

static const char *copy2d_ptr(CUmemorytype t, const void *host, CUdeviceptr dev)
{
    return t == CU_MEMORYTYPE_HOST ? host : (const char *)(uintptr_t)dev;
}

static CUresult copy2d(const CUDA_MEMCPY2D *c)
{
    CHECK_INIT();
    if (!c) return CUDA_ERROR_INVALID_VALUE;
    if (c->srcMemoryType == CU_MEMORYTYPE_ARRAY || c->dstMemoryType == CU_MEMORYTYPE_ARRAY) {
        CUDA_MEMCPY3D d = {
            .srcXInBytes = c->srcXInBytes, .srcY = c->srcY, .srcMemoryType = c->srcMemoryType, .srcHost = c->srcHost,
            .srcDevice = c->srcDevice, .srcArray = c->srcArray, .srcPitch = c->srcPitch, .srcHeight = c->Height,
            .dstXInBytes = c->dstXInBytes, .dstY = c->dstY, .dstMemoryType = c->dstMemoryType, .dstHost = c->dstHost,
            .dstDevice = c->dstDevice, .dstArray = c->dstArray, .dstPitch = c->dstPitch, .dstHeight = c->Height,
            .WidthInBytes = c->WidthInBytes, .Height = c->Height, .Depth = 1,
        };
        return fake_copy3d(&d);
    }
    const char *s = copy2d_ptr(c->srcMemoryType, c->srcHost, c->srcDevice);
    char *d = (char *)copy2d_ptr(c->dstMemoryType, c->dstHost, c->dstDevice);
    if (!s || !d) return CUDA_ERROR_INVALID_VALUE;
    for (size_t y = 0; y < c->Height; y++)
        memmove(d + (c->dstY + y) * c->dstPitch + c->dstXInBytes, s + (c->srcY + y) * c->srcPitch + c->srcXInBytes,
                c->WidthInBytes);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemcpy2D_v2(const CUDA_MEMCPY2D *c) { return copy2d(c); }
FAKE_EXPORT CUresult cuMemcpy2D_v2_ptds(const CUDA_MEMCPY2D *c) { return copy2d(c); }
FAKE_EXPORT CUresult cuMemcpy2DUnaligned_v2(const CUDA_MEMCPY2D *c) { return copy2d(c); }
FAKE_EXPORT CUresult cuMemcpy2DUnaligned_v2_ptds(const CUDA_MEMCPY2D *c) { return copy2d(c); }
FAKE_EXPORT CUresult cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D *c, CUstream s)
{
    (void)s;
    return copy2d(c);
}
FAKE_EXPORT CUresult cuMemcpy2DAsync_v2_ptsz(const CUDA_MEMCPY2D *c, CUstream s)
{
    (void)s;
    return copy2d(c);
}

/* A zero fill of whole pages of the double's own cuMemAlloc memory (private anonymous pages) gives
 * the pages back to the kernel instead of writing them: they read as zeros again, exactly as after
 * the memset, and the host does not hold the bytes of a buffer a framework only clears (llama.cpp
 * clears its whole KV cache at start), as a card's memset costs the host nothing. Memory shared with
 * another process (IPC), VMM mappings and host memory are written as before. */
int discard_zero_fill(CUdeviceptr dst, const void *value, size_t elem, size_t n)
{
    static const unsigned char zero[8];
    if (n * elem < (1u << 20) || elem > sizeof(zero) || memcmp(value, zero, elem) != 0) return 0;
    alloc a;
    if (!find_alloc(dst, &a) || a.kind != K_LINEAR || a.shared_fd >= 0 || dst + n * elem > a.ptr + a.size) return 0;
    uint64_t lo = (dst + PAGE_ALIGN - 1) & ~(PAGE_ALIGN - 1), hi = (dst + n * elem) & ~(PAGE_ALIGN - 1);
    if (hi <= lo) return 0;
    if (madvise((void *)(uintptr_t)lo, hi - lo, MADV_DONTNEED) != 0) return 0;
    memset((void *)(uintptr_t)dst, 0, lo - dst);
    memset((void *)(uintptr_t)hi, 0, dst + n * elem - hi);
    return 1;
}

static CUresult fill(CUdeviceptr dst, const void *value, size_t elem, size_t n, size_t pitch, size_t height)
{
    CHECK_INIT();
    if (!dst && n) return CUDA_ERROR_INVALID_VALUE;
    if (height == 1 && discard_zero_fill(dst, value, elem, n)) return CUDA_SUCCESS;
    for (size_t y = 0; y < height; y++) {
        char *row = (char *)(uintptr_t)dst + y * pitch;
        if (elem == 1) memset(row, *(const unsigned char *)value, n);
        else
            for (size_t i = 0; i < n; i++) memcpy(row + i * elem, value, elem);
    }
    return CUDA_SUCCESS;
}

#define MEMSET(name, T, elem)                                                                                          \
    FAKE_EXPORT CUresult name(CUdeviceptr dst, T v, size_t n) { return fill(dst, &v, elem, n, 0, 1); }
#define MEMSET_ASYNC(name, T, elem)                                                                                    \
    FAKE_EXPORT CUresult name(CUdeviceptr dst, T v, size_t n, CUstream s)                                              \
    {                                                                                                                  \
        if (dst && fake_capture_op(s, CU_GRAPH_NODE_TYPE_MEMSET, P(dst), NULL, n, 1, 0, 0, &v, elem))                   \
            return CUDA_SUCCESS;                                                                                       \
        return fill(dst, &v, elem, n, 0, 1);                                                                           \
    }
#define MEMSET2D(name, T, elem)                                                                                        \
    FAKE_EXPORT CUresult name(CUdeviceptr dst, size_t pitch, T v, size_t w, size_t h)                                  \
    {                                                                                                                  \
        return fill(dst, &v, elem, w, pitch, h);                                                                       \
    }
#define MEMSET2D_ASYNC(name, T, elem)                                                                                  \
    FAKE_EXPORT CUresult name(CUdeviceptr dst, size_t pitch, T v, size_t w, size_t h, CUstream s)                      \
    {                                                                                                                  \
        if (dst && fake_capture_op(s, CU_GRAPH_NODE_TYPE_MEMSET, P(dst), NULL, w, h, pitch, 0, &v, elem))               \
            return CUDA_SUCCESS;                                                                                       \
        return fill(dst, &v, elem, w, pitch, h);                                                                       \
    }
MEMSET(cuMemsetD8_v2_ptds, unsigned char, 1)
MEMSET(cuMemsetD16_v2, unsigned short, 2)
MEMSET(cuMemsetD16_v2_ptds, unsigned short, 2)
MEMSET(cuMemsetD32_v2, unsigned int, 4)
MEMSET(cuMemsetD32_v2_ptds, unsigned int, 4)
MEMSET_ASYNC(cuMemsetD8Async, unsigned char, 1)
MEMSET_ASYNC(cuMemsetD8Async_ptsz, unsigned char, 1)
MEMSET_ASYNC(cuMemsetD16Async, unsigned short, 2)
MEMSET_ASYNC(cuMemsetD16Async_ptsz, unsigned short, 2)
MEMSET_ASYNC(cuMemsetD32Async, unsigned int, 4)
MEMSET_ASYNC(cuMemsetD32Async_ptsz, unsigned int, 4)
MEMSET2D(cuMemsetD2D8_v2, unsigned char, 1)
MEMSET2D(cuMemsetD2D8_v2_ptds, unsigned char, 1)
MEMSET2D(cuMemsetD2D16_v2, unsigned short, 2)
MEMSET2D(cuMemsetD2D16_v2_ptds, unsigned short, 2)
MEMSET2D(cuMemsetD2D32_v2, unsigned int, 4)
MEMSET2D(cuMemsetD2D32_v2_ptds, unsigned int, 4)
MEMSET2D_ASYNC(cuMemsetD2D8Async, unsigned char, 1)
MEMSET2D_ASYNC(cuMemsetD2D8Async_ptsz, unsigned char, 1)
MEMSET2D_ASYNC(cuMemsetD2D16Async, unsigned short, 2)
MEMSET2D_ASYNC(cuMemsetD2D16Async_ptsz, unsigned short, 2)
MEMSET2D_ASYNC(cuMemsetD2D32Async, unsigned int, 4)
MEMSET2D_ASYNC(cuMemsetD2D32Async_ptsz, unsigned int, 4)

FAKE_EXPORT CUresult cuMemPrefetchAsync(CUdeviceptr p, size_t n, CUdevice dev, CUstream s)
{
    (void)p;
    (void)n;
    (void)dev;
    (void)s;
    CHECK_INIT();
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemPrefetchAsync_ptsz(CUdeviceptr p, size_t n, CUdevice dev, CUstream s)
{
    return cuMemPrefetchAsync(p, n, dev, s);
}

FAKE_EXPORT CUresult cuMemPrefetchAsync_v2(CUdeviceptr p, size_t n, CUmemLocation loc, unsigned int flags, CUstream s)
{
    (void)loc;
    (void)flags;
    return cuMemPrefetchAsync(p, n, 0, s);
}

FAKE_EXPORT CUresult cuMemPrefetchAsync_v2_ptsz(CUdeviceptr p, size_t n, CUmemLocation loc, unsigned int flags,
                                                CUstream s)
{
    return cuMemPrefetchAsync_v2(p, n, loc, flags, s);
}

FAKE_EXPORT CUresult cuMemAdvise(CUdeviceptr p, size_t n, CUmem_advise advice, CUdevice dev)
{
    (void)p;
    (void)n;
    (void)advice;
    (void)dev;
    CHECK_INIT();
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemAdvise_v2(CUdeviceptr p, size_t n, CUmem_advise advice, CUmemLocation loc)
{
    (void)loc;
    return cuMemAdvise(p, n, advice, 0);
}

/* ---------------------------------------------------------------- host memory */

typedef struct host_alloc {
    void *ptr;
    size_t size;
    unsigned flags;
    int registered; /* cuMemHostRegister: the application's memory, not ours to free */
    struct host_alloc *next;
} host_alloc;

static host_alloc *hosts;
static pthread_mutex_t host_lock = PTHREAD_MUTEX_INITIALIZER;

static int host_find(const void *p, host_alloc *out)
{
    int found = 0;
    pthread_mutex_lock(&host_lock);
    for (host_alloc *h = hosts; h; h = h->next)
        if ((const char *)p >= (char *)h->ptr && (const char *)p < (char *)h->ptr + h->size) {
            if (out) *out = *h;
            found = 1;
            break;
        }
    pthread_mutex_unlock(&host_lock);
    return found;
}

static CUresult host_add(void *p, size_t size, unsigned flags, int registered)
{
    host_alloc *h = malloc(sizeof(*h));
    if (!h) return CUDA_ERROR_OUT_OF_MEMORY;
    *h = (host_alloc){p, size, flags, registered, NULL};
    pthread_mutex_lock(&host_lock);
    h->next = hosts;
    hosts = h;
    pthread_mutex_unlock(&host_lock);
    return CUDA_SUCCESS;
}

static int host_remove(void *p, int registered, host_alloc *out)
{
    int found = 0;
    pthread_mutex_lock(&host_lock);
    for (host_alloc **pp = &hosts; *pp; pp = &(*pp)->next)
        if ((*pp)->ptr == p && (*pp)->registered == registered) {
            host_alloc *h = *pp;
            *pp = h->next;
            *out = *h;
            free(h);
            found = 1;
            break;
        }
    pthread_mutex_unlock(&host_lock);
    return found;
}

FAKE_EXPORT CUresult cuMemHostAlloc(void **pp, size_t size, unsigned int flags)
{
    CHECK_INIT();
    if (!pp || size == 0) return CUDA_ERROR_INVALID_VALUE;
    if (!current_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    void *p = mmap(NULL, rounded(size), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    if (host_add(p, size, flags, 0) != CUDA_SUCCESS) {
        munmap(p, rounded(size));
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *pp = p;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemAllocHost_v2(void **pp, size_t size)
{
    return cuMemHostAlloc(pp, size, 0);
}

FAKE_EXPORT CUresult cuMemFreeHost(void *p)
{
    CHECK_INIT();
    host_alloc h;
    if (!host_remove(p, 0, &h)) return CUDA_ERROR_INVALID_VALUE;
    munmap(h.ptr, rounded(h.size));
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemHostRegister_v2(void *p, size_t size, unsigned int flags)
{
    CHECK_INIT();
    if (!p || size == 0) return CUDA_ERROR_INVALID_VALUE;
    if (host_find(p, NULL)) return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
    return host_add(p, size, flags, 1);
}

FAKE_EXPORT CUresult cuMemHostRegister(void *p, size_t size, unsigned int flags)
{
    return cuMemHostRegister_v2(p, size, flags);
}

FAKE_EXPORT CUresult cuMemHostUnregister(void *p)
{
    CHECK_INIT();
    host_alloc h;
    return host_remove(p, 1, &h) ? CUDA_SUCCESS : CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
}

FAKE_EXPORT CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *d, void *p, unsigned int flags)
{
    CHECK_INIT();
    if (!d || flags) return CUDA_ERROR_INVALID_VALUE;
    if (!host_find(p, NULL)) return CUDA_ERROR_INVALID_VALUE;
    *d = (CUdeviceptr)(uintptr_t)p; /* unified addressing: the same address */
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemHostGetFlags(unsigned int *flags, void *p)
{
    CHECK_INIT();
    host_alloc h;
    if (!flags || !host_find(p, &h)) return CUDA_ERROR_INVALID_VALUE;
    *flags = h.flags;
    return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------- pointer attributes */

static CUresult pointer_attribute(void *data, CUpointer_attribute a, CUdeviceptr p)
{
    alloc al;
    host_alloc h;
    int is_dev = find_alloc(p, &al), is_host = !is_dev && host_find((void *)(uintptr_t)p, &h);
    if (!is_dev && !is_host) return CUDA_ERROR_INVALID_VALUE;
    uint64_t base = is_dev ? al.ptr : (uint64_t)(uintptr_t)h.ptr, size = is_dev ? al.size : h.size;
    int dev = is_dev ? al.dev : current_ctx ? current_ctx->dev : 0;
    switch (a) {
    case CU_POINTER_ATTRIBUTE_CONTEXT:
        *(CUcontext *)data = is_dev && al.ctx ? al.ctx : (CUcontext)&primary_ctx[dev];
        break;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
        *(unsigned *)data = is_dev ? CU_MEMORYTYPE_DEVICE : CU_MEMORYTYPE_HOST;
        break;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
    case CU_POINTER_ATTRIBUTE_HOST_POINTER: *(void **)data = (void *)(uintptr_t)p; break;
    case CU_POINTER_ATTRIBUTE_SYNC_MEMOPS: *(int *)data = 1; break;
    case CU_POINTER_ATTRIBUTE_BUFFER_ID: *(unsigned long long *)data = base; break;
    case CU_POINTER_ATTRIBUTE_IS_MANAGED: *(int *)data = is_dev && al.managed; break;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *(int *)data = dev; break;
    case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE: *(int *)data = is_dev && al.kind == K_LINEAR; break;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: *(void **)data = (void *)(uintptr_t)base; break;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE: *(size_t *)data = size; break;
    case CU_POINTER_ATTRIBUTE_MAPPED: *(int *)data = 1; break;
    case CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES: *(unsigned long long *)data = 0; break;
    case CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE: *(int *)data = 0; break;
    case CU_POINTER_ATTRIBUTE_ACCESS_FLAGS: *(int *)data = CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READWRITE; break;
    case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE: *(void **)data = NULL; break;
    case CU_POINTER_ATTRIBUTE_MAPPING_SIZE: *(size_t *)data = size; break;
    case CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR: *(void **)data = (void *)(uintptr_t)base; break;
    case CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID: *(unsigned long long *)data = base; break;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuPointerGetAttribute(void *data, CUpointer_attribute a, CUdeviceptr p)
{
    CHECK_INIT();
    if (!data) return CUDA_ERROR_INVALID_VALUE;
    return pointer_attribute(data, a, p);
}

/* Several at once: memory the driver does not know reads as unregistered host memory (type 0). */
FAKE_EXPORT CUresult cuPointerGetAttributes(unsigned int n, CUpointer_attribute *attrs, void **data, CUdeviceptr p)
{
    CHECK_INIT();
    if (!attrs || !data) return CUDA_ERROR_INVALID_VALUE;
    alloc al;
    int known = find_alloc(p, &al) || host_find((void *)(uintptr_t)p, NULL);
    for (unsigned i = 0; i < n; i++) {
        if (!data[i]) continue;
        if (known && pointer_attribute(data[i], attrs[i], p) == CUDA_SUCCESS) continue;
        switch (attrs[i]) { /* what the driver reports for memory it does not know */
        case CU_POINTER_ATTRIBUTE_CONTEXT:
        case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
        case CU_POINTER_ATTRIBUTE_HOST_POINTER:
        case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
        case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE:
        case CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR: *(void **)data[i] = NULL; break;
        case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *(int *)data[i] = -2; break;
        case CU_POINTER_ATTRIBUTE_BUFFER_ID:
        case CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES:
        case CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID: *(unsigned long long *)data[i] = 0; break;
        case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
        case CU_POINTER_ATTRIBUTE_MAPPING_SIZE: *(size_t *)data[i] = 0; break;
        default: *(unsigned *)data[i] = 0; break;
        }
    }
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuPointerSetAttribute(const void *value, CUpointer_attribute a, CUdeviceptr p)
{
    (void)value;
    CHECK_INIT();
    if (a != CU_POINTER_ATTRIBUTE_SYNC_MEMOPS) return CUDA_ERROR_INVALID_VALUE;
    alloc al;
    return find_alloc(p, &al) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FAKE_EXPORT CUresult cuMemRangeGetAttribute(void *data, size_t size, CUmem_range_attribute a, CUdeviceptr p, size_t n)
{
    (void)a;
    (void)p;
    (void)n;
    CHECK_INIT();
    if (!data) return CUDA_ERROR_INVALID_VALUE;
    memset(data, 0, size);
    return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------- pools and graphs */

FAKE_EXPORT CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool)
{
    CHECK_INIT();
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    return pool ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FAKE_EXPORT CUresult cuGraphInstantiateWithParams(CUgraphExec *e, CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS *p)
{
    CUresult rc = cuGraphInstantiateWithFlags(e, g, p ? p->flags : 0);
    if (p) {
        p->result_out = rc == CUDA_SUCCESS ? CUDA_GRAPH_INSTANTIATE_SUCCESS : CUDA_GRAPH_INSTANTIATE_ERROR;
        p->hErrNode_out = NULL;
    }
    return rc;
}

FAKE_EXPORT CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *e, CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS *p)
{
    return cuGraphInstantiateWithParams(e, g, p);
}

FAKE_EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec *e, CUgraph g, CUgraphNode *err, char *log, size_t logsize)
{
    if (err) *err = NULL;
    if (log && logsize) log[0] = '\0';
    return cuGraphInstantiateWithFlags(e, g, 0);
}

FAKE_EXPORT CUresult cuGraphUpload(CUgraphExec e, CUstream s)
{
    (void)s;
    CHECK_INIT();
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FAKE_EXPORT CUresult cuGraphUpload_ptsz(CUgraphExec e, CUstream s)
{
    return cuGraphUpload(e, s);
}

/* ---------------------------------------------------------------- CUDA 13 variants */

FAKE_EXPORT CUresult cuCtxGetDevice_v2(CUdevice *dev, CUcontext ctx)
{
    CHECK_INIT();
    if (!dev) return CUDA_ERROR_INVALID_VALUE;
    if (!ctx) ctx = current_ctx;
    if (!ctx || ctx->magic != CTX_MAGIC) return CUDA_ERROR_INVALID_CONTEXT;
    *dev = ctx->dev;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuCtxSynchronize_v2(CUcontext ctx)
{
    CHECK_INIT();
    if (!ctx) ctx = current_ctx;
    if (!ctx || ctx->magic != CTX_MAGIC) return CUDA_ERROR_INVALID_CONTEXT;
    wait_device_idle(ctx->dev);
    pools_release(ctx->dev);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemGetDefaultMemPool(CUmemoryPool *pool, CUmemLocation *loc, CUmemAllocationType type)
{
    CHECK_INIT();
    if (!pool || !loc || type != CU_MEM_ALLOCATION_TYPE_PINNED) return CUDA_ERROR_INVALID_VALUE;
    if (loc->type != CU_MEM_LOCATION_TYPE_DEVICE) return CUDA_ERROR_NOT_SUPPORTED; /* host pools: not modeled */
    return cuDeviceGetDefaultMemPool(pool, loc->id);
}

FAKE_EXPORT CUresult cuMemGetMemPool(CUmemoryPool *pool, CUmemLocation *loc, CUmemAllocationType type)
{
    CHECK_INIT();
    if (!pool || !loc || type != CU_MEM_ALLOCATION_TYPE_PINNED) return CUDA_ERROR_INVALID_VALUE;
    if (loc->type != CU_MEM_LOCATION_TYPE_DEVICE) return CUDA_ERROR_NOT_SUPPORTED;
    return cuDeviceGetMemPool(pool, loc->id);
}

FAKE_EXPORT CUresult cuMemSetMemPool(CUmemLocation *loc, CUmemAllocationType type, CUmemoryPool pool)
{
    CHECK_INIT();
    if (!loc || type != CU_MEM_ALLOCATION_TYPE_PINNED) return CUDA_ERROR_INVALID_VALUE;
    if (loc->type != CU_MEM_LOCATION_TYPE_DEVICE) return CUDA_ERROR_NOT_SUPPORTED;
    return cuDeviceSetMemPool(loc->id, pool);
}

/* ---------------------------------------------------------------- stream memory operations (the _v2 API) */

/* The stream's earlier work is done at once on the double (kernels are not executed), so a write
 * happens at the call and a wait holds the calling thread until another thread or process makes
 * the condition true (a wait never satisfied hangs the caller, where a GPU's stream would hang and
 * the host with it at the next synchronize). CAN_USE_64_BIT_STREAM_MEM_OPS and
 * CAN_USE_STREAM_WAIT_VALUE_NOR say 1 (cuda_device.c); the v1 entry points stay stubs, as
 * CAN_USE_STREAM_MEM_OPS_V1 says 0. */
static int wait_holds(uint64_t now, uint64_t value, unsigned flags, int wide)
{
    switch (flags & ~(unsigned)CU_STREAM_WAIT_VALUE_FLUSH) {
    case CU_STREAM_WAIT_VALUE_GEQ: return wide ? (int64_t)(now - value) >= 0 : (int32_t)(uint32_t)(now - value) >= 0;
    case CU_STREAM_WAIT_VALUE_EQ: return now == value;
    case CU_STREAM_WAIT_VALUE_AND: return (now & value) != 0;
    case CU_STREAM_WAIT_VALUE_NOR: return (wide ? ~(now | value) : (uint32_t) ~(now | value)) != 0;
    default: return -1;
    }
}

static CUresult mem_op_wait(CUstream s, CUdeviceptr addr, uint64_t value, unsigned flags, int wide)
{
    CHECK_INIT();
    CUdevice dev;
    CUresult rc = stream_dev(s, &dev);
    if (rc != CUDA_SUCCESS) return rc;
    if (!addr || addr % (wide ? 8 : 4)) return CUDA_ERROR_INVALID_VALUE;
    if (wait_holds(0, value, flags, wide) < 0) return CUDA_ERROR_INVALID_VALUE;
    for (;;) {
        uint64_t now = wide ? __atomic_load_n((uint64_t *)(uintptr_t)addr, __ATOMIC_ACQUIRE)
                            : __atomic_load_n((uint32_t *)(uintptr_t)addr, __ATOMIC_ACQUIRE);
        if (wait_holds(now, wide ? value : (uint32_t)value, flags, wide)) return CUDA_SUCCESS;
        struct timespec ts = {0, 20000};
        nanosleep(&ts, NULL);
    }
}

static CUresult mem_op_write(CUstream s, CUdeviceptr addr, uint64_t value, int wide)
{
    CHECK_INIT();
    CUdevice dev;
    CUresult rc = stream_dev(s, &dev);
    if (rc != CUDA_SUCCESS) return rc;
    if (!addr || addr % (wide ? 8 : 4)) return CUDA_ERROR_INVALID_VALUE;
    if (wide) __atomic_store_n((uint64_t *)(uintptr_t)addr, value, __ATOMIC_RELEASE);
    else __atomic_store_n((uint32_t *)(uintptr_t)addr, (uint32_t)value, __ATOMIC_RELEASE);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuStreamWaitValue32_v2(CUstream s, CUdeviceptr a, cuuint32_t v, unsigned int f)
{
    return mem_op_wait(s, a, v, f, 0);
}
FAKE_EXPORT CUresult cuStreamWaitValue64_v2(CUstream s, CUdeviceptr a, cuuint64_t v, unsigned int f)
{
    return mem_op_wait(s, a, v, f, 1);
}
FAKE_EXPORT CUresult cuStreamWriteValue32_v2(CUstream s, CUdeviceptr a, cuuint32_t v, unsigned int f)
{
    (void)f;
    return mem_op_write(s, a, v, 0);
}
FAKE_EXPORT CUresult cuStreamWriteValue64_v2(CUstream s, CUdeviceptr a, cuuint64_t v, unsigned int f)
{
    (void)f;
    return mem_op_write(s, a, v, 1);
}
FAKE_EXPORT CUresult cuStreamWaitValue32_v2_ptsz(CUstream s, CUdeviceptr a, cuuint32_t v, unsigned int f)
{
    return cuStreamWaitValue32_v2(s, a, v, f);
}
FAKE_EXPORT CUresult cuStreamWaitValue64_v2_ptsz(CUstream s, CUdeviceptr a, cuuint64_t v, unsigned int f)
{
    return cuStreamWaitValue64_v2(s, a, v, f);
}
FAKE_EXPORT CUresult cuStreamWriteValue32_v2_ptsz(CUstream s, CUdeviceptr a, cuuint32_t v, unsigned int f)
{
    return cuStreamWriteValue32_v2(s, a, v, f);
}
FAKE_EXPORT CUresult cuStreamWriteValue64_v2_ptsz(CUstream s, CUdeviceptr a, cuuint64_t v, unsigned int f)
{
    return cuStreamWriteValue64_v2(s, a, v, f);
}

/* CU_STREAM_MEM_OP_BARRIER and flush: a full barrier. A read-modify-write of a shared word rather than
 * a bare fence, which ThreadSanitizer cannot model (the tsan build refuses atomic_thread_fence). */
static void mem_op_barrier(void)
{
    static int word;
    __atomic_fetch_add(&word, 0, __ATOMIC_SEQ_CST);
}

FAKE_EXPORT CUresult cuStreamBatchMemOp_v2(CUstream s, unsigned int count, CUstreamBatchMemOpParams *ops,
                                           unsigned int flags)
{
    CHECK_INIT();
    if (flags || (count && !ops) || count > 256) return CUDA_ERROR_INVALID_VALUE;
    for (unsigned i = 0; i < count; i++) { /* every operation is checked before any runs */
        switch (ops[i].operation) {
        case CU_STREAM_MEM_OP_WAIT_VALUE_32:
        case CU_STREAM_MEM_OP_WAIT_VALUE_64:
            if (wait_holds(0, 0, ops[i].waitValue.flags, 0) < 0) return CUDA_ERROR_INVALID_VALUE;
            break;
        case CU_STREAM_MEM_OP_WRITE_VALUE_32:
        case CU_STREAM_MEM_OP_WRITE_VALUE_64:
        case CU_STREAM_MEM_OP_BARRIER:
        case CU_STREAM_MEM_OP_FLUSH_REMOTE_WRITES: break;
        default: return CUDA_ERROR_INVALID_VALUE;
        }
    }
    CUresult rc = CUDA_SUCCESS;
    for (unsigned i = 0; i < count && rc == CUDA_SUCCESS; i++) {
        const CUstreamBatchMemOpParams *p = &ops[i];
        switch (p->operation) {
        case CU_STREAM_MEM_OP_WAIT_VALUE_32:
            rc = mem_op_wait(s, p->waitValue.address, p->waitValue.value, p->waitValue.flags, 0);
            break;
        case CU_STREAM_MEM_OP_WAIT_VALUE_64:
            rc = mem_op_wait(s, p->waitValue.address, p->waitValue.value64, p->waitValue.flags, 1);
            break;
        case CU_STREAM_MEM_OP_WRITE_VALUE_32: rc = mem_op_write(s, p->writeValue.address, p->writeValue.value, 0); break;
        case CU_STREAM_MEM_OP_WRITE_VALUE_64:
            rc = mem_op_write(s, p->writeValue.address, p->writeValue.value64, 1);
            break;
        default: mem_op_barrier(); break;
        }
    }
    return rc;
}

FAKE_EXPORT CUresult cuStreamBatchMemOp_v2_ptsz(CUstream s, unsigned int count, CUstreamBatchMemOpParams *ops,
                                                unsigned int flags)
{
    return cuStreamBatchMemOp_v2(s, count, ops, flags);
}

FAKE_EXPORT CUresult cuMemcpyPeer_ptds(CUdeviceptr dst, CUcontext dc, CUdeviceptr src, CUcontext sc, size_t n)
{
    return cuMemcpyPeer(dst, dc, src, sc, n);
}
FAKE_EXPORT CUresult cuMemcpyPeerAsync_ptsz(CUdeviceptr dst, CUcontext dc, CUdeviceptr src, CUcontext sc, size_t n,
                                            CUstream s)
{
    return cuMemcpyPeerAsync(dst, dc, src, sc, n, s);
}
