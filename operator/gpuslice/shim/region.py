"""Read the shim's per-slice usage region (<usage_dir>/usage.bin) and write the agent's utilization.

Layout: shim/src/gs_region.h and shim/README.md ("Usage region"). Reading takes no lock: every field
is a naturally aligned 64-bit word the shim updates atomically. A process is live while it holds the
OFD lock on the first byte of its entry, which the kernel drops when it dies, however it dies.

The region is the tenant's to write (every process of the slice maps it read-write), and so may be
whatever a tenant put in its place. The agent, which runs as root on the host, reads it as such: the
file is looked at through an O_PATH descriptor first (opening nothing: no FIFO to block on, no device
whose open has side effects, no symbolic link followed out of the slice's directory), read only when it
is a regular file, and never more than the region's size, whatever size it claims.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
import struct
import time
from pathlib import Path

from pydantic import BaseModel

from gpuslice.shim.software import SoftwareState, parse_software

REGION_FILE = "usage.bin"
MAGIC = b"GPUSLICE"
VERSION = 1
HEADER_SIZE = 4096
ENTRY_SIZE = 128
MAX_ENTRIES = 1024
UNLIMITED = 2**64 - 1
REGION_SIZE = HEADER_SIZE + MAX_ENTRIES * ENTRY_SIZE
OFFSET_AGENT_UTILIZATION = 56

_HEADER = struct.Struct("<8sIIIIQII6Q")  # through lock_recoveries_total (offset 88)
_ENTRY = struct.Struct("<IiQ7Q")  # state, pid, start_time, used, avail, quota, peak, refused, throttled, ctx
_FLOCK = struct.Struct("hhxxxxqqixxxx")  # struct flock on Linux x86_64/aarch64


class RegionFormatError(ValueError):
    pass


class ProcessUsage(BaseModel):
    pid: int
    #: clock ticks since boot (/proc/<pid>/stat field 22); with pid, identifies the process
    start_time: int
    memory_used_bytes: int
    #: bytes the slice granted this process (used + not yet allocated)
    memory_granted_bytes: int
    memory_peak_bytes: int
    context_overhead_bytes: int
    refused_allocations: int
    throttled_seconds: float


class UsageSnapshot(BaseModel):
    #: False when no process of the slice has touched the GPU yet (no region file)
    initialized: bool
    version: int
    #: None: no memory limit configured
    memory_limit_bytes: int | None
    memory_used_bytes: int
    compute_share: int
    processes: list[ProcessUsage]
    refused_allocations_total: int
    throttled_seconds_total: float
    #: last utilization the shim measured (percent) and when (unix seconds), if any
    shim_utilization_percent: float | None
    shim_utilization_time: float | None
    #: current sleep before each kernel launch, nanoseconds
    throttle_delay_ns: int
    #: times a process died holding the region lock and the next one recovered it
    lock_recoveries_total: int
    #: what the slice's software could not do on the GPU, and when the GPU was first used
    software: SoftwareState = SoftwareState(record=None, compatible_time=None, first_use_time=None)


def _decode_utilization(word: int) -> tuple[float | None, float | None]:
    if word == 0:
        return None, None
    return (word & 0xFFFF) / 100.0, (word >> 16) / 1000.0


def _entry_alive(fd: int, index: int) -> bool:
    request = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, HEADER_SIZE + index * ENTRY_SIZE, 1, 0)
    result = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, request)
    return bool(_FLOCK.unpack(result)[0] != fcntl.F_UNLCK)


def _unused() -> UsageSnapshot:
    return UsageSnapshot(
        initialized=False,
        version=VERSION,
        memory_limit_bytes=None,
        memory_used_bytes=0,
        compute_share=100,
        processes=[],
        refused_allocations_total=0,
        throttled_seconds_total=0.0,
        shim_utilization_percent=None,
        shim_utilization_time=None,
        throttle_delay_ns=0,
        lock_recoveries_total=0,
    )


def open_region(usage_dir: Path | str, flags: int = os.O_RDONLY) -> tuple[int, os.stat_result] | None:
    """(descriptor, stat) of the slice's usage region, opened only if it is a plain regular file of
    the slice's own directory; None when there is none (no process of the slice used the GPU yet).

    RegionFormatError when something else stands in its place (a FIFO, a device, a symbolic link, a
    directory, a file linked from elsewhere): the caller reports it and reads nothing.
    """
    path = Path(usage_dir) / REGION_FILE
    try:
        dfd = os.open(usage_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except NotADirectoryError as exc:
        raise RegionFormatError(f"{usage_dir} is not the slice's usage directory: not read") from exc
    try:
        # O_PATH opens nothing (a FIFO does not block, a device's open never runs); with O_NOFOLLOW it
        # names a symbolic link itself rather than its target.
        pfd = os.open(REGION_FILE, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        return None
    finally:
        os.close(dfd)
    try:
        st = os.fstat(pfd)
        if not stat.S_ISREG(st.st_mode):
            kind = (
                "a symbolic link"
                if stat.S_ISLNK(st.st_mode)
                else "a FIFO"
                if stat.S_ISFIFO(st.st_mode)
                else "not a regular file"
            )
            raise RegionFormatError(f"{path} is {kind}, not a usage region: not read (a tenant put it there)")
        if st.st_nlink != 1:
            raise RegionFormatError(
                f"{path} has {st.st_nlink} links, not a usage region of its own: not read"
            )
        # The same inode, opened for real through the O_PATH descriptor: no second lookup to race.
        fd = os.open(f"/proc/self/fd/{pfd}", flags | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    finally:
        os.close(pfd)
    return fd, st


def trim_region(usage_dir: Path | str) -> int:
    """Cut a region a tenant made longer than the layout back to its size; the bytes cut (0: none).

    The region file must stay writable by the slice's processes, and a writable file can grow: what
    a tenant appends would be host storage outside its pod's ephemeral-storage limit. The shim maps
    only the first REGION_SIZE bytes, so what lies past them is nobody's.
    """
    try:
        opened = open_region(usage_dir, os.O_WRONLY)
    except (OSError, RegionFormatError):
        return 0  # not a region: read_usage says so
    if opened is None:
        return 0
    fd, st = opened
    try:
        if st.st_size <= REGION_SIZE:
            return 0
        os.ftruncate(fd, REGION_SIZE)
        return st.st_size - REGION_SIZE
    finally:
        os.close(fd)


def read_usage(usage_dir: Path | str) -> UsageSnapshot:
    """Snapshot of the slice's usage. An absent or empty region (no GPU use yet) reads as unused."""
    path = Path(usage_dir) / REGION_FILE
    try:
        opened = open_region(usage_dir)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RegionFormatError(f"{path}: a symbolic link in its path: not read") from exc
        raise
    if opened is None:
        return _unused()
    fd, _ = opened
    try:
        # Never more than the layout, whatever size the file has grown to.
        data = os.pread(fd, REGION_SIZE, 0)
        if len(data) == 0:
            return _unused()  # created, not laid out yet: no process of the slice has used the GPU
        header = _HEADER.unpack_from(data.ljust(_HEADER.size, b"\0"), 0)
        magic, version, header_size, entry_size, max_entries, limit, share = header[:7]
        refused, throttled_ns, _agent, shim_util, delay, recoveries = header[8:]
        if (magic, version, header_size, entry_size) != (MAGIC, VERSION, HEADER_SIZE, ENTRY_SIZE):
            raise RegionFormatError(
                f"{path} is not a version-{VERSION} gpuslice usage region "
                f"(magic {magic!r}, version {version})"
            )
        if len(data) < REGION_SIZE:
            raise RegionFormatError(f"{path} is {len(data)} bytes, shorter than a usage region: not read")
        processes = []
        for i in range(min(max_entries, MAX_ENTRIES)):
            off = HEADER_SIZE + i * ENTRY_SIZE
            state, pid, start, used, avail, quota, peak, e_refused, e_throttled, ctx = _ENTRY.unpack_from(
                data, off
            )
            del avail
            if state != 1 or not _entry_alive(fd, i):
                continue
            processes.append(
                ProcessUsage(
                    pid=pid, start_time=start, memory_used_bytes=used, memory_granted_bytes=quota,
                    memory_peak_bytes=peak, context_overhead_bytes=ctx, refused_allocations=e_refused,
                    throttled_seconds=e_throttled / 1e9,
                )
            )  # fmt: skip
    finally:
        os.close(fd)
    util, util_time = _decode_utilization(shim_util)
    return UsageSnapshot(
        initialized=True,
        version=version,
        memory_limit_bytes=None if limit == UNLIMITED else limit,
        memory_used_bytes=sum(p.memory_used_bytes for p in processes),
        compute_share=share,
        processes=processes,
        refused_allocations_total=refused,
        throttled_seconds_total=throttled_ns / 1e9,
        shim_utilization_percent=util,
        shim_utilization_time=util_time,
        throttle_delay_ns=delay,
        lock_recoveries_total=recoveries,
        software=parse_software(data),
    )


