/* State shared by the shim's translation units. Everything here is process-local. */
#ifndef GS_SHIM_H
#define GS_SHIM_H

#include <stdatomic.h>
#include <stdint.h>

#include "gs_config.h"
#include "gs_region.h"

#define GS_EXPORT __attribute__((visibility("default")))
#define GS_LIKELY(x) __builtin_expect(!!(x), 1)
#define GS_UNLIKELY(x) __builtin_expect(!!(x), 0)

enum gs_mode { GS_MODE_UNINIT = 0, GS_MODE_ACTIVE = 1, GS_MODE_FAIL_CLOSED = 2 };

extern _Atomic int gs_mode;
extern gs_config gs_cfg;
extern gs_region gs_reg;
/* The agent's utilization figure: "utilization" next to the config file (read-only in a container). */
extern char gs_util_path[GS_PATH_MAX];

void gs_init_slow(void);

static inline int gs_ensure_init(void)
{
    int m = atomic_load_explicit(&gs_mode, memory_order_acquire);
    if (GS_UNLIKELY(m == GS_MODE_UNINIT)) {
        gs_init_slow();
        m = atomic_load_explicit(&gs_mode, memory_order_acquire);
    }
    return m;
}

/* Writes one line to stderr without stdio (safe from any context). */
void gs_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* --- throttle (gs_throttle.c) --- */
extern _Atomic uint64_t gs_throttle_delay_ns;
extern _Atomic int gs_throttle_started;
extern _Atomic uint64_t gs_throttle_launches;
void gs_throttle_start(void);
void gs_throttle_sleep(uint64_t ns);
void gs_throttle_after_fork_child(void);

static inline void gs_throttle_before_launch(void)
{
    if (GS_UNLIKELY(!atomic_load_explicit(&gs_throttle_started, memory_order_relaxed))) gs_throttle_start();
    /* counted so the throttle's first step can size the delay from the launch period */
    atomic_fetch_add_explicit(&gs_throttle_launches, 1, memory_order_relaxed);
    uint64_t d = atomic_load_explicit(&gs_throttle_delay_ns, memory_order_relaxed);
    if (GS_UNLIKELY(d != 0)) gs_throttle_sleep(d);
}

/* The slice's utilization in percent of the whole GPU, now (the agent's figure when fresh, else NVML
 * per-process samples of the slice's processes over the last second); -1 when unknown. */
double gs_slice_utilization(void);

/* Real NVML entry points the throttle uses to measure utilization (NULL when NVML is absent). */
void *gs_real_nvml(const char *name);

#endif
