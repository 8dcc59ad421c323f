/* Fake libnvidia-ml.so.1: the NVML subset pynvml, the node agent and the shim use, answering from
 * the same GPU description and cross-process state as the fake libcuda. */
#define _GNU_SOURCE
#define NVML_NO_UNVERSIONED_FUNC_DEFS
#include <nvml.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "fake_common.h"
#include "fake_health.h"
#include "fake_nvml.h"
#include "fake_nvml_mig.h"

static _Atomic int init_count;

int fake_nvml_initialized(void) { return atomic_load(&init_count) > 0; } /* for fake_nvml_health.c */

#define CHECK_INIT()                                                                                     \
    do {                                                                                                 \
        if (atomic_load(&init_count) <= 0) return NVML_ERROR_UNINITIALIZED;                             \
    } while (0)

/* A handle is a pointer to the GPU's description (as opaque as the driver's). */
int fake_nvml_card(nvmlDevice_t dev, nvmlReturn_t *rc)
{
    if (atomic_load(&init_count) <= 0) {
        *rc = NVML_ERROR_UNINITIALIZED;
        return -1;
    }
    fake_system *s = fake_system_get();
    fake_gpu *g = (fake_gpu *)(void *)dev;
    if (!s || g < s->gpus || g >= s->gpus + s->count) {
        *rc = NVML_ERROR_INVALID_ARGUMENT;
        return -1;
    }
    int i = (int)(g - s->gpus);
    if (fake_health_lost(i)) {
        *rc = NVML_ERROR_GPU_IS_LOST;
        return -1;
    }
    return i;
}

static int index_of(const fake_gpu *g)
{
    return (int)(g - fake_system_get()->gpus);
}

/* Declares fake_gpu *g, the card's description, or returns the failed check's error. */
#define GET_GPU(dev, g)                                                                                  \
    GET_CARD(dev, g##_index);                                                                            \
    fake_gpu *g = &fake_system_get()->gpus[g##_index]

/* A getter of one value of a card: the checks, the output pointer, then the value (an expression of
 * the card g, or a constant). */
#define CARD_VALUE(fn, type, value)                                                                      \
    FAKE_EXPORT nvmlReturn_t fn(nvmlDevice_t dev, type *out)                                            \
    {                                                                                                    \
        GET_GPU(dev, g);                                                                                 \
        (void)g;                                                                                         \
        if (!out) return NVML_ERROR_INVALID_ARGUMENT;                                                    \
        *out = (value);                                                                                  \
        return NVML_SUCCESS;                                                                             \
    }

/* A getter of one string of a card, NVML's way (buffer and length). */
#define CARD_STRING(fn, value)                                                                           \
    FAKE_EXPORT nvmlReturn_t fn(nvmlDevice_t dev, char *out, unsigned int length)                        \
    {                                                                                                    \
        GET_GPU(dev, g);                                                                                 \
        (void)g;                                                                                         \
        return copy_str(out, length, (value));                                                           \
    }

FAKE_EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    if (!fake_system_get()) return NVML_ERROR_DRIVER_NOT_LOADED;
    atomic_fetch_add(&init_count, 1);
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlInit_v2(void)
{
    return nvmlInitWithFlags(0);
}

FAKE_EXPORT nvmlReturn_t nvmlInit(void)
{
    return nvmlInitWithFlags(0);
}

FAKE_EXPORT nvmlReturn_t nvmlShutdown(void)
{
    CHECK_INIT();
    atomic_fetch_sub(&init_count, 1);
    return NVML_SUCCESS;
}

FAKE_EXPORT const char *nvmlErrorString(nvmlReturn_t r)
{
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument Version Mismatch";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_INSUFFICIENT_RESOURCES: return "Insufficient resources";
    default: return "Unknown Error";
    }
}

static nvmlReturn_t copy_str(char *dst, unsigned int len, const char *src)
{
    if (!dst) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > len) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, strlen(src) + 1);
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    CHECK_INIT();
    return copy_str(version, length, fake_system_get()->driver_version);
}

FAKE_EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    CHECK_INIT();
    char buf[48];
    int cv = fake_system_get()->cuda_driver_version;
    snprintf(buf, sizeof(buf), "%d.%s", cv / 1000, fake_system_get()->driver_version);
    return copy_str(version, length, buf);
}

FAKE_EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v)
{
    if (!v) return NVML_ERROR_INVALID_ARGUMENT;
    fake_system *s = fake_system_get();
    if (!s) return NVML_ERROR_LIBRARY_NOT_FOUND;
    *v = s->cuda_driver_version;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v)
{
    return nvmlSystemGetCudaDriverVersion(v);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    CHECK_INIT();
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = (unsigned int)fake_system_get()->count;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *count)
{
    return nvmlDeviceGetCount_v2(count);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    CHECK_INIT();
    if (!device || index >= (unsigned int)fake_system_get()->count) return NVML_ERROR_INVALID_ARGUMENT;
    if (fake_health_lost((int)index)) return NVML_ERROR_GPU_IS_LOST;
    *device = (nvmlDevice_t)(void *)&fake_system_get()->gpus[index];
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    CHECK_INIT();
    if (!uuid || !device) return NVML_ERROR_INVALID_ARGUMENT;
    if (fake_health_any_lost()) return NVML_ERROR_GPU_IS_LOST; /* as documented: "if any GPU" is lost */
    if (strncasecmp(uuid, "MIG-", 4) == 0) return fake_nvml_mig_by_uuid(uuid, device);
    fake_system *s = fake_system_get();
    for (int i = 0; i < s->count; i++)
        if (strcasecmp(s->gpus[i].uuid, uuid) == 0) {
            *device = (nvmlDevice_t)(void *)&s->gpus[i];
            return NVML_SUCCESS;
        }
    return NVML_ERROR_NOT_FOUND;
}

