"""The ValidatingAdmissionPolicies (CEL) and bindings the operator owns.

Policies (all prefixed gpuslice-), what they bind to, their action and what they stop:

- pods (tenant namespaces, Deny): raw GPU requests; env, envFrom, hostPath and privileged bypasses.
- pod-memory (tenant namespaces, Warn): a container holding a slice with a tiny memory limit.
- claims, claim-templates (all namespaces, Deny): gpuslice claims not in the documented form, or
  in a namespace that holds no entitlement.
- vms (tenant namespaces, Deny): KubeVirt VMs holding resource claims or gpuslice devices.
- protect (objects labelled managed-by=gpuslice, Deny): writes by anyone but the operator and the
  controllers that must write them.

Tenant namespaces carry the label `gpuslice.io/tenant=true`, which the operator keeps in step with
the packages' entitlements. Policies and bindings themselves are exempt from admission in
Kubernetes; RBAC keeps tenants away from them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from gpuslice import constants as c
from gpuslice.domain.claims import documented_form_text

ADMISSION_API = "admissionregistration.k8s.io/v1"

#: Host paths a tenant pod must not mount: GPU device nodes and the agent's / shim's state.
PROTECTED_HOST_PATHS: tuple[str, ...] = (
    "/dev/nvidia",
    c.HOST_STATE_DIR,
    c.HOST_RUN_DIR,
    "/run/gpuslice",
    c.HOST_SHIM_DIR,
    c.KUBELET_PLUGINS_DIR,
    c.KUBELET_REGISTRY_DIR,
    c.CDI_DIR,
    "/etc/cdi",
)

#: Identities that legitimately write gpuslice-owned objects besides the operator: the
#: resourceclaim controller makes claims from templates, the garbage collector and namespace
#: controller delete them, kube-scheduler adds its finalizer when it allocates.
CONTROLLER_IDENTITIES: tuple[str, ...] = ("system:kube-scheduler", "system:kube-controller-manager")
CONTROLLER_IDENTITY_PREFIXES: tuple[str, ...] = ("system:serviceaccount:kube-system:",)


@dataclass(frozen=True)
class AdmissionConfig:
    #: Usernames of the operator (its service account, or the user of its kubeconfig).
    operator_identities: tuple[str, ...]
    memory_floor: str = "1Gi"
    extra_identities: tuple[str, ...] = field(default_factory=tuple)


def _cel_list(values: tuple[str, ...] | list[str]) -> str:
    return "[" + ", ".join(json.dumps(v) for v in values) + "]"


#: Pod fields that put a GPU pod into the node's namespaces.
HOST_NAMESPACES = ("hostPID", "hostIPC", "hostNetwork")
#: Capabilities that let a container step around the shim (mounts, ptrace of other processes).
DANGEROUS_CAPABILITIES = ("ALL", "SYS_ADMIN", "SYS_PTRACE", "SYS_RAWIO", "SYS_MODULE")

_CONTAINER_LISTS = ("containers", "initContainers", "ephemeralContainers")


def _no_container(cond: str) -> str:
    """True when no container of any kind satisfies `cond` (written over variable `ct`)."""
    parts = [
        f"(!has(object.spec.{lst}) || !object.spec.{lst}.exists(ct, {cond}))" for lst in _CONTAINER_LISTS
    ]
    return " && ".join(parts)


def _tenant_selector() -> dict[str, Any]:
    return {"matchExpressions": [{"key": c.LABEL_TENANT, "operator": "In", "values": ["true"]}]}


def _policy(
    name: str,
    rules: list[dict[str, Any]],
    validations: list[dict[str, Any]],
    *,
    variables: list[dict[str, str]] | None = None,
    match_conditions: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "failurePolicy": "Fail",
        "matchConstraints": {"resourceRules": rules},
        "validations": [{"reason": "Forbidden", **v} for v in validations],
    }
    if variables:
        spec["variables"] = variables
    if match_conditions:
        spec["matchConditions"] = match_conditions
    return {
        "apiVersion": ADMISSION_API,
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name, "labels": {c.LABEL_MANAGED_BY: c.MANAGED_BY_VALUE}},
        "spec": spec,
    }


def _binding(policy: str, actions: list[str], match: dict[str, Any] | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"policyName": policy, "validationActions": actions}
    if match:
        spec["matchResources"] = match
    return {
        "apiVersion": ADMISSION_API,
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": policy, "labels": {c.LABEL_MANAGED_BY: c.MANAGED_BY_VALUE}},
        "spec": spec,
    }


def _rule(group: str, resources: list[str], operations: list[str]) -> dict[str, Any]:
    return {"apiGroups": [group], "apiVersions": ["*"], "operations": operations, "resources": resources}


def _resource_request(ct: str) -> str:
    keys = "k == 'nvidia.com/gpu' || k.startsWith('deviceclass.resource.kubernetes.io/')"
    return (
        f"has({ct}.resources) && ((has({ct}.resources.limits) && {ct}.resources.limits.exists(k, {keys}))"
        f" || (has({ct}.resources.requests) && {ct}.resources.requests.exists(k, {keys})))"
    )


def pods_policy() -> dict[str, Any]:
    forbidden = _cel_list(list(c.FORBIDDEN_ENV_VARS))
    prefixes = _cel_list(list(c.FORBIDDEN_ENV_PREFIXES))
    paths = _cel_list(list(PROTECTED_HOST_PATHS))
    slice_hint = (
        "create a GpuSlice (spec.package: <product>) and reference its claim: spec.resourceClaims: "
        "[{name: gpu, resourceClaimName: <slice>}] (or resourceClaimTemplateName for a template GpuSlice) "
        "and resources.claims: [{name: gpu}] in the container"
    )
    no_claims = "(!has(object.spec.resourceClaims) || size(object.spec.resourceClaims) == 0)"
    caps = _cel_list(list(DANGEROUS_CAPABILITIES))
    host_path = (
        "has(v.hostPath) && (v.hostPath.path.contains('//') || v.hostPath.path.contains('/./') "
        f"|| {paths}.exists(d, v.hostPath.path.startsWith(d) || (d + '/').startsWith("
        "v.hostPath.path.endsWith('/') ? v.hostPath.path : v.hostPath.path + '/')))"
    )
    return _policy(
        f"{c.POLICY_PREFIX}pods",
        [_rule("", ["pods", "pods/ephemeralcontainers"], ["CREATE", "UPDATE"])],
        [
            {
                "expression": _no_container(_resource_request("ct")),
                "message": "GPUs in this namespace are sold as gpuslice products: a container may not "
                "request nvidia.com/gpu or deviceclass.resource.kubernetes.io/* resources. Instead "
                + slice_hint,
            },
            {
                "expression": _no_container(
                    f"has(ct.env) && ct.env.exists(e, e.name in {forbidden} || "
                    f"{prefixes}.exists(p, e.name.startsWith(p)))"
                ),
                "message": "a container may not set "
                + ", ".join(c.FORBIDDEN_ENV_VARS)
                + " or variables starting with "
                + ", ".join(c.FORBIDDEN_ENV_PREFIXES)
                + ": gpuslice sets GPU visibility and slice limits itself. Remove the variable; the "
                "GpuSlice's claim gives the container its GPU",
            },
            {
                "expression": "!has(object.spec.resourceClaims) || size(object.spec.resourceClaims) == 0 || "
                + _no_container("has(ct.envFrom) && size(ct.envFrom) > 0"),
                "message": "a pod that uses resource claims may not use envFrom, because it could set "
                "GPU-control variables unseen; list the variables one by one under env (valueFrom "
                "configMapKeyRef/secretKeyRef works)",
            },
            {
                "expression": f"!has(object.spec.volumes) || !object.spec.volumes.exists(v, {host_path})",
                "message": "hostPath volumes of /dev/nvidia*, of gpuslice's agent and shim state "
                "(/var/lib/gpuslice, /var/run/gpuslice, /usr/local/gpuslice), of kubelet plugins, CDI or "
                "of a directory above them are not allowed (paths must be in canonical form): the GPU "
                "reaches the container through its GpuSlice claim; use an emptyDir or a "
                "PersistentVolumeClaim for data",
            },
            {
                "expression": f"{no_claims} || !("
                + " || ".join(f"(has(object.spec.{h}) && object.spec.{h})" for h in HOST_NAMESPACES)
                + ")",
                "message": "a pod that holds a GPU slice may not use "
                + ", ".join(HOST_NAMESPACES)
                + ": in the node's namespaces it could see and signal other tenants' GPU processes or "
                "reach the node agent. Remove them; the slice needs none",
            },
            {
                "expression": f"{no_claims} || "
                + _no_container(
                    "has(ct.securityContext) && has(ct.securityContext.capabilities) && "
                    "has(ct.securityContext.capabilities.add) && "
                    f"ct.securityContext.capabilities.add.exists(x, x in {caps})"
                ),
                "message": "a container of a pod that holds a GPU slice may not add the capabilities "
                + ", ".join(DANGEROUS_CAPABILITIES)
                + ": they allow escaping the slice's limits (mounts, other processes' memory). Remove "
                "them from securityContext.capabilities.add",
            },
            {
                "expression": f"{no_claims} || "
                + _no_container("has(ct.volumeDevices) && size(ct.volumeDevices) > 0"),
                "message": "a container of a pod that holds a GPU slice may not attach raw block devices "
                "(volumeDevices): mount the PersistentVolumeClaim as a filesystem (volumeMounts) instead",
            },
            {
                # Only on create: after binding every update of the pod carries the scheduler's choice.
                "expression": f"{no_claims} || request.operation != 'CREATE' || !has(object.spec.nodeName) "
                "|| object.spec.nodeName == ''",
                "message": "a pod that holds a GPU slice may not set spec.nodeName: kube-scheduler must "
                "place it, because it allocates the slice on the node it picks. To steer it, use "
                "nodeSelector or nodeAffinity",
            },
            {
                "expression": _no_container(
                    "has(ct.securityContext) && has(ct.securityContext.privileged) && "
                    "ct.securityContext.privileged"
                ),
                "message": "privileged containers are not allowed in a gpuslice tenant namespace: they "
                "see every GPU of the node. Remove securityContext.privileged; a GpuSlice claim gives "
                "the container its slice",
            },
        ],
    )


def pod_memory_policy(floor: str) -> dict[str, Any]:
    holds = "has(ct.resources) && has(ct.resources.claims) && size(ct.resources.claims) > 0"
    small = (
        "has(ct.resources.limits) && 'memory' in ct.resources.limits && "
        f"quantity(string(ct.resources.limits['memory'])).compareTo(quantity({json.dumps(floor)})) < 0"
    )
    return _policy(
        f"{c.POLICY_PREFIX}pod-memory",
        [_rule("", ["pods"], ["CREATE"])],
        [
            {
                "expression": _no_container(f"{holds} && {small}"),
                "message": f"a container that holds a GPU slice has a memory limit below {floor}: host "
                "RAM is separate from the GPU slice, and loading a model or a CUDA context at such a "
                f"limit ends in OOMKilled (exit 137). Set resources.limits.memory to at least {floor}",
            }
        ],
    )


def _claim_policy(name: str, resource: str, base: str, labels: str) -> dict[str, Any]:
    requests = f"{base}.devices.requests"
    uses = (
        f"has({base}.devices) && has({requests}) && {requests}.exists(r, "
        f"(has(r.exactly) && r.exactly.deviceClassName.endsWith('{c.DEVICE_CLASS_SUFFIX}')) || "
        f"(has(r.firstAvailable) && r.firstAvailable.exists(s, "
        f"s.deviceClassName.endsWith('{c.DEVICE_CLASS_SUFFIX}'))))"
    )
    form = documented_form_text(one_line=True)
    where = "spec.metadata.labels" if resource == "resourceclaimtemplates" else "metadata.labels"
    tail = (
        f". Create a GpuSlice instead (it writes the claim for you), or use exactly this form "
        f"(labels under {where}): {form}"
    )
    exact = (
        "r.name == 'gpu' && has(r.exactly) && r.exactly.allocationMode == 'ExactCount' && "
        "r.exactly.count == 1 && (!has(r.exactly.selectors) || size(r.exactly.selectors) == 0) && "
        "(!has(r.exactly.adminAccess) || !r.exactly.adminAccess) && !has(r.exactly.capacity) && "
        "(!has(r.exactly.tolerations) || size(r.exactly.tolerations) == 0)"
    )
    return _policy(
        name,
        [_rule(c.DRA_GROUP, [resource], ["CREATE", "UPDATE"])],
        [
            {
                "expression": f"'{c.LABEL_TENANT}' in namespaceObject.metadata.labels && "
                f"namespaceObject.metadata.labels['{c.LABEL_TENANT}'] == 'true'",
                "message": "this namespace holds no gpuslice entitlement, so it cannot use gpuslice "
                "DeviceClasses; ask the platform team to add an entitlement to a GpuPackage that selects "
                "this namespace",
            },
            {
                "expression": f"size({requests}) == 1 && {requests}.all(r, {exact})",
                "message": "a claim for a gpuslice DeviceClass has one request named gpu with "
                "allocationMode ExactCount and count 1, and no selectors, capacity, adminAccess, "
                "tolerations or firstAvailable" + tail,
            },
            {
                "expression": f"(!has({base}.devices.constraints) || size({base}.devices.constraints) == 0) "
                f"&& (!has({base}.devices.config) || size({base}.devices.config) == 0)",
                "message": "a claim for a gpuslice DeviceClass may not carry constraints or config: "
                "the product fixes them" + tail,
            },
            {
                "expression": f"has({labels}) && '{c.LABEL_PACKAGE}' in {labels} && "
                f"{requests}.all(r, !has(r.exactly) || "
                f"{labels}['{c.LABEL_PACKAGE}'] + '{c.DEVICE_CLASS_SUFFIX}' == r.exactly.deviceClassName)",
                "message": f"a claim for a gpuslice DeviceClass carries the label {c.LABEL_PACKAGE}: "
                "<package>, matching its DeviceClass <package>.gpuslice.io" + tail,
            },
        ],
        match_conditions=[{"name": "uses-gpuslice-class", "expression": uses}],
    )


def vm_policy() -> dict[str, Any]:
    def devices_ok(spec: str) -> str:
        parts = []
        for lst in ("gpus", "hostDevices"):
            path = f"{spec}.domain.devices.{lst}"
            parts.append(
                f"(!has({spec}.domain) || !has({spec}.domain.devices) || !has({path}) || "
                f"!{path}.exists(g, has(g.claim) || "
                "(has(g.deviceName) && g.deviceName.contains('gpuslice'))))"
            )
        claims = f"(!has({spec}.resourceClaims) || size({spec}.resourceClaims) == 0)"
        return " && ".join([claims, *parts])

    vm_spec = "object.spec.template.spec"
    return _policy(
        f"{c.POLICY_PREFIX}vms",
        [_rule("kubevirt.io", ["virtualmachines", "virtualmachineinstances"], ["CREATE", "UPDATE"])],
        [
            {
                "expression": "request.kind.kind != 'VirtualMachineInstance' || " + devices_ok("object.spec"),
                "message": "slices are for containers: a VirtualMachineInstance in a gpuslice tenant "
                "namespace cannot attach a GpuSlice or any resource claim. Run the GPU workload in a pod "
                "that references the GpuSlice's claim",
            },
            {
                "expression": "request.kind.kind != 'VirtualMachine' || !has(object.spec.template) || "
                f"!has({vm_spec}) || " + devices_ok(vm_spec),
                "message": "slices are for containers: a VirtualMachine in a gpuslice tenant namespace "
                "cannot attach a GpuSlice or any resource claim. Run the GPU workload in a pod that "
                "references the GpuSlice's claim",
            },
        ],
    )


def protect_policy(config: AdmissionConfig) -> dict[str, Any]:
    allowed = _cel_list([*config.operator_identities, *config.extra_identities, *CONTROLLER_IDENTITIES])
    prefixes = _cel_list(list(CONTROLLER_IDENTITY_PREFIXES))
    return _policy(
        f"{c.POLICY_PREFIX}protect",
        [
            _rule(c.DRA_GROUP, ["resourceclaims", "resourceclaimtemplates", "deviceclasses"], ["*"]),
            _rule("", ["resourcequotas"], ["*"]),
        ],
        [
            {
                "expression": f"request.userInfo.username in {allowed} || "
                f"{prefixes}.exists(p, request.userInfo.username.startsWith(p))",
                "message": "this object is managed by gpuslice and only the gpuslice operator changes "
                "it: edit or delete the GpuSlice (claims, templates) or ask the platform team to change "
                "the GpuPackage (DeviceClasses, quotas) instead",
            }
        ],
    )


def admission_objects(config: AdmissionConfig) -> list[dict[str, Any]]:
    """Every policy and binding, policies first (a binding to a missing policy is inert, not an error)."""
    tenant = {"namespaceSelector": _tenant_selector()}
    managed = {"objectSelector": {"matchLabels": {c.LABEL_MANAGED_BY: c.MANAGED_BY_VALUE}}}
    pairs: list[tuple[dict[str, Any], list[str], dict[str, Any] | None]] = [
        (pods_policy(), ["Deny"], tenant),
        (pod_memory_policy(config.memory_floor), ["Warn"], tenant),
        (
            _claim_policy(
                f"{c.POLICY_PREFIX}claims", "resourceclaims", "object.spec", "object.metadata.labels"
            ),
            ["Deny"],
            None,
        ),
        (
            _claim_policy(
                f"{c.POLICY_PREFIX}claim-templates",
                "resourceclaimtemplates",
                "object.spec.spec",
                "object.spec.metadata.labels",
            ),
            ["Deny"],
            None,
        ),
        (vm_policy(), ["Deny"], tenant),
        (protect_policy(config), ["Deny"], managed),
    ]
    policies = [p for p, _, _ in pairs]
    bindings = [_binding(p["metadata"]["name"], actions, match) for p, actions, match in pairs]
    return policies + bindings
