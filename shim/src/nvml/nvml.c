/*
 * NVML: memory info, process lists and utilization of the slice, not the card.
 */
#define _GNU_SOURCE
#include "../gs_cuda.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

/* ------------------------------------------------------------------------------------------------
 * NVML: memory info of the slice's GPU is the slice.
 * ---------------------------------------------------------------------------------------------- */

static int nvml_slice_info(nvmlDevice_t device, uint64_t *total, uint64_t *used)
{
    int mode = gs_ensure_init();
    if (mode == GS_MODE_FAIL_CLOSED) {
        *total = 0;
        *used = 0;
        return 1;
    }
    if (gs_cfg.memory_bytes == GS_UNLIMITED) return 0;
    char uuid[96] = {0};
    int is_slice = real_nvmlDeviceGetUUID != NULL && real_nvmlDeviceGetUUID(device, uuid, sizeof(uuid)) == NVML_SUCCESS &&
                   strcasecmp(uuid, gs_cfg.gpu_uuid_text) == 0;
    if (!is_slice) {
        *total = 0;
        *used = 0;
        return 1;
    }
    uint64_t u = gs_region_used_total(&gs_reg);
    *total = gs_cfg.memory_bytes;
    *used = u < *total ? u : *total;
    return 1;
}

GS_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    if (nvml_real() != 0 || real_nvmlDeviceGetMemoryInfo == NULL) return NVML_ERROR_LIBRARY_NOT_FOUND;
    nvmlReturn_t rc = real_nvmlDeviceGetMemoryInfo(device, memory);
    uint64_t total, used;
    if (rc == NVML_SUCCESS && memory != NULL && nvml_slice_info(device, &total, &used)) {
        if (total > memory->total) total = memory->total; /* never more than the card */
        if (used > total) used = total;
        uint64_t free_b = total - used;
        memory->free = free_b < memory->free ? free_b : memory->free; /* nor more than it has free */
        memory->total = total;
        memory->used = used;
    }
    return rc;
}

GS_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    if (nvml_real() != 0 || real_nvmlDeviceGetMemoryInfo_v2 == NULL) return NVML_ERROR_LIBRARY_NOT_FOUND;
    nvmlReturn_t rc = real_nvmlDeviceGetMemoryInfo_v2(device, memory);
    uint64_t total, used;
    if (rc == NVML_SUCCESS && memory != NULL && nvml_slice_info(device, &total, &used)) {
        if (total > memory->total) total = memory->total;
        if (used > total) used = total;
        uint64_t free_b = total - used;
        memory->free = free_b < memory->free ? free_b : memory->free;
        memory->total = total;
        memory->reserved = 0;
        memory->used = used;
    }
    return rc;
}

/* ------------------------------------------------------------------------------------------------
 * NVML process lists and utilization: the slice's own processes, its own share.
 * ---------------------------------------------------------------------------------------------- */


static int nvml_pid_visible(nvmlDevice_t device, unsigned int pid)
{
    if (gs_ensure_init() != GS_MODE_ACTIVE) return 0;
    /* Whole cards (no memory limit, the whole compute): every card the container has is the claim's,
     * a multi-GPU product's second as its first, so each lists the claim's processes on it. Only the
     * claim's own processes are ever listed, on any card. */
    int whole = gs_cfg.memory_bytes == GS_UNLIMITED && gs_cfg.compute_share >= 100;
    char uuid[96] = {0};
    if (!whole &&
        (real_nvmlDeviceGetUUID == NULL || real_nvmlDeviceGetUUID(device, uuid, sizeof(uuid)) != NVML_SUCCESS ||
         strcasecmp(uuid, gs_cfg.gpu_uuid_text) != 0))
        return 0; /* a device the slice is not on */
    note_host_pid();
    return gs_region_has_nvml_pid(&gs_reg, (int32_t)pid);
}

typedef nvmlReturn_t (*gs_list_fn)(nvmlDevice_t, unsigned int *, void *);

/* Calls a process-list entry point and keeps the slice's processes (pid is each record's first field). */
static nvmlReturn_t filter_list(gs_list_fn fn, nvmlDevice_t device, unsigned int *count, void *infos, size_t stride)
{
    if (count == NULL) return fn(device, count, infos);
    unsigned int cap = infos ? *count : 0, n = 64;
    for (int attempt = 0; attempt < 4; attempt++) {
        char *buf = malloc((size_t)n * stride);
        if (buf == NULL) return NVML_ERROR_MEMORY;
        unsigned int got = n;
        nvmlReturn_t rc = fn(device, &got, buf);
        if (rc == NVML_ERROR_INSUFFICIENT_SIZE) {
            free(buf);
            n = got + 16;
            continue;
        }
        if (rc != NVML_SUCCESS) {
            free(buf);
            return rc;
        }
        unsigned int kept = 0;
        for (unsigned int i = 0; i < got; i++) {
            unsigned int pid;
            memcpy(&pid, buf + (size_t)i * stride, sizeof(pid));
            if (!nvml_pid_visible(device, pid)) continue;
            if (kept < cap) memcpy((char *)infos + (size_t)kept * stride, buf + (size_t)i * stride, stride);
            kept++;
        }
        free(buf);
        *count = kept;
        return kept > cap ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
    }
    return NVML_ERROR_UNKNOWN;
}

