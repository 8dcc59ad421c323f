/*
 * Kernel and graph launches: the cooperative throttle toward the compute share.
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
 * Launches: cooperative throttle toward the compute share.
 * ---------------------------------------------------------------------------------------------- */

#define LAUNCH(name, ...)                                                                                \
    do {                                                                                                 \
        NEED_REAL(name);                                                                                 \
        if (GS_UNLIKELY(gs_ensure_init() == GS_MODE_UNINIT)) return CUDA_ERROR_NOT_INITIALIZED;          \
        gs_throttle_before_launch();                                                                     \
        return real_##name(__VA_ARGS__);                                                                 \
    } while (0)

GS_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                                  unsigned int by, unsigned int bz, unsigned int shmem, CUstream s, void **params,
                                  void **extra)
{
    LAUNCH(cuLaunchKernel, f, gx, gy, gz, bx, by, bz, shmem, s, params, extra);
}

GS_EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                       unsigned int bx, unsigned int by, unsigned int bz, unsigned int shmem,
                                       CUstream s, void **params, void **extra)
{
    LAUNCH(cuLaunchKernel_ptsz, f, gx, gy, gz, bx, by, bz, shmem, s, params, extra);
}

GS_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **params, void **extra)
{
    LAUNCH(cuLaunchKernelEx, config, f, params, extra);
}

GS_EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **params, void **extra)
{
    LAUNCH(cuLaunchKernelEx_ptsz, config, f, params, extra);
}

GS_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                             unsigned int bx, unsigned int by, unsigned int bz, unsigned int shmem,
                                             CUstream s, void **params)
{
    LAUNCH(cuLaunchCooperativeKernel, f, gx, gy, gz, bx, by, bz, shmem, s, params);
}

GS_EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                                  unsigned int bx, unsigned int by, unsigned int bz,
                                                  unsigned int shmem, CUstream s, void **params)
{
    LAUNCH(cuLaunchCooperativeKernel_ptsz, f, gx, gy, gz, bx, by, bz, shmem, s, params);
}

#define GRAPH_LAUNCH(name)                                                                               \
    do {                                                                                                 \
        NEED_REAL(name);                                                                                 \
        if (GS_UNLIKELY(gs_ensure_init() == GS_MODE_UNINIT)) return CUDA_ERROR_NOT_INITIALIZED;          \
        gs_throttle_before_launch();                                                                     \
        if (GS_UNLIKELY(atomic_load_explicit(&has_graph_mem, memory_order_relaxed)) &&                   \
            atomic_load(&gs_mode) == GS_MODE_ACTIVE)                                                     \
            return graph_launch(real_##name, g, s);                                                      \
        return real_##name(g, s);                                                                        \
    } while (0)

GS_EXPORT CUresult cuGraphLaunch(CUgraphExec g, CUstream s)
{
    GRAPH_LAUNCH(cuGraphLaunch);
}

GS_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec g, CUstream s)
{
    GRAPH_LAUNCH(cuGraphLaunch_ptsz);
}

GS_EXPORT CUresult cuLaunch(CUfunction f)
{
    LAUNCH(cuLaunch, f);
}

GS_EXPORT CUresult cuLaunchGrid(CUfunction f, int w, int h)
{
    LAUNCH(cuLaunchGrid, f, w, h);
}

GS_EXPORT CUresult cuLaunchGridAsync(CUfunction f, int w, int h, CUstream s)
{
    LAUNCH(cuLaunchGridAsync, f, w, h, s);
}

