/*
 * A tenant program on NVIDIA's CUDA runtime (libcudart from the PyPI wheels), as nvcc would build it
 * but without nvcc: its kernel comes as a fatbin file and is registered the way nvcc's generated code
 * registers it (__cudaRegisterFatBinary / __cudaRegisterFunction), and loaded once more through
 * cudaLibraryLoadData. Compiled against the headers of the runtime it is linked with (12.x or 13.x).
 *
 *   cudart_probe version             "runtime=<v> driver=<v> count=<rc> <name>"
 *   cudart_probe props               "name=<name> total=<bytes> cc=<major>.<minor> sms=<n> ..."
 *   cudart_probe load FATBIN KERNEL  "load <rc> <name>" for cudaLibraryLoadData, then "kernel <rc> <name>"
 *   cudart_probe all FATBIN KERNEL   every step below, one line each: "<step> ok" or "<step> FAIL <rc> <name>"
 *
 * Exit status: 0 every step ok, 1 a step failed, 2 usage.
 */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../probe/probe_file.h"

/* What nvcc's generated host code calls; exported by libcudart. */
extern void **__cudaRegisterFatBinary(void *fatCubin);
extern void __cudaRegisterFatBinaryEnd(void **fatCubinHandle);
extern void __cudaUnregisterFatBinary(void **fatCubinHandle);
extern void __cudaRegisterFunction(void **fatCubinHandle, const char *hostFun, char *deviceFun, const char *deviceName,
                                   int thread_limit, void *tid, void *bid, void *bDim, void *gDim, int *wSize);

typedef struct {
    int magic;
    int version;
    const unsigned long long *data;
    void *filename_or_fatbins;
} fatbin_wrapper;

static int failures;

static int check(const char *step, cudaError_t rc)
{
    if (rc == cudaSuccess) {
        printf("%s ok\n", step);
        return 1;
    }
    printf("%s FAIL %d %s\n", step, (int)rc, cudaGetErrorName(rc));
    failures++;
    return 0;
}

static int cmd_version(void)
{
    int rt = 0, drv = 0, count = -1;
    cudaRuntimeGetVersion(&rt);
    cudaDriverGetVersion(&drv);
    cudaError_t rc = cudaGetDeviceCount(&count);
    printf("runtime=%d driver=%d count=%d %s devices=%d\n", rt, drv, (int)rc, cudaGetErrorName(rc), count);
    return 0;
}

static int cmd_props(void)
{
    struct cudaDeviceProp p;
    if (!check("cudaGetDeviceProperties", cudaGetDeviceProperties(&p, 0))) return 1;
    printf("name=%s\ntotal=%zu\ncc=%d.%d\nsms=%d\nthreads_per_sm=%d\nshared_per_sm=%zu\nshared_per_block=%zu\n"
           "regs_per_block=%d\nwarp=%d\nl2=%d\nbus_width=%d\npci=%04x:%02x:%02x\nmanaged=%d\nconcurrent_managed=%d\n"
           "uuid_first_byte=%02x\n",
           p.name, p.totalGlobalMem, p.major, p.minor, p.multiProcessorCount, p.maxThreadsPerMultiProcessor,
           p.sharedMemPerMultiprocessor, p.sharedMemPerBlock, p.regsPerBlock, p.warpSize, p.l2CacheSize,
           p.memoryBusWidth, p.pciDomainID, p.pciBusID, p.pciDeviceID, p.managedMemory, p.concurrentManagedAccess,
           (unsigned char)p.uuid.bytes[0]);
#if CUDART_VERSION < 13000 /* CUDA 13 dropped the clocks from cudaDeviceProp */
    printf("clock_khz=%d\nmemory_clock_khz=%d\n", p.clockRate, p.memoryClockRate);
#endif
    size_t free_b = 0, total_b = 0;
    if (check("cudaMemGetInfo", cudaMemGetInfo(&free_b, &total_b))) printf("mem_free=%zu\nmem_total=%zu\n", free_b, total_b);
    return failures ? 1 : 0;
}

static dim3 dim3_of(unsigned x)
{
    dim3 d = {x, 1, 1};
    return d;
}

static char host_stub; /* the "host function" nvcc would register the kernel under */

