/*
 * The per-slice usage region: <usage_dir>/usage.bin, shared by every process of a slice and read by
 * the node agent. Layout (little-endian, fixed offsets; see shim/README.md, "Usage region"):
 *
 *   header, 4096 bytes                     entries, GS_REGION_MAX_ENTRIES x 128 bytes from offset 4096
 *     0  char     magic[8] "GPUSLICE"        0  u32 state (0 free, 1 live)
 *     8  u32      version (1)                4  i32 pid (in the process's own pid namespace)
 *    12  u32      header_size (4096)         8  u64 start_time (clock ticks since boot, /proc/pid/stat #22)
 *    16  u32      entry_size (128)          16  u64 used       bytes allocated now
 *    20  u32      max_entries (1024)        24  u64 avail      granted to the process, not yet allocated
 *    24  u64      memory_limit_bytes        32  u64 quota      granted in total (changed only under lock)
 *    32  u32      compute_share             40  u64 peak       high-water mark of used
 *    36  u32      reserved                  48  u64 refused    allocations refused
 *    40  u64      refused_allocations_total 56  u64 throttled_ns time slept in launch throttling
 *    48  u64      throttled_ns_total        64  u64 context_bytes contexts' memory charged (part of used)
 *    56  u64      agent_utilization         72  i32 host_pid (as NVML reports it; 0 unknown), 76..127 reserved
 *    64  u64      shim_utilization
 *    72  u64      throttle_delay_ns
 *    80  u64      lock_recoveries_total
 *    88  u32      entries_high_water (entries at or above it were never used)
 *   128  pthread_mutex_t lock (robust, process-shared; 64 bytes reserved)
 *   512  gs_software software     the slice's software compatibility record (see gs_software)
 *  1024  gs_export exports[96]   memory of this slice exported for IPC (see gs_region_export_add)
 *
 * Utilization words encode (unix_time_ms << 16) | basis_points (0..10000); 0 means "none".
 * A live entry's owner holds an OFD write lock on the first byte of its entry; the kernel drops it
 * when the process dies, however it dies, so liveness never depends on pids (pid namespaces differ
 * between containers of a pod) and the lock holder set is exact.
 *
 * Invariant: sum(quota) over live entries <= memory_limit_bytes, and each process's allocated bytes
 * <= quota - avail. Allocation on the fast path only CASes the caller's own `avail` down (no lock).
 */
#ifndef GS_REGION_H
#define GS_REGION_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "gs_config.h"

#define GS_REGION_MAGIC "GPUSLICE"
#define GS_REGION_VERSION 1u
#define GS_REGION_HEADER_SIZE 4096u
#define GS_REGION_ENTRY_SIZE 128u
#define GS_REGION_MAX_ENTRIES 1024u
#define GS_REGION_FILE "usage.bin"
#define GS_REGION_SIZE (GS_REGION_HEADER_SIZE + GS_REGION_MAX_ENTRIES * GS_REGION_ENTRY_SIZE)
/* Bytes granted to a process at a time (at least; limit/8 on large slices), so most allocations stay
 * on the lock-free path. Other processes take back unallocated grants when they need them. */
#define GS_REGION_CHUNK (64ull << 20)

typedef struct {
    char magic[8];
    uint32_t version;
    uint32_t header_size;
    uint32_t entry_size;
    uint32_t max_entries;
    uint64_t memory_limit_bytes;
    uint32_t compute_share;
    uint32_t reserved0;
    _Atomic uint64_t refused_allocations_total;
    _Atomic uint64_t throttled_ns_total;
    _Atomic uint64_t agent_utilization;
    _Atomic uint64_t shim_utilization;
    _Atomic uint64_t throttle_delay_ns;
    _Atomic uint64_t lock_recoveries_total;
    _Atomic uint32_t entries_high_water;
    unsigned char reserved1[128 - 92];
    union {
        pthread_mutex_t lock;
        unsigned char lock_space[64];
    };
} gs_region_header;

typedef struct {
    _Atomic uint32_t state;
    int32_t pid;
    uint64_t start_time;
    _Atomic uint64_t used;
    _Atomic uint64_t avail;
    _Atomic uint64_t quota;
    _Atomic uint64_t peak;
    _Atomic uint64_t refused;
    _Atomic uint64_t throttled_ns;
    _Atomic uint64_t context_bytes;
    _Atomic int32_t host_pid; /* the pid NVML reports for this process (learned at its first context); 0 unknown */
    unsigned char reserved[128 - 76];
} gs_region_entry;

