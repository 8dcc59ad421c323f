/*
 * Driver-API test program, linked against libcuda.so.1 and compiled like an application (cuMemAlloc
 * means cuMemAlloc_v2). Each scenario checks what a user of a slice would observe and exits non-zero
 * naming the failed check.
 *
 *   cuda_probe info                          print what the driver reports (key=value lines)
 *   cuda_probe limit LIMIT                   OOM exactly at the limit; frees are credited
 *   cuda_probe paths LIMIT                   every allocation path is counted and credited
 *   cuda_probe alloc BYTES                   one cuMemAlloc; prints rc=
 *   cuda_probe hold BYTES                    allocate, print "held rc=N", wait for stdin EOF, free
 *   cuda_probe stress LIMIT THREADS ITERS COUNTER_FILE
 *                                            threads (and processes sharing COUNTER_FILE) race for
 *                                            the last bytes; their sum never exceeds LIMIT
 *   cuda_probe ipc-export BYTES              allocate, print the IPC handle in hex, wait for stdin EOF
 *   cuda_probe ipc-open HEX                  open an exported handle; prints rc=
 *   cuda_probe launch SECONDS KERNEL_US KIND launch (kernel|ex|coop|graph), synchronizing after each;
 *                                            prints the busy fraction of the second half
 *   cuda_probe boundary HI                   largest single cuMemAlloc that succeeds (bisection)
 *   cuda_probe vmm LIMIT                     VMM: physical memory stays charged while mapped,
 *                                            also after cuMemRelease, and after a retained handle;
 *                                            freeing a mapping as a cuMemAlloc pointer is refused
 *   cuda_probe ctx-teardown LIMIT            destroying a context (cuCtxDestroy, primary reset, last
 *                                            primary release) credits every allocation made in it
 *   cuda_probe fork-query BYTES              allocate, fork a child that asks NVML for memory info,
 *                                            then try to allocate BYTES again; prints rc=
 *   cuda_probe fork-hold BYTES               allocate, fork a child that never touches CUDA and
 *                                            waits for stdin EOF; prints "held rc=N child=PID"
 *   cuda_probe hidden LIMIT CTX_BYTES        memory the slice uses besides allocations is charged: each
 *                                            context's own cost (the double: CTX_BYTES), cuCtxSetLimit,
 *                                            pool memory kept after free, graph memory nodes, external
 *                                            memory imports; and credited when the driver frees it
 *   cuda_probe tamper USAGE_DIR BYTES HOW    allocate BYTES, rewrite the slice's usage region as a
 *                                            tenant can (HOW: zero = every grant and use word 0,
 *                                            inflate = its own grant huge), allocate BYTES again;
 *                                            prints "first rc=N" and "second rc=N"
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <dlfcn.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../probe/probe_ptx.h"
#include "probe_common.h"

/* The legacy 32-bit entry points, reachable by name like any other export. */
extern CUresult legacy_cuMemGetInfo(unsigned int *free, unsigned int *total) __asm__("cuMemGetInfo");
extern CUresult legacy_cuDeviceTotalMem(unsigned int *bytes, CUdevice dev) __asm__("cuDeviceTotalMem");
typedef struct {
    unsigned int Width, Height;
    CUarray_format Format;
    unsigned int NumChannels;
} legacy_array_desc;
extern CUresult legacy_cuArrayCreate(CUarray *h, const legacy_array_desc *d) __asm__("cuArrayCreate");

static CUdevice dev;

static void setup(void)
{
    CUcontext ctx;
    if (cuInit(0) != CUDA_SUCCESS || cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
        cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS || cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
        fprintf(stderr, "FAIL: cannot initialize the driver and a context\n");
        exit(1);
    }
}

