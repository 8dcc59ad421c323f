"""The local control plane is real: scheduling, quota, CEL admission, DRA allocation, templates, RBAC."""

from __future__ import annotations

import json

import pytest
import yaml

from gpuslice_dev.devcluster.cluster import DevCluster
from support import get_json, wait_for

pytestmark = pytest.mark.cluster


def _pod(name: str, ns: str, claims: list[dict[str, str]] | None = None) -> str:
    spec: dict[str, object] = {
        "containers": [
            {
                "name": "main",
                "image": "registry.example/app:1",
                "resources": {
                    "requests": {"cpu": "10m", "memory": "16Mi"},
                    "limits": {"cpu": "10m", "memory": "16Mi"},
                },
            }
        ]
    }
    if claims:
        spec["resourceClaims"] = claims
        spec["containers"][0]["resources"]["claims"] = [{"name": c["name"]} for c in claims]  # type: ignore[index]
    return yaml.safe_dump(
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns}, "spec": spec}
    )


def test_pod_is_scheduled_onto_a_kwok_node_and_runs(cluster: DevCluster, namespace: str) -> None:
    cluster.apply(_pod("hello", namespace))
    pod = wait_for(
        lambda: (
            (p := get_json(cluster, "pod", "hello", "-n", namespace))
            and p["status"].get("phase") == "Running"
            and p
        ),
        what="pod hello Running",
    )
    assert pod["spec"]["nodeName"] in cluster.nodes


def test_resource_quota_rejects_a_second_pod(cluster: DevCluster, namespace: str) -> None:
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "one-pod", "namespace": namespace},
        "spec": {"hard": {"count/pods": "1"}},
    }
    cluster.apply(yaml.safe_dump(quota))
    # kube-controller-manager computes quota status; until it has, admission rejects everything.
    wait_for(
        lambda: (
            (q := get_json(cluster, "resourcequota", "one-pod", "-n", namespace))
            and "count/pods" in q.get("status", {}).get("hard", {})
        ),
        what="quota status filled by kube-controller-manager",
    )
    cluster.apply(_pod("first", namespace))
    second = cluster.kubectl("create", "-f", "-", input=_pod("second", namespace), check=False)
    assert second.returncode != 0
    assert "exceeded quota: one-pod" in second.stderr
    assert "count/pods=1" in second.stderr


def test_validating_admission_policy_rejects_with_its_cel_message(
    cluster: DevCluster, namespace: str
) -> None:
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": f"no-forbidden-key-{namespace}"},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {
                "resourceRules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE", "UPDATE"],
                        "resources": ["configmaps"],
                    }
                ]
            },
            "validations": [
                {
                    "expression": "!has(object.data) || !('forbidden' in object.data)",
                    "message": "configmaps may not carry the key 'forbidden'; rename it",
                }
            ],
        },
    }
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": f"no-forbidden-key-{namespace}"},
        "spec": {
            "policyName": f"no-forbidden-key-{namespace}",
            "validationActions": ["Deny"],
            "matchResources": {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
            },
        },
    }
    cluster.apply(yaml.safe_dump_all([policy, binding]))
    bad = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "bad", "namespace": namespace},
        "data": {"forbidden": "x"},
    }

    # Policies reach the admission plugin's informer asynchronously; retry until it is enforced.
    def rejected() -> str | None:
        proc = cluster.kubectl("create", "-f", "-", input=yaml.safe_dump(bad), check=False)
        if proc.returncode == 0:
            cluster.kubectl("delete", "configmap", "bad", "-n", namespace)
            return None
        return proc.stderr

    message = wait_for(rejected, what="policy enforced")
    assert "configmaps may not carry the key 'forbidden'; rename it" in message
    good = dict(bad, metadata={"name": "good", "namespace": namespace}, data={"fine": "x"})
    cluster.apply(yaml.safe_dump(good))
    cluster.kubectl(
        "delete",
        "validatingadmissionpolicybinding,validatingadmissionpolicy",
        f"no-forbidden-key-{namespace}",
        check=False,
    )


