#define _GNU_SOURCE
#include "gs_region.h"

#include "gs_procfs.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static off_t entry_offset(unsigned idx)
{
    return (off_t)GS_REGION_HEADER_SIZE + (off_t)idx * GS_REGION_ENTRY_SIZE;
}

uint64_t gs_process_start_time(int pid)
{
    return gs_proc_start_time(pid);
}

static int init_mutex(pthread_mutex_t *m)
{
    pthread_mutexattr_t attr;
    if (pthread_mutexattr_init(&attr) != 0) return -1;
    int rc = pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
    if (rc == 0) rc = pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
    if (rc == 0) rc = pthread_mutex_init(m, &attr);
    pthread_mutexattr_destroy(&attr);
    return rc == 0 ? 0 : -1;
}

int gs_region_open(gs_region *r, const gs_config *cfg, char *err, size_t errlen)
{
    memset(r, 0, sizeof(*r));
    r->fd = -1;
    atomic_store(&r->self, -1);
    r->limit = cfg->memory_bytes;
    if ((size_t)snprintf(r->path, sizeof(r->path), "%s/%s", cfg->usage_dir, GS_REGION_FILE) >= sizeof(r->path)) {
        snprintf(err, errlen, "usage_dir is too long");
        return -1;
    }
    int fd = open(r->path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0) {
        snprintf(err, errlen, "cannot open usage region %s: %s", r->path, strerror(errno));
        return -1;
    }
    /* flock serializes initialization between processes starting together; the kernel drops it
     * if the initializer dies, and it is never taken again after the region is set up. */
    if (flock(fd, LOCK_EX) != 0) {
        snprintf(err, errlen, "cannot lock usage region %s: %s", r->path, strerror(errno));
        close(fd);
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        snprintf(err, errlen, "cannot stat usage region %s: %s", r->path, strerror(errno));
        goto fail;
    }
    int fresh = st.st_size == 0;
    if (st.st_size != 0 && st.st_size < (off_t)GS_REGION_SIZE) {
        snprintf(err, errlen, "usage region %s has size %lld, expected %u: not written by this shim",
                 r->path, (long long)st.st_size, GS_REGION_SIZE);
        goto fail;
    }
    if (fresh) {
        (void)fchmod(fd, 0666); /* every uid of the slice's containers shares it */
        if (ftruncate(fd, GS_REGION_SIZE) != 0) {
            snprintf(err, errlen, "cannot size usage region %s: %s", r->path, strerror(errno));
            goto fail;
        }
    }
    void *base = mmap(NULL, GS_REGION_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        snprintf(err, errlen, "cannot map usage region %s: %s", r->path, strerror(errno));
        goto fail;
    }
    r->base = base;
    r->hdr = base;
    r->entries = (gs_region_entry *)(r->base + GS_REGION_HEADER_SIZE);
    gs_region_header *h = r->hdr;
    if (fresh || memcmp(h->magic, "\0\0\0\0\0\0\0\0", 8) == 0) {
        memset(r->base, 0, GS_REGION_SIZE);
        h->version = GS_REGION_VERSION;
        h->header_size = GS_REGION_HEADER_SIZE;
        h->entry_size = GS_REGION_ENTRY_SIZE;
        h->max_entries = GS_REGION_MAX_ENTRIES;
        if (init_mutex(&h->lock) != 0) {
            snprintf(err, errlen, "cannot initialize the usage region lock");
            goto fail_unmap;
        }
        atomic_thread_fence(memory_order_release);
        memcpy(h->magic, GS_REGION_MAGIC, 8);
    } else if (memcmp(h->magic, GS_REGION_MAGIC, 8) != 0 || h->version != GS_REGION_VERSION ||
               h->header_size != GS_REGION_HEADER_SIZE || h->entry_size != GS_REGION_ENTRY_SIZE ||
               h->max_entries != GS_REGION_MAX_ENTRIES) {
        snprintf(err, errlen, "usage region %s has an unknown format (magic/version %u); this shim speaks version %u",
                 r->path, h->version, GS_REGION_VERSION);
        goto fail_unmap;
    }
    /* The limit and share are informational copies for readers; the shim enforces its own config. */
    h->memory_limit_bytes = cfg->memory_bytes;
    h->compute_share = (uint32_t)cfg->compute_share;
    flock(fd, LOCK_UN);
    r->fd = fd;
    return 0;
fail_unmap:
    munmap(r->base, GS_REGION_SIZE);
    r->base = NULL;
fail:
    flock(fd, LOCK_UN);
    close(fd);
    return -1;
}

