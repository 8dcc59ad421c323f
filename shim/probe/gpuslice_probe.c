/*
 * gpuslice-probe: what a tenant runs inside a container that holds a slice, to see the slice.
 * Linked against libcuda.so.1 and libnvidia-ml.so.1 by SONAME, like any CUDA application: which
 * driver it gets (the real one, or the test double that a CDI spec mounts) is up to the loader.
 *
 *   gpuslice-probe smi                  one line per GPU through NVML: "<name>, <total> MiB", like
 *                                       nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
 *   gpuslice-probe alloc SIZE...        one cuMemAlloc per SIZE, one line each:
 *                                       "cuMemAlloc(<bytes>) -> <code> <name>"; the memory stays
 *                                       allocated until the program exits
 *   gpuslice-probe hold SIZE SECONDS    allocate, print "held <bytes> -> <code> <name>", sleep SECONDS
 *                                       (0: until SIGTERM/SIGINT), free, exit 0
 *   gpuslice-probe burn SECONDS [KERNEL_US [START_AT]]
 *                                       back-to-back kernel launches (KERNEL_US per kernel, default
 *                                       1000), a "progress" line per second, and as the last line
 *                                       "share <percent>": busy time / wall time over the second half.
 *                                       START_AT (Unix time, seconds): set up, then wait until then,
 *                                       so burners started one after another measure one window
 *                                       ("started late=<seconds>" says by how much it missed it)
 *
 * SIZE is bytes, or a number with a suffix Ki, Mi, Gi (also K, M, G, KiB, MiB, GiB: powers of 1024).
 * Exit status: 0 ok (an allocation refused with CUDA_ERROR_OUT_OF_MEMORY is an answer, not a
 * failure), 1 a CUDA or NVML call failed unexpectedly (for `hold`: the allocation failed), 2 usage.
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <errno.h>
#include <nvml.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "probe_ptx.h"

#define PROG "gpuslice-probe"
#define MIB (1024ull * 1024ull)

static volatile sig_atomic_t stop_requested;

static void on_stop(int sig)
{
    (void)sig;
    stop_requested = 1;
}

/* SIGTERM and SIGINT end `hold` and `burn` cleanly. As a container's PID 1 the program must handle
 * them itself: the kernel does not apply default actions to PID 1 of a namespace. */
static void handle_stop_signals(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_stop;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
}

static void usage(FILE *out)
{
    fprintf(out,
            "usage: " PROG " COMMAND [ARGS]\n"
            "  smi                     each GPU as \"<name>, <total> MiB\" through NVML\n"
            "                          (like nvidia-smi --query-gpu=name,memory.total --format=csv,noheader)\n"
            "  alloc SIZE...           one cuMemAlloc per SIZE: \"cuMemAlloc(<bytes>) -> <code> <name>\";\n"
            "                          the memory stays allocated until exit\n"
            "  hold SIZE SECONDS       allocate SIZE, print \"held <bytes> -> <code> <name>\", sleep SECONDS\n"
            "                          (0: until SIGTERM), free, exit\n"
            "  burn SECONDS [KERNEL_US [START_AT]]\n"
            "                          back-to-back kernel launches of KERNEL_US (default 1000) each; the last\n"
            "                          line is \"share <percent>\", the share of the GPU achieved; START_AT\n"
            "                          (Unix time): set up, then start burning then\n"
            "SIZE: bytes, or with a suffix Ki, Mi, Gi (e.g. 512Mi, 8Gi).\n"
            "Exit status: 0 ok, 1 a CUDA/NVML call failed, 2 usage.\n");
}

static int usage_error(const char *fmt, const char *arg)
{
    fprintf(stderr, PROG ": ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n");
    usage(stderr);
    return 2;
}

/* "123", "512Mi", "8Gi", "4KiB" -> bytes. Returns 0 on success, -1 when not a size. */
static int parse_size(const char *s, size_t *out)
{
    if (!s || !*s || *s == '-' || *s == '+') return -1;
    errno = 0;
    char *end = NULL;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s) return -1;
    unsigned shift = 0;
    if (*end) {
        static const struct {
            const char *suffix;
            unsigned shift;
        } suffixes[] = {
            {"Ki", 10}, {"KiB", 10}, {"K", 10}, {"Mi", 20}, {"MiB", 20}, {"M", 20},
            {"Gi", 30}, {"GiB", 30}, {"G", 30}, {"Ti", 40}, {"TiB", 40}, {"T", 40},
        };
        size_t i;
        for (i = 0; i < sizeof(suffixes) / sizeof(suffixes[0]); i++)
            if (strcmp(end, suffixes[i].suffix) == 0) break;
        if (i == sizeof(suffixes) / sizeof(suffixes[0])) return -1;
        shift = suffixes[i].shift;
    }
    if (shift && v > (SIZE_MAX >> shift)) return -1;
    *out = (size_t)(v << shift);
    return 0;
}

