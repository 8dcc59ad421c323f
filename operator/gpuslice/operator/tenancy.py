"""Handlers that keep tenant namespaces in step with entitlements: tenant label and gpuslice quotas.

Namespace and quota events reconcile at once; a refused write marks the namespace unsynced, and the
package timers (which Kopf retries) reconcile it again until the write is accepted; the deletion
handler of the last package, which Kopf retries too, removes what it leaves. Namespaces get no timer
of their own: a Kopf timer puts its finalizer on every object it runs for.

The GpuSlice-count quota is watched for a count kube-controller-manager has not computed (it synced
the quota before discovering GpuSlices, on a fresh install); the package timers ask it to re-count
(`recount_slice_counts`) until it has.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Any

import kopf

from gpuslice import constants as c
from gpuslice.api.package import GpuPackageSpec
from gpuslice.domain.entitlement_use import entitlement_use
from gpuslice.domain.tenancy import (
    ObservedTenant,
    TenantState,
    changes,
    count_quota_action,
    count_quota_nudges,
    count_quota_steps,
    counting_packages,
    slice_count_unknown,
    tenant_state,
    untenant_patch,
)
from gpuslice.kubehttp import ApiError
from gpuslice.logs import get
from gpuslice.operator.entitlement_metrics import set_namespace_entitlements
from gpuslice.operator.indexes import MANAGED, Indexes, ns_of
from gpuslice.operator.retry import fast_path, refusal_is_temporary
from gpuslice.operator.slices import mark_quota_waiters
from gpuslice.operator.state import OperatorState, one, values

log = get(__name__)
TIMER = "package_timer"


def live_packages(idx: Indexes, exclude: str | None = None) -> dict[str, GpuPackageSpec]:
    """Packages as they count for tenancy (`counting_packages`): all but `exclude`, whose deletion
    handler has removed its DeviceClass."""
    views = [v for name in idx.packages if name != exclude and (v := one(idx.packages, name))]
    ending = {v.name for v in views if v.deleting and not values(idx.package_slices, v.name)}
    return counting_packages({v.name: v.spec for v in views}, ending)


def desired_tenant(
    namespace: str, labels: dict[str, str], state: OperatorState, idx: Indexes, exclude: str | None = None
) -> TenantState:
    return tenant_state(
        namespace,
        labels,
        live_packages(idx, exclude),
        state.config.pod_security,
        state.config.max_slices_per_namespace,
    )


async def reconcile_namespace(
    namespace: str,
    state: OperatorState,
    idx: Indexes,
    exclude: str | None = None,
) -> None:
    ns = one(idx.namespaces, namespace)
    if ns is None or ns.terminating:
        state.unsynced_namespaces.discard(namespace)
        return
    desired = desired_tenant(namespace, ns.labels, state, idx, exclude)
    quotas = {q.name: q for q in values(idx.quotas, namespace)}
    ours, count = quotas.get(c.QUOTA_NAME), quotas.get(c.COUNT_QUOTA_NAME)
    observed = ObservedTenant(
        labeled=ns.labels.get(c.LABEL_TENANT) == "true",
        quota_hard=dict(ours.spec_hard) if ours else None,
        quota_labels=dict(ours.labels) if ours else None,
        labels=dict(ns.labels),
        count_hard=dict(count.spec_hard) if count else None,
        count_labels=dict(count.labels) if count else None,
    )
    label_change, quota_action = changes(desired, observed)
    count_action = count_quota_action(desired, observed)
    state.unsynced_namespaces.add(namespace)  # until every write below is accepted
    with refusal_is_temporary(f"namespace {namespace}", state.config.recheck_seconds):
        # Quota before label: once the label binds the admission policies, the quota is in place.
        quota = desired.quota()
        if quota_action == "apply" and quota is not None:
            await state.kube.apply(quota)
            log.info("quota applied", namespace=namespace, hard=desired.hard)
        count_quota = desired.count_quota()
        if count_action == "apply" and count_quota is not None:
            await state.kube.apply(count_quota)
            log.info("GpuSlice count quota applied", namespace=namespace, max_slices=desired.max_slices)
        if label_change and not desired.tenant and observed.labeled:
            # Whoever set it (before the namespace-labels policy, or an admin): gone, not just released.
            await state.kube.json_patch("v1", "Namespace", namespace, untenant_patch(), missing_ok=True)
        if label_change:
            await state.kube.apply(desired.namespace_patch())
            log.info("tenant labels", namespace=namespace, tenant=desired.tenant, labels=desired.labels)
        if quota_action == "delete":
            await state.kube.delete("v1", "ResourceQuota", c.QUOTA_NAME, namespace)
            log.info("quota removed", namespace=namespace)
        if count_action == "delete":
            await state.kube.delete("v1", "ResourceQuota", c.COUNT_QUOTA_NAME, namespace)
    state.unsynced_namespaces.discard(namespace)


async def reconcile_many(
    state: OperatorState, namespaces: Iterable[str], idx: Indexes, exclude: str | None = None
) -> None:
    """Every namespace, even when one is refused; then one TemporaryError that names the refused."""
    refused = []
    for namespace in list(namespaces):
        try:
            await reconcile_namespace(namespace, state, idx, exclude)
        except kopf.TemporaryError as exc:
            refused.append(str(exc))
    if refused:
        raise kopf.TemporaryError("; ".join(refused[:5]), delay=state.config.recheck_seconds)


async def reconcile_all(state: OperatorState, idx: Indexes, exclude: str | None = None) -> None:
    await reconcile_many(state, idx.namespaces, idx, exclude)


async def retry_unsynced(state: OperatorState, idx: Indexes) -> None:
    """The namespaces whose last write was refused, again (none, almost always)."""
    if state.unsynced_namespaces:
        await reconcile_many(state, sorted(state.unsynced_namespaces), idx)


@kopf.on.event("", "v1", "namespaces")
async def namespace_event(name: str, type: str | None, memo: kopf.Memo, **kw: Any) -> None:
    if type == "DELETED":
        memo.state.unsynced_namespaces.discard(name)
        return
    await fast_path(reconcile_namespace(name, memo.state, Indexes(kw, memo.state.workloads)), TIMER)


async def recount_slice_counts(state: OperatorState, idx: Indexes) -> None:
    """Ask kube-controller-manager to re-count the GpuSlice-count quotas whose count it has not
    computed (a change of spec.hard makes it re-count), each at most every COUNT_QUOTA_NUDGE_SECONDS.
    A refused write is tried again at the next round."""
    if not state.slice_count_unknown:
        return
    now = time.monotonic()
    due = count_quota_nudges(
        state.slice_count_unknown, state.slice_count_known, now, c.COUNT_QUOTA_NUDGE_SECONDS
    )
    for namespace in due:
        ns = one(idx.namespaces, namespace)
        desired = desired_tenant(namespace, ns.labels, state, idx) if ns and not ns.terminating else None
        if desired is None or not desired.tenant:  # nothing to count any more
            state.slice_count_unknown.pop(namespace, None)
            continue
        state.slice_count_unknown[namespace] = now
        try:
            for limit in count_quota_steps(desired.max_slices):
                if (body := desired.count_quota(limit)) is not None:
                    await state.kube.apply(body)
        except ApiError as exc:
            log.warning("GpuSlice count re-count refused; tried again", namespace=namespace, error=str(exc))
            continue
        log.info("GpuSlice count unknown to kube-controller-manager; asked a re-count", namespace=namespace)


def note_slice_count(state: OperatorState, namespace: str, body: kopf.Body, deleted: bool) -> None:
    """Keep `slice_count_unknown` / `slice_count_known` in step with a GpuSlice-count quota's status."""
    status = body.get("status") or {}
    if not deleted and slice_count_unknown(status.get("hard") or {}, status.get("used") or {}):
        state.slice_count_unknown.setdefault(namespace, -math.inf)
        return
    state.slice_count_unknown.pop(namespace, None)
    if not deleted and c.SLICE_COUNT_KEY in (status.get("used") or {}):
        state.slice_count_known = True


@kopf.on.event("", "v1", "resourcequotas", labels=MANAGED)
async def quota_event(
    namespace: str | None, name: str, type: str | None, body: kopf.Body, memo: kopf.Memo, **kw: Any
) -> None:
    """Someone changed or deleted a gpuslice quota (or it was just created): converge again. Its
    usage or its entitlements moved too, maybe: the namespace's slices waiting for quota are looked at
    again (they are not on every tick of the package timers)."""
    namespace = ns_of(namespace)
    idx = Indexes(kw, memo.state.workloads)
    if name == c.COUNT_QUOTA_NAME:
        note_slice_count(memo.state, namespace, body, type == "DELETED")
    if name == c.QUOTA_NAME:
        status = {} if type == "DELETED" else body.get("status") or {}
        set_namespace_entitlements(
            namespace, entitlement_use(status.get("hard") or {}, status.get("used") or {})
        )
    mark_quota_waiters(memo.state, namespace, idx)
    await fast_path(reconcile_namespace(namespace, memo.state, idx), TIMER)
