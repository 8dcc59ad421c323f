/* gpuslice-fake-gpu-fault: tells the driver double that a card failed or recovered (fake_health.h).
 *
 *   gpuslice-fake-gpu-fault --config <fake-gpus.conf> --gpu INDEX|UUID --xid N   raise XID N (and what it does)
 *   gpuslice-fake-gpu-fault --config <fake-gpus.conf> --gpu INDEX|UUID --lost     fall off the bus, no event
 *   gpuslice-fake-gpu-fault --config <fake-gpus.conf> --gpu INDEX|UUID --pending-remap
 *   gpuslice-fake-gpu-fault --config <fake-gpus.conf> --gpu INDEX|UUID --clear    reset: healthy again
 *
 * Prints "<index> <uuid> <what>" and exits 0; 2 on bad usage or an unknown GPU. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "fake_health.h"

static int usage(void)
{
    fprintf(stderr, "usage: gpuslice-fake-gpu-fault --config FILE --gpu INDEX|UUID "
                    "(--xid N | --lost | --pending-remap | --clear)\n");
    return 2;
}

int main(int argc, char **argv)
{
    const char *config = NULL, *gpu = NULL;
    long xid = -1;
    int lost = 0, remap = 0, clear = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--config") == 0 && i + 1 < argc) config = argv[++i];
        else if (strcmp(argv[i], "--gpu") == 0 && i + 1 < argc) gpu = argv[++i];
        else if (strcmp(argv[i], "--xid") == 0 && i + 1 < argc) {
            char *end;
            xid = strtol(argv[++i], &end, 10);
            if (*end || xid <= 0 || xid > 65535) {
                fprintf(stderr, "gpuslice-fake-gpu-fault: --xid wants a positive XID number, not %s\n", argv[i]);
                return 2;
            }
        } else if (strcmp(argv[i], "--lost") == 0) lost = 1;
        else if (strcmp(argv[i], "--pending-remap") == 0) remap = 1;
        else if (strcmp(argv[i], "--clear") == 0) clear = 1;
        else return usage();
    }
    if (!config || !gpu || (xid > 0) + lost + remap + clear != 1) return usage();
    fake_system *s = fake_system_load_for_daemon(config);
    if (!s) return 2;
    int slot = -1;
    char *end;
    long n = strtol(gpu, &end, 10);
    for (int i = 0; i < s->count; i++)
        if ((!*end && n == i) || strcasecmp(s->gpus[i].uuid, gpu) == 0) slot = i;
    if (slot < 0) {
        fprintf(stderr, "gpuslice-fake-gpu-fault: no GPU %s in %s (%d GPUs: index 0..%d or a GPU- UUID)\n", gpu,
                config, s->count, s->count - 1);
        return 2;
    }
    int rc;
    char what[32];
    if (xid > 0) {
        rc = fake_health_raise_xid(s, slot, (unsigned)xid);
        snprintf(what, sizeof(what), "xid %ld", xid);
    } else if (clear) {
        rc = fake_health_clear(s, slot);
        snprintf(what, sizeof(what), "cleared");
    } else {
        rc = fake_health_set(s, slot, lost, remap);
        snprintf(what, sizeof(what), "%s", lost ? "lost" : "pending-remap");
    }
    if (rc != 0) {
        fprintf(stderr, "gpuslice-fake-gpu-fault: cannot write %s/health.bin\n", s->state_dir);
        return 1;
    }
    printf("%d %s %s\n", slot, s->gpus[slot].uuid, what);
    return 0;
}
