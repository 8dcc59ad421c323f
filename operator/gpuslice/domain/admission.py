"""The admission policies (CEL) and bindings the operator owns, on top of Pod Security Admission.

Tenant namespaces carry the label `gpuslice.io/tenant=true` and a Pod Security level (baseline or
restricted, `tenancy.pod_security_labels`): Kubernetes' own Pod Security Admission refuses host
namespaces, hostPath volumes, privileged containers, added capabilities, Unconfined seccomp /
AppArmor, `procMount: Unmasked` and the rest of the baseline profile there. The policies below only
cover what Pod Security does not know about: GPUs.

Policies (all prefixed gpuslice-), what they bind to, their action and what they stop:

- pods (tenant namespaces, Deny): raw GPU resource requests; for pods that can reach a GPU node
  (holding claims or tolerating the GPU taint): GPU-control env, envFrom, a runtime class, nodeName.
- pod-products (all namespaces, Deny): a gpuslice product asked for in resources.limits
  (`gpuslice.io/<package>: 1`) outside an entitled namespace, or in any other form than one regular
  container asking for exactly one slice in a pod that holds no claims; the implicit
  `deviceclass.resource.kubernetes.io/<package>.gpuslice.io` outside tenant namespaces (inside them
  the pods policy refuses it).
- workload-products (all namespaces, Deny): the same for the pod templates of Deployments,
  ReplicaSets, StatefulSets, DaemonSets and Jobs, when the template is created or changed.
- pod-slices (all namespaces, Deny): a GpuSlice with spec.pod (the one the operator keeps for a
  pod that asks for a product in resources.limits) written by anyone but the operator.
- pod-memory (tenant namespaces, Warn): a container holding a slice with a tiny memory limit.
- gpu-nodes (every namespace but the exempt ones, Deny): tolerating the GPU node taint, unless the
  pod holds claims (or asks for a product) in a tenant namespace; the tolerate-everything toleration.
- gpu-node-toleration (MutatingAdmissionPolicy, tenant namespaces): adds the GPU taint's toleration
  to pods that hold claims or ask for a product in resources.limits, so tenants never write it.
- claims, claim-templates (all namespaces, Deny): gpuslice claims not in the documented form, or
  in a namespace that holds no entitlement; kube-scheduler's own claim for a product in
  resources.limits has its form too (one request `container-<i>-request-<j>`, ExactCount 1).
- product-claims, product-claim-templates (all namespaces, Deny; every GpuPackage a param): a claim
  labelled with a package in any other count or constraint than the package's own (1 for a slice;
  `gpus` and the topology's matchAttribute for a multi-GPU product).
- other-claims, other-claim-templates (all namespaces, Deny): claims for other classes that reach
  gpuslice devices by a selector or config naming gpuslice; in tenant namespaces allocationMode All
  and adminAccess for any class.
- namespace-labels (all namespaces, Deny): only the operator sets `gpuslice.io/tenant` and the Pod
  Security enforce labels of tenant namespaces.
- vms (tenant namespaces, Deny): KubeVirt VMs holding resource claims or gpuslice devices.
- protect (objects labelled managed-by=gpuslice, Deny): writes by anyone but the operator and the
  controllers that must write them.

Policies and bindings themselves are exempt from admission in Kubernetes; RBAC keeps tenants away
from them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from gpuslice import constants as c
from gpuslice.domain.claims import documented_form_text
from gpuslice.domain.multigpu import NUMA_NODE_ATTRIBUTE, PCIE_ROOT_ATTRIBUTE

ADMISSION_API = c.ADMISSION_API

#: Identities that legitimately write gpuslice-owned objects besides the operator: the
#: resourceclaim controller makes claims from templates and deletes them, the garbage collector and
#: namespace controller delete them, kube-scheduler adds its finalizer when it allocates. Named one
#: by one: other kube-system service accounts (a tenant may run pods there in some clusters) are not
#: trusted. `system:kube-controller-manager` is the controller manager without
#: --use-service-account-credentials.
CONTROLLER_IDENTITIES: tuple[str, ...] = (
    "system:kube-scheduler",
    "system:kube-controller-manager",
    "system:serviceaccount:kube-system:resource-claim-controller",
    "system:serviceaccount:kube-system:generic-garbage-collector",
    "system:serviceaccount:kube-system:namespace-controller",
)


@dataclass(frozen=True)
class AdmissionConfig:
    #: Usernames of the operator (its service account, or the user of its kubeconfig).
    operator_identities: tuple[str, ...]
    memory_floor: str = "1Gi"
    extra_identities: tuple[str, ...] = field(default_factory=tuple)
    #: Platform namespaces whose pods may tolerate the GPU node taint (the agent's, kube-system).
    exempt_namespaces: tuple[str, ...] = ("kube-system",)


def _cel_list(values: tuple[str, ...] | list[str]) -> str:
    return "[" + ", ".join(json.dumps(v) for v in values) + "]"


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


def _binding(
    policy: str,
    actions: list[str] | None,
    match: dict[str, Any] | None,
    kind: str = "ValidatingAdmissionPolicy",
) -> dict[str, Any]:
    spec: dict[str, Any] = {"policyName": policy}
    if actions is not None:
        spec["validationActions"] = actions
    if match:
        spec["matchResources"] = match
    return {
        "apiVersion": ADMISSION_API,
        "kind": f"{kind}Binding",
        "metadata": {"name": policy, "labels": {c.LABEL_MANAGED_BY: c.MANAGED_BY_VALUE}},
        "spec": spec,
    }


def _rule(group: str, resources: list[str], operations: list[str]) -> dict[str, Any]:
    return {"apiGroups": [group], "apiVersions": ["*"], "operations": operations, "resources": resources}


def _resource_request(ct: str) -> str:
    prefixes = _cel_list([*c.RAW_GPU_RESOURCE_PREFIXES, "deviceclass.resource.kubernetes.io/"])
    keys = f"{prefixes}.exists(p, k.lowerAscii().startsWith(p))"
    return (
        f"has({ct}.resources) && ((has({ct}.resources.limits) && {ct}.resources.limits.exists(k, {keys}))"
        f" || (has({ct}.resources.requests) && {ct}.resources.requests.exists(k, {keys})))"
    )


#: The pod holds resource claims.
HOLDS_CLAIMS = "has(object.spec.resourceClaims) && size(object.spec.resourceClaims) > 0"


# --- Products in resources.limits -----------------------------------------------------------------
# A container may ask for one slice as `resources.limits: {gpuslice.io/<package>: 1}`: the package's
# DeviceClass names that extended resource, and kube-scheduler makes the pod a claim of its own for
# it. Admitted in exactly that form, in entitled namespaces; the claim the scheduler makes is
# checked by the claims policy (`_scheduler_claim`).

PRODUCT_PREFIX = c.EXTENDED_RESOURCE_DOMAIN + "/"
#: The request names kube-scheduler gives the claim it makes: container-<index>-request-<index>.
SCHEDULER_REQUEST_NAME = "^container-[0-9]+-request-[0-9]+$"
KUBE_SCHEDULER = "system:kube-scheduler"


def _product_keys(resources: str) -> str:
    """CEL: the gpuslice product names among the keys of `resources` (a limits or requests map)."""
    return f"{resources}.filter(k, k.startsWith('{PRODUCT_PREFIX}'))"


def _asks_product(ct: str) -> str:
    """CEL: container `ct` asks for a gpuslice product as an extended resource."""
    limits, requests = _product_keys(f"{ct}.resources.limits"), _product_keys(f"{ct}.resources.requests")
    return (
        f"has({ct}.resources) && ((has({ct}.resources.limits) && size({limits}) > 0)"
        f" || (has({ct}.resources.requests) && size({requests}) > 0))"
    )


def _asks_gpuslice_device(ct: str) -> str:
    """CEL: `ct` asks for a product, or for a gpuslice DeviceClass by its implicit extended resource
    name (deviceclass.resource.kubernetes.io/<package>.gpuslice.io)."""
    implicit = (
        f"k.lowerAscii().startsWith('{c.IMPLICIT_EXTENDED_RESOURCE_PREFIX}') && "
        f"k.lowerAscii().endsWith('{c.DEVICE_CLASS_SUFFIX}')"
    )
    keys = f"(k.lowerAscii().startsWith('{PRODUCT_PREFIX}') || ({implicit}))"
    return (
        f"has({ct}.resources) && ((has({ct}.resources.limits) && {ct}.resources.limits.exists(k, {keys}))"
        f" || (has({ct}.resources.requests) && {ct}.resources.requests.exists(k, {keys})))"
    )


#: The pod asks for a product in resources.limits (in any container: the products policy admits
#: only the regular containers' form).
ASKS_PRODUCT = f"!({_no_container(_asks_product('ct'))})"
#: The pod will hold a slice: through claims, or through a product in resources.limits.
HOLDS_SLICE = f"(({HOLDS_CLAIMS}) || ({ASKS_PRODUCT}))"

PRODUCT_FORM = (
    "resources: {limits: {gpuslice.io/<product>: 1}} in one container of spec.containers (kubectl get "
    "gpupackages -o wide lists the products under RESOURCE)"
)
SLICE_FORM = (
    "create a GpuSlice (spec.package: <product>) and reference its claim: spec.resourceClaims: "
    "[{name: gpu, resourceClaimName: <slice>}] and resources.claims: [{name: gpu}] in each container"
)


def _product_validations(spec: str) -> list[dict[str, Any]]:
    """The rules of `pod_products_policy` for the pod spec at `spec` (a pod's, or a template's)."""
    tenant = (
        f"has(namespaceObject.metadata.labels) && '{c.LABEL_TENANT}' in namespaceObject.metadata.labels "
        f"&& namespaceObject.metadata.labels['{c.LABEL_TENANT}'] == 'true'"
    )
    one = "quantity(string(X[k])).compareTo(quantity('1')) == 0"
    counts_one = (
        f"size({_product_keys('ct.resources.limits')}) == 1 && "
        f"{_product_keys('ct.resources.limits')}.all(k, {one.replace('X', 'ct.resources.limits')}) && "
        f"(!has(ct.resources.requests) || {_product_keys('ct.resources.requests')}"
        f".all(k, {one.replace('X', 'ct.resources.requests')}))"
    )
    no_entitlement = (
        "holds no gpuslice entitlement, so its pods cannot ask for gpuslice products (gpuslice.io/*, or "
        "deviceclass.resource.kubernetes.io/*.gpuslice.io). Ask the platform team for an entitlement: a "
        "GpuPackage entitlement whose namespaceSelector matches this namespace"
    )
    no_claims = (
        "(!has(object.spec.resourceClaims) || size(object.spec.resourceClaims) == 0) && "
        "object.spec.containers.all(ct, !has(ct.resources) || !has(ct.resources.claims) || "
        "size(ct.resources.claims) == 0)"
    )
    validations: list[dict[str, Any]] = [
        {
            "expression": f"({tenant}) || " + _no_container(_asks_gpuslice_device("ct")),
            "message": f"this namespace {no_entitlement}",
            "messageExpression": f"'namespace ' + namespaceObject.metadata.name + ' {no_entitlement}'",
        },
        {
            "expression": "(!has(object.spec.initContainers) || "
            f"!object.spec.initContainers.exists(ct, {_asks_product('ct')})) && "
            "(!has(object.spec.ephemeralContainers) || "
            f"!object.spec.ephemeralContainers.exists(ct, {_asks_product('ct')}))",
            "message": "only a container of spec.containers may ask for a gpuslice product, not an "
            f"init or ephemeral container. Use {PRODUCT_FORM}; for a slice several containers share, "
            + SLICE_FORM,
        },
        {
            "expression": f"size(object.spec.containers.filter(ct, {_asks_product('ct')})) <= 1",
            "message": "only one container of a pod may ask for a gpuslice product in resources.limits "
            f"(each would get a slice of its own). For a slice the containers share, {SLICE_FORM}; "
            f"otherwise keep {PRODUCT_FORM}",
        },
        {
            "expression": f"object.spec.containers.all(ct, !({_asks_product('ct')}) || "
            f"(has(ct.resources.limits) && {counts_one}))",
            "message": "a container asks for exactly one slice of one gpuslice product: "
            f"{PRODUCT_FORM}. A count other than 1 is not sold (slices are fixed sizes: ask for a "
            "larger product), and two products in one container are not either",
        },
        {
            "expression": f"!({ASKS_PRODUCT}) || ({no_claims})",
            "message": "a pod asks for its GPU either as a gpuslice product in resources.limits or "
            f"through resource claims, not both. Use {PRODUCT_FORM} alone, or " + SLICE_FORM,
        },
    ]
    for v in validations:
        v["expression"] = v["expression"].replace("object.spec", spec)
    return validations


def pod_products_policy() -> dict[str, Any]:
    """Products asked for in resources.limits: only in entitled namespaces, only in the one form."""
    return _policy(
        f"{c.POLICY_PREFIX}pod-products",
        [
            _rule("", ["pods"], ["CREATE"]),
            _rule("", ["pods/ephemeralcontainers"], ["UPDATE"]),
        ],
        _product_validations("object.spec"),
    )


#: Workload controllers whose pod template is at spec.template.spec.
TEMPLATE_WORKLOADS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("apps", ("deployments", "replicasets", "statefulsets", "daemonsets")),
    ("batch", ("jobs",)),
)


def workload_products_policy() -> dict[str, Any]:
    """The same rules for the pod templates of workload controllers, so a chart's Deployment that
    could never make its pods is refused when it is applied, not left with a ReplicaFailure. Only
    when the template is new or changed: other updates (the garbage collector's, a scale) pass."""
    rules = [_rule(group, list(resources), ["CREATE", "UPDATE"]) for group, resources in TEMPLATE_WORKLOADS]
    return _policy(
        f"{c.POLICY_PREFIX}workload-products",
        rules,
        _product_validations("object.spec.template.spec"),
        match_conditions=[
            {
                "name": "template-set-or-changed",
                "expression": "request.operation == 'CREATE' || "
                "object.spec.template != oldObject.spec.template",
            }
        ],
    )


def pod_slices_policy(config: AdmissionConfig) -> dict[str, Any]:
    """Only the operator writes the GpuSlice of a pod (spec.pod): a tenant's would claim another
    pod's slice as its own in `kubectl get gpuslices`."""
    allowed = _cel_list([*config.operator_identities, *config.extra_identities, *CONTROLLER_IDENTITIES])
    pod = "(has(object.spec.pod) || (oldObject != null && has(oldObject.spec.pod)))"
    return _policy(
        f"{c.POLICY_PREFIX}pod-slices",
        [_rule(c.API_GROUP, [c.SLICE_PLURAL], ["CREATE", "UPDATE"])],
        [
            {
                "expression": f"!{pod} || request.userInfo.username in {allowed}",
                "message": "spec.pod is set by the gpuslice operator on the GpuSlice it keeps for a pod "
                f"that asks for a product in resources.limits; leave it out. Use {PRODUCT_FORM} in the "
                "pod, or create a GpuSlice of your own without spec.pod",
            }
        ],
    )


def _scheduler_claim() -> str:
    """CEL: the claim is the one kube-scheduler makes for a pod's product request: created by
    kube-scheduler's own identity with its annotation (whatever a tenant writes), or an update of
    such a claim (kube-controller-manager removes its finalizer when the pod is gone; the spec cannot
    change after creation)."""
    ann = c.ANNOTATION_EXTENDED_RESOURCE_CLAIM

    def annotated(obj: str) -> str:
        return (
            f"has({obj}.metadata.annotations) && '{ann}' in {obj}.metadata.annotations && "
            f"{obj}.metadata.annotations['{ann}'] == 'true'"
        )

    return (
        f"({annotated('object')}) && ((request.operation == 'CREATE' && "
        f"request.userInfo.username == '{KUBE_SCHEDULER}') || "
        f"(request.operation == 'UPDATE' && oldObject != null && {annotated('oldObject')}))"
    )


def _scheduler_claim_form(requests: str) -> str:
    """CEL: what kube-scheduler makes for one container's `gpuslice.io/<package>: 1`: one request of
    the class, ExactCount 1, nothing else (the products policy admits no other pod)."""
    return (
        f"size({requests}) == 1 && {requests}.all(r, r.name.matches('{SCHEDULER_REQUEST_NAME}') && "
        "has(r.exactly) && r.exactly.allocationMode == 'ExactCount' && r.exactly.count == 1 && "
        "(!has(r.exactly.selectors) || size(r.exactly.selectors) == 0) && "
        "(!has(r.exactly.adminAccess) || !r.exactly.adminAccess) && !has(r.exactly.capacity) && "
        "(!has(r.exactly.tolerations) || size(r.exactly.tolerations) == 0))"
    )


#: The pod tolerates the GPU node taint (by its key, or by the tolerate-everything toleration).
TOLERATES_GPU = (
    "has(object.spec.tolerations) && object.spec.tolerations.exists(t, "
    f"(has(t.key) && t.key == '{c.TAINT_GPU_KEY}') || "
    "((!has(t.key) || t.key == '') && has(t.operator) && t.operator == 'Exists'))"
)
#: A pod that can land on a GPU node.
REACHES_GPU = f"(({HOLDS_SLICE}) || ({TOLERATES_GPU}))"


def pods_policy() -> dict[str, Any]:
    forbidden = _cel_list(list(c.FORBIDDEN_ENV_VARS))
    prefixes = _cel_list(list(c.FORBIDDEN_ENV_PREFIXES))
    slice_hint = (
        "create a GpuSlice (spec.package: <product>) and reference its claim: spec.resourceClaims: "
        "[{name: gpu, resourceClaimName: <slice>}] (or resourceClaimTemplateName for a template GpuSlice) "
        "and resources.claims: [{name: gpu}] in the container"
    )
    not_gpu = f"!{REACHES_GPU}"
    return _policy(
        f"{c.POLICY_PREFIX}pods",
        [_rule("", ["pods", "pods/ephemeralcontainers"], ["CREATE", "UPDATE"])],
        [
            {
                "expression": _no_container(_resource_request("ct")),
                "message": "GPUs in this namespace are sold as gpuslice products: a container may not "
                "request nvidia.com/gpu or other GPUs as extended resources (any nvidia.com/*, "
                "amd.com/gpu, gpu.intel.com/*, deviceclass.resource.kubernetes.io/*). "
                f"Instead ask for a product: {PRODUCT_FORM}; or " + slice_hint,
            },
            {
                "expression": f"{not_gpu} || "
                + _no_container(
                    f"has(ct.env) && ct.env.exists(e, e.name.upperAscii() in {forbidden} || "
                    f"{prefixes}.exists(p, e.name.upperAscii().startsWith(p)))"
                ),
                "message": "a container of a pod that holds a GPU slice may not set "
                + ", ".join(c.FORBIDDEN_ENV_VARS)
                + " or variables starting with "
                + ", ".join(c.FORBIDDEN_ENV_PREFIXES)
                + ": gpuslice sets GPU visibility and slice limits itself. Remove the variable; the "
                "GpuSlice's claim gives the container its GPU",
            },
            {
                "expression": f"{not_gpu} || " + _no_container("has(ct.envFrom) && size(ct.envFrom) > 0"),
                "message": "a container of a pod that holds a GPU slice may not use envFrom: a "
                "ConfigMap or Secret could set GPU-control variables (NVIDIA_*, GPUSLICE_*) admission "
                "cannot see; list the variables one by one under env (valueFrom configMapKeyRef/"
                "secretKeyRef works)",
            },
            {
                "expression": f"{not_gpu} || !has(object.spec.runtimeClassName) || "
                "object.spec.runtimeClassName == ''",
                "message": "a pod that holds a GPU slice may not set spec.runtimeClassName: a runtime "
                "class such as nvidia would hand the container whole GPUs past its slice. Remove it; "
                "the slice reaches the container through CDI with the node's default runtime",
            },
            {
                "expression": f"{not_gpu} || "
                + _no_container("has(ct.volumeDevices) && size(ct.volumeDevices) > 0"),
                "message": "a container of a pod that holds a GPU slice may not attach raw block devices "
                "(volumeDevices): mount the PersistentVolumeClaim as a filesystem (volumeMounts) instead",
            },
            {
                # Only on create: after binding every update of the pod carries the scheduler's choice.
                "expression": f"{not_gpu} || request.operation != 'CREATE' || !has(object.spec.nodeName) "
                "|| object.spec.nodeName == ''",
                "message": "a pod that holds a GPU slice may not set spec.nodeName: kube-scheduler must "
                "place it, because it allocates the slice on the node it picks. To steer it, use "
                "nodeSelector or nodeAffinity",
            },
        ],
    )


def gpu_nodes_policy() -> dict[str, Any]:
    """Who may tolerate the GPU node taint. Bound to every namespace but the exempt ones."""
    tolerations = "(has(object.spec.tolerations) ? object.spec.tolerations : [])"
    old = "(has(oldObject.spec.tolerations) ? oldObject.spec.tolerations : [])"
    tenant = (
        f"has(namespaceObject.metadata.labels) && '{c.LABEL_TENANT}' in namespaceObject.metadata.labels "
        f"&& namespaceObject.metadata.labels['{c.LABEL_TENANT}'] == 'true'"
    )
    return _policy(
        f"{c.POLICY_PREFIX}gpu-nodes",
        [_rule("", ["pods"], ["CREATE", "UPDATE"])],
        [
            {
                "expression": f"!{tolerations}.exists(t, (!has(t.key) || t.key == '') && "
                "has(t.operator) && t.operator == 'Exists' && "
                f"(!has(t.effect) || t.effect == '' || t.effect == '{c.TAINT_GPU_EFFECT}'))",
                "message": "a toleration with operator Exists and no key tolerates every taint, "
                f"including {c.TAINT_GPU_KEY} that keeps GPU nodes for gpuslice slices. Name the "
                "taints the pod tolerates (key: ...); a platform component belongs in an exempt "
                "namespace (the operator's --exempt-namespace)",
            },
            {
                "expression": f"!{tolerations}.exists(t, has(t.key) && t.key == '{c.TAINT_GPU_KEY}') || "
                f"(({tenant}) && {HOLDS_SLICE})",
                "message": f"only pods that hold a GpuSlice's claim in a namespace entitled to gpuslice "
                f"may tolerate {c.TAINT_GPU_KEY} (the GPU nodes). Remove the toleration; to use a GPU, "
                "create a GpuSlice and reference its claim (gpuslice adds the toleration itself), or "
                "ask the platform team for an entitlement for this namespace",
            },
        ],
        match_conditions=[
            {
                "name": "tolerations-set-or-changed",
                "expression": f"request.operation == 'CREATE' || {tolerations} != {old}",
            }
        ],
    )


def gpu_toleration_mutation() -> dict[str, Any]:
    """Adds the GPU taint's toleration to a tenant pod that holds claims (MutatingAdmissionPolicy)."""
    toleration = (
        f'Object.spec.tolerations{{key: "{c.TAINT_GPU_KEY}", operator: "Exists", '
        f'effect: "{c.TAINT_GPU_EFFECT}"}}'
    )
    expression = (
        "has(object.spec.tolerations) ? "
        f'[JSONPatch{{op: "add", path: "/spec/tolerations/-", value: {toleration}}}] : '
        f'[JSONPatch{{op: "add", path: "/spec/tolerations", value: [{toleration}]}}]'
    )
    return {
        "apiVersion": ADMISSION_API,
        "kind": "MutatingAdmissionPolicy",
        "metadata": {
            "name": f"{c.POLICY_PREFIX}gpu-node-toleration",
            "labels": {c.LABEL_MANAGED_BY: c.MANAGED_BY_VALUE},
        },
        "spec": {
            "failurePolicy": "Fail",
            "reinvocationPolicy": "Never",
            "matchConstraints": {"resourceRules": [_rule("", ["pods"], ["CREATE"])]},
            "matchConditions": [
                {
                    "name": "holds-claims-without-the-toleration",
                    "expression": f"{HOLDS_SLICE} && !(has(object.spec.tolerations) && "
                    f"object.spec.tolerations.exists(t, has(t.key) && t.key == '{c.TAINT_GPU_KEY}'))",
                }
            ],
            "mutations": [{"patchType": "JSONPatch", "jsonPatch": {"expression": expression}}],
        },
    }


def namespace_labels_policy(config: AdmissionConfig) -> dict[str, Any]:
    """Only the operator sets the tenant label, and the Pod Security enforce labels of tenants."""
    allowed = _cel_list([*config.operator_identities, *config.extra_identities])

    def label(obj: str, key: str) -> str:
        return (
            f"({obj} != null && has({obj}.metadata.labels) && '{key}' in {obj}.metadata.labels ? "
            f"{obj}.metadata.labels['{key}'] : '')"
        )

    guarded = (c.PSA_ENFORCE, c.PSA_ENFORCE_VERSION)
    return _policy(
        f"{c.POLICY_PREFIX}namespace-labels",
        [_rule("", ["namespaces"], ["CREATE", "UPDATE"])],
        [
            {
                "expression": f"{label('object', c.LABEL_TENANT)} == {label('oldObject', c.LABEL_TENANT)}",
                "message": f"the label {c.LABEL_TENANT} is the gpuslice operator's: it sets it on the "
                "namespaces a GpuPackage entitlement selects, together with their quota and Pod "
                "Security level. Remove it from the namespace; to make the namespace a tenant, ask the "
                "platform team for an entitlement whose namespaceSelector matches its labels",
            },
            {
                "expression": f"{label('oldObject', c.LABEL_TENANT)} != 'true' || "
                + " && ".join(f"{label('object', k)} == {label('oldObject', k)}" for k in guarded),
                "message": "the Pod Security enforce labels of a gpuslice tenant namespace are set by the "
                "gpuslice operator (its --pod-security level, baseline or restricted): they keep pods "
                "off the node and out of other tenants' slices. Leave them; ask the platform team for "
                "--pod-security restricted if you want a stricter level",
            },
        ],
        match_conditions=[
            {"name": "not-the-operator", "expression": f"!(request.userInfo.username in {allowed})"}
        ],
    )


def pod_memory_policy(floor: str) -> dict[str, Any]:
    holds = (
        f"has(ct.resources) && ((has(ct.resources.claims) && size(ct.resources.claims) > 0) || "
        f"({_asks_product('ct')}))"
    )
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
    scheduler = _scheduler_claim() if resource == "resourceclaims" else "false"
    cons = f"{base}.devices.constraints"
    # Count 1, or a multi-GPU product's whole cards: `product-claims` holds each to its package's.
    exact = (
        "r.name == 'gpu' && has(r.exactly) && r.exactly.allocationMode == 'ExactCount' && "
        "r.exactly.count in [1, 2, 4, 8] && (!has(r.exactly.selectors) || size(r.exactly.selectors) == 0) && "
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
                "expression": f"(({scheduler}) && {_scheduler_claim_form(requests)}) || "
                f"(size({requests}) == 1 && {requests}.all(r, {exact}))",
                "message": "a claim for a gpuslice DeviceClass has one request named gpu with "
                "allocationMode ExactCount and count 1, and no selectors, capacity, adminAccess, "
                "tolerations or firstAvailable" + tail,
            },
            {
                "expression": f"(!has({cons}) || size({cons}) == 0 || "
                f"(size({cons}) == 1 && {cons}.all(k, {_TOPOLOGY_CONSTRAINT}))) "
                f"&& (!has({base}.devices.config) || size({base}.devices.config) == 0)",
                "message": "a claim for a gpuslice DeviceClass may not carry constraints or config: "
                "the product fixes them" + tail,
            },
            {
                "expression": f"(({scheduler}) && {_scheduler_claim_form(requests)}) || "
                f"(has({labels}) && '{c.LABEL_PACKAGE}' in {labels} && "
                f"{requests}.all(r, !has(r.exactly) || "
                f"{labels}['{c.LABEL_PACKAGE}'] + '{c.DEVICE_CLASS_SUFFIX}' == r.exactly.deviceClassName))",
                "message": f"a claim for a gpuslice DeviceClass carries the label {c.LABEL_PACKAGE}: "
                "<package>, matching its DeviceClass <package>.gpuslice.io" + tail,
            },
        ],
        match_conditions=[{"name": "uses-gpuslice-class", "expression": uses}],
    )


