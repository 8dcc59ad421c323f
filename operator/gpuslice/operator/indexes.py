"""Kopf indexes: in-memory views of the cluster, kept current by watch streams.

Handlers look objects up here by key instead of listing them, so a change costs a dictionary
lookup, not a relist. One index answers one question, with one key shape; values are the small
frozen views from `gpuslice.domain.views` (or the ones below), never whole bodies.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import kopf

from gpuslice import constants as c
from gpuslice.api.package import GpuPackageSpec
from gpuslice.api.resourceclaim import allocated_devices
from gpuslice.api.resourceslice import PublishedSlice, parse_resource_slice
from gpuslice.domain.deviceclass import fingerprint
from gpuslice.domain.pod_slices import pod_owner_uid
from gpuslice.domain.views import (
    ClaimView,
    PodView,
    QuotaView,
    WorkloadView,
    claim_view,
    quota_view,
    uses_gpuslice,
)
from gpuslice.operator.changes import Ref
from gpuslice.operator.state import Lookup
from gpuslice.operator.workloads import Workloads

MANAGED = {c.LABEL_MANAGED_BY: c.MANAGED_BY_VALUE}


def ns_of(namespace: str | None) -> str:
    """Kopf types every handler's `namespace` as optional; the resources that use this are namespaced."""
    return namespace or ""


@dataclass(frozen=True, slots=True)
class PackageView:
    name: str
    spec: GpuPackageSpec
    uid: str | None
    deleting: bool
    generation: int | None
    #: status.capacity as the API server last showed it (what `kubectl get gpupackages` prints).
    capacity: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class SliceView:
    namespace: str
    name: str
    uid: str | None
    generation: int | None
    created: str | None
    package: str
    template: bool
    phase: str | None = None
    #: The pod this slice was made for (spec.pod), when the pod asks for the product in resources.limits,
    #: and the uid of the pod that owns it (a pod re-created under the name is another pod).
    pod: str | None = None
    pod_uid: str | None = None
    #: status.reason (why it waits, for a Pending slice).
    reason: str | None = None
    #: The status as the API server last showed it, as compact JSON: the baseline a refresh compares
    #: with. Decoded, five conditions and the allocation cost ~5 KB a slice; the text ~1.3 KB.
    status_json: str = "{}"
    #: Its deletion asked for, its finalizers and the version seen (`domain.releasing`).
    deleting: bool = False
    finalizers: tuple[str, ...] = ()
    resource_version: str = ""

    @property
    def ref(self) -> Ref:
        return (self.namespace, self.name)

    @property
    def status(self) -> dict[str, Any]:
        """A fresh copy of the status the API server last showed (decoded on each call)."""
        out: dict[str, Any] = json.loads(self.status_json)
        return out


@dataclass(frozen=True, slots=True)
class NamespaceView:
    labels: dict[str, str]
    terminating: bool


@dataclass(frozen=True, slots=True)
class AdmissionView:
    """A gpuslice ValidatingAdmissionPolicy or binding: what `policies` compares with its desired form."""

    labels: dict[str, str]
    spec: dict[str, Any]


