/*
 * Reaches the driver the way the CUDA runtime does: dlopen("libcuda.so.1"), dlsym for a few entry
 * points, and cuGetProcAddress(_v2) for the rest, per-thread-stream variants included. Not linked
 * against libcuda. Checks that every path ends in the slice's limits.
 *
 *   dl_probe LIMIT [COPY]  (LIMIT 0: no shim expected; print the physical values only)
 *
 * COPY: a copy of libcuda.so.1 under another path; dlopen'd by path it is a second driver object,
 * whose wrapped entry points must still end in the slice's limits (wrapped, never passed through).
 * Run with GPUSLICE_FAKE_PROC_TRAMPOLINES=1, the double's cuGetProcAddress hands out entry points that
 * are not its exported symbols (as real drivers may): the shim must still substitute its wrappers.
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

#include "probe_common.h"

typedef CUresult (*init_t)(unsigned);
typedef CUresult (*dev_get_t)(CUdevice *, int);
typedef CUresult (*retain_t)(CUcontext *, CUdevice);
typedef CUresult (*set_t)(CUcontext);
typedef CUresult (*alloc_t)(CUdeviceptr *, size_t);
typedef CUresult (*free_t)(CUdeviceptr);
typedef CUresult (*info_t)(size_t *, size_t *);
typedef CUresult (*total_t)(size_t *, CUdevice);
typedef CUresult (*async_t)(CUdeviceptr *, size_t, CUstream);
typedef CUresult (*gpa2_t)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
typedef CUresult (*gpa1_t)(const char *, void **, int, cuuint64_t);

static const char *object_of(void *fn)
{
    Dl_info info;
    if (fn == NULL || dladdr(fn, &info) == 0 || info.dli_fname == NULL) return "?";
    const char *slash = strrchr(info.dli_fname, '/');
    return slash ? slash + 1 : info.dli_fname;
}

static int from_shim(void *fn)
{
    return strstr(object_of(fn), "gpuslice") != NULL;
}

int main(int argc, char **argv)
{
    if (argc != 2 && argc != 3) {
        fprintf(stderr, "usage: dl_probe LIMIT [COPY]\n");
        return 2;
    }
    size_t limit = strtoull(argv[1], NULL, 10);
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "FAIL: dlopen libcuda.so.1: %s\n", dlerror());
        return 1;
    }
    init_t cu_init = (init_t)dlsym(h, "cuInit");
    dev_get_t dev_get = (dev_get_t)dlsym(h, "cuDeviceGet");
    retain_t retain = (retain_t)dlsym(h, "cuDevicePrimaryCtxRetain");
    set_t set_current = (set_t)dlsym(h, "cuCtxSetCurrent");
    alloc_t dl_alloc = (alloc_t)dlsym(h, "cuMemAlloc_v2");
    free_t dl_free = (free_t)dlsym(h, "cuMemFree_v2");
    info_t dl_info = (info_t)dlsym(h, "cuMemGetInfo_v2");
    total_t dl_total = (total_t)dlsym(h, "cuDeviceTotalMem_v2");
    gpa2_t gpa2 = (gpa2_t)dlsym(h, "cuGetProcAddress_v2");
    gpa1_t gpa1 = (gpa1_t)dlsym(h, "cuGetProcAddress");
    if (!cu_init || !dev_get || !retain || !set_current || !dl_alloc || !dl_free || !dl_info || !dl_total || !gpa2 ||
        !gpa1) {
        fprintf(stderr, "FAIL: a driver entry point is missing\n");
        return 1;
    }
    CUdevice dev;
    CUcontext ctx;
    EXPECT_RC(cu_init(0), CUDA_SUCCESS);
    EXPECT_RC(dev_get(&dev, 0), CUDA_SUCCESS);
    EXPECT_RC(retain(&ctx, dev), CUDA_SUCCESS);
    EXPECT_RC(set_current(ctx), CUDA_SUCCESS);
    size_t f = 0, t = 0, total = 0;
    EXPECT_RC(dl_info(&f, &t), CUDA_SUCCESS);
    EXPECT_RC(dl_total(&total, dev), CUDA_SUCCESS);
    printf("dlsym cuMemAlloc_v2 from %s\ndlsym meminfo_total=%zu total_mem=%zu\n", object_of((void *)dl_alloc), t, total);
    if (limit == 0) PROBE_DONE("dl_probe (no shim)");

    CHECK(from_shim((void *)dl_alloc), "dlsym(cuMemAlloc_v2) resolved to %s", object_of((void *)dl_alloc));
    CHECK(t == limit && total == limit, "dlsym'd reporting %zu/%zu, expected %zu", t, total, limit);
    CUdeviceptr p = 0, q = 0;
    EXPECT_RC(dl_alloc(&p, limit + 1), CUDA_ERROR_OUT_OF_MEMORY);

    /* cuGetProcAddress_v2, as CUDA 12/13 runtimes resolve everything. */
    static const struct {
        const char *name;
        cuuint64_t flags;
    } wrapped[] = {
        {"cuMemAlloc", CU_GET_PROC_ADDRESS_DEFAULT},      {"cuMemFree", CU_GET_PROC_ADDRESS_DEFAULT},
        {"cuMemGetInfo", CU_GET_PROC_ADDRESS_DEFAULT},    {"cuDeviceTotalMem", CU_GET_PROC_ADDRESS_DEFAULT},
        {"cuMemAllocManaged", CU_GET_PROC_ADDRESS_DEFAULT}, {"cuMemCreate", CU_GET_PROC_ADDRESS_DEFAULT},
        {"cuArrayCreate", CU_GET_PROC_ADDRESS_DEFAULT},   {"cuIpcOpenMemHandle", CU_GET_PROC_ADDRESS_DEFAULT},
        {"cuLaunchKernel", CU_GET_PROC_ADDRESS_DEFAULT},  {"cuLaunchKernel", CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM},
        {"cuMemAllocAsync", CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM},
        {"cuGraphLaunch", CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM},
        {"cuGetProcAddress", CU_GET_PROC_ADDRESS_DEFAULT},
        /* Wrapped entry points the shim once could not place and refused (CUDA_ERROR_NOT_FOUND). */
        {"cuGraphInstantiateWithParams", CU_GET_PROC_ADDRESS_DEFAULT},
        {"cuGraphInstantiateWithParams", CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM},
        {"cuLaunch", CU_GET_PROC_ADDRESS_DEFAULT},
        {"cuLaunchGrid", CU_GET_PROC_ADDRESS_DEFAULT},
        {"cuLaunchGridAsync", CU_GET_PROC_ADDRESS_DEFAULT},
    };
    for (size_t i = 0; i < sizeof(wrapped) / sizeof(wrapped[0]); i++) {
        void *fn = NULL;
        CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        EXPECT_RC(gpa2(wrapped[i].name, &fn, 12000, wrapped[i].flags, &st), CUDA_SUCCESS);
        CHECK(st == CU_GET_PROC_ADDRESS_SUCCESS, "%s status %d", wrapped[i].name, (int)st);
        CHECK(from_shim(fn), "cuGetProcAddress_v2(%s, flags=%llu) resolved to %s", wrapped[i].name,
              (unsigned long long)wrapped[i].flags, object_of(fn));
    }
    void *fn = NULL;
    CUdriverProcAddressQueryResult st;
    EXPECT_RC(gpa2("cuNoSuchFunction", &fn, 12000, 0, &st), CUDA_ERROR_NOT_FOUND);
    CHECK(st == CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND, "unknown symbol status %d", (int)st);
    EXPECT_RC(gpa2("cuMemAllocAsync", &fn, 11000, 0, &st), CUDA_ERROR_NOT_FOUND);
    CHECK(st == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT, "too-old version status %d", (int)st);

    alloc_t pa = NULL;
    info_t pinfo = NULL;
    async_t pasync = NULL;
    gpa2(("cuMemAlloc"), (void **)&pa, 12000, 0, NULL);
    gpa2(("cuMemGetInfo"), (void **)&pinfo, 12000, 0, NULL);
    gpa2(("cuMemAllocAsync"), (void **)&pasync, 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, NULL);
    EXPECT_RC(pinfo(&f, &t), CUDA_SUCCESS);
    CHECK(t == limit && f == limit, "procaddr meminfo %zu/%zu, expected %zu", f, t, limit);
    EXPECT_RC(pa(&p, limit), CUDA_SUCCESS);
    EXPECT_RC(pa(&q, 1), CUDA_ERROR_OUT_OF_MEMORY);
    EXPECT_RC(pasync(&q, 1, NULL), CUDA_ERROR_OUT_OF_MEMORY);
    EXPECT_RC(dl_free(p), CUDA_SUCCESS);
    EXPECT_RC(pasync(&q, limit, NULL), CUDA_SUCCESS);
    EXPECT_RC(dl_alloc(&p, 1), CUDA_ERROR_OUT_OF_MEMORY);
    EXPECT_RC(dl_free(q), CUDA_SUCCESS);
    /* q came from the device's pool, which keeps it until a synchronization releases it. */
    CUresult (*sync)(void) = (CUresult(*)(void))dlsym(h, "cuCtxSynchronize");
    EXPECT_RC(sync ? sync() : CUDA_ERROR_NOT_FOUND, CUDA_SUCCESS);

    /* The legacy cuGetProcAddress (CUDA 11.3+ runtimes). */
    alloc_t pa1 = NULL;
    EXPECT_RC(gpa1("cuMemAlloc", (void **)&pa1, 11030, 0), CUDA_SUCCESS);
    CHECK(from_shim((void *)pa1), "cuGetProcAddress(cuMemAlloc) resolved to %s", object_of((void *)pa1));
    EXPECT_RC(pa1(&p, limit + 1), CUDA_ERROR_OUT_OF_MEMORY);
    EXPECT_RC(pinfo(&f, &t), CUDA_SUCCESS);
    CHECK(f == limit, "free %zu at the end, expected %zu", f, limit);

    /* The names a runtime reaches graph memory by: cuGraphInstantiate is served by
     * cuGraphInstantiateWithFlags from CUDA 12.0 (an alias of another entry point's function). Whatever
     * the driver hands out, a 6 GiB memory node is charged at the first launch, so a following
     * cuMemAlloc of 6 GiB on the 8 GiB slice is refused. */
    if (limit >= ((size_t)8 << 30)) {
        typedef CUresult (*inst_t)(CUgraphExec *, CUgraph, unsigned long long);
        typedef CUresult (*instp_t)(CUgraphExec *, CUgraph, CUDA_GRAPH_INSTANTIATE_PARAMS *);
        CUresult (*g_create)(CUgraph *, unsigned) = (CUresult(*)(CUgraph *, unsigned))dlsym(h, "cuGraphCreate");
        CUresult (*g_add)(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUDA_MEM_ALLOC_NODE_PARAMS *) =
            (CUresult(*)(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUDA_MEM_ALLOC_NODE_PARAMS *))dlsym(
                h, "cuGraphAddMemAllocNode");
        CUresult (*g_launch)(CUgraphExec, CUstream) = (CUresult(*)(CUgraphExec, CUstream))dlsym(h, "cuGraphLaunch");
        CUresult (*g_exec_destroy)(CUgraphExec) = (CUresult(*)(CUgraphExec))dlsym(h, "cuGraphExecDestroy");
        CUresult (*g_destroy)(CUgraph) = (CUresult(*)(CUgraph))dlsym(h, "cuGraphDestroy");
        CUresult (*g_trim)(CUdevice) = (CUresult(*)(CUdevice))dlsym(h, "cuDeviceGraphMemTrim");
        CHECK(g_create && g_add && g_launch && g_exec_destroy && g_destroy && g_trim, "graph entry points missing");
        static const struct {
            const char *name;
            int version;
            cuuint64_t flags;
        } inst[] = {
            {"cuGraphInstantiate", 12000, CU_GET_PROC_ADDRESS_DEFAULT},
            {"cuGraphInstantiateWithFlags", 11040, CU_GET_PROC_ADDRESS_DEFAULT},
            {"cuGraphInstantiateWithParams", 12000, CU_GET_PROC_ADDRESS_DEFAULT},
            {"cuGraphInstantiateWithParams", 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM},
        };
        size_t six = (size_t)6 << 30;
        for (size_t i = 0; g_create && g_add && g_launch && g_exec_destroy && g_destroy && g_trim &&
                           i < sizeof(inst) / sizeof(inst[0]);
             i++) {
            void *pf = NULL;
            CUresult grc = gpa2(inst[i].name, &pf, inst[i].version, inst[i].flags, NULL);
            if (grc == CUDA_ERROR_NOT_FOUND && !from_shim((void *)gpa2)) continue; /* no shim: nothing to check */
            if (grc != CUDA_SUCCESS) {
                /* Refused: by the driver (it does not have the entry point) or by the shim. */
                void *raw = dlsym(h, inst[i].name);
                CHECK(raw == NULL, "cuGetProcAddress(%s, %d, flags=%llu) refused (%d)", inst[i].name,
                      inst[i].version, (unsigned long long)inst[i].flags, (int)grc);
                continue;
            }
            CHECK(from_shim(pf), "cuGetProcAddress(%s, %d, flags=%llu) resolved to %s, not the shim", inst[i].name,
                  inst[i].version, (unsigned long long)inst[i].flags, object_of(pf));
            CUgraph g = NULL;
            CUgraphNode node = NULL;
            CUgraphExec exec = NULL;
            CUDA_MEM_ALLOC_NODE_PARAMS mp = {0};
            mp.poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
            mp.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
            mp.poolProps.location.id = dev;
            mp.bytesize = six;
            EXPECT_RC(g_create(&g, 0), CUDA_SUCCESS);
            EXPECT_RC(g_add(&node, g, NULL, 0, &mp), CUDA_SUCCESS);
            if (strcmp(inst[i].name, "cuGraphInstantiateWithParams") == 0) {
                CUDA_GRAPH_INSTANTIATE_PARAMS ip = {0};
                EXPECT_RC(((instp_t)pf)(&exec, g, &ip), CUDA_SUCCESS);
            } else {
                EXPECT_RC(((inst_t)pf)(&exec, g, 0), CUDA_SUCCESS);
            }
            EXPECT_RC(g_launch(exec, NULL), CUDA_SUCCESS);
            EXPECT_RC(sync ? sync() : CUDA_ERROR_NOT_FOUND, CUDA_SUCCESS);
            CUresult arc = dl_alloc(&p, six);
            CHECK(arc == CUDA_ERROR_OUT_OF_MEMORY,
                  "%s (%s, flags=%llu): 6 GiB graph memory node not charged: cuMemAlloc(6 GiB) returned %d",
                  inst[i].name, object_of(pf), (unsigned long long)inst[i].flags, (int)arc);
            if (arc == CUDA_SUCCESS) dl_free(p);
            EXPECT_RC(g_exec_destroy(exec), CUDA_SUCCESS);
            EXPECT_RC(g_destroy(g), CUDA_SUCCESS);
            EXPECT_RC(g_trim(dev), CUDA_SUCCESS);
            EXPECT_RC(pinfo(&f, &t), CUDA_SUCCESS);
            CHECK(f == limit, "free %zu after the graph's memory was trimmed, expected %zu", f, limit);
        }
    }

    if (argc == 3) { /* a second copy of the driver, opened by another path */
        void *copy = dlopen(argv[2], RTLD_NOW | RTLD_LOCAL);
        CHECK(copy != NULL && copy != h, "dlopen %s: %s", argv[2], copy ? "same object" : dlerror());
        if (copy != NULL) {
            alloc_t c_alloc = (alloc_t)dlsym(copy, "cuMemAlloc_v2");
            free_t c_free = (free_t)dlsym(copy, "cuMemFree_v2");
            gpa2_t c_gpa2 = (gpa2_t)dlsym(copy, "cuGetProcAddress_v2");
            CHECK(c_alloc && from_shim((void *)c_alloc), "the copy's cuMemAlloc_v2 resolved to %s",
                  object_of((void *)c_alloc));
            CHECK(c_gpa2 && from_shim((void *)c_gpa2), "the copy's cuGetProcAddress_v2 resolved to %s",
                  object_of((void *)c_gpa2));
            if (c_alloc && c_free) {
                EXPECT_RC(c_alloc(&p, limit + 1), CUDA_ERROR_OUT_OF_MEMORY);
                EXPECT_RC(c_alloc(&p, limit), CUDA_SUCCESS);
                EXPECT_RC(dl_alloc(&q, 1), CUDA_ERROR_OUT_OF_MEMORY);
                EXPECT_RC(c_free(p), CUDA_SUCCESS);
            }
            if (c_gpa2) {
                alloc_t cpa = NULL;
                EXPECT_RC(c_gpa2("cuMemAlloc", (void **)&cpa, 12000, 0, NULL), CUDA_SUCCESS);
                CHECK(cpa && from_shim((void *)cpa), "the copy's cuGetProcAddress(cuMemAlloc) gave %s",
                      object_of((void *)cpa));
            }
        }
    }
    PROBE_DONE("dl_probe");
}
