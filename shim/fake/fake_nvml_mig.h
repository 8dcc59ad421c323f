/* What the fake libnvidia-ml.so.1's MIG part (fake_nvml_mig.c) tells the rest of it about MIG devices. */
#ifndef FAKE_NVML_MIG_H
#define FAKE_NVML_MIG_H

#include <nvml.h>
#include <stdint.h>

#include "fake_common.h"

/* Whether a handle is a MIG device's (nvmlDeviceGetMigDeviceHandleByIndex, by-UUID lookup). */
int fake_nvml_is_mig_handle(nvmlDevice_t dev);

typedef struct {
    int card; /* the parent card's visible index */
    char name[160]; /* "NVIDIA A100-SXM4-80GB MIG 1g.10gb", as the driver names it */
    char uuid[48];  /* "MIG-..." */
    uint64_t memory_bytes, used_bytes; /* the GPU instance's */
    unsigned memory_slices;            /* of the card's 8 */
} fake_nvml_mig_info;

/* The MIG device behind a handle (still existing), or the error NVML answers for it. */
nvmlReturn_t fake_nvml_mig_describe(nvmlDevice_t dev, fake_nvml_mig_info *out);
/* nvmlDeviceGetHandleByUUID of a "MIG-..." UUID. */
nvmlReturn_t fake_nvml_mig_by_uuid(const char *uuid, nvmlDevice_t *device);
/* Memory used on the card's GPU instances (the card's own total includes it). */
uint64_t fake_nvml_mig_card_used(int card);

/* The process lists behind a handle beyond a card's own: a card in MIG mode (`card` >= 0) has its GPU
 * instances', a MIG device handle (`card` -1) its own instance's; with the ids NVML reports with them.
 * The count, or -1 with the error in *rc; *card_out is the card. */
typedef struct {
    fake_dev_state *state; /* read-only; kept by fake_nvml_mig.c */
    unsigned gi, ci;       /* 0xFFFFFFFF: the card's own (no instance) */
} fake_nvml_mig_procs;
#define FAKE_NVML_MIG_MAX_LISTS 8
int fake_nvml_mig_proc_lists(nvmlDevice_t dev, int card, fake_nvml_mig_procs *out, int cap, int *card_out,
                             nvmlReturn_t *rc);

#endif
