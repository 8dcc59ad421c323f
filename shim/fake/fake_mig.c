/* The driver double's MIG state, shared by libcuda, libnvidia-ml and the daemon (fake_mig.h). */
#define _GNU_SOURCE
#include "fake_mig.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static fake_mig_state *reader; /* read-only view, mapped once the file exists */
static pthread_mutex_t reader_lock = PTHREAD_MUTEX_INITIALIZER;

static void mig_path(const fake_system *s, char *out, size_t n)
{
    snprintf(out, n, "%s/mig.bin", s->state_dir);
}

static int layout_ok(const fake_mig_state *m)
{
    return memcmp(m->magic, "FAKEMIG1", 8) == 0 && m->size == (uint32_t)sizeof(*m);
}

static fake_mig_state *map_reader(fake_system *s)
{
    pthread_mutex_lock(&reader_lock);
    if (!reader) {
        char path[4400];
        mig_path(s, path, sizeof(path));
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        struct stat st;
        if (fd >= 0 && fstat(fd, &st) == 0 && st.st_size >= (off_t)sizeof(fake_mig_state)) {
            fake_mig_state *m = mmap(NULL, sizeof(*m), PROT_READ, MAP_SHARED, fd, 0);
            if (m != MAP_FAILED && layout_ok(m)) reader = m;
            else if (m != MAP_FAILED) munmap(m, sizeof(*m));
        }
        if (fd >= 0) close(fd);
    }
    pthread_mutex_unlock(&reader_lock);
    return reader;
}

void fake_mig_snapshot(fake_system *s, int index, fake_mig_card *out)
{
    memset(out, 0, sizeof(*out));
    if (!s || index < 0 || index >= s->count) return;
    fake_mig_state *m = map_reader(s);
    if (!m) return;
    int slot = s->state_index[index];
    for (;;) {
        uint32_t q = atomic_load_explicit(&m->seq, memory_order_acquire);
        if (q & 1) {
            sched_yield();
            continue;
        }
        memcpy(out, (const void *)&m->cards[slot], sizeof(*out));
        atomic_thread_fence(memory_order_acquire);
        if (atomic_load_explicit(&m->seq, memory_order_relaxed) == q) break;
    }
    if (strcmp(out->uuid, s->gpus[index].uuid) != 0) memset(out, 0, sizeof(*out)); /* another card's, or none */
}

static int writer_fd = -1;
static pthread_mutex_t writer_lock = PTHREAD_MUTEX_INITIALIZER;

fake_mig_state *fake_mig_write_begin(fake_system *s)
{
    char path[4400];
    mig_path(s, path, sizeof(path));
    pthread_mutex_lock(&writer_lock);
    /* Without a daemon the first writer creates it; with one, the daemon did at start. */
    int fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW | (s->daemon_mode ? 0 : O_CREAT), 0644);
    if (fd < 0) {
        int e = errno == ENOENT ? EACCES : errno;
        pthread_mutex_unlock(&writer_lock);
        errno = e;
        return NULL;
    }
    flock(fd, LOCK_EX);
    struct stat st;
    fake_mig_state *m = MAP_FAILED;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) &&
        (st.st_size >= (off_t)sizeof(fake_mig_state) || ftruncate(fd, sizeof(fake_mig_state)) == 0))
        m = mmap(NULL, sizeof(*m), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
        int e = errno;
        flock(fd, LOCK_UN);
        close(fd);
        pthread_mutex_unlock(&writer_lock);
        errno = e;
        return NULL;
    }
    if (!layout_ok(m)) { /* new, or from a build with another layout: starts over (test state only) */
        memset(m, 0, sizeof(*m));
        m->size = (uint32_t)sizeof(*m);
        memcpy(m->magic, "FAKEMIG1", 8);
    }
    for (int i = 0; i < s->count; i++) { /* a slot names its card; a slot of another card starts over */
        fake_mig_card *c = &m->cards[s->state_index[i]];
        if (strcmp(c->uuid, s->gpus[i].uuid) != 0) {
            memset(c, 0, sizeof(*c));
            snprintf(c->uuid, sizeof(c->uuid), "%s", s->gpus[i].uuid);
        }
    }
    atomic_fetch_add_explicit(&m->seq, 1, memory_order_acq_rel);
    writer_fd = fd;
    return m;
}