#: The agent's utilization figure lives next to the limits file (the shim derives the path the same
#: way: the directory of its config path + this name). In a container both are mounted read-only, so
#: a tenant can read it and never write it (the usage region, which tenants write, is not trusted).
UTILIZATION_FILE = "utilization"
UTILIZATION_MAGIC = b"GSUTIL01"
# magic, then two u64s of (unix_ms << 16) | basis points, 0 = none yet: the slice's measured
# utilization, and the share it may use now (a burst slice's allowance; 0 = its configured share)
UTILIZATION_SIZE = 24
_UTILIZATION_V1_SIZE = 16  # the utilization word alone: an older agent's file, still read


def create_usage_region(usage_dir: Path | str) -> Path:
    """Create (or keep) the slice's usage region: an empty file of mode 0666 in a directory of the
    agent's, which the shim of every process of the slice maps read-write whatever its uid (the first
    one lays it out). Containers get the file alone (a bind mount of it), never the directory: the
    tenant cannot replace it (by a FIFO or a link) or put other files beside it on the host. Kept,
    never replaced: containers may be using it.
    """
    usage = Path(usage_dir)
    usage.mkdir(parents=True, exist_ok=True)
    os.chmod(usage, 0o755)  # whatever the umask was
    path = usage / REGION_FILE
    fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        os.fchmod(fd, 0o666)
    finally:
        os.close(fd)
    return path


