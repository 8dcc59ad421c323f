/*
 * Module-scope variables of a kernel image: what the driver backs with device memory when it loads
 * a module, and what cuModuleGetGlobal / cuLibraryGetGlobal find by name. Self-contained (libc
 * only), no allocation.
 *
 * Cubin (CUDA ELF): every defined STT_OBJECT symbol (global or local: `static __device__` variables
 * are found too) in a section named .nv.global (__device__ without an initializer: SHT_NOBITS,
 * zeros), .nv.global.init (__device__ with one: its bytes) or .nv.constantN (__constant__: bank N,
 * its bytes); st_value is the offset in its section, st_size the variable's size. Shared and local
 * memory (.nv.shared.*, .nv.local.*) is per block / per thread, not module memory.
 * PTX: the module-scope `.global` and `.const` declarations that define a variable (not `.extern`):
 * `[.visible|.weak|.common] .global [.attribute(.managed)] [.align N] [.v2|.v4] .TYPE name[N]...
 * [= initializer];`, sized element size x vector x dimensions (an unsized `[]` from its initializer).
 */
#ifndef GS_IMAGE_GLOBALS_H
#define GS_IMAGE_GLOBALS_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    char name[256];
    uint64_t size;
    uint64_t align;
    int constant;         /* in a constant bank (__constant__ / .const) */
    int managed;          /* PTX `.attribute(.managed)`: __managed__ */
    const void *init;     /* cubin: `size` initial bytes inside the image; NULL: zeros (or PTX text below) */
    const char *ptx_init; /* PTX: the initializer's text after '=' (to ';', in a NUL-terminated text); NULL: zeros */
    unsigned elem;        /* PTX: bytes per element */
    char elem_kind;       /* PTX: 'f' for floating point, 'i' otherwise */
} image_global;

/* Reads up to `max` variables of a cubin into `out` (may be NULL with max 0); returns how many it has
 * (may exceed max), -1 if it is not a readable CUDA ELF. */
int cubin_globals(const void *elf, size_t size, image_global *out, int max);

/* The same for a PTX text of `size` bytes. */
int ptx_globals(const char *ptx, size_t size, image_global *out, int max);

/* Where a variable goes when the module's variables are laid out one after another from offset `at`
 * (its alignment, 8 when it has none or an odd one); the driver double lays them out so, and the shim
 * charges a slice the same total. */
uint64_t image_global_place(uint64_t at, const image_global *g);

/* The bytes a module's variables take laid out so: what the double charges to the card at its load. */
uint64_t image_globals_bytes(const image_global *g, int n);

/* Writes a PTX variable's initial bytes (g->size of them) into `out`: its initializer's numbers in
 * order (nested braces flattened), zeros past them and for what is not a number (an address such as
 * `generic(x)`: the double does not relocate). */
void ptx_global_init(const image_global *g, void *out);

#endif
