/*
 * Kernel images a process loads: the driver's answer is passed through unchanged, and what the
 * process's software cannot do on the slice's GPU is recorded in the usage region (gs_software) so
 * the agent can tell the tenant. A CUDA build without the device's architecture (CUDA 13 dropped
 * sm_70) fails at its first kernel with "no kernel image is available"; with lazy loading the driver
 * may accept the image and refuse only at the launch, so the image's table of contents is read here
 * and judged as the driver judges it (src/fatbin.h). Loading is not a hot path.
 *
 * The CUDA runtime loads the fatbins nvcc registered through cuLibraryLoadData (12.x and 13.x);
 * cuModuleLoad* are the older and the explicit paths (CuPy's RawModule, NVRTC output).
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../fatbin.h"
#include "../gs_cuda.h"

#define MAX_ENTRIES 64
#define MAX_FILE_BYTES (256u << 20) /* images read back from a file path, at most */
#define SEEN_IMAGES 64

/* Images already judged by this process (by address and first words): each is recorded once. */
static uint64_t seen[SEEN_IMAGES];
static _Atomic unsigned seen_count;
static pthread_mutex_t seen_lock = PTHREAD_MUTEX_INITIALIZER;

static int first_time(const void *image)
{
    const uint64_t *w = image;
    uint64_t key = (uint64_t)(uintptr_t)image ^ (w[0] * 0x9E3779B97F4A7C15ull) ^ w[1];
    int fresh = 1;
    pthread_mutex_lock(&seen_lock);
    unsigned n = atomic_load(&seen_count);
    for (unsigned i = 0; i < n && fresh; i++) fresh = seen[i] != key;
    if (fresh && n < SEEN_IMAGES) {
        seen[n] = key;
        atomic_store(&seen_count, n + 1);
    }
    pthread_mutex_unlock(&seen_lock);
    return fresh;
}

static int device_arch(int *major, int *minor)
{
    CUdevice dev = 0;
    if (current_device(&dev) != 0) dev = 0;
    if (real_cuDeviceGetAttribute == NULL) return -1;
    if (real_cuDeviceGetAttribute(major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev) != CUDA_SUCCESS ||
        real_cuDeviceGetAttribute(minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev) != CUDA_SUCCESS)
        return -1;
    return 0;
}

/* The driver's CUDA version, asked once: a runtime calls cuGetProcAddress hundreds of times at start. */
static int driver_version(void)
{
    static _Atomic int cached; /* 0: not known yet */
    int v = atomic_load_explicit(&cached, memory_order_relaxed);
    if (v != 0) return v;
    if (real_cuDriverGetVersion == NULL || real_cuDriverGetVersion(&v) != CUDA_SUCCESS) return 0;
    atomic_store_explicit(&cached, v, memory_order_relaxed);
    return v;
}

/* PTX ISA of a PTX entry (decompressed when it must be); 0 when unknown (assumed compilable). */
static unsigned entry_isa(const fatbin_entry *e)
{
    if (e->kind != FATBIN_PTX) return 0;
    if (e->compression == FATBIN_RAW) return ptx_isa_version(e->payload, e->payload_size);
    if (e->raw_size == 0 || e->raw_size > (64u << 20)) return 0;
    char *buf = malloc(e->raw_size);
    if (buf == NULL) return 0;
    unsigned isa = fatbin_entry_data(e, buf, e->raw_size) == 0 ? ptx_isa_version(buf, e->raw_size) : 0;
    free(buf);
    return isa;
}

/* Judges `image` for the current device after the driver answered `rc`; records what cannot run. */
static void judge(const void *image, size_t size_hint, CUresult rc)
{
    if (image == NULL || gs_ensure_init() != GS_MODE_ACTIVE || !first_time(image)) return;
    int major = 0, minor = 0, drv = driver_version();
    if (device_arch(&major, &minor) != 0) return;
    fatbin_entry entries[MAX_ENTRIES];
    unsigned isa[MAX_ENTRIES];
    int n = 0;
    enum image_type type = image_type_of(image);
    const void *fb = fatbin_of(image);
    if (fb != NULL) {
        n = fatbin_entries(fb, entries, MAX_ENTRIES);
        if (n > MAX_ENTRIES) n = MAX_ENTRIES;
    } else if (type == IMAGE_CUBIN && size_hint > 0) {
        int specific = 0;
        entries[0] = (fatbin_entry){.kind = FATBIN_CUBIN, .arch = cubin_arch(image, size_hint, &specific),
                                    .arch_specific = specific, .payload = image, .payload_size = size_hint,
                                    .raw_size = size_hint};
        n = entries[0].arch ? 1 : 0;
    } else if (type == IMAGE_PTX) {
        size_t len = strnlen(image, MAX_FILE_BYTES);
        entries[0] = (fatbin_entry){.kind = FATBIN_PTX, .arch = ptx_target(image, len), .payload = image,
                                    .payload_size = len, .raw_size = len};
        n = 1;
    }
    if (n <= 0) return; /* not an image this parser reads: say nothing rather than guess */
    for (int i = 0; i < n; i++) isa[i] = entry_isa(&entries[i]);
    int why = 0;
    int pick = fatbin_pick(entries, isa, n, major, minor, ptx_isa_max_for_driver(drv), &why);
    int refused = rc == CUDA_ERROR_NO_BINARY_FOR_GPU || rc == CUDA_ERROR_UNSUPPORTED_PTX_VERSION;
    if (pick >= 0 && !refused) {
        gs_region_note_image_ok(&gs_reg);
        return;
    }
    gs_software rec;
    memset(&rec, 0, sizeof(rec));
    int code = refused ? (int)rc : why;
    rec.kind = code == CUDA_ERROR_UNSUPPORTED_PTX_VERSION ? GS_SW_PTX_TOO_NEW : GS_SW_NO_KERNEL_IMAGE;
    rec.cuda_error = refused ? (uint32_t)rc : 0;
    rec.device_arch = (uint32_t)(major * 10 + minor);
    rec.driver_version = (uint32_t)drv;
    rec.arch_count = (uint32_t)n;
    for (int i = 0; i < n && i < (int)GS_SOFTWARE_ARCHS; i++)
        rec.archs[i] = (uint16_t)(entries[i].arch | (entries[i].kind == FATBIN_PTX ? GS_ARCH_PTX : 0));
    gs_region_note_software(&gs_reg, &rec);
}