static size_t mem_free(void)
{
    size_t f = 0, t = 0;
    cuMemGetInfo(&f, &t);
    return f;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void wait_stdin_eof(void)
{
    char buf[64];
    while (read(0, buf, sizeof(buf)) > 0) {
    }
}

static int info(void)
{
    size_t f = 0, t = 0, total = 0;
    unsigned int f1 = 0, t1 = 0, total1 = 0;
    char name[128] = {0};
    EXPECT_RC(cuMemGetInfo(&f, &t), CUDA_SUCCESS);
    EXPECT_RC(cuDeviceTotalMem(&total, dev), CUDA_SUCCESS);
    EXPECT_RC(cuDeviceGetName(name, sizeof(name), dev), CUDA_SUCCESS);
    EXPECT_RC(legacy_cuMemGetInfo(&f1, &t1), CUDA_SUCCESS);
    EXPECT_RC(legacy_cuDeviceTotalMem(&total1, dev), CUDA_SUCCESS);
    CUuuid u;
    EXPECT_RC(cuDeviceGetUuid(&u, dev), CUDA_SUCCESS);
    const unsigned char *b = (const unsigned char *)u.bytes;
    printf("uuid=GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x\n", b[0], b[1], b[2], b[3],
           b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
    printf("name=%s\nmeminfo_free=%zu\nmeminfo_total=%zu\ntotal_mem=%zu\nmeminfo_v1_total=%u\ntotal_mem_v1=%u\n", name,
           f, t, total, t1, total1);
    return probe_failures ? 1 : 0;
}

static int limit_scenario(size_t limit)
{
    CUdeviceptr a = 0, b = 0, c = 0;
    size_t f = 0, t = 0;
    EXPECT_RC(cuMemGetInfo(&f, &t), CUDA_SUCCESS);
    CHECK(t == limit && f == limit, "meminfo %zu/%zu, expected %zu/%zu", f, t, limit, limit);
    EXPECT_RC(cuMemAlloc(&a, limit + 1), CUDA_ERROR_OUT_OF_MEMORY);
    EXPECT_RC(cuMemAlloc(&a, limit), CUDA_SUCCESS);
    CHECK(mem_free() == 0, "free %zu after allocating the whole slice", mem_free());
    EXPECT_RC(cuMemAlloc(&b, 1), CUDA_ERROR_OUT_OF_MEMORY);
    EXPECT_RC(cuMemFree(a), CUDA_SUCCESS);
    CHECK(mem_free() == limit, "free %zu after freeing, expected %zu", mem_free(), limit);
    /* Pieces add up to exactly the limit as well. */
    EXPECT_RC(cuMemAlloc(&a, limit / 2), CUDA_SUCCESS);
    EXPECT_RC(cuMemAlloc(&b, limit - limit / 2 - 1), CUDA_SUCCESS);
    EXPECT_RC(cuMemAlloc(&c, 2), CUDA_ERROR_OUT_OF_MEMORY);
    EXPECT_RC(cuMemAlloc(&c, 1), CUDA_SUCCESS);
    EXPECT_RC(cuMemAlloc(&c, 1), CUDA_ERROR_OUT_OF_MEMORY);
    EXPECT_RC(cuMemFree(a), CUDA_SUCCESS);
    EXPECT_RC(cuMemFree(b), CUDA_SUCCESS);
    EXPECT_RC(cuMemFree(c), CUDA_SUCCESS);
    EXPECT_RC(cuMemFree(c), CUDA_ERROR_INVALID_VALUE); /* a double free is the driver's error, not a credit */
    CHECK(mem_free() == limit, "free %zu at the end, expected %zu", mem_free(), limit);
    PROBE_DONE("limit");
}

/* Allocates `bytes` through one path, checks the slice's free memory dropped by `charged`, that the
 * same path cannot take more than what is left, and that freeing restores it. */
#define PATH_CHECK(label, charged, alloc_expr, free_expr)                                                \
    do {                                                                                                 \
        size_t before_ = mem_free();                                                                     \
        EXPECT_RC(alloc_expr, CUDA_SUCCESS);                                                             \
        size_t during_ = mem_free();                                                                     \
        CHECK(before_ - during_ == (size_t)(charged), "%s: charged %zu, expected %zu", label,            \
              before_ - during_, (size_t)(charged));                                                     \
        EXPECT_RC(free_expr, CUDA_SUCCESS);                                                              \
        CHECK(mem_free() == before_, "%s: free %zu after release, expected %zu", label, mem_free(),      \
              before_);                                                                                  \
        printf("path %s charged=%zu\n", label, before_ - during_);                                       \
    } while (0)

static int paths_scenario(size_t limit)
{
    size_t chunk = 64u << 20;
    CUdeviceptr p = 0;
    size_t pitch = 0;
    CUstream s;
    EXPECT_RC(cuStreamCreate(&s, 0), CUDA_SUCCESS);

    PATH_CHECK("cuMemAlloc_v2", chunk, cuMemAlloc(&p, chunk), cuMemFree(p));
    PATH_CHECK("cuMemAllocManaged", chunk, cuMemAllocManaged(&p, chunk, CU_MEM_ATTACH_GLOBAL), cuMemFree(p));
    PATH_CHECK("cuMemAllocPitch_v2", 1024 * 1000, cuMemAllocPitch(&p, &pitch, 1000, 1000, 4), cuMemFree(p));
    /* A pool gives freed memory back at the next synchronization (release threshold 0). */
    PATH_CHECK("cuMemAllocAsync", chunk, cuMemAllocAsync(&p, chunk, s), (cuMemFreeAsync(p, s), cuStreamSynchronize(s)));

    CUmemPoolProps props = {0};
    props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = dev;
    CUmemoryPool pool, host_pool;
    EXPECT_RC(cuMemPoolCreate(&pool, &props), CUDA_SUCCESS);
    PATH_CHECK("cuMemAllocFromPoolAsync(device)", chunk, cuMemAllocFromPoolAsync(&p, chunk, pool, s),
               (cuMemFreeAsync(p, s), cuStreamSynchronize(s)));
    props.location.type = CU_MEM_LOCATION_TYPE_HOST;
    props.location.id = 0;
    EXPECT_RC(cuMemPoolCreate(&host_pool, &props), CUDA_SUCCESS);
    PATH_CHECK("cuMemAllocFromPoolAsync(host)", 0, cuMemAllocFromPoolAsync(&p, limit + chunk, host_pool, s),
               cuMemFreeAsync(p, s));

    CUmemAllocationProp vp = {0};
    vp.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    vp.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    vp.location.id = dev;
    CUmemGenericAllocationHandle h;
    PATH_CHECK("cuMemCreate(device)", chunk, cuMemCreate(&h, chunk, &vp, 0), cuMemRelease(h));
    vp.location.type = CU_MEM_LOCATION_TYPE_HOST;
    vp.location.id = 0;
    PATH_CHECK("cuMemCreate(host)", 0, cuMemCreate(&h, limit + chunk, &vp, 0), cuMemRelease(h));

    CUarray arr;
    CUDA_ARRAY_DESCRIPTOR ad = {.Width = 1024, .Height = 1024, .Format = CU_AD_FORMAT_FLOAT, .NumChannels = 4};
    PATH_CHECK("cuArrayCreate_v2", 1024 * 1024 * 16, cuArrayCreate(&arr, &ad), cuArrayDestroy(arr));
    legacy_array_desc lad = {.Width = 512, .Height = 512, .Format = CU_AD_FORMAT_FLOAT, .NumChannels = 2};
    PATH_CHECK("cuArrayCreate(v1)", 512 * 512 * 8, legacy_cuArrayCreate(&arr, &lad), cuArrayDestroy(arr));
    CUDA_ARRAY3D_DESCRIPTOR d3 = {
        .Width = 256, .Height = 256, .Depth = 16, .Format = CU_AD_FORMAT_UNSIGNED_INT8, .NumChannels = 2};
    PATH_CHECK("cuArray3DCreate_v2", 256 * 256 * 16 * 2, cuArray3DCreate(&arr, &d3), cuArrayDestroy(arr));
    CUmipmappedArray mm;
    CUDA_ARRAY3D_DESCRIPTOR dm = {.Width = 512, .Height = 512, .Format = CU_AD_FORMAT_HALF, .NumChannels = 1};
    PATH_CHECK("cuMipmappedArrayCreate", (512 * 512 + 256 * 256 + 128 * 128) * 2,
               cuMipmappedArrayCreate(&mm, &dm, 3), cuMipmappedArrayDestroy(mm));

    /* Each counted path refuses what does not fit, before reaching the driver. */
    size_t over = limit + 1;
    EXPECT_RC(cuMemAlloc(&p, over), CUDA_ERROR_OUT_OF_MEMORY);
    EXPECT_RC(cuMemAllocManaged(&p, over, CU_MEM_ATTACH_GLOBAL), CUDA_ERROR_OUT_OF_MEMORY);
    EXPECT_RC(cuMemAllocPitch(&p, &pitch, over, 1, 4), CUDA_ERROR_OUT_OF_MEMORY);
    EXPECT_RC(cuMemAllocAsync(&p, over, s), CUDA_ERROR_OUT_OF_MEMORY);
    EXPECT_RC(cuMemAllocFromPoolAsync(&p, over, pool, s), CUDA_ERROR_OUT_OF_MEMORY);
    vp.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    vp.location.id = dev;
    size_t over_vmm = (limit / (2u << 20) + 1) * (2u << 20);
    EXPECT_RC(cuMemCreate(&h, over_vmm, &vp, 0), CUDA_ERROR_OUT_OF_MEMORY);
    CUDA_ARRAY_DESCRIPTOR big = {.Width = over, .Height = 1, .Format = CU_AD_FORMAT_UNSIGNED_INT8, .NumChannels = 1};
    EXPECT_RC(cuArrayCreate(&arr, &big), CUDA_ERROR_OUT_OF_MEMORY);
    legacy_array_desc lbig = {.Width = 65536, .Height = 65536, .Format = CU_AD_FORMAT_FLOAT, .NumChannels = 4};
    EXPECT_RC(legacy_cuArrayCreate(&arr, &lbig), CUDA_ERROR_OUT_OF_MEMORY);
    CUDA_ARRAY3D_DESCRIPTOR big3 = {.Width = over, .Format = CU_AD_FORMAT_UNSIGNED_INT8, .NumChannels = 1};
    EXPECT_RC(cuArray3DCreate(&arr, &big3), CUDA_ERROR_OUT_OF_MEMORY);
    EXPECT_RC(cuMipmappedArrayCreate(&mm, &big3, 1), CUDA_ERROR_OUT_OF_MEMORY);
    CHECK(mem_free() == limit, "free %zu after refusals, expected %zu", mem_free(), limit);
    EXPECT_RC(cuMemPoolDestroy(pool), CUDA_SUCCESS);
    EXPECT_RC(cuMemPoolDestroy(host_pool), CUDA_SUCCESS);
    PROBE_DONE("paths");
}

/* ------------------------------------------------------------------------------------------------ */

typedef struct {
    size_t limit;
    int iters;
    _Atomic uint64_t *shared; /* bytes currently held by every racing thread of every process */
    _Atomic uint64_t ok, refused, violations;
} stress_ctx;

static CUcontext stress_ctx_handle;

static void *stress_thread(void *arg)
{
    stress_ctx *c = arg;
    cuCtxSetCurrent(stress_ctx_handle);
    unsigned seed = (unsigned)(uintptr_t)pthread_self();
    CUdeviceptr held[8];
    size_t sizes[8];
    int n = 0;
    for (int i = 0; i < c->iters; i++) {
        if (n == 8 || (n > 0 && rand_r(&seed) % 3 == 0)) {
            n--;
            atomic_fetch_sub(c->shared, sizes[n]);
            if (cuMemFree(held[n]) != CUDA_SUCCESS) atomic_fetch_add(&c->violations, 1);
            continue;
        }
        size_t sz = c->limit / 16 + (size_t)(rand_r(&seed) % (c->limit / 8));
        CUresult rc = cuMemAlloc(&held[n], sz);
        if (rc == CUDA_SUCCESS) {
            uint64_t total = atomic_fetch_add(c->shared, sz) + sz;
            if (total > c->limit) atomic_fetch_add(&c->violations, 1);
            sizes[n++] = sz;
            atomic_fetch_add(&c->ok, 1);
        } else if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
            atomic_fetch_add(&c->refused, 1);
        } else {
            atomic_fetch_add(&c->violations, 1);
        }
    }
    while (n > 0) {
        n--;
        atomic_fetch_sub(c->shared, sizes[n]);
        cuMemFree(held[n]);
    }
    return NULL;
}

static int stress_scenario(size_t limit, int threads, int iters, const char *counter_file)
{
    int fd = open(counter_file, O_RDWR | O_CREAT, 0600);
    if (fd < 0 || ftruncate(fd, 4096) != 0) {
        fprintf(stderr, "FAIL: cannot open %s\n", counter_file);
        return 1;
    }
    _Atomic uint64_t *shared = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    stress_ctx c = {.limit = limit, .iters = iters, .shared = shared};
    cuCtxGetCurrent(&stress_ctx_handle);
    pthread_t t[64];
    if (threads > 64) threads = 64;
    for (int i = 0; i < threads; i++) pthread_create(&t[i], NULL, stress_thread, &c);
    for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
    printf("stress ok=%llu refused=%llu violations=%llu\n", (unsigned long long)c.ok, (unsigned long long)c.refused,
           (unsigned long long)c.violations);
    CHECK(c.violations == 0, "%llu allocations exceeded the slice or failed oddly", (unsigned long long)c.violations);
    CHECK(c.refused > 0, "the race never reached the limit (make the run longer)");
    PROBE_DONE("stress");
}

/* ------------------------------------------------------------------------------------------------ */

static int ipc_export(size_t bytes)
{
    CUdeviceptr p;
    EXPECT_RC(cuMemAlloc(&p, bytes), CUDA_SUCCESS);
    CUipcMemHandle h;
    EXPECT_RC(cuIpcGetMemHandle(&h, p), CUDA_SUCCESS);
    printf("handle=");
    for (size_t i = 0; i < sizeof(h.reserved); i++) printf("%02x", (unsigned char)h.reserved[i]);
    printf("\n");
    fflush(stdout);
    wait_stdin_eof();
    cuMemFree(p);
    return probe_failures ? 1 : 0;
}

static int ipc_open(const char *hex)
{
    CUipcMemHandle h;
    memset(&h, 0, sizeof(h));
    for (size_t i = 0; i < sizeof(h.reserved) && hex[2 * i] && hex[2 * i + 1]; i++) {
        unsigned v;
        sscanf(hex + 2 * i, "%2x", &v);
        h.reserved[i] = (char)v;
    }
    size_t before = mem_free();
    CUdeviceptr p;
    CUresult rc = cuIpcOpenMemHandle(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    printf("rc=%d\nfree_before=%zu\nfree_after=%zu\n", (int)rc, before, mem_free());
    if (rc == CUDA_SUCCESS) {
        EXPECT_RC(cuIpcCloseMemHandle(p), CUDA_SUCCESS);
        CHECK(mem_free() == before, "closing the handle did not credit it back (%zu vs %zu)", mem_free(), before);
    }
    return probe_failures ? 1 : 0;
}

/* ------------------------------------------------------------------------------------------------ */

static const char kernels_ptx[] = PROBE_PTX_HEAD PROBE_PTX_EMPTY PROBE_PTX_SPIN;

/* Milliseconds one spin(cycles) takes on the device, timed with events. */
static double time_spin(CUfunction fn, unsigned long long cycles)
{
    CUevent a, b;
    void *params[] = {&cycles};
    float best = 1e30f;
    cuEventCreate(&a, 0);
    cuEventCreate(&b, 0);
    for (int i = 0; i < 5; i++) {
        float ms = 0;
        cuEventRecord(a, NULL);
        EXPECT_RC(cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL), CUDA_SUCCESS);
        cuEventRecord(b, NULL);
        cuEventSynchronize(b);
        EXPECT_RC(cuEventElapsedTime(&ms, a, b), CUDA_SUCCESS);
        if (ms < best) best = ms;
    }
    cuEventDestroy(a);
    cuEventDestroy(b);
    return best;
}

static int launch_scenario(double seconds, unsigned kernel_us, const char *kind)
{
    char ptx[2048];
    snprintf(ptx, sizeof(ptx), kernels_ptx, kernel_us);
    CUmodule mod;
    CUfunction fn;
    EXPECT_RC(cuModuleLoadData(&mod, ptx), CUDA_SUCCESS);
    EXPECT_RC(cuModuleGetFunction(&fn, mod, "spin"), CUDA_SUCCESS);
    if (probe_failures) return 1;
    /* Calibrate the spin so one kernel takes about kernel_us (the double ignores the argument). */
    unsigned long long cycles = 1000000ull;
    double ms = time_spin(fn, cycles);
    if (ms > 0) cycles = (unsigned long long)((double)cycles * (kernel_us / 1000.0) / ms);
    double kernel_ms = time_spin(fn, cycles);
    void *params[] = {&cycles};
    CUgraphExec exec = NULL;
    if (strcmp(kind, "graph") == 0) {
        CUgraph g;
        CUgraphNode node;
        CUDA_KERNEL_NODE_PARAMS kp = {.func = fn, .gridDimX = 1, .gridDimY = 1, .gridDimZ = 1, .blockDimX = 1,
                                      .blockDimY = 1, .blockDimZ = 1, .kernelParams = params};
        EXPECT_RC(cuGraphCreate(&g, 0), CUDA_SUCCESS);
        EXPECT_RC(cuGraphAddKernelNode(&node, g, NULL, 0, &kp), CUDA_SUCCESS);
        EXPECT_RC(cuGraphInstantiate(&exec, g, 0), CUDA_SUCCESS);
    }
    CUlaunchConfig cfg = {.gridDimX = 1, .gridDimY = 1, .gridDimZ = 1, .blockDimX = 1, .blockDimY = 1, .blockDimZ = 1};
    double start = now_s(), half = start + seconds / 2, half_started = 0;
    unsigned long second_half = 0, total = 0;
    double t;
    while ((t = now_s()) < start + seconds) {
        CUresult rc;
        if (strcmp(kind, "ex") == 0) rc = cuLaunchKernelEx(&cfg, fn, params, NULL);
        else if (strcmp(kind, "coop") == 0) rc = cuLaunchCooperativeKernel(fn, 1, 1, 1, 1, 1, 1, 0, NULL, params);
        else if (strcmp(kind, "graph") == 0) rc = cuGraphLaunch(exec, NULL);
        else rc = cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL);
        if (rc != CUDA_SUCCESS) {
            CHECK(rc == CUDA_SUCCESS, "launch returned %d", (int)rc);
            break;
        }
        cuCtxSynchronize();
        total++;
        if (t >= half) {
            if (!half_started) half_started = t;
            second_half++;
        }
    }
    double window = now_s() - (half_started ? half_started : half);
    double busy = (double)second_half * kernel_ms / 1000.0 / window;
    /* The same from the kernel's nominal time: the calibration above includes any wait behind a
     * neighbour's kernels on a shared card, which would overstate this process's share. */
    double nominal = (double)second_half * kernel_us / 1e6 / window;
    printf("kernel_ms=%.3f\nlaunches=%lu\nbusy_fraction=%.3f\nnominal_busy_fraction=%.3f\n", kernel_ms, total,
           busy, nominal);
    return probe_failures ? 1 : 0;
}

