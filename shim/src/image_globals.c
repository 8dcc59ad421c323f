/* Module-scope variables of kernel images: see image_globals.h. */
#include "image_globals.h"

#include <elf.h>
#include <stdlib.h>
#include <string.h>

static void put(image_global *out, int max, int n, const image_global *g)
{
    if (out && n < max) out[n] = *g;
}

static int starts(const char *s, size_t room, const char *prefix)
{
    size_t n = strlen(prefix);
    return room >= n && memcmp(s, prefix, n) == 0;
}

int cubin_globals(const void *elf, size_t size, image_global *out, int max)
{
    const unsigned char *p = elf;
    if (!p || size < sizeof(Elf64_Ehdr) || memcmp(p, ELFMAG, SELFMAG) != 0 || p[EI_CLASS] != ELFCLASS64) return -1;
    Elf64_Ehdr h;
    memcpy(&h, p, sizeof(h));
    if (h.e_shoff == 0 || h.e_shentsize != sizeof(Elf64_Shdr) || h.e_shstrndx >= h.e_shnum ||
        h.e_shoff + (uint64_t)h.e_shnum * sizeof(Elf64_Shdr) > size)
        return -1;
    Elf64_Shdr names;
    memcpy(&names, p + h.e_shoff + (uint64_t)h.e_shstrndx * sizeof(names), sizeof(names));
    if (names.sh_offset + names.sh_size > size) return -1;
    int n = 0;
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
            if (ELF64_ST_TYPE(sym.st_info) != STT_OBJECT || sym.st_shndx == SHN_UNDEF || sym.st_shndx >= h.e_shnum ||
                sym.st_name >= str.sh_size)
                continue;
            Elf64_Shdr sec;
            memcpy(&sec, p + h.e_shoff + (uint64_t)sym.st_shndx * sizeof(sec), sizeof(sec));
            if (sec.sh_name >= names.sh_size) continue;
            const char *sname = (const char *)p + names.sh_offset + sec.sh_name;
            size_t sroom = names.sh_size - sec.sh_name;
            int constant = starts(sname, sroom, ".nv.constant");
            if (!constant && !starts(sname, sroom, ".nv.global")) continue; /* shared, local: not module memory */
            if (sym.st_value + sym.st_size < sym.st_value || sym.st_value + sym.st_size > sec.sh_size) continue;
            const char *name = (const char *)p + str.sh_offset + sym.st_name;
            size_t len = strnlen(name, str.sh_size - sym.st_name);
            if (len == 0 || len >= sizeof(out->name) || len == str.sh_size - sym.st_name) continue;
            image_global g;
            memset(&g, 0, sizeof(g));
            memcpy(g.name, name, len);
            g.size = sym.st_size;
            g.align = sec.sh_addralign ? sec.sh_addralign : 1;
            g.constant = constant;
            if (sec.sh_type != SHT_NOBITS) {
                if (sec.sh_offset + sym.st_value + sym.st_size > size) continue;
                g.init = p + sec.sh_offset + sym.st_value;
            }
            put(out, max, n++, &g);
        }
        return n;
    }
    return n; /* no symbol table: no variables */
}

uint64_t image_global_place(uint64_t at, const image_global *g)
{
    uint64_t a = g->align && g->align <= 4096 && (g->align & (g->align - 1)) == 0 ? g->align : 8;
    return (at + a - 1) / a * a;
}

uint64_t image_globals_bytes(const image_global *g, int n)
{
    uint64_t at = 0;
    for (int i = 0; i < n; i++) at = image_global_place(at, &g[i]) + g[i].size;
    return at;
}

/* ---------------------------------------------------------------- PTX */

static int ident_char(char c)
{
    return c == '_' || c == '$' || c == '%' || (c >= '0' && c <= '9') || ((c | 32) >= 'a' && (c | 32) <= 'z');
}

/* Skips whitespace and comments. */
static const char *skip(const char *s, const char *end)
{
    while (s < end) {
        if (*s == ' ' || *s == '\t' || *s == '\n' || *s == '\r') {
            s++;
        } else if (s + 1 < end && s[0] == '/' && s[1] == '/') {
            while (s < end && *s != '\n') s++;
        } else if (s + 1 < end && s[0] == '/' && s[1] == '*') {
            s += 2;
            while (s + 1 < end && !(s[0] == '*' && s[1] == '/')) s++;
            s = s + 1 < end ? s + 2 : end;
        } else {
            break;
        }
    }
    return s;
}

