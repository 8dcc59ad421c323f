"""A product asked for the way charts ask for GPUs, `resources.limits: {gpuslice.io/v100-8g: 1}`, on
the real control plane and a real node: kube-scheduler makes the pod a claim of its own (the
package's DeviceClass names the extended resource), the agent prepares it, the quota counts it with
the GpuSlices, admission keeps every other way shut, and the operator shows it as a GpuSlice."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuslice import constants as c
from gpuslice_dev.devcluster.cluster import DevCluster
from node.node_cluster import PROBE, TENANT, delete, entitled, exec_in, run_pod, slice_pod
from node.test_isolation_node import _container_pid, _release, gpu_holder
from support import apply, deployment_of, get_json, skip_unless_served, wait_for

# tests/operator is a package whose name the standard library's `operator` shadows here: load the
# helpers of its cluster tests (a tenant user, waiting for a slice's status) by path.
_spec = importlib.util.spec_from_file_location(
    "operator_cluster", Path(__file__).resolve().parents[1] / "operator" / "operator_cluster.py"
)
assert _spec is not None and _spec.loader is not None
operator_cluster = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(operator_cluster)
tenant_rbac, wait_status = operator_cluster.tenant_rbac, operator_cluster.wait_status

pytestmark = [pytest.mark.cluster, pytest.mark.slow(seconds=60)]
PRODUCT = "gpuslice.io/v100-8g"
OUTSIDER = "no-entitlement"
DEVICES = c.quota_key("v100-8g")
REQUESTS = f"requests.{PRODUCT}"


def product_pod(name: str, namespace: str = TENANT, limits: dict[str, str] | None = None, **spec: Any) -> Any:
    """A stock pod of the probe image asking for one slice in resources.limits, nothing gpuslice-specific."""
    container = {
        "name": "main",
        "image": PROBE,
        "command": ["sleep", "3600"],
        "resources": {"limits": limits if limits is not None else {PRODUCT: "1", "memory": "1Gi"}},
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"terminationGracePeriodSeconds": 1, "containers": [container], **spec},
    }


def deployment(name: str, namespace: str, replicas: int) -> dict[str, Any]:
    """A Deployment as a chart writes it: the GPU in the container's limits."""
    return deployment_of(name, namespace, product_pod("x", namespace)["spec"], replicas)


@pytest.fixture(scope="module")
def tenant(node_cluster: DevCluster) -> Iterator[Path]:
    """A tenant user's kubeconfig (edit + the gpuslice tenant role in team-a), and a namespace no
    package entitles."""
    node_cluster.create_namespace(OUTSIDER, {})
    with tenant_rbac(node_cluster, TENANT, "limits-tenant") as kubeconfig:
        yield kubeconfig


def used(cluster: DevCluster) -> dict[str, str]:
    quota = get_json(cluster, "resourcequota", c.QUOTA_NAME, "-n", TENANT)
    return dict(quota["status"].get("used") or {})


def _quota_settled(cluster: DevCluster, devices: str, requests: str) -> dict[str, str] | None:
    now = used(cluster)
    return now if (now.get(DEVICES), now.get(REQUESTS)) == (devices, requests) else None


