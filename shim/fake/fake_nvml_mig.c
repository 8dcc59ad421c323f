/* The fake libnvidia-ml.so.1's MIG management: MIG mode, GPU and compute instances with the real
 * profiles and placements (mig_profiles.h), and MIG device handles, over the node's shared MIG state
 * (fake_mig.h), so what one process creates every other process sees, as on the driver. */
#define _GNU_SOURCE
#define NVML_NO_UNVERSIONED_FUNC_DEFS
#include <nvml.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <unistd.h>

#include "fake_common.h"
#include "fake_mig.h"
#include "fake_nvml.h"
#include "fake_nvml_mig.h"

#define GI_MAGIC 0x4d494731u
#define CI_MAGIC 0x4d494332u
#define MIGDEV_MAGIC 0x4d494433u

/* Handles are fixed addresses per (card, instance slot), stamped with the instance they were handed
 * out for: a handle to a destroyed instance stays invalid after a new one takes its slot. */
struct nvmlGpuInstance_st {
    unsigned magic;
    int card, gi;
    uint32_t id, generation;
};
struct nvmlComputeInstance_st {
    unsigned magic;
    int card, gi, ci;
    uint32_t gi_id, gi_generation, id, generation;
};
typedef struct {
    unsigned magic;
    int card, gi, ci;
    uint32_t gi_id, gi_generation, ci_id, ci_generation;
} mig_device;

static struct nvmlGpuInstance_st gi_handles[FAKE_MAX_GPUS][FAKE_MIG_MAX_GI];
static struct nvmlComputeInstance_st ci_handles[FAKE_MAX_GPUS][FAKE_MIG_MAX_GI][FAKE_MIG_MAX_CI];
static mig_device mig_devices[FAKE_MAX_GPUS][FAKE_MIG_MAX_GI][FAKE_MIG_MAX_CI];
static pthread_mutex_t handle_lock = PTHREAD_MUTEX_INITIALIZER;

static nvmlDevice_t card_handle(int card)
{
    return (nvmlDevice_t)(void *)&fake_system_get()->gpus[card];
}

static const mig_model *model_of_card(int card)
{
    return mig_model_of(fake_system_get()->gpus[card].name);
}

static nvmlGpuInstance_t gi_handle(int card, int gi, const fake_mig_gi *g)
{
    pthread_mutex_lock(&handle_lock);
    gi_handles[card][gi] = (struct nvmlGpuInstance_st){GI_MAGIC, card, gi, g->id, g->generation};
    pthread_mutex_unlock(&handle_lock);
    return &gi_handles[card][gi];
}

static nvmlComputeInstance_t ci_handle(int card, int gi, int ci, const fake_mig_gi *g)
{
    pthread_mutex_lock(&handle_lock);
    ci_handles[card][gi][ci] = (struct nvmlComputeInstance_st){CI_MAGIC, card, gi, ci, g->id, g->generation,
                                                               g->ci[ci].id, g->ci[ci].generation};
    pthread_mutex_unlock(&handle_lock);
    return &ci_handles[card][gi][ci];
}

static nvmlDevice_t mig_handle(int card, int gi, int ci, const fake_mig_gi *g)
{
    pthread_mutex_lock(&handle_lock);
    mig_devices[card][gi][ci] = (mig_device){MIGDEV_MAGIC, card, gi, ci, g->id, g->generation,
                                             g->ci[ci].id, g->ci[ci].generation};
    pthread_mutex_unlock(&handle_lock);
    return (nvmlDevice_t)(void *)&mig_devices[card][gi][ci];
}

/* The GPU instance behind a handle, still alive: 0 and a copy of its card's state, else the error. */
static nvmlReturn_t resolve_gi(nvmlGpuInstance_t h, fake_mig_card *card)
{
    if (!fake_nvml_initialized()) return NVML_ERROR_UNINITIALIZED;
    struct nvmlGpuInstance_st *base = &gi_handles[0][0];
    if (!h || h < base || h >= base + FAKE_MAX_GPUS * FAKE_MIG_MAX_GI || h->magic != GI_MAGIC)
        return NVML_ERROR_INVALID_ARGUMENT;
    fake_mig_snapshot(fake_system_get(), h->card, card);
    const fake_mig_gi *g = &card->gi[h->gi];
    if (!card->current || !g->live || g->id != h->id || g->generation != h->generation)
        return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_SUCCESS;
}

static nvmlReturn_t resolve_ci(nvmlComputeInstance_t h, fake_mig_card *card)
{
    if (!fake_nvml_initialized()) return NVML_ERROR_UNINITIALIZED;
    struct nvmlComputeInstance_st *base = &ci_handles[0][0][0];
    if (!h || h < base || h >= base + FAKE_MAX_GPUS * FAKE_MIG_MAX_GI * FAKE_MIG_MAX_CI || h->magic != CI_MAGIC)
        return NVML_ERROR_INVALID_ARGUMENT;
    fake_mig_snapshot(fake_system_get(), h->card, card);
    const fake_mig_gi *g = &card->gi[h->gi];
    const fake_mig_ci *c = &g->ci[h->ci];
    if (!card->current || !g->live || g->id != h->gi_id || g->generation != h->gi_generation || !c->live ||
        c->id != h->id || c->generation != h->generation)
        return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_SUCCESS;
}

int fake_nvml_is_mig_handle(nvmlDevice_t dev)
{
    mig_device *base = &mig_devices[0][0][0], *m = (mig_device *)(void *)dev;
    return m >= base && m < base + FAKE_MAX_GPUS * FAKE_MIG_MAX_GI * FAKE_MIG_MAX_CI && m->magic == MIGDEV_MAGIC;
}