void gs_region_lock(gs_region *r)
{
    int rc = pthread_mutex_lock(&r->hdr->lock);
    if (rc == EOWNERDEAD) {
        /* A holder died inside a critical section. Every field it may have touched is updated
         * atomically and in an order that can only leave capacity unused, never over-granted,
         * so the state is consistent as it is. */
        pthread_mutex_consistent(&r->hdr->lock);
        atomic_fetch_add(&r->hdr->lock_recoveries_total, 1);
    }
}

void gs_region_unlock(gs_region *r)
{
    pthread_mutex_unlock(&r->hdr->lock);
}

/* An entry is live while its owner holds the OFD lock on its first byte. */
static int entry_owner_alive(gs_region *r, unsigned idx)
{
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = entry_offset(idx), .l_len = 1};
    if (fcntl(r->fd, F_OFD_GETLK, &fl) != 0) return 1; /* unknown: keep it */
    return fl.l_type != F_UNLCK;
}

static unsigned high_water(gs_region *r)
{
    unsigned n = atomic_load(&r->hdr->entries_high_water);
    return n < GS_REGION_MAX_ENTRIES ? n : GS_REGION_MAX_ENTRIES;
}

static void reclaim_dead_locked(gs_region *r)
{
    int self = atomic_load(&r->self);
    for (unsigned i = 0, n = high_water(r); i < n; i++) {
        gs_region_entry *e = &r->entries[i];
        if ((int)i == self || atomic_load(&e->state) != 1) continue;
        if (entry_owner_alive(r, i)) continue;
        /* The driver freed everything a dead process held; its grant returns to the slice. */
        atomic_store(&e->quota, 0);
        atomic_store(&e->avail, 0);
        atomic_store(&e->used, 0);
        atomic_store(&e->state, 0);
    }
}

static int claim_locked(gs_region *r)
{
    reclaim_dead_locked(r);
    for (unsigned i = 0; i < GS_REGION_MAX_ENTRIES; i++) {
        gs_region_entry *e = &r->entries[i];
        if (atomic_load(&e->state) != 0) continue;
        struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = entry_offset(i), .l_len = 1};
        if (fcntl(r->fd, F_OFD_SETLK, &fl) != 0) continue;
        int pid = (int)getpid();
        e->pid = pid;
        e->start_time = gs_process_start_time(pid);
        atomic_store(&e->used, 0);
        atomic_store(&e->avail, 0);
        atomic_store(&e->quota, 0);
        atomic_store(&e->peak, 0);
        atomic_store(&e->refused, 0);
        atomic_store(&e->throttled_ns, 0);
        atomic_store(&e->context_bytes, 0);
        atomic_store(&e->host_pid, 0);
        atomic_store(&e->state, 1);
        if (atomic_load(&r->hdr->entries_high_water) < i + 1) atomic_store(&r->hdr->entries_high_water, i + 1);
        atomic_store_explicit(&r->self, (int)i, memory_order_release);
        return 0;
    }
    return -1;
}

static int try_take_avail(gs_region_entry *e, uint64_t size)
{
    uint64_t a = atomic_load(&e->avail);
    while (a >= size) {
        if (atomic_compare_exchange_weak(&e->avail, &a, a - size)) return 0;
    }
    return -1;
}

int gs_region_refuse_held(gs_region *r, uint64_t size)
{
    atomic_fetch_sub(&r->held, size);
    gs_region_count_refused(r);
    return -1;
}

