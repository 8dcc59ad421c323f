/*
 * cuGetProcAddress(_v2) of the fake libcuda.so.1, answered as a real driver of the simulated CUDA
 * version answers (`cuda_driver_version` in the GPU description):
 *
 *   - from src/gs_procs.h, the newest variant of the name not above the requested version and not
 *     newer than the driver; the per-thread-default-stream variant with that flag;
 *   - a name the driver knows only in variants newer than the request: CUDA_ERROR_NOT_FOUND with
 *     CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT; a name it does not know (or that is newer than the
 *     driver): CUDA_ERROR_NOT_FOUND with CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
 *   - like real drivers, internal entry points, not the exported symbols: each entry has a stub of
 *     its own that jumps to the function (a distinct address that behaves the same).
 *     GPUSLICE_FAKE_PROC_TRAMPOLINES=0 hands out the exported symbols instead.
 *
 * GPUSLICE_FAKE_PROC_LOG=<file> appends one line per lookup: name, version, flags, result, status
 * and "stub" for an entry point the double does not model (cuda_stubs.c). No cuda.h here: every
 * entry point is declared alike below, including those newer than the headers the double builds with.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fake_common.h"
#include "../src/gs_procs.h"

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_NOT_FOUND 500
#define PER_THREAD_DEFAULT_STREAM 2 /* CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM */
enum { ST_SUCCESS = 0, ST_SYMBOL_NOT_FOUND = 1, ST_VERSION_NOT_SUFFICIENT = 2 };

int fake_is_stub(const void *fn);

#define DECL(base, since, fn) extern char procsym_##fn[] __asm__(#fn);
#define DECL_PTSZ(base, since, fn, ptsz) DECL(base, since, fn) DECL(base, since, ptsz)
GS_DRIVER_PROCS_UNIQUE(DECL, DECL_PTSZ)

typedef struct {
    const char *base;
    int since; /* first CUDA version (1000*major + 10*minor) this variant serves */
    void *fn, *ptsz;
} proc_entry;

#define P_ENTRY(base, since, fn) {#base, since, (void *)procsym_##fn, NULL},
#define P_ENTRY_PTSZ(base, since, fn, ptsz) {#base, since, (void *)procsym_##fn, (void *)procsym_##ptsz},
static const proc_entry procs[] = {GS_DRIVER_PROCS(P_ENTRY, P_ENTRY_PTSZ)};
#define NPROCS (sizeof(procs) / sizeof(procs[0]))

#define T_STUB(name) ".text\n.p2align 4\nfake_tramp_" #name ":\n\tjmp " #name "\n"
#define T_ASM(base, since, fn) __asm__(T_STUB(fn));
#define T_ASM_PTSZ(base, since, fn, ptsz) __asm__(T_STUB(fn) T_STUB(ptsz));
#define T_DECL(base, since, fn) extern char fake_tramp_##fn[] __attribute__((visibility("hidden")));
#define T_DECL_PTSZ(base, since, fn, ptsz) T_DECL(base, since, fn) T_DECL(base, since, ptsz)
GS_DRIVER_PROCS_UNIQUE(T_ASM, T_ASM_PTSZ)
GS_DRIVER_PROCS_UNIQUE(T_DECL, T_DECL_PTSZ)

/* With GPUSLICE_FAKE_TRACE=2 every entry point handed out logs its name on stderr before it runs
 * (a debugging aid: which driver calls a runtime makes). The argument registers are saved around the
 * log call; the stack is 16-byte aligned at the call. */
#define L_STUB(name)                                                                                   \
    ".text\n.p2align 4\nfake_trace_" #name ":\n"                                                     \
    "\tpush %rdi\n\tpush %rsi\n\tpush %rdx\n\tpush %rcx\n\tpush %r8\n\tpush %r9\n\tpush %rax\n"        \
    "\tlea fake_trace_name_" #name "(%rip), %rdi\n\tcall fake_trace_log\n"                            \
    "\tpop %rax\n\tpop %r9\n\tpop %r8\n\tpop %rcx\n\tpop %rdx\n\tpop %rsi\n\tpop %rdi\n"             \
    "\tjmp " #name "\n"                                                                               \
    ".section .rodata\nfake_trace_name_" #name ":\n\t.asciz \"" #name "\"\n.text\n"