void fake_mig_write_end(fake_mig_state *m)
{
    atomic_fetch_add_explicit(&m->seq, 1, memory_order_acq_rel);
    munmap(m, sizeof(*m));
    flock(writer_fd, LOCK_UN);
    close(writer_fd);
    writer_fd = -1;
    pthread_mutex_unlock(&writer_lock);
}

int fake_mig_prepare(fake_system *s)
{
    char path[4400];
    mig_path(s, path, sizeof(path));
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0) return -1;
    close(fd);
    int daemon = s->daemon_mode;
    s->daemon_mode = 0; /* the daemon's own process may create it */
    fake_mig_state *m = fake_mig_write_begin(s);
    s->daemon_mode = daemon;
    if (!m) return -1;
    fake_mig_write_end(m);
    return 0;
}

void fake_mig_gi_path(const fake_system *s, int slot, const fake_mig_gi *g, char *out, size_t n)
{
    snprintf(out, n, "%s/gpu%d.gi%u.%u.bin", s->state_dir, slot, g->id, g->generation);
}

int fake_mig_gi_file_create(fake_system *s, int slot, const fake_mig_gi *g)
{
    char path[4608];
    fake_mig_gi_path(s, slot, g, path, sizeof(path));
    unlink(path); /* left over from a state the layout file no longer has */
    /* Shared read-write without a daemon (like the cards' files); the daemon's own otherwise. */
    fake_dev_state *d = fake_map_state_file(path, s->daemon_mode ? FAKE_MAP_DAEMON : FAKE_MAP_DIRECT);
    if (!d) return -1;
    if (!s->daemon_mode) chmod(path, 0666);
    munmap(d, sizeof(*d));
    return 0;
}

static fake_dev_state *map_gi_readonly(fake_system *s, int slot, const fake_mig_gi *g)
{
    char path[4608];
    fake_mig_gi_path(s, slot, g, path, sizeof(path));
    return fake_map_state_file(path, FAKE_MAP_CLIENT);
}

static uint64_t gi_scan(fake_system *s, int slot, const fake_mig_gi *g, int *busy)
{
    fake_dev_state *d = map_gi_readonly(s, slot, g);
    uint64_t used = 0;
    *busy = 0;
    if (!d) return 0;
    for (int i = 0; i < FAKE_MAX_PROCS; i++) {
        const fake_proc *p = &d->procs[i];
        if (p->pid == 0 || !fake_proc_alive(p)) continue;
        uint64_t u = atomic_load(&p->used);
        used += u;
        if (u || atomic_load(&p->contexts)) *busy = 1;
    }
    munmap(d, sizeof(*d));
    return used;
}

int fake_mig_gi_busy(fake_system *s, int slot, const fake_mig_gi *g)
{
    int busy;
    (void)gi_scan(s, slot, g, &busy);
    return busy;
}

uint64_t fake_mig_gi_used(fake_system *s, int slot, const fake_mig_gi *g)
{
    int busy;
    return gi_scan(s, slot, g, &busy);
}

static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

void fake_mig_make_uuid(const char *card_uuid, unsigned gi, unsigned ci, unsigned generation, char *out, size_t n,
                        unsigned char bytes[16])
{
    unsigned ids[3] = {gi, ci, generation};
    uint64_t a = fnv(fnv(14695981039346656037ull, card_uuid, strlen(card_uuid)), ids, sizeof(ids));
    uint64_t b = fnv(fnv(a ^ 0x9e3779b97f4a7c15ull, ids, sizeof(ids)), card_uuid, strlen(card_uuid));
    for (int i = 0; i < 8; i++) {
        bytes[i] = (unsigned char)(a >> (8 * i));
        bytes[8 + i] = (unsigned char)(b >> (8 * i));
    }
    bytes[6] = (unsigned char)((bytes[6] & 0x0f) | 0x50); /* a name-based (v5) UUID, as the driver's are */
    bytes[8] = (unsigned char)((bytes[8] & 0x3f) | 0x80);
    snprintf(out, n,
             "MIG-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", bytes[0], bytes[1],
             bytes[2], bytes[3], bytes[4], bytes[5], bytes[6], bytes[7], bytes[8], bytes[9], bytes[10], bytes[11],
             bytes[12], bytes[13], bytes[14], bytes[15]);
}

