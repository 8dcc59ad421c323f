/*
 * Symbol resolution: the real driver and NVML entry points (through the shim's own handles, never
 * RTLD_NEXT), the dlsym override, and cuGetProcAddress(_v2), which hand out the shim's wrappers.
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

#include "../gs_dl.h"
#include "../gs_procs.h"

/* ------------------------------------------------------------------------------------------------
 * Real entry points
 * ---------------------------------------------------------------------------------------------- */


#define GS_DEFINE_REAL(name) __typeof__(&name) real_##name;
GS_CUDA_WRAPPED(GS_DEFINE_REAL)
GS_CUDA_HELPERS(GS_DEFINE_REAL)
GS_NVML_WRAPPED(GS_DEFINE_REAL)
GS_NVML_HELPERS(GS_DEFINE_REAL)

#define GS_SYM_WRAPPED(name) {#name, (void *)&name, (void **)&real_##name},
#define GS_SYM_HELPER(name) {#name, NULL, (void **)&real_##name},
static gs_sym cuda_syms[] = {GS_CUDA_WRAPPED(GS_SYM_WRAPPED) GS_CUDA_HELPERS(GS_SYM_HELPER)};
static gs_sym nvml_syms[] = {GS_NVML_WRAPPED(GS_SYM_WRAPPED) GS_NVML_HELPERS(GS_SYM_HELPER)};
#define GS_NSYMS(a) (sizeof(a) / sizeof((a)[0]))

typedef void *(*dlsym_fn)(void *, const char *);
static dlsym_fn real_dlsym;
static void *cuda_handle, *nvml_handle;
_Atomic int gs_cuda_ready, gs_nvml_ready;
static pthread_mutex_t resolve_lock = PTHREAD_MUTEX_INITIALIZER;

/* dlsym runs inside sanitizer runtimes' own start-up, before their shadow memory exists: the code on
 * that path must not be instrumented. */
#define GS_NO_SANITIZE __attribute__((no_sanitize_address, no_sanitize_thread))

GS_NO_SANITIZE static void find_real_dlsym(void)
{
    if (real_dlsym) return;
    /* glibc >= 2.34 versions dlsym GLIBC_2.34; older ones GLIBC_2.2.5. */
    real_dlsym = (dlsym_fn)gs_libc_dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (!real_dlsym) real_dlsym = (dlsym_fn)gs_libc_dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
}

__attribute__((constructor)) static void gs_constructor(void)
{
    find_real_dlsym();
}

/* Resolves a library's real entry points once. With load=0 only an already-loaded library is used
 * (dlsym must not pull the driver into processes that merely look up a "cu" name). The loader is
 * called outside any lock of ours: dlopen/dlsym take the loader's lock, and a library constructor
 * running under it may itself call dlsym, so holding our lock across them could deadlock. */
#define GS_MAX_SYMS 128
static int resolve_lib(const char *soname, void **handle, gs_sym *syms, size_t n, _Atomic int *ready, int load)
{
    if (atomic_load_explicit(ready, memory_order_acquire)) return 0;
    find_real_dlsym();
    if (real_dlsym == NULL || n > GS_MAX_SYMS) return -1;
    void *h = dlopen(soname, RTLD_NOW | RTLD_LOCAL | (load ? 0 : RTLD_NOLOAD));
    if (h == NULL) return -1;
    void *found[GS_MAX_SYMS];
    for (size_t i = 0; i < n; i++) found[i] = real_dlsym(h, syms[i].name);
    pthread_mutex_lock(&resolve_lock);
    if (!atomic_load(ready)) {
        *handle = h;
        for (size_t i = 0; i < n; i++) *syms[i].real = found[i];
        atomic_store_explicit(ready, 1, memory_order_release);
    } else {
        dlclose(h); /* another thread published first; drop our extra reference */
    }
    pthread_mutex_unlock(&resolve_lock);
    return 0;
}

int gs_cuda_resolve(void)
{
    return resolve_lib("libcuda.so.1", &cuda_handle, cuda_syms, GS_NSYMS(cuda_syms), &gs_cuda_ready, 1);
}

int gs_nvml_resolve(void)
{
    return resolve_lib("libnvidia-ml.so.1", &nvml_handle, nvml_syms, GS_NSYMS(nvml_syms), &gs_nvml_ready, 1);
}

void gs_hook_after_fork_child(void)
{
    pthread_mutex_init(&resolve_lock, NULL);
}

void *gs_real_nvml(const char *name)
{
    if (nvml_real() != 0) return NULL;
    return real_dlsym(nvml_handle, name);
}

