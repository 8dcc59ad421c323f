"""Entitlements -> which namespaces are tenants, and the one gpuslice ResourceQuota each tenant gets.

A tenant namespace is one that at least one entitlement of any package selects. Its quota lists every
package: the entitled number of slices, or 0 where the namespace holds no entitlement, because a
ResourceQuota without a key does not limit that key at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuslice import constants as c
from gpuslice.api.package import GpuPackageSpec
from gpuslice.api.quantity import parse_int_quantity
from gpuslice.domain.isolation import pod_security_labels
from gpuslice.domain.ownership import managed_labels
from gpuslice.domain.pod_slices import product_packages
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

    def quota(self) -> dict[str, Any] | None:
        if not self.tenant:
            return None
        return {
            "apiVersion": "v1",
            "kind": "ResourceQuota",
            "metadata": {"name": c.QUOTA_NAME, "namespace": self.namespace, "labels": managed_labels()},
            "spec": {"hard": dict(self.hard)},
        }

    def namespace_patch(self) -> dict[str, Any]:
        """Server-side apply body for the Namespace: it holds only the fields gpuslice owns.

        Applying it without the labels releases them (removed unless another manager owns them too);
        a tenant label someone else set is removed by `untenant_patch`.
        """
        meta: dict[str, Any] = {"name": self.namespace}
        if self.tenant:
            meta["labels"] = dict(self.labels)
        return {"apiVersion": "v1", "kind": "Namespace", "metadata": meta}


def untenant_patch() -> list[dict[str, Any]]:
    """JSON patch removing the tenant label whoever set it (server-side apply cannot remove a field
    another field manager owns); the test makes it a no-op failure, not a wrong removal, if it is gone."""
    path = "/metadata/labels/" + c.LABEL_TENANT.replace("~", "~0").replace("/", "~1")
    return [{"op": "test", "path": path, "value": "true"}, {"op": "remove", "path": path}]


def tenant_state(
    namespace: str,
    namespace_labels: Mapping[str, str],
    packages: Mapping[str, GpuPackageSpec],
    pod_security: str = "baseline",
) -> TenantState:
    entitled = {name: entitled_slices(spec, namespace_labels) for name, spec in packages.items()}
    tenant = any(v is not None for v in entitled.values())
    hard = {c.quota_key(name): str(v or 0) for name, v in sorted(entitled.items())} if tenant else {}
    if tenant:
        hard.update(extended_resource_quota(packages, entitled))
    labels = {c.LABEL_TENANT: "true", **pod_security_labels(namespace_labels, pod_security)} if tenant else {}
    return TenantState(namespace=namespace, tenant=tenant, hard=hard, labels=labels)


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


def changes(desired: TenantState, observed: ObservedTenant) -> tuple[bool, str]:
    """What to write: (namespace labels need applying, quota action 'apply' / 'delete' / '')."""
    label_change = desired.tenant != observed.labeled or any(
        observed.labels.get(k) != v for k, v in desired.labels.items() if k != c.LABEL_TENANT
    )
    if desired.tenant:
        same = observed.quota_hard is not None and _normalise(observed.quota_hard) == _normalise(desired.hard)
        same = same and (observed.quota_labels or {}).get(c.LABEL_MANAGED_BY) == c.MANAGED_BY_VALUE
        return label_change, "" if same else "apply"
    return label_change, "delete" if observed.quota_hard is not None else ""


def _normalise(hard: Mapping[str, Any]) -> dict[str, int]:
    """The API server writes quantities canonically (1000 comes back as 1k): compare numbers."""
    return {k: parse_int_quantity(str(v)) for k, v in hard.items()}
