/* Fake libnvidia-ml.so.1, card health: XID events (nvmlEventSetCreate / nvmlDeviceRegisterEvents /
 * nvmlEventSetWait_v2, as the driver delivers nvmlEventTypeXidCriticalError), pending page
 * retirements and row remaps. The faults come from the shared health state (fake_health.h). */
#define _GNU_SOURCE
#define NVML_NO_UNVERSIONED_FUNC_DEFS
#include <nvml.h>
#include <errno.h>
#include <linux/futex.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "fake_health.h"
#include "fake_nvml.h"

#define SET_MAGIC 0x45564e54u
#define SUPPORTED_EVENTS (nvmlEventTypeXidCriticalError | nvmlEventTypeDoubleBitEccError | nvmlEventTypeSingleBitEccError)

struct nvmlEventSet_st {
    uint32_t magic;
    uint32_t next; /* the next sequence number to look at */
    unsigned long long types[FAKE_MAX_GPUS]; /* registered event types, by visible index */
    uint32_t registered_at[FAKE_MAX_GPUS];   /* sequence number when the device was registered */
};

FAKE_EXPORT nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    if (!fake_nvml_initialized()) return NVML_ERROR_UNINITIALIZED;
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    fake_health_state *h = fake_health();
    if (!h) return NVML_ERROR_UNKNOWN;
    struct nvmlEventSet_st *e = calloc(1, sizeof(*e));
    if (!e) return NVML_ERROR_MEMORY;
    e->magic = SET_MAGIC;
    e->next = atomic_load(&h->seq) + 1;
    *set = e;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    if (!fake_nvml_initialized()) return NVML_ERROR_UNINITIALIZED;
    if (!set || set->magic != SET_MAGIC) return NVML_ERROR_INVALID_ARGUMENT;
    set->magic = 0;
    free(set);
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t dev, unsigned long long *types)
{
    CHECK_CARD(dev);
    if (!types) return NVML_ERROR_INVALID_ARGUMENT;
    *types = SUPPORTED_EVENTS;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t dev, unsigned long long types, nvmlEventSet_t set)
{
    GET_CARD(dev, i);
    if (!set || set->magic != SET_MAGIC || types == 0) return NVML_ERROR_INVALID_ARGUMENT;
    set->types[i] |= types & SUPPORTED_EVENTS;
    set->registered_at[i] = atomic_load(&fake_health()->seq);
    return (types & ~SUPPORTED_EVENTS) ? NVML_ERROR_NOT_SUPPORTED : NVML_SUCCESS;
}

/* The first deliverable event from set->next on; 1 when `data` was filled. */
static int take_event(struct nvmlEventSet_st *set, fake_health_state *h, nvmlEventData_t *data)
{
    uint32_t cur = atomic_load_explicit(&h->seq, memory_order_acquire);
    if (cur + 1 - set->next > FAKE_HEALTH_RING) set->next = cur + 1 - FAKE_HEALTH_RING; /* overrun: lost */
    for (; set->next <= cur; set->next++) {
        fake_xid_event *e = &h->ring[set->next % FAKE_HEALTH_RING];
        if (atomic_load_explicit(&e->seq, memory_order_acquire) != set->next) continue;
        int i = fake_health_visible_index(e->gpu);
        if (i < 0 || !(set->types[i] & nvmlEventTypeXidCriticalError) || set->next <= set->registered_at[i]) continue;
        fake_system *s = fake_system_get();
        *data = (nvmlEventData_t){(nvmlDevice_t)(void *)&s->gpus[i], nvmlEventTypeXidCriticalError, e->xid,
                                  0xFFFFFFFFu, 0xFFFFFFFFu};
        set->next++;
        return 1;
    }
    return 0;
}

FAKE_EXPORT nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    if (!fake_nvml_initialized()) return NVML_ERROR_UNINITIALIZED;
    if (!set || set->magic != SET_MAGIC || !data) return NVML_ERROR_INVALID_ARGUMENT;
    fake_health_state *h = fake_health();
    if (!h) return NVML_ERROR_UNKNOWN;
    uint64_t deadline = fake_now_ns() + (uint64_t)timeoutms * 1000000ull;
    for (;;) {
        uint32_t seen = atomic_load_explicit(&h->seq, memory_order_acquire);
        if (take_event(set, h, data)) return NVML_SUCCESS;
        uint64_t now = fake_now_ns();
        if (now >= deadline) return NVML_ERROR_TIMEOUT;
        uint64_t left = deadline - now;
        struct timespec ts = {(time_t)(left / 1000000000ull), (long)(left % 1000000000ull)};
        /* Sleeps until the fault tool bumps the sequence (or the time is up), like a driver wait. */
        syscall(SYS_futex, &h->seq, FUTEX_WAIT, seen, &ts, NULL, 0);
    }
}

FAKE_EXPORT nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    return nvmlEventSetWait_v2(set, data, timeoutms);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t dev, nvmlEnableState_t *isPending)
{
    GET_CARD(dev, i);
    if (!isPending) return NVML_ERROR_INVALID_ARGUMENT;
    fake_gpu_health *g = fake_health_of(i);
    *isPending = g && atomic_load(&g->retired_pages_pending) ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t dev, unsigned int *corrRows, unsigned int *uncRows,
                                                   unsigned int *isPending, unsigned int *failureOccurred)
{
    GET_CARD(dev, i);
    if (!corrRows || !uncRows || !isPending || !failureOccurred) return NVML_ERROR_INVALID_ARGUMENT;
    if (fake_system_get()->gpus[i].cc_major < 8) return NVML_ERROR_NOT_SUPPORTED; /* row remapping: Ampere on */
    fake_gpu_health *g = fake_health_of(i);
    *isPending = g && atomic_load(&g->remap_pending);
    *failureOccurred = g && atomic_load(&g->remap_failed);
    *corrRows = 0;
    *uncRows = *isPending || *failureOccurred;
    return NVML_SUCCESS;
}
