/*
 * The GPU-less NVIDIA driver test double: state shared by libcuda.so.1 and libnvidia-ml.so.1.
 *
 * GPUs are described by the file named in GPUSLICE_FAKE_GPU_CONFIG (a test fixture, so the
 * environment is fine here). Cross-process state (per-process memory, the busy timeline that
 * utilization is computed from) lives in "<config>.state/gpu<N>.bin" next to the config.
 *
 * The host-side part, like the kernel module: when gpuslice-fake-driverd serves
 * "<config>.state/driver.sock", every process that loads the double connects once and keeps the
 * connection open. The daemon tells it its host PID (SO_PEERCRED, translated into the daemon's PID
 * namespace), and frees the process's memory when the connection closes, however the process died.
 * Slots are then keyed by host PID (what NVML reports) and never judged alive or dead by a PID the
 * process cannot see. Without the socket, slots hold the process's own PID and liveness is checked
 * with kill(0) and the start time (fine while everything shares one PID namespace).
 *
 * With the daemon, the state is the daemon's alone, as the real driver's state is the kernel's: it
 * creates the files (mode 0644), clients map them read-only (NVML reads them without a round trip)
 * and every change (a slot, memory charged or freed, a context) is a request on the connection,
 * applied by the daemon to the peer's own slot and checked against the card, like an ioctl. Kernel
 * launches stay cheap: each process writes its busy intervals into its own segment (a sealed memfd
 * the daemon hands it), which the daemon merges into the device's timeline every few milliseconds and
 * before any reader's query; each launch first claims its time on the card's shared launch queue
 * (fake_queue), so processes' kernels on one card never overlap. A process can therefore only describe its own launches, never another
 * process's memory, contexts or time.
 */
#ifndef FAKE_COMMON_H
#define FAKE_COMMON_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#define FAKE_ENV "GPUSLICE_FAKE_GPU_CONFIG"
/* Where the double finds its GPUs without the variable, as the real driver needs none: the
 * simulated NVIDIA CDI spec mounts the node's description (and the daemon's socket) here. */
#define FAKE_DEFAULT_CONFIG "/run/nvidia-fake/fake-gpus.conf"
#define FAKE_MAX_GPUS 16
#define FAKE_MAX_PROCS 256
#define FAKE_MAX_NVLINKS 6
#define FAKE_RING 8192
#define FAKE_EXPORT __attribute__((visibility("default")))

typedef struct {
    char name[96];
    char uuid[48];
    unsigned char uuid_bytes[16];
    uint64_t memory_bytes;
    int cc_major, cc_minor;
    int multiprocessors;
    unsigned pci_domain, pci_bus, pci_device;
    unsigned pci_device_id;
    /* NVLinks (gpu.N.nvlink: the peer's bus id per link, comma-separated; none on a PCIe board,
     * where NVML answers NotSupported). A V100-SXM2 has 6 links. */
    int nvlink_count;
    unsigned nvlink_domain[FAKE_MAX_NVLINKS], nvlink_bus[FAKE_MAX_NVLINKS], nvlink_device[FAKE_MAX_NVLINKS];
    unsigned minor;
    char serial[32];
    uint64_t context_bytes; /* device memory each context takes (gpu.N.context_bytes; default 0) */
    unsigned context_create_us; /* how long creating a context takes (gpu.N.context_create_us; the
                                   real driver takes 100 ms and more; default 0) */
} fake_gpu;

#define FAKE_SOCK_NAME "driver.sock"

typedef struct {
    int32_t pid;     /* host PID when `managed`, else the process's own PID */
    uint32_t managed; /* 1: the daemon frees this slot when the process's connection closes */
    uint64_t start_time;
    _Atomic uint64_t used;
    _Atomic uint32_t contexts; /* live contexts: NVML lists a process with a context, memory or not */
    uint32_t pad2;
} fake_proc;

/* What the daemon sends a client right after it connects. */
typedef struct {
    char magic[8]; /* "FAKEDRV1" */
    int32_t host_pid;
    uint32_t pad;
    uint64_t host_start_time;
} fake_hello;

typedef struct {
    int32_t pid;
    uint32_t pad;
    uint64_t start_ns, end_ns; /* CLOCK_MONOTONIC */
} fake_busy;

/* One per GPU, shared by every process using the double. */
typedef struct {
    char magic[8];
    uint32_t version;
    uint32_t pad;
    pthread_mutex_t lock; /* robust, process-shared */
    _Atomic uint64_t busy_until_ns;
    _Atomic uint64_t ring_head;
    _Atomic uint64_t used_total; /* sum of live processes' used, maintained on alloc/free/reclaim */
    _Atomic uint64_t ring_seq;   /* odd while the daemon rewrites the ring (readers retry) */
    fake_proc procs[FAKE_MAX_PROCS];
    fake_busy ring[FAKE_RING];
} fake_dev_state;

typedef struct {
    int loaded;
    int count;
    fake_gpu gpus[FAKE_MAX_GPUS];
    char driver_version[32];
    int cuda_driver_version;
    char config_path[4096];
    char state_dir[4200];
    fake_dev_state *state[FAKE_MAX_GPUS];
    int state_index[FAKE_MAX_GPUS]; /* the GPU's place on the node (the state file's number) */
    int daemon_mode;                /* the state is the daemon's: read-only here, changed by requests */
} fake_system;

