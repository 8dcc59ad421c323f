#define _GNU_SOURCE
#include "fake_common.h"

#include "../src/gs_procfs.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>

static fake_system sys_state;
static pthread_once_t sys_once = PTHREAD_ONCE_INIT;

/* The connection to gpuslice-fake-driverd (see fake_common.h). */
static int conn_fd = -1;
static _Atomic int conn_owner; /* getpid() of the process the connection belongs to */
static int32_t conn_host_pid;
static uint64_t conn_host_start;
static pthread_mutex_t conn_lock = PTHREAD_MUTEX_INITIALIZER;

uint64_t fake_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint64_t fake_start_time(int pid)
{
    return gs_proc_start_time(pid);
}

int fake_proc_alive(const fake_proc *p)
{
    if (p->pid <= 0) return 0;
    if (p->managed) return 1; /* keyed by a host PID: only the daemon knows, and frees it on disconnect */
    if (kill(p->pid, 0) != 0 && errno == ESRCH) return 0;
    return fake_start_time(p->pid) == p->start_time;
}

static int hexv(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static int parse_uuid(const char *s, unsigned char out[16])
{
    if (strncmp(s, "GPU-", 4) != 0 || strlen(s) != 40) return -1;
    int n = 0;
    for (const char *p = s + 4; *p && n < 16;) {
        if (*p == '-') {
            p++;
            continue;
        }
        int hi = hexv(p[0]), lo = hexv(p[1]);
        if (hi < 0 || lo < 0) return -1;
        out[n++] = (unsigned char)(hi << 4 | lo);
        p += 2;
    }
    return n == 16 ? 0 : -1;
}

static int set_gpu_key(fake_gpu *g, const char *key, const char *val)
{
    char *end;
    if (strcmp(key, "name") == 0) {
        snprintf(g->name, sizeof(g->name), "%s", val);
    } else if (strcmp(key, "uuid") == 0) {
        if (parse_uuid(val, g->uuid_bytes) != 0) return -1;
        snprintf(g->uuid, sizeof(g->uuid), "%s", val);
    } else if (strcmp(key, "memory_bytes") == 0) {
        g->memory_bytes = strtoull(val, &end, 10);
        if (*end || g->memory_bytes == 0) return -1;
    } else if (strcmp(key, "compute_capability") == 0) {
        if (sscanf(val, "%d.%d", &g->cc_major, &g->cc_minor) != 2) return -1;
    } else if (strcmp(key, "context_bytes") == 0) {
        g->context_bytes = strtoull(val, &end, 10);
        if (*end) return -1;
    } else if (strcmp(key, "context_create_us") == 0) {
        g->context_create_us = (unsigned)strtoul(val, &end, 10);
        if (*end) return -1;
    } else if (strcmp(key, "multiprocessors") == 0) {
        g->multiprocessors = (int)strtol(val, &end, 10);
        if (*end) return -1;
    } else if (strcmp(key, "pci_bus_id") == 0) {
        if (sscanf(val, "%x:%x:%x.0", &g->pci_domain, &g->pci_bus, &g->pci_device) != 3) return -1;
    } else if (strcmp(key, "nvlink") == 0) {
        g->nvlink_count = 0;
        for (const char *p = val; *p;) {
            if (g->nvlink_count >= FAKE_MAX_NVLINKS) return -1;
            int k = g->nvlink_count, used = 0;
            if (sscanf(p, "%x:%x:%x.0%n", &g->nvlink_domain[k], &g->nvlink_bus[k], &g->nvlink_device[k], &used) != 3)
                return -1;
            g->nvlink_count++;
            p += used;
            if (*p == ',') p++;
            else if (*p) return -1;
        }
    } else if (strcmp(key, "pci_device_id") == 0) {
        g->pci_device_id = (unsigned)strtoul(val, &end, 16);
        if (*end) return -1;
    } else if (strcmp(key, "minor") == 0) {
        g->minor = (unsigned)strtoul(val, &end, 10);
        if (*end) return -1;
    } else if (strcmp(key, "serial") == 0) {
        snprintf(g->serial, sizeof(g->serial), "%s", val);
    } else {
        return -1;
    }
    return 0;
}

static int parse_config(fake_system *s, FILE *f)
{
    char line[512];
    int lineno = 0;
    while (fgets(line, sizeof(line), f)) {
        lineno++;
        size_t n = strlen(line);
        while (n && (line[n - 1] == '\n' || line[n - 1] == '\r')) line[--n] = '\0';
        if (n == 0 || line[0] == '#') continue;
        char *eq = strchr(line, '=');
        if (!eq) goto bad;
        *eq = '\0';
        const char *key = line, *val = eq + 1;
        if (strcmp(key, "version") == 0) {
            if (strcmp(val, "1") != 0) goto bad;
        } else if (strcmp(key, "driver_version") == 0) {
            snprintf(s->driver_version, sizeof(s->driver_version), "%s", val);
        } else if (strcmp(key, "cuda_driver_version") == 0) {
            s->cuda_driver_version = atoi(val);
        } else if (strncmp(key, "gpu.", 4) == 0) {
            char *dot;
            long idx = strtol(key + 4, &dot, 10);
            if (*dot != '.' || idx < 0 || idx >= FAKE_MAX_GPUS) goto bad;
            if (idx >= s->count) s->count = (int)idx + 1;
            if (set_gpu_key(&s->gpus[idx], dot + 1, val) != 0) goto bad;
        } else {
            goto bad;
        }
    }
    for (int i = 0; i < s->count; i++) {
        if (s->gpus[i].name[0] == '\0' || s->gpus[i].uuid[0] == '\0' || s->gpus[i].memory_bytes == 0) {
            fprintf(stderr, "fake NVIDIA driver: %s: gpu.%d needs name, uuid and memory_bytes\n", s->config_path, i);
            return -1;
        }
    }
    if (s->count == 0 || s->driver_version[0] == '\0' || s->cuda_driver_version == 0) {
        fprintf(stderr, "fake NVIDIA driver: %s: needs driver_version, cuda_driver_version and gpu.0.*\n",
                s->config_path);
        return -1;
    }
    return 0;
bad:
    fprintf(stderr, "fake NVIDIA driver: %s line %d: unknown or malformed entry\n", s->config_path, lineno);
    return -1;
}

static int init_mutex(pthread_mutex_t *m)
{
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    int rc = pthread_mutex_init(m, &a);
    pthread_mutexattr_destroy(&a);
    return rc;
}


static int state_ok(const fake_dev_state *s)
{
    return memcmp(s->magic, "FAKEGPU2", 8) == 0 && s->version == 2 && s->pad == (uint32_t)sizeof(*s);
}

/* MAP_DIRECT: shared read-write by every process (no daemon); MAP_DAEMON: the daemon's own, mode
 * 0644; MAP_CLIENT: read-only, a daemon serves the state. */
static fake_dev_state *map_state_path(const char *path, int how);
static fake_dev_state *map_state(const char *dir, int idx, int how)
{
    char path[4608];
    snprintf(path, sizeof(path), "%s/gpu%d.bin", dir, idx);
    return map_state_path(path, how);
}

fake_dev_state *fake_map_state_file(const char *path, int how)
{
    return map_state_path(path, how);
}

static fake_dev_state *map_state_path(const char *path, int how)
{
    struct stat st;
    if (how == MAP_CLIENT) {
        int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
        if (fd < 0) return NULL;
        if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size < (off_t)sizeof(fake_dev_state)) {
            close(fd);
            errno = EPROTO;
            return NULL;
        }
        fake_dev_state *s = mmap(NULL, sizeof(*s), PROT_READ, MAP_SHARED, fd, 0);
        close(fd);
        if (s == MAP_FAILED) return NULL;
        if (!state_ok(s)) { /* the daemon writes the layout before it serves */
            munmap(s, sizeof(*s));
            errno = EPROTO;
            return NULL;
        }
        return s;
    }
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, how == MAP_DAEMON ? 0644 : 0666);
    if (fd < 0) return NULL;
    flock(fd, LOCK_EX);
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) goto fail;
    if (how == MAP_DAEMON) {
        if (st.st_uid != geteuid()) { /* another user could still write it */
            errno = EPERM;
            goto fail;
        }
        if (fchmod(fd, 0644) != 0) goto fail;
    }
    if (st.st_size < (off_t)sizeof(fake_dev_state) && ftruncate(fd, sizeof(fake_dev_state)) != 0) goto fail;
    fake_dev_state *s = mmap(NULL, sizeof(*s), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (s == MAP_FAILED) goto fail;
    /* A state file from a build with another layout starts over (it only holds test state). */
    if (!state_ok(s)) {
        memset(s, 0, sizeof(*s));
        init_mutex(&s->lock);
        s->version = 2;
        s->pad = (uint32_t)sizeof(*s);
        atomic_thread_fence(memory_order_release);
        memcpy(s->magic, "FAKEGPU2", 8);
    }
    flock(fd, LOCK_UN);
    close(fd);
    return s;
fail:
    {
        int e = errno;
        close(fd);
        errno = e;
    }
    return NULL;
}

