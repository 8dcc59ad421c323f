/*
 * dlvsym, interposed. A tenant that takes libc's own dlsym by version (dlvsym(libc, "dlsym",
 * "GLIBC_2.34")), or libc's dlvsym and then dlsym through it, would get NVML's and the driver's real
 * entry points past the shim's dlsym (NVML's process lists unfiltered: other tenants' host pids and
 * memory). So a lookup of "dlsym" or "dlvsym", through either function and whatever the handle, gets
 * the shim's own; and a driver entry point found by version is handed out as dlsym would hand it out.
 *
 * This closes the linker's lookup functions (a driver copy dlmopen'ed into a fresh namespace is
 * looked up through them too, and answered by the shim's driver: hook.c), not every way into a
 * library: reading libc's or a copy's symbol table by hand still reaches the real entry points (the
 * in-process bypass the node agent's NVML cross-check is for; see shim/README.md, "Known limits").
 */
#define _GNU_SOURCE
#include "gs_dl.h"

#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <stdint.h>

#include "gs_shim.h"

/* Runs inside sanitizer runtimes' start-up too (see hook.c): not instrumented. */
#define GS_DL_NO_SANITIZE __attribute__((no_sanitize_address, no_sanitize_thread))

/*
 * libc's dlvsym, found in libc's own dynamic symbol table. The shim cannot simply call dlvsym: it
 * exports one, and being linked -Bsymbolic its own references bind to it (a versioned reference
 * too). libc's table is what the loader itself reads.
 */
typedef void *(*dlvsym_fn)(void *, const char *, const char *);
static dlvsym_fn libc_dlvsym;

/* String helpers of its own: sanitizer runtimes intercept strcmp and friends, and this runs before
 * their interceptors are set up. */
GS_DL_NO_SANITIZE static int same(const char *a, const char *b)
{
    while (*a && *a == *b) a++, b++;
    return *a == *b;
}

GS_DL_NO_SANITIZE static int starts_with(const char *s, const char *prefix)
{
    while (*prefix && *s == *prefix) s++, prefix++;
    return *prefix == '\0';
}

GS_DL_NO_SANITIZE static uint32_t gnu_hash(const char *s)
{
    uint32_t h = 5381;
    for (; *s; s++) h = h * 33 + (unsigned char)*s;
    return h;
}

/* Looks `want` up in one object's dynamic symbol table through its GNU hash table. */
GS_DL_NO_SANITIZE static void *lookup(const struct link_map *lm, const char *want)
{
    const ElfW(Sym) *symtab = NULL;
    const char *strtab = NULL;
    const uint32_t *hash = NULL;
    const ElfW(Half) *versym = NULL;
    for (const ElfW(Dyn) *dyn = lm->l_ld; dyn != NULL && dyn->d_tag != DT_NULL; dyn++) {
        /* The loader relocates these in place on most architectures; not on all. */
        ElfW(Addr) p = dyn->d_un.d_ptr < lm->l_addr ? lm->l_addr + dyn->d_un.d_ptr : dyn->d_un.d_ptr;
        if (dyn->d_tag == DT_SYMTAB) symtab = (const ElfW(Sym) *)p;
        else if (dyn->d_tag == DT_STRTAB) strtab = (const char *)p;
        else if (dyn->d_tag == DT_GNU_HASH) hash = (const uint32_t *)p;
        else if (dyn->d_tag == DT_VERSYM) versym = (const ElfW(Half) *)p;
    }
    if (symtab == NULL || strtab == NULL || hash == NULL || hash[0] == 0) return NULL;
    uint32_t nbuckets = hash[0], symoffset = hash[1], bloom_size = hash[2];
    const uint32_t *buckets = (const uint32_t *)((const ElfW(Addr) *)&hash[4] + bloom_size);
    const uint32_t *chain = buckets + nbuckets;
    uint32_t h = gnu_hash(want);
    for (uint32_t i = buckets[h % nbuckets]; i >= symoffset; i++) {
        uint32_t ch = chain[i - symoffset];
        const ElfW(Sym) *sym = &symtab[i];
        /* the default version (not hidden): dlvsym@@GLIBC_2.34 on current glibc */
        if ((h | 1) == (ch | 1) && sym->st_value != 0 && same(strtab + sym->st_name, want) &&
            (versym == NULL || !(versym[i] & 0x8000)))
            return (void *)(lm->l_addr + sym->st_value);
        if (ch & 1) break;
    }
    return NULL;
}

/* The loader's own list of loaded objects (no function call: sanitizer runtimes intercept
 * dl_iterate_phdr, and this runs while they set up). */
GS_DL_NO_SANITIZE static void find_libc_dlvsym(void)
{
    for (const struct link_map *lm = _r_debug.r_map; lm != NULL; lm = lm->l_next) {
        const char *base_name = lm->l_name;
        if (base_name == NULL) continue;
        for (const char *p = lm->l_name; *p; p++)
            if (*p == '/') base_name = p + 1;
        if (!starts_with(base_name, "libc.so")) continue;
        libc_dlvsym = (dlvsym_fn)lookup(lm, "dlvsym");
        return;
    }
}

GS_DL_NO_SANITIZE void *gs_libc_dlvsym(void *handle, const char *symbol, const char *version)
{
    if (__builtin_expect(libc_dlvsym == NULL, 0)) find_libc_dlvsym();
    if (libc_dlvsym == NULL) return NULL; /* then the shim's dlsym passes lookups through unchanged */
    return libc_dlvsym(handle, symbol, version);
}

GS_DL_NO_SANITIZE void *gs_dl_own(const char *symbol)
{
    if (symbol == NULL || symbol[0] != 'd' || symbol[1] != 'l') return NULL;
    if (same(symbol, "dlsym")) return (void *)&dlsym;
    if (same(symbol, "dlvsym")) return (void *)&dlvsym;
    return NULL;
}

/* Every other lookup is a tail call into libc's dlvsym, so RTLD_NEXT keeps meaning "after the
 * caller". */
GS_EXPORT GS_DL_NO_SANITIZE void *dlvsym(void *restrict handle, const char *restrict symbol,
                                         const char *restrict version)
{
    void *own = gs_dl_own(symbol);
    if (own != NULL) return own;
    int driver_name = symbol[0] == 'c' ? symbol[1] == 'u'
                                       : symbol[0] == 'n' && symbol[1] == 'v' && symbol[2] == 'm' && symbol[3] == 'l';
    if (__builtin_expect(libc_dlvsym == NULL, 0)) find_libc_dlvsym();
    if (libc_dlvsym == NULL) return NULL;
    if (handle == RTLD_NEXT || !driver_name) return libc_dlvsym(handle, symbol, version);
    if (libc_dlvsym(handle, symbol, version) == NULL) return NULL;
    return gs_dlsym_driver(handle, symbol);
}
