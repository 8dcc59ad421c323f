#define _GNU_SOURCE
#include "gs_config.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define GS_CONFIG_MAX_BYTES 65536

static int hexval(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

int gs_parse_uuid(const char *text, unsigned char out[16])
{
    if (strncmp(text, "GPU-", 4) != 0 || strlen(text) != 40) return -1;
    const char *p = text + 4;
    int n = 0;
    for (int i = 0; i < 36; i++) {
        if (i == 8 || i == 13 || i == 18 || i == 23) {
            if (p[i] != '-') return -1;
            continue;
        }
        int hi = hexval(p[i]), lo = hexval(p[i + 1]);
        if (hi < 0 || lo < 0) return -1;
        out[n++] = (unsigned char)(hi << 4 | lo);
        i++;
    }
    return n == 16 ? 0 : -1;
}

/* ASCII digits only (no sign, no whitespace, no base prefix), at most 2^64-1: exactly what
 * SliceConfig.parse accepts. strtoull would skip leading whitespace and take a sign. */
static int parse_u64(const char *s, uint64_t *out)
{
    if (*s == '\0') return -1;
    uint64_t v = 0;
    for (; *s; s++) {
        if (*s < '0' || *s > '9') return -1;
        unsigned d = (unsigned)(*s - '0');
        if (v > (UINT64_MAX - d) / 10) return -1; /* overflow */
        v = v * 10 + d;
    }
    *out = v;
    return 0;
}

enum { K_VERSION = 1, K_MEMORY = 2, K_SHARE = 4, K_UUID = 8, K_USAGE = 16, K_OVERHEAD = 32 };
#define K_REQUIRED (K_VERSION | K_MEMORY | K_SHARE | K_UUID | K_USAGE)

int gs_config_parse(const char *text, size_t len, gs_config *out, char *err, size_t errlen)
{
    memset(out, 0, sizeof(*out));
    unsigned seen = 0;
    size_t pos = 0;
    int lineno = 0;
    char line[GS_PATH_MAX + 64];
    while (pos < len) {
        size_t end = pos;
        while (end < len && text[end] != '\n') end++;
        lineno++;
        size_t n = end - pos;
        if (n >= sizeof(line)) {
            snprintf(err, errlen, "line %d is longer than %zu bytes", lineno, sizeof(line) - 1);
            return -1;
        }
        memcpy(line, text + pos, n);
        line[n] = '\0';
        pos = end + 1;
        if (memchr(line, '\0', n) != NULL) {
            snprintf(err, errlen, "line %d contains a NUL byte", lineno);
            return -1;
        }
        while (n > 0 && (line[n - 1] == '\r' || line[n - 1] == ' ' || line[n - 1] == '\t')) line[--n] = '\0';
        char *s = line;
        while (*s == ' ' || *s == '\t') s++;
        if (*s == '\0' || *s == '#') continue;
        char *eq = strchr(s, '=');
        if (eq == NULL) {
            snprintf(err, errlen, "line %d is not key=value: '%.60s'", lineno, s);
            return -1;
        }
        *eq = '\0';
        const char *key = s, *val = eq + 1;
        unsigned bit;
        if (strcmp(key, "version") == 0) bit = K_VERSION;
        else if (strcmp(key, "memory_bytes") == 0) bit = K_MEMORY;
        else if (strcmp(key, "compute_share") == 0) bit = K_SHARE;
        else if (strcmp(key, "gpu_uuid") == 0) bit = K_UUID;
        else if (strcmp(key, "usage_dir") == 0) bit = K_USAGE;
        else if (strcmp(key, "context_overhead_bytes") == 0) bit = K_OVERHEAD;
        else {
            snprintf(err, errlen, "line %d: unknown key '%.60s'", lineno, key);
            return -1;
        }
        if (seen & bit) {
            snprintf(err, errlen, "line %d: key '%s' given twice", lineno, key);
            return -1;
        }
        seen |= bit;
        uint64_t v = 0;
        switch (bit) {
        case K_VERSION:
            if (strcmp(val, "1") != 0) {
                snprintf(err, errlen, "version must be %d, got '%.40s'", GS_CONFIG_VERSION, val);
                return -1;
            }
            out->version = GS_CONFIG_VERSION;
            break;
        case K_MEMORY:
            if (strcmp(val, "unlimited") == 0) {
                out->memory_bytes = GS_UNLIMITED;
            } else if (parse_u64(val, &v) != 0 || v == 0 || v == GS_UNLIMITED) {
                snprintf(err, errlen, "memory_bytes must be a positive integer or 'unlimited', got '%.40s'", val);
                return -1;
            } else {
                out->memory_bytes = v;
            }
            break;
        case K_SHARE:
            if (parse_u64(val, &v) != 0 || v < 1 || v > 100) {
                snprintf(err, errlen, "compute_share must be an integer in 1..100, got '%.40s'", val);
                return -1;
            }
            out->compute_share = (int)v;
            break;
        case K_UUID:
            if (gs_parse_uuid(val, out->gpu_uuid) != 0) {
                snprintf(err, errlen, "gpu_uuid must look like GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, got '%.60s'", val);
                return -1;
            }
            memcpy(out->gpu_uuid_text, val, 40);
            out->gpu_uuid_text[40] = '\0';
            break;
        case K_USAGE:
            if (val[0] != '/' || strlen(val) >= sizeof(out->usage_dir) - 16) {
                snprintf(err, errlen, "usage_dir must be an absolute path, got '%.60s'", val);
                return -1;
            }
            strcpy(out->usage_dir, val);
            break;
        case K_OVERHEAD:
            if (parse_u64(val, &v) != 0) {
                snprintf(err, errlen, "context_overhead_bytes must be a non-negative integer, got '%.40s'", val);
                return -1;
            }
            out->context_overhead_bytes = v;
            break;
        default:
            break;
        }
    }
    if ((seen & K_REQUIRED) != K_REQUIRED) {
        static const char *names[] = {"version", "memory_bytes", "compute_share", "gpu_uuid", "usage_dir"};
        for (int i = 0; i < 5; i++) {
            if (!(seen & (1u << i))) {
                snprintf(err, errlen, "required key '%s' is missing", names[i]);
                return -1;
            }
        }
    }
    return 0;
}

int gs_config_load(const char *path, gs_config *out, char *err, size_t errlen)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        snprintf(err, errlen, "cannot open: %s", strerror(errno));
        return -1;
    }
    char *buf = malloc(GS_CONFIG_MAX_BYTES + 1);
    if (buf == NULL) {
        close(fd);
        snprintf(err, errlen, "out of host memory");
        return -1;
    }
    size_t len = 0;
    for (;;) {
        ssize_t r = read(fd, buf + len, GS_CONFIG_MAX_BYTES + 1 - len);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            snprintf(err, errlen, "cannot read: %s", strerror(errno));
            free(buf);
            close(fd);
            return -1;
        }
        if (r == 0) break;
        len += (size_t)r;
        if (len > GS_CONFIG_MAX_BYTES) {
            snprintf(err, errlen, "larger than %d bytes", GS_CONFIG_MAX_BYTES);
            free(buf);
            close(fd);
            return -1;
        }
    }
    close(fd);
    int rc = gs_config_parse(buf, len, out, err, errlen);
    free(buf);
    return rc;
}
