/*
 * Kernel images as the CUDA driver receives them: fatbin containers, cubins (CUDA ELF) and PTX text.
 * Self-contained (libc only), no allocation unless asked: the driver double uses it to pick the image
 * a device runs, the shim can use it to see what a process loads.
 *
 * Fatbin container (what nvcc embeds in .nv_fatbin and cuModuleLoadData accepts), little-endian:
 *   header  u32 magic 0xBA55ED50, u16 version 1, u16 header size (16), u64 size of the entries
 *   entry   u16 kind (1 PTX, 2 cubin), u16 version, u32 header size, u64 payload size (padded),
 *           u32 compressed size @16, u32 arch (sm: 70 for sm_70 / compute_70) @28,
 *           u64 flags @40 (0x1 64-bit, 0x2000 LZ4-compressed, 0x8000 zstd-compressed),
 *           u64 uncompressed size @56; the payload follows the entry header.
 * A fatbin may be wrapped in __fatBinC_Wrapper_t (u32 magic 0x466243B1, u32 version, then a
 * pointer to the fatbin): what nvcc's registration code hands the runtime.
 */
#ifndef GS_FATBIN_H
#define GS_FATBIN_H

#include <stddef.h>
#include <stdint.h>

#define FATBIN_MAGIC 0xBA55ED50u
#define FATBIN_WRAPPER_MAGIC 0x466243B1u

enum fatbin_kind { FATBIN_PTX = 1, FATBIN_CUBIN = 2 };
enum fatbin_compression { FATBIN_RAW = 0, FATBIN_LZ4 = 1, FATBIN_ZSTD = 2 };
enum image_type { IMAGE_UNKNOWN = 0, IMAGE_FATBIN, IMAGE_WRAPPER, IMAGE_CUBIN, IMAGE_PTX };

typedef struct {
    int kind;             /* FATBIN_PTX or FATBIN_CUBIN */
    unsigned arch;        /* 70 = sm_70 (cubin) / compute_70 (PTX) */
    int arch_specific;    /* an sm_XXa cubin: runs on exactly that architecture */
    int compression;      /* FATBIN_RAW, FATBIN_LZ4, FATBIN_ZSTD */
    const void *payload;  /* as stored (compressed or not) */
    size_t payload_size;  /* bytes stored */
    size_t raw_size;      /* bytes once decompressed (payload_size if raw) */
} fatbin_entry;

/* What `image` is, from its first bytes (a PTX text starts with comments, .version or .target). */
enum image_type image_type_of(const void *image);

/* The fatbin a wrapper points to, or `image` itself when it is a fatbin; NULL otherwise. */
const void *fatbin_of(const void *image);

/* Total bytes of a fatbin (header and entries). */
size_t fatbin_size(const void *fatbin);

/* Reads up to `max` entries; returns how many entries the fatbin has (may exceed max), -1 if malformed. */
int fatbin_entries(const void *fatbin, fatbin_entry *out, int max);

/* Decompresses (or copies) an entry into `out` (entry->raw_size bytes); 0 ok, -1 unsupported or corrupt. */
int fatbin_entry_data(const fatbin_entry *e, void *out, size_t out_size);

/* LZ4 block format: bytes written, or -1. */
long lz4_block_decompress(const unsigned char *src, size_t src_len, unsigned char *dst, size_t dst_cap);

/* A cubin's architecture (70 = sm_70) from its ELF header; 0 if not a CUDA ELF. */
unsigned cubin_arch(const void *elf, size_t size, int *arch_specific);

/* 1 if the cubin defines a kernel (an STT_FUNC symbol marked as an entry) named `name`, 0 if not, -1 if unreadable. */
int cubin_has_function(const void *elf, size_t size, const char *name);

/* A PTX text's ISA version (major * 10 + minor: 60 for ".version 6.0") and target (70 for sm_70); 0 if absent. */
unsigned ptx_isa_version(const char *ptx, size_t size);
unsigned ptx_target(const char *ptx, size_t size);

/* 1 if the PTX text has an .entry named `name`; -1 if it declares no entries at all. */
int ptx_has_entry(const char *ptx, size_t size, const char *name);

/* The newest PTX ISA a driver of this CUDA version compiles (12020 -> 82: ISA 8.2). */
unsigned ptx_isa_max_for_driver(int cuda_version);

/*
 * The image a device of compute capability major.minor runs, chosen as the driver chooses: a cubin
 * of the same major and a minor not above the device's (the newest such; an sm_XXa cubin only on its
 * exact architecture), else PTX for a target not above the device that the driver can JIT (the
 * newest target). Returns the index, or -1 with *why = 209 (CUDA_ERROR_NO_BINARY_FOR_GPU) or
 * 222 (CUDA_ERROR_UNSUPPORTED_PTX_VERSION, when only too-new PTX could have run).
 * `ptx_isa[i]` is entry i's PTX ISA version (0 unknown: assumed compilable).
 */
int fatbin_pick(const fatbin_entry *e, const unsigned *ptx_isa, int n, int major, int minor, unsigned isa_max,
                int *why);

#endif
