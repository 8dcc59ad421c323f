"""The release finalizer of GpuSlices (`domain.releasing` decides): on a direct slice from its claim's
creation, off once it is deleted and no pod reserves its claim, so a slice deleted while pods use it
stays, Releasing, until they end."""

from __future__ import annotations

from gpuslice import constants as c
from gpuslice.domain.releasing import Release, decide, finalizer_patch
from gpuslice.domain.views import ClaimView
from gpuslice.logs import get
from gpuslice.operator.indexes import SliceView
from gpuslice.operator.state import OperatorState

log = get(__name__)


async def settle(
    state: OperatorState, entry: SliceView, claims: list[ClaimView], namespace_terminating: bool = False
) -> Release:
    """Apply the finalizer step; a patch refused because the slice changed meanwhile is left to the
    event that change brings (which refreshes the slice again)."""
    release = decide(
        direct=not entry.template and entry.pod is None,
        deleting=entry.deleting,
        finalizers=entry.finalizers,
        claims=claims,
        namespace_terminating=namespace_terminating,
    )
    for claim in release.delete_claims:
        # Its deletion event brings the slice here again, with a view kube-scheduler can no longer change.
        await state.kube.delete(c.DRA_GROUP_VERSION, "ResourceClaim", claim, entry.namespace)
    if release.finalizer is not None and entry.resource_version:
        ops = finalizer_patch(entry.finalizers, entry.resource_version, release.finalizer)
        done = await state.kube.json_patch(
            c.GROUP_VERSION, c.SLICE_KIND, entry.name, ops, entry.namespace, missing_ok=True
        )
        if done and entry.deleting and release.finalizer == "remove":
            log.info("deleted slice released by its last pod", namespace=entry.namespace, slice=entry.name)
    return release