/* An allocation a process of the slice exported with cuIpcGetMemHandle: a process of the same slice
 * that opens it maps memory the slice already pays for, so the open is not charged again. */
#define GS_EXPORTS_OFFSET 1024u
#define GS_MAX_EXPORTS 96u
typedef struct {
    _Atomic uint64_t key; /* hash of the 64-byte IPC handle; 0 = free */
    uint64_t dptr;        /* the exporter's device pointer */
    uint32_t owner;       /* the exporter's entry index */
    uint32_t reserved;
    uint64_t reserved2;
} gs_export;
_Static_assert(sizeof(gs_export) == 32, "export layout");
_Static_assert(GS_EXPORTS_OFFSET + GS_MAX_EXPORTS * sizeof(gs_export) <= GS_REGION_HEADER_SIZE, "exports fit");

/* What the slice's software could not do on its GPU, for the tenant to be told (status condition
 * SoftwareCompatible): written by the shim when a process loads a kernel image no image of which runs
 * on the device, or the driver refuses one, or a runtime asks for a newer CUDA major than the driver's.
 * Informational only (the region is the tenant's to write): never used for a decision about another
 * slice or for enforcement. `seq` is odd while a writer fills the record (readers retry).
 *
 *   0 u32 seq    4 u32 kind (gs_software_kind)   8 u32 cuda_error (the driver's answer, 0 if it loaded)
 *  12 u32 device_arch (70)   16 u32 driver_version (12020)   20 u32 runtime_version (13000; 0 unknown)
 *  24 i32 pid   28 u32 arch_count (images in the kernel image; archs[] holds the first 16)
 *  32 u16 archs[16] (sm arch, | GS_ARCH_PTX for PTX)   64 char process[16] (comm)
 *  80 u64 time_ms (unix ms)   88 u64 ok_time_ms (last image that loaded and runs on the device)
 *  96 u64 first_use_ms (first context any process of the slice created)   104 u64 records_total
 * 112 char library[32] (file name of the library or program the image was in: "libtorch_cuda.so"; empty
 *     when the image came from memory the process built, as NVRTC output) */
#define GS_SOFTWARE_OFFSET 512u
#define GS_SOFTWARE_ARCHS 16u
#define GS_ARCH_PTX 0x8000u
enum gs_software_kind {
    GS_SW_NONE = 0,
    GS_SW_NO_KERNEL_IMAGE = 1, /* no cubin for the device's architecture and no PTX it can JIT */
    GS_SW_PTX_TOO_NEW = 2,     /* only PTX of an ISA newer than the driver compiles */
    GS_SW_DRIVER_TOO_OLD = 3,  /* a runtime of a newer CUDA major than the driver supports */
};
typedef struct {
    _Atomic uint32_t seq;
    uint32_t kind;
    uint32_t cuda_error;
    uint32_t device_arch;
    uint32_t driver_version;
    uint32_t runtime_version;
    int32_t pid;
    uint32_t arch_count;
    uint16_t archs[GS_SOFTWARE_ARCHS];
    char process[16];
    uint64_t time_ms;
    _Atomic uint64_t ok_time_ms;
    _Atomic uint64_t first_use_ms;
    _Atomic uint64_t records_total;
    char library[32];
} gs_software;
_Static_assert(sizeof(gs_software) == 144, "software record layout");
_Static_assert(GS_SOFTWARE_OFFSET >= 192 && GS_SOFTWARE_OFFSET + sizeof(gs_software) <= GS_EXPORTS_OFFSET,
               "the software record fits between the lock and the exports");

_Static_assert(sizeof(gs_region_entry) == GS_REGION_ENTRY_SIZE, "entry layout");
_Static_assert(sizeof(pthread_mutex_t) <= 64, "mutex fits its slot");
_Static_assert(sizeof(gs_region_header) <= GS_REGION_HEADER_SIZE, "header layout");

typedef struct {
    int fd;
    char path[GS_PATH_MAX];
    unsigned char *base;
    gs_region_header *hdr;
    gs_region_entry *entries;
    _Atomic int self; /* this process's entry, -1 until the first allocation */
    uint64_t limit;   /* from the read-only limits file; GS_UNLIMITED: account, never refuse */
    /* Bytes this process holds, in its own memory: the region is writable by every process of the
     * slice (and so by the tenant), so its words only share the slice between processes; whatever
     * they say, one process never holds more than `limit`. */
    _Atomic uint64_t held;
} gs_region;

/* Maps (creating and initializing if needed) <usage_dir>/usage.bin. -1 with reason in err. */
int gs_region_open(gs_region *r, const gs_config *cfg, char *err, size_t errlen);