/* Connects to the daemon (caller holds conn_lock). 0 when connected and told the host PID. */
static int connect_daemon(void)
{
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    char path[4400];
    snprintf(path, sizeof(path), "%s/%s", sys_state.state_dir, FAKE_SOCK_NAME);
    int dirfd = -1;
    if (strlen(path) >= sizeof(a.sun_path)) {
        /* sun_path holds 108 bytes; reach a deeper socket through the directory's /proc/self/fd link */
        dirfd = open(sys_state.state_dir, O_PATH | O_DIRECTORY | O_CLOEXEC);
        if (dirfd < 0) goto fail;
        snprintf(path, sizeof(path), "/proc/self/fd/%d/%s", dirfd, FAKE_SOCK_NAME);
    }
    if (strlen(path) >= sizeof(a.sun_path)) goto fail;
    memcpy(a.sun_path, path, strlen(path) + 1);
    int rc = connect(fd, (struct sockaddr *)&a, sizeof(a));
    if (dirfd >= 0) close(dirfd);
    if (rc != 0) goto fail;
    /* An answer is waited for like an ioctl returns: a dead daemon closes the socket at once; a timeout
     * (which drops the connection, and with it what the daemon holds for this process) only for one
     * that hangs, not for one a loaded machine is slow to schedule. */
    struct timeval tv = {.tv_sec = 60};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    fake_hello h;
    size_t got = 0;
    while (got < sizeof(h)) {
        ssize_t n = read(fd, (char *)&h + got, sizeof(h) - got);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) goto fail;
        got += (size_t)n;
    }
    if (memcmp(h.magic, "FAKEDRV1", 8) != 0 || h.host_pid <= 0) goto fail;
    conn_fd = fd;
    conn_host_pid = h.host_pid;
    conn_host_start = h.host_start_time;
    atomic_store(&conn_owner, (int)getpid());
    return 0;