/* A non-negative number of seconds (fractions allowed). */
static int parse_seconds(const char *s, double *out)
{
    if (!s || !*s) return -1;
    errno = 0;
    char *end = NULL;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v >= 0) || v > 1e9) return -1;
    *out = v;
    return 0;
}

static const char *cu_name(CUresult rc)
{
    const char *name = NULL;
    if (cuGetErrorName(rc, &name) != CUDA_SUCCESS || !name) return "CUDA_ERROR_UNKNOWN_CODE";
    return name;
}

static int cu_failed(const char *call, CUresult rc)
{
    fprintf(stderr, PROG ": %s failed: %d %s\n", call, (int)rc, cu_name(rc));
    return 1;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* cuInit, device 0's primary context made current. Returns 0, or 1 after saying what failed. */
static int cuda_setup(CUdevice *dev)
{
    CUresult rc;
    CUcontext ctx;
    if ((rc = cuInit(0)) != CUDA_SUCCESS) return cu_failed("cuInit", rc);
    if ((rc = cuDeviceGet(dev, 0)) != CUDA_SUCCESS) return cu_failed("cuDeviceGet(0)", rc);
    if ((rc = cuDevicePrimaryCtxRetain(&ctx, *dev)) != CUDA_SUCCESS) return cu_failed("cuDevicePrimaryCtxRetain", rc);
    if ((rc = cuCtxSetCurrent(ctx)) != CUDA_SUCCESS) return cu_failed("cuCtxSetCurrent", rc);
    return 0;
}

/* ------------------------------------------------------------------------------------------ smi */

static int nvml_failed(const char *call, nvmlReturn_t rc)
{
    fprintf(stderr, PROG ": %s failed: %d %s\n", call, (int)rc, nvmlErrorString(rc));
    return 1;
}

static int cmd_smi(void)
{
    nvmlReturn_t rc;
    unsigned int count = 0;
    if ((rc = nvmlInit_v2()) != NVML_SUCCESS) return nvml_failed("nvmlInit_v2", rc);
    int status = 0;
    if ((rc = nvmlDeviceGetCount_v2(&count)) != NVML_SUCCESS) {
        status = nvml_failed("nvmlDeviceGetCount_v2", rc);
    } else if (count == 0) {
        fprintf(stderr, PROG ": No devices were found\n");
        status = 1;
    }
    for (unsigned int i = 0; status == 0 && i < count; i++) {
        nvmlDevice_t dev;
        char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE] = {0};
        nvmlMemory_t mem;
        if ((rc = nvmlDeviceGetHandleByIndex_v2(i, &dev)) != NVML_SUCCESS)
            status = nvml_failed("nvmlDeviceGetHandleByIndex_v2", rc);
        else if ((rc = nvmlDeviceGetName(dev, name, sizeof(name))) != NVML_SUCCESS)
            status = nvml_failed("nvmlDeviceGetName", rc);
        else if ((rc = nvmlDeviceGetMemoryInfo(dev, &mem)) != NVML_SUCCESS)
            status = nvml_failed("nvmlDeviceGetMemoryInfo", rc);
        else
            printf("%s, %llu MiB\n", name, (unsigned long long)(mem.total / MIB));
    }
    nvmlShutdown();
    return status;
}

/* ---------------------------------------------------------------------------------------- alloc */

static int cmd_alloc(int n, char **sizes)
{
    size_t bytes[n];
    for (int i = 0; i < n; i++)
        if (parse_size(sizes[i], &bytes[i]) != 0) return usage_error("not a size: %s (give bytes, or e.g. 512Mi, 8Gi)", sizes[i]);
    CUdevice dev;
    if (cuda_setup(&dev)) return 1;
    int status = 0;
    for (int i = 0; i < n; i++) {
        CUdeviceptr p = 0;
        CUresult rc = cuMemAlloc(&p, bytes[i]);
        printf("cuMemAlloc(%zu) -> %d %s\n", bytes[i], (int)rc, cu_name(rc));
        if (rc != CUDA_SUCCESS && rc != CUDA_ERROR_OUT_OF_MEMORY) status = 1;
    }
    /* Kept until exit on purpose: the driver frees a process's memory when it ends. */
    return status;
}

