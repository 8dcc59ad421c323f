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
 *
 * A module's variables (__device__, __constant__) are device memory the driver allocates at the load
 * and frees at the unload or with the module's context: the slice is charged what they take (read
 * from the image the driver will choose, laid out as src/image_globals.h says) before the driver is
 * asked, so a large __device__ array cannot take memory past the slice.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../fatbin.h"
#include "../gs_cuda.h"
#include "../image_globals.h"

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

/* The file name (no directory) of what `image` came from: the file a path load read, else the mapped
 * library or program the image lies in (the runtime hands the driver the fatbins nvcc put into
 * .nv_fatbin, so this names e.g. libtorch_cuda.so); empty for memory the process built. */
static void image_origin(const void *image, const char *path, char *out, size_t size)
{
    Dl_info info;
    memset(&info, 0, sizeof(info));
    if (path == NULL && dladdr(image, &info) != 0) path = info.dli_fname;
    if (path == NULL) return;
    const char *base = strrchr(path, '/');
    snprintf(out, size, "%s", base ? base + 1 : path);
}

/* Judges `image` (read from the file `path`, or NULL) for the current device after the driver
 * answered `rc`; records what cannot run. */
static void judge(const void *image, size_t size_hint, CUresult rc, const char *path)
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
    image_origin(image, path, rec.library, sizeof(rec.library));
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

/* ---------------------------------------------------------------- module variables */

#define MAX_MODULE_RECORDS 4096
typedef struct {
    uintptr_t handle; /* CUmodule or CUlibrary; 0: free */
    uint64_t bytes;
    unsigned ctx; /* the context index it goes with (0: a library, context-independent) */
} module_record;
static module_record module_records[MAX_MODULE_RECORDS];
static pthread_mutex_t module_lock = PTHREAD_MUTEX_INITIALIZER;

/* The bytes the variables of one chosen image (cubin or PTX, `size` bytes) take. */
static uint64_t chosen_vars_bytes(int kind, const void *image, size_t size)
{
    int n = kind == FATBIN_CUBIN ? cubin_globals(image, size, NULL, 0) : ptx_globals(image, size, NULL, 0);
    if (n <= 0) return 0;
    image_global *g = calloc((size_t)n, sizeof(*g));
    if (g == NULL) return 0;
    n = kind == FATBIN_CUBIN ? cubin_globals(image, size, g, n) : ptx_globals(image, size, g, n);
    uint64_t b = n > 0 ? image_globals_bytes(g, n) : 0;
    free(g);
    return b;
}

/* What the variables of the image the driver will load for the current device take; 0 when the
 * image cannot be read here (a zstd-compressed entry: not charged). */
static uint64_t image_vars_bytes(const void *image, size_t size_hint)
{
    int major = 0, minor = 0;
    if (image == NULL || device_arch(&major, &minor) != 0) return 0;
    enum image_type type = image_type_of(image);
    if (type == IMAGE_PTX) return chosen_vars_bytes(FATBIN_PTX, image, strnlen(image, MAX_FILE_BYTES));
    if (type == IMAGE_CUBIN) {
        const unsigned char *p = image;
        uint64_t shoff;
        uint16_t shnum;
        memcpy(&shoff, p + 0x28, 8);
        memcpy(&shnum, p + 0x3c, 2);
        uint64_t end = shoff + (uint64_t)shnum * 64; /* the section headers come last in a cubin */
        if (size_hint && end > size_hint) return 0;
        return end <= MAX_FILE_BYTES ? chosen_vars_bytes(FATBIN_CUBIN, image, (size_t)end) : 0;
    }
    const void *fb = fatbin_of(image);
    if (fb == NULL) return 0;
    fatbin_entry entries[MAX_ENTRIES];
    unsigned isa[MAX_ENTRIES];
    int n = fatbin_entries(fb, entries, MAX_ENTRIES);
    if (n <= 0) return 0;
    if (n > MAX_ENTRIES) n = MAX_ENTRIES;
    for (int i = 0; i < n; i++) isa[i] = entry_isa(&entries[i]);
    int why = 0;
    int pick = fatbin_pick(entries, isa, n, major, minor, ptx_isa_max_for_driver(driver_version()), &why);
    if (pick < 0 || entries[pick].raw_size == 0 || entries[pick].raw_size > MAX_FILE_BYTES) return 0;
    char *buf = malloc(entries[pick].raw_size + 1);
    if (buf == NULL) return 0;
    uint64_t b = 0;
    if (fatbin_entry_data(&entries[pick], buf, entries[pick].raw_size) == 0) {
        buf[entries[pick].raw_size] = '\0';
        b = chosen_vars_bytes(entries[pick].kind, buf, entries[pick].raw_size);
    }
    free(buf);
    return b;
}

/* Reserves a module's variables on the slice before the load: the bytes reserved (0: none to
 * charge), or UINT64_MAX when the slice has no room for them. */
static uint64_t vars_reserve(const void *image, size_t size_hint)
{
    CUdevice dev;
    if (gs_ensure_init() != GS_MODE_ACTIVE || current_device(&dev) != 0 || !device_is_slice(dev)) return 0;
    uint64_t b = image_vars_bytes(image, size_hint);
    if (b == 0) return 0;
    if (gs_region_reserve(&gs_reg, b) != 0 && reserve_retry(b) != CUDA_SUCCESS) {
        gs_region_count_refused(&gs_reg);
        return UINT64_MAX;
    }
    return b;
}

/* After the load: keeps the reservation with the handle, or gives it back when the load failed. */
static void vars_settle(uint64_t bytes, CUresult rc, uintptr_t handle, int library)
{
    if (bytes == 0 || bytes == UINT64_MAX) return;
    if (rc != CUDA_SUCCESS || handle == 0) {
        release(bytes);
        return;
    }
    CUcontext c = NULL;
    if (!library && real_cuCtxGetCurrent != NULL) (void)real_cuCtxGetCurrent(&c);
    unsigned ctx = library ? 0 : ctx_index((uintptr_t)c);
    pthread_mutex_lock(&module_lock);
    int i = 0;
    while (i < MAX_MODULE_RECORDS && module_records[i].handle != 0) i++;
    if (i < MAX_MODULE_RECORDS) module_records[i] = (module_record){handle, bytes, ctx};
    pthread_mutex_unlock(&module_lock);
    if (i == MAX_MODULE_RECORDS) { /* cannot be credited later: not charged (logged) */
        gs_log("module table full; a module's variables are not counted");
        release(bytes);
    }
}

static void vars_credit(uintptr_t handle)
{
    uint64_t b = 0;
    pthread_mutex_lock(&module_lock);
    for (int i = 0; i < MAX_MODULE_RECORDS; i++)
        if (module_records[i].handle == handle) {
            b = module_records[i].bytes;
            module_records[i] = (module_record){0, 0, 0};
            break;
        }
    pthread_mutex_unlock(&module_lock);
    if (b) release(b);
}

/* A context went: the driver unloaded its modules and freed their variables. */
void gs_module_context_gone(unsigned ctx)
{
    if (ctx == 0) return;
    uint64_t b = 0;
    pthread_mutex_lock(&module_lock);
    for (int i = 0; i < MAX_MODULE_RECORDS; i++)
        if (module_records[i].handle != 0 && module_records[i].ctx == ctx) {
            b += module_records[i].bytes;
            module_records[i] = (module_record){0, 0, 0};
        }
    pthread_mutex_unlock(&module_lock);
    if (b) release(b);
}

/* Loads through `call` with the variables reserved first; CUDA_ERROR_OUT_OF_MEMORY when they do not fit. */
#define LOAD_CHARGED(image, size_hint, out, library, call)                                               \
    do {                                                                                                 \
        uint64_t vars_ = vars_reserve(image, size_hint);                                                 \
        if (vars_ == UINT64_MAX) return CUDA_ERROR_OUT_OF_MEMORY;                                        \
        CUresult rc_ = (call);                                                                           \
        vars_settle(vars_, rc_, rc_ == CUDA_SUCCESS && (out) ? (uintptr_t)*(out) : 0, library);          \
        judge(image, size_hint, rc_, NULL);                                                                    \
        return rc_;                                                                                      \
    } while (0)

