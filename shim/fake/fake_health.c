/* The driver double's card health, shared by libcuda, libnvidia-ml and the fault tool (fake_health.h). */
#define _GNU_SOURCE
#include "fake_health.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static fake_health_state *health;
static pthread_once_t health_once = PTHREAD_ONCE_INIT;

/* Readers map the file read-only: only the fault tool (the host) may change a card's health, so a
 * tenant cannot fail a card for the others. With the host daemon the daemon creates it (only it
 * adds state files); without one, the first process that may. */
static fake_health_state *map_health(const char *state_dir, int writer, int may_create)
{
    char path[4400];
    snprintf(path, sizeof(path), "%s/health.bin", state_dir);
    int fd = may_create ? open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644) : -1;
    if (fd < 0 && !writer) fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return NULL;
    flock(fd, LOCK_EX);
    struct stat st;
    int ok = fstat(fd, &st) == 0;
    if (ok && st.st_size < (off_t)sizeof(fake_health_state)) ok = ftruncate(fd, sizeof(fake_health_state)) == 0;
    fake_health_state *h = MAP_FAILED;
    if (ok) h = mmap(NULL, sizeof(*h), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (h != MAP_FAILED && (memcmp(h->magic, "FAKEHLT1", 8) != 0 || h->size != (uint32_t)sizeof(*h))) {
        /* new, or from a build with another layout: starts over (it only holds test state) */
        memset(h, 0, sizeof(*h));
        h->size = (uint32_t)sizeof(*h);
        memcpy(h->magic, "FAKEHLT1", 8);
    }
    if (h != MAP_FAILED && !writer) { /* keep only a read-only view */
        munmap(h, sizeof(*h));
        h = mmap(NULL, sizeof(*h), PROT_READ, MAP_SHARED, fd, 0);
    } else if (h == MAP_FAILED && !writer) {
        h = mmap(NULL, sizeof(*h), PROT_READ, MAP_SHARED, fd, 0);
    }
    flock(fd, LOCK_UN);
    close(fd);
    if (h == MAP_FAILED) return NULL;
    if (memcmp(h->magic, "FAKEHLT1", 8) != 0) {
        munmap(h, sizeof(*h));
        return NULL;
    }
    return h;
}

static void health_once_init(void)
{
    fake_system *s = fake_system_get();
    if (s) health = map_health(s->state_dir, 0, !s->daemon_mode);
}

fake_health_state *fake_health(void)
{
    pthread_once(&health_once, health_once_init);
    return health;
}

fake_gpu_health *fake_health_of(int index)
{
    fake_health_state *h = fake_health();
    fake_system *s = fake_system_get();
    if (!h || !s || index < 0 || index >= s->count) return NULL;
    for (int i = 0; i < FAKE_MAX_GPUS; i++)
        if (h->gpus[i].uuid[0] && strcmp(h->gpus[i].uuid, s->gpus[index].uuid) == 0) return &h->gpus[i];
    return NULL;
}

int fake_health_visible_index(uint32_t slot)
{
    fake_health_state *h = fake_health();
    fake_system *s = fake_system_get();
    if (!h || !s || slot >= FAKE_MAX_GPUS || !h->gpus[slot].uuid[0]) return -1;
    for (int i = 0; i < s->count; i++)
        if (strcmp(h->gpus[slot].uuid, s->gpus[i].uuid) == 0) return i;
    return -1;
}

/* The hot paths (every launch and allocation) pay one atomic load while no card is faulty. */
static fake_gpu_health *faulty_slot(int index)
{
    fake_health_state *h = fake_health();
    if (!h || !atomic_load_explicit(&h->faulty, memory_order_acquire)) return NULL;
    return fake_health_of(index);
}

int fake_health_cuda_error(int index)
{
    fake_gpu_health *g = faulty_slot(index);
    if (!g) return 0;
    if (atomic_load(&g->lost)) return 999;  /* CUDA_ERROR_UNKNOWN: the card no longer answers */
    if (atomic_load(&g->ecc)) return 214;   /* CUDA_ERROR_ECC_UNCORRECTABLE, sticky until reset */
    return 0;
}

