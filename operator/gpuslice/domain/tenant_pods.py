"""Admission rules for every pod of a tenant namespace that Pod Security's baseline does not make:
which priority classes a tenant may use, and a seccomp profile for the containers that hold slices.

- priority-classes (ValidatingAdmissionPolicy, tenant namespaces, Deny): a pod's priorityClassName
  must be one the platform offers tenants (`--tenant-priority-class`, none by default), or none.
  A higher class lets kube-scheduler preempt (evict) other tenants' pods, GPU pods included, and
  hand their slices to the attacker's next pod. The Priority admission plugin runs first, so a
  cluster's globalDefault class shows here by name: offer it too if the cluster has one.
- slice-seccomp (MutatingAdmissionPolicy, tenant namespaces): a pod that will hold a slice (claims,
  or a product in resources.limits) and sets no pod-level seccomp profile gets `RuntimeDefault`.
  Under baseline an absent profile means the runtime's default, which for containerd and CRI-O is
  Unconfined: the container's root may then
  make a user and mount namespace and bind-mount over the read-only `/etc/ld.so.preload`, and its
  next process runs without the shim. The runtime's default profile refuses `unshare`/`clone` of
  namespaces without CAP_SYS_ADMIN, which baseline never grants. `Unconfined` itself, at pod or
  container level, is refused by Pod Security baseline (and restricted) in every tenant namespace.
"""

from __future__ import annotations

import json
from typing import Any

from gpuslice import constants as c
from gpuslice.domain.admission import HOLDS_SLICE

ADMISSION_API = "admissionregistration.k8s.io/v1"
PRIORITY_POLICY = f"{c.POLICY_PREFIX}priority-classes"
SECCOMP_POLICY = f"{c.POLICY_PREFIX}slice-seccomp"


def _meta(name: str) -> dict[str, Any]:
    return {"name": name, "labels": {c.LABEL_MANAGED_BY: c.MANAGED_BY_VALUE}}


def _pods(operations: list[str]) -> dict[str, Any]:
    return {
        "resourceRules": [
            {"apiGroups": [""], "apiVersions": ["*"], "operations": operations, "resources": ["pods"]}
        ]
    }


def priority_class_policy(offered: tuple[str, ...]) -> dict[str, Any]:
    names = "[" + ", ".join(json.dumps(n) for n in sorted(set(offered))) + "]"
    choice = (
        f"use one the platform offers tenants ({', '.join(sorted(set(offered)))}) or none"
        if offered
        else "the platform offers tenants none: remove it"
    )
    return {
        "apiVersion": ADMISSION_API,
        "kind": "ValidatingAdmissionPolicy",
        "metadata": _meta(PRIORITY_POLICY),
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": _pods(["CREATE"]),
            "validations": [
                {
                    "expression": "!has(object.spec.priorityClassName) || "
                    f"object.spec.priorityClassName == '' || object.spec.priorityClassName in {names}",
                    "messageExpression": "'priorityClassName ' + object.spec.priorityClassName + ' is not "
                    "offered to gpuslice tenants: a higher priority lets kube-scheduler evict other "
                    f"tenants\\' pods and take their GPU slices. {choice}'",
                    "reason": "Forbidden",
                }
            ],
        },
    }


def slice_seccomp_mutation() -> dict[str, Any]:
    profile = 'Object.spec.securityContext.seccompProfile{type: "RuntimeDefault"}'
    return {
        "apiVersion": ADMISSION_API,
        "kind": "MutatingAdmissionPolicy",
        "metadata": _meta(SECCOMP_POLICY),
        "spec": {
            "failurePolicy": "Fail",
            "reinvocationPolicy": "Never",
            "matchConstraints": _pods(["CREATE"]),
            "matchConditions": [
                {
                    "name": "holds-a-slice-without-a-pod-seccomp-profile",
                    "expression": f"{HOLDS_SLICE} && !(has(object.spec.securityContext) && "
                    "has(object.spec.securityContext.seccompProfile))",
                }
            ],
            "mutations": [
                {
                    "patchType": "ApplyConfiguration",
                    "applyConfiguration": {
                        "expression": "Object{spec: Object.spec{securityContext: "
                        f"Object.spec.securityContext{{seccompProfile: {profile}}}}}}}"
                    },
                }
            ],
        },
    }


def tenant_pod_objects(offered_priority_classes: tuple[str, ...]) -> list[dict[str, Any]]:
    """The policies above and their bindings (policies first), bound to tenant namespaces."""
    tenant = {
        "namespaceSelector": {
            "matchExpressions": [{"key": c.LABEL_TENANT, "operator": "In", "values": ["true"]}]
        }
    }
    out: list[dict[str, Any]] = [priority_class_policy(offered_priority_classes), slice_seccomp_mutation()]
    for policy in list(out):
        binding: dict[str, Any] = {"policyName": policy["metadata"]["name"], "matchResources": tenant}
        if policy["kind"] == "ValidatingAdmissionPolicy":
            binding["validationActions"] = ["Deny"]
        out.append(
            {
                "apiVersion": ADMISSION_API,
                "kind": f"{policy['kind']}Binding",
                "metadata": _meta(policy["metadata"]["name"]),
                "spec": binding,
            }
        )
    return out