/* Maps a real driver entry point to the shim's wrapper for it; anything else is returned as is. */
static void *substitute(void *fn, gs_sym *syms, size_t n)
{
    if (fn == NULL) return NULL;
    for (size_t i = 0; i < n; i++)
        if (syms[i].wrapper != NULL && *syms[i].real == fn) return syms[i].wrapper;
    return fn;
}

/* The shim's wrapper for an entry point named `name`, NULL when it wraps none by that name. */
static void *wrapper_named(const char *name, gs_sym *syms, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (syms[i].wrapper != NULL && strcmp(syms[i].name, name) == 0) return syms[i].wrapper;
    return NULL;
}

typedef struct {
    const char *base;
    int since;
    const char *fn, *ptsz;
} gs_proc;
#define GS_PROC(base, since, fn) {#base, since, #fn, NULL},
#define GS_PROC_PTSZ(base, since, fn, ptsz) {#base, since, #fn, #ptsz},

/* Generated from NVIDIA's headers (tools/gen_procs.py): every variant of every name, aliases included. */
static const gs_proc procs[] = {GS_DRIVER_PROCS(GS_PROC, GS_PROC_PTSZ)};
#define GS_NPROCS (sizeof(procs) / sizeof(procs[0]))

/* A wrapper the shim holds under `name` by the naming convention alone (cuMemAlloc: cuMemAlloc_v2,
 * cuLaunchKernel: cuLaunchKernel_ptsz), for names the list does not place: the exact name, its per-thread
 * variant when asked for, else its newest _vN. NULL when the shim wraps nothing by that name. */
static void *wrapper_by_convention(const char *base, cuuint64_t flags)
{
    size_t n = strlen(base);
    void *exact = NULL, *ptsz = NULL, *newest = NULL;
    int newest_v = -1;
    for (size_t i = 0; i < GS_NSYMS(cuda_syms); i++) {
        const char *w = cuda_syms[i].name;
        if (cuda_syms[i].wrapper == NULL || strncmp(w, base, n) != 0) continue;
        if (w[n] == '\0') exact = cuda_syms[i].wrapper;
        else if (strcmp(w + n, "_ptsz") == 0) ptsz = cuda_syms[i].wrapper;
        else if (w[n] == '_' && w[n + 1] == 'v' && atoi(w + n + 2) > newest_v) {
            newest_v = atoi(w + n + 2);
            newest = cuda_syms[i].wrapper;
        }
    }
    if ((flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) && ptsz) return ptsz;
    return newest ? newest : exact;
}

/*
 * cuGetProcAddress handed out a pointer that is not the driver's exported symbol of any wrapped
 * variant (real drivers hand out internal entry points). Decide by name which variant the caller got
 * for (symbol, cudaVersion, flags) and return the shim's wrapper for it. A wrapped entry point is never
 * refused: where the list holds the name, the variant it names is wrapped or needs no wrapper (it is
 * passed through); where it does not (a driver newer than the list), the shim's wrapper by naming convention stands in for it.
 */
static void procaddr_by_name(const char *symbol, void **pfn, int version, cuuint64_t flags)
{
    if (symbol == NULL) return;
    /* A driver serves no variant newer than itself: a 12.2 driver asked for cuGraphAddNode at 12030
     * hands out the 12020 variant, whose arguments differ. */
    static _Atomic int driver_version;
    int dv = atomic_load_explicit(&driver_version, memory_order_relaxed);
    if (dv == 0) {
        if (real_cuDriverGetVersion == NULL || real_cuDriverGetVersion(&dv) != CUDA_SUCCESS || dv <= 0) dv = -1;
        atomic_store_explicit(&driver_version, dv, memory_order_relaxed);
    }
    if (dv > 0 && dv < version) version = dv;
    const gs_proc *best = NULL, *oldest = NULL;
    for (size_t i = 0; i < GS_NPROCS; i++) {
        const gs_proc *e = &procs[i];
        if (strcmp(e->base, symbol) != 0) continue;
        if (oldest == NULL || e->since < oldest->since) oldest = e;
        if (e->since <= version && (best == NULL || e->since > best->since)) best = e;
    }
    /* A driver that serves a version the list says is too old for the name: the oldest variant. */
    if (best == NULL) best = oldest;
    if (best != NULL) {
        const char *name = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) && best->ptsz ? best->ptsz : best->fn;
        void *w = wrapper_named(name, cuda_syms, GS_NSYMS(cuda_syms));
        if (w != NULL) *pfn = w;
        return; /* else a variant the shim has no business with: the driver's pointer stands */
    }
    void *w = wrapper_by_convention(symbol, flags);
    if (w != NULL) {
        gs_log("cuGetProcAddress(%s, %d): the list does not place this name; handing out the shim's wrapper by its name",
               symbol, version);
        *pfn = w;
    }
}

