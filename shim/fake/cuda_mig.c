/*
 * Which devices the fake libcuda.so.1 shows a process, as the driver decides at cuInit: the cards it
 * can reach, a card in MIG mode replaced by its MIG devices (compute instances), narrowed by
 * CUDA_VISIBLE_DEVICES (indices, "GPU-<uuid>" prefixes, "MIG-<uuid>" and the older
 * "MIG-GPU-<uuid>/<gi>/<ci>"; the list ends at the first entry that names nothing), and at most one MIG
 * device per process (CUDA enumerates a single MIG device). In a container, a MIG device is there only
 * when the container holds its two capability devices (see mig_reachable).
 *
 * A MIG device is a device of its own to CUDA: its name is the card's with the profile
 * ("NVIDIA A100-SXM4-80GB MIG 1g.10gb"), its UUID the MIG UUID, its memory (cuDeviceTotalMem) the GPU
 * instance's and its multiprocessors the compute instance's. Its allocations are charged to the GPU
 * instance's own memory state (fake_mig.h), so an allocation past the instance fails with
 * CUDA_ERROR_OUT_OF_MEMORY in the driver itself.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include "fake_cuda.h"
#include "fake_mig.h"

typedef struct {
    int card;   /* visible index of the card in the loaded description */
    int gi, ci; /* -1: the whole card */
} candidate;

/* The card's MIG devices in the driver's order (GPU instance id, then compute instance id). */
static int mig_devices_of(const fake_mig_card *st, int card, candidate *out, int cap)
{
    int n = 0;
    for (unsigned gid = 0; gid < 64; gid++)
        for (int g = 0; g < FAKE_MIG_MAX_GI; g++) {
            if (!st->gi[g].live || st->gi[g].id != gid) continue;
            for (unsigned cid = 0; cid < 64; cid++)
                for (int c = 0; c < FAKE_MIG_MAX_CI; c++)
                    if (st->gi[g].ci[c].live && st->gi[g].ci[c].id == cid && n < cap)
                        out[n++] = (candidate){card, g, c};
        }
    return n;
}

/* What a card contributes: itself, or in MIG mode its MIG devices (none while it has none). */
static int card_devices(fake_system *s, const fake_mig_card *st, int card, candidate *out, int cap)
{
    (void)s;
    if (st[card].current) return mig_devices_of(&st[card], card, out, cap);
    if (cap < 1) return 0;
    out[0] = (candidate){card, -1, -1};
    return 1;
}

static int all_digits(const char *t)
{
    if (!*t) return 0;
    for (; *t; t++)
        if (!isdigit((unsigned char)*t)) return 0;
    return 1;
}

/* The devices one CUDA_VISIBLE_DEVICES entry names; -1 when it names none (the list ends there). */
static int entry_devices(fake_system *s, const fake_mig_card *st, const char *t, candidate *out, int cap)
{
    if (all_digits(t)) {
        long i = strtol(t, NULL, 10);
        return i < s->count ? card_devices(s, st, (int)i, out, cap) : -1;
    }
    if (strncasecmp(t, "GPU-", 4) == 0) {
        int found = -1;
        for (int i = 0; i < s->count; i++)
            if (strncasecmp(s->gpus[i].uuid, t, strlen(t)) == 0) {
                if (found >= 0) return -1; /* an ambiguous prefix names nothing */
                found = i;
            }
        return found < 0 ? -1 : card_devices(s, st, found, out, cap);
    }
    if (strncasecmp(t, "MIG-GPU-", 8) == 0) { /* MIG-GPU-<uuid>/<gi>/<ci> (drivers before R470) */
        char uuid[64];
        unsigned gi, ci;
        if (sscanf(t + 4, "%44[^/]/%u/%u", uuid, &gi, &ci) != 3) return -1;
        for (int i = 0; i < s->count; i++) {
            if (strcasecmp(s->gpus[i].uuid, uuid) != 0 || !st[i].current) continue;
            for (int g = 0; g < FAKE_MIG_MAX_GI; g++)
                for (int c = 0; st[i].gi[g].live && st[i].gi[g].id == gi && c < FAKE_MIG_MAX_CI; c++)
                    if (st[i].gi[g].ci[c].live && st[i].gi[g].ci[c].id == ci && cap > 0) {
                        out[0] = (candidate){i, g, c};
                        return 1;
                    }
        }
        return -1;
    }
    if (strncasecmp(t, "MIG-", 4) == 0) {
        for (int i = 0; i < s->count; i++)
            for (int g = 0; st[i].current && g < FAKE_MIG_MAX_GI; g++)
                for (int c = 0; st[i].gi[g].live && c < FAKE_MIG_MAX_CI; c++)
                    if (st[i].gi[g].ci[c].live && strcasecmp(st[i].gi[g].ci[c].uuid, t) == 0 && cap > 0) {
                        out[0] = (candidate){i, g, c};
                        return 1;
                    }
        return -1;
    }
    return -1;
}