/* Largest single cuMemAlloc that succeeds, by bisection between 0 and `hi` (1 MiB resolution first,
 * then exact at the top). */
static int boundary_scenario(size_t hi)
{
    size_t lo = 0;
    while (hi - lo > 1) {
        size_t mid = lo + (hi - lo) / 2;
        CUdeviceptr p;
        if (cuMemAlloc(&p, mid) == CUDA_SUCCESS) {
            cuMemFree(p);
            lo = mid;
        } else {
            hi = mid;
        }
    }
    CUdeviceptr p;
    CUresult over = cuMemAlloc(&p, lo + 1);
    if (over == CUDA_SUCCESS) cuMemFree(p);
    printf("largest_alloc=%zu\nlargest_plus_one_rc=%d\n", lo, (int)over);
    return 0;
}

static CUresult vmm_create(CUmemGenericAllocationHandle *h, size_t size)
{
    CUmemAllocationProp vp = {0};
    vp.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    vp.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    vp.location.id = dev;
    return cuMemCreate(h, size, &vp, 0);
}

static CUresult vmm_map(CUdeviceptr va, size_t size, CUmemGenericAllocationHandle h)
{
    CUresult rc = cuMemMap(va, size, 0, h, 0);
    if (rc != CUDA_SUCCESS) return rc;
    CUmemAccessDesc acc = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = dev},
                           .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    return cuMemSetAccess(va, size, &acc, 1);
}

