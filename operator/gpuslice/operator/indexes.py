"""Kopf indexes: in-memory views of the cluster, kept current by watch streams.

Handlers look objects up here by key instead of listing them, so a change costs a dictionary
lookup, not a relist. Values are the small frozen views from `gpuslice.domain.views`.
"""

from __future__ import annotations

from typing import Any

import kopf

from gpuslice import constants as c
from gpuslice.api.package import GpuPackageSpec
from gpuslice.domain.capacity import summarize_resource_slice
from gpuslice.domain.views import claim_view, pod_view, quota_view, uses_gpuslice, workload_view

MANAGED = {c.LABEL_MANAGED_BY: c.MANAGED_BY_VALUE}
Idx = kopf.Index[Any, Any]


class Indexes:
    """Every gpuslice index of a handler call (Kopf passes them as keyword arguments), as one."""

    def __init__(self, kw: dict[str, Any]) -> None:
        self.packages: Idx = kw["gs_packages"]
        self.slices: Idx = kw["gs_slices"]
        self.claims: Idx = kw["gs_claims"]
        self.templates: Idx = kw["gs_claim_templates"]
        self.pods: Idx = kw["gs_pods"]
        self.quotas: Idx = kw["gs_quotas"]
        self.workloads: Idx = kw["gs_workloads"]
        self.resource_slices: Idx = kw["gs_resource_slices"]
        self.namespaces: Idx = kw["gs_namespaces"]
        self.device_classes: Idx = kw["gs_device_classes"]


@kopf.index(c.API_GROUP, c.API_VERSION, c.PACKAGE_PLURAL)
def gs_packages(name: str, spec: Any, meta: Any, **_: Any) -> dict[str, Any]:
    return {
        name: {
            "spec": GpuPackageSpec.model_validate(dict(spec)),
            "uid": meta.get("uid"),
            "deleting": meta.get("deletionTimestamp") is not None,
            "generation": meta.get("generation"),
        }
    }


@kopf.index(c.API_GROUP, c.API_VERSION, c.SLICE_PLURAL)
def gs_slices(namespace: Any, name: str, spec: Any, status: Any, meta: Any, **_: Any) -> dict[Any, Any]:
    entry = {
        "namespace": namespace,
        "name": name,
        "uid": meta.get("uid"),
        "generation": meta.get("generation"),
        "created": meta.get("creationTimestamp"),
        "package": spec.get("package", ""),
        "template": bool(spec.get("template", False)),
        "status": dict(status),
    }
    return {
        ("slice", namespace, name): entry,
        ("package", spec.get("package", "")): f"{namespace}/{name}",
        ("ns", namespace): (namespace, name),
    }


@kopf.index("", "v1", "namespaces")
def gs_namespaces(name: str, labels: Any, meta: Any, **_: Any) -> dict[str, Any]:
    return {name: {"labels": dict(labels), "terminating": meta.get("deletionTimestamp") is not None}}


@kopf.index("", "v1", "resourcequotas")
def gs_quotas(namespace: Any, body: Any, **_: Any) -> dict[str, Any]:
    return {namespace: quota_view(body)}


@kopf.index(c.DRA_GROUP, c.DRA_VERSION, "resourceclaims")
def gs_claims(namespace: Any, name: str, body: Any, labels: Any, **_: Any) -> dict[Any, Any] | None:
    if not uses_gpuslice(body):
        return None
    view = claim_view(body)
    keys: dict[Any, Any] = {("claim", namespace, name): view}
    template = labels.get(c.LABEL_SLICE_TEMPLATE)
    if template:
        keys[("template", namespace, template)] = view
    for pool, _device in view.devices:
        keys[("pool", pool)] = view
    return keys


@kopf.index(c.DRA_GROUP, c.DRA_VERSION, "resourceclaimtemplates", labels=MANAGED)
def gs_claim_templates(namespace: Any, name: str, **_: Any) -> dict[Any, Any]:
    return {(namespace, name): True}


@kopf.index(c.DRA_GROUP, c.DRA_VERSION, "deviceclasses", labels=MANAGED)
def gs_device_classes(name: str, **_: Any) -> dict[str, Any]:
    return {name: True}


@kopf.index(c.DRA_GROUP, c.DRA_VERSION, "resourceslices")
def gs_resource_slices(body: Any, **_: Any) -> dict[Any, Any] | None:
    summary = summarize_resource_slice(body)
    if summary is None:
        return None
    return {summary.pool: summary}


@kopf.index("", "v1", "pods")
def gs_pods(body: Any, **_: Any) -> dict[Any, Any] | None:
    view = pod_view(body)
    if view is None:
        return None
    keys: dict[Any, Any] = {}
    for pod_claim, claim in view.claims.items():
        if pod_claim in view.templates:
            keys[("template", view.namespace, view.templates[pod_claim])] = view
        elif claim:
            keys[("claim", view.namespace, claim)] = view
    return keys or None


@kopf.index("apps", "v1", "replicasets")
def gs_workloads(body: Any, **_: Any) -> dict[Any, Any] | None:
    view = workload_view(body)
    if view is None:
        return None
    keys: dict[Any, Any] = {("claim", view.namespace, n): view for n in view.claim_names}
    keys.update({("template", view.namespace, n): view for n in view.template_names})
    return keys
