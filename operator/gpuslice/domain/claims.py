"""GpuSlice -> ResourceClaim (or ResourceClaimTemplate) of the documented form.

The documented form, the only one admission accepts for a gpuslice DeviceClass:

    spec:
      devices:
        requests:
        - name: gpu
          exactly:
            deviceClassName: <package>.gpuslice.io
            allocationMode: ExactCount
            count: 1

with label `gpuslice.io/package: <package>` on the claim (for a template: on `spec.metadata`), and
nothing else in `devices`: no selectors, capacity, adminAccess, tolerations, constraints or config.
"""

from __future__ import annotations

from typing import Any

import yaml

from gpuslice import constants as c
from gpuslice.api.package import GpuPackageSpec
from gpuslice.domain import multigpu
from gpuslice.domain.ownership import managed_labels, owner_reference
from gpuslice.domain.views import ClaimView


def documented_claim_spec(package: str, spec: GpuPackageSpec | None = None) -> dict[str, Any]:
    """With the spec of a multi-GPU package: its N whole cards and topology constraint instead."""
    if spec is not None and spec.gpus is not None:
        return multigpu.claim_spec(package, spec)
    return {
        "devices": {
            "requests": [
                {
                    "name": c.CLAIM_REQUEST_NAME,
                    "exactly": {
                        "deviceClassName": c.device_class_name(package),
                        "allocationMode": "ExactCount",
                        "count": 1,
                    },
                }
            ]
        }
    }


def documented_form_text(package: str = "<package>", *, one_line: bool = False) -> str:
    """The form as YAML, for docs; `one_line` gives flow style, as admission messages take no line breaks."""
    doc = {
        "metadata": {"labels": {c.LABEL_PACKAGE: package}},
        "spec": documented_claim_spec(package),
    }
    if one_line:
        return yaml.safe_dump(doc, sort_keys=False, default_flow_style=True, width=10_000).strip()
    return yaml.safe_dump(doc, sort_keys=False).strip()


def slice_claim(
    namespace: str, name: str, uid: str, package: str, spec: GpuPackageSpec | None = None
) -> dict[str, Any]:
    """The ResourceClaim of a GpuSlice: same name, same namespace, owned by the slice (GC deletes it).

    It is made with the finalizer kube-scheduler adds before it allocates a claim: finding it there,
    the scheduler allocates the claim with one write (the status) instead of two (an update for the
    finalizer, then the status), one round trip less in every slice pod's start
    (`bench/pod_start_stages.py`, PreBind). The resourceclaim controller takes it off when the
    claim is deleted, allocated or not, as for any claim the scheduler allocated."""
    return {
        "apiVersion": c.DRA_GROUP_VERSION,
        "kind": "ResourceClaim",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": managed_labels(package=package, slice=name),
            "ownerReferences": [owner_reference(c.SLICE_KIND, name, uid)],
            "finalizers": [c.DRA_CLAIM_FINALIZER],
        },
        "spec": documented_claim_spec(package, spec),
    }


def protection_patch(claim: ClaimView) -> list[dict[str, Any]] | None:
    """The JSON patch that puts kube-scheduler's finalizer back on a GpuSlice's claim (`slice_claim`
    says why it is there) that kube-controller-manager deallocated after its last pod and took the
    finalizer off with it: the next pod's claim is then allocated with one write again. None when
    there is nothing to do. It replaces the claim's finalizers, so only onto the version seen."""
    if (
        claim.owner_uid is None
        or claim.deleting
        or claim.allocated
        or c.DRA_CLAIM_FINALIZER in claim.finalizers
        or not claim.resource_version
    ):
        return None
    return [
        {"op": "test", "path": "/metadata/resourceVersion", "value": claim.resource_version},
        {"op": "add", "path": "/metadata/finalizers", "value": [*claim.finalizers, c.DRA_CLAIM_FINALIZER]},
    ]


def slice_claim_template(
    namespace: str, name: str, uid: str, package: str, spec: GpuPackageSpec | None = None
) -> dict[str, Any]:
    """The ResourceClaimTemplate of a template GpuSlice: every pod referencing it gets its own claim.

    The claims kube-controller-manager makes from it carry the labels of `spec.metadata`, so the
    operator finds them by `gpuslice.io/slice-template=<name>` and quota counts them like any claim.
    """
    claim_labels = managed_labels(package=package, slice_template=name)
    return {
        "apiVersion": c.DRA_GROUP_VERSION,
        "kind": "ResourceClaimTemplate",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": managed_labels(package=package, slice_template=name),
            "ownerReferences": [owner_reference(c.SLICE_KIND, name, uid)],
        },
        "spec": {"metadata": {"labels": claim_labels}, "spec": documented_claim_spec(package, spec)},
    }


def pod_claim_snippet(slice_name: str, template: bool) -> str:
    """What a pod writes to use a slice, for status messages and docs."""
    ref = "resourceClaimTemplateName" if template else "resourceClaimName"
    return (
        f"spec.resourceClaims: [{{name: gpu, {ref}: {slice_name}}}] and, in the container, "
        "resources.claims: [{name: gpu}]"
    )
