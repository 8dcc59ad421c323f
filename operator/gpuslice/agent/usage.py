"""Real usage: each prepared claim's usage region -> its GpuSlice's `status.usage` and metrics.

Pure decisions (what status.usage says, whether to write it) are plain functions; `UsageReporter`
reads the regions, has `agent.violations` judge the GPU processes (a violation is part of
status.usage), and writes:
- `status.usage` of the GpuSlice that owns each prepared claim, by a JSON patch of that one key on
  the status subresource (the operator merge-patches the other status fields, so neither erases the
  other), which first tests the slice's uid: a GpuSlice re-created under the name of the claim's
  deleted owner never gets its predecessor's usage; at most one write per slice per interval, none
  when nothing but the reading time changed, and a refused write is tried again the next interval;
- the per-slice and per-GPU Prometheus series of `gpuslice.metrics`.
The shims' utilization feedback is `agent.utilization`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuslice import logs, metrics
from gpuslice.agent.checkpoint import CheckpointStore, ClaimRecord
from gpuslice.agent.kube import Kube
from gpuslice.agent.owners import ClaimOwner, lookup_owner
from gpuslice.agent.prepare import NodePaths
from gpuslice.agent.violations import ViolationEnforcer
from gpuslice.kubehttp import ApiError
from gpuslice.shim.region import RegionFormatError, UsageSnapshot, read_usage, trim_region
from gpuslice.shim.software import SoftwareState
from gpuslice.timefmt import rfc3339

#: A slice whose pod has held it this long without any process creating a context is reported idle
#: (`status.usage.gpuIdleSince`): software that checks the GPU itself and falls back to the CPU
#: leaves no error behind (`gpuslice agent --idle-after`).
DEFAULT_IDLE_AFTER = 600.0

log = logs.get(__name__)


def _iso(unix: float) -> str:
    return rfc3339(dt.datetime.fromtimestamp(int(unix), dt.UTC))


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def software_status(state: SoftwareState) -> dict[str, Any] | None:
    """`status.usage.software`: the last thing the slice's software could not do on its GPU, until a
    later kernel image loads fine (then None: the operator's condition clears)."""
    rec = state.record
    if rec is None or (state.compatible_time is not None and state.compatible_time > rec.time):
        return None
    out: dict[str, Any] = {
        "reason": rec.kind.value,
        "process": rec.process,
        "pid": rec.pid,
        "imageArchitectures": rec.image_architectures,
        "imageCount": rec.image_count,
        "cudaError": rec.cuda_error,
        "time": _iso(rec.time),
    }
    if rec.library:
        out["library"] = rec.library
    if rec.device_arch:
        out["gpuArchitecture"] = f"sm_{rec.device_arch}"
    if rec.driver_version:
        out["driverCudaVersion"] = _cuda_version(rec.driver_version)
    if rec.runtime_version:
        out["runtimeCudaVersion"] = _cuda_version(rec.runtime_version)
    return out


def claim_memory_bytes(record: ClaimRecord) -> int:
    """The memory a claim holds: its slice's, or all of every card of a multi-GPU product (whose
    region says unlimited: the cards are whole)."""
    return sum(d.memory_bytes for d in record.devices)


def usage_status(
    snapshot: UsageSnapshot,
    limit_bytes: int,
    now: str,
    violation: str | None = None,
    idle_since: float | None = None,
) -> dict[str, Any]:
    """`status.usage` of a slice from its usage region (`idle_since`: unix time the slice has been
    held without GPU use since, once that passed the idle threshold)."""
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
    software = software_status(snapshot.software)
    if software is not None:
        usage["software"] = software
    if snapshot.software.first_use_time is not None:
        usage["firstGpuUseTime"] = _iso(snapshot.software.first_use_time)
    elif idle_since is not None:
        usage["gpuIdleSince"] = _iso(idle_since)
    return usage


def idle_since(snapshot: UsageSnapshot, held_since: float, now: float, idle_after: float) -> float | None:
    """When the slice has been held without any GPU use for at least `idle_after` seconds: since when."""
    used = snapshot.software.first_use_time is not None or any(
        p.memory_used_bytes or p.context_overhead_bytes for p in snapshot.processes
    )
    return held_since if not used and now - held_since >= idle_after else None


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


@dataclass
class _SliceState:
    owner: ClaimOwner
    #: unix time this agent first saw the claim prepared (the idle clock starts again after a restart)
    held_since: float = field(default_factory=time.time)
    last_usage: dict[str, Any] | None = None
    last_write: float | None = None
    write_error: int | None = None  # HTTP status of the last refused usage write (logged once)


def _read(usage_dir: Path) -> tuple[UsageSnapshot, int]:
    """The slice's usage, and the bytes cut from a region a tenant made longer than its layout."""
    return read_usage(usage_dir), trim_region(usage_dir)


@dataclass
class UsageReporter:
    node: str
    paths: NodePaths
    kube: Kube
    enforcer: ViolationEnforcer
    interval: float = 10.0
    idle_after: float = DEFAULT_IDLE_AFTER
    _states: dict[str, _SliceState] = field(default_factory=dict)
    # The region holds running totals; these turn them into counter increments.
    _refused: metrics.CounterFromTotal = field(
        default_factory=lambda: metrics.CounterFromTotal(metrics.SLICE_REFUSED_ALLOCATIONS)
    )
    _throttled: metrics.CounterFromTotal = field(
        default_factory=lambda: metrics.CounterFromTotal(metrics.SLICE_THROTTLED)
    )

    async def tick(self) -> None:
        checkpoint = CheckpointStore(self.paths.state_dir / "checkpoint.json").load()
        # A MIG instance (Hardware package) has no shim and no usage region: the driver keeps its
        # memory, so there is nothing to read or to judge.
        records = [
            r
            for r in checkpoint.claims.values()
            if r.state == "Prepared" and r.devices and r.devices[0].mig_profile is None
        ]
        now_s = time.monotonic()
        now_iso = _iso(time.time())
        for record in records:
            known = self._states.get(record.uid)
            if known is None or not known.owner.settled:  # a pod's GpuSlice the operator had yet to make
                self._states[record.uid] = _SliceState(await lookup_owner(self.kube, self.node, record))
        violations = await self.enforcer.sweep(records, {r.uid: self._states[r.uid].owner for r in records})
        for record in records:
            state = self._states[record.uid]
            try:
                # In a thread: the file is the tenant's, and this loop also serves kubelet's DRA gRPC.
                snapshot, trimmed = await asyncio.to_thread(_read, self.paths.usage_dir(record.uid))
            except (OSError, RegionFormatError) as exc:
                log.warning("usage region unreadable", claim=record.name, error=str(exc))
                continue
            if trimmed:
                log.warning(
                    "usage region grown past its size by the slice; cut back",
                    claim=record.name,
                    bytes=trimmed,
                )
            labels = state.owner.labels
            limit = claim_memory_bytes(record)
            metrics.SLICE_MEMORY_USED.labels(*labels).set(snapshot.memory_used_bytes)
            metrics.SLICE_MEMORY_LIMIT.labels(*labels).set(limit)
            if snapshot.shim_utilization_percent is not None:
                metrics.SLICE_COMPUTE_UTILIZATION.labels(*labels).set(snapshot.shim_utilization_percent / 100)
            self._refused.update(labels, snapshot.refused_allocations_total)
            self._throttled.update(labels, snapshot.throttled_seconds_total)
            if state.owner.key is None or state.owner.uid is None:
                continue  # template claims: metrics only (several nodes may serve one GpuSlice)
            idle = idle_since(snapshot, state.held_since, time.time(), self.idle_after)
            usage = usage_status(snapshot, limit, now_iso, violations.get(record.uid), idle)
            software = (usage.get("software") or {}).get("reason")
            for reason in metrics.SOFTWARE_REASONS:
                metrics.SLICE_SOFTWARE_INCOMPATIBLE.labels(*labels, reason).set(reason == software)
            metrics.SLICE_GPU_IDLE.labels(*labels).set("gpuIdleSince" in usage)
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
                metrics.forget_slice(self._states.pop(uid).owner.labels, self._refused, self._throttled)
        self.enforcer.forget(uids)

    async def _write_usage(self, state: _SliceState, usage: dict[str, Any]) -> bool:
        """True when written, or when the slice is gone (nothing to report); False to try again."""
        key, owner_uid = state.owner.key, state.owner.uid
        assert key is not None and owner_uid is not None
        namespace, name = key.split("/", 1)
        try:
            await self.kube.patch_slice_usage(namespace, name, usage_patch(owner_uid, usage))
        except ApiError as exc:
            if exc.status == 404:  # the slice is being deleted: nothing to report
                return True
            # 422: a GpuSlice of another uid holds the name now (the test), or the admission policy
            # refused (the operator has not shown the allocation on this node yet); others: transient.
            if exc.status != state.write_error:
                log.warning(
                    "could not write usage; trying again next interval",
                    slice=key, status=exc.status, reason=exc.reason, message=exc.message,
                )  # fmt: skip
            state.write_error = exc.status
            return False
        state.write_error = None
        return True

    async def run(self) -> None:
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
