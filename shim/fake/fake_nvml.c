/* Fake libnvidia-ml.so.1: the NVML subset pynvml, the node agent and the shim use, answering from
 * the same GPU description and cross-process state as the fake libcuda. */
#define _GNU_SOURCE
#define NVML_NO_UNVERSIONED_FUNC_DEFS
#include <nvml.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "fake_common.h"
#include "fake_health.h"

static _Atomic int init_count;

int fake_nvml_initialized(void) { return atomic_load(&init_count) > 0; } /* for fake_nvml_health.c */

#define CHECK_INIT()                                                                                     \
    do {                                                                                                 \
        if (atomic_load(&init_count) <= 0) return NVML_ERROR_UNINITIALIZED;                             \
    } while (0)

/* A handle is a pointer to the GPU's description (as opaque as the driver's). */
static fake_gpu *gpu_of(nvmlDevice_t d)
{
    fake_system *s = fake_system_get();
    if (!s) return NULL;
    fake_gpu *g = (fake_gpu *)(void *)d;
    if (g < s->gpus || g >= s->gpus + s->count) return NULL;
    return g;
}

static int index_of(const fake_gpu *g)
{
    return (int)(g - fake_system_get()->gpus);
}

#define GET_GPU(dev, g)                                                                                  \
    CHECK_INIT();                                                                                        \
    fake_gpu *g = gpu_of(dev);                                                                           \
    if (!g) return NVML_ERROR_INVALID_ARGUMENT;                                                          \
    if (fake_health_lost(index_of(g))) return NVML_ERROR_GPU_IS_LOST

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

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t dev, unsigned int *index)
{
    GET_GPU(dev, g);
    if (!index) return NVML_ERROR_INVALID_ARGUMENT;
    *index = (unsigned int)index_of(g);
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t dev, char *name, unsigned int length)
{
    GET_GPU(dev, g);
    return copy_str(name, length, g->name);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t dev, char *uuid, unsigned int length)
{
    GET_GPU(dev, g);
    return copy_str(uuid, length, g->uuid);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t dev, char *serial, unsigned int length)
{
    GET_GPU(dev, g);
    if (!g->serial[0]) return NVML_ERROR_NOT_SUPPORTED;
    return copy_str(serial, length, g->serial);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t dev, unsigned int *minor)
{
    GET_GPU(dev, g);
    if (!minor) return NVML_ERROR_INVALID_ARGUMENT;
    *minor = g->minor;
    return NVML_SUCCESS;
}

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

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t dev, unsigned int *current, unsigned int *pending)
{
    GET_GPU(dev, g);
    if (!current || !pending) return NVML_ERROR_INVALID_ARGUMENT;
    if (g->cc_major < 8) return NVML_ERROR_NOT_SUPPORTED; /* MIG exists from Ampere on */
    *current = NVML_DEVICE_MIG_DISABLE;
    *pending = NVML_DEVICE_MIG_DISABLE;
    return NVML_SUCCESS;
}

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
    return used;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *memory)
{
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

/* Utilization over the last second, as NVML's sampling window roughly is. */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t dev, nvmlUtilization_t *util)
{
    GET_GPU(dev, g);
    if (!util) return NVML_ERROR_INVALID_ARGUMENT;
    uint64_t now = fake_now_ns(), window = 1000000000ull;
    uint64_t busy = fake_busy_between(fake_system_get()->state[index_of(g)], 0, now - window, now);
    util->gpu = (unsigned int)(busy * 100 / window);
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

/* One sample per live process: its SM utilization since lastSeenTimeStamp (at most the last second). */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t dev, nvmlProcessUtilizationSample_t *samples,
                                                         unsigned int *count, unsigned long long lastSeenTimeStamp)
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
        samples[i] = (nvmlProcessUtilizationSample_t){(unsigned int)pids[i], now_us, (unsigned int)(pct > 100 ? 100 : pct),
                                                      0, 0, 0};
    }
    *count = (unsigned int)n;
    return NVML_SUCCESS;
}

/* Running compute processes with their memory, like the driver lists them (v1/v2/v3 layouts). */
static nvmlReturn_t running(nvmlDevice_t dev, unsigned int *count, void *infos, size_t stride, int v1)
{
    GET_GPU(dev, g);
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    fake_dev_state *s = fake_system_get()->state[index_of(g)];
    unsigned int n = 0, cap = *count;
    nvmlReturn_t rc = NVML_SUCCESS;
    fake_lock(s);
    (void)fake_used_locked(s);
    for (int i = 0; i < FAKE_MAX_PROCS; i++) {
        fake_proc *p = &s->procs[i];
        if (!p->pid) continue;
        uint64_t used = atomic_load(&p->used);
        /* Like the real driver: a process is listed from its first context on, memory or not. */
        if (used == 0 && atomic_load(&p->contexts) == 0) continue;
        if (infos && n < cap) {
            char *slot = (char *)infos + n * stride;
            if (v1) {
                nvmlProcessInfo_v1_t e = {(unsigned int)p->pid, used};
                memcpy(slot, &e, sizeof(e));
            } else {
                nvmlProcessInfo_v2_t e = {(unsigned int)p->pid, used, 0xFFFFFFFFu, 0xFFFFFFFFu};
                memcpy(slot, &e, sizeof(e));
            }
        } else {
            rc = NVML_ERROR_INSUFFICIENT_SIZE;
        }
        n++;
    }
    fake_unlock(s);
    *count = n;
    return rc;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t dev, unsigned int *count,
                                                                 nvmlProcessInfo_t *infos)
{
    return running(dev, count, infos, sizeof(nvmlProcessInfo_v2_t), 0);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t dev, unsigned int *count,
                                                                 nvmlProcessInfo_v2_t *infos)
{
    return running(dev, count, infos, sizeof(nvmlProcessInfo_v2_t), 0);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t dev, unsigned int *count,
                                                              nvmlProcessInfo_v1_t *infos)
{
    return running(dev, count, infos, sizeof(nvmlProcessInfo_v1_t), 1);
}
