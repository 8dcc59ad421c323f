/* Parses slice config files with the shim's own parser and prints the result in one canonical
 * line per file, so tests can compare it with the Python side (SliceConfig.parse):
 *   config_check FILE...   ->   "ok memory=<n|unlimited> share=<n> uuid=<text> overhead=<n> usage=<dir>"
 *                                or "error <reason>"                                              */
#include <inttypes.h>
#include <stdio.h>

#include "gs_config.h"

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        gs_config c;
        char err[512];
        if (gs_config_load(argv[i], &c, err, sizeof(err)) != 0) {
            printf("error %s\n", err);
            continue;
        }
        if (c.memory_bytes == GS_UNLIMITED) printf("ok memory=unlimited");
        else printf("ok memory=%" PRIu64, c.memory_bytes);
        printf(" share=%d uuid=%s overhead=%" PRIu64 " usage=%s\n", c.compute_share, c.gpu_uuid_text,
               c.context_overhead_bytes, c.usage_dir);
    }
    return 0;
}
