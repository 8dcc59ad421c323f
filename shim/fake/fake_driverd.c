/*
 * gpuslice-fake-driverd: the host-side part of the NVIDIA driver test double, playing the kernel
 * module. Started on the host as `gpuslice-fake-driverd --config <fake-gpus.conf>`, it serves
 * "<config>.state/driver.sock". Every process that loads the double's libcuda / libnvidia-ml connects
 * once and keeps the connection open (like an open /dev/nvidiactl). The daemon
 *   - learns the client's PID with SO_PEERCRED, which the kernel translates into the daemon's PID
 *     namespace (the host PID of a process in a container), and tells the client (fake_hello);
 *   - frees the process's memory in the shared state when its last connection closes, however the
 *     process ended (exit, SIGKILL, exec), as the driver does when the process's file descriptors go;
 *   - owns the state: it alone writes it (mode 0644, read-only to every client); a client's memory,
 *     contexts and slot change only through its requests (fake_req), applied to the client's own
 *     slot, checked against the card and the device nodes the process can reach, like ioctls;
 *   - merges each process's busy segment (a sealed memfd it hands the process) into the devices'
 *     timelines every few milliseconds and whenever a reader asks (FAKE_OP_SYNC);
 *   - hands every process the cards' launch queues (fake_queue), where launches claim card time.
 * NVML therefore reports host PIDs, whatever PID namespace the caller lives in, and no client can
 * change what it reports about another process.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "fake_common.h"
#include "fake_health.h"
#include "fake_mig.h"

#define MAX_CLIENTS 4096

/* How often processes' busy segments are merged into the timelines (readers also ask for a merge). */
#define MERGE_EVERY_MS 5
/* A process cannot claim the device busy further ahead than this (its own queue is far shorter). */
#define MAX_AHEAD_NS FAKE_MAX_AHEAD_NS

typedef struct {
    int fd;
    int32_t pid;
    uint64_t start;
    fake_segment *seg; /* its busy segment, once asked for */
    int seg_fd;
    struct {
        uint64_t idx;  /* first entry of the segment's ring not yet finished with */
        uint64_t done; /* the timeline has this process busy up to here already */
    } cur[FAKE_MAX_GPUS];
} client;

static volatile sig_atomic_t stop;
static void on_signal(int sig)
{
    (void)sig;
    stop = 1;
}

static int sock_path(char *out, size_t n, int dirfd, const char *dir, const char *name)
{
    struct sockaddr_un a;
    int len = snprintf(out, n, "%s/%s", dir, name);
    if (len > 0 && (size_t)len < sizeof(a.sun_path)) return 0;
    len = snprintf(out, n, "/proc/self/fd/%d/%s", dirfd, name); /* deep paths: through the dir's fd */
    return len > 0 && (size_t)len < sizeof(a.sun_path) ? 0 : -1;
}

/* Slots of processes that ended while no daemon watched them (a previous daemon's) are freed. */
static void reclaim_orphans(fake_system *s)
{
    for (int g = 0; g < s->count; g++)
        for (int i = 0; i < FAKE_MAX_PROCS; i++) {
            fake_proc *p = &s->state[g]->procs[i];
            if (p->managed && p->pid > 0 && fake_start_time(p->pid) != p->start_time)
                fake_release_process(s, p->pid, p->start_time);
        }
}

/* Whether the process can reach the GPU's device node, as opening /dev/nvidia<minor> requires. A process
 * in a container (a root other than the daemon's) needs the node in its /dev, whatever else it removed
 * there; on the host, only where NVIDIA device nodes exist at all (/dev/nvidiactl), as the clients'
 * own view of their GPUs has it. A root the daemon cannot inspect (not root itself) is not judged. */
static int reachable(const fake_system *s, int dev, int32_t pid)
{
    char path[96];
    struct stat mine, theirs;
    snprintf(path, sizeof(path), "/proc/%d/root/", (int)pid);
    if (stat(path, &theirs) != 0) return 1;
    int contained = stat("/", &mine) == 0 && (mine.st_dev != theirs.st_dev || mine.st_ino != theirs.st_ino);
    snprintf(path, sizeof(path), "/proc/%d/root/dev/nvidiactl", (int)pid);
    if (!contained && access(path, F_OK) != 0) return 1;
    snprintf(path, sizeof(path), "/proc/%d/root/dev/nvidia%u", (int)pid, s->gpus[dev].minor);
    return access(path, F_OK) == 0;
}

