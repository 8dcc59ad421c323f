"""Admission policies and bindings: applied at start-up, restored when someone changes or deletes them.

Their watch events restore at once (a fast path); `ensure_policies`, run by the package timers, puts
back what the indexes show missing or changed after a refused restore, and Kopf retries it. (With no
GpuPackage there is no timer, and nothing of gpuslice's for the policies to protect either.)
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import kopf

from gpuslice import constants as c
from gpuslice.domain import features
from gpuslice.domain.admission import AdmissionConfig, admission_objects
from gpuslice.domain.conditions import contains
from gpuslice.domain.tenant_pods import tenant_pod_objects
from gpuslice.logs import get
from gpuslice.operator.indexes import MANAGED, AdmissionView, Indexes
from gpuslice.operator.retry import fast_path, refusal_is_temporary
from gpuslice.operator.state import OperatorState, one

log = get(__name__)


def desired_objects(state: OperatorState) -> dict[tuple[str, str], dict[str, Any]]:
    # Built once per process: they depend on the configuration only, and the package timers ask often.
    if state.admission is None:
        cfg = AdmissionConfig(
            operator_identities=state.config.operator_identities,
            memory_floor=state.config.memory_floor,
            exempt_namespaces=state.config.exempt_namespaces,
        )
        objects = [*admission_objects(cfg), *tenant_pod_objects(state.config.tenant_priority_classes)]
        if state.platform is not None and not state.platform.on(features.MUTATING):
            # Not served (Kubernetes 1.35): the GpuPackages' KubernetesFeatures condition says so.
            objects = [o for o in objects if not o["kind"].startswith("MutatingAdmissionPolicy")]
        state.admission = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    return state.admission


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
        written += 1
    log.info(
        "admission policies in place", written=written, identities=list(state.config.operator_identities)
    )


async def _apply(state: OperatorState, obj: dict[str, Any]) -> None:
    kind, name = obj["kind"], obj["metadata"]["name"]
    with refusal_is_temporary(f"{kind} {name}", state.config.recheck_seconds):
        await state.kube.apply(obj)
    log.info("admission object restored", kind=kind, name=name)


async def _restore(kind: str, name: str, type: str | None, body: kopf.Body, state: OperatorState) -> None:
    if type not in ("MODIFIED", "DELETED"):
        return
    obj = desired_objects(state).get((kind, name))
    if obj is None or (type == "MODIFIED" and _current(dict(body), obj)):
        return
    await _apply(state, obj)


async def ensure_policies(state: OperatorState, idx: Indexes) -> None:
    """Apply the policies and bindings the indexes show missing or changed (none, almost always)."""
    indexes = idx.admission
    for (kind, name), obj in desired_objects(state).items():
        seen: AdmissionView | None = one(indexes[kind], name)
        if seen is None or not _current({"metadata": {"labels": seen.labels}, "spec": seen.spec}, obj):
            await _apply(state, obj)


TIMER = "package_timer"


def _restorer(kind: str) -> Callable[..., Awaitable[None]]:
    async def restore(name: str, type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        await fast_path(_restore(kind, name, type, body, memo.state), TIMER)

    return restore


# A policy or binding someone changed or deleted is put back at once, whatever its kind.
for _kind, _plural in c.ADMISSION_PLURALS.items():
    kopf.on.event(c.ADMISSION_GROUP, c.ADMISSION_VERSION, _plural, labels=MANAGED, id=f"restore_{_plural}")(
        _restorer(_kind)
    )
