/*
 * gpuslice-fake-driverd: the host-side part of the NVIDIA driver test double, playing the kernel
 * module. Started on the host as `gpuslice-fake-driverd --config <fake-gpus.conf>`, it serves
 * "<config>.state/driver.sock". Every process that loads the double's libcuda / libnvidia-ml connects
 * once and keeps the connection open (like an open /dev/nvidiactl). The daemon
 *   - learns the client's PID with SO_PEERCRED, which the kernel translates into the daemon's PID
 *     namespace (the host PID of a process in a container), and tells the client (fake_hello);
 *   - frees the process's memory in the shared state when its last connection closes, however the
 *     process ended (exit, SIGKILL, exec), as the driver does when the process's file descriptors go.
 * NVML therefore reports host PIDs, whatever PID namespace the caller lives in.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "fake_common.h"

#define MAX_CLIENTS 4096

typedef struct {
    int fd;
    int32_t pid;
    uint64_t start;
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
    int lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
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
    while (!stop) {
        pfd[0] = (struct pollfd){.fd = lfd, .events = POLLIN};
        for (int i = 0; i < n; i++) pfd[i + 1] = (struct pollfd){.fd = clients[i].fd, .events = POLLIN};
        if (poll(pfd, (nfds_t)n + 1, -1) < 0) {
            if (errno == EINTR) continue;
            break;
        }
        for (int i = n - 1; i >= 0; i--) {
            if (!(pfd[i + 1].revents & (POLLIN | POLLHUP | POLLERR))) continue;
            char buf[256];
            ssize_t r = read(clients[i].fd, buf, sizeof(buf));
            if (r > 0 || (r < 0 && errno == EINTR)) continue; /* clients send nothing; ignore it */
            client gone = clients[i];
            close(gone.fd);
            clients[i] = clients[--n];
            int still = 0; /* libcuda and libnvidia-ml each hold a connection: free after the last */
            for (int k = 0; k < n; k++) still |= clients[k].pid == gone.pid && clients[k].start == gone.start;
            if (!still) fake_release_process(s, gone.pid, gone.start);
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
            if (write(cfd, &h, sizeof(h)) != (ssize_t)sizeof(h)) {
                close(cfd);
                continue;
            }
            clients[n++] = (client){cfd, cred.pid, h.host_start_time};
        }
    }
    unlinkat(dirfd, FAKE_SOCK_NAME, 0);
    return 0;
}