/* The pattern of CUDA samples and VMM pools: create, map, release the handle at once, use the memory,
 * unmap when done. The driver frees the physical memory only when the last mapping goes. */
static int vmm_scenario(size_t limit)
{
    size_t gran = 2u << 20, six = (limit * 3 / 4) / gran * gran, two = 1u << 30;
    CUdeviceptr va, va2;
    CUmemGenericAllocationHandle h, h2, r;
    EXPECT_RC(cuMemAddressReserve(&va, 2 * six, 0, 0, 0), CUDA_SUCCESS);
    EXPECT_RC(vmm_create(&h, six), CUDA_SUCCESS);
    EXPECT_RC(vmm_map(va, six, h), CUDA_SUCCESS);
    EXPECT_RC(cuMemRelease(h), CUDA_SUCCESS);
    CHECK(mem_free() == limit - six, "free %zu after create+map+release, expected %zu", mem_free(), limit - six);
    EXPECT_RC(vmm_create(&h2, six), CUDA_ERROR_OUT_OF_MEMORY); /* still mapped: the slice is full */
    CUdeviceptr p;
    EXPECT_RC(cuMemAlloc(&p, six), CUDA_ERROR_OUT_OF_MEMORY);
    EXPECT_RC(cuMemsetD8(va, 7, 4096), CUDA_SUCCESS);
    /* Freeing a mapping as if it were cuMemAlloc's or an IPC opening is refused and changes nothing. */
    EXPECT_RC(cuMemFree(va), CUDA_ERROR_INVALID_VALUE);
    EXPECT_RC(cuIpcCloseMemHandle(va), CUDA_ERROR_INVALID_VALUE);
    CHECK(mem_free() == limit - six, "free %zu after refused frees, expected %zu", mem_free(), limit - six);
    EXPECT_RC(cuMemUnmap(va, six), CUDA_SUCCESS);
    CHECK(mem_free() == limit, "free %zu after the last unmap, expected %zu", mem_free(), limit);
    EXPECT_RC(vmm_create(&h2, six), CUDA_SUCCESS);
    EXPECT_RC(cuMemRelease(h2), CUDA_SUCCESS);
    CHECK(mem_free() == limit, "free %zu after create+release, expected %zu", mem_free(), limit);

    /* Two mappings of one allocation, and a retained handle: freed after the last of all of them. */
    EXPECT_RC(vmm_create(&h, two), CUDA_SUCCESS);
    EXPECT_RC(vmm_map(va, two, h), CUDA_SUCCESS);
    EXPECT_RC(cuMemAddressReserve(&va2, two, 0, 0, 0), CUDA_SUCCESS);
    EXPECT_RC(vmm_map(va2, two, h), CUDA_SUCCESS);
    EXPECT_RC(cuMemRetainAllocationHandle(&r, (void *)(uintptr_t)va), CUDA_SUCCESS);
    CHECK(r == h, "retained handle differs");
    EXPECT_RC(cuMemRelease(h), CUDA_SUCCESS);
    EXPECT_RC(cuMemUnmap(va, two), CUDA_SUCCESS);
    CHECK(mem_free() == limit - two, "free %zu with one mapping and a retained handle, expected %zu", mem_free(),
          limit - two);
    EXPECT_RC(cuMemUnmap(va2, two), CUDA_SUCCESS);
    CHECK(mem_free() == limit - two, "free %zu with a retained handle left, expected %zu", mem_free(), limit - two);
    EXPECT_RC(cuMemRelease(r), CUDA_SUCCESS);
    CHECK(mem_free() == limit, "free %zu at the end, expected %zu", mem_free(), limit);
    EXPECT_RC(cuMemRelease(r), CUDA_ERROR_INVALID_VALUE); /* gone: the driver's error, no credit */
    CHECK(mem_free() == limit, "free %zu after a bad release, expected %zu", mem_free(), limit);
    EXPECT_RC(cuMemAddressFree(va, 2 * six), CUDA_SUCCESS);
    EXPECT_RC(cuMemAddressFree(va2, two), CUDA_SUCCESS);
    PROBE_DONE("vmm");
}