static void bus_id(const fake_gpu *g, char *out, size_t n)
{
    snprintf(out, n, "%08X:%02X:%02X.0", g->pci_domain, g->pci_bus, g->pci_device);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device)
{
    CHECK_INIT();
    if (!pciBusId || !device) return NVML_ERROR_INVALID_ARGUMENT;
    fake_system *s = fake_system_get();
    for (int i = 0; i < s->count; i++) {
        char id[32];
        bus_id(&s->gpus[i], id, sizeof(id));
        if (strcasecmp(id, pciBusId) == 0 || strcasecmp(id + 4, pciBusId) == 0) {
            *device = (nvmlDevice_t)(void *)&s->gpus[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

CARD_VALUE(nvmlDeviceGetIndex, unsigned int, (unsigned int)index_of(g))
/* A MIG device handle answers with its own name and UUID (fake_nvml_mig.c). */
static nvmlReturn_t card_string(nvmlDevice_t dev, char *out, unsigned int length, int uuid)
{
    if (fake_nvml_is_mig_handle(dev)) {
        fake_nvml_mig_info m;
        nvmlReturn_t rc = fake_nvml_mig_describe(dev, &m);
        return rc != NVML_SUCCESS ? rc : copy_str(out, length, uuid ? m.uuid : m.name);
    }
    GET_GPU(dev, g);
    return copy_str(out, length, uuid ? g->uuid : g->name);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t dev, char *out, unsigned int length)
{
    return card_string(dev, out, length, 0);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t dev, char *out, unsigned int length)
{
    return card_string(dev, out, length, 1);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t dev, char *serial, unsigned int length)
{
    GET_GPU(dev, g);
    if (!g->serial[0]) return NVML_ERROR_NOT_SUPPORTED;
    return copy_str(serial, length, g->serial);
}

CARD_VALUE(nvmlDeviceGetMinorNumber, unsigned int, g->minor)

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t dev, int *major, int *minor)
{
    GET_GPU(dev, g);
    if (!major || !minor) return NVML_ERROR_INVALID_ARGUMENT;
    *major = g->cc_major;
    *minor = g->cc_minor;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetArchitecture(nvmlDevice_t dev, nvmlDeviceArchitecture_t *arch)
{
    GET_GPU(dev, g);
    if (!arch) return NVML_ERROR_INVALID_ARGUMENT;
    int cc = g->cc_major * 10 + g->cc_minor;
    *arch = cc >= 90 ? NVML_DEVICE_ARCH_HOPPER
            : cc >= 80 ? NVML_DEVICE_ARCH_AMPERE
            : cc >= 75 ? NVML_DEVICE_ARCH_TURING
            : cc >= 70 ? NVML_DEVICE_ARCH_VOLTA
                       : NVML_DEVICE_ARCH_PASCAL;
    return NVML_SUCCESS;
}

/* nvmlDeviceGetMigMode and the rest of MIG: fake_nvml_mig.c. */

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t dev, nvmlPciInfo_t *pci)
{
    GET_GPU(dev, g);
    if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
    memset(pci, 0, sizeof(*pci));
    bus_id(g, pci->busId, sizeof(pci->busId));
    snprintf(pci->busIdLegacy, sizeof(pci->busIdLegacy), "%04X:%02X:%02X.0", g->pci_domain & 0xffff, g->pci_bus,
             g->pci_device);
    pci->domain = g->pci_domain;
    pci->bus = g->pci_bus;
    pci->device = g->pci_device;
    pci->pciDeviceId = g->pci_device_id;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t dev, nvmlPciInfo_t *pci)
{
    return nvmlDeviceGetPciInfo_v3(dev, pci);
}

static uint64_t used_on(const fake_gpu *g)
{
    fake_dev_state *s = fake_system_get()->state[index_of(g)];
    fake_lock(s);
    uint64_t used = fake_used_locked(s);
    fake_unlock(s);
    return used + fake_nvml_mig_card_used(index_of(g)); /* the card's memory includes its GPU instances' */
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *memory)
{
    if (fake_nvml_is_mig_handle(dev)) { /* a MIG device: its GPU instance's memory */
        fake_nvml_mig_info m;
        nvmlReturn_t rc = fake_nvml_mig_describe(dev, &m);
        if (rc != NVML_SUCCESS || !memory) return rc != NVML_SUCCESS ? rc : NVML_ERROR_INVALID_ARGUMENT;
        uint64_t used = m.used_bytes < m.memory_bytes ? m.used_bytes : m.memory_bytes;
        *memory = (nvmlMemory_t){m.memory_bytes, m.memory_bytes - used, used};
        return NVML_SUCCESS;
    }
    GET_GPU(dev, g);
    if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
    uint64_t used = used_on(g);
    memory->total = g->memory_bytes;
    memory->used = used;
    memory->free = used < g->memory_bytes ? g->memory_bytes - used : 0;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *memory)
{
    if (fake_nvml_is_mig_handle(dev)) {
        nvmlMemory_t m;
        nvmlReturn_t rc = nvmlDeviceGetMemoryInfo(dev, &m);
        if (rc != NVML_SUCCESS || !memory) return rc != NVML_SUCCESS ? rc : NVML_ERROR_INVALID_ARGUMENT;
        if (memory->version != nvmlMemory_v2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
        memory->total = m.total, memory->reserved = 0, memory->used = m.used, memory->free = m.free;
        return NVML_SUCCESS;
    }
    GET_GPU(dev, g);
    if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != nvmlMemory_v2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    uint64_t used = used_on(g);
    memory->total = g->memory_bytes;
    memory->reserved = 0;
    memory->used = used;
    memory->free = used < g->memory_bytes ? g->memory_bytes - used : 0;
    return NVML_SUCCESS;
}

/* The device's utilization over the last second (as NVML's sampling window roughly is), in percent:
 * also what clocks, power and temperature follow. */
static unsigned busy_percent(const fake_gpu *g)
{
    uint64_t now = fake_now_ns(), window = 1000000000ull;
    uint64_t busy = fake_busy_between(fake_system_get()->state[index_of(g)], 0, now - window, now);
    return (unsigned)(busy * 100 / window);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t dev, nvmlUtilization_t *util)
{
    GET_GPU(dev, g);
    if (!util) return NVML_ERROR_INVALID_ARGUMENT;
    util->gpu = busy_percent(g);
    util->memory = 0;
    return NVML_SUCCESS;
}

static uint64_t mono_to_unix_us(uint64_t mono_ns)
{
    struct timespec rt;
    clock_gettime(CLOCK_REALTIME, &rt);
    uint64_t now_rt_us = (uint64_t)rt.tv_sec * 1000000ull + (uint64_t)rt.tv_nsec / 1000ull;
    uint64_t now_mono = fake_now_ns();
    return now_rt_us - (now_mono - mono_ns) / 1000ull;
}

/* One sample per process that ran kernels since lastSeenTimeStamp (at most the last second): its SM
 * utilization over that window. NOT_FOUND when none did, INSUFFICIENT_SIZE (with the count) when
 * `samples` is NULL or holds fewer than *count. */
static nvmlReturn_t process_samples(nvmlDevice_t dev, nvmlProcessUtilizationInfo_v1_t *samples, unsigned int *count,
                                    unsigned long long lastSeenTimeStamp)
{
    GET_GPU(dev, g);
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    fake_dev_state *s = fake_system_get()->state[index_of(g)];
    uint64_t now = fake_now_ns();
    uint64_t now_us = mono_to_unix_us(now);
    uint64_t window_us = 1000000ull;
    if (lastSeenTimeStamp && lastSeenTimeStamp < now_us && now_us - lastSeenTimeStamp < window_us)
        window_us = now_us - lastSeenTimeStamp;
    if (window_us == 0) return NVML_ERROR_NOT_FOUND;
    /* Processes that ran kernels in the window, from the device's busy timeline. */
    int32_t pids[FAKE_MAX_PROCS];
    int n = 0;
    uint64_t from = now - window_us * 1000ull;
    fake_lock(s);
    uint64_t head = atomic_load(&s->ring_head);
    for (uint64_t k = 0; k < (head < FAKE_RING ? head : FAKE_RING); k++) {
        fake_busy *b = &s->ring[(head - 1 - k) % FAKE_RING];
        if (b->end_ns <= from) break;
        int seen = 0;
        for (int i = 0; i < n; i++) seen |= pids[i] == b->pid;
        if (!seen && n < FAKE_MAX_PROCS) pids[n++] = b->pid;
    }
    fake_unlock(s);
    if (n == 0) return NVML_ERROR_NOT_FOUND;
    if (!samples || *count < (unsigned int)n) {
        *count = (unsigned int)n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (int i = 0; i < n; i++) {
        uint64_t busy = fake_busy_between(s, pids[i], now - window_us * 1000ull, now);
        uint64_t pct = busy / 10ull / window_us; /* busy_ns * 100 / (window_us * 1000) */
        samples[i] = (nvmlProcessUtilizationInfo_v1_t){.timeStamp = now_us,
                                                       .pid = (unsigned int)pids[i],
                                                       .smUtil = (unsigned int)(pct > 100 ? 100 : pct)};
    }
    *count = (unsigned int)n;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t dev, nvmlProcessUtilizationSample_t *samples,
                                                         unsigned int *count, unsigned long long lastSeenTimeStamp)
{
    CHECK_CARD(dev);
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int cap = samples ? *count : 0;
    nvmlProcessUtilizationInfo_v1_t buf[FAKE_MAX_PROCS];
    unsigned int n = cap < FAKE_MAX_PROCS ? cap : FAKE_MAX_PROCS;
    nvmlReturn_t rc = process_samples(dev, samples ? buf : NULL, samples ? &n : count, lastSeenTimeStamp);
    if (!samples || rc != NVML_SUCCESS) {
        if (samples && rc == NVML_ERROR_INSUFFICIENT_SIZE) *count = n;
        return rc;
    }
    for (unsigned int i = 0; i < n; i++)
        samples[i] = (nvmlProcessUtilizationSample_t){buf[i].pid, buf[i].timeStamp, buf[i].smUtil, 0, 0, 0};
    *count = n;
    return NVML_SUCCESS;
}

/* The layouts of a process record: nvmlProcessInfo_v1_t, _v2_t (= the v3 API's nvmlProcessInfo_t) and
 * nvmlProcessDetail_v1_t (nvmlDeviceGetRunningProcessDetailList). */
enum { REC_V1, REC_V2, REC_DETAIL };

/* nvmlProcessDetailList_t.mode (nvml.h documents the values, 0-2, without names; pynvml's). */
enum { NVML_PROCESS_MODE_COMPUTE, NVML_PROCESS_MODE_GRAPHICS, NVML_PROCESS_MODE_MPS };

static size_t rec_size(int layout)
{
    return layout == REC_V1 ? sizeof(nvmlProcessInfo_v1_t)
           : layout == REC_V2 ? sizeof(nvmlProcessInfo_v2_t)
                              : sizeof(nvmlProcessDetail_v1_t);
}

/* Running processes of one kind with their memory, like the driver lists them. Every context the
 * double makes is a compute context, and no MPS server runs on it: the graphics and MPS lists are
 * empty (the driver's answer on a headless data-center card: NVML_SUCCESS, count 0). */
static nvmlReturn_t running(nvmlDevice_t dev, unsigned int *count, void *infos, int layout, unsigned int mode)
{
    /* Whose processes: a card's own and, in MIG mode, its GPU instances' (with their instance ids); a
     * MIG device's: its GPU instance's (fake_nvml_mig.c). */
    fake_nvml_mig_procs lists[1 + FAKE_NVML_MIG_MAX_LISTS];
    int nl, card, mig = fake_nvml_is_mig_handle(dev);
    if (mig) {
        nvmlReturn_t why;
        nl = fake_nvml_mig_proc_lists(dev, -1, lists, FAKE_NVML_MIG_MAX_LISTS, &card, &why);
        if (nl < 0) return why;
    } else {
        GET_CARD(dev, i);
        card = i;
        lists[0] = (fake_nvml_mig_procs){fake_system_get()->state[i], 0xFFFFFFFFu, 0xFFFFFFFFu};
        nvmlReturn_t why;
        nl = 1 + fake_nvml_mig_proc_lists(dev, i, lists + 1, FAKE_NVML_MIG_MAX_LISTS, &card, &why);
    }
    const fake_gpu *g = &fake_system_get()->gpus[card];
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    if (mode == NVML_PROCESS_MODE_MPS && g->cc_major < 7) return NVML_ERROR_NOT_SUPPORTED; /* Volta on */
    unsigned int n = 0, cap = *count;
    nvmlReturn_t rc = NVML_SUCCESS;
    if (mode != NVML_PROCESS_MODE_COMPUTE) {
        *count = 0;
        return NVML_SUCCESS;
    }
    size_t stride = rec_size(layout);
    for (int l = 0; l < nl; l++) {
        fake_dev_state *s = lists[l].state;
        unsigned gi = lists[l].gi, ci = lists[l].ci;
        int own = l == 0 && !mig; /* the card's own state; instances' are read-only views here */
        if (own) {
            fake_lock(s);
            (void)fake_used_locked(s);
        }
        for (int i = 0; i < FAKE_MAX_PROCS; i++) {
            fake_proc *p = &s->procs[i];
            if (!p->pid || (!own && !fake_proc_alive(p))) continue;
            uint64_t used = atomic_load(&p->used);
            /* Like the real driver: a process is listed from its first context on, memory or not. */
            if (used == 0 && atomic_load(&p->contexts) == 0) continue;
            if (infos && n < cap) {
                char *slot = (char *)infos + n * stride;
                if (layout == REC_V1) {
                    nvmlProcessInfo_v1_t e = {(unsigned int)p->pid, used};
                    memcpy(slot, &e, sizeof(e));
                } else if (layout == REC_V2) {
                    nvmlProcessInfo_v2_t e = {(unsigned int)p->pid, used, gi, ci};
                    memcpy(slot, &e, sizeof(e));
                } else {
                    nvmlProcessDetail_v1_t e = {(unsigned int)p->pid, used, gi, ci, 0};
                    memcpy(slot, &e, sizeof(e));
                }
            } else {
                rc = NVML_ERROR_INSUFFICIENT_SIZE;
            }
            n++;
        }
        if (own) fake_unlock(s);
    }
    *count = n;
    return rc;
}

#define RUNNING_LIST(fn, type, layout, mode)                                                             \
    FAKE_EXPORT nvmlReturn_t fn(nvmlDevice_t dev, unsigned int *count, type *infos)                      \
    {                                                                                                    \
        return running(dev, count, infos, layout, mode);                                                 \
    }

RUNNING_LIST(nvmlDeviceGetComputeRunningProcesses, nvmlProcessInfo_v1_t, REC_V1, NVML_PROCESS_MODE_COMPUTE)
RUNNING_LIST(nvmlDeviceGetComputeRunningProcesses_v2, nvmlProcessInfo_v2_t, REC_V2, NVML_PROCESS_MODE_COMPUTE)
RUNNING_LIST(nvmlDeviceGetComputeRunningProcesses_v3, nvmlProcessInfo_t, REC_V2, NVML_PROCESS_MODE_COMPUTE)
RUNNING_LIST(nvmlDeviceGetGraphicsRunningProcesses, nvmlProcessInfo_v1_t, REC_V1, NVML_PROCESS_MODE_GRAPHICS)
RUNNING_LIST(nvmlDeviceGetGraphicsRunningProcesses_v2, nvmlProcessInfo_v2_t, REC_V2, NVML_PROCESS_MODE_GRAPHICS)
RUNNING_LIST(nvmlDeviceGetGraphicsRunningProcesses_v3, nvmlProcessInfo_t, REC_V2, NVML_PROCESS_MODE_GRAPHICS)
RUNNING_LIST(nvmlDeviceGetMPSComputeRunningProcesses, nvmlProcessInfo_v1_t, REC_V1, NVML_PROCESS_MODE_MPS)
RUNNING_LIST(nvmlDeviceGetMPSComputeRunningProcesses_v2, nvmlProcessInfo_v2_t, REC_V2, NVML_PROCESS_MODE_MPS)
RUNNING_LIST(nvmlDeviceGetMPSComputeRunningProcesses_v3, nvmlProcessInfo_t, REC_V2, NVML_PROCESS_MODE_MPS)

/* The driver branch the double plays, as a number (535, 580). Entry points a branch's library does
 * not have answer NVML_ERROR_FUNCTION_NOT_FOUND there: one library plays every branch, so it
 * exports the newest's names (tests/shim/test_nvml_api_family.py). */
static int driver_branch(void)
{
    return atoi(fake_system_get()->driver_version);
}

/* All processes of one mode in one call, with their conf-compute protected memory (0: CC is off). */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetRunningProcessDetailList(nvmlDevice_t dev, nvmlProcessDetailList_t *plist)
{
    CHECK_CARD(dev);
    if (!plist || plist->version != nvmlProcessDetailList_v1 || plist->mode > NVML_PROCESS_MODE_MPS)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int n = plist->procArray ? plist->numProcArrayEntries : 0;
    nvmlReturn_t rc = running(dev, &n, plist->procArray, REC_DETAIL, plist->mode);
    plist->numProcArrayEntries = n;
    return rc;
}

/* Per-process utilization, the struct-versioned call of the 550 and later branches. */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetProcessesUtilizationInfo(nvmlDevice_t dev,
                                                               nvmlProcessesUtilizationInfo_t *info)
{
    CHECK_CARD(dev);
    if (driver_branch() < 550) return NVML_ERROR_FUNCTION_NOT_FOUND;
    if (!info) return NVML_ERROR_INVALID_ARGUMENT;
    if (info->version != nvmlProcessesUtilizationInfo_v1) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    return process_samples(dev, info->procUtilArray, &info->processSamplesCount, info->lastSeenTimeStamp);
}

/* ---------------------------------------------------------------- what monitoring tools read */

/* Board values per model (nvidia-smi -q of each card): power limit, BAR1 aperture, PCIe link, clocks. */
typedef struct {
    const char *name;
    unsigned power_limit_w, idle_w, bar1_mib, pcie_gen, sm_mhz, mem_mhz;
    nvmlBrandType_t brand;
    unsigned bus_bits; /* memory bus width */
} nvml_model;

static const nvml_model nvml_models[] = {
    {"Tesla V100-PCIE-32GB", 250, 25, 32768, 3, 1380, 877, NVML_BRAND_TESLA, 4096},
    {"Tesla V100-PCIE-16GB", 250, 25, 16384, 3, 1380, 877, NVML_BRAND_TESLA, 4096},
    {"Tesla V100-SXM2-16GB", 300, 40, 16384, 3, 1530, 877, NVML_BRAND_TESLA, 4096},
    {"Tesla V100-SXM2-32GB", 300, 40, 32768, 3, 1530, 877, NVML_BRAND_TESLA, 4096},
    {"Tesla T4", 70, 10, 256, 3, 1590, 5001, NVML_BRAND_NVIDIA, 256},
    {"NVIDIA A100-SXM4-40GB", 400, 50, 65536, 4, 1410, 1215, NVML_BRAND_NVIDIA, 5120},
    {"NVIDIA A100-PCIE-40GB", 250, 35, 65536, 4, 1410, 1215, NVML_BRAND_NVIDIA, 5120},
    {"NVIDIA A100-SXM4-80GB", 400, 50, 131072, 4, 1410, 1593, NVML_BRAND_NVIDIA, 5120},
    {"NVIDIA H100 80GB HBM3", 700, 70, 131072, 5, 1980, 2619, NVML_BRAND_NVIDIA, 5120},
};

static const nvml_model *model_of(const fake_gpu *g)
{
    for (size_t i = 0; i < sizeof(nvml_models) / sizeof(nvml_models[0]); i++)
        if (strcmp(nvml_models[i].name, g->name) == 0) return &nvml_models[i];
    return &nvml_models[0];
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetBAR1MemoryInfo(nvmlDevice_t dev, nvmlBAR1Memory_t *bar1)
{
    if (fake_nvml_is_mig_handle(dev)) { /* a MIG device: its memory slices' share of the card's aperture */
        fake_nvml_mig_info m;
        nvmlReturn_t rc = fake_nvml_mig_describe(dev, &m);
        if (rc != NVML_SUCCESS || !bar1) return rc != NVML_SUCCESS ? rc : NVML_ERROR_INVALID_ARGUMENT;
        uint64_t total = ((unsigned long long)model_of(&fake_system_get()->gpus[m.card])->bar1_mib << 20) *
                         m.memory_slices / 8;
        *bar1 = (nvmlBAR1Memory_t){total, total, 0};
        return NVML_SUCCESS;
    }
    GET_GPU(dev, g);
    if (!bar1) return NVML_ERROR_INVALID_ARGUMENT;
    bar1->bar1Total = (unsigned long long)model_of(g)->bar1_mib << 20;
    bar1->bar1Used = 2ull << 20;
    bar1->bar1Free = bar1->bar1Total - bar1->bar1Used;
    return NVML_SUCCESS;
}

/* The draw in mW: from idle to the power limit with the utilization. */
static unsigned power_mw(const fake_gpu *g)
{
    const nvml_model *m = model_of(g);
    return (m->idle_w + (m->power_limit_w - m->idle_w) * busy_percent(g) / 100) * 1000;
}

CARD_VALUE(nvmlDeviceGetPowerUsage, unsigned int, power_mw(g))
/* Energy since the driver loaded, in mJ: the idle draw over the system's uptime (monotonic). */
CARD_VALUE(nvmlDeviceGetTotalEnergyConsumption, unsigned long long,
           (unsigned long long)model_of(g)->idle_w * (fake_now_ns() / 1000000ull))
CARD_VALUE(nvmlDeviceGetPowerManagementLimit, unsigned int, model_of(g)->power_limit_w * 1000)
CARD_VALUE(nvmlDeviceGetPowerManagementDefaultLimit, unsigned int, model_of(g)->power_limit_w * 1000)
CARD_VALUE(nvmlDeviceGetEnforcedPowerLimit, unsigned int, model_of(g)->power_limit_w * 1000)

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetPowerManagementLimitConstraints(nvmlDevice_t dev, unsigned int *min_mw,
                                                                      unsigned int *max_mw)
{
    GET_GPU(dev, g);
    if (!min_mw || !max_mw) return NVML_ERROR_INVALID_ARGUMENT;
    *max_mw = model_of(g)->power_limit_w * 1000;
    *min_mw = *max_mw / 2;
    return NVML_SUCCESS;
}

CARD_VALUE(nvmlDeviceGetPowerManagementMode, nvmlEnableState_t, NVML_FEATURE_ENABLED)

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t dev, nvmlTemperatureSensors_t sensor, unsigned int *t)
{
    GET_GPU(dev, g);
    if (!t || sensor != NVML_TEMPERATURE_GPU) return NVML_ERROR_INVALID_ARGUMENT;
    *t = 33 + busy_percent(g) * 40 / 100;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetTemperatureThreshold(nvmlDevice_t dev, nvmlTemperatureThresholds_t type,
                                                           unsigned int *t)
{
    CHECK_CARD(dev);
    if (!t) return NVML_ERROR_INVALID_ARGUMENT;
    switch (type) {
    case NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: *t = 90; break;
    case NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: *t = 87; break;
    case NVML_TEMPERATURE_THRESHOLD_MEM_MAX: *t = 95; break;
    case NVML_TEMPERATURE_THRESHOLD_GPU_MAX: *t = 83; break;
    default: return NVML_ERROR_NOT_SUPPORTED;
    }
    return NVML_SUCCESS;
}

/* Passively cooled data-center boards have no fan of their own. */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetFanSpeed(nvmlDevice_t dev, unsigned int *speed)
{
    (void)speed;
    CHECK_CARD(dev);
    return NVML_ERROR_NOT_SUPPORTED;
}

CARD_VALUE(nvmlDeviceGetNumFans, unsigned int, 0)

static unsigned clock_mhz(const fake_gpu *g, nvmlClockType_t type, int max)
{
    const nvml_model *m = model_of(g);
    switch (type) {
    case NVML_CLOCK_GRAPHICS:
    case NVML_CLOCK_SM: return max || busy_percent(g) > 0 ? m->sm_mhz : 135;
    case NVML_CLOCK_MEM: return m->mem_mhz;
    case NVML_CLOCK_VIDEO: return max || busy_percent(g) > 0 ? m->sm_mhz * 9 / 10 : 555;
    default: return 0;
    }
}

static nvmlReturn_t clock_of(nvmlDevice_t dev, nvmlClockType_t type, unsigned int *mhz, int max)
{
    GET_GPU(dev, g);
    if (!mhz || (unsigned)type >= NVML_CLOCK_COUNT) return NVML_ERROR_INVALID_ARGUMENT;
    *mhz = clock_mhz(g, type, max);
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t dev, nvmlClockType_t type, unsigned int *mhz)
{
    return clock_of(dev, type, mhz, 0);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t dev, nvmlClockType_t type, unsigned int *mhz)
{
    return clock_of(dev, type, mhz, 1);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetApplicationsClock(nvmlDevice_t dev, nvmlClockType_t type, unsigned int *mhz)
{
    return nvmlDeviceGetMaxClockInfo(dev, type, mhz);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetDefaultApplicationsClock(nvmlDevice_t dev, nvmlClockType_t type,
                                                               unsigned int *mhz)
{
    return nvmlDeviceGetMaxClockInfo(dev, type, mhz);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetClock(nvmlDevice_t dev, nvmlClockType_t type, nvmlClockId_t id,
                                            unsigned int *mhz)
{
    return clock_of(dev, type, mhz, id != NVML_CLOCK_ID_CURRENT);
}

/* Data-center boards stay in P0 with persistence mode on. */
CARD_VALUE(nvmlDeviceGetPerformanceState, nvmlPstates_t, NVML_PSTATE_0)

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetPowerState(nvmlDevice_t dev, nvmlPstates_t *state)
{
    return nvmlDeviceGetPerformanceState(dev, state);
}

CARD_VALUE(nvmlDeviceGetCurrentClocksEventReasons, unsigned long long,
           busy_percent(g) > 0 ? 0 : nvmlClocksEventReasonGpuIdle)

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t dev, unsigned long long *reasons)
{
    return nvmlDeviceGetCurrentClocksEventReasons(dev, reasons);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetEccMode(nvmlDevice_t dev, nvmlEnableState_t *current,
                                              nvmlEnableState_t *pending)
{
    if (!pending) return NVML_ERROR_INVALID_ARGUMENT;
    CHECK_CARD(dev);
    if (!current) return NVML_ERROR_INVALID_ARGUMENT;
    *current = *pending = NVML_FEATURE_ENABLED;
    return NVML_SUCCESS;
}

CARD_VALUE(nvmlDeviceGetPersistenceMode, nvmlEnableState_t, NVML_FEATURE_ENABLED)
CARD_VALUE(nvmlDeviceGetDisplayMode, nvmlEnableState_t, NVML_FEATURE_DISABLED)
CARD_VALUE(nvmlDeviceGetDisplayActive, nvmlEnableState_t, NVML_FEATURE_DISABLED)
CARD_VALUE(nvmlDeviceGetAccountingMode, nvmlEnableState_t, NVML_FEATURE_DISABLED)

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t dev, nvmlMemoryErrorType_t type,
                                                     nvmlEccCounterType_t counter, unsigned long long *count)
{
    (void)type;
    (void)counter;
    CHECK_CARD(dev);
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = 0;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMemoryErrorCounter(nvmlDevice_t dev, nvmlMemoryErrorType_t type,
                                                         nvmlEccCounterType_t counter, nvmlMemoryLocation_t loc,
                                                         unsigned long long *count)
{
    (void)loc;
    return nvmlDeviceGetTotalEccErrors(dev, type, counter, count);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t dev, nvmlPageRetirementCause_t cause,
                                                   unsigned int *count, unsigned long long *addresses)
{
    (void)cause;
    (void)addresses;
    CHECK_CARD(dev);
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = 0;
    return NVML_SUCCESS;
}

/* nvmlDeviceGetRetiredPagesPendingStatus: fake_nvml_health.c (a card's pending retirements). */

CARD_VALUE(nvmlDeviceGetComputeMode, nvmlComputeMode_t, NVML_COMPUTEMODE_DEFAULT)
CARD_VALUE(nvmlDeviceGetBrand, nvmlBrandType_t, model_of(g)->brand)
CARD_VALUE(nvmlDeviceGetCurrPcieLinkGeneration, unsigned int, model_of(g)->pcie_gen)
CARD_VALUE(nvmlDeviceGetMaxPcieLinkGeneration, unsigned int, model_of(g)->pcie_gen)
CARD_VALUE(nvmlDeviceGetCurrPcieLinkWidth, unsigned int, 16)
CARD_VALUE(nvmlDeviceGetMaxPcieLinkWidth, unsigned int, 16)

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetPcieThroughput(nvmlDevice_t dev, nvmlPcieUtilCounter_t counter,
                                                     unsigned int *kbps)
{
    (void)counter;
    CHECK_CARD(dev);
    if (!kbps) return NVML_ERROR_INVALID_ARGUMENT;
    *kbps = 0;
    return NVML_SUCCESS;
}

static nvmlReturn_t codec(nvmlDevice_t dev, unsigned int *util, unsigned int *period_us)
{
    CHECK_CARD(dev);
    if (!util || !period_us) return NVML_ERROR_INVALID_ARGUMENT;
    *util = 0;
    *period_us = 167000;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetEncoderUtilization(nvmlDevice_t dev, unsigned int *util, unsigned int *period)
{
    return codec(dev, util, period);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetDecoderUtilization(nvmlDevice_t dev, unsigned int *util, unsigned int *period)
{
    return codec(dev, util, period);
}

CARD_STRING(nvmlDeviceGetVbiosVersion, "88.00.4F.00.09")
CARD_STRING(nvmlDeviceGetInforomImageVersion, "G500.0200.00.03")
CARD_STRING(nvmlDeviceGetBoardPartNumber, "900-2G500-0010-000")
CARD_VALUE(nvmlDeviceGetMultiGpuBoard, unsigned int, 0)

/* NVLink as the board has it (gpu.N.nvlink): a PCIe board has none and answers NotSupported for every
 * link; an SXM2 board has FAKE_MAX_NVLINKS links, the configured ones active, each to a peer card. */
static nvmlReturn_t nvlink_of(nvmlDevice_t dev, unsigned int link_id, const fake_gpu **out)
{
    GET_GPU(dev, g);
    if (g->nvlink_count == 0) return NVML_ERROR_NOT_SUPPORTED;
    if (link_id >= FAKE_MAX_NVLINKS) return NVML_ERROR_INVALID_ARGUMENT;
    *out = g;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t dev, unsigned int link_id, nvmlEnableState_t *active)
{
    const fake_gpu *g = NULL;
    nvmlReturn_t rc = nvlink_of(dev, link_id, &g);
    if (rc != NVML_SUCCESS) return rc;
    if (!active) return NVML_ERROR_INVALID_ARGUMENT;
    *active = (int)link_id < g->nvlink_count ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t dev, unsigned int link_id,
                                                              nvmlIntNvLinkDeviceType_t *type)
{
    const fake_gpu *g = NULL;
    nvmlReturn_t rc = nvlink_of(dev, link_id, &g);
    if (rc != NVML_SUCCESS) return rc;
    if (!type) return NVML_ERROR_INVALID_ARGUMENT;
    if ((int)link_id >= g->nvlink_count) return NVML_ERROR_NOT_FOUND;
    *type = NVML_NVLINK_DEVICE_TYPE_GPU;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t dev, unsigned int link_id, nvmlPciInfo_t *pci)
{
    const fake_gpu *g = NULL;
    nvmlReturn_t rc = nvlink_of(dev, link_id, &g);
    if (rc != NVML_SUCCESS) return rc;
    if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
    if ((int)link_id >= g->nvlink_count) return NVML_ERROR_NOT_FOUND;
    memset(pci, 0, sizeof(*pci));
    snprintf(pci->busId, sizeof(pci->busId), "%08X:%02X:%02X.0", g->nvlink_domain[link_id], g->nvlink_bus[link_id],
             g->nvlink_device[link_id]);
    snprintf(pci->busIdLegacy, sizeof(pci->busIdLegacy), "%04X:%02X:%02X.0", g->nvlink_domain[link_id] & 0xffff,
             g->nvlink_bus[link_id], g->nvlink_device[link_id]);
    pci->domain = g->nvlink_domain[link_id];
    pci->bus = g->nvlink_bus[link_id];
    pci->device = g->nvlink_device[link_id];
    return NVML_SUCCESS;
}

/* GPU fabric (NVSwitch / multi-node NVLink) membership: a Hopper-and-later notion; PCIe boards have none. */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t dev, nvmlGpuFabricInfoV_t *info)
{
    CHECK_CARD(dev);
    if (!info) return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_ERROR_NOT_SUPPORTED;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetGpuFabricInfo(nvmlDevice_t dev, nvmlGpuFabricInfo_t *info)
{
    CHECK_CARD(dev);
    if (!info) return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_ERROR_NOT_SUPPORTED;
}


/* ---------------------------------------------------------------- the rest of NVML's process, memory and
 * utilization family, as the driver answers on the double's cards (PCIe/SXM boards without NVLink,
 * vGPU, MPS or confidential computing; accounting mode off). */

CARD_VALUE(nvmlDeviceGetMemoryBusWidth, unsigned int, model_of(g)->bus_bits)

/* Every memory clock the board supports: HBM2/GDDR6 boards run one. */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetSupportedMemoryClocks(nvmlDevice_t dev, unsigned int *count, unsigned int *mhz)
{
    GET_GPU(dev, g);
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int cap = *count;
    *count = 1;
    if (!mhz || cap < 1) return NVML_ERROR_INSUFFICIENT_SIZE;
    mhz[0] = model_of(g)->mem_mhz;
    return NVML_SUCCESS;
}

/* The NUMA nodes nearest the card's memory: one socket, node 0. */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMemoryAffinity(nvmlDevice_t dev, unsigned int nodeSetSize, unsigned long *nodeSet,
                                                     nvmlAffinityScope_t scope)
{
    CHECK_CARD(dev);
    if (!nodeSetSize || !nodeSet || (scope != NVML_AFFINITY_SCOPE_NODE && scope != NVML_AFFINITY_SCOPE_SOCKET))
        return NVML_ERROR_INVALID_ARGUMENT;
    memset(nodeSet, 0, nodeSetSize * sizeof(*nodeSet));
    nodeSet[0] = 1ul;
    return NVML_SUCCESS;
}

/* JPEG and optical-flow engines exist from Turing on; idle on the double. */
static nvmlReturn_t engine_util(nvmlDevice_t dev, unsigned int *util, unsigned int *period_us)
{
    GET_GPU(dev, g);
    if (!util || !period_us) return NVML_ERROR_INVALID_ARGUMENT;
    if (g->cc_major * 10 + g->cc_minor < 75) return NVML_ERROR_NOT_SUPPORTED;
    *util = 0;
    *period_us = 167000;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetJpgUtilization(nvmlDevice_t dev, unsigned int *util, unsigned int *period)
{
    return engine_util(dev, util, period);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetOfaUtilization(nvmlDevice_t dev, unsigned int *util, unsigned int *period)
{
    return engine_util(dev, util, period);
}

/* NVLink 2 (Volta): 25.781 GB/s per link and direction, as nvidia-smi nvlink -s shows it. */
#define NVLINK2_SPEED_MBPS 25781

/* The field API: the call succeeds for a valid card and a value array, and each field carries its own
 * result. The double answers the NVLink fields from the board (none on a PCIe board: NotSupported,
 * as its per-link calls answer); every other field says NotSupported, the answer a driver gives for
 * a field the card lacks. */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t dev, int count, nvmlFieldValue_t *values)
{
    GET_GPU(dev, g);
    if (count < 0 || (count > 0 && !values)) return NVML_ERROR_INVALID_ARGUMENT;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    for (int i = 0; i < count; i++) {
        nvmlFieldValue_t *f = &values[i];
        f->timestamp = (long long)now.tv_sec * 1000000 + now.tv_nsec / 1000;
        f->latencyUsec = 0;
        f->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
        f->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        unsigned int value = 0;
        switch (f->fieldId) {
        case NVML_FI_DEV_NVLINK_LINK_COUNT: value = FAKE_MAX_NVLINKS; break;
        case NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON:
        case NVML_FI_DEV_NVLINK_GET_SPEED: value = NVLINK2_SPEED_MBPS; break;
        default: continue;
        }
        if (g->nvlink_count == 0) continue; /* a PCIe board */
        f->value.uiVal = value;
        f->nvmlReturn = NVML_SUCCESS;
    }
    return NVML_SUCCESS;
}

/* Confidential computing (R535 on) needs Hopper: on a node of the double's cards it is unavailable
 * and off, which the driver reports as a successful query. */
FAKE_EXPORT nvmlReturn_t nvmlSystemGetConfComputeState(nvmlConfComputeSystemState_t *state)
{
    CHECK_INIT();
    if (!state) return NVML_ERROR_INVALID_ARGUMENT;
    state->environment = NVML_CC_SYSTEM_ENVIRONMENT_UNAVAILABLE;
    state->ccFeature = NVML_CC_SYSTEM_FEATURE_DISABLED;
    state->devToolsMode = NVML_CC_SYSTEM_DEVTOOLS_MODE_OFF;
    return NVML_SUCCESS;
}

/* Confidential computing is a Hopper feature and off on the double's cards. */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetConfComputeProtectedMemoryUsage(nvmlDevice_t dev, nvmlMemory_t *memory)
{
    CHECK_CARD(dev);
    if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_ERROR_NOT_SUPPORTED;
}

/* A process's name as the driver gives it: the path it was started from (argv[0]). */
FAKE_EXPORT nvmlReturn_t nvmlSystemGetProcessName(unsigned int pid, char *name, unsigned int length)
{
    CHECK_INIT();
    if (!name || !length) return NVML_ERROR_INVALID_ARGUMENT;
    char path[64], buf[4096];
    snprintf(path, sizeof(path), "/proc/%u/cmdline", pid);
    FILE *f = fopen(path, "r");
    if (!f) return NVML_ERROR_NOT_FOUND;
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = 0;
    if (!buf[0]) { /* a kernel thread or a zombie: its comm */
        snprintf(path, sizeof(path), "/proc/%u/comm", pid);
        f = fopen(path, "r");
        if (!f) return NVML_ERROR_NOT_FOUND;
        n = fread(buf, 1, sizeof(buf) - 1, f);
        fclose(f);
        buf[n] = 0;
        buf[strcspn(buf, "\n")] = 0;
    }
    size_t len = strlen(buf);
    if (len >= length) len = length - 1; /* the driver truncates */
    memcpy(name, buf, len);
    name[len] = 0;
    return NVML_SUCCESS;
}

/* Accounting mode is off (nvmlDeviceGetAccountingMode): the driver keeps no per-process records. */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetAccountingBufferSize(nvmlDevice_t dev, unsigned int *size)
{
    CHECK_CARD(dev);
    if (!size) return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_ERROR_NOT_SUPPORTED;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetAccountingPids(nvmlDevice_t dev, unsigned int *count, unsigned int *pids)
{
    (void)pids;
    CHECK_CARD(dev);
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_ERROR_NOT_SUPPORTED;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetAccountingStats(nvmlDevice_t dev, unsigned int pid, nvmlAccountingStats_t *stats)
{
    (void)pid;
    CHECK_CARD(dev);
    if (!stats) return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_ERROR_NOT_SUPPORTED;
}

/* Changing the card's settings takes root, as on the driver. The double keeps accounting off: turning
 * it on is refused as unsupported rather than pretended. */
static nvmlReturn_t root_only(void)
{
    return geteuid() == 0 ? NVML_SUCCESS : NVML_ERROR_NO_PERMISSION;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceSetAccountingMode(nvmlDevice_t dev, nvmlEnableState_t mode)
{
    CHECK_CARD(dev);
    if (mode != NVML_FEATURE_ENABLED && mode != NVML_FEATURE_DISABLED) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = root_only();
    if (rc != NVML_SUCCESS) return rc;
    return mode == NVML_FEATURE_DISABLED ? NVML_SUCCESS : NVML_ERROR_NOT_SUPPORTED;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceClearAccountingPids(nvmlDevice_t dev)
{
    CHECK_CARD(dev);
    return root_only();
}

/* Memory clocks can be locked from Ampere on. */
FAKE_EXPORT nvmlReturn_t nvmlDeviceSetMemoryLockedClocks(nvmlDevice_t dev, unsigned int min_mhz, unsigned int max_mhz)
{
    GET_GPU(dev, g);
    if (g->cc_major < 8) return NVML_ERROR_NOT_SUPPORTED;
    if (min_mhz > max_mhz) return NVML_ERROR_INVALID_ARGUMENT;
    return root_only();
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceResetMemoryLockedClocks(nvmlDevice_t dev)
{
    GET_GPU(dev, g);
    if (g->cc_major < 8) return NVML_ERROR_NOT_SUPPORTED;
    return root_only();
}

/* NVLink utilization counters: the boards have no NVLink (nvmlDeviceGetNvLinkState). */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkUtilizationControl(nvmlDevice_t dev, unsigned int link, unsigned int counter,
                                                               nvmlNvLinkUtilizationControl_t *control)
{
    (void)link, (void)counter, (void)control;
    CHECK_CARD(dev);
    return NVML_ERROR_NOT_SUPPORTED;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceSetNvLinkUtilizationControl(nvmlDevice_t dev, unsigned int link, unsigned int counter,
                                                               nvmlNvLinkUtilizationControl_t *control,
                                                               unsigned int reset)
{
    (void)link, (void)counter, (void)control, (void)reset;
    CHECK_CARD(dev);
    return NVML_ERROR_NOT_SUPPORTED;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkUtilizationCounter(nvmlDevice_t dev, unsigned int link, unsigned int counter,
                                                               unsigned long long *rx, unsigned long long *tx)
{
    (void)link, (void)counter, (void)rx, (void)tx;
    CHECK_CARD(dev);
    return NVML_ERROR_NOT_SUPPORTED;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceFreezeNvLinkUtilizationCounter(nvmlDevice_t dev, unsigned int link,
                                                                  unsigned int counter, nvmlEnableState_t freeze)
{
    (void)link, (void)counter, (void)freeze;
    CHECK_CARD(dev);
    return NVML_ERROR_NOT_SUPPORTED;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceResetNvLinkUtilizationCounter(nvmlDevice_t dev, unsigned int link, unsigned int counter)
{
    (void)link, (void)counter;
    CHECK_CARD(dev);
    return NVML_ERROR_NOT_SUPPORTED;
}

/* vGPU: the double is bare metal, no vGPU manager runs and there are no vGPU instances. */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetVgpuUtilization(nvmlDevice_t dev, unsigned long long lastSeen, nvmlValueType_t *type,
                                                      unsigned int *count, nvmlVgpuInstanceUtilizationSample_t *samples)
{
    (void)lastSeen, (void)type, (void)count, (void)samples;
    CHECK_CARD(dev);
    return NVML_ERROR_NOT_SUPPORTED;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetVgpuProcessUtilization(nvmlDevice_t dev, unsigned long long lastSeen,
                                                             unsigned int *count,
                                                             nvmlVgpuProcessUtilizationSample_t *samples)
{
    (void)lastSeen, (void)count, (void)samples;
    CHECK_CARD(dev);
    return NVML_ERROR_NOT_SUPPORTED;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetVgpuInstancesUtilizationInfo(nvmlDevice_t dev,
                                                                   nvmlVgpuInstancesUtilizationInfo_t *info)
{
    (void)info;
    CHECK_CARD(dev);
    if (driver_branch() < 550) return NVML_ERROR_FUNCTION_NOT_FOUND;
    return NVML_ERROR_NOT_SUPPORTED;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetVgpuProcessesUtilizationInfo(nvmlDevice_t dev,
                                                                   nvmlVgpuProcessesUtilizationInfo_t *info)
{
    (void)info;
    CHECK_CARD(dev);
    if (driver_branch() < 550) return NVML_ERROR_FUNCTION_NOT_FOUND;
    return NVML_ERROR_NOT_SUPPORTED;
}

/* A vGPU instance id names none on bare metal. */
#define NO_VGPU_INSTANCE()                                                                               \
    do {                                                                                                 \
        CHECK_INIT();                                                                                    \
        return NVML_ERROR_INVALID_ARGUMENT;                                                              \
    } while (0)

FAKE_EXPORT nvmlReturn_t nvmlVgpuInstanceGetAccountingMode(nvmlVgpuInstance_t id, nvmlEnableState_t *mode)
{
    (void)id, (void)mode;
    NO_VGPU_INSTANCE();
}

FAKE_EXPORT nvmlReturn_t nvmlVgpuInstanceGetAccountingPids(nvmlVgpuInstance_t id, unsigned int *count, unsigned int *pids)
{
    (void)id, (void)count, (void)pids;
    NO_VGPU_INSTANCE();
}

FAKE_EXPORT nvmlReturn_t nvmlVgpuInstanceGetAccountingStats(nvmlVgpuInstance_t id, unsigned int pid,
                                                            nvmlAccountingStats_t *stats)
{
    (void)id, (void)pid, (void)stats;
    NO_VGPU_INSTANCE();
}

FAKE_EXPORT nvmlReturn_t nvmlVgpuInstanceClearAccountingPids(nvmlVgpuInstance_t id)
{
    (void)id;
    NO_VGPU_INSTANCE();
}

/* WDDM/TCC are Windows driver models: Linux drivers answer NOT_SUPPORTED. */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetDriverModel_v2(nvmlDevice_t dev, nvmlDriverModel_t *current,
                                                     nvmlDriverModel_t *pending)
{
    (void)current, (void)pending;
    CHECK_CARD(dev);
    return NVML_ERROR_NOT_SUPPORTED;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetDriverModel(nvmlDevice_t dev, nvmlDriverModel_t *current,
                                                  nvmlDriverModel_t *pending)
{
    return nvmlDeviceGetDriverModel_v2(dev, current, pending);
}
