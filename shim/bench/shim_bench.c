/*
 * Per-call cost of cuLaunchKernel and cuMemAlloc, linked against libcuda.so.1 like an application.
 * tests/bench.sh runs it with and without the shim against the same driver and prints the ratio.
 *
 *   shim_bench [ITERATIONS] [PTX_FILE]     (PTX_FILE must define an `empty` kernel; default: built in)
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static const char builtin_ptx[] = "// gpuslice-fake: duration_us=0\n"
                                  ".version 6.0\n.target sm_70\n.address_size 64\n"
                                  ".visible .entry empty()\n{\n\tret;\n}\n";

static double now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

#define CK(call)                                                                                         \
    do {                                                                                                 \
        CUresult rc_ = (call);                                                                           \
        if (rc_ != CUDA_SUCCESS) {                                                                       \
            fprintf(stderr, "shim_bench: %s failed: %d\n", #call, (int)rc_);                             \
            exit(1);                                                                                     \
        }                                                                                                \
    } while (0)

static char *read_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        perror(path);
        exit(1);
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    rewind(f);
    char *buf = malloc((size_t)n + 1);
    if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) exit(1);
    buf[n] = '\0';
    fclose(f);
    return buf;
}

int main(int argc, char **argv)
{
    int iters = argc > 1 ? atoi(argv[1]) : 200000;
    const char *ptx = argc > 2 ? read_file(argv[2]) : builtin_ptx;
    CUdevice dev;
    CUcontext ctx;
    CUmodule mod;
    CUfunction fn;
    CK(cuInit(0));
    CK(cuDeviceGet(&dev, 0));
    CK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CK(cuCtxSetCurrent(ctx));
    CK(cuModuleLoadData(&mod, ptx));
    CK(cuModuleGetFunction(&fn, mod, "empty"));

    for (int i = 0; i < 1000; i++) CK(cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL));
    CK(cuCtxSynchronize());
    /* Batches keep the launch queue from filling on a real GPU (a full queue measures the GPU). */
    double launch_total = 0;
    int launched = 0, batch = 256;
    while (launched < iters) {
        double t0 = now_ns();
        for (int i = 0; i < batch; i++) CK(cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL));
        launch_total += now_ns() - t0;
        launched += batch;
        CK(cuCtxSynchronize());
    }

    enum { BATCH = 512 };
    static CUdeviceptr ptrs[BATCH];
    double alloc_total = 0, free_total = 0;
    int allocs = 0;
    int rounds = iters / 20 / BATCH + 1;
    for (int r = 0; r < rounds; r++) {
        double t0 = now_ns();
        for (int i = 0; i < BATCH; i++) CK(cuMemAlloc(&ptrs[i], 1u << 20));
        double t1 = now_ns();
        for (int i = 0; i < BATCH; i++) CK(cuMemFree(ptrs[i]));
        free_total += now_ns() - t1;
        alloc_total += t1 - t0;
        allocs += BATCH;
    }
    printf("launch_ns=%.1f\nalloc_ns=%.1f\nfree_ns=%.1f\nlaunches=%d\nallocs=%d\n", launch_total / launched,
           alloc_total / allocs, free_total / allocs, launched, allocs);
    return 0;
}
