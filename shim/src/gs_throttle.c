/*
 * Cooperative compute throttle. A watcher thread, started on the first launch when the share is below
 * 100, measures the slice's utilization every GS_THROTTLE_PERIOD_MS and adjusts one number: the delay
 * each launch sleeps before reaching the driver. An unthrottled launch costs two relaxed loads.
 *
 * Utilization comes from, in order: the figure the node agent writes into the utilization file
 * next to the config (read-only in a container: the tenant cannot fake it; the agent sees host PIDs,
 * so it works inside any PID namespace), if fresher than GS_AGENT_UTIL_MAX_AGE_MS; or NVML
 * per-process utilization summed over the slice's live processes (which only matches while the
 * processes share the driver's PID namespace, i.e. outside containers).
 *
 * The share steered to is the configured one, or, for a burst slice, the allowance the agent writes
 * beside the utilization (the card's idle compute, or the share again once a neighbour runs). The usage region's
 * agent_utilization word is never read: every process of the slice can write the region.
 * With neither, the delay decays to zero (cooperative: the share is steered, never guessed).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <sys/mman.h>
#include <unistd.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <nvml.h>

#include "gs_shim.h"

#define GS_THROTTLE_PERIOD_MS 200
#define GS_AGENT_UTIL_MAX_AGE_MS 3000
#define GS_DELAY_MIN_NS 20000ull       /* first step when utilization exceeds the share */
#define GS_DELAY_MAX_NS 1000000000ull  /* never sleep more than a second per launch */

_Atomic uint64_t gs_throttle_delay_ns;
_Atomic int gs_throttle_started;
_Atomic uint64_t gs_throttle_launches;
static pthread_mutex_t start_lock = PTHREAD_MUTEX_INITIALIZER;