def _dra_fixture(cluster: DevCluster, tag: str, node: str) -> str:
    """A DeviceClass and a hand-made ResourceSlice with two devices on `node`; returns the class name."""
    cls = f"test-{tag}.example.com"
    docs = [
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": cls},
            "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{tag}.example.com"'}}]},
        },
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": f"{tag}-{node}"},
            "spec": {
                "driver": f"{tag}.example.com",
                "nodeName": node,
                "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                "devices": [
                    {"name": "dev-0", "attributes": {"model": {"string": "thing"}}},
                    {"name": "dev-1", "attributes": {"model": {"string": "thing"}}},
                ],
            },
        },
    ]
    cluster.apply(yaml.safe_dump_all(docs))
    return cls


def test_kube_scheduler_allocates_a_claim_when_it_schedules_the_pod(
    cluster: DevCluster, namespace: str
) -> None:
    node = cluster.nodes[-1]
    cls = _dra_fixture(cluster, "alloc", node)
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "one", "namespace": namespace},
        "spec": {"devices": {"requests": [{"name": "dev", "exactly": {"deviceClassName": cls}}]}},
    }
    cluster.apply(yaml.safe_dump(claim))
    assert "allocation" not in (
        get_json(cluster, "resourceclaim", "one", "-n", namespace).get("status") or {}
    )
    cluster.apply(_pod("user", namespace, [{"name": "dev", "resourceClaimName": "one"}]))
    allocated = wait_for(
        lambda: (
            (c := get_json(cluster, "resourceclaim", "one", "-n", namespace))
            and c.get("status", {}).get("allocation")
            and c
        ),
        what="claim allocated",
    )
    results = allocated["status"]["allocation"]["devices"]["results"]
    assert results[0]["driver"] == "alloc.example.com"
    assert results[0]["pool"] == node
    assert results[0]["device"] in {"dev-0", "dev-1"}
    pod = get_json(cluster, "pod", "user", "-n", namespace)
    assert pod["spec"]["nodeName"] == node  # the devices only exist there
    assert any(r["name"] == "user" for r in allocated["status"]["reservedFor"])


def test_claim_template_yields_a_claim_through_the_controller_manager(
    cluster: DevCluster, namespace: str
) -> None:
    node = cluster.nodes[0]
    cls = _dra_fixture(cluster, "tmpl", node)
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "per-pod", "namespace": namespace},
        "spec": {"spec": {"devices": {"requests": [{"name": "dev", "exactly": {"deviceClassName": cls}}]}}},
    }
    cluster.apply(yaml.safe_dump(template))
    cluster.apply(_pod("templated", namespace, [{"name": "dev", "resourceClaimTemplateName": "per-pod"}]))

    def generated() -> dict[str, object] | None:
        claims = get_json(cluster, "resourceclaims", "-n", namespace)["items"]
        owned = [
            c
            for c in claims
            if any(o["name"] == "templated" for o in c["metadata"].get("ownerReferences", []))
        ]
        return owned[0] if owned else None

    claim = wait_for(generated, what="claim generated from the template")
    assert claim["metadata"]["annotations"]["resource.kubernetes.io/pod-claim-name"] == "dev"
    # Deleting the pod garbage-collects the generated claim (owner reference, real GC).
    cluster.kubectl("delete", "pod", "templated", "-n", namespace, "--grace-period=0", "--force", check=False)
    wait_for(lambda: generated() is None, what="generated claim garbage-collected")


def test_tenant_identity_is_subject_to_rbac(cluster: DevCluster, namespace: str) -> None:
    tenant = cluster.tenant_kubeconfig("alice", ["team-a"])
    denied = cluster.kubectl("get", "pods", "-n", namespace, kubeconfig=tenant, check=False)
    assert denied.returncode != 0
    assert 'User "alice" cannot list resource "pods"' in denied.stderr
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "team-a-view", "namespace": namespace},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "view"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "team-a"}],
    }
    cluster.apply(yaml.safe_dump(binding))
    allowed = wait_for(
        lambda: (
            (
                p := cluster.kubectl(
                    "get", "pods", "-n", namespace, "-o", "json", kubeconfig=tenant, check=False
                )
            ).returncode
            == 0
            and p
        ),
        what="tenant allowed after the binding",
    )
    assert json.loads(allowed.stdout)["kind"] == "List"
    # The group grants nothing cluster-wide.
    nodes = cluster.kubectl("get", "nodes", kubeconfig=tenant, check=False)
    assert nodes.returncode != 0
