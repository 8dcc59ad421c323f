"""Out-of-band violations, enforced: each GPU process attributed from the host to its pod and slice
(`agent.attribution`) and judged against that slice (`domain.gpu_processes`). For a slice past its
memory: an Event on the affected GpuSlices, the violation message for their status.usage,
`gpuslice_slice_violations_total`, and under the package's `spec.isolation.onViolation: Stop` a
SIGKILL of the slice's processes. A process on a sold card outside any slice is reported, never
stopped.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from gpuslice import constants, logs, metrics
from gpuslice.agent import attribution, nvml
from gpuslice.agent.checkpoint import ClaimRecord
from gpuslice.agent.kube import Kube
from gpuslice.agent.owners import ClaimOwner
from gpuslice.api.package import OnViolation
from gpuslice.domain.gpu_processes import Finding, SliceClaim
from gpuslice.kubehttp import ApiError

log = logs.get(__name__)


@dataclass
class ViolationEnforcer:
    node: str
    kube: Kube
    #: a package's spec.isolation.onViolation, by package name
    policy: Callable[[str], OnViolation] = lambda _package: OnViolation.STOP
    pods: attribution.PodDirectory | None = None  # default: this node's pods from the API
    #: the violation message last reported per claim uid (an Event only when it changes)
    _reported: dict[str, str | None] = field(default_factory=dict)

    async def sweep(
        self, records: Sequence[ClaimRecord], owners: Mapping[str, ClaimOwner]
    ) -> dict[str, str | None]:
        """Judge every process on the cards that hold `records`, act, and return each claim's
        violation message (None: none) by claim uid."""
        claims = [
            SliceClaim(r.uid, owners[r.uid].report_key(r), r.devices[0].gpu_uuid, r.devices[0].memory_bytes,
                       self.policy(owners[r.uid].package))
            for r in records
        ]  # fmt: skip
        if self.pods is None:
            self.pods = attribution.PodDirectory(attribution.node_pod_lister(self.kube, self.node))
        findings, seen = await attribution.find_violations(
            nvml.compute_processes(sorted({c.gpu_uuid for c in claims})),
            claims,
            {(r.namespace, r.name): r.uid for r in records},
            self.pods,
        )
        return await self._act(records, owners, findings, seen)

    async def _act(
        self,
        records: Sequence[ClaimRecord],
        owners: Mapping[str, ClaimOwner],
        findings: Sequence[Finding],
        seen: Mapping[int, attribution.Seen],
    ) -> dict[str, str | None]:
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
        out: dict[str, str | None] = {}
        for record in records:
            owner = owners[record.uid]
            mine = flagged.get(owner.report_key(record), [])
            message = "; ".join(f.message for f in mine) or None
            if message and message != self._reported.get(record.uid):
                for kind in sorted({f.kind for f in mine}):
                    metrics.SLICE_VIOLATIONS.labels(*owner.labels, metrics.ViolationKind(kind).value).inc()
                if owner.key:
                    await self._event(owner.key, message)
            self._reported[record.uid] = out[record.uid] = message
        return out

    def forget(self, keep: set[str]) -> None:
        """Drop what was reported for claims other than `keep` (unprepared ones)."""
        for uid in set(self._reported) - keep:
            del self._reported[uid]

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
