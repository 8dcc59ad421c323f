/*
 * Replays a list of cuGetProcAddress queries (the ones a CUDA runtime makes, recorded from the library)
 * against whatever libcuda.so.1 the loader finds, through whatever is preloaded, and prints one line
 * per query:
 *
 *   NAME VERSION FLAGS RC STATUS SYMBOL OBJECT
 *
 * SYMBOL and OBJECT name the exported symbol and the file the returned pointer lies in (dladdr; "-"
 * when none). Run once on the bare double without internal pointers (the oracle: which variant the
 * driver serves), once under the shim with them: tests/shim/test_proc_replay.py compares the two.
 *
 *   proc_replay LIST DEFAULT_VERSION
 *
 * LIST: one query a line, "NAME [VERSION [FLAGS]]", '#' starts a comment; DEFAULT_VERSION stands in
 * for a missing VERSION, flags default to 0 (CU_GET_PROC_ADDRESS_DEFAULT).
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef CUresult (*gpa2_t)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);

static void where(void *fn, const char **sym, const char **obj)
{
    Dl_info info;
    *sym = "-";
    *obj = "-";
    if (fn == NULL || dladdr(fn, &info) == 0) return;
    if (info.dli_fname != NULL) {
        const char *slash = strrchr(info.dli_fname, '/');
        *obj = slash ? slash + 1 : info.dli_fname;
    }
    if (info.dli_sname != NULL && info.dli_saddr == fn) *sym = info.dli_sname; /* exactly a symbol */
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: proc_replay LIST DEFAULT_VERSION\n");
        return 2;
    }
    FILE *in = fopen(argv[1], "r");
    if (in == NULL) {
        perror(argv[1]);
        return 2;
    }
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    gpa2_t gpa2 = h ? (gpa2_t)dlsym(h, "cuGetProcAddress_v2") : NULL;
    if (gpa2 == NULL) {
        fprintf(stderr, "proc_replay: no cuGetProcAddress_v2 in libcuda.so.1: %s\n", h ? "missing" : dlerror());
        return 2;
    }
    char line[512];
    int n = 0;
    while (fgets(line, sizeof line, in) != NULL) {
        char *hash = strchr(line, '#');
        if (hash) *hash = '\0';
        char name[256];
        int version = atoi(argv[2]);
        unsigned long long flags = 0;
        if (sscanf(line, "%255s %d %llu", name, &version, &flags) < 1) continue;
        void *fn = NULL;
        CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        CUresult rc = gpa2(name, &fn, version, (cuuint64_t)flags, &st);
        const char *sym, *obj;
        where(rc == CUDA_SUCCESS ? fn : NULL, &sym, &obj);
        printf("%s %d %llu %d %d %s %s\n", name, version, flags, (int)rc, (int)st, sym, obj);
        n++;
    }
    fclose(in);
    fprintf(stderr, "proc_replay: %d queries\n", n);
    return 0;
}
