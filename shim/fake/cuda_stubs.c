/*
 * Every entry point in src/gs_procs.h that the double does not model gets a stub here, so that
 * cuGetProcAddress answers every name a real driver of the simulated version knows (as the driver
 * does) and a call of an unmodeled one fails visibly: CUDA_ERROR_NOT_SUPPORTED, and its name on stderr
 * with GPUSLICE_FAKE_TRACE=1. Each stub is a weak alias: the double's real implementation, where it
 * has one, wins at link time. No cuda.h here: the stubs take no arguments they would need.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/gs_procs.h"

#define CUDA_ERROR_NOT_SUPPORTED 801

static int stub_called(const char *name)
{
    const char *t = getenv("GPUSLICE_FAKE_TRACE");
    if (t && t[0] == '1') fprintf(stderr, "fake NVIDIA driver: %s is not modeled (CUDA_ERROR_NOT_SUPPORTED)\n", name);
    return CUDA_ERROR_NOT_SUPPORTED;
}

#define STUB_ONE(fn)                                                                                                   \
    static int stub_##fn(void)                                                                                         \
    {                                                                                                                  \
        return stub_called(#fn);                                                                                       \
    }                                                                                                                  \
    __attribute__((weak, alias("stub_" #fn), visibility("default"))) int fn(void);
#define STUB(base, since, fn) STUB_ONE(fn)
#define STUB_PTSZ(base, since, fn, ptsz) STUB_ONE(fn) STUB_ONE(ptsz)
GS_DRIVER_PROCS_UNIQUE(STUB, STUB_PTSZ)

#define ADDR(base, since, fn) (void *)stub_##fn,
#define ADDR_PTSZ(base, since, fn, ptsz) (void *)stub_##fn, (void *)stub_##ptsz,
static void *const stubs[] = {GS_DRIVER_PROCS_UNIQUE(ADDR, ADDR_PTSZ)};

int fake_is_stub(const void *fn)
{
    for (size_t i = 0; i < sizeof(stubs) / sizeof(stubs[0]); i++)
        if (stubs[i] == fn) return 1;
    return 0;
}
