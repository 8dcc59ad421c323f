/*
 * The shim's start: the config path slot, the first-call initialization (config, usage region,
 * allocation tables), the fork handler, and which devices the slice covers.
 */
#define _GNU_SOURCE
#include "gs_cuda.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

/*
 * The config path, fixed at build time. It sits in a marked, fixed-size array so that
 * `gpuslice shim run` can write a private copy of this library pointing at another file (a tenant
 * cannot: in a container the library is injected read-only and /etc/ld.so.preload names it).
 * Layout: GS_CONFIG_MARKER, then a NUL-terminated path, NUL-padded to GS_CONFIG_SLOT bytes.
 */
#ifndef GS_DEFAULT_CONFIG_PATH
#define GS_DEFAULT_CONFIG_PATH "/etc/gpuslice/slice.conf"
#endif
#define GS_CONFIG_MARKER "@@GPUSLICE_CONFIG_PATH@@"
#define GS_CONFIG_SLOT 4096
__attribute__((used, aligned(64))) volatile char gs_config_slot[GS_CONFIG_SLOT] =
    GS_CONFIG_MARKER GS_DEFAULT_CONFIG_PATH;

_Atomic int gs_mode = GS_MODE_UNINIT;
gs_config gs_cfg;
gs_region gs_reg;
char gs_util_path[GS_PATH_MAX];

gs_table tab_dptr;  /* device pointers: cuMemAlloc*, managed, async, pools, IPC opens */
gs_table tab_vmm;   /* VMM handles held by the application -> gs_phys* */
gs_table tab_map;   /* VMM mapping start addresses -> gs_vmap* */
gs_table tab_array; /* CUarray and CUmipmappedArray handles */
gs_table tab_pool;  /* pools created with a non-device location (their allocations are free) */
gs_table tab_graph; /* graphs with memory alloc nodes -> their bytes */
gs_table tab_gexec; /* executable graphs with memory -> bytes | GS_GEXEC_BACKED once launched */
_Atomic int has_exports; /* this process exported memory for IPC: frees drop its export records */

static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER;

void gs_log(const char *fmt, ...)
{
    char buf[1024];
    int n = snprintf(buf, sizeof(buf), "gpuslice[%d]: ", (int)getpid());
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(buf + n, sizeof(buf) - (size_t)n - 1, fmt, ap);
    va_end(ap);
    size_t len = (size_t)n + (m < 0 ? 0 : (size_t)m);
    if (len > sizeof(buf) - 2) len = sizeof(buf) - 2;
    buf[len++] = '\n';
    (void)!write(2, buf, len);
}

/* ------------------------------------------------------------------------------------------------
 * Initialization: config, usage region, tables. Runs on the first intercepted call, not at load, so
 * that processes which never touch the GPU (a shell under /etc/ld.so.preload) pay nothing.
 * ---------------------------------------------------------------------------------------------- */

_Atomic uint64_t ctx_charged; /* bit per device ordinal: context overhead charged */

/* A forked child owns none of its parent's driver objects, entry or locks: start it from scratch. */
static void after_fork_child(void)
{
    gs_region_after_fork_child(&gs_reg);
    gs_table_clear(&tab_dptr);
    gs_table_clear(&tab_vmm);
    gs_table_clear(&tab_map);
    gs_table_clear(&tab_array);
    gs_vmm_after_fork_child();
    atomic_store(&ctx_charged, 0);
    gs_ctx_after_fork_child();
    gs_pool_after_fork_child();
    gs_graph_after_fork_child();
    pthread_mutex_init(&init_lock, NULL);
    gs_hook_after_fork_child();
    gs_throttle_after_fork_child();
}