#: CEL: the one constraint a multi-GPU product's claim may carry (`product-claims` checks it is the
#: package's own): all cards share the PCIe root or the NUMA node.
_TOPOLOGY_CONSTRAINT = (
    f"has(k.matchAttribute) && k.matchAttribute in ['{PCIE_ROOT_ATTRIBUTE}', '{NUMA_NODE_ATTRIBUTE}'] && "
    f"has(k.requests) && k.requests == ['{c.CLAIM_REQUEST_NAME}']"
)


def _product_claim_policy(name: str, resource: str, base: str, labels: str) -> dict[str, Any]:
    """Each GpuPackage (the policy's params, every one of them) holds the claims labelled with its
    name to its own form: count 1 for a slice; `gpus` and the topology's constraint for a multi-GPU
    product. The `claims` policy already refuses everything else."""
    requests = f"{base}.devices.requests"
    constraints = f"{base}.devices.constraints"
    uses = (
        f"has({base}.devices) && has({requests}) && {requests}.exists(r, "
        f"has(r.exactly) && r.exactly.deviceClassName.endsWith('{c.DEVICE_CLASS_SUFFIX}')) && "
        f"has({labels}) && '{c.LABEL_PACKAGE}' in {labels}"
    )
    count = "(has(params.spec.gpus) ? params.spec.gpus : 1)"
    attribute = (
        f"(params.spec.topology == 'SamePcieRoot' ? '{PCIE_ROOT_ATTRIBUTE}' : '{NUMA_NODE_ATTRIBUTE}')"
    )
    wants = "has(params.spec.gpus) && has(params.spec.topology) && params.spec.topology != 'Any'"
    none = f"(!has({constraints}) || size({constraints}) == 0)"
    form = documented_form_text(one_line=True)
    policy = _policy(
        name,
        [_rule(c.DRA_GROUP, [resource], ["CREATE", "UPDATE"])],
        [
            {
                "expression": f"{labels}['{c.LABEL_PACKAGE}'] != params.metadata.name || ("
                # No count (allocationMode All): the `claims` policy refuses it, with its own message.
                f"{requests}.all(r, !has(r.exactly) || !has(r.exactly.count) || "
                f"r.exactly.count == {count}) && "
                f"(({wants}) ? (has({constraints}) && size({constraints}) == 1 && "
                f"has({constraints}[0].matchAttribute) && "
                f"{constraints}[0].matchAttribute == {attribute}) : {none}))",
                "messageExpression": "'a claim for a gpuslice DeviceClass has one request named gpu with "
                "allocationMode ExactCount and count 1, or for the multi-GPU product ' + "
                f"params.metadata.name + ' count ' + string({count}) + "
                "' and the matchAttribute constraint of its topology ' + "
                "(has(params.spec.topology) ? params.spec.topology : 'Any') + "
                "'. Create a GpuSlice instead (it writes the claim for you), or use exactly this form: "
                f"{form}'",
                "message": "a claim for a gpuslice DeviceClass has allocationMode ExactCount and count 1 "
                "(a multi-GPU product: its gpus and topology constraint). Create a GpuSlice instead",
            }
        ],
        match_conditions=[{"name": "names-gpuslice-package", "expression": uses}],
    )
    policy["spec"]["paramKind"] = {"apiVersion": c.GROUP_VERSION, "kind": c.PACKAGE_KIND}
    return policy


