"""Out-of-band violations, enforced: each GPU process attributed from the host to its pod and slice
(`agent.attribution`) and judged against that slice (`domain.gpu_processes`). For a slice past its
memory: an Event on the affected GpuSlices, the violation message for their status.usage,
`gpuslice_slice_violations_total`, and under the package's `spec.isolation.onViolation: Stop` a
SIGKILL of the slice's processes. A process on a sold card outside any slice is reported, never
stopped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from gpuslice import logs, metrics
from gpuslice.agent import attribution, nvml
from gpuslice.agent.checkpoint import ClaimRecord
from gpuslice.agent.events import slice_event
from gpuslice.agent.kube import Kube
from gpuslice.agent.owners import ClaimOwner
from gpuslice.api.package import OnViolation
from gpuslice.domain.gpu_processes import Finding, SliceClaim

log = logs.get(__name__)


def slice_claims(
    records: Sequence[ClaimRecord], owners: Mapping[str, ClaimOwner], policy: Callable[[str], OnViolation]
) -> list[SliceClaim]:
    """What the cross-check judges: one entry per device of every claim, so each card of a
    multi-GPU product is checked (a process of the product's pod on its second card is the
    product's; any other process there is unknown) and limited to that card's own memory."""
    return [
        SliceClaim(
            r.uid, owners[r.uid].report_key(r), d.gpu_uuid, d.memory_bytes, policy(owners[r.uid].package)
        )
        for r in records
        for d in r.devices
    ]


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
        claims = slice_claims(records, owners, self.policy)
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
        await slice_event(self.kube, self.node, key, "Warning", "SliceMemoryViolation", message)
