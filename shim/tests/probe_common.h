/* Helpers shared by the C test programs: checks that name what failed. */
#ifndef PROBE_COMMON_H
#define PROBE_COMMON_H

#include <stdio.h>
#include <stdlib.h>

static int probe_failures;

#define CHECK(cond, ...)                                                                                 \
    do {                                                                                                 \
        if (!(cond)) {                                                                                   \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                              \
            fprintf(stderr, __VA_ARGS__);                                                                \
            fprintf(stderr, "\n");                                                                       \
            probe_failures++;                                                                            \
        }                                                                                                \
    } while (0)

#define EXPECT_RC(call, want)                                                                            \
    do {                                                                                                 \
        int rc_ = (int)(call);                                                                           \
        CHECK(rc_ == (int)(want), "%s returned %d, expected %d", #call, rc_, (int)(want));               \
    } while (0)

#define PROBE_DONE(name)                                                                                 \
    do {                                                                                                 \
        if (probe_failures) {                                                                            \
            fprintf(stderr, "%s: %d check(s) failed\n", name, probe_failures);                           \
            return 1;                                                                                    \
        }                                                                                                \
        printf("ok %s\n", name);                                                                         \
        return 0;                                                                                        \
    } while (0)

#endif
