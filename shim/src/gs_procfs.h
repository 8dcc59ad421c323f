/*
 * A process's start time from /proc/<pid>/stat (field 22, clock ticks since boot): with the pid, what
 * identifies a process across pid reuse. One reader for the shim and the driver double.
 */
#ifndef GS_PROCFS_H
#define GS_PROCFS_H

#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

/* 0 if unknown (no such process, or /proc unreadable). */
static inline uint64_t gs_proc_start_time(int pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof(path), "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = '\0';
    /* The command name may contain spaces and parentheses: field 3 starts after the last ") ". */
    char *p = strrchr(buf, ')');
    if (p == NULL) return 0;
    p++;
    for (int field = 3; field < 22 && p != NULL; field++) p = strchr(p + 1, ' ');
    unsigned long long v = 0;
    if (p == NULL || sscanf(p + 1, "%llu", &v) != 1) return 0;
    return (uint64_t)v;
}

#endif