class Indexes:
    """Every gpuslice index of a handler call (Kopf passes them as keyword arguments), as one typed view."""

    def __init__(self, kw: dict[str, Any], workloads: Workloads) -> None:
        self.packages: kopf.Index[str, PackageView] = kw["gs_packages"]
        self.slices: kopf.Index[Ref, SliceView] = kw["gs_slices"]
        self.package_slices: kopf.Index[str, Ref] = kw["gs_package_slices"]
        self.namespace_slices: kopf.Index[str, Ref] = kw["gs_namespace_slices"]
        self.claims: kopf.Index[Ref, ClaimView] = kw["gs_claims"]
        #: (namespace, template slice) -> claims made from its template; pool -> claims allocated there.
        self.template_claims: kopf.Index[Ref, Ref] = kw["gs_template_claims"]
        self.pool_claims: kopf.Index[str, Ref] = kw["gs_pool_claims"]
        self.templates: kopf.Index[Ref, bool] = kw["gs_claim_templates"]
        #: Pods and ReplicaSets come from the operator's own watches (see `workloads`), not Kopf's.
        self.claim_pods: Lookup[Ref, PodView] = workloads.pods.by_claim
        self.template_pods: Lookup[Ref, PodView] = workloads.pods.by_template
        self.claim_workloads: Lookup[Ref, WorkloadView] = workloads.replicasets.by_claim
        self.template_workloads: Lookup[Ref, WorkloadView] = workloads.replicasets.by_template
        #: (namespace, pod) -> the pod, for pods that ask for a product in resources.limits.
        self.product_pods: Lookup[Ref, PodView] = workloads.pods.by_product
        self.quotas: kopf.Index[str, QuotaView] = kw["gs_quotas"]
        self.resource_slices: kopf.Index[str, PublishedSlice] = kw["gs_resource_slices"]
        #: DeviceTaintRule name -> its spec (drains: `gpuslice drain`, or the platform's own rules)
        self.device_taint_rules: kopf.Index[str, dict[str, Any]] = kw["gs_device_taint_rules"]
        self.namespaces: kopf.Index[str, NamespaceView] = kw["gs_namespaces"]
        #: DeviceClass name -> what gpuslice sets of it (`deviceclass.fingerprint`: to tell a changed
        #: one from ours).
        self.device_classes: kopf.Index[str, str] = kw["gs_device_classes"]
        #: admission kind -> name -> what the operator's object of that kind and name shows
        self.admission: dict[str, kopf.Index[str, AdmissionView]] = {
            kind: kw[admission_index_id(kind)] for kind in c.ADMISSION_PLURALS
        }


# --- GpuPackages and GpuSlices ----------------------------------------------------------------------


@kopf.index(c.API_GROUP, c.API_VERSION, c.PACKAGE_PLURAL)
async def gs_packages(
    name: str, spec: kopf.Spec, meta: kopf.Meta, status: kopf.Status, **_: Any
) -> dict[str, PackageView]:
    return {
        name: PackageView(
            name=name,
            spec=GpuPackageSpec.model_validate(dict(spec)),
            uid=meta.get("uid"),
            deleting=meta.get("deletionTimestamp") is not None,
            generation=meta.get("generation"),
            capacity=dict(status.get("capacity") or {}) or None,
        )
    }


def slice_view(namespace: str, name: str, spec: kopf.Spec, status: kopf.Status, meta: kopf.Meta) -> SliceView:
    return SliceView(
        namespace=namespace,
        name=name,
        uid=meta.get("uid"),
        generation=meta.get("generation"),
        created=meta.get("creationTimestamp"),
        package=spec.get("package", ""),
        template=bool(spec.get("template", False)),
        phase=status.get("phase"),
        pod=spec.get("pod") or None,
        pod_uid=pod_owner_uid(meta),
        reason=status.get("reason"),
        status_json=json.dumps(dict(status), separators=(",", ":")),
        deleting=meta.get("deletionTimestamp") is not None,
        finalizers=tuple(meta.get("finalizers") or ()),
        resource_version=str(meta.get("resourceVersion") or ""),
    )


@kopf.index(c.API_GROUP, c.API_VERSION, c.SLICE_PLURAL)
async def gs_slices(
    namespace: str | None, name: str, spec: kopf.Spec, status: kopf.Status, meta: kopf.Meta, **_: Any
) -> dict[Ref, SliceView]:
    namespace = ns_of(namespace)
    return {(namespace, name): slice_view(namespace, name, spec, status, meta)}


@kopf.index(c.API_GROUP, c.API_VERSION, c.SLICE_PLURAL)
async def gs_package_slices(namespace: str | None, name: str, spec: kopf.Spec, **_: Any) -> dict[str, Ref]:
    """Package name -> the slices that name it."""
    namespace = ns_of(namespace)
    return {spec.get("package", ""): (namespace, name)}


