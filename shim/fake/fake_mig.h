/*
 * The driver double's MIG state, shared by libnvidia-ml (which changes it, as nvidia-smi and the
 * node agent do through NVML), libcuda (which shows a process its MIG device) and the host daemon.
 *
 * Like the real driver's, the state outlives the process that made it: "<config>.state/mig.bin"
 * holds each card's MIG mode (current and pending) and its GPU and compute instances. Changing it
 * takes write access to the file, as changing MIG takes root on the driver: the file is mode 0644,
 * so root (or the daemon's user) may, any other process gets NVML_ERROR_NO_PERMISSION, and a pod,
 * which gets the state directory mounted read-only, never may. Writers serialize on flock and
 * bump a sequence number readers use to take a consistent copy.
 *
 * Each GPU instance has its own memory, like a card: "<config>.state/gpu<N>.gi<id>.<gen>.bin" is a
 * device state file (fake_dev_state) whose capacity is the instance's memory. A process on a MIG
 * device charges its allocations there, so one instance never takes another's memory and an
 * allocation past the instance fails in the driver itself.
 */
#ifndef FAKE_MIG_H
#define FAKE_MIG_H

#include <stdint.h>

#include "fake_common.h"
#include "mig_profiles.h"

#define FAKE_MIG_MAX_GI 8
#define FAKE_MIG_MAX_CI 8

typedef struct {
    uint32_t live;
    uint32_t id;          /* unique within its GPU instance, from 0 */
    uint32_t profile;     /* NVML_COMPUTE_INSTANCE_PROFILE_* (also its profile id) */
    uint32_t start, size; /* compute slices within the GPU instance */
    uint32_t generation;  /* the card's creation counter when it was made */
    char uuid[48];        /* the MIG device's "MIG-xxxxxxxx-xxxx-5xxx-xxxx-xxxxxxxxxxxx" */
    unsigned char uuid_bytes[16];
} fake_mig_ci;

typedef struct {
    uint32_t live;
    uint32_t id;          /* unique on the card, from 1 */
    uint32_t profile;     /* NVML_GPU_INSTANCE_PROFILE_* index */
    uint32_t start, size; /* memory slices */
    uint32_t generation;  /* handles to a destroyed instance stay invalid after a new one takes its slot */
    fake_mig_ci ci[FAKE_MIG_MAX_CI];
} fake_mig_gi;

typedef struct {
    char uuid[48]; /* the card the slot describes */
    uint32_t current, pending; /* NVML_DEVICE_MIG_DISABLE / _ENABLE */
    uint32_t generation;
    uint32_t pad;
    fake_mig_gi gi[FAKE_MIG_MAX_GI];
} fake_mig_card;

typedef struct {
    char magic[8]; /* "FAKEMIG1" */
    uint32_t size;
    _Atomic uint32_t seq; /* odd while a writer changes it */
    fake_mig_card cards[FAKE_MAX_GPUS]; /* by the GPU's place on the node */
} fake_mig_state;

/* A consistent copy of the MIG state of visible GPU `index` (all zero: MIG never enabled). */
void fake_mig_snapshot(fake_system *s, int index, fake_mig_card *out);

/* Writer side: the state mapped read-write and locked against other writers, or NULL (errno EACCES
 * when this process may not change MIG). fake_mig_write_end publishes and unlocks. */
fake_mig_state *fake_mig_write_begin(fake_system *s);
void fake_mig_write_end(fake_mig_state *m);
/* The daemon creates the (empty) file at start; without one the first writer does. */
int fake_mig_prepare(fake_system *s);

/* "<state_dir>/gpu<slot>.gi<id>.<generation>.bin": every instance made has a file of its own */
void fake_mig_gi_path(const fake_system *s, int slot, const fake_mig_gi *g, char *out, size_t n);
/* The memory state file of a new GPU instance (writer side, no daemon); 0 or -1. */
int fake_mig_gi_file_create(fake_system *s, int slot, const fake_mig_gi *g);
/* Whether a process holds memory or a context on the GPU instance. */
int fake_mig_gi_busy(fake_system *s, int slot, const fake_mig_gi *g);
/* Memory used on the GPU instance by live processes. */
uint64_t fake_mig_gi_used(fake_system *s, int slot, const fake_mig_gi *g);

/* What a process on a MIG device names in its requests to the daemon: the GPU instance of the card
 * at node place `slot`, beyond every card's place. */
#define FAKE_MIG_DEV(slot, gi_id) (0x10000 | ((slot) << 8) | (int)(gi_id))
#define FAKE_MIG_DEV_CARD(dev) (((dev) >> 8) & 0xff)
/* Daemon side: the memory state and capacity of such a GPU instance while it exists (its file made
 * afresh for each new instance); 0, or -1 when it names none. */
int fake_mig_daemon_device(fake_system *s, int dev, fake_dev_state **d, uint64_t *cap);
/* Daemon side, at start: serves the instances there are, freeing what processes that ended while no
 * daemon watched held on them (as it does for the cards). */
void fake_mig_daemon_start(fake_system *s);
/* Daemon side: frees what a disconnected process held on GPU instances. */
void fake_mig_daemon_release(int32_t pid, uint64_t start_time);

/* The MIG UUID of a new compute instance (deterministic in its card, ids and generation). */
void fake_mig_make_uuid(const char *card_uuid, unsigned gi, unsigned ci, unsigned generation, char *out, size_t n,
                        unsigned char bytes[16]);

#endif