#define NVML_LIST(name, type)                                                                            \
    GS_EXPORT nvmlReturn_t name(nvmlDevice_t device, unsigned int *infoCount, type *infos)               \
    {                                                                                                    \
        if (nvml_real() != 0 || real_##name == NULL) return NVML_ERROR_FUNCTION_NOT_FOUND;               \
        return filter_list((gs_list_fn)real_##name, device, infoCount, infos, sizeof(type));             \
    }

NVML_LIST(nvmlDeviceGetComputeRunningProcesses, nvmlProcessInfo_v1_t)
NVML_LIST(nvmlDeviceGetComputeRunningProcesses_v2, nvmlProcessInfo_v2_t)
NVML_LIST(nvmlDeviceGetComputeRunningProcesses_v3, nvmlProcessInfo_t)
NVML_LIST(nvmlDeviceGetGraphicsRunningProcesses, nvmlProcessInfo_v1_t)
NVML_LIST(nvmlDeviceGetGraphicsRunningProcesses_v2, nvmlProcessInfo_v2_t)
NVML_LIST(nvmlDeviceGetGraphicsRunningProcesses_v3, nvmlProcessInfo_t)
NVML_LIST(nvmlDeviceGetMPSComputeRunningProcesses, nvmlProcessInfo_v1_t)
NVML_LIST(nvmlDeviceGetMPSComputeRunningProcesses_v2, nvmlProcessInfo_v2_t)
NVML_LIST(nvmlDeviceGetMPSComputeRunningProcesses_v3, nvmlProcessInfo_t)

/* The struct-versioned list (all processes of one mode): the same filter, the list's fields as the
 * count and the array. */
static __thread nvmlProcessDetailList_t tl_detail;

static nvmlReturn_t detail_as_list(nvmlDevice_t device, unsigned int *count, void *procs)
{
    nvmlProcessDetailList_t l = tl_detail;
    l.numProcArrayEntries = *count;
    l.procArray = procs;
    nvmlReturn_t rc = real_nvmlDeviceGetRunningProcessDetailList(device, &l);
    *count = l.numProcArrayEntries;
    return rc;
}

GS_EXPORT nvmlReturn_t nvmlDeviceGetRunningProcessDetailList(nvmlDevice_t device, nvmlProcessDetailList_t *plist)
{
    if (nvml_real() != 0 || real_nvmlDeviceGetRunningProcessDetailList == NULL) return NVML_ERROR_FUNCTION_NOT_FOUND;
    if (plist == NULL) return real_nvmlDeviceGetRunningProcessDetailList(device, plist);
    tl_detail = *plist;
    unsigned int count = plist->procArray ? plist->numProcArrayEntries : 0;
    nvmlReturn_t rc = filter_list(detail_as_list, device, &count, plist->procArray, sizeof(*plist->procArray));
    if (rc == NVML_SUCCESS || rc == NVML_ERROR_INSUFFICIENT_SIZE) plist->numProcArrayEntries = count;
    return rc;
}

typedef struct {
    unsigned long long since;
    nvmlReturn_t (*fn)(nvmlDevice_t, nvmlProcessUtilizationSample_t *, unsigned int *, unsigned long long);
} gs_util_call;
static __thread gs_util_call tl_util;

static nvmlReturn_t util_as_list(nvmlDevice_t device, unsigned int *count, void *samples)
{
    return tl_util.fn(device, samples, count, tl_util.since);
}

GS_EXPORT nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t *utilization,
                                                        unsigned int *processSamplesCount,
                                                        unsigned long long lastSeenTimeStamp)
{
    if (nvml_real() != 0 || real_nvmlDeviceGetProcessUtilization == NULL) return NVML_ERROR_FUNCTION_NOT_FOUND;
    tl_util = (gs_util_call){lastSeenTimeStamp, real_nvmlDeviceGetProcessUtilization};
    return filter_list(util_as_list, device, processSamplesCount, utilization, sizeof(*utilization));
}

static __thread nvmlProcessesUtilizationInfo_t tl_utilinfo;

/* pid is not the first field of nvmlProcessUtilizationInfo_v1_t: the filter sees the samples as
 * nvmlProcessUtilizationSample_t, pid first, and they are copied back in the caller's layout. */
static nvmlReturn_t utilinfo_as_list(nvmlDevice_t device, unsigned int *count, void *samples)
{
    nvmlProcessesUtilizationInfo_t info = tl_utilinfo;
    nvmlProcessUtilizationInfo_v1_t *raw = NULL;
    if (samples && *count) {
        raw = calloc(*count, sizeof(*raw));
        if (raw == NULL) return NVML_ERROR_MEMORY;
    }
    info.processSamplesCount = *count;
    info.procUtilArray = raw;
    nvmlReturn_t rc = real_nvmlDeviceGetProcessesUtilizationInfo(device, &info);
    *count = info.processSamplesCount;
    if (rc == NVML_SUCCESS && samples)
        for (unsigned int i = 0; i < info.processSamplesCount; i++)
            ((nvmlProcessUtilizationSample_t *)samples)[i] =
                (nvmlProcessUtilizationSample_t){raw[i].pid, raw[i].timeStamp, raw[i].smUtil, raw[i].memUtil,
                                                 raw[i].encUtil, raw[i].decUtil};
    free(raw);
    return rc;
}

GS_EXPORT nvmlReturn_t nvmlDeviceGetProcessesUtilizationInfo(nvmlDevice_t device, nvmlProcessesUtilizationInfo_t *info)
{
    if (nvml_real() != 0 || real_nvmlDeviceGetProcessesUtilizationInfo == NULL) return NVML_ERROR_FUNCTION_NOT_FOUND;
    if (info == NULL || info->version != nvmlProcessesUtilizationInfo_v1)
        return real_nvmlDeviceGetProcessesUtilizationInfo(device, info);
    tl_utilinfo = *info;
    unsigned int cap = info->procUtilArray ? info->processSamplesCount : 0;
    nvmlProcessUtilizationSample_t *kept = cap ? calloc(cap, sizeof(*kept)) : NULL;
    if (cap && kept == NULL) return NVML_ERROR_MEMORY;
    unsigned int count = cap;
    nvmlReturn_t rc = filter_list(utilinfo_as_list, device, &count, kept, sizeof(*kept));
    if (rc == NVML_SUCCESS)
        for (unsigned int i = 0; i < count; i++)
            info->procUtilArray[i] = (nvmlProcessUtilizationInfo_v1_t){.timeStamp = kept[i].timeStamp,
                                                                       .pid = kept[i].pid,
                                                                       .smUtil = kept[i].smUtil,
                                                                       .memUtil = kept[i].memUtil,
                                                                       .encUtil = kept[i].encUtil,
                                                                       .decUtil = kept[i].decUtil};
    if (rc == NVML_SUCCESS || rc == NVML_ERROR_INSUFFICIENT_SIZE) info->processSamplesCount = count;
    free(kept);
    return rc;
}

/* The card's utilization is other tenants' business: the slice sees its own, as a share of its
 * compute quota (a 25 % slice running flat out reads 100 %). */
GS_EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization)
{
    if (nvml_real() != 0 || real_nvmlDeviceGetUtilizationRates == NULL) return NVML_ERROR_FUNCTION_NOT_FOUND;
    nvmlReturn_t rc = real_nvmlDeviceGetUtilizationRates(device, utilization);
    if (rc != NVML_SUCCESS || utilization == NULL) return rc;
    int mode = gs_ensure_init();
    if (mode == GS_MODE_FAIL_CLOSED) {
        utilization->gpu = utilization->memory = 0;
        return rc;
    }
    if (gs_cfg.memory_bytes == GS_UNLIMITED && gs_cfg.compute_share >= 100) return rc;
    char uuid[96] = {0};
    if (real_nvmlDeviceGetUUID == NULL || real_nvmlDeviceGetUUID(device, uuid, sizeof(uuid)) != NVML_SUCCESS ||
        strcasecmp(uuid, gs_cfg.gpu_uuid_text) != 0) {
        utilization->gpu = utilization->memory = 0;
        return rc;
    }
    double u = gs_slice_utilization();
    if (u < 0) u = 0;
    double share = gs_cfg.compute_share ? (double)gs_cfg.compute_share : 100.0;
    double pct = u * 100.0 / share;
    utilization->gpu = (unsigned int)(pct > 100 ? 100 : pct + 0.5);
    if (utilization->memory > utilization->gpu) utilization->memory = utilization->gpu;
    return rc;
}

