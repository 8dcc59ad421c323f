/* A kernel image file read whole into 64-byte-aligned memory, as a program embeds its fatbin, and
 * loaded the way the runtime loads an application's: shared by the programs on NVIDIA's runtime
 * (probe/gpuslice_cudart_probe.c, tests/cudart_probe.c). */
#ifndef PROBE_FILE_H
#define PROBE_FILE_H

#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>

/* The file's bytes (free() them); NULL if unreadable, said on stderr after `who`. */
static inline void *probe_read_file(const char *who, const char *path)
{
    FILE *f = fopen(path, "rb");
    void *buf = NULL;
    if (f) {
        fseek(f, 0, SEEK_END);
        long n = ftell(f);
        fseek(f, 0, SEEK_SET);
        buf = n > 0 ? aligned_alloc(64, ((size_t)n + 63) & ~(size_t)63) : NULL;
        if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
            free(buf);
            buf = NULL;
        }
        fclose(f);
    }
    if (!buf) fprintf(stderr, "%scannot read %s\n", who, path);
    return buf;
}

/* cudaLibraryLoadData of an image, as the runtime loads an application's; prints "load <code> <name>". */
static inline cudaError_t probe_load_library(cudaLibrary_t *lib, const void *image)
{
    cudaError_t rc = cudaLibraryLoadData(lib, image, NULL, NULL, 0, NULL, NULL, 0);
    printf("load %d %s\n", (int)rc, cudaGetErrorName(rc));
    return rc;
}

#endif