/* A wrapped name that resolves to something other than the driver's own symbol comes from another
 * copy of the driver (a copied libcuda.so.1 opened by path, a bundled libnvidia-ml): the caller gets
 * the shim's wrapper, which calls the driver the shim enforces over, never the copy unwrapped. */
void *gs_dlsym_driver(void *handle, const char *symbol)
{
    void *fn = real_dlsym(handle, symbol);
    if (fn == NULL) return NULL;
    int cuda = symbol[0] == 'c';
    gs_sym *syms = cuda ? cuda_syms : nvml_syms;
    size_t n = cuda ? GS_NSYMS(cuda_syms) : GS_NSYMS(nvml_syms);
    void *w = wrapper_named(symbol, syms, n);
    if (fn == w) return fn; /* the shim's own export */
    /* A name the shim does not wrap, from an object that is no driver (libcups' cups*): as it is,
     * and without loading the driver. */
    if (w == NULL && real_dlsym(handle, cuda ? "cuInit" : "nvmlInit_v2") == NULL) return fn;
    /* Load our driver if needed: the wrapper must have a real entry point to call. */
    if (cuda) (void)resolve_lib("libcuda.so.1", &cuda_handle, cuda_syms, n, &gs_cuda_ready, 1);
    else (void)resolve_lib("libnvidia-ml.so.1", &nvml_handle, nvml_syms, n, &gs_nvml_ready, 1);
    if (w != NULL) return w;
    /* Not wrapped, from a driver: from ours as it is; from another copy (dlmopen into a fresh
     * namespace) ours answers it too, as the wrappers do, so the caller has one driver, not the
     * copy's cuInit beside our cuCtxCreate (the copy's state never initialized, or ours). */
    void *own = cuda ? cuda_handle : nvml_handle;
    void *mine = own != NULL ? real_dlsym(own, symbol) : NULL;
    return mine != NULL ? mine : fn;
}

/* Every other lookup is a tail call into the real dlsym, so glibc sees the application's return
 * address: RTLD_NEXT keeps meaning "after the caller", not "after the shim". */
GS_EXPORT GS_NO_SANITIZE void *dlsym(void *restrict handle, const char *restrict symbol)
{
    if (__builtin_expect(real_dlsym == NULL, 0)) find_real_dlsym();
    int driver_name = symbol[0] == 'c' ? symbol[1] == 'u'
                                       : symbol[0] == 'n' && symbol[1] == 'v' && symbol[2] == 'm' && symbol[3] == 'l';
    if (symbol[0] == 'd') {
        void *own = gs_dl_own(symbol); /* libc's dlsym/dlvsym would be a way around this one */
        if (own != NULL) return own;
    }
    if (handle == RTLD_NEXT || !driver_name) return real_dlsym(handle, symbol);
    return gs_dlsym_driver(handle, symbol);
}

/* ------------------------------------------------------------------------------------------------
 * cuGetProcAddress: whatever the driver hands out for a wrapped entry point becomes the wrapper.
 * ---------------------------------------------------------------------------------------------- */

GS_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                       CUdriverProcAddressQueryResult *symbolStatus)
{
    NEED_REAL(cuGetProcAddress_v2);
    if (GS_UNLIKELY(cudaVersion >= 13000)) gs_module_runtime_version(cudaVersion);
    CUresult rc = real_cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, symbolStatus);
    if (rc == CUDA_SUCCESS && pfn != NULL) {
        void *got = *pfn;
        *pfn = substitute(got, cuda_syms, GS_NSYMS(cuda_syms));
        if (*pfn == got && got != NULL) procaddr_by_name(symbol, pfn, cudaVersion, flags);
    }
    return rc;
}

GS_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    NEED_REAL(cuGetProcAddress);
    if (GS_UNLIKELY(cudaVersion >= 13000)) gs_module_runtime_version(cudaVersion);
    CUresult rc = real_cuGetProcAddress(symbol, pfn, cudaVersion, flags);
    if (rc == CUDA_SUCCESS && pfn != NULL) {
        void *got = *pfn;
        *pfn = substitute(got, cuda_syms, GS_NSYMS(cuda_syms));
        if (*pfn == got && got != NULL) procaddr_by_name(symbol, pfn, cudaVersion, flags);
    }
    return rc;
}