void gs_init_slow(void)
{
    pthread_mutex_lock(&init_lock);
    if (atomic_load(&gs_mode) != GS_MODE_UNINIT) {
        pthread_mutex_unlock(&init_lock);
        return;
    }
    char path[GS_CONFIG_SLOT];
    size_t off = sizeof(GS_CONFIG_MARKER) - 1, i = 0;
    for (; off + i < GS_CONFIG_SLOT - 1 && gs_config_slot[off + i] != '\0'; i++) path[i] = gs_config_slot[off + i];
    path[i] = '\0';
    /* Derived from the trusted config path, never from anything the tenant can write. */
    const char *slash = strrchr(path, '/');
    size_t dirlen = slash ? (size_t)(slash - path) : 0;
    if (dirlen + sizeof("/utilization") <= sizeof(gs_util_path)) {
        memcpy(gs_util_path, path, dirlen);
        memcpy(gs_util_path + dirlen, "/utilization", sizeof("/utilization"));
    }

    char err[512];
    int mode = GS_MODE_ACTIVE;
    if (gs_config_load(path, &gs_cfg, err, sizeof(err)) != 0) {
        gs_log("slice config %s is unusable (%s); this process gets no GPU memory (fail closed)", path, err);
        mode = GS_MODE_FAIL_CLOSED;
    } else if (gs_region_open(&gs_reg, &gs_cfg, err, sizeof(err)) != 0) {
        gs_log("%s; this process gets no GPU memory (fail closed)", err);
        mode = GS_MODE_FAIL_CLOSED;
    } else if (gs_table_init(&tab_dptr, 18) != 0 || gs_table_init(&tab_vmm, 14) != 0 || gs_table_init(&tab_map, 16) != 0 ||
               gs_table_init(&tab_array, 14) != 0 || gs_table_init(&tab_pool, 10) != 0 ||
               gs_table_init(&tab_graph, 10) != 0 || gs_table_init(&tab_gexec, 12) != 0) {
        gs_log("cannot map allocation tables; this process gets no GPU memory (fail closed)");
        mode = GS_MODE_FAIL_CLOSED;
    }
    if (mode != GS_MODE_ACTIVE || gs_cfg.compute_share >= 100) atomic_store(&gs_throttle_started, 1);
    pthread_atfork(NULL, NULL, after_fork_child);
    atomic_store_explicit(&gs_mode, mode, memory_order_release);
    pthread_mutex_unlock(&init_lock);
}

/* ------------------------------------------------------------------------------------------------
 * Which devices the slice covers: the one whose UUID is in the config. Memory on any other device
 * is refused while a limit is configured (the tenant holds no slice there).
 * ---------------------------------------------------------------------------------------------- */

static _Atomic signed char dev_state[GS_MAX_DEVICES]; /* 0 unknown, 1 slice, 2 other */
_Atomic int only_device_is_slice;               /* 1: one device, the slice's: skip lookups */

int device_is_slice(CUdevice dev)
{
    if (gs_cfg.memory_bytes == GS_UNLIMITED) return 1;
    if (dev < 0 || dev >= GS_MAX_DEVICES) return 0;
    signed char s = atomic_load_explicit(&dev_state[dev], memory_order_relaxed);
    if (GS_LIKELY(s != 0)) return s == 1;
    CUuuid uuid;
    CUresult rc = CUDA_ERROR_NOT_FOUND;
    if (real_cuDeviceGetUuid_v2) rc = real_cuDeviceGetUuid_v2(&uuid, dev);
    if (rc != CUDA_SUCCESS && real_cuDeviceGetUuid) rc = real_cuDeviceGetUuid(&uuid, dev);
    if (rc != CUDA_SUCCESS) return 0;
    s = memcmp(uuid.bytes, gs_cfg.gpu_uuid, 16) == 0 ? 1 : 2;
    atomic_store_explicit(&dev_state[dev], s, memory_order_relaxed);
    int count = 0;
    if (s == 1 && real_cuDeviceGetCount && real_cuDeviceGetCount(&count) == CUDA_SUCCESS && count == 1)
        atomic_store_explicit(&only_device_is_slice, 1, memory_order_relaxed);
    return s == 1;
}

int current_device(CUdevice *dev)
{
    return real_cuCtxGetDevice != NULL && real_cuCtxGetDevice(dev) == CUDA_SUCCESS ? 0 : -1;
}


_Atomic int pool_slack; /* some stream-ordered pool may hold more than its live allocations */

/* Before refusing: memory pools gave back to the driver may still be charged; settle, then retry. */
CUresult reserve_retry(uint64_t bytes)
{
    if (atomic_load_explicit(&pool_slack, memory_order_relaxed)) {
        pools_settle();
        if (gs_region_reserve(&gs_reg, bytes) == 0) return CUDA_SUCCESS;
    }
    return CUDA_ERROR_OUT_OF_MEMORY;
}



CUresult reserve_on(CUdevice dev, uint64_t bytes)
{
    int mode = gs_ensure_init();
    if (mode != GS_MODE_ACTIVE) return CUDA_ERROR_OUT_OF_MEMORY;
    if (!device_is_slice(dev)) {
        gs_region_count_refused(&gs_reg);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return gs_region_reserve(&gs_reg, bytes) == 0 ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}



