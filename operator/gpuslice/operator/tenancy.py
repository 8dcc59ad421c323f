"""Handlers that keep tenant namespaces in step with entitlements: tenant label and gpuslice quota."""

from __future__ import annotations

from typing import Any

import kopf
from kubernetes_asyncio.client.exceptions import ApiException

from gpuslice import constants as c
from gpuslice.api.package import GpuPackageSpec
from gpuslice.domain.tenancy import ObservedTenant, changes, tenant_state
from gpuslice.logs import get
from gpuslice.metrics import WRITES
from gpuslice.operator.indexes import MANAGED, Indexes
from gpuslice.operator.kube import error_message
from gpuslice.operator.state import OperatorState, one, values

log = get(__name__)


def live_packages(packages: kopf.Index[Any, Any], exclude: str | None = None) -> dict[str, GpuPackageSpec]:
    """Packages that count for quotas: all but `exclude` (one whose deletion is completing)."""
    out = {}
    for name in packages:
        entry = one(packages, name)
        if entry and name != exclude:
            out[name] = entry["spec"]
    return out


async def reconcile_namespace(
    namespace: Any,
    state: OperatorState,
    idx: Indexes,
    exclude: str | None = None,
) -> None:
    ns = one(idx.namespaces, namespace)
    if ns is None or ns["terminating"]:
        return
    desired = tenant_state(namespace, ns["labels"], live_packages(idx.packages, exclude))
    ours = next((q for q in values(idx.quotas, namespace) if q.name == c.QUOTA_NAME), None)
    observed = ObservedTenant(
        labeled=ns["labels"].get(c.LABEL_TENANT) == "true",
        quota_hard=dict(ours.spec_hard) if ours else None,
        quota_labels=dict(ours.labels) if ours else None,
    )
    label_change, quota_action = changes(desired, observed)
    try:
        # Quota before label: once the label binds the admission policies, the quota is in place.
        quota = desired.quota()
        if quota_action == "apply" and quota is not None:
            await state.kube.apply(quota)
            WRITES.labels("ResourceQuota", "apply").inc()
            log.info("quota applied", namespace=namespace, hard=desired.hard)
        if label_change:
            await state.kube.apply(desired.namespace_patch())
            WRITES.labels("Namespace", "apply").inc()
            log.info("tenant label", namespace=namespace, tenant=desired.tenant)
        if quota_action == "delete":
            await state.kube.delete("v1", "ResourceQuota", c.QUOTA_NAME, namespace)
            WRITES.labels("ResourceQuota", "delete").inc()
            log.info("quota removed", namespace=namespace)
    except ApiException as exc:
        raise kopf.TemporaryError(f"namespace {namespace}: {error_message(exc)}", delay=5) from exc


async def reconcile_all(state: OperatorState, idx: Indexes, exclude: str | None = None) -> None:
    for namespace in list(idx.namespaces):
        await reconcile_namespace(namespace, state, idx, exclude)


@kopf.on.event("", "v1", "namespaces")
async def namespace_event(
    name: str,
    type: Any,
    memo: Any,
    **kw: Any,
) -> None:
    idx = Indexes(kw)
    if type == "DELETED":
        return
    await reconcile_namespace(name, memo.state, idx)


@kopf.on.event("", "v1", "resourcequotas", labels=MANAGED)
async def quota_event(
    namespace: Any,
    memo: Any,
    **kw: Any,
) -> None:
    """Someone changed or deleted a gpuslice quota (or it was just created): converge again."""
    idx = Indexes(kw)
    await reconcile_namespace(namespace, memo.state, idx)
