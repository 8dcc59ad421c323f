"""Entitlements -> which namespaces are tenants, and the two gpuslice ResourceQuotas each tenant gets.

A tenant namespace is one that at least one entitlement of any package selects. Its quota `gpuslice`
lists every package: the entitled number of slices, or 0 where the namespace holds no entitlement,
because a ResourceQuota without a key does not limit that key at all. Its quota `gpuslice-objects`
limits how many GpuSlice objects it holds, whatever its entitlements: a slice waiting past its
entitlement still costs the operator a watch entry and status work.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuslice import constants as c
from gpuslice.api.package import GpuPackageSpec
from gpuslice.api.quantity import parse_int_quantity
from gpuslice.domain.isolation import pod_security_labels
from gpuslice.domain.ownership import managed_labels
from gpuslice.domain.pod_slices import product_packages
from gpuslice.domain.queues import quota_ceilings
from gpuslice.domain.selectors import matches


def entitled_slices(spec: GpuPackageSpec, namespace_labels: Mapping[str, str]) -> int | None:
    """Slices of one package a namespace may hold; None when no entitlement selects it.

    Overlapping entitlements do not add up: the largest one applies, so a namespace that two
    selectors happen to match never gets more than the platform team wrote down for either.
    """
    granted = [e.slices for e in spec.entitlements if matches(e.namespace_selector, namespace_labels)]
    return max(granted) if granted else None


@dataclass(frozen=True)
class TenantState:
    """What one namespace should look like: tenant label on or off, and its gpuslice quota (or none)."""

    namespace: str
    tenant: bool
    hard: dict[str, str]
    #: The labels gpuslice keeps on a tenant namespace: the tenant label and its Pod Security level.
    labels: dict[str, str] = field(default_factory=dict)
    #: GpuSlice objects the namespace may hold (`--max-gpuslices-per-namespace`).
    max_slices: int = c.DEFAULT_MAX_SLICES_PER_NAMESPACE

    def quota(self) -> dict[str, Any] | None:
        if not self.tenant:
            return None
        return _quota(c.QUOTA_NAME, self.namespace, self.hard)

    def count_quota(self, max_slices: int | None = None) -> dict[str, Any] | None:
        """The GpuSlice-count quota (at `max_slices` instead of the configured number: a re-count)."""
        if not self.tenant:
            return None
        hard = {c.SLICE_COUNT_KEY: str(self.max_slices if max_slices is None else max_slices)}
        return _quota(c.COUNT_QUOTA_NAME, self.namespace, hard)

    def namespace_patch(self) -> dict[str, Any]:
        """Server-side apply body for the Namespace: it holds only the fields gpuslice owns.

        Applying it without the labels releases them (removed unless another manager owns them too);
        a tenant label someone else set is removed by `untenant_patch`.
        """
        meta: dict[str, Any] = {"name": self.namespace}
        if self.tenant:
            meta["labels"] = dict(self.labels)
        return {"apiVersion": "v1", "kind": "Namespace", "metadata": meta}


def _quota(name: str, namespace: str, hard: Mapping[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": name, "namespace": namespace, "labels": managed_labels()},
        "spec": {"hard": dict(hard)},
    }


def untenant_patch() -> list[dict[str, Any]]:
    """JSON patch removing the tenant label whoever set it (server-side apply cannot remove a field
    another field manager owns); the test makes it a no-op failure, not a wrong removal, if it is gone."""
    path = "/metadata/labels/" + c.LABEL_TENANT.replace("~", "~0").replace("/", "~1")
    return [{"op": "test", "path": path, "value": "true"}, {"op": "remove", "path": path}]


def counting_packages(
    packages: Mapping[str, GpuPackageSpec], ending: Collection[str]
) -> dict[str, GpuPackageSpec]:
    """The packages as tenancy counts them. One whose deletion is ending (`ending`: being deleted,
    no GpuSlice uses it) entitles nobody any more: its deletion handler takes its quota and the
    tenant label off, and a namespace event before the package is gone from the operator's view
    (that very label change) must not put them back. Its quota key stays, at 0, until the package
    is gone, so that no claim of its DeviceClass goes uncounted meanwhile."""
    return {
        name: spec.model_copy(update={"entitlements": []}) if name in ending else spec
        for name, spec in packages.items()
    }


def tenant_state(
    namespace: str,
    namespace_labels: Mapping[str, str],
    packages: Mapping[str, GpuPackageSpec],
    pod_security: str = "baseline",
    max_slices: int = c.DEFAULT_MAX_SLICES_PER_NAMESPACE,
) -> TenantState:
    entitled = {name: entitled_slices(spec, namespace_labels) for name, spec in packages.items()}
    tenant = any(v is not None for v in entitled.values())
    entitled = quota_ceilings(packages, entitled)
    # The quota Kubernetes keeps counts devices, and a multi-GPU product's claim holds one per card:
    # `slices` products of N cards are N x slices devices.
    hard = (
        {c.quota_key(n): str((v or 0) * packages[n].cards_per_product) for n, v in sorted(entitled.items())}
        if tenant
        else {}
    )
    if tenant:
        hard.update(extended_resource_quota(packages, entitled))
    labels = {c.LABEL_TENANT: "true", **pod_security_labels(namespace_labels, pod_security)} if tenant else {}
    return TenantState(namespace=namespace, tenant=tenant, hard=hard, labels=labels, max_slices=max_slices)


def extended_resource_quota(
    packages: Mapping[str, GpuPackageSpec], entitled: Mapping[str, int | None]
) -> dict[str, str]:
    """`requests.<extended resource>` of every product requestable in resources.limits, at the
    same count as its devices key.

    The devices key already counts the claim kube-scheduler makes for such a pod, but only once the
    pod is scheduled. kube-apiserver charges `requests.gpuslice.io/<package>` at pod creation (the
    pod's request) and for every claim of the class (a GpuSlice's claim included; the scheduler's
    claim for a pod is not charged twice), so with this key a pod past the entitlement is refused
    when it is created, and `kubectl describe quota` shows slices of both forms under the name
    tenants write.
    """
    return {
        c.QUOTA_REQUESTS_PREFIX + resource: str(entitled.get(name) or 0)
        for resource, name in sorted(product_packages(packages).items())
    }


@dataclass(frozen=True)
class ObservedTenant:
    """What the cluster shows for a namespace now, from the operator's indexes."""

    labeled: bool
    quota_hard: dict[str, str] | None
    quota_labels: dict[str, str] | None = None
    #: The namespace's labels (to see whether its Pod Security labels are as desired).
    labels: dict[str, str] = field(default_factory=dict)
    #: spec.hard and labels of the GpuSlice-count quota (None: there is none).
    count_hard: dict[str, str] | None = None
    count_labels: dict[str, str] | None = None


