"""Real usage: the shim's usage regions and NVML's per-process view -> GpuSlice status, metrics, events.

Pure decisions (what status.usage says, whether to write it, what counts as a violation) are plain
functions; `UsageReporter` reads the regions and NVML, calls them, and writes:
- `status.usage` of the GpuSlice that owns each prepared claim, by JSON merge patch on the status
  subresource (the operator merge-patches the other status fields, so neither erases the other);
  at most one write per slice per interval, and none when nothing but the reading time changed;
- the per-slice and per-GPU Prometheus series of `gpuslice.metrics`;
- for an out-of-band violation (a process NVML shows holding more GPU memory than any slice on
  its card allows, i.e. it bypassed the shim): an Event on the affected GpuSlices, `violation` in
  their status.usage, `gpuslice_slice_violations_total`, and with `--stop-violators` a SIGKILL.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import signal
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuslice import constants, logs, metrics
from gpuslice.agent.checkpoint import CheckpointStore, ClaimRecord
from gpuslice.agent.kube import Kube
from gpuslice.agent.prepare import NodePaths
from gpuslice.kubehttp import ApiError
from gpuslice.shim.region import (
    REGION_FILE,
    RegionFormatError,
    UsageSnapshot,
    create_utilization_file,
    read_usage,
    utilization_file_for,
    write_utilization,
)

log = logs.get(__name__)
_OVER = metrics.ViolationKind.MEMORY_OVER_SLICE.value


@dataclass(frozen=True)
class GpuProcess:
    """One process NVML lists on a GPU (host pid, as the agent sees it)."""

    gpu_uuid: str
    pid: int
    used_bytes: int


@dataclass(frozen=True)
class SliceOnGpu:
    key: str  # namespace/slice
    gpu_uuid: str
    limit_bytes: int


@dataclass(frozen=True)
class Violation:
    gpu_uuid: str
    pid: int | None
    used_bytes: int
    allowed_bytes: int
    slices: tuple[str, ...]
    kind: str
    message: str


def usage_status(
    snapshot: UsageSnapshot, limit_bytes: int, now: str, violation: str | None = None
) -> dict[str, Any]:
    """`status.usage` of a slice from its usage region."""
    usage: dict[str, Any] = {
        "memoryUsedBytes": snapshot.memory_used_bytes,
        "memoryLimitBytes": snapshot.memory_limit_bytes
        if snapshot.memory_limit_bytes is not None
        else limit_bytes,
        "computeShare": snapshot.compute_share,
        "refusedAllocations": snapshot.refused_allocations_total,
        "throttledSeconds": round(snapshot.throttled_seconds_total, 3),
        "processes": [
            {
                "pid": p.pid,
                "memoryUsedBytes": p.memory_used_bytes,
                "refusedAllocations": p.refused_allocations,
            }
            for p in sorted(snapshot.processes, key=lambda p: p.pid)
        ],
        "time": now,
    }
    if snapshot.shim_utilization_percent is not None:
        usage["computeUtilizationPercent"] = round(snapshot.shim_utilization_percent, 1)
    if violation:
        usage["violation"] = violation
    return usage


def should_write(
    previous: Mapping[str, Any] | None,
    current: Mapping[str, Any],
    last_write: float | None,
    now: float,
    interval: float,
) -> bool:
    """Write when something other than the reading time changed, and not more than once per interval."""

    def strip(u: Mapping[str, Any] | None) -> dict[str, Any] | None:
        return None if u is None else {k: v for k, v in u.items() if k != "time"}

    if strip(previous) == strip(current):
        return False
    return last_write is None or now - last_write >= interval


def find_violations(processes: Iterable[GpuProcess], slices: Iterable[SliceOnGpu]) -> list[Violation]:
    """Processes that hold more GPU memory than the shim could have granted them.

    Container pids differ from host pids, so a process cannot be matched to its slice from NVML
    alone; what is certain is: no process may hold more than the largest slice on its card, and all
    processes on a card together no more than the card's slices together.
    """
    by_gpu: dict[str, list[SliceOnGpu]] = {}
    for s in slices:
        by_gpu.setdefault(s.gpu_uuid, []).append(s)
    procs_by_gpu: dict[str, list[GpuProcess]] = {}
    for p in processes:
        procs_by_gpu.setdefault(p.gpu_uuid, []).append(p)
    found: list[Violation] = []
    for uuid, on_gpu in sorted(by_gpu.items()):
        keys = tuple(sorted(s.key for s in on_gpu))
        largest = max(s.limit_bytes for s in on_gpu)
        total_allowed = sum(s.limit_bytes for s in on_gpu)
        procs = procs_by_gpu.get(uuid, [])
        for p in sorted(procs, key=lambda p: p.pid):
            if p.used_bytes > largest:
                found.append(
                    Violation(
                        uuid, p.pid, p.used_bytes, largest, keys, _OVER,
                        f"process {p.pid} holds {p.used_bytes >> 20} MiB on GPU {uuid}, more than any slice "
                        f"on it allows ({largest >> 20} MiB): it bypassed the gpuslice shim",
                    )
                )  # fmt: skip
        used = sum(p.used_bytes for p in procs)
        if used > total_allowed and not any(v.gpu_uuid == uuid for v in found):
            found.append(
                Violation(
                    uuid, None, used, total_allowed, keys, _OVER,
                    f"processes on GPU {uuid} hold {used >> 20} MiB, more than its slices allow together "
                    f"({total_allowed >> 20} MiB): a process bypassed the gpuslice shim",
                )
            )  # fmt: skip
    return found


def nvml_processes(gpu_uuids: Sequence[str]) -> list[GpuProcess]:
    """Compute processes of the given GPUs through NVML (nvmlInit must have run)."""
    import pynvml

    if not gpu_uuids:
        return []
    pynvml.nvmlInit()  # reference-counted: cheap when discovery's init is still open
    try:
        return _query_processes(pynvml, gpu_uuids)
    finally:
        pynvml.nvmlShutdown()


def _query_processes(pynvml: Any, gpu_uuids: Sequence[str]) -> list[GpuProcess]:
    out: list[GpuProcess] = []
    for uuid in gpu_uuids:
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except pynvml.NVMLError as exc:
            log.warning("NVML process query failed", gpu=uuid, error=str(exc))
            continue
        for p in procs:
            used = p.usedGpuMemory
            if used is None or used == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
                continue
            out.append(GpuProcess(uuid, int(p.pid), int(used)))
    return out


def slice_host_pids(region_file: Path, pids: Iterable[int], proc: Path = Path("/proc")) -> set[int]:
    """Those of `pids` (host PIDs, as NVML lists them) that have the slice's usage region mapped.

    Every process of a slice maps its region (the shim does on its first CUDA call), whatever PID
    namespace it lives in; /proc/<pid>/maps names the mapped file by device and inode, which a bind
    mount keeps. The PIDs the region itself records are the processes' own and mean nothing here.
    """
    st = os.stat(region_file)
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


@dataclass
class UtilizationMeter:
    """Measures one GPU's per-process utilization through NVML (host PIDs), sample by sample."""

    gpu_uuid: str
    last_seen_us: int = 0

    def samples(self) -> list[tuple[int, float]] | None:
        """New (pid, smUtil) samples since the last call; None when NVML has nothing new."""
        import pynvml

        handle = pynvml.nvmlDeviceGetHandleByUUID(self.gpu_uuid)
        if self.last_seen_us == 0:  # the first call would return the whole history
            self.last_seen_us = int(time.time() * 1e6) - 500_000
        try:
            raw = pynvml.nvmlDeviceGetProcessUtilization(handle, self.last_seen_us)
        except pynvml.NVMLError_NotFound:
            return None
        if not raw:
            return None
        self.last_seen_us = max(self.last_seen_us, *(int(r.timeStamp) for r in raw))
        return [(int(r.pid), float(r.smUtil)) for r in raw]