def _other_claim_policy(name: str, resource: str, base: str) -> dict[str, Any]:
    """Claims that name no gpuslice DeviceClass must not reach gpuslice devices another way."""
    requests = f"{base}.devices.requests"
    uses = (
        f"has({base}.devices) && has({requests}) && {requests}.exists(r, "
        f"(has(r.exactly) && r.exactly.deviceClassName.endsWith('{c.DEVICE_CLASS_SUFFIX}')) || "
        f"(has(r.firstAvailable) && r.firstAvailable.exists(s, "
        f"s.deviceClassName.endsWith('{c.DEVICE_CLASS_SUFFIX}'))))"
    )

    # Every exact request and every firstAvailable subrequest, as one list of maps of the same shape.
    def each(cond: str) -> str:
        return (
            f"{requests}.exists(r, (has(r.exactly) && {cond.replace('X', 'r.exactly')}) || "
            f"(has(r.firstAvailable) && r.firstAvailable.exists(s, {cond.replace('X', 's')})))"
        )

    names_us = (
        "has(X.selectors) && X.selectors.exists(sel, has(sel.cel) && "
        "sel.cel.expression.lowerAscii().contains('gpuslice'))"
    )
    tenant = (
        f"has(namespaceObject.metadata.labels) && '{c.LABEL_TENANT}' in namespaceObject.metadata.labels "
        f"&& namespaceObject.metadata.labels['{c.LABEL_TENANT}'] == 'true'"
    )
    wide = "(has(X.allocationMode) && X.allocationMode == 'All') || (has(X.adminAccess) && X.adminAccess)"
    tail = (
        ". gpuslice devices are reached only through a GpuSlice (or a claim of the documented form "
        f"for <package>{c.DEVICE_CLASS_SUFFIX}): create a GpuSlice instead"
    )
    return _policy(
        name,
        [_rule(c.DRA_GROUP, [resource], ["CREATE", "UPDATE"])],
        [
            {
                "expression": f"!has({base}.devices) || !has({requests}) || !({each(names_us)})",
                "message": "a claim for another DeviceClass may not select devices with a CEL selector "
                "that names gpuslice (for instance device.driver == 'gpuslice.io')" + tail,
            },
            {
                "expression": f"!has({base}.devices) || !has({base}.devices.config) || "
                f"!{base}.devices.config.exists(cf, has(cf.opaque) && "
                f"cf.opaque.driver.lowerAscii().contains('gpuslice'))",
                "message": f"a claim may not pass configuration to driver {c.DRIVER_NAME}: the product "
                "fixes it" + tail,
            },
            {
                "expression": f"!({tenant}) || !has({base}.devices) || !has({requests}) || !({each(wide)})",
                "message": "in a gpuslice tenant namespace a claim may not use allocationMode All or "
                "adminAccess, for any DeviceClass: either could take every GPU slice of a node. Ask for "
                "a count of devices (allocationMode ExactCount)" + tail,
            },
        ],
        match_conditions=[{"name": "names-no-gpuslice-class", "expression": f"!({uses})"}],
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
    return _policy(
        f"{c.POLICY_PREFIX}protect",
        [
            _rule(c.DRA_GROUP, ["resourceclaims", "resourceclaimtemplates", "deviceclasses"], ["*"]),
            _rule("", ["resourcequotas"], ["*"]),
        ],
        [
            {
                "expression": f"request.userInfo.username in {allowed}",
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
    not_exempt = {
        "namespaceSelector": {
            "matchExpressions": [
                {
                    "key": c.LABEL_NAMESPACE_NAME,
                    "operator": "NotIn",
                    "values": sorted(set(config.exempt_namespaces)),
                }
            ]
        }
    }
    pairs: list[tuple[dict[str, Any], list[str], dict[str, Any] | None]] = [
        (pods_policy(), ["Deny"], tenant),
        (pod_products_policy(), ["Deny"], None),
        (workload_products_policy(), ["Deny"], None),
        (pod_slices_policy(config), ["Deny"], None),
        (pod_memory_policy(config.memory_floor), ["Warn"], tenant),
        (gpu_nodes_policy(), ["Deny"], not_exempt),
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
        (
            _product_claim_policy(
                f"{c.POLICY_PREFIX}product-claims", "resourceclaims", "object.spec", "object.metadata.labels"
            ),
            ["Deny"],
            None,
        ),
        (
            _product_claim_policy(
                f"{c.POLICY_PREFIX}product-claim-templates",
                "resourceclaimtemplates",
                "object.spec.spec",
                "object.spec.metadata.labels",
            ),
            ["Deny"],
            None,
        ),
        (
            _other_claim_policy(f"{c.POLICY_PREFIX}other-claims", "resourceclaims", "object.spec"),
            ["Deny"],
            None,
        ),
        (
            _other_claim_policy(
                f"{c.POLICY_PREFIX}other-claim-templates", "resourceclaimtemplates", "object.spec.spec"
            ),
            ["Deny"],
            None,
        ),
        (namespace_labels_policy(config), ["Deny"], None),
        (vm_policy(), ["Deny"], tenant),
        (protect_policy(config), ["Deny"], managed),
    ]
    policies = [p for p, _, _ in pairs]
    bindings = [_binding(p["metadata"]["name"], actions, match) for p, actions, match in pairs]
    for b in bindings:
        if b["metadata"]["name"].startswith(f"{c.POLICY_PREFIX}product-claim"):
            # Every GpuPackage is a param: each holds the claims labelled with its name to its form.
            b["spec"]["paramRef"] = {"selector": {}, "parameterNotFoundAction": "Allow"}
    mutation = gpu_toleration_mutation()
    mutating = [mutation, _binding(mutation["metadata"]["name"], None, tenant, "MutatingAdmissionPolicy")]
    return policies + mutating[:1] + bindings + mutating[1:]