int gs_region_reserve_slow(gs_region *r, uint64_t size)
{
    gs_region_lock(r);
    if (atomic_load(&r->self) < 0 && claim_locked(r) != 0) {
        gs_region_unlock(r);
        static const char msg[] = "gpuslice: usage region is full (1024 live processes); refusing allocation\n";
        (void)!write(2, msg, sizeof(msg) - 1);
        atomic_fetch_add(&r->hdr->refused_allocations_total, 1);
        if (r->limit != GS_UNLIMITED) atomic_fetch_sub(&r->held, size);
        return -1;
    }
    int self = atomic_load(&r->self);
    gs_region_entry *me = &r->entries[self];
    if (r->limit == GS_UNLIMITED) {
        gs_region_unlock(r);
        return gs_region_reserve(r, size);
    }
    int stolen = 0;
    for (;;) {
        if (try_take_avail(me, size) == 0) break;
        reclaim_dead_locked(r);
        uint64_t committed = 0;
        for (unsigned i = 0, n = high_water(r); i < n; i++)
            if (atomic_load(&r->entries[i].state) == 1) committed += atomic_load(&r->entries[i].quota);
        uint64_t headroom = r->limit > committed ? r->limit - committed : 0;
        uint64_t mine = atomic_load(&me->avail);
        if (mine + headroom < size && !stolen) {
            /* Take back what other processes were granted but have not allocated. Exchange first,
             * then lower the quota: dying in between leaves capacity unused, never over-granted. */
            for (unsigned i = 0, n = high_water(r); i < n; i++) {
                gs_region_entry *o = &r->entries[i];
                if ((int)i == self || atomic_load(&o->state) != 1) continue;
                uint64_t x = atomic_exchange(&o->avail, 0);
                atomic_fetch_sub(&o->quota, x);
            }
            stolen = 1;
            continue;
        }
        if (mine + headroom < size) {
            gs_region_unlock(r);
            return gs_region_refuse_held(r, size);
        }
        uint64_t chunk = r->limit / 8 > GS_REGION_CHUNK ? r->limit / 8 : GS_REGION_CHUNK;
        uint64_t want = size > chunk ? size : chunk;
        uint64_t grant = headroom < want ? headroom : want;
        atomic_fetch_add(&me->quota, grant);
        atomic_fetch_add(&me->avail, grant);
    }
    gs_region_unlock(r);
    uint64_t used = atomic_fetch_add(&me->used, size) + size;
    uint64_t peak = atomic_load(&me->peak);
    while (used > peak && !atomic_compare_exchange_weak(&me->peak, &peak, used)) {
    }
    return 0;
}

void gs_region_count_refused(gs_region *r)
{
    atomic_fetch_add(&r->hdr->refused_allocations_total, 1);
    int self = atomic_load(&r->self);
    if (self >= 0) atomic_fetch_add(&r->entries[self].refused, 1);
}

uint64_t gs_region_used_total(gs_region *r)
{
    gs_region_lock(r);
    reclaim_dead_locked(r);
    uint64_t total = 0;
    for (unsigned i = 0, n = high_water(r); i < n; i++)
        if (atomic_load(&r->entries[i].state) == 1) total += atomic_load(&r->entries[i].used);
    gs_region_unlock(r);
    return total;
}

int gs_region_live_pids(gs_region *r, int32_t *pids, int max)
{
    int n = 0;
    for (unsigned i = 0, hw = high_water(r); i < hw && n < max; i++)
        if (atomic_load(&r->entries[i].state) == 1) pids[n++] = r->entries[i].pid;
    return n;
}

int gs_region_has_nvml_pid(gs_region *r, int32_t pid)
{
    if (pid <= 0) return 0;
    for (unsigned i = 0, hw = high_water(r); i < hw; i++) {
        gs_region_entry *e = &r->entries[i];
        if (atomic_load(&e->state) == 1 && (e->pid == pid || atomic_load(&e->host_pid) == pid)) return 1;
    }
    return 0;
}

