/*
 * Device attributes of the simulated models: every CUdevice_attribute a driver of the simulated CUDA
 * version knows, with the values NVIDIA's drivers report for the model (per architecture: compute
 * capability limits; per model: clocks, memory bus, L2). The per-model table agrees with
 * devtools/gpuslice_dev/gpusim/simulate.py's KNOWN_MODELS (tests/shim/test_cudart.py checks both
 * through the real runtime's cudaGetDeviceProperties).
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fake_cuda.h"

typedef struct {
    int major, minor;
    int shared_per_sm, shared_optin, threads_per_sm, blocks_per_sm, copy_engines;
    int cluster_launch, dma_buf;
} arch_t;

static const arch_t archs[] = {
    {7, 0, 98304, 98304, 2048, 32, 7, 0, 0},
    {7, 5, 65536, 65536, 1024, 16, 3, 0, 0},
    {8, 0, 167936, 166912, 2048, 32, 3, 0, 1},
    {8, 6, 102400, 101376, 1536, 16, 2, 0, 1},
    {8, 9, 102400, 101376, 1536, 24, 2, 0, 1},
    {9, 0, 233472, 232448, 2048, 32, 3, 1, 1},
};

typedef struct {
    const char *name;
    int clock_khz, memory_clock_khz, bus_width, l2_bytes, persisting_l2_max;
} model_t;

/* clock: the boost clock the driver reports (CU_DEVICE_ATTRIBUTE_CLOCK_RATE, kHz); memory clock in kHz. */
static const model_t models[] = {
    {"Tesla V100-PCIE-32GB", 1380000, 877000, 4096, 6291456, 0},
    {"Tesla V100-PCIE-16GB", 1380000, 877000, 4096, 6291456, 0},
    {"Tesla V100-SXM2-16GB", 1530000, 877000, 4096, 6291456, 0},
    {"Tesla V100-SXM2-32GB", 1530000, 877000, 4096, 6291456, 0},
    {"Tesla T4", 1590000, 5001000, 256, 4194304, 0},
    {"NVIDIA A100-SXM4-40GB", 1410000, 1215000, 5120, 41943040, 31457280},
    {"NVIDIA A100-PCIE-40GB", 1410000, 1215000, 5120, 41943040, 31457280},
    {"NVIDIA A100-SXM4-80GB", 1410000, 1593000, 5120, 41943040, 52428800},
    {"NVIDIA H100 80GB HBM3", 1980000, 2619000, 5120, 52428800, 82837504},
};

static const model_t unknown_model = {"", 1380000, 877000, 4096, 6291456, 0};

static const arch_t *arch_of(const fake_gpu *g)
{
    const arch_t *best = &archs[0]; /* the newest architecture not above the device's (archs is sorted) */
    for (size_t i = 0; i < sizeof(archs) / sizeof(archs[0]); i++)
        if (archs[i].major < g->cc_major || (archs[i].major == g->cc_major && archs[i].minor <= g->cc_minor))
            best = &archs[i];
    return best;
}

static const model_t *model_of(const fake_gpu *g)
{
    for (size_t i = 0; i < sizeof(models) / sizeof(models[0]); i++)
        if (strcmp(models[i].name, g->name) == 0) return &models[i];
    return &unknown_model;
}

/* The newest attribute a driver of the simulated CUDA version knows; newer ones are invalid values to it. */
static int max_attribute(void)
{
    int v = sys()->cuda_driver_version;
    if (v < 12030) return 132; /* CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED */
    if (v < 12080) return 134; /* CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID */
    if (v < 13000) return 138; /* CU_DEVICE_ATTRIBUTE_VULKAN_CIG_SUPPORTED */
    return 147;                /* CU_DEVICE_ATTRIBUTE_ONLY_PARTIAL_HOST_NATIVE_ATOMIC_SUPPORTED */
}

static int attribute_value(const fake_gpu *g, int a, int *v)
{
    const arch_t *ar = arch_of(g);
    const model_t *m = model_of(g);
    int cc = g->cc_major * 10 + g->cc_minor;
    switch (a) {
    case 1: *v = 1024; break;                               /* MAX_THREADS_PER_BLOCK */
    case 2: case 3: *v = 1024; break;                       /* MAX_BLOCK_DIM_X/Y */
    case 4: *v = 64; break;                                 /* MAX_BLOCK_DIM_Z */
    case 5: *v = 2147483647; break;                         /* MAX_GRID_DIM_X */
    case 6: case 7: *v = 65535; break;                      /* MAX_GRID_DIM_Y/Z */
    case 8: *v = 49152; break;                              /* MAX_SHARED_MEMORY_PER_BLOCK */
    case 9: *v = 65536; break;                              /* TOTAL_CONSTANT_MEMORY */
    case 10: *v = 32; break;                                /* WARP_SIZE */
    case 11: *v = 2147483647; break;                        /* MAX_PITCH */
    case 12: *v = 65536; break;                             /* MAX_REGISTERS_PER_BLOCK */
    case 13: *v = m->clock_khz; break;                      /* CLOCK_RATE */
    case 14: *v = 512; break;                               /* TEXTURE_ALIGNMENT */
    case 15: *v = 1; break;                                 /* GPU_OVERLAP */
    case 16: *v = g->multiprocessors; break;                /* MULTIPROCESSOR_COUNT */
    case 17: *v = 0; break;                                 /* KERNEL_EXEC_TIMEOUT */
    case 18: *v = 0; break;                                 /* INTEGRATED */
    case 19: *v = 1; break;                                 /* CAN_MAP_HOST_MEMORY */
    case 20: *v = CU_COMPUTEMODE_DEFAULT; break;            /* COMPUTE_MODE */
    case 21: *v = 131072; break;                            /* MAXIMUM_TEXTURE1D_WIDTH */
    case 22: *v = 131072; break;                            /* MAXIMUM_TEXTURE2D_WIDTH */
    case 23: *v = 65536; break;                             /* MAXIMUM_TEXTURE2D_HEIGHT */
    case 24: case 25: case 26: *v = 16384; break;           /* MAXIMUM_TEXTURE3D_* */
    case 27: case 28: *v = 32768; break;                    /* MAXIMUM_TEXTURE2D_LAYERED_WIDTH/HEIGHT */
    case 29: *v = 2048; break;                              /* MAXIMUM_TEXTURE2D_LAYERED_LAYERS */
    case 30: *v = 512; break;                               /* SURFACE_ALIGNMENT */
    case 31: *v = 1; break;                                 /* CONCURRENT_KERNELS */
    case 32: *v = 1; break;                                 /* ECC_ENABLED */
    case 33: *v = (int)g->pci_bus; break;                   /* PCI_BUS_ID */
    case 34: *v = (int)g->pci_device; break;                /* PCI_DEVICE_ID */
    case 35: *v = 0; break;                                 /* TCC_DRIVER */
    case 36: *v = m->memory_clock_khz; break;               /* MEMORY_CLOCK_RATE */
    case 37: *v = m->bus_width; break;                      /* GLOBAL_MEMORY_BUS_WIDTH */
    case 38: *v = m->l2_bytes; break;                       /* L2_CACHE_SIZE */
    case 39: *v = ar->threads_per_sm; break;                /* MAX_THREADS_PER_MULTIPROCESSOR */
    case 40: *v = ar->copy_engines; break;                  /* ASYNC_ENGINE_COUNT */
    case 41: *v = 1; break;                                 /* UNIFIED_ADDRESSING */
    case 42: *v = 32768; break;                             /* MAXIMUM_TEXTURE1D_LAYERED_WIDTH */
    case 43: *v = 2048; break;                              /* MAXIMUM_TEXTURE1D_LAYERED_LAYERS */
    case 44: *v = 0; break;                                 /* CAN_TEX2D_GATHER (deprecated) */
    case 45: case 46: *v = 32768; break;                    /* MAXIMUM_TEXTURE2D_GATHER_* */
    case 47: case 48: *v = 8192; break;                     /* MAXIMUM_TEXTURE3D_*_ALTERNATE */
    case 49: *v = 32768; break;
    case 50: *v = (int)g->pci_domain; break;                /* PCI_DOMAIN_ID */
    case 51: *v = 32; break;                                /* TEXTURE_PITCH_ALIGNMENT */
    case 52: case 53: *v = 32768; break;                    /* MAXIMUM_TEXTURECUBEMAP_* */
    case 54: *v = 2046; break;
    case 55: *v = 32768; break;                             /* MAXIMUM_SURFACE1D_WIDTH */
    case 56: *v = 131072; break;                            /* MAXIMUM_SURFACE2D_WIDTH */
    case 57: *v = 65536; break;
    case 58: case 59: case 60: *v = 16384; break;           /* MAXIMUM_SURFACE3D_* */
    case 61: *v = 32768; break;
    case 62: *v = 2048; break;
    case 63: case 64: *v = 32768; break;
    case 65: *v = 2048; break;
    case 66: case 67: *v = 32768; break;
    case 68: *v = 2046; break;
    case 69: *v = 268435456; break;                         /* MAXIMUM_TEXTURE1D_LINEAR_WIDTH (deprecated) */
    case 70: *v = 131072; break;
    case 71: *v = 65000; break;
    case 72: *v = 2097120; break;
    case 73: *v = 32768; break;
    case 74: *v = 32768; break;
    case 75: *v = g->cc_major; break;                       /* COMPUTE_CAPABILITY_MAJOR */
    case 76: *v = g->cc_minor; break;                       /* COMPUTE_CAPABILITY_MINOR */
    case 77: *v = 32768; break;
    case 78: *v = 1; break;                                 /* STREAM_PRIORITIES_SUPPORTED */
    case 79: case 80: *v = 1; break;                        /* GLOBAL/LOCAL_L1_CACHE_SUPPORTED */
    case 81: *v = ar->shared_per_sm; break;                 /* MAX_SHARED_MEMORY_PER_MULTIPROCESSOR */
    case 82: *v = 65536; break;                             /* MAX_REGISTERS_PER_MULTIPROCESSOR */
    case 83: *v = 1; break;                                 /* MANAGED_MEMORY */
    case 84: *v = 0; break;                                 /* MULTI_GPU_BOARD */
    case 85: *v = 0; break;
    case 86: *v = 0; break;                                 /* HOST_NATIVE_ATOMIC_SUPPORTED */
    case 87: *v = cc == 75 ? 32 : 2; break;                 /* SINGLE_TO_DOUBLE_PRECISION_PERF_RATIO */
    case 88: *v = 0; break;                                 /* PAGEABLE_MEMORY_ACCESS */
    case 89: *v = 1; break;                                 /* CONCURRENT_MANAGED_ACCESS */
    case 90: *v = 1; break;                                 /* COMPUTE_PREEMPTION_SUPPORTED */
    case 91: *v = 0; break;                                 /* CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM */
    case 92: *v = 0; break;                                 /* CAN_USE_STREAM_MEM_OPS_V1 */
    case 93: *v = 0; break;
    case 94: *v = 0; break;
    case 95: *v = 1; break;                                 /* COOPERATIVE_LAUNCH */
    case 96: *v = 1; break;                                 /* COOPERATIVE_MULTI_DEVICE_LAUNCH (deprecated) */
    case 97: *v = ar->shared_optin; break;                  /* MAX_SHARED_MEMORY_PER_BLOCK_OPTIN */
    case 98: *v = 0; break;                                 /* CAN_FLUSH_REMOTE_WRITES */
    case 99: *v = 1; break;                                 /* HOST_REGISTER_SUPPORTED */
    case 100: *v = 0; break;                                /* PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES */
    case 101: *v = 0; break;                                /* DIRECT_MANAGED_MEM_ACCESS_FROM_HOST */
    case 102: *v = 1; break;                                /* VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED */
    case 103: *v = 1; break;                                /* HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED */
    case 104: case 105: *v = 0; break;                      /* WIN32 handles */
    case 106: *v = ar->blocks_per_sm; break;                /* MAX_BLOCKS_PER_MULTIPROCESSOR */
    case 107: *v = cc >= 80; break;                         /* GENERIC_COMPRESSION_SUPPORTED */
    case 108: *v = m->persisting_l2_max; break;             /* MAX_PERSISTING_L2_CACHE_SIZE */
    case 109: *v = cc >= 80 ? 134213632 : 0; break;         /* MAX_ACCESS_POLICY_WINDOW_SIZE */
    case 110: *v = 1; break;                                /* GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED */
    case 111: *v = cc >= 80 ? 1024 : 0; break;              /* RESERVED_SHARED_MEMORY_PER_BLOCK */
    case 112: *v = 1; break;                                /* SPARSE_CUDA_ARRAY_SUPPORTED */
    case 113: *v = 1; break;                                /* READ_ONLY_HOST_REGISTER_SUPPORTED */
    case 114: *v = 1; break;                                /* TIMELINE_SEMAPHORE_INTEROP_SUPPORTED */
    case 115: *v = 1; break;                                /* MEMORY_POOLS_SUPPORTED */
    case 116: *v = 1; break;                                /* GPU_DIRECT_RDMA_SUPPORTED */
    case 117: *v = 1; break;                                /* GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS */
    case 118: *v = 0; break;                                /* GPU_DIRECT_RDMA_WRITES_ORDERING */
    case 119: *v = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR; break; /* MEMPOOL_SUPPORTED_HANDLE_TYPES */
    case 120: *v = ar->cluster_launch; break;               /* CLUSTER_LAUNCH */
    case 121: *v = 1; break;                                /* DEFERRED_MAPPING_CUDA_ARRAY_SUPPORTED */
    case 122: case 123: *v = 1; break;                      /* CAN_USE_64_BIT_STREAM_MEM_OPS, WAIT_VALUE_NOR */
    case 124: *v = ar->dma_buf; break;                      /* DMA_BUF_SUPPORTED */
    case 125: *v = 1; break;                                /* IPC_EVENT_SUPPORTED */
    case 126: *v = cc >= 90 ? 4 : 1; break;                 /* MEM_SYNC_DOMAIN_COUNT */
    case 127: *v = cc >= 90; break;                         /* TENSOR_MAP_ACCESS_SUPPORTED */
    case 128: *v = 0; break;                                /* HANDLE_TYPE_FABRIC_SUPPORTED */
    case 129: *v = 0; break;                                /* UNIFIED_FUNCTION_POINTERS */
    case 130: *v = 0; break;                                /* NUMA_CONFIG: none */
    case 131: *v = -1; break;                               /* NUMA_ID */
    case 132: *v = 0; break;                                /* MULTICAST_SUPPORTED */
    case 133: *v = 0; break;                                /* MPS_ENABLED */
    case 134: *v = -1; break;                               /* HOST_NUMA_ID */
    case 135: *v = 0; break;                                /* D3D12_CIG_SUPPORTED */
    case 136: case 137: *v = 0; break;                      /* MEM_DECOMPRESS_* */
    case 138: *v = 0; break;                                /* VULKAN_CIG_SUPPORTED */
    case 139: *v = (int)g->pci_device_id; break;           /* GPU_PCI_DEVICE_ID: device << 16 | vendor */
    case 140: *v = 0x124a10de; break;                       /* GPU_PCI_SUBSYSTEM_ID */
    case 141: case 142: case 143: *v = 0; break;            /* HOST_NUMA_* */
    case 144: case 145: *v = 0; break;                      /* HOST_MEMORY_POOLS / HOST_VMM */
    case 146: *v = 0; break;                                /* HOST_ALLOC_DMA_BUF_SUPPORTED */
    case 147: *v = 0; break;                                /* ONLY_PARTIAL_HOST_NATIVE_ATOMIC_SUPPORTED */
    default: return 0;
    }
    return 1;
}

