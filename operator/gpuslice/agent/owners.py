"""Which GpuSlice a prepared claim reports to: its owner reference, looked up once per claim."""

from __future__ import annotations

from dataclasses import dataclass

from gpuslice import constants, metrics
from gpuslice.agent.checkpoint import ClaimRecord
from gpuslice.agent.kube import Kube
from gpuslice.domain.ownership import slice_owner
from gpuslice.kubehttp import ApiError


@dataclass(frozen=True)
class ClaimOwner:
    """The GpuSlice a claim belongs to, and the claim's series labels (fixed for the claim's life)."""

    key: str | None  # namespace/slice when the claim belongs to a (non-template) GpuSlice
    uid: str | None  # that GpuSlice's uid (the claim's owner reference)
    #: metrics.SLICE_LABELS order
    labels: tuple[str, ...]

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
    try:
        claim = await kube.get_claim(record.namespace, record.name)
        meta = claim.get("metadata", {})
        package = meta.get("labels", {}).get(constants.LABEL_PACKAGE, "")
        if (ref := slice_owner(meta)) is not None:
            key = f"{record.namespace}/{ref['name']}"
            owner_uid = ref.get("uid")
    except ApiError as exc:
        if exc.status != 404:
            raise
    name = key.split("/", 1)[1] if key else record.name
    labels = metrics.slice_labels(record.namespace, name, package, node, record.devices[0].gpu_uuid)
    return ClaimOwner(key=key, uid=owner_uid if key else None, labels=labels)
