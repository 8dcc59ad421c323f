"""Tenant isolation on the real control plane: every way to a GPU but a gpuslice claim,
tried the way an attacker would, refused by Pod Security Admission, gpuslice's policies or the GPU
node taint, with a message that says what is wrong.

One operator serves the module. Mallory is a client-certificate user with `edit` and the gpuslice
tenant role in the tenant namespace and `edit` in a second namespace that holds no entitlement, and
she may create and label namespaces (as in clusters that let tenants make their own projects).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from gpuslice import constants as c
from gpuslice.domain.isolation import taint_patch
from gpuslice_dev.agents import agent_kubeconfig
from gpuslice_dev.devcluster.cluster import DevCluster, node_manifest
from support import apply, pod_doc, published, skip_unless_served, slice_doc, wait_for

from .operator_cluster import (
    TEST_LABEL,
    OperatorProcess,
    get,
    kubectl_as,
    package_doc,
    publish_gpus,
    tenant_rbac,
    wait_status,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow(seconds=110)]
NS_LABEL = "gpuslice-test/isolation"
#: --max-gpuslices-per-namespace of the module's operator.
MAX_SLICES = 4


@dataclass
class Iso:
    cluster: DevCluster
    token: str
    tenant: str  # entitled namespace
    other: str  # a namespace of the same user that holds no entitlement
    mallory: Path
    gpu_node: str

    @property
    def pkg(self) -> str:
        return f"iso{self.token}"

    @property
    def device_class(self) -> str:
        return c.device_class_name(self.pkg)


def _labels(cluster: DevCluster, ns: str) -> dict[str, str]:
    return (get(cluster, "namespace", ns) or {}).get("metadata", {}).get("labels", {})


@pytest.fixture(scope="module")
def iso(cluster: DevCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Iso]:
    cluster.apply_crds()
    token = "i" + uuid.uuid4().hex[:5]
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    offered = f"iso-offered-{token}"
    op = OperatorProcess(
        cluster,
        log,
        "--recheck-seconds=2",
        f"--tenant-priority-class={offered}",
        f"--max-gpuslices-per-namespace={MAX_SLICES}",
    )
    op.start()
    tenant, other, gpu_node = f"iso-tenant-{token}", f"iso-other-{token}", f"iso-gpu-{token}"
    try:
        wait_for(
            lambda: get(cluster, "validatingadmissionpolicybinding", "gpuslice-gpu-nodes"), 60, "policies"
        )
        cluster.create_namespace(tenant, {NS_LABEL: token})
        cluster.create_namespace(other)
        apply(
            cluster,
            [
                {
                    "apiVersion": "scheduling.k8s.io/v1",
                    "kind": "PriorityClass",
                    "metadata": {"name": offered, "labels": {TEST_LABEL: "true"}},
                    "value": 1000,
                }
            ],
        )
        apply(cluster, [package_doc(f"iso{token}", 25, {NS_LABEL: token}, slices=2)])
        wait_for(lambda: _labels(cluster, tenant).get(c.PSA_ENFORCE) == "baseline", 30, "Pod Security labels")
        node = node_manifest(gpu_node)
        node["metadata"]["labels"]["nvidia.com/gpu.present"] = "true"  # type: ignore[index]
        node["metadata"]["labels"][TEST_LABEL] = "true"  # type: ignore[index]
        apply(cluster, [node])
        with tenant_rbac(cluster, tenant, f"mallory-{token}") as mallory:
            user = f"mallory-{token}"
            subject = [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]
            apply(
                cluster,
                [
                    {
                        "apiVersion": "rbac.authorization.k8s.io/v1",
                        "kind": "RoleBinding",
                        "metadata": {"name": f"{user}-edit", "namespace": other},
                        "roleRef": {
                            "apiGroup": "rbac.authorization.k8s.io",
                            "kind": "ClusterRole",
                            "name": "edit",
                        },
                        "subjects": subject,
                    },
                    # `kubectl debug` needs the ephemeral containers subresource, which edit lacks.
                    {
                        "apiVersion": "rbac.authorization.k8s.io/v1",
                        "kind": "Role",
                        "metadata": {"name": f"{user}-debug", "namespace": tenant},
                        "rules": [
                            {
                                "apiGroups": [""],
                                "resources": ["pods/ephemeralcontainers"],
                                "verbs": ["patch", "update"],
                            }
                        ],
                    },
                    {
                        "apiVersion": "rbac.authorization.k8s.io/v1",
                        "kind": "RoleBinding",
                        "metadata": {"name": f"{user}-debug", "namespace": tenant},
                        "roleRef": {
                            "apiGroup": "rbac.authorization.k8s.io",
                            "kind": "Role",
                            "name": f"{user}-debug",
                        },
                        "subjects": subject,
                    },
                    # Runtime classes a GPU cluster has (the RuntimeClass plugin refuses unknown ones first).
                    *[
                        {
                            "apiVersion": "node.k8s.io/v1",
                            "kind": "RuntimeClass",
                            "metadata": {"name": n},
                            "handler": n,
                        }
                        for n in ("nvidia", "kata")
                    ],
                    {
                        "apiVersion": "rbac.authorization.k8s.io/v1",
                        "kind": "ClusterRole",
                        "metadata": {"name": f"iso-namespaces-{token}"},
                        "rules": [
                            {
                                "apiGroups": [""],
                                "resources": ["namespaces"],
                                "verbs": ["create", "patch", "update"],
                            }
                        ],
                    },
                    {
                        "apiVersion": "rbac.authorization.k8s.io/v1",
                        "kind": "ClusterRoleBinding",
                        "metadata": {"name": f"iso-namespaces-{token}"},
                        "roleRef": {
                            "apiGroup": "rbac.authorization.k8s.io",
                            "kind": "ClusterRole",
                            "name": f"iso-namespaces-{token}",
                        },
                        "subjects": subject,
                    },
                ],
            )
            yield Iso(cluster, token, tenant, other, mallory, gpu_node)
    finally:
        cluster.kubectl(
            "delete", "gpuslices.gpuslice.io", "-A", "-l", TEST_LABEL, "--wait=false", check=False
        )
        cluster.kubectl("delete", "gpuslices.gpuslice.io", "--all", "-n", tenant, "--wait=false", check=False)
        cluster.kubectl("delete", "gpupackages.gpuslice.io", f"iso{token}", "--timeout=60s", check=False)
        op.stop()
        cluster.kubectl(
            "delete",
            "validatingadmissionpolicybindings,validatingadmissionpolicies,"
            "mutatingadmissionpolicybindings,mutatingadmissionpolicies",
            "-l",
            f"{c.LABEL_MANAGED_BY}={c.MANAGED_BY_VALUE}",
            check=False,
        )
        for ns in (tenant, other):
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        cluster.kubectl("delete", "node", gpu_node, "--wait=false", check=False)
        cluster.kubectl("delete", "runtimeclass", "nvidia", "kata", check=False)
        cluster.kubectl("delete", "priorityclass", offered, check=False)
        cluster.kubectl("delete", "resourceslices", "-l", TEST_LABEL, check=False)
        print(op.tail(), flush=True)


def dry_run(iso: Iso, doc: dict[str, Any], kubeconfig: Path | None = None) -> Any:
    return kubectl_as(
        iso.cluster,
        kubeconfig or iso.mallory,
        "create",
        "--dry-run=server",
        "-o",
        "json",
        "-f",
        "-",
        input=json.dumps(doc),
    )


def refused(iso: Iso, doc: dict[str, Any], *expect: str, kubeconfig: Path | None = None) -> str:
    proc = dry_run(iso, doc, kubeconfig)
    assert proc.returncode != 0, f"accepted: {json.dumps(doc)}"
    for e in expect:
        assert e in proc.stderr, proc.stderr
    return str(proc.stderr)


def accepted(iso: Iso, doc: dict[str, Any], kubeconfig: Path | None = None) -> dict[str, Any]:
    proc = dry_run(iso, doc, kubeconfig)
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout))


def plain_pod(name: str, namespace: str) -> dict[str, Any]:
    doc = pod_doc(name, namespace)
    doc["spec"].pop("resourceClaims")
    doc["spec"]["containers"][0]["resources"] = {"limits": {"memory": "1Gi"}}
    return doc


def _ct(doc: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = doc["spec"]["containers"][0]
    return container


# --- holes 2, 4, 5: Pod Security baseline in tenant namespaces ------------------------------------------


def _host_path(path: str) -> Any:
    def edit(d: dict[str, Any]) -> None:
        d["spec"]["volumes"] = [{"name": "h", "hostPath": {"path": path}}]
        _ct(d)["volumeMounts"] = [{"name": "h", "mountPath": "/h"}]

    return edit


def _sc(**sc: Any) -> Any:
    def edit(d: dict[str, Any]) -> None:
        _ct(d)["securityContext"] = sc

    return edit


def _spec(**fields: Any) -> Any:
    def edit(d: dict[str, Any]) -> None:
        d["spec"].update(fields)

    return edit


POD_SECURITY_CASES = {
    "hostPID": (_spec(hostPID=True), "host namespaces"),
    "hostIPC": (_spec(hostIPC=True), "host namespaces"),
    "hostNetwork": (_spec(hostNetwork=True), "host namespaces"),
    "hostPath-run-cdi": (_host_path("/run/cdi"), "hostPath volumes"),
    "hostPath-proc-1-root": (_host_path("/proc/1/root/var/lib/gpuslice"), "hostPath volumes"),
    "hostPath-proc-self-root": (_host_path("/proc/self/root/etc/cdi"), "hostPath volumes"),
    "hostPath-kubelet-pods": (_host_path("/var/lib/kubelet/pods"), "hostPath volumes"),
    "hostPath-containerd": (_host_path("/run/containerd"), "hostPath volumes"),
    "hostPath-root": (_host_path("/"), "hostPath volumes"),
    "hostPath-double-slash": (_host_path("//var/lib//gpuslice"), "hostPath volumes"),
    "privileged": (_sc(privileged=True), "privileged"),
    "cap-SYS_ADMIN": (_sc(capabilities={"add": ["SYS_ADMIN"]}), "non-default capabilities"),
    "cap-prefixed": (_sc(capabilities={"add": ["CAP_SYS_ADMIN"]}), "non-default capabilities"),
    "cap-lowercase": (_sc(capabilities={"add": ["sys_ptrace"]}), "non-default capabilities"),
    "cap-DAC_READ_SEARCH": (_sc(capabilities={"add": ["DAC_READ_SEARCH"]}), "non-default capabilities"),
    "cap-BPF": (_sc(capabilities={"add": ["BPF"]}), "non-default capabilities"),
    "cap-PERFMON": (_sc(capabilities={"add": ["PERFMON"]}), "non-default capabilities"),
    "cap-ALL": (_sc(capabilities={"add": ["ALL"]}), "non-default capabilities"),
    "seccomp-unconfined": (_sc(seccompProfile={"type": "Unconfined"}), "seccompProfile"),
    "pod-seccomp-unconfined": (
        _spec(securityContext={"seccompProfile": {"type": "Unconfined"}}),
        "seccompProfile",
    ),
    "apparmor-unconfined": (_sc(appArmorProfile={"type": "Unconfined"}), "AppArmor profile"),
    # Unmasked /proc is only valid in a user namespace (hostUsers: false), where baseline allows it:
    # the host's /proc is not what it unmasks.
    "procMount-unmasked": (_sc(procMount="Unmasked"), "`hostUsers` must be false to use `Unmasked`"),
}


@pytest.mark.parametrize("holds_claim", [True, False], ids=["claim-pod", "claimless-pod"])
@pytest.mark.parametrize("case", sorted(POD_SECURITY_CASES))
def test_pod_security_baseline_refuses_node_access_in_tenant_namespaces(
    iso: Iso, case: str, holds_claim: bool
) -> None:
    edit, expect = POD_SECURITY_CASES[case]
    doc = pod_doc("p", iso.tenant, "nothing-yet") if holds_claim else plain_pod("p", iso.tenant)
    edit(doc)
    psa = () if "hostUsers" in expect else ('violates PodSecurity "baseline:latest"',)
    refused(iso, doc, *psa, expect)


def test_pod_security_also_covers_ephemeral_containers_added_later(iso: Iso) -> None:
    name = f"debug-{uuid.uuid4().hex[:4]}"
    proc = kubectl_as(
        iso.cluster, iso.mallory, "create", "-f", "-", input=json.dumps(plain_pod(name, iso.tenant))
    )
    assert proc.returncode == 0, proc.stderr
    # `kubectl debug --profile=sysadmin` adds a privileged ephemeral container (the subresource).
    proc = kubectl_as(
        iso.cluster, iso.mallory, "debug", name, "-n", iso.tenant, "--image=busybox", "--profile=sysadmin"
    )
    assert proc.returncode != 0 and "PodSecurity" in proc.stderr and "privileged" in proc.stderr, proc.stderr


def test_tenant_namespaces_carry_baseline_enforce_warn_and_audit(iso: Iso) -> None:
    labels = _labels(iso.cluster, iso.tenant)
    assert labels[c.LABEL_TENANT] == "true"
    for key in (c.PSA_ENFORCE, c.PSA_WARN, c.PSA_AUDIT):
        assert labels[key] == "baseline", key
    assert labels[c.PSA_ENFORCE_VERSION] == "latest"


# --- gpuslice's pod policy: what Pod Security does not know ---------------------------------------------


def _env(name: str, where: str = "containers") -> Any:
    def edit(d: dict[str, Any]) -> None:
        if where == "initContainers":
            d["spec"]["initContainers"] = [
                {"name": "init", "image": "x", "env": [{"name": name, "value": "all"}]}
            ]
        else:
            _ct(d)["env"] = [{"name": name, "value": "all"}]

    return edit


def _env_from(source: dict[str, Any]) -> Any:
    def edit(d: dict[str, Any]) -> None:
        _ct(d)["envFrom"] = [source]

    return edit


def _raw(resource: str) -> Any:
    def edit(d: dict[str, Any]) -> None:
        _ct(d)["resources"]["limits"][resource] = "1"

    return edit


GPU_POD_CASES = {
    "raw-nvidia-gpu": (_raw("nvidia.com/gpu"), "GPUs as extended resources", "create a GpuSlice"),
    "raw-nvidia-mig": (_raw("nvidia.com/mig-1g.5gb"), "GPUs as extended resources", "create a GpuSlice"),
    # a product in resources.limits is the other form of a slice: not both in one pod
    "product-and-claim": (_raw("gpuslice.io/v100-8g"), "or through resource claims, not both", "GpuSlice"),
    "raw-deviceclass": (
        _raw("deviceclass.resource.kubernetes.io/v100-8g.gpuslice.io"),
        "deviceclass.resource.kubernetes.io/*",
        "create a GpuSlice",
    ),
    "env-visible-devices": (_env("NVIDIA_VISIBLE_DEVICES"), "NVIDIA_VISIBLE_DEVICES", "Remove the variable"),
    "env-lowercase": (_env("nvidia_visible_devices"), "NVIDIA_", "Remove the variable"),
    "env-other-nvidia": (_env("NVIDIA_MIG_CONFIG_DEVICES"), "NVIDIA_", "Remove the variable"),
    "env-gpuslice": (_env("GPUSLICE_LIMIT_BYTES"), "GPUSLICE_", "Remove the variable"),
    "env-ld-preload": (_env("LD_PRELOAD"), "LD_PRELOAD", "Remove the variable"),
    "env-init-container": (_env("NVIDIA_VISIBLE_DEVICES", "initContainers"), "NVIDIA_VISIBLE_DEVICES"),
    "envFrom-configmap": (_env_from({"configMapRef": {"name": "x"}}), "envFrom", "one by one under env"),
    "envFrom-secret": (_env_from({"secretRef": {"name": "x"}}), "envFrom", "one by one under env"),
    "envFrom-prefixed": (
        _env_from({"prefix": "NVIDIA_", "configMapRef": {"name": "x"}}),
        "envFrom",
        "one by one under env",
    ),
    "runtime-class-nvidia": (_spec(runtimeClassName="nvidia"), "runtimeClassName", "Remove it"),
    "runtime-class-other": (_spec(runtimeClassName="kata"), "runtimeClassName", "Remove it"),
    "node-name": (_spec(nodeName="kwok-node-0"), "spec.nodeName", "nodeSelector"),
}


@pytest.mark.parametrize("case", sorted(GPU_POD_CASES))
def test_gpu_pods_may_not_take_gpus_past_their_claim(iso: Iso, case: str) -> None:
    edit, *expect = GPU_POD_CASES[case]
    doc = pod_doc("p", iso.tenant, "nothing-yet")
    edit(doc)
    refused(iso, doc, *expect)


def test_raw_gpu_requests_are_refused_without_a_claim_too(iso: Iso) -> None:
    doc = plain_pod("p", iso.tenant)
    _raw("nvidia.com/gpu")(doc)
    refused(iso, doc, "nvidia.com/gpu", "resourceClaimName")


def test_the_documented_pod_is_accepted_and_gets_the_gpu_node_toleration(iso: Iso) -> None:
    skip_unless_served(
        iso.cluster,
        "admissionregistration.k8s.io/v1",
        "mutatingadmissionpolicies",
        "the gpu-node-toleration MutatingAdmissionPolicy",
    )
    doc = pod_doc("p", iso.tenant, "nothing-yet")
    _ct(doc)["env"] = [{"name": "CUDA_LAUNCH_BLOCKING", "value": "1"}]  # plain CUDA_* stays allowed
    out = accepted(iso, doc)
    assert {"key": c.TAINT_GPU_KEY, "operator": "Exists", "effect": "NoExecute"} in out["spec"]["tolerations"]


# --- priority: a tenant may not preempt another tenant's pods -------------------------------------------


@pytest.mark.parametrize("holds_claim", [True, False], ids=["claim-pod", "claimless-pod"])
@pytest.mark.parametrize("priority_class", ["system-node-critical", "system-cluster-critical"])
def test_a_tenant_pod_may_not_take_a_priority_that_evicts_other_tenants(
    iso: Iso, priority_class: str, holds_claim: bool
) -> None:
    # Admitted, system-node-critical let kube-scheduler preempt another tenant's GPU pod and hand
    # its slice to the attacker's next pod.
    doc = pod_doc("p", iso.tenant, "nothing-yet") if holds_claim else plain_pod("p", iso.tenant)
    doc["spec"]["priorityClassName"] = priority_class
    refused(
        iso,
        doc,
        f"priorityClassName {priority_class} is not offered to gpuslice tenants",
        f"use one the platform offers tenants (iso-offered-{iso.token}) or none",
    )


def test_a_priority_class_the_platform_offers_tenants_is_accepted(iso: Iso) -> None:
    doc = pod_doc("p", iso.tenant, "nothing-yet")
    doc["spec"]["priorityClassName"] = f"iso-offered-{iso.token}"
    assert accepted(iso, doc)["spec"]["priority"] == 1000
    # Outside tenant namespaces the platform's rules are its own.
    doc = plain_pod("p", iso.other)
    doc["spec"]["priorityClassName"] = "system-cluster-critical"
    accepted(iso, doc)


# --- seccomp: the runtime's default profile for containers that hold slices --------------------------


def test_slice_pods_get_the_runtime_default_seccomp_profile(iso: Iso) -> None:
    skip_unless_served(
        iso.cluster,
        "admissionregistration.k8s.io/v1",
        "mutatingadmissionpolicies",
        "the slice-seccomp MutatingAdmissionPolicy",
    )
    # Without one, baseline leaves seccomp Unconfined: the container's root could `unshare -Urm` and
    # bind-mount /dev/null over the read-only /etc/ld.so.preload (tests/node: the attack on a real node).
    out = accepted(iso, pod_doc("p", iso.tenant, "nothing-yet"))
    assert out["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    doc = pod_doc("p", iso.tenant, "nothing-yet")
    doc["spec"]["securityContext"] = {"runAsUser": 1000}
    out = accepted(iso, doc)
    assert out["spec"]["securityContext"] == {"runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}}
    # a pod asking for the product in resources.limits gets its slice through kube-scheduler's claim
    product = plain_pod("p", iso.tenant)
    _ct(product)["resources"]["limits"][f"gpuslice.io/{iso.pkg}"] = "1"
    assert accepted(iso, product)["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    # A profile the pod names itself is kept (Pod Security refuses Unconfined: POD_SECURITY_CASES).
    doc["spec"]["securityContext"] = {"seccompProfile": {"type": "Localhost", "localhostProfile": "p.json"}}
    assert accepted(iso, doc)["spec"]["securityContext"]["seccompProfile"]["type"] == "Localhost"
    assert "securityContext" not in accepted(iso, plain_pod("p", iso.tenant))["spec"] or (
        "seccompProfile" not in accepted(iso, plain_pod("p", iso.tenant))["spec"]["securityContext"]
    )


# --- GPU nodes are tainted; only claim pods of tenants and exempt namespaces tolerate it --------


def test_gpu_nodes_get_the_taint(iso: Iso) -> None:
    def tainted() -> bool:
        taints = (get(iso.cluster, "node", iso.gpu_node) or {}).get("spec", {}).get("taints") or []
        return any(t.get("key") == c.TAINT_GPU_KEY and t.get("effect") == "NoExecute" for t in taints)

    wait_for(tainted, 30, "the GPU node taint")


def test_the_gpu_taint_from_a_stale_view_of_a_node_never_drops_another_taint(iso: Iso) -> None:
    """The operator decides on the Node as its watch last showed it; meanwhile node-lifecycle may
    have added a taint (not-ready, unreachable, unschedulable). The API server is the judge: the
    patch is refused (the next Node event decides again) or keeps that taint, never replaces it."""
    label = f"gpuslice-test/stale-{iso.token}"
    name = f"stale-{iso.token}"
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {label: "true"}}}
    iso.cluster.kubectl("create", "-f", "-", input=json.dumps(node))

    def patch_as_seen(node: dict[str, Any], check: bool) -> set[str]:
        """The operator's patch decided on `node` (a view of it), applied; the node's taint keys after."""
        meta = node["metadata"]
        ops = taint_patch(
            meta["labels"], node["spec"].get("taints"), f"{label}=true", meta["resourceVersion"]
        )
        assert ops is not None
        iso.cluster.kubectl("patch", "node", name, "--type=json", "-p", json.dumps(ops), check=check)
        return {t["key"] for t in get(iso.cluster, "node", name)["spec"].get("taints") or []}

    try:
        seen = get(iso.cluster, "node", name)
        iso.cluster.kubectl("taint", "node", name, "example.com/meanwhile=yes:NoSchedule")
        taints = patch_as_seen(seen, check=False)
        assert "example.com/meanwhile" in taints, taints
        # Decided again on the Node as it is now: the taint goes on beside the other.
        taints = patch_as_seen(get(iso.cluster, "node", name), check=True)
        assert {"example.com/meanwhile", c.TAINT_GPU_KEY} <= taints, taints
    finally:
        iso.cluster.kubectl("delete", "node", name, "--wait=false", check=False)


GPU_TOLERATION = {"key": c.TAINT_GPU_KEY, "operator": "Exists", "effect": "NoExecute"}
ONLY_CLAIM_PODS = (f"may tolerate {c.TAINT_GPU_KEY}", "Remove the toleration", "create a GpuSlice")
EVERYTHING = ("tolerates every taint", "Name the taints")
TOLERATION_CASES: dict[str, tuple[str, bool, list[dict[str, Any]], tuple[str, ...]]] = {
    "other-namespace-gpu-toleration": ("other", False, [GPU_TOLERATION], ONLY_CLAIM_PODS),
    "other-namespace-claim-pod": ("other", True, [GPU_TOLERATION], ONLY_CLAIM_PODS),
    "other-namespace-equal-operator": (
        "other",
        False,
        [{"key": c.TAINT_GPU_KEY, "operator": "Equal", "value": "present"}],
        ONLY_CLAIM_PODS,
    ),
    "other-namespace-tolerate-everything": ("other", False, [{"operator": "Exists"}], EVERYTHING),
    "tenant-claimless-gpu-toleration": ("tenant", False, [GPU_TOLERATION], ONLY_CLAIM_PODS),
    "tenant-tolerate-everything": (
        "tenant",
        True,
        [{"operator": "Exists", "effect": "NoExecute"}],
        EVERYTHING,
    ),
}


@pytest.mark.parametrize("case", sorted(TOLERATION_CASES))
def test_only_tenant_claim_pods_may_tolerate_the_gpu_node_taint(iso: Iso, case: str) -> None:
    where, claim, tolerations, expect = TOLERATION_CASES[case]
    ns = iso.tenant if where == "tenant" else iso.other
    doc = pod_doc("p", ns, "nothing-yet") if claim else plain_pod("p", ns)
    doc["spec"]["tolerations"] = tolerations
    refused(iso, doc, *expect)


def test_a_toleration_added_to_a_running_pod_is_refused(iso: Iso) -> None:
    name = f"later-{uuid.uuid4().hex[:4]}"
    proc = kubectl_as(
        iso.cluster, iso.mallory, "create", "-f", "-", input=json.dumps(plain_pod(name, iso.other))
    )
    assert proc.returncode == 0, proc.stderr
    patch = json.dumps([{"op": "add", "path": "/spec/tolerations/-", "value": GPU_TOLERATION}])
    proc = kubectl_as(
        iso.cluster, iso.mallory, "patch", "pod", name, "-n", iso.other, "--type=json", "-p", patch
    )
    assert proc.returncode != 0 and f"may tolerate {c.TAINT_GPU_KEY}" in proc.stderr, proc.stderr


def test_exempt_platform_namespaces_may_tolerate_everything(iso: Iso) -> None:
    doc = plain_pod("p", "kube-system")
    doc["spec"]["tolerations"] = [{"operator": "Exists"}]
    accepted(iso, doc, iso.cluster.kubeconfig)


def test_a_pod_bound_to_a_gpu_node_by_node_name_is_evicted(iso: Iso) -> None:
    test_gpu_nodes_get_the_taint(iso)
    name = f"pinned-{uuid.uuid4().hex[:4]}"
    doc = plain_pod(name, iso.other)
    doc["spec"]["nodeName"] = iso.gpu_node  # bypasses the scheduler, and with it the taint's NoSchedule
    proc = kubectl_as(iso.cluster, iso.mallory, "create", "-f", "-", input=json.dumps(doc))
    assert proc.returncode == 0, proc.stderr
    # kube-controller-manager's taint-eviction controller deletes it: NoExecute, not tolerated.
    wait_for(lambda: get(iso.cluster, "pod", name, "-n", iso.other) is None, 60, "the pinned pod evicted")


# --- the tenant label and Pod Security labels are the operator's ----------------------------------


def test_a_self_made_tenant_namespace_is_refused(iso: Iso) -> None:
    doc = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": f"self-{iso.token}", "labels": {c.LABEL_TENANT: "true"}},
    }
    refused(iso, doc, f"the label {c.LABEL_TENANT} is the gpuslice operator's", "ask the platform team")


@pytest.mark.parametrize(
    ("target", "label", "expect"),
    [
        ("other", f"{c.LABEL_TENANT}=true", "is the gpuslice operator's"),
        ("tenant", f"{c.LABEL_TENANT}-", "is the gpuslice operator's"),
        ("tenant", f"{c.PSA_ENFORCE}=privileged", "Pod Security enforce labels"),
        ("tenant", f"{c.PSA_ENFORCE}-", "Pod Security enforce labels"),
        ("tenant", f"{c.PSA_ENFORCE_VERSION}=v1.0", "Pod Security enforce labels"),
    ],
    ids=["label-other-namespace-tenant", "drop-tenant-label", "lower-enforce", "drop-enforce", "old-version"],
)
def test_tenants_cannot_change_the_labels_isolation_rests_on(
    iso: Iso, target: str, label: str, expect: str
) -> None:
    ns = iso.tenant if target == "tenant" else iso.other
    proc = kubectl_as(iso.cluster, iso.mallory, "label", "namespace", ns, label, "--overwrite")
    assert proc.returncode != 0 and expect in proc.stderr, proc.stderr


def test_a_tenant_label_nobody_entitled_is_removed(iso: Iso) -> None:
    ns = iso.cluster.create_namespace(f"stray-{iso.token}")
    try:
        # Set by another field manager (kubectl label, as the admin the operator runs as here): server-side
        # apply alone could not remove it.
        iso.cluster.kubectl("label", "namespace", ns, f"{c.LABEL_TENANT}=true")
        wait_for(lambda: c.LABEL_TENANT not in _labels(iso.cluster, ns), 30, "the stray tenant label removed")
        assert get(iso.cluster, "resourcequota", c.QUOTA_NAME, "-n", ns) is None
    finally:
        iso.cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


# --- claims for other classes ---------------------------------------------------------------------


def _claim(ns: str, requests: list[dict[str, Any]], **devices: Any) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": ns},
        "spec": {"devices": {"requests": requests, **devices}},
    }


def _template(claim: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": claim["metadata"],
        "spec": {"spec": claim["spec"]},
    }


def _sel(expr: str) -> list[dict[str, Any]]:
    return [{"cel": {"expression": expr}}]


OTHER = "other.example.com"
CLAIM_CASES: dict[str, tuple[str, list[dict[str, Any]], dict[str, Any], str]] = {
    "cel-driver": (
        "tenant",
        [
            {
                "name": "g",
                "exactly": {"deviceClassName": OTHER, "selectors": _sel("device.driver == 'gpuslice.io'")},
            }
        ],
        {},
        "CEL selector that names gpuslice",
    ),
    "cel-driver-uppercase-other-namespace": (
        "other",
        [
            {
                "name": "g",
                "exactly": {
                    "deviceClassName": OTHER,
                    "selectors": _sel('device.driver == "GPUSLICE.IO".lowerAscii()'),
                },
            }
        ],
        {},
        "CEL selector that names gpuslice",
    ),
    "cel-attribute-first-available": (
        "tenant",
        [
            {
                "name": "g",
                "firstAvailable": [
                    {
                        "name": "a",
                        "deviceClassName": OTHER,
                        "selectors": _sel("device.attributes['gpuslice.io'].package == 'x'"),
                    }
                ],
            }
        ],
        {},
        "CEL selector that names gpuslice",
    ),
    "allocation-mode-all": (
        "tenant",
        [{"name": "g", "exactly": {"deviceClassName": OTHER, "allocationMode": "All"}}],
        {},
        "allocationMode All or adminAccess",
    ),
    # Kubernetes itself refuses adminAccess outside namespaces labelled for it (see the next test).
    "admin-access": (
        "tenant",
        [{"name": "g", "exactly": {"deviceClassName": OTHER, "adminAccess": True}}],
        {},
        "admin access to devices requires",
    ),
    "opaque-config": (
        "tenant",
        [{"name": "g", "exactly": {"deviceClassName": OTHER}}],
        {"config": [{"opaque": {"driver": "gpuslice.io", "parameters": {"limit": 0}}}]},
        "configuration to driver gpuslice.io",
    ),
    "gpuslice-class-in-other-namespace": (
        "other",
        [{"name": "gpu", "exactly": {"deviceClassName": "PKG", "allocationMode": "ExactCount", "count": 1}}],
        {},
        "holds no gpuslice entitlement",
    ),
    "gpuslice-class-two-requests": (
        "tenant",
        [
            {"name": "gpu", "exactly": {"deviceClassName": "PKG"}},
            {"name": "more", "exactly": {"deviceClassName": OTHER}},
        ],
        {},
        "one request named gpu",
    ),
    "gpuslice-class-all": (
        "tenant",
        [{"name": "gpu", "exactly": {"deviceClassName": "PKG", "allocationMode": "All"}}],
        {},
        "ExactCount and count 1",
    ),
}


@pytest.mark.parametrize("kind", ["claim", "template"])
@pytest.mark.parametrize("case", sorted(CLAIM_CASES))
def test_claims_cannot_reach_gpuslice_devices_another_way(iso: Iso, case: str, kind: str) -> None:
    where, requests, devices, expect = CLAIM_CASES[case]
    ns = iso.tenant if where == "tenant" else iso.other
    requests = json.loads(json.dumps(requests).replace('"PKG"', json.dumps(iso.device_class)))
    doc = _claim(ns, requests, **devices)
    doc["metadata"]["labels"] = {c.LABEL_PACKAGE: iso.pkg}
    if kind == "template":
        doc = _template(doc)
        doc["spec"]["metadata"] = {"labels": {c.LABEL_PACKAGE: iso.pkg}}
    refused(iso, doc, expect, *(() if "entitlement" in expect or "admin access" in expect else ("GpuSlice",)))


def test_admin_access_is_refused_even_where_the_namespace_allows_it(iso: Iso) -> None:
    # Mallory may label namespaces here; Kubernetes then allows adminAccess claims, gpuslice does not.
    label = "resource.kubernetes.io/admin-access"
    proc = kubectl_as(
        iso.cluster, iso.mallory, "label", "namespace", iso.tenant, f"{label}=true", "--overwrite"
    )
    assert proc.returncode == 0, proc.stderr
    try:
        doc = _claim(iso.tenant, [{"name": "g", "exactly": {"deviceClassName": OTHER, "adminAccess": True}}])
        refused(iso, doc, "allocationMode All or adminAccess", "GpuSlice")
    finally:
        iso.cluster.kubectl("label", "namespace", iso.tenant, f"{label}-")


def test_claims_for_other_classes_of_the_ordinary_form_stay_allowed(iso: Iso) -> None:
    accepted(iso, _claim(iso.tenant, [{"name": "g", "exactly": {"deviceClassName": OTHER, "count": 2}}]))


# --- the protect policy, the agent's writes ---------------------------------------------------------------


def test_kube_system_service_accounts_are_not_trusted_with_gpuslice_claims(iso: Iso) -> None:
    apply(iso.cluster, [slice_doc("s", iso.tenant, iso.pkg)])
    wait_for(lambda: get(iso.cluster, "resourceclaim", "s", "-n", iso.tenant), 30, "the slice's claim")
    sa = "system:serviceaccount:kube-system:default"
    apply(
        iso.cluster,
        [
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": {"name": "kube-system-default-edit", "namespace": iso.tenant},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
                "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": "kube-system"}],
            }
        ],
    )
    proc = iso.cluster.kubectl(
        "delete", "resourceclaim", "s", "-n", iso.tenant, f"--as={sa}", "--dry-run=server", check=False
    )
    assert proc.returncode != 0 and "managed by gpuslice" in proc.stderr, proc.stderr


def test_an_agent_may_publish_only_its_own_pool(iso: Iso) -> None:
    node = iso.cluster.nodes[0]
    agent = agent_kubeconfig(iso.cluster, node)
    token = f"{iso.token}x"
    doc = published(node, 1, {iso.pkg: 25})[0]
    doc["metadata"]["name"] = f"{node}-{token}"
    doc["spec"]["nodeName"] = node
    doc["spec"]["pool"]["name"] = iso.cluster.nodes[1]  # another node's pool, on its own node
    # agent_kubeconfig (re)applies the agent's policies: one another test removed is enforced only
    # once the API server has loaded it again.
    wait_for(lambda: dry_run(iso, doc, agent).returncode != 0, 15, "the agent policy to be enforced")
    refused(iso, doc, f"may only write ResourceSlices of pool {node}", kubeconfig=agent)


def test_an_agent_may_write_only_usage_of_slices_on_its_own_node(iso: Iso) -> None:
    a, b = iso.cluster.nodes[0], iso.cluster.nodes[1]
    publish_gpus(iso.cluster, iso.token, a, 1, {iso.pkg: 25})
    apply(
        iso.cluster,
        [
            slice_doc("u", iso.tenant, iso.pkg),
            pod_doc("u", iso.tenant, node_selector={"kubernetes.io/hostname": a}),
        ],
    )
    wait_status(iso.cluster, iso.tenant, "u", 60, node=a)
    usage = {"usage": {"memoryBytes": 1}}

    def patch(node: str, status: dict[str, Any]) -> str:
        """What the agent of `node` gets for a merge patch of the slice's status, as its code sends it."""
        return asyncio.run(_patch_status(agent_kubeconfig(iso.cluster, node), iso.tenant, "u", status))

    assert f"allocated on its own node {b}" in patch(b, usage)
    assert "may only write status.usage" in patch(a, {"phase": "Failed"})
    assert patch(a, usage) == ""


