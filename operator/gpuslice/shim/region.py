"""Read the shim's per-slice usage region (<usage_dir>/usage.bin) and write the agent's utilization.

Layout: shim/src/gs_region.h and shim/README.md ("Usage region"). Reading takes no lock: every field
is a naturally aligned 64-bit word the shim updates atomically. A process is live while it holds the
OFD lock on the first byte of its entry, which the kernel drops when it dies, however it dies.
"""

from __future__ import annotations

import fcntl
import mmap
import os
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


def read_usage(usage_dir: Path | str) -> UsageSnapshot:
    """Snapshot of the slice's usage. An absent or empty region (no GPU use yet) reads as unused."""
    path = Path(usage_dir) / REGION_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return _unused()
    try:
        data = os.pread(fd, HEADER_SIZE + MAX_ENTRIES * ENTRY_SIZE, 0)
        if len(data) == 0:
            # created by the agent, not laid out yet: no process of the slice has used the GPU
            return _unused()
        header = _HEADER.unpack_from(data, 0)
        magic, version, header_size, entry_size, max_entries, limit, share = header[:7]
        refused, throttled_ns, _agent, shim_util, delay, recoveries = header[8:]
        if (magic, version, header_size, entry_size) != (MAGIC, VERSION, HEADER_SIZE, ENTRY_SIZE):
            raise RegionFormatError(
                f"{path} is not a version-{VERSION} gpuslice usage region "
                f"(magic {magic!r}, version {version})"
            )
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
UTILIZATION_SIZE = 16  # magic, then one u64: (unix_ms << 16) | basis points; 0 = none yet


def create_usage_region(usage_dir: Path | str) -> Path:
    """Create (or keep) the slice's usage region for containers running as any uid.

    The directory is the agent's (mode 0755): a tenant cannot remove, rename or add entries in it (no
    FIFO, symlink or other file in place of the region). The region file is created empty with mode
    0666, so the shim of every process of the slice maps it read-write whatever its uid and group;
    the first one to open it lays it out. Kept, never replaced: containers may be using it.
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
        if os.fstat(fd).st_size < UTILIZATION_SIZE or os.pread(fd, 8, 0) != UTILIZATION_MAGIC:
            os.pwrite(fd, UTILIZATION_MAGIC + bytes(8), 0)
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
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        if os.fstat(fd).st_size < UTILIZATION_SIZE:
            return False
        word = (int((time.time() if now is None else now) * 1000) << 16) | round(percent * 100)
        mem = mmap.mmap(fd, UTILIZATION_SIZE)
        try:
            if mem[:8] != UTILIZATION_MAGIC:
                return False
            # A "Q" view writes the word in a single access.
            with memoryview(mem) as raw, raw.cast("Q") as words:
                words[1] = word
        finally:
            mem.close()
    finally:
        os.close(fd)
    return True