/* ----------------------------------------------------------------------------------------- hold */

static void sleep_until_stopped(double seconds)
{
    if (seconds <= 0) {
        while (!stop_requested) pause();
        return;
    }
    double end = now_s() + seconds;
    while (!stop_requested) {
        double left = end - now_s();
        if (left <= 0) break;
        struct timespec ts = {.tv_sec = (time_t)left, .tv_nsec = (long)((left - (double)(time_t)left) * 1e9)};
        nanosleep(&ts, NULL); /* a signal interrupts it; the loop looks at the flag */
    }
}

static int cmd_hold(const char *size_arg, const char *seconds_arg)
{
    size_t bytes;
    double seconds;
    if (parse_size(size_arg, &bytes) != 0) return usage_error("not a size: %s (give bytes, or e.g. 512Mi, 8Gi)", size_arg);
    if (parse_seconds(seconds_arg, &seconds) != 0) return usage_error("not a number of seconds: %s", seconds_arg);
    handle_stop_signals();
    CUdevice dev;
    if (cuda_setup(&dev)) return 1;
    CUdeviceptr p = 0;
    CUresult rc = cuMemAlloc(&p, bytes);
    printf("held %zu -> %d %s\n", bytes, (int)rc, cu_name(rc));
    fflush(stdout);
    if (rc != CUDA_SUCCESS) return 1;
    sleep_until_stopped(seconds);
    if ((rc = cuMemFree(p)) != CUDA_SUCCESS) return cu_failed("cuMemFree", rc);
    return 0;
}

/* ----------------------------------------------------------------------------------------- burn */

static const char spin_ptx[] = PROBE_PTX_HEAD PROBE_PTX_SPIN;

/* Milliseconds one spin(cycles) takes on the device (best of 5, timed with events) into *best_ms;
 * on failure returns the failed call's result and names it in *call. */
static CUresult time_spin(CUfunction fn, unsigned long long cycles, double *best_ms, const char **call)
{
    CUevent a, b;
    void *params[] = {&cycles};
    CUresult rc;
    *best_ms = -1;
    *call = "cuEventCreate";
    if ((rc = cuEventCreate(&a, 0)) != CUDA_SUCCESS) return rc;
    if ((rc = cuEventCreate(&b, 0)) != CUDA_SUCCESS) {
        cuEventDestroy(a);
        return rc;
    }
    for (int i = 0; i < 5 && rc == CUDA_SUCCESS; i++) {
        float ms = 0;
        if ((rc = cuEventRecord(a, NULL)) != CUDA_SUCCESS) *call = "cuEventRecord";
        else if ((rc = cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL)) != CUDA_SUCCESS) *call = "cuLaunchKernel";
        else if ((rc = cuEventRecord(b, NULL)) != CUDA_SUCCESS) *call = "cuEventRecord";
        else if ((rc = cuEventSynchronize(b)) != CUDA_SUCCESS) *call = "cuEventSynchronize";
        else if ((rc = cuEventElapsedTime(&ms, a, b)) != CUDA_SUCCESS) *call = "cuEventElapsedTime";
        else if (*best_ms < 0 || ms < *best_ms) *best_ms = ms;
    }
    cuEventDestroy(a);
    cuEventDestroy(b);
    return rc;
}

/* Sleeps until the Unix time `at`; how late the caller is for it (0 when on time). */
static double wait_until_unix(double at)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    double late = (double)ts.tv_sec + (double)ts.tv_nsec / 1e9 - at;
    if (late >= 0) return late;
    struct timespec when = {(time_t)at, (long)((at - (double)(time_t)at) * 1e9)};
    while (clock_nanosleep(CLOCK_REALTIME, TIMER_ABSTIME, &when, NULL) == EINTR && !stop_requested) {
    }
    return 0;
}

