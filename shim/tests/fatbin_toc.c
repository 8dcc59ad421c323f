/*
 * Prints a fatbin's table of contents with src/fatbin.c (the parser the double uses):
 *   fatbin_toc FILE   one line per entry: "<ptx|cubin> <arch> <raw|lz4|zstd> <stored> <raw size> <check>"
 * where check is, for entries it can decode, "elf-sm<arch>" (a cubin's own ELF header) or
 * "ptx-isa<version>-sm<target>", else "-". A file may hold several fatbins back to back.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/fatbin.h"

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: fatbin_toc FILE\n");
        return 2;
    }
    FILE *f = fopen(argv[1], "rb");
    if (!f) return 2;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *buf = malloc((size_t)n + 16);
    if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) return 2;
    fclose(f);
    static const char *kinds[] = {"?", "ptx", "cubin"}, *comp[] = {"raw", "lz4", "zstd"};
    for (long off = 0; off + 16 <= n;) {
        if (image_type_of(buf + off) != IMAGE_FATBIN) break;
        fatbin_entry e[256];
        int count = fatbin_entries(buf + off, e, 256);
        if (count < 0) {
            printf("malformed fatbin at %ld\n", off);
            return 1;
        }
        for (int i = 0; i < count && i < 256; i++) {
            char check[64] = "-";
            void *raw = malloc(e[i].raw_size + 1);
            if (raw && fatbin_entry_data(&e[i], raw, e[i].raw_size) == 0) {
                if (e[i].kind == FATBIN_CUBIN) snprintf(check, sizeof check, "elf-sm%u", cubin_arch(raw, e[i].raw_size, NULL));
                else {
                    ((char *)raw)[e[i].raw_size] = '\0';
                    snprintf(check, sizeof check, "ptx-isa%u-sm%u", ptx_isa_version(raw, e[i].raw_size),
                             ptx_target(raw, e[i].raw_size));
                }
            }
            free(raw);
            printf("%s %u %s %zu %zu %s\n", kinds[e[i].kind <= 2 ? e[i].kind : 0], e[i].arch, comp[e[i].compression],
                   e[i].payload_size, e[i].raw_size, check);
        }
        off += (long)((fatbin_size(buf + off) + 7) & ~(size_t)7);
    }
    return 0;
}
