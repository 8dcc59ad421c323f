"""Which GpuSlice a prepared claim reports to: its owner reference, looked up once per claim; for
kube-scheduler's claim for a pod (a product in resources.limits), the GpuSlice the operator keeps
for that pod."""

from __future__ import annotations

from dataclasses import dataclass

from gpuslice import constants as c
from gpuslice import metrics
from gpuslice.agent.checkpoint import ClaimRecord
from gpuslice.agent.kube import Kube
from gpuslice.domain.ownership import slice_owner
from gpuslice.domain.pod_slices import pod_owner_uid, scheduler_claim_pod
from gpuslice.kubehttp import ApiError


@dataclass(frozen=True)
class ClaimOwner:
    """The GpuSlice a claim belongs to, and the claim's series labels (fixed for the claim's life)."""

    key: str | None  # namespace/slice when the claim belongs to a (non-template) GpuSlice
    uid: str | None  # that GpuSlice's uid (the claim's owner reference)
    #: metrics.SLICE_LABELS order
    labels: tuple[str, ...]
    #: False while a pod's GpuSlice (kube-scheduler's claim for resources.limits) is not there yet:
    #: the operator makes it, so it is looked up again next time.
    settled: bool = True

    def report_key(self, record: ClaimRecord) -> str:
        """namespace/name the claim is reported under: its GpuSlice, or the claim itself (template)."""
        return self.key or f"{record.namespace}/{record.name}"

    @property
    def package(self) -> str:
        return self.labels[metrics.SLICE_LABELS.index("package")]


async def lookup_owner(kube: Kube, node: str, record: ClaimRecord) -> ClaimOwner:
    """Read the claim's owner reference and package label; a claim already deleted has no owner."""
    key: str | None = None
    owner_uid: str | None = None
    package = ""
    settled = True
    try:
        claim = await kube.get_claim(record.namespace, record.name)
        meta = claim.get("metadata", {})
        package = meta.get("labels", {}).get(c.LABEL_PACKAGE, "")
        if (ref := slice_owner(meta)) is not None:
            key = f"{record.namespace}/{ref['name']}"
            owner_uid = ref.get("uid")
        elif (pod := scheduler_claim_pod(meta)) is not None:
            # kube-scheduler's claim for a pod's `gpuslice.io/<package>: 1`: its GpuSlice is the one
            # the operator keeps for that pod, named like it and owned by it.
            found = await _pod_slice(kube, record.namespace, *pod)
            if found is not None:
                key, owner_uid, package = f"{record.namespace}/{pod[0]}", found[0], found[1]
            settled = found is not None
    except ApiError as exc:
        if exc.status != 404:
            raise
    name = key.split("/", 1)[1] if key else record.name
    labels = metrics.slice_labels(record.namespace, name, package, node, record.devices[0].gpu_uuid)
    return ClaimOwner(key=key, uid=owner_uid if key else None, labels=labels, settled=settled)


async def _pod_slice(kube: Kube, namespace: str, pod: str, pod_uid: str) -> tuple[str, str] | None:
    """(uid, package) of the GpuSlice the operator keeps for pod `pod`, if it is that pod's."""
    try:
        obj = await kube.get_gpuslice(namespace, pod)
    except ApiError as exc:
        if exc.status != 404:
            raise
        return None
    meta = obj.get("metadata") or {}
    if pod_owner_uid(meta) != pod_uid or (obj.get("spec") or {}).get("pod") != pod:
        return None
    return str(meta.get("uid") or ""), str((obj.get("spec") or {}).get("package") or "")
