/* Slice limits, read once from the read-only config file (never from the environment). */
#ifndef GS_CONFIG_H
#define GS_CONFIG_H

#include <stddef.h>
#include <stdint.h>

#define GS_CONFIG_VERSION 1
#define GS_PATH_MAX 4096
#define GS_UNLIMITED UINT64_MAX

typedef struct {
    int version;
    uint64_t memory_bytes;           /* GS_UNLIMITED when the file says memory_bytes=unlimited */
    uint64_t context_overhead_bytes; /* charged once per (process, device) on first context */
    int compute_share;               /* 1..100; 100 disables the throttle */
    unsigned char gpu_uuid[16];
    char gpu_uuid_text[41];          /* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" */
    char usage_dir[GS_PATH_MAX];
} gs_config;

/* Parses `text` (len bytes). On failure returns -1 and writes a one-line reason into err. */
int gs_config_parse(const char *text, size_t len, gs_config *out, char *err, size_t errlen);

/* Reads and parses `path`. On failure returns -1 with the reason in err. */
int gs_config_load(const char *path, gs_config *out, char *err, size_t errlen);

/* Parses "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" into 16 bytes; -1 if malformed. */
int gs_parse_uuid(const char *text, unsigned char out[16]);

#endif
