/*
 * What the parts of the fake libcuda.so.1 share: the objects behind the driver's handles, the
 * card's memory accounting and the per-thread current context. Internal to the double (hidden
 * symbols); fake_common.h is what it shares with libnvidia-ml.so.1 and the daemon.
 */
#ifndef FAKE_CUDA_H
#define FAKE_CUDA_H

#include <cuda.h>
#include <stdint.h>

#include "fake_common.h"

#define PAGE_ALIGN 4096ull
#define QUEUE_AHEAD_NS 20000000ull /* a launch blocks when the device is booked this far ahead */

extern _Atomic int initialized;

struct CUctx_st;
extern __thread struct CUctx_st *current_ctx;
enum kind { K_LINEAR = 1, K_HOST_POOL = 2, K_IPC = 3, K_VMM_MAP = 4, K_POOL = 5, K_MODULE = 6 };

typedef struct alloc {
    uint64_t ptr, size;
    int dev, kind;
    int shared_fd; /* memfd backing the range once exported for IPC, else -1 */
    uintptr_t shared_fd_handle; /* K_VMM_MAP: the vmm_alloc mapped here; K_POOL: its pool; K_MODULE: its module */
    struct CUctx_st *ctx;       /* the context it belongs to (freed with it); NULL for VMM mappings */
    int managed;                /* cuMemAllocManaged */
    struct alloc *next;
} alloc;

#define NBUCKETS 4096
extern alloc *buckets[NBUCKETS];
extern pthread_mutex_t alloc_lock;

/* Context limits (cuCtxSetLimit) the driver backs with device memory: malloc heap, per-thread stack
 * (times every thread the device can hold resident), printf FIFO. The defaults are part of the
 * context's own cost (gpu.N.context_bytes); a larger limit charges the difference. */
enum { LIM_HEAP, LIM_STACK, LIM_FIFO, LIM_N };
extern const uint64_t limit_default[LIM_N];
#define THREADS_PER_SM 2048ull

struct CUctx_st {
    int magic;
    CUdevice dev;
    int primary;
    int refcount;
    uint64_t limits[LIM_N];
};
#define CTX_MAGIC 0x43545831
extern struct CUctx_st primary_ctx[FAKE_MAX_GPUS];

struct CUstream_st {
    CUcontext ctx;
    unsigned flags;
    int priority;
    int capturing; /* CUstreamCaptureStatus */
    struct CUgraph_st *capture_graph;
};
/* A module-scope variable of a loaded module: at `offset` in the module's device memory. */
struct fake_global {
    char *name;
    uint64_t offset, size;
    int managed;
};
/* A loaded module: the image chosen for the device (decompressed, owned), to find functions in, and
 * the device memory its variables live in (one K_MODULE allocation of its context, `data_bytes`). */
struct CUmod_st {
    int magic;
    uint64_t duration_ns;
    int kind; /* FATBIN_CUBIN, FATBIN_PTX, or 0: an image whose functions cannot be listed (any name) */
    void *image;
    size_t size;
    CUdevice dev;
    int library; /* a library's: its memory comes back in a later context when its context went */
    struct fake_global *globals;
    unsigned nglobals;
    uint64_t data, data_bytes; /* device address (0: none), bytes charged */
};
#define MOD_MAGIC 0x4d4f4431
/* Functions and kernels (a CUkernel may be passed where a CUfunction is expected: same head). */
struct CUfunc_st {
    int magic;
    uint64_t duration_ns; /* its module's */
    int time_rule;        /* the GPUSLICE_FAKE_KERNEL_TIME rule naming it, or -1 */
    CUdevice dev;
    struct CUmod_st *mod;
    char name[256];
};
#define FUNC_MAGIC 0x46554e43
#define KERNEL_MAGIC 0x4b45524e
/* A stream-ordered pool keeps freed memory reserved (charged to the card) until a synchronization
 * finds it above the release threshold, or cuMemPoolTrimTo; like the driver's. */