def test_a_stock_pod_asking_for_the_product_in_its_limits_runs_on_its_slice(
    node_cluster: DevCluster, tenant: Path
) -> None:
    skip_unless_served(
        node_cluster,
        "admissionregistration.k8s.io/v1",
        "mutatingadmissionpolicies",
        "the GPU node toleration a stock pod gets from a MutatingAdmissionPolicy",
    )
    # the product names its resource: in its DeviceClass (what kube-scheduler reads) and its status
    device_class = get_json(node_cluster, "deviceclass", "v100-8g.gpuslice.io")
    assert device_class["spec"]["extendedResourceName"] == PRODUCT
    assert get_json(node_cluster, "gpupackage", "v100-8g")["status"]["resourceName"] == PRODUCT
    before = used(node_cluster)
    apply(node_cluster, [product_pod("chart")], kubeconfig=tenant)
    run_pod(node_cluster, [product_pod("chart")])
    try:
        rc, out, err = exec_in(node_cluster, "chart", "gpuslice-probe", "smi")
        assert rc == 0 and out.strip().splitlines() == ["Tesla V100-PCIE-32GB, 8192 MiB"], (out, err)
        # the shim holds it to its slice like a GpuSlice pod
        rc, out, _ = exec_in(node_cluster, "chart", "gpuslice-probe", "alloc", "6Gi", "3Gi")
        assert "CUDA_ERROR_OUT_OF_MEMORY" in out.splitlines()[1], out
        # `kubectl debug` (by someone allowed to: edit does not grant pods/ephemeralcontainers) cannot
        # add a container with a slice of its own
        debug = {"name": "dbg", "image": PROBE, "command": ["true"], "resources": {"limits": {PRODUCT: "1"}}}
        patch = (
            "--subresource=ephemeralcontainers",
            "-p",
            json.dumps({"spec": {"ephemeralContainers": [debug]}}),
        )
        proc = node_cluster.kubectl("patch", "pod", "chart", "-n", TENANT, *patch, check=False)
        assert proc.returncode != 0 and "resources" in proc.stderr, proc.stderr

        pod = get_json(node_cluster, "pod", "chart", "-n", TENANT)
        assert any(t.get("key") == c.TAINT_GPU_KEY for t in pod["spec"]["tolerations"])  # added for it
        claim_name = pod["status"]["extendedResourceClaimStatus"]["resourceClaimName"]
        claim = get_json(node_cluster, "resourceclaim", claim_name, "-n", TENANT)
        assert claim["metadata"]["annotations"][c.ANNOTATION_EXTENDED_RESOURCE_CLAIM] == "true"
        (request,) = claim["spec"]["devices"]["requests"]
        assert request["exactly"]["deviceClassName"] == "v100-8g.gpuslice.io"
        assert request["exactly"]["count"] == 1

        # the scheduler's claim is charged like a GpuSlice's, under both keys
        inc = {k: str(int(before.get(k, "0")) + 1) for k in (DEVICES, REQUESTS)}
        wait_for(lambda: _quota_settled(node_cluster, inc[DEVICES], inc[REQUESTS]), 30, "quota charged")

        # the operator shows it as a GpuSlice owned by the pod
        status = wait_status(node_cluster, TENANT, "chart", phase="InUse", claimName=claim_name)
        assert status["allocations"][0]["pod"] == "chart" and status["node"] == "real-node-0"
        mirror = get_json(node_cluster, "gpuslice", "chart", "-n", TENANT)
        assert mirror["spec"] == {"package": "v100-8g", "pod": "chart", "template": False}
        (owner,) = mirror["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["uid"]) == ("Pod", pod["metadata"]["uid"])
        # the agent's usage reaches it like any slice's
        usage = wait_for(
            lambda: (
                get_json(node_cluster, "gpuslice", "chart", "-n", TENANT)["status"].get("usage") or {}
            ).get("refusedAllocations"),
            30,
            "status.usage of the pod's GpuSlice",
        )
        assert usage >= 1
    finally:
        delete(node_cluster, "pod", "chart")
    # deleted with its pod, the scheduler's claim too
    wait_for(lambda: get_json(node_cluster, "gpuslice", "chart", "-n", TENANT) is None, 30, "slice gone")
    wait_for(
        lambda: get_json(node_cluster, "resourceclaim", claim_name, "-n", TENANT) is None, 30, "claim gone"
    )


def test_a_deployment_from_a_chart_gets_a_slice_per_replica(node_cluster: DevCluster, tenant: Path) -> None:
    apply(node_cluster, [deployment("ollama", TENANT, 2)], kubeconfig=tenant)
    try:

        def running() -> list[dict[str, Any]] | None:
            items = get_json(node_cluster, "gpuslices", "-n", TENANT)["items"]
            mine = [s for s in items if s["metadata"]["name"].startswith("ollama-")]
            # a slice the operator has just made has no status yet
            in_use = all((s.get("status") or {}).get("phase") == "InUse" for s in mine)
            return mine if len(mine) == 2 and in_use else None

        slices = wait_for(running, 90, "two InUse GpuSlices of the Deployment's pods")
        assert {s["spec"]["pod"] for s in slices} == {s["metadata"]["name"] for s in slices}
        table = node_cluster.kubectl("get", "gpuslices", "-n", TENANT, "-o", "wide").stdout
        assert table.count("InUse") >= 2 and "ollama-" in table
    finally:
        node_cluster.kubectl("delete", "deployment", "ollama", "-n", TENANT, "--wait=true")
    wait_for(
        lambda: (
            not [
                s
                for s in get_json(node_cluster, "gpuslices", "-n", TENANT)["items"]
                if s["metadata"]["name"].startswith("ollama-")
            ]
        ),
        60,
        "the replicas' slices deleted with their pods",
    )


@pytest.fixture
def two_slices(node_cluster: DevCluster) -> Iterator[None]:
    with entitled(node_cluster, 2):
        yield


def test_both_forms_draw_on_one_entitlement(node_cluster: DevCluster, tenant: Path, two_slices: None) -> None:
    # one slice through a GpuSlice, one through resources.limits: the entitlement of 2 is used up
    docs = slice_pod("sliced", ["sleep", "3600"])
    apply(node_cluster, docs, kubeconfig=tenant)
    run_pod(node_cluster, docs)
    apply(node_cluster, [product_pod("limited")], kubeconfig=tenant)
    try:
        run_pod(node_cluster, [product_pod("limited")])
        wait_for(lambda: _quota_settled(node_cluster, "2", "2"), 30, "both forms charged to both keys")
        described = node_cluster.kubectl("describe", "quota", c.QUOTA_NAME, "-n", TENANT).stdout
        assert any(line.split()[:3] == [REQUESTS, "2", "2"] for line in described.splitlines()), described
        # a third slice in either form is refused: the pod when it is created, the GpuSlice's claim
        refused = node_cluster.kubectl(
            "create", "-f", "-", input=json.dumps(product_pod("third")), kubeconfig=tenant, check=False
        )
        assert refused.returncode != 0 and "exceeded quota" in refused.stderr, refused.stderr
        assert REQUESTS in refused.stderr
        apply(node_cluster, [slice_pod("third-slice", ["true"])[0]], kubeconfig=tenant)
        status = wait_status(node_cluster, TENANT, "third-slice", reason="QuotaExceeded")
        # both slices are counted as held (kube-scheduler's claim for the pod carries no package
        # label): used up, not a quota that counted more than the namespace holds
        assert "holds 2 of 2 v100-8g slices" in status["message"], status
        assert "recount" not in status["message"], status
    finally:
        for kind, name in (
            ("pod", "limited"),
            ("pod", "sliced"),
            ("gpuslice", "sliced"),
            ("gpuslice", "third-slice"),
        ):
            delete(node_cluster, kind, name)


def test_a_slice_made_while_a_deleted_ones_pod_stops_names_that_pod_and_gets_its_claim_by_itself(
    node_cluster: DevCluster, tenant: Path
) -> None:
    """Delete a GpuSlice and its pod and create another at once: the old claim counts in the quota
    until its pod has stopped (its grace period). The new slice names that pod, not a recount or a
    slice to delete, and gets its claim without anyone's help."""
    with entitled(node_cluster, 1):
        docs = slice_pod("leaving", ["sleep", "3600"])  # pid 1 of its pid namespace: SIGTERM is ignored
        docs[1]["spec"]["terminationGracePeriodSeconds"] = 15  # type: ignore[index]
        apply(node_cluster, docs, kubeconfig=tenant)
        run_pod(node_cluster, docs)
        try:
            node_cluster.kubectl("delete", "pod", "leaving", "-n", TENANT, "--wait=false")
            node_cluster.kubectl("delete", "gpuslice", "leaving", "-n", TENANT, "--wait=false")
            apply(node_cluster, [slice_pod("arriving", ["true"])[0]], kubeconfig=tenant)
            # the garbage collector marks the old claim some moments after its GpuSlice went: what
            # the new slice says follows (within the old pod's grace period)
            wait_status(node_cluster, TENANT, "arriving", reason="QuotaExceeded")
            wait_for(
                lambda: (
                    "counts until pod leaving has stopped"
                    in operator_cluster.slice_status(node_cluster, TENANT, "arriving").get("message", "")
                ),
                10,
                "the new slice to name the stopping pod",
            )
            status = operator_cluster.slice_status(node_cluster, TENANT, "arriving")
            assert "by itself" in status["message"] and "recount" not in status["message"], status
            wait_for(
                lambda: get_json(node_cluster, "resourceclaim", "arriving", "-n", TENANT),
                60,
                "the new slice's claim once the old pod has stopped",
            )
        finally:
            delete(node_cluster, "pod", "leaving")
            delete(node_cluster, "gpuslice", "leaving")
            delete(node_cluster, "gpuslice", "arriving")


# --- admission: the one form, in entitled namespaces only -------------------------------------------


def _container(name: str, limits: dict[str, str], **extra: Any) -> dict[str, Any]:
    return {"name": name, "image": PROBE, "command": ["true"], "resources": {"limits": limits}, **extra}


ONE = {PRODUCT: "1"}
REFUSED: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "count-2": (product_pod("p", limits={PRODUCT: "2"}), ("exactly one slice", "{limits: {gpuslice.io/")),
    "two-products": (
        product_pod("p", limits={PRODUCT: "1", "gpuslice.io/v100-16g": "1"}),
        ("exactly one slice of one gpuslice product",),
    ),
    "two-containers": (
        product_pod("p", containers=[_container("a", ONE), _container("b", ONE)]),
        ("only one container", "create a GpuSlice"),
    ),
    "init-container": (
        product_pod("p", initContainers=[_container("i", ONE)], containers=[_container("main", {})]),
        ("not an init or ephemeral container",),
    ),
    "sidecar": (
        product_pod(
            "p",
            initContainers=[_container("i", ONE, restartPolicy="Always")],
            containers=[_container("m", {})],
        ),
        ("not an init or ephemeral container",),
    ),
    "with-claims": (
        product_pod("p", resourceClaims=[{"name": "gpu", "resourceClaimName": "x"}]),
        ("either as a gpuslice product in resources.limits or through resource claims",),
    ),
    "implicit-class-name": (
        product_pod("p", limits={"deviceclass.resource.kubernetes.io/v100-8g.gpuslice.io": "1"}),
        ("deviceclass.resource.kubernetes.io/*", "gpuslice.io/<product>: 1"),
    ),
    "nvidia-gpu": (product_pod("p", limits={"nvidia.com/gpu": "1"}), ("nvidia.com/gpu",)),
    "pod-level-resources": (product_pod("p", resources={"limits": {PRODUCT: "1"}}), ("spec.resources",)),
    "gpu-env": (
        product_pod(
            "p", containers=[_container("m", ONE, env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}])]
        ),
        ("NVIDIA_VISIBLE_DEVICES",),
    ),
    "node-name": (product_pod("p", nodeName="real-node-0"), ("spec.nodeName",)),
    "no-entitlement": (product_pod("p", OUTSIDER), (f"namespace {OUTSIDER} holds no gpuslice entitlement",)),
    "no-entitlement-implicit": (
        product_pod("p", OUTSIDER, limits={"deviceclass.resource.kubernetes.io/v100-8g.gpuslice.io": "1"}),
        ("holds no gpuslice entitlement",),
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_every_other_form_is_refused_with_the_one_that_works(
    node_cluster: DevCluster, tenant: Path, case: str
) -> None:
    doc, expect = REFUSED[case]
    # the outsider namespace has no tenant role binding: create it as the cluster admin there
    kubeconfig = tenant if doc["metadata"]["namespace"] == TENANT else None
    proc = node_cluster.kubectl(
        "create", "--dry-run=server", "-f", "-", input=json.dumps(doc), kubeconfig=kubeconfig, check=False
    )
    assert proc.returncode != 0, f"{case} was admitted"
    for text in expect:
        assert text in proc.stderr, proc.stderr


def _job(name: str, namespace: str, limits: dict[str, str]) -> dict[str, Any]:
    pod = product_pod("x", namespace, limits=limits)["spec"] | {"restartPolicy": "Never"}
    meta = {"name": name, "namespace": namespace}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": {"template": {"spec": pod}}}


WORKLOADS_REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "deployment-without-entitlement": (deployment("chart", OUTSIDER, 1), "holds no gpuslice entitlement"),
    "job-count-2": (_job("train", TENANT, {PRODUCT: "2"}), "exactly one slice"),
}


