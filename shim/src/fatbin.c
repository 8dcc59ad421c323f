/* Kernel images: see fatbin.h. */
#include "fatbin.h"

#include <elf.h>
#include <string.h>

#define STO_CUDA_ENTRY 0x10 /* st_other of a kernel (a __global__ function) */

static uint32_t rd32(const unsigned char *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static uint64_t rd64(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

enum image_type image_type_of(const void *image)
{
    const unsigned char *p = image;
    if (!p) return IMAGE_UNKNOWN;
    uint32_t m = rd32(p);
    if (m == FATBIN_MAGIC) return IMAGE_FATBIN;
    if (m == FATBIN_WRAPPER_MAGIC) return IMAGE_WRAPPER;
    if (memcmp(p, ELFMAG, SELFMAG) == 0) return IMAGE_CUBIN;
    /* PTX is text: skip whitespace and comments, then a directive */
    const char *s = image;
    for (int guard = 0; guard < 4096 && *s; guard++) {
        if (*s == ' ' || *s == '\t' || *s == '\n' || *s == '\r') {
            s++;
        } else if (s[0] == '/' && s[1] == '/') {
            while (*s && *s != '\n') s++;
        } else if (s[0] == '/' && s[1] == '*') {
            const char *e = strstr(s + 2, "*/");
            if (!e) return IMAGE_UNKNOWN;
            s = e + 2;
        } else {
            return *s == '.' ? IMAGE_PTX : IMAGE_UNKNOWN;
        }
    }
    return IMAGE_UNKNOWN;
}

const void *fatbin_of(const void *image)
{
    enum image_type t = image_type_of(image);
    if (t == IMAGE_FATBIN) return image;
    if (t == IMAGE_WRAPPER) {
        const void *data;
        memcpy(&data, (const unsigned char *)image + 8, sizeof(data));
        return image_type_of(data) == IMAGE_FATBIN ? data : NULL;
    }
    return NULL;
}

size_t fatbin_size(const void *fatbin)
{
    const unsigned char *p = fatbin;
    return (size_t)(p[6] | (p[7] << 8)) + (size_t)rd64(p + 8);
}

int fatbin_entries(const void *fatbin, fatbin_entry *out, int max)
{
    const unsigned char *p = fatbin;
    if (rd32(p) != FATBIN_MAGIC) return -1;
    size_t hsize = (size_t)(p[6] | (p[7] << 8));
    uint64_t total = rd64(p + 8);
    if (hsize < 16 || total > (1ull << 34)) return -1;
    const unsigned char *e = p + hsize, *end = e + total;
    int n = 0;
    while (e + 64 <= end) {
        unsigned kind = (unsigned)(e[0] | (e[1] << 8));
        uint32_t eh = rd32(e + 4);
        uint64_t payload = rd64(e + 8);
        if (eh < 64 || eh > 4096 || payload > (uint64_t)(end - e) || eh + payload > (uint64_t)(end - e)) return -1;
        if (n < max) {
            uint64_t flags = rd64(e + 40);
            uint32_t compressed = rd32(e + 16);
            uint64_t raw = rd64(e + 56);
            fatbin_entry *f = &out[n];
            f->kind = (int)kind;
            f->arch = rd32(e + 28);
            f->arch_specific = 0;
            f->compression = flags & 0x2000 ? FATBIN_LZ4 : flags & 0x8000 ? FATBIN_ZSTD : FATBIN_RAW;
            f->payload = e + eh;
            f->payload_size = f->compression != FATBIN_RAW && compressed && compressed <= payload ? compressed
                                                                                                   : (size_t)payload;
            f->raw_size = f->compression != FATBIN_RAW && raw ? (size_t)raw : f->payload_size;
        }
        n++;
        e += eh + payload;
    }
    return n;
}

long lz4_block_decompress(const unsigned char *src, size_t src_len, unsigned char *dst, size_t dst_cap)
{
    const unsigned char *s = src, *send = src + src_len;
    unsigned char *d = dst, *dend = dst + dst_cap;
    while (s < send) {
        unsigned token = *s++;
        size_t lit = token >> 4;
        if (lit == 15) {
            unsigned b;
            do {
                if (s >= send) return -1;
                b = *s++;
                lit += b;
            } while (b == 255);
        }
        if (lit > (size_t)(send - s) || lit > (size_t)(dend - d)) return -1;
        memcpy(d, s, lit);
        d += lit;
        s += lit;
        if (s >= send) break; /* the last sequence has literals only */
        if (send - s < 2) return -1;
        size_t off = (size_t)(s[0] | (s[1] << 8));
        s += 2;
        if (off == 0 || off > (size_t)(d - dst)) return -1;
        size_t mlen = (token & 15) + 4u;
        if ((token & 15) == 15) {
            unsigned b;
            do {
                if (s >= send) return -1;
                b = *s++;
                mlen += b;
            } while (b == 255);
        }
        if (mlen > (size_t)(dend - d)) return -1;
        for (size_t i = 0; i < mlen; i++, d++) *d = *(d - off); /* overlapping copies repeat */
    }
    return (long)(d - dst);
}

int fatbin_entry_data(const fatbin_entry *e, void *out, size_t out_size)
{
    if (out_size < e->raw_size) return -1;
    if (e->compression == FATBIN_RAW) {
        memcpy(out, e->payload, e->raw_size);
        return 0;
    }
    if (e->compression == FATBIN_LZ4) {
        long n = lz4_block_decompress(e->payload, e->payload_size, out, out_size);
        return n >= 0 && (size_t)n >= e->raw_size - (e->raw_size > 0) ? 0 : -1;
    }
    return -1; /* zstd: not decoded here */
}

unsigned cubin_arch(const void *elf, size_t size, int *arch_specific)
{
    const unsigned char *p = elf;
    if (size < sizeof(Elf64_Ehdr) || memcmp(p, ELFMAG, SELFMAG) != 0 || p[EI_CLASS] != ELFCLASS64) return 0;
    Elf64_Ehdr h;
    memcpy(&h, p, sizeof(h));
    if (h.e_machine != EM_CUDA) return 0;
    /* ELF ABI version 7 and older: the SM in the low byte, 0x800 marks an sm_XXa image; newer ABIs moved
     * the SM up one byte. */
    unsigned abi = p[EI_ABIVERSION];
    unsigned sm = abi >= 8 ? (h.e_flags >> 8) & 0xff : h.e_flags & 0xff;
    if (arch_specific) *arch_specific = abi >= 8 ? 0 : (h.e_flags & 0x800) != 0;
    return sm;
}

int cubin_has_function(const void *elf, size_t size, const char *name)
{
    const unsigned char *p = elf;
    if (size < sizeof(Elf64_Ehdr) || memcmp(p, ELFMAG, SELFMAG) != 0 || p[EI_CLASS] != ELFCLASS64) return -1;
    Elf64_Ehdr h;
    memcpy(&h, p, sizeof(h));
    if (h.e_shoff == 0 || h.e_shentsize != sizeof(Elf64_Shdr) || h.e_shoff + (uint64_t)h.e_shnum * sizeof(Elf64_Shdr) > size)
        return -1;
    for (unsigned i = 0; i < h.e_shnum; i++) {
        Elf64_Shdr sh;
        memcpy(&sh, p + h.e_shoff + (uint64_t)i * sizeof(sh), sizeof(sh));
        if (sh.sh_type != SHT_SYMTAB || sh.sh_entsize != sizeof(Elf64_Sym) || sh.sh_link >= h.e_shnum) continue;
        Elf64_Shdr str;
        memcpy(&str, p + h.e_shoff + (uint64_t)sh.sh_link * sizeof(str), sizeof(str));
        if (sh.sh_offset + sh.sh_size > size || str.sh_offset + str.sh_size > size) return -1;
        for (uint64_t off = 0; off + sizeof(Elf64_Sym) <= sh.sh_size; off += sizeof(Elf64_Sym)) {
            Elf64_Sym sym;
            memcpy(&sym, p + sh.sh_offset + off, sizeof(sym));
            /* kernels only: device functions are FUNC symbols too, without the entry mark */
            if (ELF64_ST_TYPE(sym.st_info) != STT_FUNC || !(sym.st_other & STO_CUDA_ENTRY) || sym.st_name >= str.sh_size)
                continue;
            const char *s = (const char *)p + str.sh_offset + sym.st_name;
            size_t room = str.sh_size - sym.st_name;
            size_t len = strlen(name);
            if (len < room && memcmp(s, name, len) == 0 && s[len] == '\0') return 1;
        }
        return 0;
    }
    return -1;
}

/* The first occurrence of `word` in [s, s+n) as a directive (preceded by start or whitespace). */
static const char *find_directive(const char *s, size_t n, const char *word)
{
    size_t w = strlen(word);
    for (size_t i = 0; i + w <= n; i++)
        if (memcmp(s + i, word, w) == 0 && (i == 0 || s[i - 1] == '\n' || s[i - 1] == ' ' || s[i - 1] == '\t'))
            return s + i + w;
    return NULL;
}

static unsigned digits(const char **p, const char *end)
{
    unsigned v = 0;
    while (*p < end && **p >= '0' && **p <= '9') v = v * 10 + (unsigned)(*(*p)++ - '0');
    return v;
}

unsigned ptx_isa_version(const char *ptx, size_t size)
{
    const char *v = find_directive(ptx, size, ".version"), *end = ptx + size;
    if (!v) return 0;
    while (v < end && (*v == ' ' || *v == '\t')) v++;
    unsigned major = digits(&v, end), minor = 0;
    if (v < end && *v == '.') {
        v++;
        minor = digits(&v, end);
    }
    return major * 10 + minor;
}

unsigned ptx_target(const char *ptx, size_t size)
{
    const char *t = find_directive(ptx, size, ".target"), *end = ptx + size;
    if (!t) return 0;
    while (t < end && (*t == ' ' || *t == '\t')) t++;
    if (end - t < 4 || memcmp(t, "sm_", 3) != 0) return 0;
    t += 3;
    return digits(&t, end);
}

int ptx_has_entry(const char *ptx, size_t size, const char *name)
{
    size_t len = strlen(name);
    int any = 0;
    const char *s = ptx, *end = ptx + size;
    while (s < end) {
        const char *e = find_directive(s, (size_t)(end - s), ".entry");
        if (!e) break;
        any = 1;
        while (e < end && (*e == ' ' || *e == '\t')) e++;
        if ((size_t)(end - e) >= len && memcmp(e, name, len) == 0 &&
            (e + len == end || e[len] == '(' || e[len] == ' ' || e[len] == '\n' || e[len] == '\t' || e[len] == '\r'))
            return 1;
        s = e;
    }
    return any ? 0 : -1;
}

unsigned ptx_isa_max_for_driver(int v)
{
    static const struct {
        int cuda;
        unsigned isa;
    } table[] = {{11000, 70}, {11010, 71}, {11020, 72}, {11030, 73}, {11040, 74}, {11050, 75}, {11060, 76},
                 {11070, 77}, {11080, 78}, {12000, 80}, {12010, 81}, {12020, 82}, {12030, 83}, {12040, 84},
                 {12050, 85}, {12060, 85}, {12080, 87}, {12090, 88}, {13000, 90}, {13010, 91}};
    unsigned isa = 65;
    for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++)
        if (table[i].cuda <= v) isa = table[i].isa;
    return isa;
}

int fatbin_pick(const fatbin_entry *e, const unsigned *ptx_isa, int n, int major, int minor, unsigned isa_max,
                int *why)
{
    unsigned dev = (unsigned)(major * 10 + minor);
    int best_cubin = -1, best_ptx = -1, too_new_ptx = 0;
    for (int i = 0; i < n; i++) {
        if (e[i].kind == FATBIN_CUBIN) {
            unsigned a = e[i].arch;
            int ok = e[i].arch_specific ? a == dev : a / 10 == (unsigned)major && a <= dev;
            if (ok && (best_cubin < 0 || a > e[best_cubin].arch)) best_cubin = i;
        } else if (e[i].kind == FATBIN_PTX && e[i].arch <= dev) {
            if (ptx_isa && ptx_isa[i] > isa_max) {
                too_new_ptx = 1;
                continue;
            }
            if (best_ptx < 0 || e[i].arch > e[best_ptx].arch) best_ptx = i;
        }
    }
    if (best_cubin >= 0) return best_cubin;
    if (best_ptx >= 0) return best_ptx;
    if (why) *why = too_new_ptx ? 222 : 209;
    return -1;
}