/* A file's bytes for judging (the driver reads the file itself); NULL when unreadable or huge. */
static void *read_image(const char *path, size_t *size)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return NULL;
    struct stat st;
    char *buf = NULL;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 16 && (size_t)st.st_size <= MAX_FILE_BYTES &&
        (buf = malloc((size_t)st.st_size + 1)) != NULL) {
        size_t got = 0;
        while (got < (size_t)st.st_size) {
            ssize_t r = read(fd, buf + got, (size_t)st.st_size - got);
            if (r <= 0) break;
            got += (size_t)r;
        }
        buf[got] = '\0';
        *size = got;
    }
    close(fd);
    return buf;
}

static void judge_file(const char *path, CUresult rc)
{
    if (path == NULL || gs_ensure_init() != GS_MODE_ACTIVE) return;
    size_t size = 0;
    void *image = read_image(path, &size);
    if (image == NULL) return;
    judge(image, size, rc);
    free(image);
}

GS_EXPORT CUresult cuModuleLoadData(CUmodule *module, const void *image)
{
    NEED_REAL(cuModuleLoadData);
    CUresult rc = real_cuModuleLoadData(module, image);
    judge(image, 0, rc);
    return rc;
}

GS_EXPORT CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions,
                                      CUjit_option *options, void **optionValues)
{
    NEED_REAL(cuModuleLoadDataEx);
    CUresult rc = real_cuModuleLoadDataEx(module, image, numOptions, options, optionValues);
    judge(image, 0, rc);
    return rc;
}

GS_EXPORT CUresult cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin)
{
    NEED_REAL(cuModuleLoadFatBinary);
    CUresult rc = real_cuModuleLoadFatBinary(module, fatCubin);
    judge(fatCubin, 0, rc);
    return rc;
}

GS_EXPORT CUresult cuModuleLoad(CUmodule *module, const char *fname)
{
    NEED_REAL(cuModuleLoad);
    CUresult rc = real_cuModuleLoad(module, fname);
    judge_file(fname, rc);
    return rc;
}

GS_EXPORT CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions,
                                     void **jitOptionsValues, unsigned int numJitOptions,
                                     CUlibraryOption *libraryOptions, void **libraryOptionValues,
                                     unsigned int numLibraryOptions)
{
    NEED_REAL(cuLibraryLoadData);
    CUresult rc = real_cuLibraryLoadData(library, code, jitOptions, jitOptionsValues, numJitOptions, libraryOptions,
                                         libraryOptionValues, numLibraryOptions);
    judge(code, 0, rc);
    return rc;
}

GS_EXPORT CUresult cuLibraryLoadFromFile(CUlibrary *library, const char *fileName, CUjit_option *jitOptions,
                                         void **jitOptionsValues, unsigned int numJitOptions,
                                         CUlibraryOption *libraryOptions, void **libraryOptionValues,
                                         unsigned int numLibraryOptions)
{
    NEED_REAL(cuLibraryLoadFromFile);
    CUresult rc = real_cuLibraryLoadFromFile(library, fileName, jitOptions, jitOptionsValues, numJitOptions,
                                             libraryOptions, libraryOptionValues, numLibraryOptions);
    judge_file(fileName, rc);
    return rc;
}

/* A runtime asks for entry points as of its own CUDA version: a newer major than the driver's means
 * the runtime will refuse to start (cudaErrorInsufficientDriver) and the tenant should be told why. */
void gs_module_runtime_version(int cuda_version)
{
    static _Atomic int noted;
    if (atomic_load_explicit(&noted, memory_order_relaxed) || gs_ensure_init() != GS_MODE_ACTIVE) return;
    int drv = driver_version();
    if (drv <= 0 || cuda_version / 1000 <= drv / 1000 || atomic_exchange(&noted, 1)) return;
    gs_software rec;
    memset(&rec, 0, sizeof(rec));
    int major = 0, minor = 0;
    if (device_arch(&major, &minor) == 0) rec.device_arch = (uint32_t)(major * 10 + minor);
    rec.kind = GS_SW_DRIVER_TOO_OLD;
    rec.cuda_error = CUDA_ERROR_NOT_FOUND;
    rec.driver_version = (uint32_t)drv;
    rec.runtime_version = (uint32_t)cuda_version;
    gs_region_note_software(&gs_reg, &rec);
}