/* The client's slot on `dev` (made if `make`), or NULL; caller holds the device's lock. */
static fake_proc *slot_locked(fake_dev_state *d, const client *c, int make)
{
    for (int i = 0; i < FAKE_MAX_PROCS; i++) {
        fake_proc *p = &d->procs[i];
        if (p->pid == c->pid && p->managed && p->start_time == c->start) return p;
    }
    if (!make) return NULL;
    for (int i = 0; i < FAKE_MAX_PROCS; i++) {
        fake_proc *p = &d->procs[i];
        if (p->pid != 0 && fake_proc_alive(p)) continue;
        if (p->pid != 0) atomic_fetch_sub(&d->used_total, atomic_exchange(&p->used, 0));
        p->pid = c->pid;
        p->managed = 1;
        p->start_time = c->start;
        atomic_store(&p->used, 0);
        atomic_store(&p->contexts, 0);
        return p;
    }
    return NULL;
}

/* Moves what the process recorded since the last merge into the devices' timelines. The segment is the
 * process's to write: only its own intervals are taken, never before what was merged already, never
 * further ahead than MAX_AHEAD_NS. */
static void merge(fake_system *s, client *c)
{
    if (!c->seg) return;
    uint64_t now = fake_now_ns();
    for (int g = 0; g < s->count; g++) {
        fake_seg_dev *d = &c->seg->dev[g];
        uint64_t head = atomic_load_explicit(&d->head, memory_order_acquire);
        uint64_t idx = c->cur[g].idx;
        if (head < idx || head - idx > FAKE_SEG_RING) idx = head > FAKE_SEG_RING ? head - FAKE_SEG_RING : 0;
        if (idx == head) continue;
        fake_dev_state *st = s->state[g];
        fake_lock(st);
        for (uint64_t i = idx; i < head; i++) {
            fake_seg_busy *e = &d->ring[i % FAKE_SEG_RING];
            uint64_t a = e->start_ns, b = atomic_load(&e->end_ns);
            if (a < c->cur[g].done) a = c->cur[g].done;
            if (b > now + MAX_AHEAD_NS) b = now + MAX_AHEAD_NS;
            if (b > a) {
                fake_ring_append(st, c->pid, a, b);
                c->cur[g].done = b;
            }
            if (i + 1 < head) idx = i + 1; /* the last one may still grow: look at it again next time */
        }
        fake_unlock(st);
        c->cur[g].idx = idx;
    }
}

/* A sealed memfd: the process writes into it, but cannot shrink it under the daemon's mapping. */
static int make_segment(client *c)
{
    if (c->seg) return 0;
    int fd = memfd_create("gpuslice-fake-busy", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) return -1;
    if (ftruncate(fd, sizeof(fake_segment)) != 0 ||
        fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
        close(fd);
        return -1;
    }
    fake_segment *m = mmap(NULL, sizeof(*m), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
        close(fd);
        return -1;
    }
    memcpy(m->magic, "FAKESEG1", 8);
    c->seg = m;
    c->seg_fd = fd;
    memset(c->cur, 0, sizeof(c->cur));
    return 0;
}

/* The cards' launch queues, one memfd for every client (fake_queue): sealed at its size, written by all. */
static int queue_fd = -1;
static int make_queue(void)
{
    int fd = memfd_create("gpuslice-fake-queue", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) return -1;
    if (ftruncate(fd, sizeof(fake_queue)) != 0 ||
        fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0 ||
        pwrite(fd, "FAKEQUE1", 8, 0) != 8) {
        close(fd);
        return -1;
    }
    queue_fd = fd;
    return 0;
}

static int reply(client *c, fake_rep rep, int fd)
{
    struct iovec iov = {&rep, sizeof(rep)};
    char cbuf[CMSG_SPACE(sizeof(int))];
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1};
    if (fd >= 0) {
        memset(cbuf, 0, sizeof(cbuf));
        m.msg_control = cbuf;
        m.msg_controllen = sizeof(cbuf);
        struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cm), &fd, sizeof(fd));
    }
    /* never blocks: a client that does not read its answers is dropped */
    return sendmsg(c->fd, &m, MSG_DONTWAIT | MSG_NOSIGNAL) == (ssize_t)sizeof(rep) ? 0 : -1;
}

