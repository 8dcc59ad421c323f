"""The utilization feedback loop of the shims' throttles: every half second, each prepared slice's
measured GPU utilization (NVML's per-process samples, host PIDs) into the slice's utilization file.

The figure reaches the shim through a file mounted read-only into the containers (tenants can read
it, never write it), because only the agent sees host PIDs. It runs faster than status reporting
because the throttles steer on it (they ignore a figure older than 3 s).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from gpuslice import logs
from gpuslice.agent import nvml
from gpuslice.agent.checkpoint import CheckpointStore, ClaimRecord
from gpuslice.agent.prepare import NodePaths
from gpuslice.domain import burst
from gpuslice.shim.region import (
    REGION_FILE,
    RegionFormatError,
    create_utilization_file,
    open_region,
    utilization_file_for,
    write_allowance,
    write_utilization,
)

log = logs.get(__name__)


def slice_host_pids(region_file: Path, pids: Iterable[int], proc: Path = Path("/proc")) -> set[int]:
    """Those of `pids` (host PIDs, as NVML lists them) that have the slice's usage region mapped.

    Every process of a slice maps its region (the shim does on its first CUDA call), whatever PID
    namespace it lives in; /proc/<pid>/maps names the mapped file by device and inode, which a bind
    mount keeps. The PIDs the region itself records are the processes' own and mean nothing here.
    """
    opened = open_region(region_file.parent)  # the tenant's file: never followed, never blocked on
    if opened is None:
        return set()
    fd, st = opened
    os.close(fd)
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    found: set[int] = set()
    for pid in pids:
        try:
            with open(proc / str(pid) / "maps") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)
                    if len(fields) >= 5 and fields[4] == str(st.st_ino) and fields[3] == want:
                        found.add(pid)
                        break
        except OSError:  # gone, or not ours to read
            continue
    return found


def slice_utilization(samples: Iterable[tuple[int, float]], pids: set[int]) -> float:
    """Percent of the GPU the slice's processes used: each process's mean SM utilization, summed."""
    per_pid: dict[int, list[float]] = {}
    for pid, util in samples:
        if pid in pids:
            per_pid.setdefault(pid, []).append(util)
    return min(100.0, sum(sum(v) / len(v) for v in per_pid.values()))


def write_slice_utilization(
    meter: nvml.UtilizationMeter, region_file: Path, utilization_file: Path
) -> float | None:
    """One measurement of a slice's utilization written for its shims; None when there was no news."""
    samples = meter.samples()
    if samples is None:
        return None
    pids = slice_host_pids(region_file, {pid for pid, _ in samples})
    percent = slice_utilization(samples, pids)
    write_utilization(utilization_file, percent)
    return percent


@dataclass
class UtilizationFeedback:
    paths: NodePaths
    interval: float = 0.5
    _meters: dict[str, nvml.UtilizationMeter] = field(default_factory=dict)
    _last: dict[str, float] = field(default_factory=dict)  # the latest figure per claim

    async def run(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.step)
            except Exception:
                log.exception("utilization measurement failed; retrying")
            await asyncio.sleep(self.interval)

    def step(self) -> None:
        """One measurement of every prepared slice (blocking: NVML and file I/O)."""
        checkpoint = CheckpointStore(self.paths.state_dir / "checkpoint.json").load()
        records = [r for r in checkpoint.claims.values() if r.state == "Prepared" and r.devices]
        if not records:
            return
        with nvml.session():
            for record in records:
                region = self.paths.usage_dir(record.uid) / REGION_FILE
                if not region.exists():
                    continue  # no process of the slice has touched CUDA yet
                meter = self._meters.setdefault(record.uid, nvml.UtilizationMeter(record.devices[0].gpu_uuid))
                target = create_utilization_file(
                    utilization_file_for(self.paths.claim_dir(record.uid) / "slice.conf")
                )
                try:
                    percent = write_slice_utilization(meter, region, target)
                    if percent is not None:
                        self._last[record.uid] = percent
                except nvml.Error as exc:  # this card failed (agent.health says so); the others go on
                    log.debug("no utilization for the slice's card", claim=record.uid, error=str(exc))
                except (OSError, RegionFormatError) as exc:  # the usage reporter says what is wrong
                    log.debug("no utilization for the slice", claim=record.uid, error=str(exc))
        self._write_allowances(records)
        for uid in set(self._meters) - {r.uid for r in records}:
            del self._meters[uid]
        for uid in set(self._last) - {r.uid for r in records}:
            del self._last[uid]

    def _write_allowances(self, records: list[ClaimRecord]) -> None:
        """Each burst slice's allowance, decided per card from every slice's latest figure."""
        cards: dict[str, list[burst.SliceLoad]] = {}
        files: dict[str, Path] = {}
        for r in records:
            device = r.devices[0]
            cards.setdefault(device.gpu_uuid, []).append(
                burst.SliceLoad(r.uid, device.compute_share, device.compute_burst, self._last.get(r.uid))
            )
            files[r.uid] = utilization_file_for(self.paths.claim_dir(r.uid) / "slice.conf")
        for card in cards.values():
            for uid, percent in burst.allowances(card).items():
                try:
                    write_allowance(files[uid], percent)
                except OSError as exc:
                    log.debug("no allowance for the slice", claim=uid, error=str(exc))