def write_slice_utilization(
    meter: UtilizationMeter, region_file: Path, utilization_file: Path
) -> float | None:
    """One measurement of a slice's utilization written for its shims; None when there was no news.

    The figure reaches the shim's throttle through a file mounted read-only into the containers
    (tenants can read it, never write it), because only the agent sees host PIDs.
    """
    samples = meter.samples()
    if samples is None:
        return None
    pids = slice_host_pids(region_file, {pid for pid, _ in samples})
    percent = slice_utilization(samples, pids)
    write_utilization(utilization_file, percent)
    return percent


@dataclass
class _SliceState:
    key: str | None  # namespace/slice when the claim belongs to a (non-template) GpuSlice
    #: the slice's series labels (metrics.SLICE_LABELS order); fixed for the claim's life
    labels: tuple[str, ...]
    last_usage: dict[str, Any] | None = None
    last_write: float | None = None
    violation: str | None = None


def _report_key(record: ClaimRecord, state: _SliceState) -> str:
    """namespace/name a claim is reported under: its GpuSlice, or the claim itself (template form)."""
    return state.key or f"{record.namespace}/{record.name}"


@dataclass
class UsageReporter:
    node: str
    paths: NodePaths
    kube: Kube
    interval: float = 10.0
    stop_violators: bool = False
    _states: dict[str, _SliceState] = field(default_factory=dict)
    # The region holds running totals; these turn them into counter increments.
    _refused: metrics.CounterFromTotal = field(
        default_factory=lambda: metrics.CounterFromTotal(metrics.SLICE_REFUSED_ALLOCATIONS)
    )
    _throttled: metrics.CounterFromTotal = field(
        default_factory=lambda: metrics.CounterFromTotal(metrics.SLICE_THROTTLED)
    )

    async def _owner(self, record: ClaimRecord) -> _SliceState:
        """Which GpuSlice a claim belongs to (its owner reference), looked up once per claim."""
        state = self._states.get(record.uid)
        if state is not None:
            return state
        key: str | None = None
        package = ""
        try:
            claim = await self.kube.get_claim(record.namespace, record.name)
            meta = claim.get("metadata", {})
            package = meta.get("labels", {}).get(constants.LABEL_PACKAGE, "")
            for ref in meta.get("ownerReferences") or []:
                if ref.get("kind") == constants.SLICE_KIND and ref.get("apiVersion", "").startswith(
                    constants.API_GROUP
                ):
                    key = f"{record.namespace}/{ref['name']}"
        except ApiError as exc:
            if exc.status != 404:
                raise
        name = key.split("/", 1)[1] if key else record.name
        labels = metrics.slice_labels(record.namespace, name, package, self.node, record.devices[0].gpu_uuid)
        state = _SliceState(key=key, labels=labels)
        self._states[record.uid] = state
        return state

    async def tick(self) -> None:
        checkpoint = CheckpointStore(self.paths.state_dir / "checkpoint.json").load()
        records = [r for r in checkpoint.claims.values() if r.state == "Prepared" and r.devices]
        now_s = time.monotonic()
        now_iso = dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")
        slices_on_gpu: list[SliceOnGpu] = []
        for record in records:
            state = await self._owner(record)
            dev = record.devices[0]
            slices_on_gpu.append(SliceOnGpu(_report_key(record, state), dev.gpu_uuid, dev.memory_bytes))
        violations = find_violations(
            nvml_processes(sorted({s.gpu_uuid for s in slices_on_gpu})), slices_on_gpu
        )
        await self._handle_violations(records, violations)
        for record in records:
            state = self._states[record.uid]
            try:
                snapshot = read_usage(self.paths.usage_dir(record.uid))
            except (OSError, RegionFormatError) as exc:
                log.warning("usage region unreadable", claim=record.name, error=str(exc))
                continue
            labels = state.labels
            limit = record.devices[0].memory_bytes
            metrics.SLICE_MEMORY_USED.labels(*labels).set(snapshot.memory_used_bytes)
            metrics.SLICE_MEMORY_LIMIT.labels(*labels).set(limit)
            if snapshot.shim_utilization_percent is not None:
                metrics.SLICE_COMPUTE_UTILIZATION.labels(*labels).set(snapshot.shim_utilization_percent / 100)
            self._refused.update(labels, snapshot.refused_allocations_total)
            self._throttled.update(labels, snapshot.throttled_seconds_total)
            if state.key is None:
                continue  # template claims: metrics only (several nodes may serve one GpuSlice)
            usage = usage_status(snapshot, limit, now_iso, state.violation)
            if should_write(state.last_usage, usage, state.last_write, now_s, self.interval):
                await self._write_usage(state.key, usage)
                state.last_usage, state.last_write = usage, now_s
        self._forget_unprepared({r.uid for r in checkpoint.claims.values()})

    def _forget_unprepared(self, uids: set[str]) -> None:
        """Unprepared claims: drop their state and their series (dashboards must not keep them)."""
        for uid in list(self._states):
            if uid not in uids:
                metrics.forget_slice(self._states.pop(uid).labels, self._refused, self._throttled)

    async def _write_usage(self, key: str, usage: dict[str, Any]) -> None:
        namespace, name = key.split("/", 1)
        try:
            # A merge patch leaves the operator's status fields alone.
            await self.kube.patch_slice_status(namespace, name, {"usage": usage})
        except ApiError as exc:
            if exc.status != 404:  # the slice is being deleted: nothing to report
                log.warning("could not write usage", slice=key, status=exc.status, reason=exc.reason)

    async def _handle_violations(
        self, records: Sequence[ClaimRecord], violations: Sequence[Violation]
    ) -> None:
        flagged: dict[str, str] = {}
        for v in violations:
            for key in v.slices:
                flagged[key] = v.message
            log.error("slice memory violation", gpu=v.gpu_uuid, pid=v.pid, message=v.message)
            if self.stop_violators and v.pid is not None:
                try:
                    os.kill(v.pid, signal.SIGKILL)
                    log.warning("stopped violating process", pid=v.pid, gpu=v.gpu_uuid)
                except ProcessLookupError:
                    pass
        for record in records:
            state = self._states[record.uid]
            message = flagged.get(_report_key(record, state))
            if message and message != state.violation:
                metrics.SLICE_VIOLATIONS.labels(*state.labels, _OVER).inc()
                if state.key:
                    await self._event(state.key, message)
            state.violation = message

    async def _event(self, key: str, message: str) -> None:
        namespace, name = key.split("/", 1)
        now = dt.datetime.now(dt.UTC)
        stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "metadata": {"generateName": f"{name}.", "namespace": namespace},
            "involvedObject": {
                "apiVersion": constants.GROUP_VERSION, "kind": constants.SLICE_KIND,
                "name": name, "namespace": namespace,
            },
            "reason": "SliceMemoryViolation",
            "message": message,
            "type": "Warning",
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
            "source": {"component": "gpuslice-agent", "host": self.node},
        }  # fmt: skip
        try:
            await self.kube.create_event(namespace, body)
        except ApiError as exc:
            log.warning("could not record event", slice=key, status=exc.status)

    async def _utilization_loop(self, interval: float = 0.5) -> None:
        """Every half second: each prepared slice's measured utilization into its utilization file.

        Faster than status reporting because the shims' throttles steer on it (they ignore a figure
        older than 3 s).
        """
        meters: dict[str, UtilizationMeter] = {}
        while True:
            try:
                await asyncio.to_thread(self._write_utilizations, meters)
            except Exception:
                log.exception("utilization measurement failed; retrying")
            await asyncio.sleep(interval)

    def _write_utilizations(self, meters: dict[str, UtilizationMeter]) -> None:
        import pynvml

        checkpoint = CheckpointStore(self.paths.state_dir / "checkpoint.json").load()
        records = [r for r in checkpoint.claims.values() if r.state == "Prepared" and r.devices]
        if not records:
            return
        pynvml.nvmlInit()  # reference-counted
        try:
            for record in records:
                region = self.paths.usage_dir(record.uid) / REGION_FILE
                if not region.exists():
                    continue  # no process of the slice has touched CUDA yet
                meter = meters.setdefault(record.uid, UtilizationMeter(record.devices[0].gpu_uuid))
                target = create_utilization_file(
                    utilization_file_for(self.paths.claim_dir(record.uid) / "slice.conf")
                )
                write_slice_utilization(meter, region, target)
        finally:
            pynvml.nvmlShutdown()
        for uid in set(meters) - {r.uid for r in records}:
            del meters[uid]

    async def run(self) -> None:
        utilization = asyncio.create_task(self._utilization_loop())
        try:
            await self._report_loop()
        finally:
            utilization.cancel()

    async def _report_loop(self) -> None:
        while True:
            try:
                await self.tick()
            except ApiError as exc:
                log.warning(
                    "usage report failed; retrying next interval", status=exc.status, reason=exc.reason
                )
            except Exception:
                # Reporting is auxiliary: a bad reading must not take the node's plugin down with it.
                log.exception("usage report failed; retrying next interval")
            await asyncio.sleep(self.interval)