@pytest.mark.parametrize("case", sorted(WORKLOADS_REFUSED))
def test_a_workload_whose_pods_would_be_refused_is_refused_when_applied(
    node_cluster: DevCluster, tenant: Path, case: str
) -> None:
    """A chart's Deployment, a Job: refused with the pods' message when applied, not left making
    no pods (a ReplicaFailure nobody reads)."""
    doc, expect = WORKLOADS_REFUSED[case]
    kubeconfig = tenant if doc["metadata"]["namespace"] == TENANT else None
    proc = node_cluster.kubectl(
        "create", "--dry-run=server", "-f", "-", input=json.dumps(doc), kubeconfig=kubeconfig, check=False
    )
    assert proc.returncode != 0 and "gpuslice-workload-products" in proc.stderr, proc.stderr
    assert expect in proc.stderr, proc.stderr


def test_tenants_cannot_forge_the_schedulers_claim_or_a_pods_slice(
    node_cluster: DevCluster, tenant: Path
) -> None:
    forged = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": "forged",
            "namespace": TENANT,
            "annotations": {c.ANNOTATION_EXTENDED_RESOURCE_CLAIM: "true"},
        },
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "container-0-request-0",
                        "exactly": {
                            "deviceClassName": "v100-8g.gpuslice.io",
                            "allocationMode": "ExactCount",
                            "count": 1,
                        },
                    }
                ]
            }
        },
    }
    proc = node_cluster.kubectl(
        "create", "--dry-run=server", "-f", "-", input=json.dumps(forged), kubeconfig=tenant, check=False
    )
    assert proc.returncode != 0 and "one request named gpu" in proc.stderr, proc.stderr
    pod_slice = slice_pod("someone-elses", ["true"])[0]
    pod_slice["spec"]["pod"] = "someone-elses"
    proc = node_cluster.kubectl(
        "create", "--dry-run=server", "-f", "-", input=json.dumps(pod_slice), kubeconfig=tenant, check=False
    )
    assert proc.returncode != 0 and "spec.pod is set by the gpuslice operator" in proc.stderr, proc.stderr