def changes(desired: TenantState, observed: ObservedTenant) -> tuple[bool, str]:
    """What to write: (namespace labels need applying, quota action 'apply' / 'delete' / '')."""
    label_change = desired.tenant != observed.labeled or any(
        observed.labels.get(k) != v for k, v in desired.labels.items() if k != c.LABEL_TENANT
    )
    return label_change, _quota_action(
        desired.hard if desired.tenant else None, observed.quota_hard, observed.quota_labels
    )


def count_quota_action(desired: TenantState, observed: ObservedTenant) -> str:
    """What to write of the GpuSlice-count quota: 'apply' / 'delete' / ''."""
    want = {c.SLICE_COUNT_KEY: str(desired.max_slices)} if desired.tenant else None
    return _quota_action(want, observed.count_hard, observed.count_labels)


def _quota_action(
    want: Mapping[str, str] | None, hard: Mapping[str, str] | None, labels: Mapping[str, str] | None
) -> str:
    """'apply' when a quota should hold `want` (None: no quota) and the observed one (`hard`, its
    labels; None: there is none) does not, or is not gpuslice's; 'delete' when there should be none."""
    if want is None:
        return "delete" if hard is not None else ""
    same = hard is not None and _normalise(hard) == _normalise(want)
    same = same and (labels or {}).get(c.LABEL_MANAGED_BY) == c.MANAGED_BY_VALUE
    return "" if same else "apply"


def slice_count_unknown(status_hard: Mapping[str, str], status_used: Mapping[str, str]) -> bool:
    """kube-controller-manager took the GpuSlice-count limit on (status.hard) without counting it
    (no status.used): it did not know the resource yet when it synced the quota.

    The quota admission plugin then refuses every GpuSlice create of the namespace ("status unknown
    for quota"), and nothing re-counts the quota before the controller's full resync (5 minutes by
    default): a recount follows a change of spec.hard or a GpuSlice deletion, and no slice can be
    created to be deleted. A quota whose status.hard lacks the key is not synced
    yet, which the controller does first (and admission does not enforce it meanwhile).
    """
    return c.SLICE_COUNT_KEY in status_hard and c.SLICE_COUNT_KEY not in status_used


def count_quota_nudges(
    unknown: Mapping[str, float], counted_elsewhere: bool, now: float, interval: float
) -> list[str]:
    """The namespaces whose GpuSlice-count quota to re-count now (`count_quota_steps`).

    unknown: namespace -> when its quota was last re-counted (monotonic seconds; -inf: never), for
    every namespace whose count is unknown. Each is re-counted at most every `interval`. Until some
    namespace's count is known (`counted_elsewhere`), kube-controller-manager has not discovered
    GpuSlices yet and a re-count anywhere tells whether it has: one namespace a round, so a cluster
    whose controller never counts them costs two writes an interval, not two per tenant namespace.
    """
    due = sorted((last, ns) for ns, last in unknown.items() if now - last >= interval)
    if not counted_elsewhere:
        due = due[:1]
    return [ns for _, ns in due]


def count_quota_steps(max_slices: int) -> Sequence[int]:
    """The limits to apply, in order, to make kube-controller-manager re-count the quota: it does
    so when spec.hard changes, so one below the limit and then the limit (below first: the
    namespace is never allowed more than the limit in between)."""
    return (max_slices - 1, max_slices)


def _normalise(hard: Mapping[str, Any]) -> dict[str, int]:
    """The API server writes quantities canonically (1000 comes back as 1k): compare numbers."""
    return {k: parse_int_quantity(str(v)) for k, v in hard.items()}