static int ctx_teardown(size_t limit)
{
    size_t six = limit / 4 * 3;
    CUcontext primary, own;
    CUdeviceptr p, q;
    EXPECT_RC(cuCtxGetCurrent(&primary), CUDA_SUCCESS);
    EXPECT_RC(cuCtxCreate(&own, 0, dev), CUDA_SUCCESS);
    EXPECT_RC(cuMemAlloc(&p, six), CUDA_SUCCESS);
    EXPECT_RC(cuCtxDestroy(own), CUDA_SUCCESS);
    EXPECT_RC(cuCtxSetCurrent(primary), CUDA_SUCCESS);
    CHECK(mem_free() == limit, "free %zu after cuCtxDestroy, expected %zu", mem_free(), limit);
    EXPECT_RC(cuMemAlloc(&p, six), CUDA_SUCCESS);
    EXPECT_RC(cuDevicePrimaryCtxReset(dev), CUDA_SUCCESS);
    CHECK(mem_free() == limit, "free %zu after cuDevicePrimaryCtxReset, expected %zu", mem_free(), limit);
    EXPECT_RC(cuMemFree(p), CUDA_ERROR_INVALID_VALUE); /* freed by the reset: no second credit */
    CHECK(mem_free() == limit, "free %zu after freeing a reset allocation, expected %zu", mem_free(), limit);
    CUcontext again;
    EXPECT_RC(cuDevicePrimaryCtxRetain(&again, dev), CUDA_SUCCESS); /* refcount 2 */
    EXPECT_RC(cuCtxSetCurrent(again), CUDA_SUCCESS);
    EXPECT_RC(cuMemAlloc(&q, six), CUDA_SUCCESS);
    EXPECT_RC(cuDevicePrimaryCtxRelease(dev), CUDA_SUCCESS);
    CHECK(mem_free() == limit - six, "free %zu while the primary context is still retained", mem_free());
    EXPECT_RC(cuDevicePrimaryCtxRelease(dev), CUDA_SUCCESS); /* the last one */
    EXPECT_RC(cuDevicePrimaryCtxRetain(&again, dev), CUDA_SUCCESS);
    EXPECT_RC(cuCtxSetCurrent(again), CUDA_SUCCESS);
    CHECK(mem_free() == limit, "free %zu after the last primary release, expected %zu", mem_free(), limit);
    EXPECT_RC(cuMemAlloc(&q, limit), CUDA_SUCCESS);
    PROBE_DONE("ctx-teardown");
}