/* Applies one request of `c` to its own slot; -1 drops the client. */
static int serve(fake_system *s, client *clients, int n, client *c, const fake_req *rq)
{
    fake_rep rep = {0, 0, 0};
    int fd = -1;
    if (rq->op == FAKE_OP_SYNC) {
        for (int i = 0; i < n; i++) merge(s, &clients[i]);
        return reply(c, rep, -1);
    }
    if (rq->op == FAKE_OP_QUEUE) {
        if (queue_fd < 0) rep.rc = 1;
        return reply(c, rep, queue_fd);
    }
    if (rq->op == FAKE_OP_SEGMENT) {
        if (make_segment(c) != 0) rep.rc = 1;
        else fd = c->seg_fd;
        return reply(c, rep, fd);
    }
    /* a card, or a MIG GPU instance of one (its own memory, fake_mig.h) */
    int card = rq->dev;
    fake_dev_state *d = NULL;
    uint64_t cap = 0;
    if (rq->dev >= 0 && rq->dev < s->count) d = s->state[card], cap = s->gpus[card].memory_bytes;
    else if (fake_mig_daemon_device(s, rq->dev, &d, &cap) == 0) card = FAKE_MIG_DEV_CARD(rq->dev);
    if (!d || rq->op < FAKE_OP_SLOT || rq->op > FAKE_OP_CONTEXTS) {
        rep.rc = 1;
        return reply(c, rep, -1);
    }
    fake_lock(d);
    fake_proc *p = slot_locked(d, c, 0);
    if (!p && rq->op != FAKE_OP_UNCHARGE) {
        if (!reachable(s, card, c->pid)) rep.rc = 4;
        else if (!(p = slot_locked(d, c, 1))) rep.rc = 3;
    }
    if (p) switch (rq->op) {
        case FAKE_OP_SLOT: rep.val = (uint64_t)(p - d->procs); break;
        case FAKE_OP_CHARGE: {
            uint64_t size = (uint64_t)rq->arg;
            if (rq->arg < 0) {
                rep.rc = 1;
                break;
            }
            uint64_t used = fake_used_locked(d);
            if (used > cap || size > cap - used) {
                rep.rc = 2;
                break;
            }
            atomic_fetch_add(&d->used_total, size);
            atomic_fetch_add(&p->used, size);
            break;
        }
        case FAKE_OP_UNCHARGE: { /* never more than the process holds */
            uint64_t held = atomic_load(&p->used), size = rq->arg < 0 ? 0 : (uint64_t)rq->arg;
            if (size > held) size = held;
            atomic_fetch_sub(&p->used, size);
            atomic_fetch_sub(&d->used_total, size);
            break;
        }
        case FAKE_OP_CONTEXTS:
            if (rq->arg == 1) atomic_fetch_add(&p->contexts, 1);
            else if (rq->arg == -1 && atomic_load(&p->contexts) > 0) atomic_fetch_sub(&p->contexts, 1);
            else rep.rc = 1;
            break;
        }
    fake_unlock(d);
    return reply(c, rep, -1);
}

static void drop(fake_system *s, client *clients, int *n, int i)
{
    client gone = clients[i];
    merge(s, &gone); /* what it ran last still counts */
    close(gone.fd);
    if (gone.seg) {
        munmap(gone.seg, sizeof(*gone.seg));
        close(gone.seg_fd);
    }
    clients[i] = clients[--*n];
    int still = 0; /* libcuda and libnvidia-ml each hold a connection: free after the last */
    for (int k = 0; k < *n; k++) still |= clients[k].pid == gone.pid && clients[k].start == gone.start;
    if (!still) fake_release_process(s, gone.pid, gone.start);
    if (!still) fake_mig_daemon_release(gone.pid, gone.start);
}

