"""One way to replace a file atomically, for every file gpuslice writes that a reader may open at any time."""

from __future__ import annotations

import glob
import os
from pathlib import Path


def atomic_write(path: Path, data: bytes | str, mode: int = 0o644) -> None:
    """Replace `path` with `data`: readers see the old file or the new one, never a part, and after a
    crash (power loss included) one of the two is on disk. Writes a temporary file next to it (named
    for this process, so two writers never share one), fsyncs it, sets `mode`, renames it over `path`
    and fsyncs the directory so the rename itself is durable."""
    payload = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)  # a read-only leftover of a killed writer with this pid
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def remove_stale_temp_files(directory: Path, prefix: str) -> list[Path]:
    """Delete the temporary files `atomic_write` left in `directory` for files named `prefix`*, when
    the process that wrote them is gone (it was killed between writing and renaming). A live writer's
    file is kept. Returns what was deleted."""
    removed = []
    for tmp in directory.glob(f".{glob.escape(prefix)}*.tmp"):
        pid = tmp.name.rsplit(".", 2)[-2]
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed
