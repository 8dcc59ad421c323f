/* libFuzzer harness for the shim's slice config parser (built by `make fuzz`, with clang's
 * -fsanitize=fuzzer,address,undefined): whatever bytes the file holds, the parser returns, reads and
 * writes only inside its buffers, and what it accepts is a config the shim can enforce.
 *
 * The differential half (the C parser and the agent's Python parser give the same verdict) runs on
 * the corpus this leaves behind: tests/shim/test_shim_fuzz.py feeds it to config_check.          */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gs_config.h"

static void check(int ok, const char *what)
{
    if (!ok) {
        /* a broken property is a crash to libFuzzer: it saves the input and stops */
        __builtin_trap();
    }
    (void)what;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* an exact-size heap copy: ASan reports a read one byte past the file's end */
    char *text = malloc(size ? size : 1);
    if (text == NULL) return 0;
    memcpy(text, data, size);
    gs_config c, again;
    char err[256], err2[256];
    memset(err, 'x', sizeof(err));
    int rc = gs_config_parse(text, size, &c, err, sizeof(err));
    int rc2 = gs_config_parse(text, size, &again, err2, sizeof(err2));
    check(rc == rc2, "the same bytes give the same verdict");
    if (rc != 0) {
        check(rc == -1, "failure is -1");
        size_t n = strnlen(err, sizeof(err));
        check(n > 0 && n < sizeof(err), "a reason, NUL-terminated");
        check(memchr(err, '\n', n) == NULL, "the reason is one line");
        check(strcmp(err, err2) == 0, "the same reason");
    } else {
        check(memcmp(&c, &again, sizeof(c)) == 0, "the same config");
        check(c.version == GS_CONFIG_VERSION, "version");
        check(c.memory_bytes > 0, "a memory limit");
        check(c.compute_share >= 1 && c.compute_share <= 100, "share in 1..100");
        check(strnlen(c.gpu_uuid_text, sizeof(c.gpu_uuid_text)) == 40, "uuid text");
        unsigned char uuid[16];
        check(gs_parse_uuid(c.gpu_uuid_text, uuid) == 0 && memcmp(uuid, c.gpu_uuid, 16) == 0, "uuid bytes");
        size_t dir = strnlen(c.usage_dir, sizeof(c.usage_dir));
        check(dir < sizeof(c.usage_dir) && c.usage_dir[0] == '/', "absolute usage dir");
        check(memchr(c.usage_dir, '\n', dir) == NULL, "usage dir on one line");
    }
    free(text);
    return 0;
}