async def _patch_status(kubeconfig: Path, namespace: str, name: str, status: dict[str, Any]) -> str:
    """The API server's refusal ("" when accepted) of a status merge patch, sent like the agent does."""
    api = await config.new_client_from_config(config_file=str(kubeconfig))
    try:
        await client.CustomObjectsApi(api).patch_namespaced_custom_object_status(
            c.API_GROUP, c.API_VERSION, namespace, c.SLICE_PLURAL, name, {"status": status},
            _content_type="application/merge-patch+json",
        )  # fmt: skip
    except ApiException as exc:
        return str(exc.body)
    finally:
        await api.close()
    return ""


# --- object count: GpuSlices per tenant namespace (at the end: it fills the namespace up) ---------------


def test_a_tenant_namespace_holds_at_most_the_configured_number_of_gpuslices(iso: Iso) -> None:
    # One tenant made 6,000 GpuSlices (all waiting QuotaExceeded): the operator's CPU went 0 -> 51-72 %.
    def create(name: str) -> subprocess.CompletedProcess[str]:
        doc = slice_doc(name, iso.tenant, iso.pkg)
        return kubectl_as(iso.cluster, iso.mallory, "create", "-f", "-", input=json.dumps(doc))

    def held() -> list[str]:
        out = iso.cluster.kubectl("get", "gpuslices.gpuslice.io", "-n", iso.tenant, "-o", "name").stdout
        return out.split()

    made, refusal = [], ""
    try:
        for i in range(MAX_SLICES + 1):  # other tests of the module may have left a slice or two
            proc = create(f"many-{i}")
            if proc.returncode != 0:
                refusal = proc.stderr
                break
            made.append(f"many-{i}")
        # What the tenant reads: the quota's name, the key, how many are used of how many.
        assert "exceeded quota: gpuslice-objects" in refusal, refusal
        assert f"used: count/gpuslices.gpuslice.io={MAX_SLICES}" in refusal, refusal
        assert f"limited: count/gpuslices.gpuslice.io={MAX_SLICES}" in refusal, refusal
        assert len(held()) == MAX_SLICES
        # One deleted (the operator lets it go, kube-controller-manager counts it gone): one more fits.
        iso.cluster.kubectl("delete", "gpuslices.gpuslice.io", made.pop(), "-n", iso.tenant, "--timeout=60s")
        wait_for(
            lambda: create("many-again").returncode == 0, 30, "a GpuSlice create after a delete", interval=1
        )
        made.append("many-again")
        assert len(held()) == MAX_SLICES
    finally:
        for name in made:
            iso.cluster.kubectl(
                "delete", "gpuslices.gpuslice.io", name, "-n", iso.tenant, "--wait=false", check=False
            )
