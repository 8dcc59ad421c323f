"""Pods that ask for a product in resources.limits -> the GpuSlice the operator keeps for each.

A container's `resources.limits: {gpuslice.io/v100-8g: 1}` gets its slice from kube-scheduler, which
makes the pod a claim of its own (the package's DeviceClass names the extended resource). So that
`kubectl get gpuslices`, status, `gpuslice explain`, metrics and metering see that slice like any
other, the operator makes a GpuSlice named like the pod with `spec.pod`, owned by the pod (the
garbage collector deletes it with the pod); its status is computed from the scheduler's claim.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpuslice import constants as c
from gpuslice.api.package import GpuPackageSpec
from gpuslice.domain.ownership import managed_labels


def product_packages(packages: Mapping[str, GpuPackageSpec]) -> dict[str, str]:
    """Extended resource name -> package, for every package that offers one. Two packages naming
    the same resource: the one whose default name it is, else the first by name, keeps it; the
    other's DeviceClass names none (`resource_of`), since kube-scheduler would serve the name from
    whichever class is older."""
    out: dict[str, str] = {}
    for name in sorted(packages, key=lambda n: (packages[n].extended_resource_name is not None, n)):
        resource = packages[name].extended_resource(name)
        if resource is not None and resource not in out:
            out[resource] = name
    return out


def resource_of(package: str, packages: Mapping[str, GpuPackageSpec]) -> str | None:
    """The extended resource `package`'s DeviceClass names: its own unless another package keeps it."""
    spec = packages.get(package)
    resource = spec.extended_resource(package) if spec is not None else None
    if resource is None or product_packages(packages).get(resource) != package:
        return None
    return resource


def pod_slice(namespace: str, pod: str, pod_uid: str, package: str) -> dict[str, Any]:
    """The GpuSlice of a pod that asks for `package` in resources.limits; the pod is its controller."""
    return {
        "apiVersion": c.GROUP_VERSION,
        "kind": c.SLICE_KIND,
        "metadata": {
            "name": pod,
            "namespace": namespace,
            "labels": managed_labels(package=package),
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": pod,
                    "uid": pod_uid,
                    "controller": True,
                    "blockOwnerDeletion": False,
                }
            ],
        },
        "spec": {"package": package, "pod": pod},
    }


def scheduler_claim_pod(meta: Mapping[str, Any]) -> tuple[str, str] | None:
    """(name, uid) of the pod a claim was made for by kube-scheduler (for its extended resources)."""
    if (meta.get("annotations") or {}).get(c.ANNOTATION_EXTENDED_RESOURCE_CLAIM) != "true":
        return None
    for ref in meta.get("ownerReferences") or []:
        if ref.get("kind") == "Pod" and ref.get("apiVersion") == "v1" and ref.get("controller"):
            return str(ref.get("name") or ""), str(ref.get("uid") or "")
    return None


def pod_owner_uid(meta: Mapping[str, Any]) -> str | None:
    """uid of the Pod controlling an object (a pod's GpuSlice, kube-scheduler's claim for a pod)."""
    for ref in meta.get("ownerReferences") or []:
        if ref.get("kind") == "Pod" and ref.get("apiVersion") == "v1" and ref.get("controller"):
            return str(ref.get("uid") or "") or None
    return None
