/*
 * gpuslice-cudart-probe: a tenant program on NVIDIA's CUDA runtime (libcudart.so.12 from the PyPI
 * wheel nvidia-cuda-runtime-cu12), to see a slice the way CUDA applications, CuPy and PyTorch see it:
 * through the runtime, which reaches the driver by cuGetProcAddress and its private export tables.
 * Built without a CUDA toolkit against the wheel's headers (gpuslice_dev.gpusim.cudart.build_program).
 *
 *   gpuslice-cudart-probe info        "<name>, <total> MiB, free <free> MiB, runtime <v>, driver <v>"
 *                                     (cudaGetDeviceProperties, cudaMemGetInfo)
 *   gpuslice-cudart-probe alloc SIZE_MIB...
 *                                     one cudaMalloc per size, one line each:
 *                                     "cudaMalloc(<bytes>) -> <code> <name>"; kept until exit
 *   gpuslice-cudart-probe kernels FATBIN KERNEL
 *                                     loads a kernel image as the runtime loads an application's
 *                                     (cudaLibraryLoadData), launches KERNEL once and synchronizes:
 *                                     "load <code> <name>", "launch <code> <name>"; the images in the
 *                                     probe image: /usr/local/share/gpuslice/kernels-{sm70,no-volta}.fatbin
 *
 * Exit status: 0 ok (an allocation refused with cudaErrorMemoryAllocation, or an image the GPU cannot
 * run, is an answer), 1 a runtime call failed unexpectedly, 2 usage.
 */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "probe_file.h"

#define MIB (1024ull * 1024ull)

static int fail(const char *call, cudaError_t rc)
{
    fprintf(stderr, "gpuslice-cudart-probe: %s failed: %d %s\n", call, (int)rc, cudaGetErrorName(rc));
    return 1;
}

static int cmd_info(void)
{
    int rt = 0, drv = 0;
    cudaRuntimeGetVersion(&rt);
    cudaDriverGetVersion(&drv);
    struct cudaDeviceProp p;
    cudaError_t rc = cudaGetDeviceProperties(&p, 0);
    if (rc != cudaSuccess) return fail("cudaGetDeviceProperties", rc);
    size_t free_b = 0, total_b = 0;
    rc = cudaMemGetInfo(&free_b, &total_b);
    if (rc != cudaSuccess) return fail("cudaMemGetInfo", rc);
    printf("%s, %llu MiB, free %llu MiB, runtime %d, driver %d\n", p.name,
           (unsigned long long)(p.totalGlobalMem / MIB), (unsigned long long)(free_b / MIB), rt, drv);
    return 0;
}

static int cmd_alloc(int n, char **sizes)
{
    for (int i = 0; i < n; i++) {
        char *end = NULL;
        unsigned long long mib = strtoull(sizes[i], &end, 10);
        if (end == sizes[i] || *end != '\0') {
            fprintf(stderr, "gpuslice-cudart-probe: size %s is not a number of MiB\n", sizes[i]);
            return 2;
        }
        void *ptr = NULL;
        cudaError_t rc = cudaMalloc(&ptr, (size_t)(mib * MIB));
        printf("cudaMalloc(%llu) -> %d %s\n", mib * MIB, (int)rc, cudaGetErrorName(rc));
        if (rc != cudaSuccess && rc != cudaErrorMemoryAllocation) return 1;
        (void)cudaGetLastError(); /* the refusal is an answer; the next call starts clean */
    }
    return 0;
}

static int cmd_kernels(const char *path, const char *name)
{
    void *image = probe_read_file("gpuslice-cudart-probe: ", path);
    if (!image) return 2;
    cudaLibrary_t lib = NULL;
    cudaError_t rc = probe_load_library(&lib, image);
    if (rc == cudaSuccess) {
        cudaKernel_t k = NULL;
        rc = cudaLibraryGetKernel(&k, lib, name);
        if (rc == cudaSuccess) {
            dim3 one = {1, 1, 1};
            rc = cudaLaunchKernel((const void *)k, one, one, NULL, 0, NULL); /* a kernel without parameters */
            if (rc == cudaSuccess) rc = cudaDeviceSynchronize();
        }
        printf("launch %d %s\n", (int)rc, cudaGetErrorName(rc));
    }
    fflush(stdout);
    return rc == cudaSuccess || rc == cudaErrorNoKernelImageForDevice || rc == cudaErrorUnsupportedPtxVersion ? 0 : 1;
}

int main(int argc, char **argv)
{
    if (argc == 4 && strcmp(argv[1], "kernels") == 0) return cmd_kernels(argv[2], argv[3]);
    if (argc == 2 && strcmp(argv[1], "info") == 0) return cmd_info();
    if (argc >= 3 && strcmp(argv[1], "alloc") == 0) return cmd_alloc(argc - 2, argv + 2);
    fprintf(stderr, "usage: gpuslice-cudart-probe info | alloc SIZE_MIB... | kernels FATBIN KERNEL\n");
    return 2;
}
