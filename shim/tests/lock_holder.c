/*
 * Takes the usage region's lock and never lets go: the test SIGKILLs it while it holds the lock and
 * checks that the slice's other processes carry on (robust mutex). Optionally also holds memory in
 * the region first, so the test can check that a killed process's bytes return to the slice.
 *
 *   lock_holder USAGE_DIR LIMIT [BYTES]
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gs_region.h"

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: lock_holder USAGE_DIR LIMIT [BYTES]\n");
        return 2;
    }
    gs_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.version = 1;
    cfg.memory_bytes = strtoull(argv[2], NULL, 10);
    cfg.compute_share = 100;
    snprintf(cfg.usage_dir, sizeof(cfg.usage_dir), "%s", argv[1]);
    gs_region r;
    char err[256];
    if (gs_region_open(&r, &cfg, err, sizeof(err)) != 0) {
        fprintf(stderr, "lock_holder: %s\n", err);
        return 1;
    }
    if (argc > 3 && gs_region_reserve(&r, strtoull(argv[3], NULL, 10)) != 0) {
        fprintf(stderr, "lock_holder: could not reserve\n");
        return 1;
    }
    gs_region_lock(&r);
    printf("locked\n");
    fflush(stdout);
    for (;;) pause();
}