/* The MIG device behind a handle, still alive: its card, GPU and compute instance. */
static nvmlReturn_t resolve_mig(nvmlDevice_t dev, fake_mig_card *card, const mig_device **out)
{
    if (!fake_nvml_initialized()) return NVML_ERROR_UNINITIALIZED;
    if (!fake_nvml_is_mig_handle(dev)) return NVML_ERROR_INVALID_ARGUMENT;
    const mig_device *m = (const mig_device *)(void *)dev;
    fake_mig_snapshot(fake_system_get(), m->card, card);
    const fake_mig_gi *g = &card->gi[m->gi];
    const fake_mig_ci *c = &g->ci[m->ci];
    if (!card->current || !g->live || g->id != m->gi_id || g->generation != m->gi_generation || !c->live ||
        c->id != m->ci_id || c->generation != m->ci_generation)
        return NVML_ERROR_INVALID_ARGUMENT; /* destroyed since */
    *out = m;
    return NVML_SUCCESS;
}

/* ---------------------------------------------------------------- MIG mode */

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t dev, unsigned int *current, unsigned int *pending)
{
    GET_CARD(dev, i);
    if (!current || !pending) return NVML_ERROR_INVALID_ARGUMENT;
    if (!model_of_card(i)) return NVML_ERROR_NOT_SUPPORTED; /* MIG exists on A100/A30/H100-class cards */
    fake_mig_card c;
    fake_mig_snapshot(fake_system_get(), i, &c);
    *current = c.current ? NVML_DEVICE_MIG_ENABLE : NVML_DEVICE_MIG_DISABLE;
    *pending = c.pending ? NVML_DEVICE_MIG_ENABLE : NVML_DEVICE_MIG_DISABLE;
    return NVML_SUCCESS;
}

/* Whether any process holds a context or memory on the card or one of its GPU instances. */
static int card_busy(int card, const fake_mig_card *c)
{
    fake_system *s = fake_system_get();
    fake_dev_state *d = s->state[card];
    for (int i = 0; i < FAKE_MAX_PROCS; i++) {
        const fake_proc *p = &d->procs[i];
        if (p->pid && fake_proc_alive(p) && (atomic_load(&p->used) || atomic_load(&p->contexts))) return 1;
    }
    for (int g = 0; g < FAKE_MIG_MAX_GI; g++)
        if (c->gi[g].live && fake_mig_gi_busy(s, s->state_index[card], &c->gi[g])) return 1;
    return 0;
}

static nvmlReturn_t write_error(void)
{
    return errno == EACCES || errno == EPERM || errno == EROFS ? NVML_ERROR_NO_PERMISSION : NVML_ERROR_UNKNOWN;
}

/* The mode becomes current at once when the card is idle (the driver resets it); while a process uses
 * the card it stays pending and activationStatus says NVML_ERROR_IN_USE: idle the card and set it again.
 * MIG is not turned off while GPU instances exist (destroy them first). */
FAKE_EXPORT nvmlReturn_t nvmlDeviceSetMigMode(nvmlDevice_t dev, unsigned int mode, nvmlReturn_t *activationStatus)
{
    GET_CARD(dev, i);
    if (!activationStatus || (mode != NVML_DEVICE_MIG_ENABLE && mode != NVML_DEVICE_MIG_DISABLE))
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!model_of_card(i)) return NVML_ERROR_NOT_SUPPORTED;
    fake_system *s = fake_system_get();
    fake_mig_state *m = fake_mig_write_begin(s);
    if (!m) return write_error();
    fake_mig_card *c = &m->cards[s->state_index[i]];
    int instances = 0;
    for (int g = 0; g < FAKE_MIG_MAX_GI; g++) instances |= c->gi[g].live != 0;
    c->pending = mode == NVML_DEVICE_MIG_ENABLE;
    if (c->current == c->pending) {
        *activationStatus = NVML_SUCCESS;
    } else if (card_busy(i, c) || (mode == NVML_DEVICE_MIG_DISABLE && instances)) {
        *activationStatus = NVML_ERROR_IN_USE;
    } else {
        c->current = c->pending;
        *activationStatus = NVML_SUCCESS;
    }
    fake_mig_write_end(m);
    return NVML_SUCCESS;
}

/* ---------------------------------------------------------------- GPU instance profiles */

/* The card's profile `index`, after NVML's checks; `need_mig`: only while MIG mode is on. */
static nvmlReturn_t gi_profile(nvmlDevice_t dev, unsigned index, int need_mig, const mig_gi_profile **out, int *card)
{
    GET_CARD(dev, i);
    const mig_model *m = model_of_card(i);
    if (!m) return NVML_ERROR_NOT_SUPPORTED;
    if (index >= NVML_GPU_INSTANCE_PROFILE_COUNT) return NVML_ERROR_INVALID_ARGUMENT;
    if (need_mig) {
        fake_mig_card c;
        fake_mig_snapshot(fake_system_get(), i, &c);
        if (!c.current) return NVML_ERROR_NOT_SUPPORTED;
    }
    const mig_gi_profile *p = mig_profile_by_index(m, index);
    if (!p) return NVML_ERROR_NOT_SUPPORTED;
    *out = p;
    *card = i;
    return NVML_SUCCESS;
}