def test_a_process_that_bypasses_the_shim_in_such_a_pod_is_judged_against_its_slice(
    node_cluster: DevCluster,
) -> None:
    """The agent attributes it through the pod's status.extendedResourceClaimStatus to the scheduler's
    claim, judges it against that slice's 8 GiB and, under the default onViolation: Stop, kills it;
    the report goes to the pod's GpuSlice."""
    run_pod(node_cluster, [product_pod("bypass-limits")])
    try:
        uuid = wait_for(
            lambda: (
                get_json(node_cluster, "gpuslice", "bypass-limits", "-n", TENANT).get("status") or {}
            ).get("gpuUUID"),
            60,
            "the pod's GpuSlice's GPU",
        )
        uid = get_json(node_cluster, "pod", "bypass-limits", "-n", TENANT)["metadata"]["uid"]
        holder = gpu_holder(node_cluster, uuid, 10 * c.GIB, into_pod_of=_container_pid(uid))
        try:
            holder.wait(timeout=60)  # SIGKILLed by the agent
            events = get_json(
                node_cluster, "events", "-n", TENANT,
                "--field-selector=reason=SliceMemoryViolation,involvedObject.name=bypass-limits",
            )["items"]  # fmt: skip
            messages = [e["message"] for e in events]
            judged = f"of slice {TENANT}/bypass-limits hold 10240 MiB on GPU {uuid}, more than the slice's"
            assert any(f"{judged} 8192 MiB" in m and "onViolation: Stop" in m for m in messages), messages
        finally:
            _release(holder)
    finally:
        delete(node_cluster, "pod", "bypass-limits")


