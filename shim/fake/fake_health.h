/*
 * The driver double's card health: XID events, a GPU fallen off the bus, pending page retirements
 * and row remaps, and recovery (a reset), injected per GPU from the host.
 *
 * State lives in "<config>.state/health.bin", shared like the per-GPU state files, so every process
 * that loads the double (the node agent, a pod's CUDA program) sees a fault the moment it is
 * injected. `gpuslice-fake-gpu-fault` (fake_gpu_fault.c) is the only writer; readers take one
 * atomic load on the hot paths. XID events sit in a ring with a sequence number; NVML event sets
 * (nvmlEventSetCreate / nvmlDeviceRegisterEvents / nvmlEventSetWait_v2) deliver those raised after
 * the device was registered, and a waiter sleeps on a futex on the sequence, as idle as a real one.
 */
#ifndef FAKE_HEALTH_H
#define FAKE_HEALTH_H

#include <stdatomic.h>
#include <stdint.h>

#include "fake_common.h"

#define FAKE_HEALTH_RING 64

typedef struct {
    _Atomic uint32_t seq; /* 0: empty */
    uint32_t gpu; /* the GPU's place on the node (its state index) */
    uint32_t xid;
    uint32_t pad;
    uint64_t time_ns; /* CLOCK_REALTIME */
} fake_xid_event;

typedef struct {
    char uuid[48];           /* which card the slot describes (filled by the writer) */
    _Atomic uint32_t lost;   /* fallen off the bus: NVML_ERROR_GPU_IS_LOST, CUDA calls fail */
    _Atomic uint32_t ecc;    /* an uncorrectable ECC error hit the running contexts (XID 48/94/95) */
    _Atomic uint32_t retired_pages_pending; /* nvmlDeviceGetRetiredPagesPendingStatus */
    _Atomic uint32_t remap_pending;         /* nvmlDeviceGetRemappedRows isPending */
    _Atomic uint32_t remap_failed;          /* nvmlDeviceGetRemappedRows failureOccurred (XID 64) */
    uint32_t pad;
} fake_gpu_health;

typedef struct {
    char magic[8]; /* "FAKEHLT1" */
    uint32_t size;
    _Atomic uint32_t seq;     /* last event's sequence number; a futex word */
    _Atomic uint32_t faulty;  /* nonzero while any slot holds a fault: the hot paths' only load */
    uint32_t pad;
    fake_gpu_health gpus[FAKE_MAX_GPUS];
    fake_xid_event ring[FAKE_HEALTH_RING];
} fake_health_state;

/* The node's shared health state (mapped on first use); NULL when the double has no config. */
fake_health_state *fake_health(void);
/* The health slot of this process's GPU `index` (visible numbering), or NULL. */
fake_gpu_health *fake_health_of(int index);
/* This process's visible index of the node's GPU `slot`, or -1 when it cannot see it. */
int fake_health_visible_index(uint32_t slot);

/* What a CUDA call on visible GPU `index` returns while the card is faulty: 0 (CUDA_SUCCESS) when
 * healthy, CUDA_ERROR_UNKNOWN (999) on a lost card, CUDA_ERROR_ECC_UNCORRECTABLE (214) after an
 * uncorrectable ECC error. */
int fake_health_cuda_error(int index);
/* Nonzero when NVML must answer NVML_ERROR_GPU_IS_LOST for visible GPU `index`. */
int fake_health_lost(int index);
/* Nonzero when any GPU this process can see is lost (NVML's by-UUID and by-serial lookups fail). */
int fake_health_any_lost(void);

/* Writer side (gpuslice-fake-gpu-fault; `s` loaded for the daemon, so it sees every GPU). The
 * daemon prepares the (empty) file at start: clients of a daemon never create state files. */
int fake_health_prepare(fake_system *s);
int fake_health_raise_xid(fake_system *s, int slot, unsigned xid);
int fake_health_set(fake_system *s, int slot, int lost, int remap_pending);
int fake_health_clear(fake_system *s, int slot);

#endif