/* The nvidia-caps major the simulated node's /proc/devices (next to its GPU description) lists; -1: none. */
static int caps_major(const fake_system *s)
{
    char path[4200];
    snprintf(path, sizeof(path), "%s", s->config_path);
    char *slash = strrchr(path, '/');
    if (!slash) return -1;
    snprintf(slash, sizeof(path) - (size_t)(slash - path), "/proc/devices");
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    char line[256], name[64];
    int major = -1, m;
    while (fgets(line, sizeof(line), f))
        if (sscanf(line, "%d %63s", &m, name) == 2 && strcmp(name, "nvidia-caps") == 0) major = m;
    fclose(f);
    return major;
}

static int holds_cap(unsigned minor_number, int major)
{
    char path[64];
    snprintf(path, sizeof(path), "/dev/nvidia-caps/nvidia-cap%u", minor_number);
    struct stat st;
    if (stat(path, &st) != 0 || !S_ISCHR(st.st_mode)) return 0;
    return minor(st.st_rdev) == minor_number && (major < 0 || (int)major(st.st_rdev) == major);
}

/* Whether the process may use the candidate. A MIG instance is opened through its GPU instance's and
 * compute instance's capability devices, /dev/nvidia-caps/nvidia-cap<minor> with the minors of the
 * kernel module's fixed layout (/proc/driver/nvidia-caps/mig-minors: gpu<minor>/gi<G>/access is
 * 3 + 135 * minor + 9 * G, its ci<C> one more than that plus C), as the real driver does by default
 * (nv_cap_enable_devfs=1). A container has only the nodes its CDI spec lists; the double is in one
 * when it found its description where the toolkit's spec mounts it (no GPUSLICE_FAKE_GPU_CONFIG). On
 * the host the driver's nvidia-modprobe makes the nodes on demand, so the double does not ask there. */
static int mig_reachable(const fake_system *s, const fake_mig_card *st, candidate c)
{
    if (c.gi < 0 || strcmp(s->config_path, FAKE_DEFAULT_CONFIG) != 0) return 1;
    const fake_mig_gi *g = &st[c.card].gi[c.gi];
    unsigned gi_minor = 3 + 135 * s->gpus[c.card].minor + 9 * g->id;
    int major = caps_major(s);
    return holds_cap(gi_minor, major) && holds_cap(gi_minor + 1 + g->ci[c.ci].id, major);
}

static int same(candidate a, candidate b)
{
    return a.card == b.card && a.gi == b.gi && a.ci == b.ci;
}

