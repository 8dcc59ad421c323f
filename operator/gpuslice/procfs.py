"""`/proc/<pid>/stat`, read once: the fields gpuslice uses to tell one process from a later one with
the same pid (start time) and a live process from a zombie (state)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProcStat:
    pid: int
    #: Field 3: R, S, D, Z (zombie), T, ...
    state: str
    #: Field 22: clock ticks after boot at which the process started.
    start_time: int

    @property
    def zombie(self) -> bool:
        return self.state == "Z"


def parse_stat(pid: int, text: str) -> ProcStat:
    # Fields are counted after the parenthesised command name, which may itself hold spaces and ")".
    fields = text.rsplit(")", 1)[1].split()
    return ProcStat(pid=pid, state=fields[0], start_time=int(fields[19]))


def read_stat(pid: int, proc: Path = Path("/proc")) -> ProcStat | None:
    """None when there is no such process (any more)."""
    try:
        return parse_stat(pid, (proc / str(pid) / "stat").read_text())
    except (OSError, IndexError, ValueError):
        return None


def start_time(pid: int) -> int | None:
    stat = read_stat(pid)
    return stat.start_time if stat else None


def alive(pid: int) -> bool:
    """Exists and is not a zombie."""
    stat = read_stat(pid)
    return stat is not None and not stat.zombie