void gs_region_lock(gs_region *r);
void gs_region_unlock(gs_region *r);

/* Reserves `size` bytes for this process: 0 on success, -1 when the slice has no room. The slow
 * path of gs_region_reserve, which has already charged `size` to `held` (undone on refusal). */
int gs_region_reserve_slow(gs_region *r, uint64_t size);

/* Refuses (and counts) an allocation the process's own holdings cannot take; undoes its charge. */
int gs_region_refuse_held(gs_region *r, uint64_t size);

static inline int gs_region_reserve(gs_region *r, uint64_t size)
{
    if (r->limit != GS_UNLIMITED) {
        uint64_t h = atomic_fetch_add_explicit(&r->held, size, memory_order_relaxed) + size;
        if (__builtin_expect(h > r->limit || h < size, 0)) return gs_region_refuse_held(r, size);
    }
    int self = atomic_load_explicit(&r->self, memory_order_acquire);
    if (__builtin_expect(self < 0, 0)) return gs_region_reserve_slow(r, size);
    gs_region_entry *e = &r->entries[self];
    if (r->limit != GS_UNLIMITED) {
        uint64_t a = atomic_load_explicit(&e->avail, memory_order_relaxed);
        for (;;) {
            if (a < size) return gs_region_reserve_slow(r, size);
            if (atomic_compare_exchange_weak_explicit(&e->avail, &a, a - size, memory_order_acq_rel,
                                                      memory_order_relaxed))
                break;
        }
    }
    uint64_t used = atomic_fetch_add_explicit(&e->used, size, memory_order_relaxed) + size;
    uint64_t peak = atomic_load_explicit(&e->peak, memory_order_relaxed);
    while (used > peak &&
           !atomic_compare_exchange_weak_explicit(&e->peak, &peak, used, memory_order_relaxed, memory_order_relaxed)) {
    }
    return 0;
}

/* Credits `size` bytes back to this process after the driver freed them. */
static inline void gs_region_release(gs_region *r, uint64_t size)
{
    int self = atomic_load_explicit(&r->self, memory_order_acquire);
    if (self < 0) return;
    gs_region_entry *e = &r->entries[self];
    atomic_fetch_sub_explicit(&e->used, size, memory_order_relaxed);
    if (r->limit != GS_UNLIMITED) {
        atomic_fetch_add_explicit(&e->avail, size, memory_order_release);
        atomic_fetch_sub_explicit(&r->held, size, memory_order_relaxed);
    }
}

/* Counts a refused allocation in the region (header total and, when attached, the own entry). */
void gs_region_count_refused(gs_region *r);

/* Bytes in use by all live processes of the slice (reclaims dead entries first). */
uint64_t gs_region_used_total(gs_region *r);

/* Fills pids[] (at most max) with the pids of live entries; returns how many. */
int gs_region_live_pids(gs_region *r, int32_t *pids, int max);
/* 1 when `pid`, as NVML reports it, is a live process of this slice (its own pid or learned host pid). */
int gs_region_has_nvml_pid(gs_region *r, int32_t pid);

/* Records that this process exported `dptr` under handle hash `key` (no-op when the table is full:
 * the open is then charged, the old behaviour). */
void gs_region_export_add(gs_region *r, uint64_t key, uint64_t dptr);
/* 1 when a live process of this slice exported the handle hashed to `key`. */
int gs_region_export_known(gs_region *r, uint64_t key);
/* Forgets this process's exports of `dptr` (it was freed). */
void gs_region_export_drop(gs_region *r, uint64_t dptr);

/* Records what a process's software could not do on the GPU (fields of `rec` but seq and the counters;
 * time, pid and process name filled here). No-op without a region. */
void gs_region_note_software(gs_region *r, const gs_software *rec);
/* A kernel image loaded that runs on the device (clears the tenant's condition when newer). */
void gs_region_note_image_ok(gs_region *r);
/* A process of the slice created a context (the first one's time is kept). */
void gs_region_note_first_use(gs_region *r);

/* Called in a forked child: the child gets its own entry on first use. */
void gs_region_after_fork_child(gs_region *r);

/* Reads /proc/<pid>/stat field 22 (start time in clock ticks since boot); 0 if unknown. */
uint64_t gs_process_start_time(int pid);

static inline uint64_t gs_util_encode(uint64_t unix_ms, unsigned basis_points)
{
    return (unix_ms << 16) | (basis_points & 0xffffu);
}

#endif
