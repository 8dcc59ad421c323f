"""Handlers that keep tenant namespaces in step with entitlements: tenant label and gpuslice quota.

Namespace and quota events reconcile at once; a refused write marks the namespace unsynced, and the
package timers (which Kopf retries) reconcile it again until the write is accepted; the deletion
handler of the last package, which Kopf retries too, removes what it leaves. Namespaces get no timer
of their own: a Kopf timer puts its finalizer on every object it runs for.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import kopf

from gpuslice import constants as c
from gpuslice.api.package import GpuPackageSpec
from gpuslice.domain.tenancy import ObservedTenant, changes, tenant_state, untenant_patch
from gpuslice.logs import get
from gpuslice.operator.indexes import MANAGED, Indexes, PackageView, ns_of
from gpuslice.operator.retry import fast_path, refusal_is_temporary
from gpuslice.operator.slices import mark_quota_waiters
from gpuslice.operator.state import OperatorState, one, values

log = get(__name__)
TIMER = "package_timer"


def live_packages(
    packages: kopf.Index[str, PackageView], exclude: str | None = None
) -> dict[str, GpuPackageSpec]:
    """Packages that count for quotas: all but `exclude` (one whose deletion is completing)."""
    out = {}
    for name in packages:
        entry = one(packages, name)
        if entry and name != exclude:
            out[name] = entry.spec
    return out


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
    desired = tenant_state(
        namespace, ns.labels, live_packages(idx.packages, exclude), state.config.pod_security
    )
    ours = next((q for q in values(idx.quotas, namespace) if q.name == c.QUOTA_NAME), None)
    observed = ObservedTenant(
        labeled=ns.labels.get(c.LABEL_TENANT) == "true",
        quota_hard=dict(ours.spec_hard) if ours else None,
        quota_labels=dict(ours.labels) if ours else None,
        labels=dict(ns.labels),
    )
    label_change, quota_action = changes(desired, observed)
    state.unsynced_namespaces.add(namespace)  # until every write below is accepted
    with refusal_is_temporary(f"namespace {namespace}", state.config.recheck_seconds):
        # Quota before label: once the label binds the admission policies, the quota is in place.
        quota = desired.quota()
        if quota_action == "apply" and quota is not None:
            await state.kube.apply(quota)
            log.info("quota applied", namespace=namespace, hard=desired.hard)
        if label_change and not desired.tenant and observed.labeled:
            # Whoever set it (before the namespace-labels policy, or an admin): gone, not just released.
            await state.kube.json_patch("v1", "Namespace", namespace, untenant_patch(), missing_ok=True)
        if label_change:
            await state.kube.apply(desired.namespace_patch())
            log.info("tenant labels", namespace=namespace, tenant=desired.tenant, labels=desired.labels)
        if quota_action == "delete":
            await state.kube.delete("v1", "ResourceQuota", c.QUOTA_NAME, namespace)
            log.info("quota removed", namespace=namespace)
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


@kopf.on.event("", "v1", "resourcequotas", labels=MANAGED)
async def quota_event(namespace: str | None, memo: kopf.Memo, **kw: Any) -> None:
    """Someone changed or deleted a gpuslice quota (or it was just created): converge again. Its
    usage or its entitlements moved too, maybe: the namespace's slices waiting for quota are looked at
    again (they are not on every tick of the package timers)."""
    namespace = ns_of(namespace)
    idx = Indexes(kw, memo.state.workloads)
    mark_quota_waiters(memo.state, namespace, idx)
    await fast_path(reconcile_namespace(namespace, memo.state, idx), TIMER)
