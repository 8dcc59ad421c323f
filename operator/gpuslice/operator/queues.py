"""Keeps a package's Kueue objects (sharing mode Kueue) in step with its entitlements.

Run by the package timer, before the package's status is written: it lists Kueue's objects (a
404 is Kueue not installed, which the package's `Queues` condition says), refuses to write over
any it does not own (the condition names them), applies what `domain.queues` derives and deletes
the package's queues no entitlement needs any more. Only differences are written: server-side
apply of an unchanged object changes nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from gpuslice import constants as c
from gpuslice import kubehttp
from gpuslice.api.package import Condition, GpuPackageSpec
from gpuslice.domain.queues import (
    KUEUE_API,
    conflicts,
    desired_objects,
    fair_share_weight,
    kueue_wait,
    stale,
    uses_kueue,
)
from gpuslice.domain.slice_status import SliceFacts
from gpuslice.domain.tenancy import entitled_slices
from gpuslice.kubehttp import ApiError
from gpuslice.logs import get
from gpuslice.operator.indexes import Indexes
from gpuslice.operator.retry import refusal_is_temporary
from gpuslice.operator.state import OperatorState, one

log = get(__name__)
CONDITION = "Queues"
KINDS = ("ResourceFlavor", "ClusterQueue", "LocalQueue")

#: package -> its Queues condition, read by the status writer; packages that have had Kueue objects.
_conditions: dict[str, Condition] = {}
_written: set[str] = set()


def conditions(package: str) -> list[Condition]:
    cond = _conditions.get(package)
    return [cond] if cond else []


def forget(package: str) -> None:
    _conditions.pop(package, None)
    _written.discard(package)


def entitled_namespaces(spec: GpuPackageSpec, idx: Indexes) -> tuple[dict[str, int], dict[str, float]]:
    """namespace -> slices of its entitlement, and -> its fair-sharing weight where it has one."""
    slices_of: dict[str, int] = {}
    weights: dict[str, float] = {}
    for ns in idx.namespaces:
        entry = one(idx.namespaces, ns)
        if entry is None or entry.terminating:
            continue
        slices = entitled_slices(spec, entry.labels)
        if slices is None:
            continue
        slices_of[ns] = slices
        weight = fair_share_weight(spec, entry.labels)
        if weight is not None:
            weights[ns] = weight
    return slices_of, weights


async def _existing(state: OperatorState) -> list[dict[str, Any]] | None:
    """Kueue's objects of the kinds the operator writes; None when Kueue's API is not served."""
    found: list[dict[str, Any]] = []
    for kind in KINDS:
        try:
            items = await state.kube.list_all(KUEUE_API, kind)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise
        found += [{**o, "kind": kind} for o in items]
    return found


async def reconcile_queues(state: OperatorState, idx: Indexes, package: str, spec: GpuPackageSpec) -> None:
    if not uses_kueue(spec) and package not in _written:
        _conditions.pop(package, None)
        return
    desired = desired_objects(package, spec, *entitled_namespaces(spec, idx))
    existing = await _existing(state)
    if existing is None:
        if uses_kueue(spec):
            _conditions[package] = Condition(
                type=CONDITION,
                status="False",
                reason="KueueNotInstalled",
                message="sharing.mode is Kueue but the cluster serves no kueue.x-k8s.io/v1beta2 API: "
                "install Kueue; until then each namespace's ResourceQuota (entitlement + borrowingLimit) "
                "is all that limits it",
            )
        return
    refused = conflicts(package, desired, existing)
    if refused:
        _conditions[package] = Condition(
            type=CONDITION,
            status="False",
            reason="NotOwned",
            message="; ".join(x.message() for x in refused[:5]),
        )
        log.warning("kueue objects not written", package=package, conflicts=[x.message() for x in refused])
        return
    with refusal_is_temporary(f"Kueue queues of {package}", state.config.recheck_seconds):
        for body in desired:
            await state.kube.apply(body)
        for old in stale(package, desired, existing):
            meta = old["metadata"]
            await state.kube.delete(KUEUE_API, old["kind"], meta["name"], meta.get("namespace"))
            log.info("kueue queue removed", package=package, kind=old["kind"], name=meta["name"])
    if desired:
        _written.add(package)
        queues = sum(1 for d in desired if d["kind"] == "ClusterQueue")
        _conditions[package] = Condition(
            type=CONDITION,
            status="True",
            reason="QueuesReady",
            message=f"{queues} ClusterQueue(s) in cohort {desired[1]['spec']['cohortName']}"
            if queues
            else "no namespace is entitled yet",
        )
    else:
        _written.discard(package)
        _conditions.pop(package, None)


async def with_kueue_waits(state: OperatorState, facts: SliceFacts) -> SliceFacts:
    """`facts` with where Kueue holds the slice's pods, for those its admission gate holds: read from
    the namespace's Workloads (one list per refresh of such a slice, none for any other)."""
    gated = [p for p in facts.pods if c.KUEUE_ADMISSION_GATE in p.gates and p.uid and not p.deleting]
    if not gated:
        return facts
    group, _, version = KUEUE_API.rpartition("/")
    try:
        url = kubehttp.path(group, version, "workloads", namespace=facts.namespace)
        answer = await state.kube.api.get(url)
    except ApiError as exc:
        if exc.status in (403, 404):  # no Kueue, or no right to read it: the gate alone is said
            return facts
        raise
    workloads = list(answer.get("items") or [])
    waits = {p.name: w for p in gated if p.uid and (w := kueue_wait(p.uid, workloads)) is not None}
    return dataclasses.replace(facts, queued=waits)