struct CUmemPoolHandle_st {
    CUmemLocationType type;
    int id;
    uint64_t reserved, in_use, reserved_high, used_high, threshold;
    int is_default;
    struct CUmemPoolHandle_st *next;
};
/* An array keeps its bytes (row-major: `row` bytes by `height` rows by `depth` slices; mapped
 * lazily), so copies into and out of it move real data; a mipmapped array's levels keep none. */
struct CUarray_st {
    uint64_t size;
    int dev;
    char *data; /* NULL for a mipmapped array */
    size_t row, height, depth;
};
struct CUmipmappedArray_st {
    uint64_t size;
    int dev;
    char *data;
    size_t row, height, depth;
};
/* Runs a 3-D copy between host, device and array memory (cuda_vmm.c); an array side must lie inside it. */
CUresult fake_copy3d(const CUDA_MEMCPY3D *c);
struct CUgraph_st {
    uint64_t duration_ns;
    uint64_t mem_bytes; /* memory alloc nodes, its child graphs' included */
    struct CUgraphNode_st **nodes;
    size_t nnodes, cap;
    int owned; /* moved into a parent's child graph node: freed with it, never alone */
};
/* Graph memory: an executable graph's alloc nodes get physical memory at its first launch and keep
 * it; destroying the executable returns it to the device's graph pool, which keeps it reserved
 * until cuDeviceGraphMemTrim. */
struct CUgraphExec_st {
    uint64_t duration_ns;
    CUdevice dev;
    uint64_t mem_bytes;
    int backed;
    struct CUgraphNode_st *ops; /* its copy and memset nodes, replayed in order at each launch */
    size_t nops;
    /* its top-level kernel nodes (the graph's node handles) and the duration each has in it now */
    const struct CUgraphNode_st **knodes;
    uint64_t *kdur;
    size_t nk;
};
struct CUextMemory_st {
    int fd;
    uint64_t size;
};
struct CUgraphNode_st {
    CUgraphNodeType type;
    struct CUgraph_st *graph;
    uint64_t duration_ns; /* a kernel node's */
    uint64_t mem_bytes;   /* an alloc node's */
    /* a copy node (CU_GRAPH_NODE_TYPE_MEMCPY: rows of `width` bytes) or a fill (MEMSET: `width`
     * elements of `elem` bytes per row): what it does at each launch */
    char *dst;
    const char *src;
    size_t width, height, dst_pitch, src_pitch, elem;
    unsigned char value[8];
    struct CUgraph_st *child; /* a child graph node's graph (owned by the node) */
    size_t nin;               /* dependencies it has: a root has none */
};
/* Records a copy or fill into a capturing stream's graph: 1 if `s` is capturing (nothing ran), 0 if not. */
int fake_capture_op(CUstream s, CUgraphNodeType type, void *dst, const void *src, size_t width, size_t height,
                    size_t dst_pitch, size_t src_pitch, const void *value, size_t elem);
/* Runs one copy or fill node. */
void fake_graph_op_run(const struct CUgraphNode_st *op);
/* An executable graph takes its graph's copy and fill nodes at instantiation. */
CUresult fake_graph_exec_take_ops(struct CUgraphExec_st *x, const struct CUgraph_st *g);
/* Frees what fake_graph_exec_take_ops gave an executable graph. */
void fake_graph_exec_free_ops(struct CUgraphExec_st *x);
/* A new node of `type` in `g` (cuda_graph.c); NULL when out of memory. */
struct CUgraphNode_st *fake_graph_node(struct CUgraph_st *g, CUgraphNodeType type);
/* Frees a graph and its nodes. */
void fake_graph_free(struct CUgraph_st *g);
/* Checks that `deps` are `n` nodes of `g` and records them on `node`: CUDA_ERROR_INVALID_VALUE if not. */
CUresult fake_graph_deps(struct CUgraph_st *g, struct CUgraphNode_st *node, const CUgraphNode *deps, size_t n);
/* A copy of `g`, its nodes and child graphs (NULL when out of memory). */
struct CUgraph_st *fake_graph_clone(const struct CUgraph_st *g);
struct CUevent_st {
    uint64_t t_ns; /* where the device timeline reaches the event; 0 until recorded */
    CUdevice dev;
};
/* A VMM physical allocation (cuMemCreate): backed by a memfd; alive while the application holds a
 * handle to it (create/import/retain, each undone by a cuMemRelease) or any mapping of it. */
