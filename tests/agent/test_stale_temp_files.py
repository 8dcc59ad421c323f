"""A node agent SIGKILLed while it wrote a CDI spec leaves the temporary file of `atomic_write` in the
node's CDI directory; the next agent removes it (the agent e2e test saw one after a kill mid-prepare)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from gpuslice.files import atomic_write, remove_stale_temp_files

PREFIX = "gpuslice.io-slice-"


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_killed_writers_temporary_file_is_removed_and_nothing_else(tmp_path: Path) -> None:
    spec = tmp_path / f"{PREFIX}uid-1.json"
    atomic_write(spec, "{}")
    killed = tmp_path / f".{PREFIX}uid-2.json.{dead_pid()}.tmp"
    killed.write_text("{ half")
    live = tmp_path / f".{PREFIX}uid-3.json.{os.getppid()}.tmp"  # a writer that still runs
    live.write_text("{")
    other = tmp_path / f".nvidia.com-gpu.json.{dead_pid()}.tmp"  # not the agent's
    other.write_text("{")
    assert remove_stale_temp_files(tmp_path, PREFIX) == [killed]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([spec.name, live.name, other.name])