int main(int argc, char **argv)
{
    const char *config = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--config") == 0 && i + 1 < argc) config = argv[++i];
        else if (strncmp(argv[i], "--config=", 9) == 0) config = argv[i] + 9;
        else {
            fprintf(stderr, "usage: gpuslice-fake-driverd --config FAKE_GPUS_CONF\n");
            return 2;
        }
    }
    if (!config) {
        fprintf(stderr, "usage: gpuslice-fake-driverd --config FAKE_GPUS_CONF\n");
        return 2;
    }
    fake_system *s = fake_system_load_for_daemon(config);
    if (!s) return 1; /* the loader said why */
    reclaim_orphans(s);
    if (fake_health_prepare(s) != 0) fprintf(stderr, "gpuslice-fake-driverd: no card health file\n");
    if (fake_mig_prepare(s) != 0) fprintf(stderr, "gpuslice-fake-driverd: no MIG state file\n");
    fake_mig_daemon_start(s);
    if (make_queue() != 0) fprintf(stderr, "gpuslice-fake-driverd: no launch queue: processes overlap on a card\n");

    int dirfd = open(s->state_dir, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (dirfd < 0) {
        fprintf(stderr, "gpuslice-fake-driverd: cannot open %s: %s\n", s->state_dir, strerror(errno));
        return 1;
    }
    char tmpname[64], tmppath[4400], final[4400];
    snprintf(tmpname, sizeof(tmpname), "%s.%d", FAKE_SOCK_NAME, (int)getpid());
    if (sock_path(tmppath, sizeof(tmppath), dirfd, s->state_dir, tmpname) != 0) {
        fprintf(stderr, "gpuslice-fake-driverd: socket path too long\n");
        return 1;
    }
    snprintf(final, sizeof(final), "%s/%s", s->state_dir, FAKE_SOCK_NAME);
    int lfd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    memcpy(a.sun_path, tmppath, strlen(tmppath) + 1); /* sock_path checked the length */
    unlinkat(dirfd, tmpname, 0);
    /* bind a private name, listen, then rename: a client never finds a socket that refuses it */
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&a, sizeof(a)) != 0 || listen(lfd, 256) != 0 ||
        fchmodat(dirfd, tmpname, 0666, 0) != 0 || renameat(dirfd, tmpname, dirfd, FAKE_SOCK_NAME) != 0) {
        fprintf(stderr, "gpuslice-fake-driverd: cannot serve %s: %s\n", final, strerror(errno));
        return 1;
    }
    struct sigaction sa = {.sa_handler = on_signal};
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    printf("gpuslice-fake-driverd: serving %s\n", final);
    fflush(stdout);

    static client clients[MAX_CLIENTS];
    static struct pollfd pfd[MAX_CLIENTS + 1];
    int n = 0;
    uint64_t last_merge = fake_now_ns();
    while (!stop) {
        pfd[0] = (struct pollfd){.fd = lfd, .events = POLLIN};
        int segments = 0;
        for (int i = 0; i < n; i++) {
            pfd[i + 1] = (struct pollfd){.fd = clients[i].fd, .events = POLLIN};
            segments |= clients[i].seg != NULL;
        }
        if (poll(pfd, (nfds_t)n + 1, segments ? MERGE_EVERY_MS : -1) < 0) {
            if (errno == EINTR) continue;
            break;
        }
        if (segments && fake_now_ns() - last_merge >= MERGE_EVERY_MS * 1000000ull) {
            for (int i = 0; i < n; i++) merge(s, &clients[i]);
            last_merge = fake_now_ns();
        }
        for (int i = n - 1; i >= 0; i--) {
            if (!(pfd[i + 1].revents & (POLLIN | POLLHUP | POLLERR))) continue;
            fake_req rq;
            ssize_t r = recv(clients[i].fd, &rq, sizeof(rq), MSG_DONTWAIT | MSG_TRUNC);
            if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
            if (r == (ssize_t)sizeof(rq) && serve(s, clients, n, &clients[i], &rq) == 0) continue;
            if (r > 0 && r != (ssize_t)sizeof(rq)) {
                fake_rep bad = {1, 0, 0}; /* not a request: say so, keep serving */
                if (reply(&clients[i], bad, -1) == 0) continue;
            }
            drop(s, clients, &n, i); /* closed (or unanswerable): the process's memory goes */
        }
        if (pfd[0].revents & POLLIN) {
            int cfd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
            if (cfd < 0) continue;
            struct ucred cred;
            socklen_t len = sizeof(cred);
            if (n >= MAX_CLIENTS || getsockopt(cfd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.pid <= 0) {
                close(cfd); /* the client falls back to its own PID */
                continue;
            }
            fake_hello h = {{'F', 'A', 'K', 'E', 'D', 'R', 'V', '1'}, cred.pid, 0, fake_start_time(cred.pid)};
            if (send(cfd, &h, sizeof(h), MSG_DONTWAIT | MSG_NOSIGNAL) != (ssize_t)sizeof(h)) {
                close(cfd);
                continue;
            }
            clients[n++] = (client){.fd = cfd, .pid = cred.pid, .start = h.host_start_time, .seg_fd = -1};
        }
    }
    unlinkat(dirfd, FAKE_SOCK_NAME, 0);
    return 0;
}