static int cmd_all(const char *fatbin_path, const char *kernel)
{
    void *image = probe_read_file("", fatbin_path);
    if (!image) return 2;
    int dev = -1;
    check("cudaSetDevice", cudaSetDevice(0));
    check("cudaGetDevice", cudaGetDevice(&dev));
    check("cudaFree(0)", cudaFree(0));

    /* Memory that behaves: what is written is read back. */
    enum { N = 1 << 20 };
    unsigned char *d = NULL, *host = malloc(N);
    if (check("cudaMalloc", cudaMalloc((void **)&d, N))) {
        check("cudaMemset", cudaMemset(d, 0x5a, N));
        memset(host, 0, N);
        check("cudaMemcpy D2H", cudaMemcpy(host, d, N, cudaMemcpyDeviceToHost));
        check("memset visible", host[0] == 0x5a && host[N - 1] == 0x5a ? cudaSuccess : cudaErrorUnknown);
        for (int i = 0; i < N; i++) host[i] = (unsigned char)i;
        check("cudaMemcpy H2D", cudaMemcpy(d, host, N, cudaMemcpyHostToDevice));
        unsigned char back[16] = {0};
        check("cudaMemcpy D2H tail", cudaMemcpy(back, d + N - 16, 16, cudaMemcpyDeviceToHost));
        check("copy visible", back[15] == (unsigned char)(N - 1) ? cudaSuccess : cudaErrorUnknown);
        check("cudaFree", cudaFree(d));
    }

    cudaStream_t s = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    check("cudaStreamCreateWithFlags", cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    check("cudaEventCreate", cudaEventCreate(&e0));
    check("cudaEventCreate", cudaEventCreate(&e1));
    check("cudaEventRecord", cudaEventRecord(e0, s));

    /* The kernel, registered as nvcc's generated code does, launched through the runtime. */
    fatbin_wrapper wrapper = {0x466243B1, 1, image, NULL};
    void **handle = __cudaRegisterFatBinary(&wrapper);
    __cudaRegisterFunction(handle, &host_stub, (char *)kernel, kernel, -1, NULL, NULL, NULL, NULL, NULL);
    __cudaRegisterFatBinaryEnd(handle);
    void *arg_ptr = NULL;
    int arg_n = 0;
    void *args[] = {&arg_ptr, &arg_n};
    check("cudaLaunchKernel", cudaLaunchKernel(&host_stub, dim3_of(64), dim3_of(128), args, 0, s));
    check("cudaEventRecord", cudaEventRecord(e1, s));
    check("cudaStreamSynchronize", cudaStreamSynchronize(s));
    float ms = -1;
    check("cudaEventElapsedTime", cudaEventElapsedTime(&ms, e0, e1));
    printf("kernel_ms=%.3f\n", ms);

    /* The same image through the library API (cuLibraryLoadData underneath). */
    cudaLibrary_t lib = NULL;
    cudaKernel_t k = NULL;
    if (check("cudaLibraryLoadData", cudaLibraryLoadData(&lib, image, NULL, NULL, 0, NULL, NULL, 0))) {
        if (check("cudaLibraryGetKernel", cudaLibraryGetKernel(&k, lib, kernel)))
            check("cudaLaunchKernel(kernel)", cudaLaunchKernel((const void *)k, dim3_of(1), dim3_of(32), args, 0, s));
        cudaKernel_t none = NULL;
        cudaError_t rc = cudaLibraryGetKernel(&none, lib, "no_such_kernel");
        check("unknown kernel refused", rc == cudaErrorSymbolNotFound ? cudaSuccess : cudaErrorUnknown);
        check("cudaLibraryUnload", cudaLibraryUnload(lib));
    }

    /* Stream-ordered pool. */
    void *pa = NULL;
    if (check("cudaMallocAsync", cudaMallocAsync(&pa, 64 << 20, s))) check("cudaFreeAsync", cudaFreeAsync(pa, s));
    check("cudaStreamSynchronize", cudaStreamSynchronize(s));
    cudaMemPool_t pool = NULL;
    check("cudaDeviceGetDefaultMemPool", cudaDeviceGetDefaultMemPool(&pool, 0));

    /* Managed memory: the host reads and writes it directly. */
    int *m = NULL;
    if (check("cudaMallocManaged", cudaMallocManaged((void **)&m, 4096, cudaMemAttachGlobal))) {
        m[0] = 42;
        check("cudaDeviceSynchronize", cudaDeviceSynchronize());
        check("managed visible", m[0] == 42 ? cudaSuccess : cudaErrorUnknown);
        check("cudaFree(managed)", cudaFree(m));
    }

    /* A graph with a memory node, instantiated with parameters. */
    cudaGraph_t g = NULL;
    cudaGraphExec_t ge = NULL;
    cudaGraphNode_t alloc_node = NULL, free_node = NULL;
    if (check("cudaGraphCreate", cudaGraphCreate(&g, 0))) {
        struct cudaMemAllocNodeParams ap;
        memset(&ap, 0, sizeof(ap));
        ap.poolProps.allocType = cudaMemAllocationTypePinned;
        ap.poolProps.location.type = cudaMemLocationTypeDevice;
        ap.poolProps.location.id = 0;
        ap.bytesize = 32 << 20;
        if (check("cudaGraphAddMemAllocNode", cudaGraphAddMemAllocNode(&alloc_node, g, NULL, 0, &ap)))
            check("cudaGraphAddMemFreeNode", cudaGraphAddMemFreeNode(&free_node, g, &alloc_node, 1, ap.dptr));
        cudaGraphInstantiateParams ip;
        memset(&ip, 0, sizeof(ip));
        if (check("cudaGraphInstantiateWithParams", cudaGraphInstantiateWithParams(&ge, g, &ip))) {
            check("cudaGraphLaunch", cudaGraphLaunch(ge, s));
            check("cudaStreamSynchronize", cudaStreamSynchronize(s));
            check("cudaGraphExecDestroy", cudaGraphExecDestroy(ge));
        }
        check("cudaGraphDestroy", cudaGraphDestroy(g));
    }

    /* Stream capture: the launch becomes a node of the captured graph, which then runs. */
    cudaGraph_t cg = NULL;
    cudaGraphExec_t cge = NULL;
    unsigned char *cap = NULL, seen = 0xff;
    check("cudaMalloc (capture target)", cudaMalloc((void **)&cap, 4096));
    check("cudaMemset (capture target)", cudaMemset(cap, 0, 4096));
    if (check("cudaStreamBeginCapture", cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal))) {
        /* a captured memset runs when the graph runs, not when it is captured */
        check("cudaMemsetAsync (captured)", cudaMemsetAsync(cap, 0x11, 4096, s));
        enum cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
        check("cudaStreamIsCapturing", cudaStreamIsCapturing(s, &st));
        check("capturing", st == cudaStreamCaptureStatusActive ? cudaSuccess : cudaErrorUnknown);
        check("cudaLaunchKernel (captured)", cudaLaunchKernel(&host_stub, dim3_of(8), dim3_of(64), args, 0, s));
        if (check("cudaStreamEndCapture", cudaStreamEndCapture(s, &cg))) {
            size_t nodes = 0;
            check("cudaGraphGetNodes", cudaGraphGetNodes(cg, NULL, &nodes));
            printf("captured_nodes=%zu\n", nodes);
            check("two nodes captured", nodes == 2 ? cudaSuccess : cudaErrorUnknown);
            check("cudaMemcpy (before the graph runs)", cudaMemcpy(&seen, cap + 4095, 1, cudaMemcpyDeviceToHost));
            check("captured memset not run yet", seen == 0 ? cudaSuccess : cudaErrorUnknown);
            if (check("cudaGraphInstantiate", cudaGraphInstantiate(&cge, cg, 0))) {
                check("cudaGraphLaunch (captured)", cudaGraphLaunch(cge, s));
                check("cudaStreamSynchronize", cudaStreamSynchronize(s));
                check("cudaMemcpy (after)", cudaMemcpy(&seen, cap + 4095, 1, cudaMemcpyDeviceToHost));
                check("captured memset ran with the graph", seen == 0x11 ? cudaSuccess : cudaErrorUnknown);
                check("cudaGraphExecDestroy", cudaGraphExecDestroy(cge));
            }
            check("cudaGraphDestroy", cudaGraphDestroy(cg));
        }
    }
    check("cudaFree (capture target)", cudaFree(cap));

    check("cudaEventDestroy", cudaEventDestroy(e0));
    check("cudaEventDestroy", cudaEventDestroy(e1));
    check("cudaStreamDestroy", cudaStreamDestroy(s));
    __cudaUnregisterFatBinary(handle);
    check("cudaDeviceReset", cudaDeviceReset());
    /* The runtime starts again after a reset. */
    void *again = NULL;
    if (check("cudaMalloc after reset", cudaMalloc(&again, 4096))) check("cudaFree", cudaFree(again));
    printf("failures=%d\n", failures);
    free(host);
    return failures ? 1 : 0;
}

static int cmd_load(const char *fatbin_path, const char *kernel)
{
    void *image = probe_read_file("", fatbin_path);
    if (!image) return 2;
    cudaLibrary_t lib = NULL;
    cudaError_t rc = probe_load_library(&lib, image);
    if (rc != cudaSuccess) return 0;
    cudaKernel_t k = NULL;
    rc = cudaLibraryGetKernel(&k, lib, kernel);
    printf("kernel %d %s\n", (int)rc, cudaGetErrorName(rc));
    return 0;
}

int main(int argc, char **argv)
{
    if (argc >= 4 && strcmp(argv[1], "load") == 0) return cmd_load(argv[2], argv[3]);
    if (argc >= 2 && strcmp(argv[1], "version") == 0) return cmd_version();
    if (argc >= 2 && strcmp(argv[1], "props") == 0) return cmd_props();
    if (argc >= 4 && strcmp(argv[1], "all") == 0) return cmd_all(argv[2], argv[3]);
    fprintf(stderr, "usage: cudart_probe version | props | load FATBIN KERNEL | all FATBIN KERNEL\n");
    return 2;
}