#define L_ASM(base, since, fn) __asm__(L_STUB(fn));
#define L_ASM_PTSZ(base, since, fn, ptsz) __asm__(L_STUB(fn) L_STUB(ptsz));
#define L_DECL(base, since, fn) extern char fake_trace_##fn[] __attribute__((visibility("hidden")));
#define L_DECL_PTSZ(base, since, fn, ptsz) L_DECL(base, since, fn) L_DECL(base, since, ptsz)
GS_DRIVER_PROCS_UNIQUE(L_ASM, L_ASM_PTSZ)
GS_DRIVER_PROCS_UNIQUE(L_DECL, L_DECL_PTSZ)

__attribute__((visibility("hidden"), used)) void fake_trace_log(const char *name)
{
    char line[160];
    int n = snprintf(line, sizeof(line), "fake NVIDIA driver: call %s\n", name);
    if (n > 0 && write(2, line, (size_t)n) < 0) {
    }
}

static int trace_calls(void)
{
    static int state; /* 0 unknown, 1 no, 2 yes */
    if (state == 0) {
        const char *v = getenv("GPUSLICE_FAKE_TRACE");
        state = v && strcmp(v, "2") == 0 ? 2 : 1;
    }
    return state == 2;
}

/* What an entry point is handed out as instead of its symbol: its trampoline, or its tracing stub. */
typedef struct {
    void *fn, *tramp, *traced;
} proc_stubs;

static const proc_stubs *stubs_of(void *fn)
{
    static const proc_stubs map[] = {
#define S_ENTRY(base, since, fn) {(void *)procsym_##fn, fake_tramp_##fn, fake_trace_##fn},
#define S_ENTRY_PTSZ(base, since, fn, ptsz) S_ENTRY(base, since, fn) S_ENTRY(base, since, ptsz)
        GS_DRIVER_PROCS_UNIQUE(S_ENTRY, S_ENTRY_PTSZ)};
    for (size_t i = 0; i < sizeof(map) / sizeof(map[0]); i++)
        if (map[i].fn == fn) return &map[i];
    return NULL;
}

static int use_trampolines(void)
{
    static int state; /* 0 unknown, 1 no, 2 yes */
    if (state == 0) {
        const char *v = getenv("GPUSLICE_FAKE_PROC_TRAMPOLINES");
        state = v && strcmp(v, "0") == 0 ? 1 : 2;
    }
    return state == 2;
}

static void log_lookup(const char *symbol, int version, unsigned long long flags, int rc, int status, const void *fn)
{
    static int fd = -2;
    static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&lock);
    if (fd == -2) {
        const char *path = getenv("GPUSLICE_FAKE_PROC_LOG");
        fd = path && *path ? open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644) : -1;
    }
    if (fd >= 0) {
        char line[512];
        int n = snprintf(line, sizeof(line), "%s\t%d\t%llu\t%d\t%d%s\n", symbol, version, flags, rc, status,
                         fn && fake_is_stub(fn) ? "\tstub" : "");
        if (n > 0 && write(fd, line, (size_t)n) < 0) {
        }
    }
    pthread_mutex_unlock(&lock);
}

__attribute__((visibility("default"))) int cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                                               unsigned long long flags, int *status)
{
    if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
    fake_system *s = fake_system_get();
    int driver = s ? s->cuda_driver_version : 12020;
    const proc_entry *best = NULL;
    int known = 0;
    for (size_t i = 0; i < NPROCS; i++) {
        if (strcmp(procs[i].base, symbol) != 0 || procs[i].since > driver) continue;
        known = 1;
        if (procs[i].since <= cudaVersion && (!best || procs[i].since > best->since)) best = &procs[i];
    }
    *pfn = NULL;
    if (!best) {
        int st = known ? ST_VERSION_NOT_SUFFICIENT : ST_SYMBOL_NOT_FOUND;
        if (status) *status = st;
        log_lookup(symbol, cudaVersion, flags, CUDA_ERROR_NOT_FOUND, st, NULL);
        return CUDA_ERROR_NOT_FOUND;
    }
    void *fn = (flags & PER_THREAD_DEFAULT_STREAM) && best->ptsz ? best->ptsz : best->fn;
    log_lookup(symbol, cudaVersion, flags, CUDA_SUCCESS, ST_SUCCESS, fn);
    int trace = trace_calls();
    const proc_stubs *stub = trace || use_trampolines() ? stubs_of(fn) : NULL;
    *pfn = !stub ? fn : trace ? stub->traced : stub->tramp;
    if (status) *status = ST_SUCCESS;
    return CUDA_SUCCESS;
}

__attribute__((visibility("default"))) int cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion,
                                                            unsigned long long flags)
{
    return cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, NULL);
}