#define FILL_GI_INFO(info, p)                                                                           \
    do {                                                                                                \
        (info)->id = (p)->id;                                                                           \
        (info)->sliceCount = (p)->slices;                                                               \
        (info)->instanceCount = (p)->instances;                                                         \
        (info)->multiprocessorCount = (p)->sms;                                                         \
        (info)->copyEngineCount = (p)->copy_engines;                                                    \
        (info)->decoderCount = (p)->decoders;                                                           \
        (info)->encoderCount = (p)->encoders;                                                           \
        (info)->jpegCount = (p)->jpegs;                                                                 \
        (info)->ofaCount = (p)->ofas;                                                                   \
        (info)->memorySizeMB = (p)->memory_mb;                                                          \
    } while (0)

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfo(nvmlDevice_t dev, unsigned int profile,
                                                             nvmlGpuInstanceProfileInfo_t *info)
{
    const mig_gi_profile *p;
    int card;
    nvmlReturn_t rc = gi_profile(dev, profile, 0, &p, &card);
    if (rc != NVML_SUCCESS) return rc;
    if (!info) return NVML_ERROR_INVALID_ARGUMENT;
    memset(info, 0, sizeof(*info));
    FILL_GI_INFO(info, p);
    info->isP2pSupported = 0; /* MIG instances have no peer-to-peer */
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoV(nvmlDevice_t dev, unsigned int profile,
                                                              nvmlGpuInstanceProfileInfo_v2_t *info)
{
    const mig_gi_profile *p;
    int card;
    nvmlReturn_t rc = gi_profile(dev, profile, 1, &p, &card);
    if (rc != NVML_SUCCESS) return rc;
    if (!info) return NVML_ERROR_INVALID_ARGUMENT;
    if (info->version == nvmlGpuInstanceProfileInfo_v3) {
        nvmlGpuInstanceProfileInfo_v3_t *v3 = (nvmlGpuInstanceProfileInfo_v3_t *)(void *)info;
        memset(v3, 0, sizeof(*v3));
        v3->version = nvmlGpuInstanceProfileInfo_v3;
        FILL_GI_INFO(v3, p);
        snprintf(v3->name, sizeof(v3->name), "MIG %s", p->name);
        return NVML_SUCCESS;
    }
    if (info->version != nvmlGpuInstanceProfileInfo_v2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    memset(info, 0, sizeof(*info));
    info->version = nvmlGpuInstanceProfileInfo_v2;
    FILL_GI_INFO(info, p);
    snprintf(info->name, sizeof(info->name), "MIG %s", p->name);
    return NVML_SUCCESS;
}

/* The card's profile with the driver's profile id (what placements and creation take). */
static nvmlReturn_t gi_profile_by_id(nvmlDevice_t dev, unsigned id, int need_mig, const mig_gi_profile **out,
                                     int *card, fake_mig_card *state)
{
    GET_CARD(dev, i);
    const mig_model *m = model_of_card(i);
    if (!m) return NVML_ERROR_NOT_SUPPORTED;
    fake_mig_snapshot(fake_system_get(), i, state);
    if (need_mig && !state->current) return NVML_ERROR_NOT_SUPPORTED;
    const mig_gi_profile *p = mig_profile_by_id(m, id);
    if (!p) return NVML_ERROR_INVALID_ARGUMENT;
    *out = p;
    *card = i;
    return NVML_SUCCESS;
}

static nvmlReturn_t placements(nvmlDevice_t dev, unsigned int profileId, nvmlGpuInstancePlacement_t *out,
                               unsigned int *count)
{
    const mig_gi_profile *p;
    int card;
    fake_mig_card st;
    nvmlReturn_t rc = gi_profile_by_id(dev, profileId, 0, &p, &card, &st);
    if (rc != NVML_SUCCESS) return rc;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    if (!out) {
        *count = p->nstarts;
        return NVML_SUCCESS;
    }
    if (*count < p->nstarts) {
        *count = p->nstarts;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned k = 0; k < p->nstarts; k++) out[k] = (nvmlGpuInstancePlacement_t){p->starts[k], p->size};
    *count = p->nstarts;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstancePossiblePlacements_v2(nvmlDevice_t dev, unsigned int profileId,
                                                                       nvmlGpuInstancePlacement_t *out,
                                                                       unsigned int *count)
{
    return placements(dev, profileId, out, count);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstancePossiblePlacements(nvmlDevice_t dev, unsigned int profileId,
                                                                    nvmlGpuInstancePlacement_t *out,
                                                                    unsigned int *count)
{
    return placements(dev, profileId, out, count);
}

/* ---------------------------------------------------------------- creating and finding GPU instances */

/* Whether `p` fits at memory slice `start` next to the card's instances: its memory slices free, its
 * compute slices left, fewer than instanceCount of it. */
static int fits(const mig_model *m, const fake_mig_card *c, const mig_gi_profile *p, unsigned start)
{
    unsigned compute = 0, same = 0;
    for (int g = 0; g < FAKE_MIG_MAX_GI; g++) {
        const fake_mig_gi *x = &c->gi[g];
        if (!x->live) continue;
        if (start < x->start + x->size && x->start < start + p->size) return 0;
        const mig_gi_profile *xp = mig_profile_by_index(m, x->profile);
        compute += xp ? xp->slices : 0;
        if (x->profile == p->index) same++;
    }
    return compute + p->slices <= MIG_COMPUTE_SLICES && same < p->instances && start + p->size <= MIG_MEMORY_SLICES;
}

/* Where the driver puts an instance it is not told where to put: the free placement with the highest
 * start, so the low slices stay free for the larger profiles. -1 if none is free. */
static int choose_start(const mig_model *m, const fake_mig_card *c, const mig_gi_profile *p)
{
    for (int k = (int)p->nstarts - 1; k >= 0; k--)
        if (fits(m, c, p, p->starts[k])) return (int)p->starts[k];
    return -1;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceRemainingCapacity(nvmlDevice_t dev, unsigned int profileId,
                                                                  unsigned int *count)
{
    const mig_gi_profile *p;
    int card;
    fake_mig_card st;
    nvmlReturn_t rc = gi_profile_by_id(dev, profileId, 1, &p, &card, &st);
    if (rc != NVML_SUCCESS) return rc;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    const mig_model *m = model_of_card(card);
    unsigned n = 0;
    for (int g = 0; g < FAKE_MIG_MAX_GI; g++) { /* place more of it, as creating them one by one would */
        int start = choose_start(m, &st, p);
        int slot = -1;
        for (int k = 0; k < FAKE_MIG_MAX_GI && slot < 0; k++)
            if (!st.gi[k].live) slot = k;
        if (start < 0 || slot < 0) break;
        st.gi[slot] = (fake_mig_gi){.live = 1, .profile = p->index, .start = (unsigned)start, .size = p->size};
        n++;
    }
    *count = n;
    return NVML_SUCCESS;
}

static nvmlReturn_t create_gi(nvmlDevice_t dev, unsigned profileId, const nvmlGpuInstancePlacement_t *placement,
                              nvmlGpuInstance_t *out)
{
    const mig_gi_profile *p;
    int card;
    fake_mig_card st;
    nvmlReturn_t rc = gi_profile_by_id(dev, profileId, 1, &p, &card, &st);
    if (rc != NVML_SUCCESS) return rc;
    if (!out) return NVML_ERROR_INVALID_ARGUMENT;
    if (placement) {
        int listed = 0;
        for (unsigned k = 0; k < p->nstarts; k++) listed |= p->starts[k] == placement->start;
        if (placement->size != p->size || !listed) return NVML_ERROR_INVALID_ARGUMENT;
    }
    fake_system *s = fake_system_get();
    const mig_model *m = model_of_card(card);
    fake_mig_state *w = fake_mig_write_begin(s);
    if (!w) return write_error();
    int slot = s->state_index[card];
    fake_mig_card *c = &w->cards[slot];
    rc = NVML_ERROR_INSUFFICIENT_RESOURCES;
    int start = placement ? (fits(m, c, p, placement->start) ? (int)placement->start : -1) : choose_start(m, c, p);
    int gi = -1;
    for (int k = 0; k < FAKE_MIG_MAX_GI && gi < 0; k++)
        if (!c->gi[k].live) gi = k;
    if (!c->current) rc = NVML_ERROR_NOT_SUPPORTED;
    else if (start >= 0 && gi >= 0) {
        unsigned id = 1; /* the lowest id not in use */
        for (int again = 1; again;) {
            again = 0;
            for (int k = 0; k < FAKE_MIG_MAX_GI; k++)
                if (c->gi[k].live && c->gi[k].id == id) id++, again = 1;
        }
        fake_mig_gi made = {.live = 1, .id = id, .profile = p->index, .start = (unsigned)start, .size = p->size,
                            .generation = c->generation + 1};
        /* its memory: a state file of its own (with a daemon, the daemon makes it at the first request) */
        if (!s->daemon_mode && fake_mig_gi_file_create(s, slot, &made) != 0) {
            rc = NVML_ERROR_UNKNOWN;
        } else {
            c->generation++;
            c->gi[gi] = made;
            *out = gi_handle(card, gi, &c->gi[gi]);
            rc = NVML_SUCCESS;
        }
    }
    fake_mig_write_end(w);
    return rc;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceCreateGpuInstance(nvmlDevice_t dev, unsigned int profileId,
                                                     nvmlGpuInstance_t *gpuInstance)
{
    return create_gi(dev, profileId, NULL, gpuInstance);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceCreateGpuInstanceWithPlacement(nvmlDevice_t dev, unsigned int profileId,
                                                                  const nvmlGpuInstancePlacement_t *placement,
                                                                  nvmlGpuInstance_t *gpuInstance)
{
    if (!placement) {
        CHECK_CARD(dev);
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    return create_gi(dev, profileId, placement, gpuInstance);
}

/* A GPU instance goes only without compute instances and processes on it (NVML_ERROR_IN_USE). */
FAKE_EXPORT nvmlReturn_t nvmlGpuInstanceDestroy(nvmlGpuInstance_t h)
{
    fake_mig_card st;
    nvmlReturn_t rc = resolve_gi(h, &st);
    if (rc != NVML_SUCCESS) return rc;
    fake_system *s = fake_system_get();
    fake_mig_state *w = fake_mig_write_begin(s);
    if (!w) return write_error();
    int slot = s->state_index[h->card];
    fake_mig_gi *g = &w->cards[slot].gi[h->gi];
    int cis = 0;
    for (int k = 0; k < FAKE_MIG_MAX_CI; k++) cis |= g->ci[k].live != 0;
    if (!g->live || g->id != h->id || g->generation != h->generation) {
        rc = NVML_ERROR_INVALID_ARGUMENT; /* destroyed meanwhile */
    } else if (cis || fake_mig_gi_busy(s, slot, g)) {
        rc = NVML_ERROR_IN_USE;
    } else {
        char path[4608];
        fake_mig_gi_path(s, slot, g, path, sizeof(path));
        unlink(path);
        memset(g, 0, sizeof(*g));
    }
    fake_mig_write_end(w);
    return rc;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstances(nvmlDevice_t dev, unsigned int profileId,
                                                   nvmlGpuInstance_t *gpuInstances, unsigned int *count)
{
    const mig_gi_profile *p;
    int card;
    fake_mig_card st;
    nvmlReturn_t rc = gi_profile_by_id(dev, profileId, 1, &p, &card, &st);
    if (rc != NVML_SUCCESS) return rc;
    if (!gpuInstances || !count) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned n = 0;
    for (int g = 0; g < FAKE_MIG_MAX_GI; g++)
        if (st.gi[g].live && st.gi[g].profile == p->index) gpuInstances[n++] = gi_handle(card, g, &st.gi[g]);
    *count = n;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceById(nvmlDevice_t dev, unsigned int id,
                                                      nvmlGpuInstance_t *gpuInstance)
{
    GET_CARD(dev, i);
    if (!model_of_card(i)) return NVML_ERROR_NOT_SUPPORTED;
    if (!gpuInstance) return NVML_ERROR_INVALID_ARGUMENT;
    fake_mig_card st;
    fake_mig_snapshot(fake_system_get(), i, &st);
    if (!st.current) return NVML_ERROR_NOT_SUPPORTED;
    for (int g = 0; g < FAKE_MIG_MAX_GI; g++)
        if (st.gi[g].live && st.gi[g].id == id) {
            *gpuInstance = gi_handle(i, g, &st.gi[g]);
            return NVML_SUCCESS;
        }
    return NVML_ERROR_NOT_FOUND;
}

FAKE_EXPORT nvmlReturn_t nvmlGpuInstanceGetInfo(nvmlGpuInstance_t h, nvmlGpuInstanceInfo_t *info)
{
    fake_mig_card st;
    nvmlReturn_t rc = resolve_gi(h, &st);
    if (rc != NVML_SUCCESS) return rc;
    if (!info) return NVML_ERROR_INVALID_ARGUMENT;
    const fake_mig_gi *g = &st.gi[h->gi];
    const mig_gi_profile *p = mig_profile_by_index(model_of_card(h->card), g->profile);
    *info = (nvmlGpuInstanceInfo_t){card_handle(h->card), g->id, p ? p->id : 0, {g->start, g->size}};
    return NVML_SUCCESS;
}

/* ---------------------------------------------------------------- compute instances */

static const mig_gi_profile *profile_of_gi(int card, const fake_mig_gi *g)
{
    return mig_profile_by_index(model_of_card(card), g->profile);
}

/* Compute instance profile `ci` of a GPU instance of profile `gp`: 0 when it has none. */
static int ci_profile(const mig_gi_profile *gp, unsigned ci, unsigned *slices, unsigned *count, unsigned *sms)
{
    int n = mig_ci_slices(ci);
    if (n <= 0 || (unsigned)n > gp->slices) return 0;
    *slices = (unsigned)n;
    *count = gp->slices / (unsigned)n;
    *sms = mig_ci_sms(gp, (unsigned)n);
    return 1;
}


#define FILL_CI_INFO(info, id_, slices, count, sms, gp)                                                 \
    do {                                                                                                \
        (info)->id = (id_);                                                                             \
        (info)->sliceCount = (slices);                                                                  \
        (info)->instanceCount = (count);                                                                \
        (info)->multiprocessorCount = (sms);                                                            \
        (info)->sharedCopyEngineCount = (gp)->copy_engines;                                             \
        (info)->sharedDecoderCount = (gp)->decoders;                                                    \
        (info)->sharedEncoderCount = (gp)->encoders;                                                    \
        (info)->sharedJpegCount = (gp)->jpegs;                                                          \
        (info)->sharedOfaCount = (gp)->ofas;                                                            \
    } while (0)

static nvmlReturn_t ci_profile_of(nvmlGpuInstance_t h, unsigned profile, unsigned eng, const mig_gi_profile **gp,
                                  unsigned *slices, unsigned *count, unsigned *sms, fake_mig_card *st)
{
    nvmlReturn_t rc = resolve_gi(h, st);
    if (rc != NVML_SUCCESS) return rc;
    if (profile >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT || eng >= NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_COUNT)
        return NVML_ERROR_INVALID_ARGUMENT;
    *gp = profile_of_gi(h->card, &st->gi[h->gi]);
    if (!*gp || !ci_profile(*gp, profile, slices, count, sms)) return NVML_ERROR_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfo(nvmlGpuInstance_t h, unsigned int profile,
                                                                      unsigned int engProfile,
                                                                      nvmlComputeInstanceProfileInfo_t *info)
{
    const mig_gi_profile *gp;
    unsigned slices, count, sms;
    fake_mig_card st;
    nvmlReturn_t rc = ci_profile_of(h, profile, engProfile, &gp, &slices, &count, &sms, &st);
    if (rc != NVML_SUCCESS) return rc;
    if (!info) return NVML_ERROR_INVALID_ARGUMENT;
    memset(info, 0, sizeof(*info));
    FILL_CI_INFO(info, profile, slices, count, sms, gp);
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfoV(nvmlGpuInstance_t h, unsigned int profile,
                                                                       unsigned int engProfile,
                                                                       nvmlComputeInstanceProfileInfo_v2_t *info)
{
    const mig_gi_profile *gp;
    unsigned slices, count, sms;
    fake_mig_card st;
    nvmlReturn_t rc = ci_profile_of(h, profile, engProfile, &gp, &slices, &count, &sms, &st);
    if (rc != NVML_SUCCESS) return rc;
    if (!info) return NVML_ERROR_INVALID_ARGUMENT;
    if (info->version == nvmlComputeInstanceProfileInfo_v3) {
        nvmlComputeInstanceProfileInfo_v3_t *v3 = (nvmlComputeInstanceProfileInfo_v3_t *)(void *)info;
        memset(v3, 0, sizeof(*v3));
        v3->version = nvmlComputeInstanceProfileInfo_v3;
        FILL_CI_INFO(v3, profile, slices, count, sms, gp);
        mig_ci_name(gp, slices, v3->name, sizeof(v3->name));
        return NVML_SUCCESS;
    }
    if (info->version != nvmlComputeInstanceProfileInfo_v2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    memset(info, 0, sizeof(*info));
    info->version = nvmlComputeInstanceProfileInfo_v2;
    FILL_CI_INFO(info, profile, slices, count, sms, gp);
    mig_ci_name(gp, slices, info->name, sizeof(info->name));
    return NVML_SUCCESS;
}

/* Whether a compute instance of `slices` fits at `start` of the GPU instance. */
static int ci_fits(const fake_mig_gi *g, const mig_gi_profile *gp, unsigned profile, unsigned slices, unsigned start,
                   unsigned count)
{
    if (start % slices || start + slices > gp->slices) return 0;
    unsigned same = 0;
    for (int k = 0; k < FAKE_MIG_MAX_CI; k++) {
        const fake_mig_ci *c = &g->ci[k];
        if (!c->live) continue;
        if (start < c->start + c->size && c->start < start + slices) return 0;
        same += c->profile == profile;
    }
    return same < count;
}

FAKE_EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstancePossiblePlacements(nvmlGpuInstance_t h, unsigned int profileId,
                                                                            nvmlComputeInstancePlacement_t *out,
                                                                            unsigned int *count)
{
    const mig_gi_profile *gp;
    unsigned slices, n, sms;
    fake_mig_card st;
    nvmlReturn_t rc = ci_profile_of(h, profileId, 0, &gp, &slices, &n, &sms, &st);
    if (rc != NVML_SUCCESS) return rc;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned total = gp->slices / slices;
    if (!out) {
        *count = total;
        return NVML_SUCCESS;
    }
    if (*count < total) {
        *count = total;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned k = 0; k < total; k++) out[k] = (nvmlComputeInstancePlacement_t){k * slices, slices};
    *count = total;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceRemainingCapacity(nvmlGpuInstance_t h,
                                                                           unsigned int profileId,
                                                                           unsigned int *count)
{
    const mig_gi_profile *gp;
    unsigned slices, n, sms;
    fake_mig_card st;
    nvmlReturn_t rc = ci_profile_of(h, profileId, 0, &gp, &slices, &n, &sms, &st);
    if (rc != NVML_SUCCESS) return rc;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    fake_mig_gi g = st.gi[h->gi];
    unsigned left = 0;
    for (unsigned start = 0; start + slices <= gp->slices; start += slices) {
        int free_ci = -1;
        for (int k = 0; k < FAKE_MIG_MAX_CI && free_ci < 0; k++)
            if (!g.ci[k].live) free_ci = k;
        if (free_ci < 0 || !ci_fits(&g, gp, profileId, slices, start, n)) continue;
        g.ci[free_ci] = (fake_mig_ci){.live = 1, .profile = profileId, .start = start, .size = slices};
        left++;
    }
    *count = left;
    return NVML_SUCCESS;
}

static nvmlReturn_t create_ci(nvmlGpuInstance_t h, unsigned profileId, const nvmlComputeInstancePlacement_t *pl,
                              nvmlComputeInstance_t *out)
{
    const mig_gi_profile *gp;
    unsigned slices, n, sms;
    fake_mig_card st;
    nvmlReturn_t rc = ci_profile_of(h, profileId, 0, &gp, &slices, &n, &sms, &st);
    if (rc != NVML_SUCCESS) return rc;
    if (!out) return NVML_ERROR_INVALID_ARGUMENT;
    if (pl && (pl->size != slices || pl->start % slices || pl->start + slices > gp->slices))
        return NVML_ERROR_INVALID_ARGUMENT;
    fake_system *s = fake_system_get();
    fake_mig_state *w = fake_mig_write_begin(s);
    if (!w) return write_error();
    fake_mig_card *card = &w->cards[s->state_index[h->card]];
    fake_mig_gi *g = &card->gi[h->gi];
    rc = NVML_ERROR_INSUFFICIENT_RESOURCES;
    if (!g->live || g->id != h->id || g->generation != h->generation) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else {
        int start = -1;
        if (pl) start = ci_fits(g, gp, profileId, slices, pl->start, n) ? (int)pl->start : -1;
        for (unsigned k = 0; !pl && start < 0 && k * slices + slices <= gp->slices; k++)
            if (ci_fits(g, gp, profileId, slices, k * slices, n)) start = (int)(k * slices);
        int ci = -1;
        for (int k = 0; k < FAKE_MIG_MAX_CI && ci < 0; k++)
            if (!g->ci[k].live) ci = k;
        if (start >= 0 && ci >= 0) {
            unsigned id = 0; /* the lowest id not in use in the GPU instance */
            for (int again = 1; again;) {
                again = 0;
                for (int k = 0; k < FAKE_MIG_MAX_CI; k++)
                    if (g->ci[k].live && g->ci[k].id == id) id++, again = 1;
            }
            fake_mig_ci *c = &g->ci[ci];
            *c = (fake_mig_ci){.live = 1, .id = id, .profile = profileId, .start = (unsigned)start, .size = slices,
                               .generation = ++card->generation};
            fake_mig_make_uuid(card->uuid, g->id, id, c->generation, c->uuid, sizeof(c->uuid), c->uuid_bytes);
            *out = ci_handle(h->card, h->gi, ci, g);
            rc = NVML_SUCCESS;
        }
    }
    fake_mig_write_end(w);
    return rc;
}

FAKE_EXPORT nvmlReturn_t nvmlGpuInstanceCreateComputeInstance(nvmlGpuInstance_t h, unsigned int profileId,
                                                              nvmlComputeInstance_t *computeInstance)
{
    return create_ci(h, profileId, NULL, computeInstance);
}

FAKE_EXPORT nvmlReturn_t nvmlGpuInstanceCreateComputeInstanceWithPlacement(
    nvmlGpuInstance_t h, unsigned int profileId, const nvmlComputeInstancePlacement_t *placement,
    nvmlComputeInstance_t *computeInstance)
{
    if (!placement) return NVML_ERROR_INVALID_ARGUMENT;
    return create_ci(h, profileId, placement, computeInstance);
}

/* A compute instance goes only while no process uses its GPU instance (NVML_ERROR_IN_USE). */
FAKE_EXPORT nvmlReturn_t nvmlComputeInstanceDestroy(nvmlComputeInstance_t h)
{
    fake_mig_card st;
    nvmlReturn_t rc = resolve_ci(h, &st);
    if (rc != NVML_SUCCESS) return rc;
    fake_system *s = fake_system_get();
    fake_mig_state *w = fake_mig_write_begin(s);
    if (!w) return write_error();
    int slot = s->state_index[h->card];
    fake_mig_gi *g = &w->cards[slot].gi[h->gi];
    fake_mig_ci *c = &g->ci[h->ci];
    if (!g->live || g->generation != h->gi_generation || !c->live || c->generation != h->generation)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    else if (fake_mig_gi_busy(s, slot, g))
        rc = NVML_ERROR_IN_USE;
    else
        memset(c, 0, sizeof(*c));
    fake_mig_write_end(w);
    return rc;
}

FAKE_EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstances(nvmlGpuInstance_t h, unsigned int profileId,
                                                            nvmlComputeInstance_t *computeInstances,
                                                            unsigned int *count)
{
    fake_mig_card st;
    nvmlReturn_t rc = resolve_gi(h, &st);
    if (rc != NVML_SUCCESS) return rc;
    if (!computeInstances || !count || profileId >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT)
        return NVML_ERROR_INVALID_ARGUMENT;
    const fake_mig_gi *g = &st.gi[h->gi];
    unsigned n = 0;
    for (int k = 0; k < FAKE_MIG_MAX_CI; k++)
        if (g->ci[k].live && g->ci[k].profile == profileId) computeInstances[n++] = ci_handle(h->card, h->gi, k, g);
    *count = n;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceById(nvmlGpuInstance_t h, unsigned int id,
                                                               nvmlComputeInstance_t *computeInstance)
{
    fake_mig_card st;
    nvmlReturn_t rc = resolve_gi(h, &st);
    if (rc != NVML_SUCCESS) return rc;
    if (!computeInstance) return NVML_ERROR_INVALID_ARGUMENT;
    const fake_mig_gi *g = &st.gi[h->gi];
    for (int k = 0; k < FAKE_MIG_MAX_CI; k++)
        if (g->ci[k].live && g->ci[k].id == id) {
            *computeInstance = ci_handle(h->card, h->gi, k, g);
            return NVML_SUCCESS;
        }
    return NVML_ERROR_NOT_FOUND;
}

FAKE_EXPORT nvmlReturn_t nvmlComputeInstanceGetInfo_v2(nvmlComputeInstance_t h, nvmlComputeInstanceInfo_t *info)
{
    fake_mig_card st;
    nvmlReturn_t rc = resolve_ci(h, &st);
    if (rc != NVML_SUCCESS) return rc;
    if (!info) return NVML_ERROR_INVALID_ARGUMENT;
    const fake_mig_gi *g = &st.gi[h->gi];
    const fake_mig_ci *c = &g->ci[h->ci];
    *info = (nvmlComputeInstanceInfo_t){card_handle(h->card), gi_handle(h->card, h->gi, g), c->id, c->profile,
                                        {c->start, c->size}};
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlComputeInstanceGetInfo(nvmlComputeInstance_t h, nvmlComputeInstanceInfo_t *info)
{
    return nvmlComputeInstanceGetInfo_v2(h, info);
}

/* ---------------------------------------------------------------- MIG devices */

FAKE_EXPORT nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t dev, unsigned int *isMigDevice)
{
    if (!fake_nvml_initialized()) return NVML_ERROR_UNINITIALIZED;
    if (!isMigDevice) return NVML_ERROR_INVALID_ARGUMENT;
    if (fake_nvml_is_mig_handle(dev)) {
        fake_mig_card st;
        const mig_device *m;
        nvmlReturn_t rc = resolve_mig(dev, &st, &m);
        if (rc != NVML_SUCCESS) return rc;
        *isMigDevice = 1;
        return NVML_SUCCESS;
    }
    CHECK_CARD(dev);
    *isMigDevice = 0;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t dev, unsigned int *count)
{
    GET_CARD(dev, i);
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = model_of_card(i) ? MIG_COMPUTE_SLICES : 0;
    return NVML_SUCCESS;
}

/* The card's MIG devices (compute instances) in the driver's order: by GPU instance id, then compute
 * instance id. */
static int nth_mig_device(const fake_mig_card *st, unsigned index, int *gi_out, int *ci_out)
{
    unsigned seen = 0;
    for (unsigned gid = 0; gid < 64; gid++)
        for (int g = 0; g < FAKE_MIG_MAX_GI; g++) {
            if (!st->gi[g].live || st->gi[g].id != gid) continue;
            for (unsigned cid = 0; cid < 64; cid++)
                for (int c = 0; c < FAKE_MIG_MAX_CI; c++) {
                    if (!st->gi[g].ci[c].live || st->gi[g].ci[c].id != cid) continue;
                    if (seen++ == index) {
                        *gi_out = g;
                        *ci_out = c;
                        return 1;
                    }
                }
        }
    return 0;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t dev, unsigned int index,
                                                             nvmlDevice_t *migDevice)
{
    GET_CARD(dev, i);
    if (!migDevice) return NVML_ERROR_INVALID_ARGUMENT;
    if (!model_of_card(i)) return NVML_ERROR_NOT_SUPPORTED;
    fake_mig_card st;
    fake_mig_snapshot(fake_system_get(), i, &st);
    if (!st.current) return NVML_ERROR_INVALID_ARGUMENT; /* not a MIG-enabled GPU */
    if (index >= MIG_COMPUTE_SLICES) return NVML_ERROR_INVALID_ARGUMENT;
    int g, c;
    if (!nth_mig_device(&st, index, &g, &c)) return NVML_ERROR_NOT_FOUND;
    *migDevice = mig_handle(i, g, c, &st.gi[g]);
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice, nvmlDevice_t *device)
{
    fake_mig_card st;
    const mig_device *m;
    nvmlReturn_t rc = resolve_mig(migDevice, &st, &m);
    if (rc != NVML_SUCCESS) return rc;
    if (!device) return NVML_ERROR_INVALID_ARGUMENT;
    *device = card_handle(m->card);
    return NVML_SUCCESS;
}

static nvmlReturn_t mig_ids(nvmlDevice_t dev, unsigned int *id, int compute)
{
    if (!fake_nvml_initialized()) return NVML_ERROR_UNINITIALIZED;
    if (!fake_nvml_is_mig_handle(dev)) {
        CHECK_CARD(dev);
        return id ? NVML_ERROR_NOT_SUPPORTED : NVML_ERROR_INVALID_ARGUMENT; /* a whole card has no such id */
    }
    fake_mig_card st;
    const mig_device *m;
    nvmlReturn_t rc = resolve_mig(dev, &st, &m);
    if (rc != NVML_SUCCESS) return rc;
    if (!id) return NVML_ERROR_INVALID_ARGUMENT;
    *id = compute ? st.gi[m->gi].ci[m->ci].id : st.gi[m->gi].id;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t dev, unsigned int *id)
{
    return mig_ids(dev, id, 0);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t dev, unsigned int *id)
{
    return mig_ids(dev, id, 1);
}

/* ---------------------------------------------------------------- what fake_nvml.c asks of MIG devices */

nvmlReturn_t fake_nvml_mig_by_uuid(const char *uuid, nvmlDevice_t *device)
{
    fake_system *s = fake_system_get();
    for (int i = 0; i < s->count; i++) {
        fake_mig_card st;
        fake_mig_snapshot(s, i, &st);
        if (!st.current) continue;
        for (int g = 0; g < FAKE_MIG_MAX_GI; g++)
            for (int c = 0; st.gi[g].live && c < FAKE_MIG_MAX_CI; c++)
                if (st.gi[g].ci[c].live && strcasecmp(st.gi[g].ci[c].uuid, uuid) == 0) {
                    *device = mig_handle(i, g, c, &st.gi[g]);
                    return NVML_SUCCESS;
                }
    }
    return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t fake_nvml_mig_describe(nvmlDevice_t dev, fake_nvml_mig_info *out)
{
    fake_mig_card st;
    const mig_device *m;
    nvmlReturn_t rc = resolve_mig(dev, &st, &m);
    if (rc != NVML_SUCCESS) return rc;
    fake_system *s = fake_system_get();
    const fake_mig_gi *g = &st.gi[m->gi];
    const fake_mig_ci *c = &g->ci[m->ci];
    const mig_gi_profile *gp = profile_of_gi(m->card, g);
    if (!gp) return NVML_ERROR_UNKNOWN;
    char ci[64];
    mig_ci_name(gp, c->size, ci, sizeof(ci));
    memset(out, 0, sizeof(*out));
    out->card = m->card;
    snprintf(out->name, sizeof(out->name), "%s %s", s->gpus[m->card].name, ci);
    snprintf(out->uuid, sizeof(out->uuid), "%s", c->uuid);
    out->memory_bytes = gp->memory_mb << 20;
    out->used_bytes = fake_mig_gi_used(s, s->state_index[m->card], g);
    out->memory_slices = g->size;
    return NVML_SUCCESS;
}

uint64_t fake_nvml_mig_card_used(int card)
{
    fake_system *s = fake_system_get();
    fake_mig_card st;
    fake_mig_snapshot(s, card, &st);
    uint64_t used = 0;
    for (int g = 0; g < FAKE_MIG_MAX_GI; g++)
        if (st.gi[g].live) used += fake_mig_gi_used(s, s->state_index[card], &st.gi[g]);
    return used;
}

/* Read-only views of the GPU instances' memory states, kept per (card, instance slot) while the instance
 * lives. In a process holding no lock across calls, an instance destroyed meanwhile shows its last state. */
static struct {
    fake_dev_state *d;
    uint32_t id, generation;
} views[FAKE_MAX_GPUS][FAKE_MIG_MAX_GI];
static pthread_mutex_t views_lock = PTHREAD_MUTEX_INITIALIZER;

static fake_dev_state *view_of(int card, int gi, const fake_mig_gi *g)
{
    fake_system *s = fake_system_get();
    pthread_mutex_lock(&views_lock);
    if (views[card][gi].d && (views[card][gi].id != g->id || views[card][gi].generation != g->generation)) {
        munmap(views[card][gi].d, sizeof(fake_dev_state));
        views[card][gi].d = NULL;
    }
    if (!views[card][gi].d) {
        char path[4608];
        fake_mig_gi_path(s, s->state_index[card], g, path, sizeof(path));
        views[card][gi].d = fake_map_state_file(path, FAKE_MAP_CLIENT);
        views[card][gi].id = g->id;
        views[card][gi].generation = g->generation;
    }
    fake_dev_state *d = views[card][gi].d;
    pthread_mutex_unlock(&views_lock);
    return d;
}

/* The id NVML reports with a process of a GPU instance: its (first) compute instance's. */
static unsigned first_ci(const fake_mig_gi *g)
{
    unsigned best = 0xFFFFFFFFu;
    for (int c = 0; c < FAKE_MIG_MAX_CI; c++)
        if (g->ci[c].live && g->ci[c].id < best) best = g->ci[c].id;
    return best;
}

int fake_nvml_mig_proc_lists(nvmlDevice_t dev, int card, fake_nvml_mig_procs *out, int cap, int *card_out,
                             nvmlReturn_t *rc)
{
    fake_mig_card st;
    int n = 0;
    if (card < 0) {
        const mig_device *m;
        *rc = resolve_mig(dev, &st, &m);
        if (*rc != NVML_SUCCESS) return -1;
        *card_out = m->card;
        fake_dev_state *d = view_of(m->card, m->gi, &st.gi[m->gi]);
        if (d && cap > 0) out[n++] = (fake_nvml_mig_procs){d, st.gi[m->gi].id, st.gi[m->gi].ci[m->ci].id};
        return n;
    }
    *card_out = card;
    if (!model_of_card(card)) return 0;
    fake_mig_snapshot(fake_system_get(), card, &st);
    for (int g = 0; st.current && g < FAKE_MIG_MAX_GI && n < cap; g++) {
        if (!st.gi[g].live) continue;
        fake_dev_state *d = view_of(card, g, &st.gi[g]);
        if (d) out[n++] = (fake_nvml_mig_procs){d, st.gi[g].id, first_ci(&st.gi[g])};
    }
    return n;
}