FAKE_EXPORT CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev)
{
    CHECK_INIT();
    if (!pi) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    if ((int)attrib >= 1 && (int)attrib <= max_attribute() && attribute_value(&sys()->gpus[dev], (int)attrib, pi))
        return CUDA_SUCCESS;
    const char *t = getenv("GPUSLICE_FAKE_TRACE");
    if (t && t[0] != '0') fprintf(stderr, "fake NVIDIA driver: cuDeviceGetAttribute(%d): not an attribute of this driver\n", (int)attrib);
    return CUDA_ERROR_INVALID_VALUE;
}

FAKE_EXPORT CUresult cuDeviceComputeCapability(int *major, int *minor, CUdevice dev)
{
    CHECK_INIT();
    if (!major || !minor) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    *major = sys()->gpus[dev].cc_major;
    *minor = sys()->gpus[dev].cc_minor;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuDeviceGetProperties(CUdevprop *p, CUdevice dev)
{
    CHECK_INIT();
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    const fake_gpu *g = &sys()->gpus[dev];
    int v = 0;
    memset(p, 0, sizeof(*p));
    p->maxThreadsPerBlock = 1024;
    p->maxThreadsDim[0] = p->maxThreadsDim[1] = 1024;
    p->maxThreadsDim[2] = 64;
    p->maxGridSize[0] = 2147483647;
    p->maxGridSize[1] = p->maxGridSize[2] = 65535;
    p->sharedMemPerBlock = 49152;
    p->totalConstantMemory = 65536;
    p->SIMDWidth = 32;
    p->memPitch = 2147483647;
    p->regsPerBlock = 65536;
    attribute_value(g, 13, &v);
    p->clockRate = v;
    p->textureAlign = 512;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuDeviceGetLuid(char *luid, unsigned int *mask, CUdevice dev)
{
    (void)luid;
    (void)mask;
    CHECK_INIT();
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    return CUDA_ERROR_NOT_SUPPORTED; /* a Windows (WDDM) notion */
}

FAKE_EXPORT CUresult cuDeviceGetByPCIBusId(CUdevice *dev, const char *bus_id)
{
    CHECK_INIT();
    if (!dev || !bus_id) return CUDA_ERROR_INVALID_VALUE;
    unsigned dom = 0, bus = 0, d = 0;
    if (sscanf(bus_id, "%x:%x:%x", &dom, &bus, &d) != 3) {
        dom = 0;
        if (sscanf(bus_id, "%x:%x", &bus, &d) != 2) return CUDA_ERROR_INVALID_VALUE;
    }
    for (int i = 0; i < sys()->count; i++) {
        const fake_gpu *g = &sys()->gpus[i];
        if (g->pci_domain == dom && g->pci_bus == bus && g->pci_device == d) {
            *dev = i;
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_INVALID_DEVICE;
}

FAKE_EXPORT CUresult cuDeviceCanAccessPeer(int *can, CUdevice dev, CUdevice peer)
{
    CHECK_INIT();
    if (!can) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev) || !valid_dev(peer)) return CUDA_ERROR_INVALID_DEVICE;
    *can = 0; /* PCIe cards in different root complexes: no peer access */
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuDeviceGetP2PAttribute(int *value, CUdevice_P2PAttribute attrib, CUdevice src, CUdevice dst)
{
    (void)attrib;
    CHECK_INIT();
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(src) || !valid_dev(dst) || src == dst) return CUDA_ERROR_INVALID_DEVICE;
    *value = 0;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuDeviceGetTexture1DLinearMaxWidth(size_t *w, CUarray_format format, unsigned channels,
                                                        CUdevice dev)
{
    (void)format;
    (void)channels;
    CHECK_INIT();
    if (!w) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    *w = 268435456;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuDeviceGetExecAffinitySupport(int *pi, CUexecAffinityType type, CUdevice dev)
{
    CHECK_INIT();
    if (!pi || type >= CU_EXEC_AFFINITY_TYPE_MAX) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    *pi = 0; /* SM partitioning is an MPS feature */
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuFlushGPUDirectRDMAWrites(CUflushGPUDirectRDMAWritesTarget target,
                                                CUflushGPUDirectRDMAWritesScope scope)
{
    (void)target;
    (void)scope;
    CHECK_INIT();
    return CUDA_SUCCESS;
}
