/*
 * The MIG profiles of the simulated MIG-capable models, as their drivers report them
 * (`nvidia-smi mig -lgip` / `-lgipp`, i.e. nvmlDeviceGetGpuInstanceProfileInfoV and
 * nvmlDeviceGetGpuInstancePossiblePlacements_v2): a card has 7 compute slices and 8 memory slices;
 * a GPU instance profile takes `slices` compute slices and the memory slices of its placement.
 *
 * Profile ids are the driver's (19 for 1g, 15 for the 1g with two memory slices, 14, 9, 5, 0), not
 * the NVML_GPU_INSTANCE_PROFILE_* indexes they are looked up by. Memory is NVML's memorySizeMB (MiB);
 * the multiprocessor counts are those of the whole instance.
 */
#ifndef MIG_PROFILES_H
#define MIG_PROFILES_H

#include <stdio.h>

#define MIG_MEMORY_SLICES 8
#define MIG_COMPUTE_SLICES 7
#define MIG_MAX_PLACEMENTS 8

typedef struct {
    unsigned index; /* NVML_GPU_INSTANCE_PROFILE_* */
    unsigned id;    /* the driver's profile id (nvmlGpuInstanceProfileInfo_t.id) */
    const char *name; /* "1g.10gb" ("MIG 1g.10gb" in NVML's v2 struct) */
    unsigned slices, instances, sms, copy_engines, decoders, encoders, jpegs, ofas;
    unsigned long long memory_mb;
    unsigned nstarts;
    unsigned starts[MIG_MAX_PLACEMENTS]; /* memory slice where each placement starts */
    unsigned size;                       /* memory slices a placement occupies */
} mig_gi_profile;

typedef struct {
    const char *model; /* the card's NVML name */
    unsigned nprofiles;
    mig_gi_profile profiles[8];
} mig_model;

/* index, id, name, slices, instances, SMs, CE, DEC, ENC, JPEG, OFA, MiB, placements (starts), size */
static const mig_model mig_models[] = {
    {"NVIDIA A100-SXM4-40GB", 7, {
        {0, 19, "1g.5gb", 1, 7, 14, 1, 0, 0, 0, 0, 4864, 7, {0, 1, 2, 3, 4, 5, 6}, 1},
        {7, 20, "1g.5gb+me", 1, 1, 14, 1, 1, 0, 1, 1, 4864, 7, {0, 1, 2, 3, 4, 5, 6}, 1},
        {9, 15, "1g.10gb", 1, 4, 14, 1, 1, 0, 0, 0, 9856, 4, {0, 2, 4, 6}, 2},
        {1, 14, "2g.10gb", 2, 3, 28, 2, 1, 0, 0, 0, 9856, 3, {0, 2, 4}, 2},
        {2, 9, "3g.20gb", 3, 2, 42, 3, 2, 0, 0, 0, 19968, 2, {0, 4}, 4},
        {3, 5, "4g.20gb", 4, 1, 56, 4, 2, 0, 0, 0, 19968, 1, {0}, 4},
        {4, 0, "7g.40gb", 7, 1, 98, 7, 5, 0, 1, 1, 40192, 1, {0}, 8},
    }},
    {"NVIDIA A100-PCIE-40GB", 7, {
        {0, 19, "1g.5gb", 1, 7, 14, 1, 0, 0, 0, 0, 4864, 7, {0, 1, 2, 3, 4, 5, 6}, 1},
        {7, 20, "1g.5gb+me", 1, 1, 14, 1, 1, 0, 1, 1, 4864, 7, {0, 1, 2, 3, 4, 5, 6}, 1},
        {9, 15, "1g.10gb", 1, 4, 14, 1, 1, 0, 0, 0, 9856, 4, {0, 2, 4, 6}, 2},
        {1, 14, "2g.10gb", 2, 3, 28, 2, 1, 0, 0, 0, 9856, 3, {0, 2, 4}, 2},
        {2, 9, "3g.20gb", 3, 2, 42, 3, 2, 0, 0, 0, 19968, 2, {0, 4}, 4},
        {3, 5, "4g.20gb", 4, 1, 56, 4, 2, 0, 0, 0, 19968, 1, {0}, 4},
        {4, 0, "7g.40gb", 7, 1, 98, 7, 5, 0, 1, 1, 40192, 1, {0}, 8},
    }},
    {"NVIDIA A100-SXM4-80GB", 7, {
        {0, 19, "1g.10gb", 1, 7, 14, 1, 0, 0, 0, 0, 9728, 7, {0, 1, 2, 3, 4, 5, 6}, 1},
        {7, 20, "1g.10gb+me", 1, 1, 14, 1, 1, 0, 1, 1, 9728, 7, {0, 1, 2, 3, 4, 5, 6}, 1},
        {9, 15, "1g.20gb", 1, 4, 14, 1, 1, 0, 0, 0, 19968, 4, {0, 2, 4, 6}, 2},
        {1, 14, "2g.20gb", 2, 3, 28, 2, 1, 0, 0, 0, 19968, 3, {0, 2, 4}, 2},
        {2, 9, "3g.40gb", 3, 2, 42, 3, 2, 0, 0, 0, 40192, 2, {0, 4}, 4},
        {3, 5, "4g.40gb", 4, 1, 56, 4, 2, 0, 0, 0, 40192, 1, {0}, 4},
        {4, 0, "7g.80gb", 7, 1, 98, 7, 5, 0, 1, 1, 80896, 1, {0}, 8},
    }},
    {"NVIDIA H100 80GB HBM3", 7, {
        {0, 19, "1g.10gb", 1, 7, 16, 1, 1, 0, 1, 0, 9984, 7, {0, 1, 2, 3, 4, 5, 6}, 1},
        {7, 20, "1g.10gb+me", 1, 1, 16, 1, 1, 0, 1, 1, 9984, 7, {0, 1, 2, 3, 4, 5, 6}, 1},
        {9, 15, "1g.20gb", 1, 4, 26, 1, 1, 0, 1, 0, 20096, 4, {0, 2, 4, 6}, 2},
        {1, 14, "2g.20gb", 2, 3, 32, 2, 2, 0, 2, 0, 20096, 3, {0, 2, 4}, 2},
        {2, 9, "3g.40gb", 3, 2, 60, 3, 3, 0, 3, 0, 40448, 2, {0, 4}, 4},
        {3, 5, "4g.40gb", 4, 1, 64, 4, 4, 0, 4, 0, 40448, 1, {0}, 4},
        {4, 0, "7g.80gb", 7, 1, 132, 8, 7, 0, 7, 1, 81152, 1, {0}, 8},
    }},
};

