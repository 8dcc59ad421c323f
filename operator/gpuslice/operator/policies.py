"""Admission policies and bindings: applied at start-up, restored when someone changes or deletes them."""

from __future__ import annotations

from typing import Any

import kopf

from gpuslice.domain.admission import AdmissionConfig, admission_objects
from gpuslice.domain.conditions import contains
from gpuslice.logs import get
from gpuslice.metrics import WRITES
from gpuslice.operator.indexes import MANAGED
from gpuslice.operator.state import OperatorState

log = get(__name__)


def desired_objects(state: OperatorState) -> dict[tuple[str, str], dict[str, Any]]:
    cfg = AdmissionConfig(
        operator_identities=state.config.operator_identities, memory_floor=state.config.memory_floor
    )
    return {(o["kind"], o["metadata"]["name"]): o for o in admission_objects(cfg)}


def _current(obj: dict[str, Any], desired: dict[str, Any]) -> bool:
    """Already as desired? Then no apply at all: an apply right after the API server wrote the
    policy's status reorders managedFields and counts as a write."""
    return contains(obj.get("metadata", {}).get("labels", {}), desired["metadata"]["labels"]) and contains(
        obj.get("spec", {}), desired["spec"]
    )


async def apply_policies(state: OperatorState) -> None:
    written = 0
    for obj in desired_objects(state).values():
        existing = await state.kube.get(obj["apiVersion"], obj["kind"], obj["metadata"]["name"])
        if existing is not None and _current(existing, obj):
            continue
        await state.kube.apply(obj)
        WRITES.labels(obj["kind"], "apply").inc()
        written += 1
    log.info(
        "admission policies in place", written=written, identities=list(state.config.operator_identities)
    )


async def _restore(kind: str, name: str, type: str | None, body: Any, memo: Any) -> None:
    if type not in ("MODIFIED", "DELETED"):
        return
    obj = desired_objects(memo.state).get((kind, name))
    if obj is None or (type == "MODIFIED" and _current(dict(body), obj)):
        return
    await memo.state.kube.apply(obj)
    WRITES.labels(kind, "apply").inc()
    log.info("admission object restored", kind=kind, name=name)


@kopf.on.event("admissionregistration.k8s.io", "v1", "validatingadmissionpolicies", labels=MANAGED)
async def policy_event(name: str, type: Any, body: Any, memo: Any, **_: Any) -> None:
    await _restore("ValidatingAdmissionPolicy", name, type, body, memo)


@kopf.on.event("admissionregistration.k8s.io", "v1", "validatingadmissionpolicybindings", labels=MANAGED)
async def binding_event(name: str, type: Any, body: Any, memo: Any, **_: Any) -> None:
    await _restore("ValidatingAdmissionPolicyBinding", name, type, body, memo)