GS_EXPORT CUresult cuModuleUnload(CUmodule hmod)
{
    NEED_REAL(cuModuleUnload);
    CUresult rc = real_cuModuleUnload(hmod);
    if (rc == CUDA_SUCCESS) vars_credit((uintptr_t)hmod);
    return rc;
}

GS_EXPORT CUresult cuLibraryUnload(CUlibrary library)
{
    NEED_REAL(cuLibraryUnload);
    CUresult rc = real_cuLibraryUnload(library);
    if (rc == CUDA_SUCCESS) vars_credit((uintptr_t)library);
    return rc;
}

GS_EXPORT CUresult cuModuleLoadData(CUmodule *module, const void *image)
{
    NEED_REAL(cuModuleLoadData);
    LOAD_CHARGED(image, 0, module, 0, real_cuModuleLoadData(module, image));
}

GS_EXPORT CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions,
                                      CUjit_option *options, void **optionValues)
{
    NEED_REAL(cuModuleLoadDataEx);
    LOAD_CHARGED(image, 0, module, 0, real_cuModuleLoadDataEx(module, image, numOptions, options, optionValues));
}

GS_EXPORT CUresult cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin)
{
    NEED_REAL(cuModuleLoadFatBinary);
    LOAD_CHARGED(fatCubin, 0, module, 0, real_cuModuleLoadFatBinary(module, fatCubin));
}

GS_EXPORT CUresult cuModuleLoad(CUmodule *module, const char *fname)
{
    NEED_REAL(cuModuleLoad);
    size_t size = 0;
    void *image = fname != NULL && gs_ensure_init() == GS_MODE_ACTIVE ? read_image(fname, &size) : NULL;
    uint64_t vars = vars_reserve(image, size);
    if (vars == UINT64_MAX) {
        free(image);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUresult rc = real_cuModuleLoad(module, fname);
    vars_settle(vars, rc, rc == CUDA_SUCCESS && module ? (uintptr_t)*module : 0, 0);
    if (image != NULL) judge(image, size, rc, fname);
    free(image);
    return rc;
}

GS_EXPORT CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions,
                                     void **jitOptionsValues, unsigned int numJitOptions,
                                     CUlibraryOption *libraryOptions, void **libraryOptionValues,
                                     unsigned int numLibraryOptions)
{
    NEED_REAL(cuLibraryLoadData);
    LOAD_CHARGED(code, 0, library, 1,
                 real_cuLibraryLoadData(library, code, jitOptions, jitOptionsValues, numJitOptions, libraryOptions,
                                        libraryOptionValues, numLibraryOptions));
}

GS_EXPORT CUresult cuLibraryLoadFromFile(CUlibrary *library, const char *fileName, CUjit_option *jitOptions,
                                         void **jitOptionsValues, unsigned int numJitOptions,
                                         CUlibraryOption *libraryOptions, void **libraryOptionValues,
                                         unsigned int numLibraryOptions)
{
    NEED_REAL(cuLibraryLoadFromFile);
    size_t size = 0;
    void *image = fileName != NULL && gs_ensure_init() == GS_MODE_ACTIVE ? read_image(fileName, &size) : NULL;
    uint64_t vars = vars_reserve(image, size);
    if (vars == UINT64_MAX) {
        free(image);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUresult rc = real_cuLibraryLoadFromFile(library, fileName, jitOptions, jitOptionsValues, numJitOptions,
                                             libraryOptions, libraryOptionValues, numLibraryOptions);
    vars_settle(vars, rc, rc == CUDA_SUCCESS && library ? (uintptr_t)*library : 0, 1);
    if (image != NULL) judge(image, size, rc, fileName);
    free(image);
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