/* NVML memory info through dlopen, as a monitoring library would (nvmlMemory_t: total, free, used). */
static int nvml_used(unsigned long long *used)
{
    void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!h) return -1;
    int (*init)(void) = (int (*)(void))dlsym(h, "nvmlInit_v2");
    int (*by_index)(unsigned, void **) = (int (*)(unsigned, void **))dlsym(h, "nvmlDeviceGetHandleByIndex_v2");
    int (*meminfo)(void *, unsigned long long *) = (int (*)(void *, unsigned long long *))dlsym(h, "nvmlDeviceGetMemoryInfo");
    void *dev;
    unsigned long long m[3];
    if (!init || !by_index || !meminfo || init() != 0 || by_index(0, &dev) != 0 || meminfo(dev, m) != 0) return -1;
    *used = m[2];
    return 0;
}

static int fork_query(size_t bytes)
{
    CUdeviceptr p;
    EXPECT_RC(cuMemAlloc(&p, bytes), CUDA_SUCCESS);
    pid_t child = fork();
    if (child == 0) {
        unsigned long long used = 0;
        int rc = nvml_used(&used);
        printf("child_nvml_rc=%d child_used=%llu\n", rc, used);
        fflush(stdout);
        _exit(rc == 0 ? 0 : 1);
    }
    int status = 0;
    waitpid(child, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the child could not query NVML");
    CUdeviceptr q;
    CUresult rc = cuMemAlloc(&q, bytes);
    printf("rc=%d\n", (int)rc);
    if (rc == CUDA_SUCCESS) cuMemFree(q);
    cuMemFree(p);
    return probe_failures ? 1 : 0;
}

static int fork_hold(size_t bytes)
{
    CUdeviceptr p;
    CUresult rc = cuMemAlloc(&p, bytes);
    pid_t child = fork();
    if (child == 0) { /* never touches CUDA; outlives its parent */
        wait_stdin_eof();
        _exit(0);
    }
    printf("held rc=%d child=%d\n", (int)rc, (int)child);
    fflush(stdout);
    wait_stdin_eof();
    return 0;
}

/* free must drop by exactly `charged` across `expr` */
#define DROPS(label, charged, expr)                                                                      \
    do {                                                                                                 \
        size_t b_ = mem_free();                                                                          \
        EXPECT_RC(expr, CUDA_SUCCESS);                                                                   \
        size_t a_ = mem_free();                                                                          \
        CHECK(b_ - a_ == (size_t)(charged), "%s: free dropped by %lld, expected %zu", label,            \
              (long long)b_ - (long long)a_, (size_t)(charged));                                         \
    } while (0)

static int hidden_scenario(size_t limit, size_t ctx_bytes)
{
    size_t gib = 1u << 30, mib = 1u << 20;
    /* The primary context (setup) costs ctx_bytes, as the driver reports it. */
    CHECK(mem_free() == limit - ctx_bytes, "free %zu with one context, expected %zu", mem_free(), limit - ctx_bytes);
    CUcontext primary, own;
    EXPECT_RC(cuCtxGetCurrent(&primary), CUDA_SUCCESS);
    DROPS("cuCtxCreate", ctx_bytes, cuCtxCreate(&own, 0, dev));
    DROPS("cuCtxSetLimit(heap 1 GiB)", gib - 8 * mib, cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE, gib));
    DROPS("cuCtxSetLimit(stack 4 KiB)", (size_t)(4096 - 1024) * 80 * 2048, cuCtxSetLimit(CU_LIMIT_STACK_SIZE, 4096));
    DROPS("cuCtxSetLimit(printf 64 MiB)", 63 * mib, cuCtxSetLimit(CU_LIMIT_PRINTF_FIFO_SIZE, 64 * mib));
    DROPS("cuCtxSetLimit(heap back)", -(gib - 8 * mib), cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE, 8 * mib));
    EXPECT_RC(cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE, limit), CUDA_ERROR_OUT_OF_MEMORY);
    size_t with_own = mem_free();
    EXPECT_RC(cuCtxDestroy(own), CUDA_SUCCESS); /* its cost and its limits go with it */
    EXPECT_RC(cuCtxSetCurrent(primary), CUDA_SUCCESS);
    CHECK(mem_free() == limit - ctx_bytes, "free %zu after cuCtxDestroy, expected %zu (was %zu)", mem_free(),
          limit - ctx_bytes, with_own);
    DROPS("primary cuCtxSetLimit(heap 512 MiB)", 504 * mib, cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE, 512 * mib));
    DROPS("cuDevicePrimaryCtxReset", -(504 * mib), cuDevicePrimaryCtxReset(dev));

    /* Stream-ordered pools keep freed memory up to the release threshold: charged until trimmed. */
    CUstream s;
    CUmemoryPool pool;
    CUdeviceptr p;
    EXPECT_RC(cuStreamCreate(&s, 0), CUDA_SUCCESS);
    EXPECT_RC(cuDeviceGetDefaultMemPool(&pool, dev), CUDA_SUCCESS);
    cuuint64_t keep_all = ~0ull;
    EXPECT_RC(cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &keep_all), CUDA_SUCCESS);
    DROPS("cuMemAllocAsync", 2 * gib, cuMemAllocAsync(&p, 2 * gib, s));
    DROPS("cuMemFreeAsync (kept by the pool)", 0, cuMemFreeAsync(p, s));
    DROPS("cuStreamSynchronize (threshold: keep)", 0, cuStreamSynchronize(s));
    EXPECT_RC(cuMemAlloc(&p, mem_free() + 1), CUDA_ERROR_OUT_OF_MEMORY);
    DROPS("cuMemAllocAsync from the pool's spare", 0, cuMemAllocAsync(&p, gib, s));
    EXPECT_RC(cuMemFreeAsync(p, s), CUDA_SUCCESS);
    DROPS("cuMemPoolTrimTo(0)", -(2 * gib), cuMemPoolTrimTo(pool, 0));
    cuuint64_t release_all = 0;
    EXPECT_RC(cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &release_all), CUDA_SUCCESS);
    DROPS("cuMemAllocAsync", gib, cuMemAllocAsync(&p, gib, s));
    EXPECT_RC(cuMemFreeAsync(p, s), CUDA_SUCCESS);
    DROPS("cuStreamSynchronize (threshold 0: released)", -gib, cuStreamSynchronize(s));

    /* Graph memory nodes: backed at the first launch, kept after the executable goes, until trimmed. */
    CUgraph g;
    CUgraphNode node;
    CUgraphExec exec;
    CUDA_MEM_ALLOC_NODE_PARAMS mp = {0};
    mp.poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    mp.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    mp.poolProps.location.id = dev;
    mp.bytesize = 3 * gib;
    EXPECT_RC(cuGraphCreate(&g, 0), CUDA_SUCCESS);
    DROPS("cuGraphAddMemAllocNode", 0, cuGraphAddMemAllocNode(&node, g, NULL, 0, &mp));
    DROPS("cuGraphInstantiate", 0, cuGraphInstantiate(&exec, g, 0));
    DROPS("cuGraphLaunch (first)", 3 * gib, cuGraphLaunch(exec, s));
    DROPS("cuGraphLaunch (again)", 0, cuGraphLaunch(exec, s));
    DROPS("cuGraphExecDestroy (kept by the graph pool)", 0, cuGraphExecDestroy(exec));
    DROPS("cuGraphInstantiate", 0, cuGraphInstantiate(&exec, g, 0));
    DROPS("cuGraphLaunch (from the pool's spare)", 0, cuGraphLaunch(exec, s));
    EXPECT_RC(cuGraphExecDestroy(exec), CUDA_SUCCESS);
    DROPS("cuDeviceGraphMemTrim", -(3 * gib), cuDeviceGraphMemTrim(dev));
    mp.bytesize = limit;
    CUgraph big;
    EXPECT_RC(cuGraphCreate(&big, 0), CUDA_SUCCESS);
    EXPECT_RC(cuGraphAddMemAllocNode(&node, big, NULL, 0, &mp), CUDA_SUCCESS);
    EXPECT_RC(cuGraphInstantiate(&exec, big, 0), CUDA_SUCCESS);
    EXPECT_RC(cuGraphLaunch(exec, s), CUDA_ERROR_OUT_OF_MEMORY); /* more than the slice */
    EXPECT_RC(cuGraphExecDestroy(exec), CUDA_SUCCESS);
    EXPECT_RC(cuGraphDestroy(big), CUDA_SUCCESS);
    EXPECT_RC(cuGraphDestroy(g), CUDA_SUCCESS);

    /* External memory (a Vulkan allocation's file descriptor). */
    CUexternalMemory ext;
    CUDA_EXTERNAL_MEMORY_HANDLE_DESC ed = {0};
    ed.type = CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD;
    ed.handle.fd = memfd_create("vulkan-allocation", MFD_CLOEXEC);
    ed.size = 2 * gib;
    DROPS("cuImportExternalMemory", 2 * gib, cuImportExternalMemory(&ext, &ed));
    DROPS("cuDestroyExternalMemory", -(2 * gib), cuDestroyExternalMemory(ext));
    ed.handle.fd = memfd_create("vulkan-allocation", MFD_CLOEXEC);
    ed.size = limit;
    EXPECT_RC(cuImportExternalMemory(&ext, &ed), CUDA_ERROR_OUT_OF_MEMORY);
    CHECK(mem_free() == limit - ctx_bytes, "free %zu at the end, expected %zu", mem_free(), limit - ctx_bytes);
    PROBE_DONE("hidden");
}