#define VMM_MAGIC 0x564d4d31
typedef struct vmm_alloc_s {
    int magic;
    uint64_t size;
    int dev;         /* -1: host location, not on a GPU */
    int charged;     /* counted in the card's used memory (device location, created here) */
    int fd;          /* memfd */
    int handle_refs; /* handles held by the application */
    int map_refs;    /* live mappings */
    struct vmm_alloc_s *next;
} vmm_alloc;
extern vmm_alloc *vmm_live;
extern pthread_mutex_t vmm_lock;

extern struct CUmemPoolHandle_st default_pool[FAKE_MAX_GPUS];
extern struct CUmemPoolHandle_st *pools;
extern pthread_mutex_t pool_lock;
extern pthread_mutex_t primary_lock;
extern uint64_t graph_spare[FAKE_MAX_GPUS], graph_backed[FAKE_MAX_GPUS];


#define CHECK_INIT()                                                                                     \
    do {                                                                                                 \
        if (!atomic_load(&initialized)) return CUDA_ERROR_NOT_INITIALIZED;                               \
    } while (0)

fake_system *sys(void);
int valid_dev(CUdevice d);
CUresult charge(int dev, uint64_t size);
void uncharge(int dev, uint64_t size);
/* Files a copy of an allocation record under its address. */
void track_alloc(const alloc *rec);
/* ... one in the current context, with no IPC export, not managed. */
void track(uint64_t ptr, uint64_t size, int dev, int kind);
alloc *untrack(uint64_t ptr);
/* The allocation holding [ptr, ptr+1): 1 and its range, or 0. */
int find_range(uint64_t ptr, uint64_t *base, uint64_t *size);
/* A copy of the allocation holding ptr: 1 if there is one. */
int find_alloc(uint64_t ptr, alloc *out);
/* A zero fill of n elements of elem bytes done by giving whole pages back (cuda_stream.c); 0: not done. */
int discard_zero_fill(CUdeviceptr dst, const void *value, size_t elem, size_t n);
CUresult current_dev(CUdevice *dev);
uint64_t rounded(uint64_t size);
CUresult device_alloc(uint64_t *out, uint64_t size, int dev);
void device_free(alloc *a);
/* Drops a handle (handle_ref) or mapping reference of a VMM allocation; frees it at the last one. */
void vmm_unref(vmm_alloc *v, int handle_ref);
void free_ctx_allocs(struct CUctx_st *c);
void wait_device_idle(CUdevice dev);
void pools_release(CUdevice dev);
/* The device a stream works on (the legacy and per-thread handles: the current context's). */
CUresult stream_dev(CUstream s, CUdevice *dev);
/* How long a launch of f with that grid keeps the device busy (GPUSLICE_FAKE_KERNEL_TIME, else its
 * module's duration). */
uint64_t fake_kernel_duration(const struct CUfunc_st *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                              unsigned by, unsigned bz);
/* 0 when GPUSLICE_FAKE_KERNEL_TIME is set and cannot be read (cuInit then fails). */
int fake_kernel_time_spec_ok(void);
/* Books `duration_ns` on the device's timeline; blocks when the launch queue is full. */
CUresult occupy(CUdevice dev, uint64_t duration_ns);

/* Narrows the loaded cards to the devices CUDA shows this process: MIG devices of cards in MIG mode,
 * CUDA_VISIBLE_DEVICES (cuda_mig.c). Once, at the first cuInit. */
void fake_cuda_select_devices(fake_system *s);

#endif
