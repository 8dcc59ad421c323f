/* A kernel image file read whole into 64-byte-aligned memory, as a program embeds its fatbin: shared
 * by the programs on NVIDIA's runtime (probe/gpuslice_cudart_probe.c, tests/cudart_probe.c). */
#ifndef PROBE_FILE_H
#define PROBE_FILE_H

#include <stdio.h>
#include <stdlib.h>

/* The file's bytes (free() them), their count in *len; NULL if unreadable. */
static inline void *probe_read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    void *buf = n > 0 ? aligned_alloc(64, ((size_t)n + 63) & ~(size_t)63) : NULL;
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    *len = (size_t)n;
    return buf;
}

#endif
