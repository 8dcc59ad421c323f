"""Real usage: the shim's usage regions and NVML's per-process view -> GpuSlice status, metrics, events.

Pure decisions (what status.usage says, whether to write it, what counts as a violation) are plain
functions; `UsageReporter` reads the regions and NVML, calls them, and writes:
- `status.usage` of the GpuSlice that owns each prepared claim, by a JSON patch of that one key on
  the status subresource (the operator merge-patches the other status fields, so neither erases the
  other), which first tests the slice's uid: a GpuSlice re-created under the name of the claim's
  deleted owner never gets its predecessor's usage; at most one write per slice per interval, none
  when nothing but the reading time changed, and a refused write is tried again the next interval;
- the per-slice and per-GPU Prometheus series of `gpuslice.metrics`;
- for an out-of-band violation, found by `agent.attribution` (each GPU process attributed from the
  host to its pod and slice, and judged against that slice by `domain.gpu_processes`): an Event on
  the affected GpuSlices, `violation` in their status.usage, `gpuslice_slice_violations_total`,
  and under the package's `spec.isolation.onViolation: Stop` a SIGKILL of the slice's processes.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuslice import constants, logs, metrics
from gpuslice.agent import attribution
from gpuslice.agent.checkpoint import CheckpointStore, ClaimRecord
from gpuslice.agent.kube import Kube
from gpuslice.agent.prepare import NodePaths
from gpuslice.api.package import OnViolation
from gpuslice.domain.gpu_processes import Finding, GpuProcess, SliceClaim
from gpuslice.domain.ownership import slice_owner
from gpuslice.domain.pod_slices import pod_owner_uid, scheduler_claim_pod
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


def usage_patch(owner_uid: str, usage: Mapping[str, Any]) -> list[dict[str, Any]]:
    """JSON patch of the status subresource that sets `status.usage` of the GpuSlice with uid
    `owner_uid`, and of no other GpuSlice of that name: the test fails (422) once it was replaced."""
    return [
        {"op": "test", "path": "/metadata/uid", "value": owner_uid},
        {"op": "add", "path": "/status/usage", "value": dict(usage)},
    ]


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
    owner_uid: str | None  # that GpuSlice's uid (the claim's owner reference)
    #: the slice's series labels (metrics.SLICE_LABELS order); fixed for the claim's life
    labels: tuple[str, ...]
    last_usage: dict[str, Any] | None = None
    last_write: float | None = None
    violation: str | None = None
    write_error: int | None = None  # HTTP status of the last refused usage write (logged once)
    unsettled: bool = False  # its GpuSlice may not exist yet (a pod's): looked up again next tick


def _report_key(record: ClaimRecord, state: _SliceState) -> str:
    """namespace/name a claim is reported under: its GpuSlice, or the claim itself (template form)."""
    return state.key or f"{record.namespace}/{record.name}"


@dataclass
class UsageReporter:
    node: str
    paths: NodePaths
    kube: Kube
    interval: float = 10.0
    #: a package's spec.isolation.onViolation, by package name
    policy: Callable[[str], OnViolation] = lambda _package: OnViolation.STOP
    pods: attribution.PodDirectory | None = None  # default: this node's pods from the API
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
        if state is not None and not state.unsettled:
            return state
        key: str | None = None
        owner_uid: str | None = None
        package = ""
        settled = True
        try:
            claim = await self.kube.get_claim(record.namespace, record.name)
            meta = claim.get("metadata", {})
            package = meta.get("labels", {}).get(constants.LABEL_PACKAGE, "")
            if (ref := slice_owner(meta)) is not None:
                key = f"{record.namespace}/{ref['name']}"
                owner_uid = ref.get("uid")
            elif (pod := scheduler_claim_pod(meta)) is not None:
                # kube-scheduler's claim for a pod's `gpuslice.io/<package>: 1`: its GpuSlice is the
                # one the operator keeps for that pod, named like it and owned by it.
                found = await self._pod_slice(record.namespace, *pod)
                if found is not None:
                    key, owner_uid, package = f"{record.namespace}/{pod[0]}", found[0], found[1]
                settled = found is not None  # the operator may not have made it yet: ask again
        except ApiError as exc:
            if exc.status != 404:
                raise
        name = key.split("/", 1)[1] if key else record.name
        labels = metrics.slice_labels(record.namespace, name, package, self.node, record.devices[0].gpu_uuid)
        state = _SliceState(
            key=key, owner_uid=owner_uid if key else None, labels=labels, unsettled=not settled
        )
        self._states[record.uid] = state
        return state

    async def _pod_slice(self, namespace: str, pod: str, pod_uid: str) -> tuple[str, str] | None:
        """(uid, package) of the GpuSlice the operator keeps for pod `pod`, if it is that pod's."""
        try:
            obj = await self.kube.get_gpuslice(namespace, pod)
        except ApiError as exc:
            if exc.status != 404:
                raise
            return None
        meta = obj.get("metadata") or {}
        if pod_owner_uid(meta) != pod_uid or (obj.get("spec") or {}).get("pod") != pod:
            return None
        return str(meta.get("uid") or ""), str((obj.get("spec") or {}).get("package") or "")

    async def tick(self) -> None:
        checkpoint = CheckpointStore(self.paths.state_dir / "checkpoint.json").load()
        records = [r for r in checkpoint.claims.values() if r.state == "Prepared" and r.devices]
        now_s = time.monotonic()
        now_iso = dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")
        claims: list[SliceClaim] = []
        for record in records:
            state = await self._owner(record)
            dev = record.devices[0]
            claims.append(
                SliceClaim(record.uid, _report_key(record, state), dev.gpu_uuid, dev.memory_bytes,
                           self.policy(state.labels[metrics.SLICE_LABELS.index("package")]))
            )  # fmt: skip
        if self.pods is None:
            self.pods = attribution.PodDirectory(attribution.node_pod_lister(self.kube, self.node))
        findings, seen = await attribution.find_violations(
            nvml_processes(sorted({c.gpu_uuid for c in claims})),
            claims,
            {(r.namespace, r.name): r.uid for r in records},
            self.pods,
        )
        await self._handle_violations(records, findings, seen)
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
            if state.key is None or state.owner_uid is None:
                continue  # template claims: metrics only (several nodes may serve one GpuSlice)
            usage = usage_status(snapshot, limit, now_iso, state.violation)
            # a violation found or gone is written at once: a stopped process may be gone next tick
            news = usage.get("violation") != (state.last_usage or {}).get("violation")
            if news or should_write(state.last_usage, usage, state.last_write, now_s, self.interval):
                state.last_write = now_s
                if await self._write_usage(state, usage):
                    state.last_usage = usage  # a refused write is not: the next tick tries again
        self._forget_unprepared({r.uid for r in checkpoint.claims.values()})

    def _forget_unprepared(self, uids: set[str]) -> None:
        """Unprepared claims: drop their state and their series (dashboards must not keep them)."""
        for uid in list(self._states):
            if uid not in uids:
                metrics.forget_slice(self._states.pop(uid).labels, self._refused, self._throttled)

    async def _write_usage(self, state: _SliceState, usage: dict[str, Any]) -> bool:
        """True when written, or when the slice is gone (nothing to report); False to try again."""
        assert state.key is not None and state.owner_uid is not None
        namespace, name = state.key.split("/", 1)
        try:
            await self.kube.patch_slice_usage(namespace, name, usage_patch(state.owner_uid, usage))
        except ApiError as exc:
            if exc.status == 404:  # the slice is being deleted: nothing to report
                return True
            # 422: a GpuSlice of another uid holds the name now (the test), or the admission policy
            # refused (the operator has not shown the allocation on this node yet); others: transient.
            if exc.status != state.write_error:
                log.warning(
                    "could not write usage; trying again next interval",
                    slice=state.key, status=exc.status, reason=exc.reason, message=exc.message,
                )  # fmt: skip
            state.write_error = exc.status
            return False
        state.write_error = None
        return True

    async def _handle_violations(
        self,
        records: Sequence[ClaimRecord],
        findings: Sequence[Finding],
        seen: Mapping[int, attribution.Seen],
    ) -> None:
        flagged: dict[str, list[Finding]] = {}
        for f in findings:
            for key in f.slices:
                flagged.setdefault(key, []).append(f)
            if not f.slices:
                log.warning("GPU process outside any slice", gpu=f.gpu_uuid, pids=f.pids, message=f.message)
                continue
            log.error("slice memory violation", gpu=f.gpu_uuid, pids=f.pids, kind=f.kind, message=f.message)
            for pid in f.stop:
                if attribution.stop(pid, seen[pid]):
                    log.warning("stopped violating process", pid=pid, gpu=f.gpu_uuid, slices=f.slices)
        for record in records:
            state = self._states[record.uid]
            mine = flagged.get(_report_key(record, state), [])
            message = "; ".join(f.message for f in mine) or None
            if message and message != state.violation:
                for kind in sorted({f.kind for f in mine}):
                    metrics.SLICE_VIOLATIONS.labels(*state.labels, metrics.ViolationKind(kind).value).inc()
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