fail:
    close(fd);
    return -1;
}

/* This process's busy segment (daemon mode): its own, handed over by the daemon. */
static fake_segment *seg;
static int seg_pid;
static pthread_mutex_t seg_lock = PTHREAD_MUTEX_INITIALIZER;

/* A forked child shares its parent's connection: drop it (so the parent's death is still seen) and
 * connect on its own on first use. The parent's busy segment stays the parent's. */
static void conn_after_fork_child(void)
{
    if (conn_fd >= 0) close(conn_fd);
    conn_fd = -1;
    atomic_store(&conn_owner, 0);
    pthread_mutex_init(&conn_lock, NULL);
    if (seg) munmap(seg, sizeof(*seg));
    seg = NULL;
    seg_pid = 0;
    pthread_mutex_init(&seg_lock, NULL);
}

/* A connection of this process (not a parent's), connected if needed; caller holds conn_lock. */
static int conn_ready_locked(void)
{
    int me = (int)getpid();
    if (atomic_load(&conn_owner) == me && conn_fd >= 0) return 0;
    if (conn_fd >= 0) close(conn_fd);
    conn_fd = -1;
    if (connect_daemon() != 0) {
        atomic_store(&conn_owner, -1);
        return -1;
    }
    return 0;
}

static void self_identity(int32_t *pid, uint64_t *start, int *managed)
{
    int me = (int)getpid();
    if (sys_state.daemon_mode && atomic_load(&conn_owner) != me) {
        pthread_mutex_lock(&conn_lock);
        if (atomic_load(&conn_owner) != me) (void)conn_ready_locked();
        pthread_mutex_unlock(&conn_lock);
    }
    if (sys_state.daemon_mode && atomic_load(&conn_owner) == me) {
        *pid = conn_host_pid;
        *start = conn_host_start;
        *managed = 1;
        return;
    }
    *pid = me;
    *start = fake_start_time(me);
    *managed = 0;
}

/* One request and its answer (and the descriptor that comes with it, if `fd_out`). -1: no daemon. */
static int request(uint32_t op, int dev, int64_t arg, fake_rep *rep, int *fd_out)
{
    fake_req rq = {op, dev, arg};
    int rc = -1;
    if (fd_out) *fd_out = -1;
    pthread_mutex_lock(&conn_lock);
    if (conn_ready_locked() != 0) goto out;
    ssize_t n;
    do n = send(conn_fd, &rq, sizeof(rq), MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
    if (n != (ssize_t)sizeof(rq)) goto broken;
    char cbuf[CMSG_SPACE(sizeof(int))];
    struct iovec iov = {rep, sizeof(*rep)};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof(cbuf)};
    do n = recvmsg(conn_fd, &m, MSG_CMSG_CLOEXEC);
    while (n < 0 && errno == EINTR);
    if (n != (ssize_t)sizeof(*rep)) goto broken;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        int fd;
        memcpy(&fd, CMSG_DATA(c), sizeof(fd));
        if (fd_out && *fd_out < 0) *fd_out = fd;
        else close(fd);
    }
    rc = 0;
    goto out;
broken: /* a dead daemon is a dead driver: requests fail from now on (a later one reconnects) */
    close(conn_fd);
    conn_fd = -1;
    atomic_store(&conn_owner, -1);
out:
    pthread_mutex_unlock(&conn_lock);
    return rc;
}

int32_t fake_self_pid(void)
{
    if (!sys_state.daemon_mode) return (int32_t)getpid();
    int32_t pid;
    uint64_t st;
    int managed;
    self_identity(&pid, &st, &managed);
    return pid;
}

static int is_daemon;