@kopf.index(c.API_GROUP, c.API_VERSION, c.SLICE_PLURAL)
async def gs_namespace_slices(namespace: str | None, name: str, **_: Any) -> dict[str, Ref]:
    """Namespace -> its slices."""
    namespace = ns_of(namespace)
    return {namespace: (namespace, name)}


# --- tenancy ----------------------------------------------------------------------------------------


@kopf.index("", "v1", "namespaces")
async def gs_namespaces(
    name: str, labels: kopf.Labels, meta: kopf.Meta, **_: Any
) -> dict[str, NamespaceView]:
    return {name: NamespaceView(labels=dict(labels), terminating=meta.get("deletionTimestamp") is not None)}


@kopf.index("", "v1", "resourcequotas")
async def gs_quotas(namespace: str | None, body: kopf.Body, **_: Any) -> dict[str, QuotaView]:
    namespace = ns_of(namespace)
    return {namespace: quota_view(body)}


@kopf.index(c.DRA_GROUP, c.DRA_VERSION, "deviceclasses", labels=MANAGED)
async def gs_device_classes(name: str, spec: kopf.Spec, **_: Any) -> dict[str, str]:
    return {name: fingerprint(spec)}


async def admission_view(
    name: str, labels: kopf.Labels, spec: kopf.Spec, **_: Any
) -> dict[str, AdmissionView]:
    return {name: AdmissionView(dict(labels), dict(spec))}


def admission_index_id(kind: str) -> str:
    """The Kopf index (a handler kwarg) of one kind of the operator's admission objects."""
    return f"gs_{c.ADMISSION_PLURALS[kind]}"


for _kind, _plural in c.ADMISSION_PLURALS.items():
    kopf.index(c.ADMISSION_GROUP, c.ADMISSION_VERSION, _plural, labels=MANAGED, id=admission_index_id(_kind))(
        admission_view
    )


# --- claims, pods, workloads ------------------------------------------------------------------------


@kopf.index(c.DRA_GROUP, c.DRA_VERSION, "resourceclaims")
async def gs_claims(
    namespace: str | None, name: str, body: kopf.Body, **_: Any
) -> dict[Ref, ClaimView] | None:
    namespace = ns_of(namespace)
    return {(namespace, name): claim_view(body)} if uses_gpuslice(body) else None


@kopf.index(c.DRA_GROUP, c.DRA_VERSION, "resourceclaims")
async def gs_template_claims(
    namespace: str | None, name: str, body: kopf.Body, labels: kopf.Labels, **_: Any
) -> dict[Ref, Ref] | None:
    """(namespace, template slice) -> the claims kube-controller-manager made from its template."""
    namespace = ns_of(namespace)
    template = labels.get(c.LABEL_SLICE_TEMPLATE)
    if not template or not uses_gpuslice(body):
        return None
    return {(namespace, template): (namespace, name)}


@kopf.index(c.DRA_GROUP, c.DRA_VERSION, "resourceclaims")
async def gs_pool_claims(
    namespace: str | None, name: str, body: kopf.Body, **_: Any
) -> dict[str, Ref] | None:
    """Pool -> the gpuslice claims with a device allocated in it (what capacity subtracts)."""
    namespace = ns_of(namespace)
    return {pool: (namespace, name) for pool, _device in allocated_devices(body)} or None


@kopf.index(c.DRA_GROUP, c.DRA_VERSION, "resourceclaimtemplates", labels=MANAGED)
async def gs_claim_templates(namespace: str | None, name: str, **_: Any) -> dict[Ref, bool]:
    namespace = ns_of(namespace)
    return {(namespace, name): True}


@kopf.index(c.DRA_GROUP, c.DRA_VERSION, "resourceslices")
async def gs_resource_slices(body: kopf.Body, **_: Any) -> dict[str, PublishedSlice] | None:
    summary = parse_resource_slice(body)
    return {summary.pool: summary} if summary else None


@kopf.index(c.DRA_GROUP, c.DRA_VERSION, "devicetaintrules")
async def gs_device_taint_rules(name: str, spec: kopf.Spec, **_: Any) -> dict[str, dict[str, Any]]:
    return {name: dict(spec)}