static int cmd_burn(const char *seconds_arg, const char *kernel_us_arg, const char *start_at_arg)
{
    double seconds, start_at = 0;
    if (parse_seconds(seconds_arg, &seconds) != 0 || seconds <= 0)
        return usage_error("not a positive number of seconds: %s", seconds_arg);
    char *at_end = NULL;
    if (start_at_arg) start_at = strtod(start_at_arg, &at_end);
    if (start_at_arg && (at_end == start_at_arg || *at_end || !(start_at > 0) || start_at > 1e11))
        return usage_error("START_AT must be a Unix time in seconds, not %s", start_at_arg);
    unsigned kernel_us = 1000;
    if (kernel_us_arg) {
        char *end = NULL;
        unsigned long v = strtoul(kernel_us_arg, &end, 10);
        if (end == kernel_us_arg || *end || v < 1 || v > 1000000)
            return usage_error("KERNEL_US must be 1..1000000 microseconds, not %s", kernel_us_arg);
        kernel_us = (unsigned)v;
    }
    handle_stop_signals();
    CUdevice dev;
    if (cuda_setup(&dev)) return 1;
    char ptx[2048];
    snprintf(ptx, sizeof(ptx), spin_ptx, kernel_us);
    CUmodule mod;
    CUfunction fn;
    CUresult rc;
    if ((rc = cuModuleLoadData(&mod, ptx)) != CUDA_SUCCESS) return cu_failed("cuModuleLoadData", rc);
    if ((rc = cuModuleGetFunction(&fn, mod, "spin")) != CUDA_SUCCESS) return cu_failed("cuModuleGetFunction", rc);

    /* Calibrate the spin so one kernel takes about kernel_us on a real GPU (the double ignores the
     * argument and takes the duration from the module). */
    unsigned long long cycles = 1000000ull;
    double ms, kernel_ms;
    const char *call;
    if ((rc = time_spin(fn, cycles, &ms, &call)) != CUDA_SUCCESS) return cu_failed(call, rc);
    if (ms > 0) cycles = (unsigned long long)((double)cycles * (kernel_us / 1000.0) / ms);
    if (cycles == 0) cycles = 1;
    if ((rc = time_spin(fn, cycles, &kernel_ms, &call)) != CUDA_SUCCESS) return cu_failed(call, rc);
    printf("burn seconds=%g kernel_ms=%.3f\n", seconds, kernel_ms);
    fflush(stdout);
    if (start_at_arg) printf("started late=%.3f\n", wait_until_unix(start_at));

    void *params[] = {&cycles};
    double start = now_s(), half = start + seconds / 2, half_started = 0, next_report = start + 1;
    unsigned long total = 0, second_half = 0, since_report = 0;
    int status = 0;
    double t, last_report = start;
    while (!stop_requested && (t = now_s()) < start + seconds) {
        if ((rc = cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL)) != CUDA_SUCCESS) {
            status = cu_failed("cuLaunchKernel", rc);
            break;
        }
        if ((rc = cuCtxSynchronize()) != CUDA_SUCCESS) {
            status = cu_failed("cuCtxSynchronize", rc);
            break;
        }
        total++;
        since_report++;
        if (t >= half) {
            if (!half_started) half_started = t;
            second_half++;
        }
        double after = now_s();
        if (after >= next_report) {
            double busy = (double)since_report * kernel_ms / 1000.0 / (after - last_report);
            printf("progress t=%.0fs launches=%lu busy=%.1f%%\n", after - start, total, 100.0 * busy);
            fflush(stdout);
            since_report = 0;
            last_report = after;
            next_report += 1;
        }
    }
    double end = now_s();
    /* Stopped early (a signal) before the second half began: measure over the whole run. */
    double from = half_started ? half_started : (end > half ? half : start);
    unsigned long counted = half_started ? second_half : total;
    double window = end - from;
    double share = window > 0 ? 100.0 * (double)counted * kernel_ms / 1000.0 / window : 0;
    if (share > 100) share = 100; /* timer granularity on very short runs */
    cuModuleUnload(mod);
    printf("launches=%lu\n", total);
    printf("share %.1f\n", share);
    return status;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[1];
    if (strcmp(cmd, "-h") == 0 || strcmp(cmd, "--help") == 0 || strcmp(cmd, "help") == 0) {
        usage(stdout);
        return 0;
    }
    if (strcmp(cmd, "smi") == 0) {
        if (argc != 2) return usage_error("smi takes no arguments (%s given)", argv[2]);
        return cmd_smi();
    }
    if (strcmp(cmd, "alloc") == 0) {
        if (argc < 3) return usage_error("%s needs at least one SIZE", cmd);
        return cmd_alloc(argc - 2, argv + 2);
    }
    if (strcmp(cmd, "hold") == 0) {
        if (argc != 4) return usage_error("%s needs SIZE SECONDS", cmd);
        return cmd_hold(argv[2], argv[3]);
    }
    if (strcmp(cmd, "burn") == 0) {
        if (argc < 3 || argc > 5) return usage_error("%s needs SECONDS [KERNEL_US [START_AT]]", cmd);
        return cmd_burn(argv[2], argc >= 4 ? argv[3] : NULL, argc == 5 ? argv[4] : NULL);
    }
    return usage_error("unknown command: %s", cmd);
}