void fake_cuda_select_devices(fake_system *s)
{
    static fake_mig_card st[FAKE_MAX_GPUS];
    for (int i = 0; i < s->count; i++) fake_mig_snapshot(s, i, &st[i]);
    candidate list[FAKE_MAX_GPUS];
    int n = 0;
    const char *env = getenv("CUDA_VISIBLE_DEVICES");
    if (env) {
        char buf[4096];
        snprintf(buf, sizeof(buf), "%s", env);
        for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
            while (isspace((unsigned char)*t)) t++;
            for (char *e = t + strlen(t); e > t && isspace((unsigned char)e[-1]);) *--e = '\0';
            candidate found[FAKE_MAX_GPUS];
            int k = entry_devices(s, st, t, found, FAKE_MAX_GPUS);
            if (k < 0) break;
            for (int j = 0; j < k && n < FAKE_MAX_GPUS; j++) {
                int dup = 0;
                for (int m = 0; m < n; m++) dup |= same(list[m], found[j]);
                if (!dup) list[n++] = found[j];
            }
        }
    } else {
        for (int i = 0; i < s->count && n < FAKE_MAX_GPUS; i++)
            n += card_devices(s, st, i, list + n, FAKE_MAX_GPUS - n);
    }
    /* CUDA enumerates a single MIG device: the first one listed that the process may open */
    int out = 0, mig_seen = 0;
    for (int k = 0; k < n; k++) {
        if (!mig_reachable(s, st, list[k])) continue;
        if (list[k].gi >= 0 && mig_seen++) continue;
        list[out++] = list[k];
    }
    n = out;

    int changed = n != s->count;
    for (int k = 0; k < n; k++) changed |= list[k].card != k || list[k].gi >= 0;
    if (!changed) return; /* every card as loaded */
    fake_gpu gpus[FAKE_MAX_GPUS];
    fake_dev_state *state[FAKE_MAX_GPUS];
    int index[FAKE_MAX_GPUS];
    for (int k = 0; k < n; k++) {
        candidate c = list[k];
        gpus[k] = s->gpus[c.card];
        state[k] = s->state[c.card];
        index[k] = s->state_index[c.card];
        if (c.gi < 0) continue;
        const fake_mig_gi *g = &st[c.card].gi[c.gi];
        const fake_mig_ci *ci = &g->ci[c.ci];
        const mig_gi_profile *gp = mig_profile_by_index(mig_model_of(s->gpus[c.card].name), g->profile);
        char path[4608], prof[64];
        fake_mig_gi_path(s, s->state_index[c.card], g, path, sizeof(path));
        int dev = FAKE_MIG_DEV(s->state_index[c.card], g->id);
        if (s->daemon_mode) { /* the daemon keeps the instance's memory (and makes its state file) */
            index[k] = dev;
            if (fake_daemon_slot(dev) != 0) gp = NULL;
        }
        fake_dev_state *d = gp ? fake_map_state_file(path, s->daemon_mode ? FAKE_MAP_CLIENT : FAKE_MAP_DIRECT) : NULL;
        if (!d) { /* the instance went away meanwhile: the device is not there */
            fprintf(stderr, "fake NVIDIA driver: MIG device %s: no GPU instance state at %s\n", ci->uuid, path);
            gpus[k].name[0] = '\0';
            continue;
        }
        mig_ci_name(gp, ci->size, prof, sizeof(prof));
        snprintf(gpus[k].name, sizeof(gpus[k].name), "%s %s", s->gpus[c.card].name, prof);
        snprintf(gpus[k].uuid, sizeof(gpus[k].uuid), "%s", ci->uuid);
        memcpy(gpus[k].uuid_bytes, ci->uuid_bytes, 16);
        gpus[k].memory_bytes = gp->memory_mb << 20;
        gpus[k].multiprocessors = (int)mig_ci_sms(gp, ci->size);
        state[k] = d;
    }
    int m = 0;
    for (int k = 0; k < n; k++) {
        if (!gpus[k].name[0]) continue;
        s->gpus[m] = gpus[k];
        s->state[m] = state[k];
        s->state_index[m] = index[k];
        m++;
    }
    s->count = m;
}