/* A token: a directive or identifier (with its leading '.'), else one character. */
static const char *token(const char *s, const char *end, size_t *len)
{
    s = skip(s, end);
    size_t n = 0;
    if (s < end && (*s == '.' || ident_char(*s))) {
        n = 1;
        while (s + n < end && ident_char(s[n])) n++;
    } else if (s < end) {
        n = 1;
    }
    *len = n;
    return s;
}

static int is_tok(const char *t, size_t n, const char *word)
{
    return n == strlen(word) && memcmp(t, word, n) == 0;
}

/* Bytes of a PTX fundamental type (.u32 -> 4); 0 if it is not one (.texref, .samplerref, ...). */
static unsigned type_bytes(const char *t, size_t n, char *kind)
{
    static const struct {
        const char *name;
        unsigned bytes;
        char kind;
    } types[] = {{".b8", 1, 'i'},   {".u8", 1, 'i'},   {".s8", 1, 'i'},   {".b16", 2, 'i'},  {".u16", 2, 'i'},
                 {".s16", 2, 'i'},  {".f16", 2, 'f'},  {".bf16", 2, 'f'}, {".b32", 4, 'i'},  {".u32", 4, 'i'},
                 {".s32", 4, 'i'},  {".f32", 4, 'f'},  {".f16x2", 4, 'i'}, {".bf16x2", 4, 'i'}, {".b64", 8, 'i'},
                 {".u64", 8, 'i'},  {".s64", 8, 'i'},  {".f64", 8, 'f'},  {".b128", 16, 'i'}};
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++)
        if (is_tok(t, n, types[i].name)) {
            *kind = types[i].kind;
            return types[i].bytes;
        }
    return 0;
}

/* How many values an initializer holds (commas at any depth, plus one), for an unsized `[]`. */
static uint64_t init_count(const char *s, const char *end)
{
    uint64_t n = 0;
    int any = 0;
    for (; s < end && *s != ';'; s++) {
        if (*s == ',') n++;
        else if (*s != ' ' && *s != '\t' && *s != '\n' && *s != '\r' && *s != '{' && *s != '}') any = 1;
    }
    return any ? n + 1 : 0;
}

/* Parses a declaration after `.global` / `.const` up to its ';' (at *next). 1 if it defines a variable. */
static int ptx_decl(const char *s, const char *end, int constant, image_global *g, const char **next)
{
    memset(g, 0, sizeof(*g));
    g->constant = constant;
    uint64_t vec = 1, count = 1;
    int unsized = 0, named = 0;
    size_t n;
    const char *t;
    for (;;) {
        t = token(s, end, &n);
        if (n == 0 || *t == ';') break;
        s = t + n;
        if (*t == '=') {
            g->ptx_init = s;
            while (s < end && *s != ';') s++;
            break;
        }
        if (is_tok(t, n, ".attribute")) { /* .attribute(.managed) */
            const char *close = memchr(s, ')', (size_t)(end - s));
            if (!close) break;
            for (const char *q = s; q + 8 <= close; q++)
                if (memcmp(q, ".managed", 8) == 0) g->managed = 1;
            s = close + 1;
        } else if (is_tok(t, n, ".align")) {
            t = token(s, end, &n);
            g->align = strtoull(t, NULL, 10);
            s = t + n;
        } else if (is_tok(t, n, ".v2") || is_tok(t, n, ".v4") || is_tok(t, n, ".v8")) {
            vec = (uint64_t)(t[2] - '0');
        } else if (*t == '.' && !named) {
            g->elem = type_bytes(t, n, &g->elem_kind);
            if (!g->elem) return 0; /* an opaque type (texture, sampler, surface reference) */
        } else if (*t == '[') {
            t = token(s, end, &n);
            if (n && *t == ']') {
                unsized = 1;
                s = t + 1;
            } else {
                count *= strtoull(t, NULL, 10);
                const char *close = memchr(t, ']', (size_t)(end - t));
                if (!close) return 0;
                s = close + 1;
            }
        } else if (ident_char(*t) && !named && g->elem) {
            if (n >= sizeof(g->name)) return 0;
            memcpy(g->name, t, n);
            g->name[n] = '\0';
            named = 1;
        }
    }
    while (s < end && *s != ';') s++;
    *next = s < end ? s + 1 : end;
    if (!named || !g->elem) return 0;
    uint64_t elems = vec * count;
    if (unsized) elems *= g->ptx_init ? init_count(g->ptx_init, end) / vec : 0;
    g->size = elems * g->elem;
    if (!g->align) g->align = g->elem * vec;
    return g->size > 0;
}