def utilization_file_for(limits_file: Path | str) -> Path:
    return Path(limits_file).parent / UTILIZATION_FILE


def create_utilization_file(path: Path | str) -> Path:
    """Create (or keep) the slice's utilization file; it must exist before a container mounts it.

    Kept, never replaced: a bind mount pins the inode, so every later update is written in place.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size < _UTILIZATION_V1_SIZE or os.pread(fd, 8, 0) != UTILIZATION_MAGIC:
            os.pwrite(fd, UTILIZATION_MAGIC + bytes(16), 0)
            os.fsync(fd)
        elif size < UTILIZATION_SIZE:  # an older agent's file: grown in place (mounts pin the inode)
            os.pwrite(fd, bytes(UTILIZATION_SIZE - size), size)
            os.fsync(fd)
    finally:
        os.close(fd)
    return path


def write_utilization(path: Path | str, percent: float, now: float | None = None) -> bool:
    """Tell the slice's shims its measured utilization (percent of the GPU, 0..100).

    `path` is the slice's utilization file (`create_utilization_file`). The shim's throttle uses this
    figure while it is at most 3 s old (write it several times a second). One aligned 8-byte store
    of (unix_ms << 16) | basis points, so a reader never sees half an update. Returns False when the
    file does not exist or is not a utilization file.
    """
    if not 0 <= percent <= 100:
        raise ValueError(f"utilization must be within 0..100 percent, got {percent}")
    return _write_word(path, 1, percent, now)


def write_allowance(path: Path | str, percent: float, now: float | None = None) -> bool:
    """Tell a burst slice's shims the share of the GPU they may use now (percent, 1..100).

    The shim steers to it while it is at most 3 s old, else to the configured share: a stopped agent
    drops every burst slice back to its share within 3 s.
    """
    if not 1 <= percent <= 100:
        raise ValueError(f"allowance must be within 1..100 percent, got {percent}")
    return _write_word(path, 2, percent, now)


def _write_word(path: Path | str, index: int, percent: float, now: float | None) -> bool:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        if os.fstat(fd).st_size < 8 * (index + 1):
            return False
        word = (int((time.time() if now is None else now) * 1000) << 16) | round(percent * 100)
        mem = mmap.mmap(fd, 8 * (index + 1))
        try:
            if mem[:8] != UTILIZATION_MAGIC:
                return False
            # A "Q" view writes the word in a single access.
            with memoryview(mem) as raw, raw.cast("Q") as words:
                words[index] = word
        finally:
            mem.close()
    finally:
        os.close(fd)
    return True
