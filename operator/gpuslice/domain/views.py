"""Small, immutable views of cluster objects: what status decisions need, nothing more.

The operator's indexes hold these instead of whole objects, which keeps memory flat at 5,000
slices; every function here is pure and takes the object as the API server returns it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuslice import constants as c
from gpuslice.api.pod import claim_refs, generated_claims
from gpuslice.api.quantity import parse_int_quantity
from gpuslice.api.resourceclaim import allocated_devices, allocated_node, allocation
from gpuslice.domain.ownership import slice_owner


@dataclass(frozen=True, slots=True)
class ClaimView:
    namespace: str
    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    allocated: bool = False
    node: str | None = None
    devices: tuple[tuple[str, str], ...] = ()
    reserved_for: tuple[str, ...] = ()
    deleting: bool = False
    #: uid of the GpuSlice that controls the claim (its owner reference), if one does: a slice
    #: re-created under the same name must not take its deleted predecessor's claim for its own.
    owner_uid: str | None = None
    #: finalizers and resourceVersion: to put kube-scheduler's finalizer back onto exactly the
    #: version seen (`claims.protection_patch`).
    finalizers: tuple[str, ...] = ()
    resource_version: str = ""
    #: The package it is a slice of (`claim_package`): claims of both forms count in one quota.
    package: str | None = None


def claim_view(obj: Mapping[str, Any]) -> ClaimView:
    meta = obj.get("metadata") or {}
    status = obj.get("status") or {}
    allocated = allocation(obj) is not None
    devices = tuple(allocated_devices(obj))
    node = allocated_node(obj)
    if allocated and node is None and devices:
        node = devices[0][0]  # the agent names each pool after its node
    return ClaimView(
        namespace=meta.get("namespace", ""),
        name=meta.get("name", ""),
        labels=dict(meta.get("labels") or {}),
        allocated=allocated,
        node=node,
        devices=devices,
        reserved_for=tuple(
            r.get("name", "") for r in status.get("reservedFor") or [] if r.get("resource") == "pods"
        ),
        deleting=meta.get("deletionTimestamp") is not None,
        owner_uid=owner.get("uid") if (owner := slice_owner(meta)) and owner.get("controller") else None,
        finalizers=tuple(meta.get("finalizers") or ()),
        resource_version=meta.get("resourceVersion", ""),
        package=claim_package(obj),
    )


def claim_package(obj: Mapping[str, Any]) -> str | None:
    """The package a claim is a slice of: its label, or for kube-scheduler's claim for a pod that
    asks for the product in resources.limits (no labels) the gpuslice DeviceClass it requests."""
    label = ((obj.get("metadata") or {}).get("labels") or {}).get(c.LABEL_PACKAGE)
    classes = (k for k in requested_classes(obj) if k.endswith(c.DEVICE_CLASS_SUFFIX))
    return label or next((k.removesuffix(c.DEVICE_CLASS_SUFFIX) for k in classes), None)


def requested_classes(obj: Mapping[str, Any]) -> list[str]:
    """The DeviceClasses a claim's requests name (exactly, or any of firstAvailable)."""
    out = []
    for r in ((obj.get("spec") or {}).get("devices") or {}).get("requests") or []:
        out.append((r.get("exactly") or {}).get("deviceClassName", ""))
        out += [s.get("deviceClassName", "") for s in r.get("firstAvailable") or []]
    return out


def uses_gpuslice(obj: Mapping[str, Any]) -> bool:
    """A claim that asks for a gpuslice DeviceClass or holds a gpuslice.io device."""
    if any(cls.endswith(c.DEVICE_CLASS_SUFFIX) for cls in requested_classes(obj)):
        return True
    return bool(allocated_devices(obj))


@dataclass(frozen=True, slots=True)
class PodView:
    namespace: str
    name: str
    phase: str
    node: str | None
    #: pod claim name -> ResourceClaim name (direct reference, or the one generated from a template).
    claims: Mapping[str, str | None]
    #: pod claim name -> ResourceClaimTemplate name, for template references.
    templates: Mapping[str, str]
    unschedulable: str | None = None
    deleting: bool = False
    uid: str | None = None
    #: The gpuslice product a container asks for in resources.limits (`gpuslice.io/<package>`).
    product: str | None = None
    #: The claim kube-scheduler made for that request (status.extendedResourceClaimStatus).
    extended_claim: str | None = None
    #: spec.schedulingGates by name: a gated pod is not scheduled until each is removed.
    gates: tuple[str, ...] = ()

    @property
    def waiting(self) -> bool:
        return self.phase == "Pending" and not self.node

    @property
    def direct_claims(self) -> tuple[str, ...]:
        """ResourceClaims the pod names itself (not generated from a template)."""
        return tuple(claim for ref, claim in self.claims.items() if ref not in self.templates and claim)