static inline const mig_model *mig_model_of(const char *name)
{
    for (unsigned i = 0; i < sizeof(mig_models) / sizeof(mig_models[0]); i++) {
        const char *a = mig_models[i].model, *b = name;
        while (*a && *a == *b) a++, b++;
        if (*a == *b) return &mig_models[i];
    }
    return 0;
}

static inline const mig_gi_profile *mig_profile_by_index(const mig_model *m, unsigned index)
{
    for (unsigned i = 0; m && i < m->nprofiles; i++)
        if (m->profiles[i].index == index) return &m->profiles[i];
    return 0;
}

static inline const mig_gi_profile *mig_profile_by_id(const mig_model *m, unsigned id)
{
    for (unsigned i = 0; m && i < m->nprofiles; i++)
        if (m->profiles[i].id == id) return &m->profiles[i];
    return 0;
}

/* Compute instance profiles of a GPU instance of `gi_slices`: NVML_COMPUTE_INSTANCE_PROFILE_<n>_SLICE
 * for n in 1, 2, 3, 4, 7 not above it, the profile id being the index. A compute instance of n slices
 * gets the GPU instance's multiprocessors pro rata (all of them when it spans the instance). */
static inline int mig_ci_slices(unsigned ci_index)
{
    switch (ci_index) {
    case 0: return 1; /* NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE */
    case 1: return 2;
    case 2: return 3;
    case 3: return 4;
    case 4: return 7;
    default: return 0;
    }
}

/* Multiprocessors of a compute instance of `slices` in a GPU instance of profile `gp`. */
static inline unsigned mig_ci_sms(const mig_gi_profile *gp, unsigned slices)
{
    return slices == gp->slices ? gp->sms : gp->sms * slices / gp->slices;
}

/* A compute instance profile's name: "MIG 3g.40gb" when it spans its GPU instance, else "MIG 1c.3g.40gb". */
static inline void mig_ci_name(const mig_gi_profile *gp, unsigned slices, char *out, size_t n)
{
    if (slices == gp->slices) snprintf(out, n, "MIG %s", gp->name);
    else snprintf(out, n, "MIG %uc.%s", slices, gp->name);
}

#endif