void gs_region_after_fork_child(gs_region *r)
{
    if (r->base == NULL) return;
    atomic_store(&r->self, -1);
    atomic_store(&r->held, 0); /* the parent's allocations stay the parent's */
    /* The inherited descriptor shares the parent's open file description, and OFD locks belong to
     * the description: through it the parent's entry lock looks like our own (so the parent would
     * look dead to our liveness checks), and while we hold it the parent's entry stays locked after
     * the parent dies. Drop it now, before anything else runs in the child, and use a fresh one
     * (open and close are async-signal-safe). If the open fails, fd -1 makes every liveness check
     * answer "alive" (safe: capacity may stay unused, never over-granted).
     * The inherited mapping references the parent's description too (a mapping holds its file), so it
     * is replaced in place by one of the fresh descriptor: pointers into the region stay valid. */
    int fd = open(r->path, O_RDWR | O_CLOEXEC);
    if (fd >= 0 &&
        mmap(r->base, GS_REGION_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
        close(fd);
        fd = -1;
    }
    if (r->fd >= 0) close(r->fd);
    r->fd = fd;
}

static gs_export *exports(gs_region *r)
{
    return (gs_export *)(r->base + GS_EXPORTS_OFFSET);
}

/* Our own OFD lock is invisible to F_OFD_GETLK through our descriptor: never ask about ourselves. */
static int export_owner_live(gs_region *r, uint32_t owner)
{
    if (owner >= GS_REGION_MAX_ENTRIES) return 0;
    if ((int)owner == atomic_load(&r->self)) return 1;
    return atomic_load(&r->entries[owner].state) == 1 && entry_owner_alive(r, owner);
}

void gs_region_export_add(gs_region *r, uint64_t key, uint64_t dptr)
{
    int self = atomic_load(&r->self);
    if (key == 0 || self < 0) return;
    gs_region_lock(r);
    gs_export *x = exports(r), *slot = NULL;
    for (unsigned i = 0; i < GS_MAX_EXPORTS; i++) {
        uint64_t k = atomic_load(&x[i].key);
        if (k == key && x[i].owner == (uint32_t)self) { /* exported again: already known */
            slot = NULL;
            break;
        }
        /* free, or left by a process that died */
        if (slot == NULL && (k == 0 || !export_owner_live(r, x[i].owner))) slot = &x[i];
    }
    if (slot != NULL) {
        slot->dptr = dptr;
        slot->owner = (uint32_t)self;
        atomic_store(&slot->key, key);
    }
    gs_region_unlock(r);
}

int gs_region_export_known(gs_region *r, uint64_t key)
{
    if (key == 0) return 0;
    int known = 0;
    gs_region_lock(r);
    gs_export *x = exports(r);
    for (unsigned i = 0; i < GS_MAX_EXPORTS && !known; i++)
        known = atomic_load(&x[i].key) == key && export_owner_live(r, x[i].owner);
    gs_region_unlock(r);
    return known;
}

void gs_region_export_drop(gs_region *r, uint64_t dptr)
{
    int self = atomic_load(&r->self);
    if (self < 0) return;
    gs_region_lock(r);
    gs_export *x = exports(r);
    for (unsigned i = 0; i < GS_MAX_EXPORTS; i++)
        if (atomic_load(&x[i].key) != 0 && x[i].owner == (uint32_t)self && x[i].dptr == dptr)
            atomic_store(&x[i].key, 0);
    gs_region_unlock(r);
}

static gs_software *software(gs_region *r)
{
    return (gs_software *)(r->base + GS_SOFTWARE_OFFSET);
}

static uint64_t unix_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

void gs_region_note_software(gs_region *r, const gs_software *rec)
{
    if (r->base == NULL) return;
    gs_software *sw = software(r);
    gs_region_lock(r);
    atomic_fetch_add_explicit(&sw->seq, 1, memory_order_acq_rel); /* odd: being written */
    sw->kind = rec->kind;
    sw->cuda_error = rec->cuda_error;
    sw->device_arch = rec->device_arch;
    sw->driver_version = rec->driver_version;
    sw->runtime_version = rec->runtime_version;
    sw->pid = (int32_t)getpid();
    sw->arch_count = rec->arch_count;
    memcpy(sw->archs, rec->archs, sizeof(sw->archs));
    memset(sw->process, 0, sizeof(sw->process));
    (void)prctl(PR_GET_NAME, sw->process, 0, 0, 0);
    sw->process[sizeof(sw->process) - 1] = '\0';
    memcpy(sw->library, rec->library, sizeof(sw->library));
    sw->library[sizeof(sw->library) - 1] = '\0';
    sw->time_ms = unix_ms();
    atomic_fetch_add_explicit(&sw->seq, 1, memory_order_release);
    atomic_fetch_add_explicit(&sw->records_total, 1, memory_order_relaxed);
    gs_region_unlock(r);
}

void gs_region_note_image_ok(gs_region *r)
{
    if (r->base == NULL) return;
    atomic_store_explicit(&software(r)->ok_time_ms, unix_ms(), memory_order_relaxed);
}

void gs_region_note_first_use(gs_region *r)
{
    if (r->base == NULL) return;
    uint64_t expected = 0;
    atomic_compare_exchange_strong_explicit(&software(r)->first_use_ms, &expected, unix_ms(), memory_order_relaxed,
                                            memory_order_relaxed);
}