/* Requests on the daemon connection (SOCK_SEQPACKET: one message each, answered in order). */
enum {
    FAKE_OP_SLOT = 1,  /* the caller's slot on `dev` (created): val = its index in procs[] */
    FAKE_OP_CHARGE,    /* charge `arg` bytes to the caller on `dev`: rc 0, or 2 when the card is full */
    FAKE_OP_UNCHARGE,  /* give back `arg` bytes (never more than the caller holds) */
    FAKE_OP_CONTEXTS,  /* add `arg` (+1/-1) to the caller's live contexts on `dev` */
    FAKE_OP_SEGMENT,   /* the caller's busy segment (its fd comes with the answer) */
    FAKE_OP_SYNC,      /* merge every process's busy segment into the timelines now */
    FAKE_OP_QUEUE,     /* the node's launch queues (their fd comes with the answer) */
};
typedef struct {
    uint32_t op;
    int32_t dev; /* the GPU's place on the node */
    int64_t arg;
} fake_req;
typedef struct {
    int32_t rc; /* 0 ok, 1 bad request, 2 out of memory, 3 no slot free, 4 device not reachable */
    uint32_t pad;
    uint64_t val;
} fake_rep;

/* One process's own busy intervals (written by it, read and merged by the daemon). */
#define FAKE_SEG_RING 256
typedef struct {
    uint64_t start_ns;
    _Atomic uint64_t end_ns; /* the last entry grows while the process's kernels run back to back */
} fake_seg_busy;
typedef struct {
    _Atomic uint64_t until_ns; /* the end of this process's last launch */
    _Atomic uint64_t head;
    fake_seg_busy ring[FAKE_SEG_RING];
} fake_seg_dev;
typedef struct {
    char magic[8]; /* "FAKESEG1" */
    fake_seg_dev dev[FAKE_MAX_GPUS]; /* by the GPU's place on the node */
} fake_segment;

/* The cards' launch queues (daemon mode): one memfd the daemon hands every process, which maps it
 * read-write. A launch claims its kernel's time on the card here, at once, so kernels of different
 * processes on one card run one after another, as a GPU time-slices between contexts: the processes'
 * busy time never adds up to more than the card (the merged timelines come only every few
 * milliseconds, too late to queue behind). A process can push a card's queue ahead, which delays other
 * processes' kernels as long kernels of its own would (never further than FAKE_MAX_AHEAD_NS), but it
 * cannot describe their busy time: that is still only what each process's own segment says. */
#define FAKE_MAX_AHEAD_NS 10000000000ull
typedef struct {
    char magic[8];                            /* "FAKEQUE1" */
    _Atomic uint64_t until_ns[FAKE_MAX_GPUS]; /* the card booked up to here, by its place on the node */
} fake_queue;

/* Loads the config and maps the state (once per process). NULL with a message on stderr if unusable. */
fake_system *fake_system_get(void);

uint64_t fake_now_ns(void);
void fake_lock(fake_dev_state *s);
void fake_unlock(fake_dev_state *s);

/* This process's slot on a device (created on first use); dead processes' slots are reclaimed. */
fake_proc *fake_self_slot(fake_dev_state *s);
/* Bytes used on the device by live processes (caller holds the lock). */
uint64_t fake_used_locked(fake_dev_state *s);
int fake_proc_alive(const fake_proc *p);

/* Records [start, end) as busy for this process and returns the end (launch queue semantics). */
uint64_t fake_record_busy(fake_dev_state *s, uint64_t duration_ns);
/* Busy nanoseconds of `pid` (0: all processes) within [from_ns, to_ns). */
uint64_t fake_busy_between(fake_dev_state *s, int32_t pid, uint64_t from_ns, uint64_t to_ns);

uint64_t fake_start_time(int pid);

/* This process's PID as NVML reports it: the host PID the daemon told it, or getpid() without one. */
int32_t fake_self_pid(void);
/* Frees every slot of (host pid, start time) on every GPU: what the daemon does on disconnect. */
void fake_release_process(fake_system *s, int32_t pid, uint64_t start_time);
/* Loads the config for the daemon itself (it never connects to its own socket). */
fake_system *fake_system_load_for_daemon(const char *config_path);

/* Memory and contexts of the calling process on a device: through the daemon when it serves (the
 * state is read-only here), else directly in the shared state. fake_charge: 0, or -1 when the card is
 * full (or the daemon refuses). */
int fake_charge(fake_dev_state *s, uint64_t size);
void fake_uncharge(fake_dev_state *s, uint64_t size);
void fake_contexts_add(fake_dev_state *s, int delta);
/* When the device's queue drains, this process's own launches included. */
uint64_t fake_busy_until(fake_dev_state *s);

/* Appends [start, end) of `pid` to the device's timeline (caller holds the lock; the daemon merges
 * segments with it): joins the previous interval when it continues it, moves busy_until. */
void fake_ring_append(fake_dev_state *s, int32_t pid, uint64_t start_ns, uint64_t end_ns);

/* Maps a device state file by path (a MIG GPU instance's, fake_mig.h): FAKE_MAP_DIRECT shared read-write
 * (no daemon), FAKE_MAP_DAEMON the daemon's own (mode 0644), FAKE_MAP_CLIENT read-only. NULL with errno. */
enum { MAP_DIRECT, MAP_DAEMON, MAP_CLIENT };
#define FAKE_MAP_DIRECT MAP_DIRECT
#define FAKE_MAP_DAEMON MAP_DAEMON
#define FAKE_MAP_CLIENT MAP_CLIENT
fake_dev_state *fake_map_state_file(const char *path, int how);
/* With the daemon: has it make the caller's slot on `dev` (a card's place or FAKE_MIG_DEV); 0 or -1. */
int fake_daemon_slot(int dev);

#endif