int fake_health_lost(int index)
{
    fake_gpu_health *g = faulty_slot(index);
    return g && atomic_load(&g->lost);
}

int fake_health_any_lost(void)
{
    fake_system *s = fake_system_get();
    for (int i = 0; s && i < s->count; i++)
        if (fake_health_lost(i)) return 1;
    return 0;
}

/* ---------------------------------------------------------------- writer side (the fault tool) */

static fake_health_state *writer_state(fake_system *s, int slot, fake_gpu_health **g)
{
    if (!s || slot < 0 || slot >= s->count) return NULL;
    fake_health_state *h = map_health(s->state_dir, 1, 1);
    if (!h) return NULL;
    *g = &h->gpus[slot];
    snprintf((*g)->uuid, sizeof((*g)->uuid), "%s", s->gpus[slot].uuid);
    return h;
}

static void update_faulty(fake_health_state *h)
{
    uint32_t any = 0;
    for (int i = 0; i < FAKE_MAX_GPUS; i++) {
        fake_gpu_health *g = &h->gpus[i];
        any |= atomic_load(&g->lost) | atomic_load(&g->ecc) | atomic_load(&g->retired_pages_pending) |
               atomic_load(&g->remap_pending) | atomic_load(&g->remap_failed);
    }
    atomic_store_explicit(&h->faulty, any ? 1u : 0u, memory_order_release);
}

int fake_health_prepare(fake_system *s)
{
    fake_health_state *h = s ? map_health(s->state_dir, 1, 1) : NULL;
    if (h) munmap(h, sizeof(*h));
    return h ? 0 : -1;
}

int fake_health_raise_xid(fake_system *s, int slot, unsigned xid)
{
    fake_gpu_health *g;
    fake_health_state *h = writer_state(s, slot, &g);
    if (!h) return -1;
    /* What the driver does to the card along with the event (NVIDIA's XID catalog). */
    int ampere = s->gpus[slot].cc_major >= 8; /* rows are remapped from Ampere on, pages retired before */
    switch (xid) {
    case 79: atomic_store(&g->lost, 1); break;                /* fallen off the bus */
    case 48:                                                  /* double-bit ECC error */
    case 95: atomic_store(&g->ecc, 1); /* fall through */    /* uncontained ECC error */
    case 94:                                                  /* contained ECC error */
    case 63:                                                  /* retirement / remap recorded */
        atomic_store(ampere ? &g->remap_pending : &g->retired_pages_pending, 1);
        break;
    case 64: atomic_store(&g->remap_failed, 1); break; /* row remapping failed */
    default: break;
    }
    update_faulty(h);
    uint32_t q = atomic_load(&h->seq) + 1;
    fake_xid_event *e = &h->ring[q % FAKE_HEALTH_RING];
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    e->gpu = (uint32_t)slot;
    e->xid = xid;
    e->time_ns = (uint64_t)now.tv_sec * 1000000000ull + (uint64_t)now.tv_nsec;
    atomic_store_explicit(&e->seq, q, memory_order_release);
    atomic_store_explicit(&h->seq, q, memory_order_release);
    syscall(SYS_futex, &h->seq, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
    return 0;
}

int fake_health_set(fake_system *s, int slot, int lost, int remap_pending)
{
    fake_gpu_health *g;
    fake_health_state *h = writer_state(s, slot, &g);
    if (!h) return -1;
    if (lost) atomic_store(&g->lost, 1);
    if (remap_pending) atomic_store(s->gpus[slot].cc_major >= 8 ? &g->remap_pending : &g->retired_pages_pending, 1);
    update_faulty(h);
    return 0;
}

int fake_health_clear(fake_system *s, int slot)
{
    fake_gpu_health *g;
    fake_health_state *h = writer_state(s, slot, &g);
    if (!h) return -1;
    atomic_store(&g->lost, 0);
    atomic_store(&g->ecc, 0);
    atomic_store(&g->retired_pages_pending, 0);
    atomic_store(&g->remap_pending, 0);
    atomic_store(&g->remap_failed, 0);
    update_faulty(h);
    return 0;
}