void gs_throttle_sleep(uint64_t ns)
{
    struct timespec ts = {.tv_sec = (time_t)(ns / 1000000000ull), .tv_nsec = (long)(ns % 1000000000ull)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
    atomic_fetch_add_explicit(&gs_reg.hdr->throttled_ns_total, ns, memory_order_relaxed);
    int self = atomic_load_explicit(&gs_reg.self, memory_order_relaxed);
    if (self >= 0) atomic_fetch_add_explicit(&gs_reg.entries[self].throttled_ns, ns, memory_order_relaxed);
}

static uint64_t unix_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

typedef nvmlReturn_t (*init_fn)(void);
typedef nvmlReturn_t (*by_uuid_fn)(const char *, nvmlDevice_t *);
typedef nvmlReturn_t (*proc_util_fn)(nvmlDevice_t, nvmlProcessUtilizationSample_t *, unsigned int *,
                                     unsigned long long);

typedef struct {
    int nvml_state; /* 0 untried, 1 usable, -1 unusable */
    nvmlDevice_t dev;
    proc_util_fn proc_util;
    unsigned long long last_seen_us;
    nvmlProcessUtilizationSample_t samples[256];
} gs_meter;

#define GS_UTIL_UNKNOWN (-1.0) /* no source of utilization: the delay decays */
#define GS_UTIL_NO_NEWS (-2.0) /* the source has no sample newer than the last one: hold the delay */

/* Percent utilization of the slice's processes from NVML, or one of the sentinels above. */
static double nvml_slice_util(gs_meter *m)
{
    if (m->nvml_state == 0) {
        m->nvml_state = -1;
        init_fn init = (init_fn)gs_real_nvml("nvmlInit_v2");
        by_uuid_fn by_uuid = (by_uuid_fn)gs_real_nvml("nvmlDeviceGetHandleByUUID");
        m->proc_util = (proc_util_fn)gs_real_nvml("nvmlDeviceGetProcessUtilization");
        if (init && by_uuid && m->proc_util && init() == NVML_SUCCESS &&
            by_uuid(gs_cfg.gpu_uuid_text, &m->dev) == NVML_SUCCESS)
            m->nvml_state = 1;
    }
    if (m->nvml_state != 1) return GS_UTIL_UNKNOWN;
    unsigned int count = 256;
    nvmlReturn_t rc = m->proc_util(m->dev, m->samples, &count, m->last_seen_us);
    /* NVML samples about every 1/6 s: no sample since the last one is not the same as idle. */
    if (rc == NVML_ERROR_NOT_FOUND || (rc == NVML_SUCCESS && count == 0)) return GS_UTIL_NO_NEWS;
    if (rc == NVML_ERROR_INSUFFICIENT_SIZE) { /* a long history (first call): start from now */
        m->last_seen_us = unix_ms() * 1000u - 500000u;
        return GS_UTIL_NO_NEWS;
    }
    if (rc != NVML_SUCCESS) return GS_UTIL_UNKNOWN;
    /* Mean per process, summed over the slice's processes (own pids, or host pids they learned). */
    double total = 0;
    for (unsigned int i = 0; i < count; i++) {
        unsigned int pid = m->samples[i].pid;
        int first = 1;
        for (unsigned int j = 0; j < i && first; j++) first = m->samples[j].pid != pid;
        if (!first || !gs_region_has_nvml_pid(&gs_reg, (int32_t)pid)) continue;
        double sum = 0;
        int n = 0;
        for (unsigned int j = i; j < count; j++)
            if (m->samples[j].pid == pid) {
                sum += m->samples[j].smUtil;
                n++;
            }
        total += sum / n;
    }
    for (unsigned int i = 0; i < count; i++)
        if (m->samples[i].timeStamp > m->last_seen_us) m->last_seen_us = m->samples[i].timeStamp;
    return total > 100 ? 100 : total;
}

#define GS_UTIL_FILE_SIZE 24 /* "GSUTIL01", the utilization word, the allowance word */

/* The agent's words (0: utilization, 1: the share this slice may use now), mapped read-only once the
 * file exists; 0 while there is none. A file of the older 16-byte layout reads 0 as its allowance
 * (the mapping covers the whole page, zero past the end). */
static uint64_t agent_word_at(int i)
{
    static const _Atomic uint64_t *word;
    if (word == NULL) {
        if (gs_util_path[0] == '\0') return 0;
        int fd = open(gs_util_path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) return 0;
        void *p = mmap(NULL, GS_UTIL_FILE_SIZE, PROT_READ, MAP_SHARED, fd, 0);
        close(fd);
        if (p == MAP_FAILED) return 0;
        if (memcmp(p, "GSUTIL01", 8) != 0) {
            munmap(p, GS_UTIL_FILE_SIZE);
            return 0;
        }
        word = (const _Atomic uint64_t *)((const char *)p + 8);
    }
    return atomic_load(word + i);
}

static uint64_t agent_word(void) { return agent_word_at(0); }

/* The share to steer to now: the agent's allowance while it is fresh (a burst slice on an otherwise
 * idle card may use more than its share), else the configured share. A stale or missing allowance
 * falls back to the share: only the agent, which sees every slice of the card, may lift it. */
static double share_now(void)
{
    uint64_t word = agent_word_at(1);
    uint64_t now = unix_ms();
    if (word != 0 && now >= (word >> 16) && now - (word >> 16) <= GS_AGENT_UTIL_MAX_AGE_MS) {
        double allowed = (double)(word & 0xffffu) / 100.0;
        if (allowed >= 1 && allowed <= 100) return allowed;
    }
    return (double)gs_cfg.compute_share;
}

static double measure(gs_meter *m);

double gs_slice_utilization(void)
{
    static __thread gs_meter *m;
    if (m == NULL && (m = calloc(1, sizeof(*m))) == NULL) return -1;
    m->last_seen_us = unix_ms() * 1000u - 1000000u; /* the last second */
    double u = measure(m);
    return u == GS_UTIL_NO_NEWS ? 0 : u;
}

static double measure(gs_meter *m)
{
    uint64_t word = agent_word();
    uint64_t now = unix_ms();
    if (word != 0 && now >= (word >> 16) && now - (word >> 16) <= GS_AGENT_UTIL_MAX_AGE_MS)
        return (double)(word & 0xffffu) / 100.0;
    return nvml_slice_util(m);
}

/* Multiplicative controller on the per-launch delay: utilization u under delay d behaves roughly like
 * k / (k + d) for kernel time k. Far from the share the delay moves by the full ratio u/share (at most
 * 4x per period), near it by the square root of the ratio, so it settles without oscillating. */
static uint64_t next_delay(uint64_t d, double util, double share)
{
    if (util == GS_UTIL_NO_NEWS) return d;
    if (util < 0) return d / 2; /* no measurement at all: let go */
    double ratio = util / share;
    if (util > share) {
        if (d < GS_DELAY_MIN_NS) return GS_DELAY_MIN_NS;
        double f = ratio > 1.5 ? (ratio > 4 ? 4 : ratio) : sqrt(ratio);
        double nd = (double)d * f;
        return nd > (double)GS_DELAY_MAX_NS ? GS_DELAY_MAX_NS : (uint64_t)nd;
    }
    double f = ratio < 1 / 1.5 ? (ratio < 0.25 ? 0.25 : ratio) : sqrt(ratio);
    uint64_t nd = (uint64_t)((double)d * f);
    return nd < GS_DELAY_MIN_NS / 2 ? 0 : nd;
}

/* The first step from unthrottled, sized from the launch period instead of grown from
 * GS_DELAY_MIN_NS: with kernels of milliseconds the multiplicative steps alone take seconds, and a
 * burst slice must be back at its share within 2 s of a neighbour starting. A launch cycle of c ns at
 * utilization u becomes c * u / share with the delay added; 0.8 of that, the rest left to the steps
 * below. Then the controller holds for two periods while the (lagging) measurement catches up. */
static uint64_t first_delay(double util, double share, uint64_t launches)
{
    if (util < 0 || launches == 0 || util <= 1.5 * share) return 0;
    double cycle = (double)GS_THROTTLE_PERIOD_MS * 1e6 / (double)launches;
    double d = 0.8 * cycle * (util / share - 1);
    return d > (double)GS_DELAY_MAX_NS ? GS_DELAY_MAX_NS : (uint64_t)d;
}

/* The same sizing for a delay already set, when utilization stays above the share by more than 10 %
 * after the hold (the first step was sized on a cycle a neighbour's kernels stretched, and the
 * neighbour then backed off): the cycle grows by c * (u / share - 1), 0.8 of it. */
static uint64_t resize_delay(uint64_t d, double util, double share, uint64_t launches)
{
    if (util < 0 || launches == 0 || util <= 1.1 * share) return 0;
    double cycle = (double)GS_THROTTLE_PERIOD_MS * 1e6 / (double)launches;
    double nd = (double)d + 0.8 * cycle * (util / share - 1);
    return nd > (double)GS_DELAY_MAX_NS ? GS_DELAY_MAX_NS : (uint64_t)nd;
}

static void *watcher(void *arg)
{
    (void)arg;
    static gs_meter meter;
    uint64_t seen = atomic_load(&gs_throttle_launches);
    int hold = 0;
    for (;;) {
        struct timespec ts = {.tv_sec = 0, .tv_nsec = GS_THROTTLE_PERIOD_MS * 1000000L};
        nanosleep(&ts, NULL);
        uint64_t count = atomic_load(&gs_throttle_launches), launches = count - seen;
        seen = count;
        double share = share_now();
        double util = measure(&meter);
        uint64_t d = atomic_load(&gs_throttle_delay_ns), jump = 0;
        if (d < GS_DELAY_MIN_NS && (jump = first_delay(util, share, launches)) > GS_DELAY_MIN_NS) {
            d = jump;
            hold = 2;
        } else if (hold > 0 && util > share) {
            hold--;
        } else if ((jump = resize_delay(d, util, share, launches)) > d) {
            d = jump;
            hold = 2;
        } else {
            hold = 0;
            d = next_delay(d, util, share);
        }
        atomic_store(&gs_throttle_delay_ns, d);
        if (util >= 0) atomic_store(&gs_reg.hdr->shim_utilization, gs_util_encode(unix_ms(), (unsigned)(util * 100)));
        atomic_store(&gs_reg.hdr->throttle_delay_ns, d);
    }
    return NULL;
}

void gs_throttle_start(void)
{
    pthread_mutex_lock(&start_lock);
    if (!atomic_load(&gs_throttle_started) && atomic_load(&gs_mode) == GS_MODE_ACTIVE) {
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old); /* signals stay with the application's threads */
        pthread_t t;
        if (pthread_create(&t, &attr, watcher, NULL) != 0) gs_log("cannot start the compute throttle thread");
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        pthread_attr_destroy(&attr);
    }
    atomic_store(&gs_throttle_started, 1);
    pthread_mutex_unlock(&start_lock);
}

void gs_throttle_after_fork_child(void)
{
    /* The watcher thread does not survive fork; the child starts its own on its first launch. */
    if (atomic_load(&gs_mode) == GS_MODE_ACTIVE && gs_cfg.compute_share < 100) {
        atomic_store(&gs_throttle_started, 0);
        atomic_store(&gs_throttle_delay_ns, 0);
    }
    pthread_mutex_init(&start_lock, NULL);
}