/* The usage region is a file every process of the slice can write: what a tenant can do to it. */
static int tamper_scenario(const char *usage_dir, uint64_t bytes, const char *how)
{
    CUdeviceptr a = 0, b = 0;
    printf("first rc=%d\n", (int)cuMemAlloc(&a, bytes));
    char path[4096];
    snprintf(path, sizeof(path), "%s/usage.bin", usage_dir);
    int fd = open(path, O_RDWR);
    CHECK(fd >= 0, "open %s", path);
    size_t size = 4096 + 1024 * 128;
    unsigned char *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    CHECK(m != MAP_FAILED, "mmap %s", path);
    for (unsigned i = 0; i < 1024; i++) {
        unsigned char *e = m + 4096 + (size_t)i * 128;
        if (*(uint32_t *)e != 1) continue;
        if (strcmp(how, "zero") == 0) {
            memset(e + 16, 0, 32); /* used, avail, quota, peak */
        } else if ((int32_t)((int32_t *)e)[1] == (int32_t)getpid()) {
            *(uint64_t *)(e + 24) = 1ull << 60; /* avail: the fast path trusts it */
            *(uint64_t *)(e + 32) = 1ull << 60; /* quota */
        }
    }
    munmap(m, size);
    close(fd);
    printf("second rc=%d\n", (int)cuMemAlloc(&b, bytes));
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: cuda_probe SCENARIO [ARGS] (see the source header)\n");
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    setup();
    const char *s = argv[1];
    if (strcmp(s, "info") == 0) return info();
    if (strcmp(s, "limit") == 0 && argc == 3) return limit_scenario(strtoull(argv[2], NULL, 10));
    if (strcmp(s, "paths") == 0 && argc == 3) return paths_scenario(strtoull(argv[2], NULL, 10));
    if (strcmp(s, "alloc") == 0 && argc == 3) {
        CUdeviceptr p;
        CUresult rc = cuMemAlloc(&p, strtoull(argv[2], NULL, 10));
        printf("rc=%d\n", (int)rc);
        return 0;
    }
    if (strcmp(s, "hold") == 0 && argc == 3) {
        CUdeviceptr p = 0;
        CUresult rc = cuMemAlloc(&p, strtoull(argv[2], NULL, 10));
        printf("held rc=%d\n", (int)rc);
        fflush(stdout);
        wait_stdin_eof();
        if (rc == CUDA_SUCCESS) cuMemFree(p);
        return 0;
    }
    if (strcmp(s, "stress") == 0 && argc == 6)
        return stress_scenario(strtoull(argv[2], NULL, 10), atoi(argv[3]), atoi(argv[4]), argv[5]);
    if (strcmp(s, "ipc-export") == 0 && argc == 3) return ipc_export(strtoull(argv[2], NULL, 10));
    if (strcmp(s, "ipc-open") == 0 && argc == 3) return ipc_open(argv[2]);
    if (strcmp(s, "launch") == 0 && argc == 5) return launch_scenario(atof(argv[2]), (unsigned)atoi(argv[3]), argv[4]);
    if (strcmp(s, "ctx-teardown") == 0 && argc == 3) return ctx_teardown(strtoull(argv[2], NULL, 10));
    if (strcmp(s, "vmm") == 0 && argc == 3) return vmm_scenario(strtoull(argv[2], NULL, 10));
    if (strcmp(s, "fork-query") == 0 && argc == 3) return fork_query(strtoull(argv[2], NULL, 10));
    if (strcmp(s, "fork-hold") == 0 && argc == 3) return fork_hold(strtoull(argv[2], NULL, 10));
    if (strcmp(s, "hidden") == 0 && argc == 4)
        return hidden_scenario(strtoull(argv[2], NULL, 10), strtoull(argv[3], NULL, 10));
    if (strcmp(s, "tamper") == 0 && argc == 5) return tamper_scenario(argv[2], strtoull(argv[3], NULL, 10), argv[4]);
    if (strcmp(s, "boundary") == 0 && argc == 3) return boundary_scenario(strtoull(argv[2], NULL, 10));
    fprintf(stderr, "cuda_probe: unknown scenario or wrong arguments: %s\n", s);
    return 2;
}