static void load_config(const char *path)
{
    fake_system *s = &sys_state;
    snprintf(s->config_path, sizeof(s->config_path), "%s", path);
    FILE *f = fopen(path, "re");
    if (!f) {
        fprintf(stderr, "fake NVIDIA driver: cannot open %s: %s\n", path, strerror(errno));
        return;
    }
    int rc = parse_config(s, f);
    fclose(f);
    if (rc != 0) return;
    snprintf(s->state_dir, sizeof(s->state_dir), "%s.state", path);
    if (is_daemon) {
        /* Only the daemon writes in here: its own dir, not writable by others. */
        struct stat st;
        if (mkdir(s->state_dir, 0755) != 0 && errno != EEXIST) {
            fprintf(stderr, "fake NVIDIA driver: cannot make %s: %s\n", s->state_dir, strerror(errno));
            return;
        }
        if (lstat(s->state_dir, &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != geteuid() ||
            chmod(s->state_dir, 0755) != 0) {
            fprintf(stderr, "fake NVIDIA driver: %s must be a directory of this user (uid %u)\n", s->state_dir,
                    (unsigned)geteuid());
            return;
        }
    } else {
        /* Like opening /dev/nvidiactl: one connection per process, kept for its lifetime. */
        pthread_mutex_lock(&conn_lock);
        s->daemon_mode = connect_daemon() == 0;
        pthread_mutex_unlock(&conn_lock);
        if (!s->daemon_mode) mkdir(s->state_dir, 0777);
    }
    /* The real driver shows a process only the GPUs whose device node it can reach: in a container
     * that is what the runtime put in /dev. Where NVIDIA device nodes exist at all (/dev/nvidiactl),
     * a GPU without its /dev/nvidia<minor> is invisible and the others are renumbered from 0; their
     * shared state stays keyed by the GPU's place on the node. The daemon sees every GPU. */
    for (int i = 0; i < s->count; i++) s->state_index[i] = i;
    if (!is_daemon && access("/dev/nvidiactl", F_OK) == 0) {
        int visible = 0;
        for (int i = 0; i < s->count; i++) {
            char node[64];
            snprintf(node, sizeof(node), "/dev/nvidia%u", s->gpus[i].minor);
            if (access(node, F_OK) != 0) continue;
            s->gpus[visible] = s->gpus[i];
            s->state_index[visible++] = i;
        }
        s->count = visible;
    }
    int how = is_daemon ? MAP_DAEMON : s->daemon_mode ? MAP_CLIENT : MAP_DIRECT;
    for (int i = 0; i < s->count; i++) {
        s->state[i] = map_state(s->state_dir, s->state_index[i], how);
        if (!s->state[i]) {
            fprintf(stderr, "fake NVIDIA driver: cannot map state in %s: %s\n", s->state_dir, strerror(errno));
            return;
        }
    }
    s->loaded = 1;
    if (s->daemon_mode) pthread_atfork(NULL, NULL, conn_after_fork_child);
}

static void load_once(void)
{
    const char *path = getenv(FAKE_ENV);
    if (path == NULL || *path == '\0') {
        if (access(FAKE_DEFAULT_CONFIG, R_OK) != 0) {
            fprintf(stderr, "fake NVIDIA driver: %s is not set and %s is absent; no GPUs\n", FAKE_ENV,
                    FAKE_DEFAULT_CONFIG);
            return;
        }
        path = FAKE_DEFAULT_CONFIG;
    }
    load_config(path);
}

static const char *daemon_config;
static void load_daemon_once(void)
{
    is_daemon = 1;
    load_config(daemon_config);
}

fake_system *fake_system_load_for_daemon(const char *config_path)
{
    daemon_config = config_path;
    pthread_once(&sys_once, load_daemon_once);
    return sys_state.loaded ? &sys_state : NULL;
}

void fake_release_process(fake_system *s, int32_t pid, uint64_t start_time)
{
    for (int g = 0; g < s->count; g++) {
        fake_dev_state *d = s->state[g];
        fake_lock(d);
        for (int i = 0; i < FAKE_MAX_PROCS; i++) {
            fake_proc *p = &d->procs[i];
            if (p->pid != pid || !p->managed || p->start_time != start_time) continue;
            /* the kernel module frees everything the process held */
            atomic_fetch_sub(&d->used_total, atomic_exchange(&p->used, 0));
            atomic_store(&p->contexts, 0);
            p->managed = 0;
            p->pid = 0;
        }
        fake_unlock(d);
    }
}

fake_system *fake_system_get(void)
{
    pthread_once(&sys_once, load_once);
    return sys_state.loaded ? &sys_state : NULL;
}

int fake_state_index(fake_dev_state *s)
{
    for (int i = 0; i < sys_state.count; i++)
        if (sys_state.state[i] == s) return i;
    return -1;
}

/* The device's place on the node (what requests name), or -1. */
static int node_index(fake_dev_state *s)
{
    int i = fake_state_index(s);
    return i < 0 ? -1 : sys_state.state_index[i];
}

static void sync_timelines(void)
{
    fake_rep rep;
    (void)request(FAKE_OP_SYNC, 0, 0, &rep, NULL);
}

/* With the daemon the state is read-only here: there is no lock to take (the daemon changes memory
 * and slots synchronously; busy timelines are merged on a reader's request, in fake_busy_between, and
 * otherwise every few milliseconds). */
void fake_lock(fake_dev_state *s)
{
    if (sys_state.daemon_mode) return;
    if (pthread_mutex_lock(&s->lock) == EOWNERDEAD) pthread_mutex_consistent(&s->lock);
}

void fake_unlock(fake_dev_state *s)
{
    if (sys_state.daemon_mode) return;
    pthread_mutex_unlock(&s->lock);
}

static __thread fake_proc *self_slots[FAKE_MAX_GPUS];
static __thread int self_pid;

fake_proc *fake_self_slot(fake_dev_state *s)
{
    int idx = fake_state_index(s);
    int me = (int)getpid();
    if (self_pid != me) { /* first call in this thread, or a forked child */
        memset(self_slots, 0, sizeof(self_slots));
        self_pid = me;
    }
    if (idx >= 0 && self_slots[idx]) return self_slots[idx];
    fake_proc *found = NULL;
    if (sys_state.daemon_mode) {
        fake_rep rep;
        if (idx >= 0 && request(FAKE_OP_SLOT, sys_state.state_index[idx], 0, &rep, NULL) == 0 && rep.rc == 0 &&
            rep.val < FAKE_MAX_PROCS)
            found = &s->procs[rep.val]; /* read-only: changed through requests */
        if (idx >= 0) self_slots[idx] = found;
        return found;
    }
    int32_t pid;
    uint64_t st;
    int managed;
    self_identity(&pid, &st, &managed);
    fake_lock(s);
    for (int i = 0; i < FAKE_MAX_PROCS && !found; i++)
        if (s->procs[i].pid == pid && s->procs[i].start_time == st) found = &s->procs[i];
    for (int i = 0; i < FAKE_MAX_PROCS && !found; i++) {
        fake_proc *p = &s->procs[i];
        if (p->pid == 0 || !fake_proc_alive(p)) {
            if (p->pid != 0) atomic_fetch_sub(&s->used_total, atomic_exchange(&p->used, 0));
            p->pid = pid;
            p->managed = (uint32_t)managed;
            p->start_time = st;
            atomic_store(&p->used, 0);
            atomic_store(&p->contexts, 0);
            found = p;
        }
    }
    fake_unlock(s);
    if (idx >= 0) self_slots[idx] = found;
    return found;
}

uint64_t fake_used_locked(fake_dev_state *s)
{
    if (sys_state.daemon_mode) return atomic_load(&s->used_total); /* the daemon frees what dead processes held */
    for (int i = 0; i < FAKE_MAX_PROCS; i++) {
        fake_proc *p = &s->procs[i];
        if (p->pid == 0 || fake_proc_alive(p)) continue;
        /* the driver frees a dead process's memory */
        atomic_fetch_sub(&s->used_total, atomic_exchange(&p->used, 0));
        p->pid = 0;
        p->managed = 0;
    }
    return atomic_load(&s->used_total);
}

/* ---------------------------------------------------------------- memory and contexts */

int fake_charge(fake_dev_state *s, uint64_t size)
{
    if (sys_state.daemon_mode) {
        fake_rep rep;
        int dev = node_index(s);
        if (dev < 0 || size > (uint64_t)INT64_MAX) return -1;
        return request(FAKE_OP_CHARGE, dev, (int64_t)size, &rep, NULL) == 0 && rep.rc == 0 ? 0 : -1;
    }
    /* Lock-free unless the card looks full; then dead processes' memory is reclaimed and it is retried. */
    fake_proc *me = fake_self_slot(s);
    int i = fake_state_index(s);
    if (!me || i < 0) return -1;
    uint64_t cap = sys_state.gpus[i].memory_bytes;
    for (int attempt = 0; attempt < 2; attempt++) {
        uint64_t used = atomic_load(&s->used_total);
        while (used + size <= cap && used + size >= used) {
            if (atomic_compare_exchange_weak(&s->used_total, &used, used + size)) {
                atomic_fetch_add(&me->used, size);
                return 0;
            }
        }
        fake_lock(s);
        (void)fake_used_locked(s);
        fake_unlock(s);
    }
    return -1;
}

void fake_uncharge(fake_dev_state *s, uint64_t size)
{
    if (sys_state.daemon_mode) {
        fake_rep rep;
        int dev = node_index(s);
        if (dev >= 0 && size <= (uint64_t)INT64_MAX) (void)request(FAKE_OP_UNCHARGE, dev, (int64_t)size, &rep, NULL);
        return;
    }
    fake_proc *me = fake_self_slot(s);
    if (me) atomic_fetch_sub(&me->used, size);
    atomic_fetch_sub(&s->used_total, size);
}

void fake_contexts_add(fake_dev_state *s, int delta)
{
    if (sys_state.daemon_mode) {
        fake_rep rep;
        int dev = node_index(s);
        if (dev >= 0) (void)request(FAKE_OP_CONTEXTS, dev, delta, &rep, NULL);
        return;
    }
    fake_proc *me = fake_self_slot(s);
    if (!me) return;
    if (delta > 0) atomic_fetch_add(&me->contexts, (uint32_t)delta);
    else if (delta < 0 && atomic_load(&me->contexts) > 0) atomic_fetch_sub(&me->contexts, 1);
}

/* ---------------------------------------------------------------- the busy timeline */

void fake_ring_append(fake_dev_state *s, int32_t pid, uint64_t start, uint64_t end)
{
    /* seqlock: lock-free readers (daemon mode's clients) retry while the ring changes */
    uint64_t q = atomic_load_explicit(&s->ring_seq, memory_order_relaxed);
    atomic_store_explicit(&s->ring_seq, q + 1, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);
    uint64_t head = atomic_load(&s->ring_head);
    fake_busy *last = head ? &s->ring[(head - 1) % FAKE_RING] : NULL;
    if (last && last->pid == pid && last->end_ns == start) {
        last->end_ns = end; /* back-to-back kernels of one process form one busy interval */
    } else {
        fake_busy *b = &s->ring[head % FAKE_RING];
        b->pid = pid;
        b->start_ns = start;
        b->end_ns = end;
        atomic_store(&s->ring_head, head + 1);
    }
    if (atomic_load(&s->busy_until_ns) < end) atomic_store(&s->busy_until_ns, end);
    atomic_store_explicit(&s->ring_seq, q + 2, memory_order_release);
}

/* This process's segment (asked for once per process), or NULL. */
static fake_segment *my_segment(void)
{
    int me = (int)getpid();
    if (seg && seg_pid == me) return seg;
    fake_rep rep;
    int fd = -1;
    if (request(FAKE_OP_SEGMENT, 0, 0, &rep, &fd) != 0 || rep.rc != 0 || fd < 0) {
        if (fd >= 0) close(fd);
        return NULL;
    }
    fake_segment *m = mmap(NULL, sizeof(*m), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) return NULL;
    seg = m;
    seg_pid = me;
    return seg;
}

/* The cards' launch queues (asked for once; a forked child keeps its parent's: they are the node's), or
 * NULL with a daemon that has none. */
static fake_queue *queue;
static int queue_asked;
static fake_queue *my_queue(void)
{
    if (queue || queue_asked) return queue;
    queue_asked = 1;
    fake_rep rep;
    int fd = -1;
    if (request(FAKE_OP_QUEUE, 0, 0, &rep, &fd) != 0 || rep.rc != 0 || fd < 0) {
        if (fd >= 0) close(fd);
        return NULL;
    }
    struct stat st;
    fake_queue *m = fstat(fd, &st) == 0 && st.st_size >= (off_t)sizeof(*m)
                        ? mmap(NULL, sizeof(*m), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                        : MAP_FAILED;
    close(fd);
    if (m == MAP_FAILED) return NULL;
    if (memcmp(m->magic, "FAKEQUE1", 8) != 0) {
        munmap(m, sizeof(*m));
        return NULL;
    }
    queue = m;
    return queue;
}

/* Books `duration_ns` on the card's queue from `earliest` on, behind every process's kernels; the start. */
static uint64_t claim(fake_queue *qs, int dev, uint64_t earliest, uint64_t now, uint64_t duration_ns)
{
    _Atomic uint64_t *q = &qs->until_ns[dev];
    uint64_t until = atomic_load(q), start;
    do {
        /* what other processes booked is believed only as far ahead as the daemon merges a booking */
        uint64_t booked = until < now + FAKE_MAX_AHEAD_NS ? until : now + FAKE_MAX_AHEAD_NS;
        start = booked > earliest ? booked : earliest;
    } while (!atomic_compare_exchange_weak(q, &until, start + duration_ns));
    return start;
}

uint64_t fake_record_busy(fake_dev_state *s, uint64_t duration_ns)
{
    if (duration_ns == 0) return fake_now_ns(); /* an empty kernel keeps nothing busy */
    if (sys_state.daemon_mode) {
        /* No round trip per launch: the process's own segment, merged by the daemon. */
        int dev = node_index(s);
        pthread_mutex_lock(&seg_lock);
        fake_segment *g = dev >= 0 ? my_segment() : NULL;
        uint64_t now = fake_now_ns();
        if (!g) {
            pthread_mutex_unlock(&seg_lock);
            return now + duration_ns;
        }
        fake_seg_dev *d = &g->dev[dev];
        uint64_t start = atomic_load(&d->until_ns), merged = atomic_load(&s->busy_until_ns);
        if (start < merged) start = merged;
        if (start < now) start = now;
        fake_queue *qs = dev < FAKE_MAX_GPUS ? my_queue() : NULL;
        if (qs) start = claim(qs, dev, start, now, duration_ns);
        uint64_t end = start + duration_ns;
        uint64_t head = atomic_load_explicit(&d->head, memory_order_relaxed);
        fake_seg_busy *last = head ? &d->ring[(head - 1) % FAKE_SEG_RING] : NULL;
        if (last && atomic_load(&last->end_ns) == start) {
            atomic_store(&last->end_ns, end);
        } else {
            fake_seg_busy *b = &d->ring[head % FAKE_SEG_RING];
            b->start_ns = start;
            atomic_store(&b->end_ns, end);
            atomic_store_explicit(&d->head, head + 1, memory_order_release);
        }
        atomic_store(&d->until_ns, end);
        pthread_mutex_unlock(&seg_lock);
        return end;
    }
    int32_t pid = fake_self_pid();
    fake_lock(s);
    uint64_t now = fake_now_ns();
    uint64_t start = atomic_load(&s->busy_until_ns);
    if (start < now) start = now;
    uint64_t end = start + duration_ns;
    fake_ring_append(s, pid, start, end);
    fake_unlock(s);
    return end;
}

uint64_t fake_busy_until(fake_dev_state *s)
{
    uint64_t until = atomic_load(&s->busy_until_ns);
    if (sys_state.daemon_mode) {
        int dev = node_index(s);
        pthread_mutex_lock(&seg_lock);
        if (seg && seg_pid == (int)getpid() && dev >= 0) {
            uint64_t own = atomic_load(&seg->dev[dev].until_ns);
            if (own > until) until = own;
        }
        pthread_mutex_unlock(&seg_lock);
    }
    return until;
}

/* How far out of order the daemon's merged timeline can be (processes' segments are merged every few
 * milliseconds); readers look that much further back before they stop. */
#define FAKE_MERGE_SLACK_NS 1000000000ull

static uint64_t busy_scan(fake_dev_state *s, int32_t pid, uint64_t from_ns, uint64_t to_ns, uint64_t slack)
{
    uint64_t busy = 0;
    uint64_t head = atomic_load(&s->ring_head);
    uint64_t n = head < FAKE_RING ? head : FAKE_RING;
    for (uint64_t k = 0; k < n; k++) {
        const volatile fake_busy *b = &s->ring[(head - 1 - k) % FAKE_RING];
        uint64_t bs = b->start_ns, be = b->end_ns;
        if (be + slack <= from_ns) break; /* intervals are serialized: all older ones end earlier */
        if (pid && b->pid != pid) continue;
        uint64_t a = bs > from_ns ? bs : from_ns;
        uint64_t e = be < to_ns ? be : to_ns;
        if (e > a) busy += e - a;
    }
    return busy;
}

uint64_t fake_busy_between(fake_dev_state *s, int32_t pid, uint64_t from_ns, uint64_t to_ns)
{
    uint64_t busy;
    if (sys_state.daemon_mode) {
        sync_timelines();
        for (;;) {
            uint64_t q = atomic_load_explicit(&s->ring_seq, memory_order_acquire);
            if (q & 1) {
                sched_yield();
                continue;
            }
            busy = busy_scan(s, pid, from_ns, to_ns, FAKE_MERGE_SLACK_NS);
            atomic_thread_fence(memory_order_acquire);
            if (atomic_load_explicit(&s->ring_seq, memory_order_relaxed) == q) break;
        }
    } else {
        fake_lock(s);
        busy = busy_scan(s, pid, from_ns, to_ns, 0);
        fake_unlock(s);
    }
    /* merged segments may overlap a little: the device is never more than fully busy */
    if (to_ns > from_ns && busy > to_ns - from_ns) busy = to_ns - from_ns;
    return busy;
}

/* Makes the daemon set up the caller's slot on `dev` (a MIG GPU instance's state comes into being so). */
int fake_daemon_slot(int dev)
{
    fake_rep rep;
    return request(FAKE_OP_SLOT, dev, 0, &rep, NULL) == 0 && rep.rc == 0 ? 0 : -1;
}