def test_a_package_chooses_its_resource_name_or_turns_the_form_off(node_cluster: DevCluster) -> None:
    package = {
        "apiVersion": c.GROUP_VERSION,
        "kind": c.PACKAGE_KIND,
        "metadata": {"name": "v100-16g"},
        "spec": {
            "gpuModel": "Tesla V100-PCIE-32GB",
            "fraction": 50,
            "entitlements": [
                {"namespaceSelector": {"matchLabels": {"tenant.example.com/project": TENANT}}, "slices": 1}
            ],
        },
    }

    def named(resource: str | None) -> bool:
        dc = get_json(node_cluster, "deviceclass", "v100-16g.gpuslice.io") or {"spec": {}}
        hard = get_json(node_cluster, "resourcequota", c.QUOTA_NAME, "-n", TENANT)["spec"]["hard"]
        keys = {k for k in hard if k.startswith("requests.gpuslice.io/v100-")} - {REQUESTS}
        want = {f"requests.{resource}"} if resource else set()
        return dc["spec"].get("extendedResourceName") == resource and keys == want and "spec" in dc

    apply(node_cluster, [package])
    try:
        wait_for(lambda: named("gpuslice.io/v100-16g"), 30, "the default name")
        for resource in ("gpuslice.io/v100-half", ""):
            patch = json.dumps({"spec": {"extendedResourceName": resource}})
            node_cluster.kubectl("patch", "gpupackage", "v100-16g", "--type=merge", "-p", patch)
            wait_for(lambda r=resource: named(r or None), 30, f"DeviceClass and quota with {resource!r}")
        bad = json.dumps({"spec": {"extendedResourceName": "nvidia.com/gpu"}})
        proc = node_cluster.kubectl("patch", "gpupackage", "v100-16g", "--type=merge", "-p", bad, check=False)
        assert proc.returncode != 0 and "extendedResourceName must be gpuslice.io/<name>" in proc.stderr, (
            proc.stderr
        )
    finally:
        node_cluster.kubectl("delete", "gpupackage", "v100-16g", "--wait=true", "--timeout=60s")
