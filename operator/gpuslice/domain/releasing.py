"""What deleting a GpuSlice whose claim pods still use does: the slice stays until they end.

A GpuSlice's claim is its device. Pods that name the claim (`resourceClaimName`) keep it allocated
whatever happens to the GpuSlice: kube-scheduler's finalizer on the claim holds it while any pod
reserves it, and the tenant can go on using the GPU. So a GpuSlice deleted then is not gone: it
would hide a device still held and still billed. The operator puts `FINALIZER_RELEASE` on a direct
GpuSlice as soon as it has a claim (a pod may reserve the claim at any moment, before the operator
hears of it: a finalizer added only once pods were seen left a second in which a deleted slice went
at once while its device stayed held). Deleted while pods reserve the claim, it stays Terminating
with phase Releasing and heldBy naming the pods, until the last one ends; deleted while none does,
its claim is deleted first (kube-scheduler reserves no claim being deleted, so what the next view
shows is final) and the finalizer goes once the claim is gone or being deleted unreserved. The
operator never stops the tenant's pods: deleting them is the tenant's decision. The price: a slice
that has a claim waits for the operator to be deleted (as the README's uninstall says).

A slice of the template form or the pod form has claims that belong to their pods and go with them;
neither is held here.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuslice import constants as c
from gpuslice.api.slice import GpuSliceStatus, Phase
from gpuslice.domain.views import ClaimView

#: status.reason of a Releasing slice.
STILL_IN_USE = "StillInUse"


@dataclass(frozen=True, slots=True)
class Release:
    #: "add", "remove" or None: what to do with `FINALIZER_RELEASE`.
    finalizer: str | None
    #: The pods that hold the deleted slice's claim; empty: not Releasing.
    held_by: tuple[str, ...] = ()
    #: Claims to delete before the finalizer may go (a deleted slice's claims nobody reserves yet).
    delete_claims: tuple[str, ...] = ()


def holders(claims: list[ClaimView]) -> tuple[str, ...]:
    """The pods that reserve the slice's allocated claim(s), sorted."""
    return tuple(sorted({p for cl in claims if cl.allocated for p in cl.reserved_for if p}))


def decide(
    *,
    direct: bool,
    deleting: bool,
    finalizers: tuple[str, ...],
    claims: list[ClaimView],
    namespace_terminating: bool = False,
) -> Release:
    """The finalizer's next step and whether the slice is Releasing.

    `claims`: the slice's own claims as the API shows them. In a namespace being deleted the
    namespace's deletion ends the pods and takes the ledger's objects with it: the slice never waits
    there (nor could it post an Event saying why)."""
    mine = c.FINALIZER_RELEASE in finalizers
    if not direct or namespace_terminating:
        return Release("remove" if mine else None)
    held = holders(claims)
    if not deleting:
        # From its claim's creation on: a pod may reserve it before this operator sees the pod.
        return Release("add" if not mine and any(not cl.deleting for cl in claims) else None)
    if held:
        # Without the finalizer (the API refuses a new one on an object being deleted: a slice made
        # and deleted before the operator ever saw its claim) it goes; its claim is billed until released.
        return Release(None, held if mine else ())
    if not mine:
        return Release(None)
    live = tuple(sorted(cl.name for cl in claims if not cl.deleting))
    if live:
        return Release(None, delete_claims=live)
    return Release("remove")


def finalizer_patch(finalizers: tuple[str, ...], resource_version: str, step: str) -> list[dict[str, object]]:
    """The JSON patch for `step`; onto the version seen only (it replaces the list)."""
    if step == "add":
        new = [*finalizers, c.FINALIZER_RELEASE]
    else:
        new = [f for f in finalizers if f != c.FINALIZER_RELEASE]
    return [
        {"op": "test", "path": "/metadata/resourceVersion", "value": resource_version},
        {"op": "add", "path": "/metadata/finalizers", "value": new},
    ]


def releasing(status: GpuSliceStatus, claim: str, held_by: tuple[str, ...]) -> GpuSliceStatus:
    """The status of a deleted slice its pods still hold: what it was (node, GPU, conditions), with
    phase Releasing, the pods, and why it is still there."""
    pods = ", ".join(held_by)
    noun = "pod" if len(held_by) == 1 else "pods"
    message = (
        f"deleted, but {noun} {pods} still use its claim {claim}: the device stays held and billed until "
        f"{'it ends' if len(held_by) == 1 else 'they end'}; delete {'it' if len(held_by) == 1 else 'them'} "
        "to release it now"
    )
    return status.model_copy(
        update={
            "phase": Phase.RELEASING,
            "reason": STILL_IN_USE,
            "message": message,
            "held_by": list(held_by),
        }
    )
