"""Deleting a GpuSlice whose claim pods still use (domain.releasing): the slice stays, Releasing, with
the pods that hold it, until the last ends; one nobody uses goes once its claim is being deleted."""

from __future__ import annotations

from gpuslice import constants as c
from gpuslice.api.slice import GpuSliceStatus, Phase
from gpuslice.domain.releasing import STILL_IN_USE, Release, decide, finalizer_patch, releasing
from gpuslice.domain.views import ClaimView


def claim(*pods: str, allocated: bool = True, deleting: bool = False) -> ClaimView:
    return ClaimView(
        namespace="team-a", name="llm", allocated=allocated, reserved_for=pods, deleting=deleting
    )


MINE = ("other.example/keep", c.FINALIZER_RELEASE)


def test_the_finalizer_is_on_from_the_claims_creation_before_any_pod_reserves_it() -> None:
    """A pod may reserve the claim the moment it exists, before the operator sees the pod: a finalizer
    put on only once pods were seen let a slice deleted in between go while its device stayed held."""
    assert decide(direct=True, deleting=False, finalizers=(), claims=[claim(allocated=False)]) == Release(
        "add"
    )
    assert decide(direct=True, deleting=False, finalizers=(), claims=[claim("llm")]) == Release("add")
    assert decide(direct=True, deleting=False, finalizers=MINE, claims=[claim("llm")]) == Release(None)
    assert decide(direct=True, deleting=False, finalizers=MINE, claims=[claim()]) == Release(None)
    # No claim yet: nothing to hold; a claim re-created after a failed card keeps the finalizer on.
    assert decide(direct=True, deleting=False, finalizers=(), claims=[]) == Release(None)
    assert decide(direct=True, deleting=False, finalizers=MINE, claims=[]) == Release(None)


def test_deleted_unused_its_claim_is_deleted_first_then_the_finalizer_goes() -> None:
    """kube-scheduler reserves no claim that is being deleted: only a view of the claim deleting (or
    gone) with no reservation is final, so the claim is deleted before the finalizer may go."""
    unused = decide(direct=True, deleting=True, finalizers=MINE, claims=[claim(allocated=False)])
    assert unused == Release(None, delete_claims=("llm",))
    assert decide(direct=True, deleting=True, finalizers=MINE, claims=[claim()]) == Release(
        None, delete_claims=("llm",)
    )
    gone = decide(direct=True, deleting=True, finalizers=MINE, claims=[claim(allocated=False, deleting=True)])
    assert gone == Release("remove")
    assert decide(direct=True, deleting=True, finalizers=MINE, claims=[]) == Release("remove")
    # A pod reserved it just before the deletion reached it: Releasing, not gone.
    raced = decide(direct=True, deleting=True, finalizers=MINE, claims=[claim("late", deleting=True)])
    assert raced == Release(None, ("late",))


def test_deleted_while_held_it_is_releasing_with_its_pods_until_the_last_ends() -> None:
    held = [claim("train-1", "llm", "eval")]
    assert decide(direct=True, deleting=True, finalizers=MINE, claims=held) == Release(
        None, ("eval", "llm", "train-1")
    )
    # Deallocated (its pods ended): nothing holds it even if a stale reservation lingers in the view.
    assert decide(
        direct=True, deleting=True, finalizers=MINE, claims=[claim("x", allocated=False, deleting=True)]
    ) == Release("remove")


def test_template_and_pod_slices_and_a_namespace_going_never_wait() -> None:
    assert decide(direct=False, deleting=True, finalizers=(), claims=[claim("p")]) == Release(None)
    assert decide(direct=False, deleting=True, finalizers=MINE, claims=[claim("p")]) == Release("remove")
    assert decide(
        direct=True, deleting=True, finalizers=MINE, claims=[claim("p")], namespace_terminating=True
    ) == Release("remove")


def test_a_deleting_slice_gets_no_new_finalizer() -> None:
    # The API server refuses one on an object being deleted.
    assert decide(direct=True, deleting=True, finalizers=(), claims=[claim("llm")]) == Release(None)


def test_the_patch_keeps_other_finalizers_and_applies_to_the_version_seen_only() -> None:
    assert finalizer_patch(("other.example/keep",), "42", "add") == [
        {"op": "test", "path": "/metadata/resourceVersion", "value": "42"},
        {"op": "add", "path": "/metadata/finalizers", "value": ["other.example/keep", c.FINALIZER_RELEASE]},
    ]
    assert finalizer_patch(MINE, "43", "remove")[1]["value"] == ["other.example/keep"]


def test_a_releasing_status_says_who_holds_it_and_why_it_is_still_there() -> None:
    before = GpuSliceStatus.model_validate(
        {"phase": "InUse", "reason": "InUse", "node": "node-1", "claimName": "llm"}
    )
    after = releasing(before, "llm", ("eval", "llm"))
    shown = after.model_dump(by_alias=True, exclude_none=True, mode="json")
    assert (shown["phase"], shown["reason"], shown["heldBy"], shown["node"]) == (
        Phase.RELEASING.value,
        STILL_IN_USE,
        ["eval", "llm"],
        "node-1",
    )
    assert "eval, llm" in shown["message"] and "billed" in shown["message"]
    assert "heldBy" not in before.model_dump(by_alias=True, exclude_none=True)