int ptx_globals(const char *ptx, size_t size, image_global *out, int max)
{
    if (!ptx) return -1;
    const char *s = ptx, *end = ptx + size;
    int n = 0, depth = 0, external = 0;
    while (s < end) {
        size_t len;
        const char *t = token(s, end, &len);
        if (len == 0) break;
        s = t + len;
        /* function bodies and parameter lists (`.param .u64 .ptr .global p`) are not module scope */
        if (*t == '{' || *t == '(') depth++;
        else if (*t == '}' || *t == ')') depth -= depth > 0;
        if (*t == ';' || *t == '{' || *t == '}') {
            external = 0;
            continue;
        }
        if (depth != 0) continue;
        if (is_tok(t, len, ".extern")) external = 1;
        int constant = is_tok(t, len, ".const");
        if (!constant && !is_tok(t, len, ".global")) continue;
        image_global g;
        const char *next = end;
        int defines = ptx_decl(s, end, constant, &g, &next);
        s = next;
        if (defines && !external) put(out, max, n++, &g);
        external = 0;
    }
    return n;
}

/* One number of an initializer: 1 with its bits in *v (an integer, or a float's bits for 'f'), 0 if
 * it is not a number (an address); *s past it either way. */
static int ptx_number(const char **s, const char *end, char kind, unsigned elem, uint64_t *v)
{
    const char *p = *s;
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) p++;
    const char *stop = p;
    int depth = 0;
    while (stop < end && *stop != ';' && !(depth == 0 && (*stop == ',' || *stop == '}'))) {
        if (*stop == '(') depth++;
        if (*stop == ')') depth--;
        stop++;
    }
    *s = stop;
    size_t n = (size_t)(stop - p);
    while (n > 0 && (p[n - 1] == ' ' || p[n - 1] == '\t' || p[n - 1] == '\n' || p[n - 1] == '\r')) n--;
    char buf[64];
    if (n == 0 || n >= sizeof(buf)) return 0;
    memcpy(buf, p, n);
    buf[n] = '\0';
    char *e = NULL;
    int neg = buf[0] == '-';
    const char *b = neg ? buf + 1 : buf;
    if ((b[0] == '0') && (b[1] == 'f' || b[1] == 'F' || b[1] == 'd' || b[1] == 'D')) { /* a float's bits in hex */
        uint64_t bits = strtoull(b + 2, &e, 16);
        if (*e) return 0;
        if (b[1] == 'f' || b[1] == 'F') {
            float f;
            uint32_t w = (uint32_t)bits;
            memcpy(&f, &w, 4);
            if (kind == 'f' && elem == 8) {
                double d = neg ? -(double)f : (double)f;
                memcpy(v, &d, 8);
            } else {
                if (neg) w ^= 0x80000000u;
                *v = w;
            }
        } else {
            if (neg) bits ^= 0x8000000000000000ull;
            *v = bits;
        }
        return 1;
    }
    if (kind == 'f') {
        double d = strtod(buf, &e);
        if (*e || e == buf) return 0;
        if (elem == 4) {
            float f = (float)d;
            uint32_t w;
            memcpy(&w, &f, 4);
            *v = w;
        } else {
            memcpy(v, &d, 8);
        }
        return 1;
    }
    long long x = strtoll(buf, &e, 0);
    if (e == buf) return 0;
    if (*e == 'U' || *e == 'u') e++;
    if (*e) {
        unsigned long long ux = strtoull(buf, &e, 0); /* past LLONG_MAX */
        if (*e && *e != 'U' && *e != 'u') return 0;
        x = (long long)ux;
    }
    *v = (uint64_t)x;
    return 1;
}

void ptx_global_init(const image_global *g, void *out)
{
    memset(out, 0, g->size);
    if (!g->ptx_init || !g->elem || g->elem > 8) return;
    const char *s = g->ptx_init, *end = s + strlen(s);
    unsigned char *dst = out;
    uint64_t at = 0;
    while (s < end && *s != ';' && at + g->elem <= g->size) {
        while (s < end && (*s == ' ' || *s == '\t' || *s == '\n' || *s == '\r' || *s == '{' || *s == '}' || *s == ','))
            s++;
        if (s >= end || *s == ';') break;
        uint64_t v = 0;
        if (ptx_number(&s, end, g->elem_kind, g->elem, &v)) memcpy(dst + at, &v, g->elem); /* little-endian */
        at += g->elem;
    }
}