def asked_product(pod_spec: Mapping[str, Any]) -> str | None:
    """The gpuslice product (`gpuslice.io/<name>`) a container of the pod asks for in
    resources.limits; admission lets a pod ask for one, in one regular container."""
    prefix = c.EXTENDED_RESOURCE_DOMAIN + "/"
    for ct in pod_spec.get("containers") or []:
        for key in (ct.get("resources") or {}).get("limits") or {}:
            if str(key).startswith(prefix):
                return str(key)
    return None


def pod_view(obj: Mapping[str, Any]) -> PodView | None:
    """None for pods that reference no ResourceClaim and ask for no gpuslice product."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    refs = claim_refs(spec)
    product = asked_product(spec)
    if not refs and product is None:
        return None
    generated = generated_claims(obj)
    claims: dict[str, str | None] = {}
    templates: dict[str, str] = {}
    for ref in refs:
        if ref.claim:
            claims[ref.name] = ref.claim
        elif ref.template:
            templates[ref.name] = ref.template
            claims[ref.name] = generated.get(ref.name)
    unschedulable = None
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            unschedulable = cond.get("message") or cond.get("reason") or "not scheduled yet"
    return PodView(
        namespace=meta.get("namespace", ""),
        name=meta.get("name", ""),
        phase=status.get("phase", "Pending"),
        node=spec.get("nodeName"),
        claims=claims,
        templates=templates,
        unschedulable=unschedulable,
        deleting=meta.get("deletionTimestamp") is not None,
        uid=meta.get("uid"),
        product=product,
        extended_claim=(status.get("extendedResourceClaimStatus") or {}).get("resourceClaimName") or None,
        gates=tuple(str(g.get("name")) for g in spec.get("schedulingGates") or []),
    )


@dataclass(frozen=True, slots=True)
class QuotaView:
    namespace: str
    name: str
    hard: Mapping[str, str]
    used: Mapping[str, str]
    managed: bool
    labels: Mapping[str, str] = field(default_factory=dict)
    spec_hard: Mapping[str, str] = field(default_factory=dict)

    def usage(self, key: str) -> tuple[int, int] | None:
        """(used, hard) of one key as kube-controller-manager last counted it; None if not limited."""
        if key not in self.hard and key not in self.spec_hard:
            return None
        hard = parse_int_quantity(str(self.hard.get(key, self.spec_hard.get(key, "0"))))
        return parse_int_quantity(str(self.used.get(key, "0"))), hard


def quota_view(obj: Mapping[str, Any]) -> QuotaView:
    meta = obj.get("metadata") or {}
    status = obj.get("status") or {}
    labels = dict(meta.get("labels") or {})
    return QuotaView(
        namespace=meta.get("namespace", ""),
        name=meta.get("name", ""),
        hard=dict(status.get("hard") or {}),
        used=dict(status.get("used") or {}),
        managed=labels.get(c.LABEL_MANAGED_BY) == c.MANAGED_BY_VALUE,
        labels=labels,
        spec_hard={k: str(v) for k, v in ((obj.get("spec") or {}).get("hard") or {}).items()},
    )


@dataclass(frozen=True, slots=True)
class WorkloadView:
    """A ReplicaSet (or any pod-template owner) that references claims, and why it cannot make pods."""

    namespace: str
    kind: str
    name: str
    claim_names: tuple[str, ...]
    template_names: tuple[str, ...]
    failure: str | None


def workload_view(obj: Mapping[str, Any]) -> WorkloadView | None:
    """None for workloads whose pod template references no claim."""
    meta = obj.get("metadata") or {}
    pod_spec = (((obj.get("spec") or {}).get("template") or {}).get("spec")) or {}
    refs = claim_refs(pod_spec)
    if not refs:
        return None
    failure = None
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            failure = cond.get("message") or cond.get("reason")
    return WorkloadView(
        namespace=meta.get("namespace", ""),
        kind=obj.get("kind", "ReplicaSet"),
        name=meta.get("name", ""),
        claim_names=tuple(r.claim for r in refs if r.claim),
        template_names=tuple(r.template for r in refs if r.template),
        failure=failure,
    )