/* ---------------------------------------------------------------- the daemon's GPU instance states */

typedef struct {
    int slot;
    uint32_t gi_id, generation;
    fake_dev_state *d;
} daemon_gi;
static daemon_gi daemon_gis[FAKE_MAX_GPUS * FAKE_MIG_MAX_GI];

int fake_mig_daemon_device(fake_system *s, int dev, fake_dev_state **d, uint64_t *cap)
{
    if (dev < 0 || (dev & ~0x1ffff) || !(dev & 0x10000)) return -1;
    int slot = FAKE_MIG_DEV_CARD(dev);
    unsigned gi_id = (unsigned)dev & 0xff;
    if (slot >= s->count) return -1;
    fake_mig_card st;
    fake_mig_snapshot(s, slot, &st); /* the daemon sees every card: its index is the card's place */
    const fake_mig_gi *g = NULL;
    for (int k = 0; k < FAKE_MIG_MAX_GI && !g; k++)
        if (st.current && st.gi[k].live && st.gi[k].id == gi_id) g = &st.gi[k];
    const mig_gi_profile *p = g ? mig_profile_by_index(mig_model_of(s->gpus[slot].name), g->profile) : NULL;
    daemon_gi *e = &daemon_gis[slot * FAKE_MIG_MAX_GI + (gi_id % FAKE_MIG_MAX_GI)];
    if (e->d && (!g || e->slot != slot || e->gi_id != gi_id || e->generation != g->generation)) {
        munmap(e->d, sizeof(*e->d)); /* the instance is gone; its processes' memory with it */
        memset(e, 0, sizeof(*e));
    }
    if (!p) return -1;
    if (!e->d) { /* a new instance (empty), or one a previous daemon served */
        char path[4608];
        fake_mig_gi_path(s, slot, g, path, sizeof(path));
        e->d = fake_map_state_file(path, FAKE_MAP_DAEMON);
        if (!e->d) return -1;
        *e = (daemon_gi){slot, gi_id, g->generation, e->d};
        for (int i = 0; i < FAKE_MAX_PROCS; i++) { /* processes that ended while no daemon watched */
            fake_proc *q = &e->d->procs[i];
            if (q->managed && q->pid > 0 && fake_start_time(q->pid) != q->start_time)
                fake_mig_daemon_release(q->pid, q->start_time);
        }
    }
    *d = e->d;
    *cap = p->memory_mb << 20;
    return 0;
}

void fake_mig_daemon_release(int32_t pid, uint64_t start_time)
{
    for (size_t k = 0; k < sizeof(daemon_gis) / sizeof(daemon_gis[0]); k++) {
        fake_dev_state *d = daemon_gis[k].d;
        if (!d) continue;
        for (int i = 0; i < FAKE_MAX_PROCS; i++) {
            fake_proc *p = &d->procs[i];
            if (p->pid != pid || !p->managed || p->start_time != start_time) continue;
            atomic_fetch_sub(&d->used_total, atomic_exchange(&p->used, 0));
            atomic_store(&p->contexts, 0);
            p->managed = 0;
            p->pid = 0;
        }
    }
}

void fake_mig_daemon_start(fake_system *s)
{
    for (int slot = 0; slot < s->count; slot++) {
        fake_mig_card st;
        fake_mig_snapshot(s, slot, &st);
        for (int g = 0; st.current && g < FAKE_MIG_MAX_GI; g++) {
            fake_dev_state *d;
            uint64_t cap;
            if (st.gi[g].live) (void)fake_mig_daemon_device(s, FAKE_MIG_DEV(slot, (int)st.gi[g].id), &d, &cap);
        }
    }
}
