"""Argo CD reads gpuslice's health from the same conditions kstatus (Flux, `kubectl wait`) reads, and
syncs CRDs and the objects of their kinds in one go. Real status objects from the cluster are checked
in tests/operator/test_operator_cluster.py; these are the edges a running operator rarely shows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from support import ARGOCD_HEALTH, argocd_health

REPO = Path(__file__).resolve().parents[2]


def obj(generation: int = 2, **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": "s", "generation": generation}, "status": status}


def cond(type_: str, status: str, message: str = "", generation: int = 2) -> dict[str, Any]:
    return {
        "type": type_,
        "status": status,
        "reason": "R",
        "message": message,
        "observedGeneration": generation,
    }


def test_an_object_the_operator_has_not_seen_is_progressing() -> None:
    assert argocd_health({"metadata": {"name": "s", "generation": 1}})["status"] == "Progressing"
    behind = obj(generation=3, observedGeneration=2, conditions=[cond("Ready", "True")])
    assert argocd_health(behind) == {
        "status": "Progressing",
        "message": "waiting for the gpuslice operator to see generation 3",
    }


def test_ready_is_healthy_stalled_is_degraded_and_reconciling_progresses() -> None:
    ready = obj(observedGeneration=2, conditions=[cond("Ready", "True", "ready to use")])
    assert argocd_health(ready) == {"status": "Healthy", "message": "ready to use"}
    stalled = obj(
        observedGeneration=2,
        conditions=[cond("Ready", "False", "quota used up"), cond("Stalled", "True", "quota used up")],
    )
    assert argocd_health(stalled) == {"status": "Degraded", "message": "quota used up"}
    waiting = obj(
        observedGeneration=2,
        conditions=[cond("Ready", "False", "all full"), cond("Reconciling", "True", "all full")],
    )
    assert argocd_health(waiting) == {"status": "Progressing", "message": "all full"}


def test_a_failed_slice_from_an_older_operator_is_degraded_too() -> None:
    assert argocd_health(obj(phase="Failed", message="no such package"))["status"] == "Degraded"


def test_a_held_package_deletion_progresses_with_its_reason() -> None:
    held = obj(
        observedGeneration=2,
        conditions=[cond("Ready", "True"), cond("Deleting", "True", "deletion is held: 1 GpuSlice(s)")],
    )
    assert argocd_health(held) == {"status": "Progressing", "message": "deletion is held: 1 GpuSlice(s)"}


def test_argocd_cm_carries_the_script_for_both_kinds(renderer) -> None:
    (cm,) = renderer(REPO / "manifests/argocd")
    assert (cm["kind"], cm["metadata"]["name"], cm["metadata"]["namespace"]) == (
        "ConfigMap",
        "argocd-cm",
        "argocd",
    )
    script = ARGOCD_HEALTH.read_text()
    assert cm["data"] == {
        "resource.customizations.health.gpuslice.io_GpuSlice": script,
        "resource.customizations.health.gpuslice.io_GpuPackage": script,
    }


def test_one_argocd_sync_applies_crds_before_the_peering_and_skips_its_dry_run(base) -> None:
    crds = [d for d in base if d["kind"] == "CustomResourceDefinition"]
    assert crds and all(d["metadata"]["annotations"]["argocd.argoproj.io/sync-wave"] == "-1" for d in crds)
    (peering,) = [d for d in base if d["kind"] == "ClusterKopfPeering"]
    annotations = peering["metadata"]["annotations"]
    assert annotations["argocd.argoproj.io/sync-options"] == "SkipDryRunOnMissingResource=true"
    # Everything else is in the default wave 0, after the CRDs.
    others = [d for d in base if d["kind"] != "CustomResourceDefinition"]
    assert all(
        int((d["metadata"].get("annotations") or {}).get("argocd.argoproj.io/sync-wave", "0")) >= 0
        for d in others
    )
