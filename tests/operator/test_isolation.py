"""Isolation decisions without a cluster: Pod Security labels, the GPU node taint, the tenant label's
removal and the shape of the isolation policies (their CEL runs in test_isolation_cluster.py)."""

from __future__ import annotations

import pytest

from gpuslice import constants as c
from gpuslice.domain.admission import AdmissionConfig, admission_objects
from gpuslice.domain.isolation import pod_security_labels, stronger_level, taint_patch
from gpuslice.domain.tenancy import ObservedTenant, changes, tenant_state, untenant_patch
from gpuslice.operator.run import own_namespace
from support import package_spec

GPU = {"nvidia.com/gpu.present": "true"}
TAINT = {"key": c.TAINT_GPU_KEY, "value": c.TAINT_GPU_VALUE, "effect": "NoExecute"}


def test_tenant_namespaces_get_the_configured_level_or_the_stricter_one_they_have() -> None:
    assert pod_security_labels({}, "baseline") == {
        c.PSA_ENFORCE: "baseline",
        c.PSA_ENFORCE_VERSION: "latest",
        c.PSA_WARN: "baseline",
        c.PSA_AUDIT: "baseline",
    }
    assert pod_security_labels({c.PSA_ENFORCE: "privileged"}, "baseline")[c.PSA_ENFORCE] == "baseline"
    assert pod_security_labels({c.PSA_ENFORCE: "restricted"}, "baseline")[c.PSA_ENFORCE] == "restricted"
    assert pod_security_labels({c.PSA_ENFORCE: "nonsense"}, "restricted")[c.PSA_ENFORCE] == "restricted"
    assert stronger_level("baseline", "restricted") == "restricted"


def test_a_level_weaker_than_baseline_is_refused() -> None:
    with pytest.raises(ValueError, match="baseline or restricted"):
        pod_security_labels({}, "privileged")


def test_tenant_state_carries_the_pod_security_labels_and_changes_sees_them_missing() -> None:
    spec = package_spec(25).model_copy(
        update={"entitlements": package_spec(25, entitlements=[
            {"namespaceSelector": {"matchLabels": {"team": "a"}}, "slices": 2}
        ]).entitlements}
    )  # fmt: skip
    desired = tenant_state("a", {"team": "a"}, {"p": spec}, "restricted")
    assert desired.namespace_patch()["metadata"]["labels"][c.PSA_ENFORCE] == "restricted"
    have = {"team": "a", c.LABEL_TENANT: "true"}
    hard = dict(desired.hard)
    labels = {c.LABEL_MANAGED_BY: c.MANAGED_BY_VALUE}
    assert changes(desired, ObservedTenant(True, hard, labels, labels=have)) == (True, "")
    full = {**have, **desired.labels}
    assert changes(desired, ObservedTenant(True, hard, labels, labels=full)) == (False, "")


def test_the_tenant_label_is_removed_by_a_guarded_json_patch() -> None:
    path = "/metadata/labels/gpuslice.io~1tenant"
    assert untenant_patch() == [{"op": "test", "path": path, "value": "true"}, {"op": "remove", "path": path}]


def test_gpu_nodes_get_the_taint_appended_once() -> None:
    label = c.GPU_NODE_LABEL
    # A node seen without taints: the list, only onto that version of the node (the cluster test
    # shows the API server refusing it once a taint came meanwhile).
    assert taint_patch(GPU, None, label, "41") == [
        {"op": "test", "path": "/metadata/resourceVersion", "value": "41"},
        {"op": "add", "path": "/spec/taints", "value": [TAINT]},
    ]
    other = {"key": "x", "effect": "NoSchedule"}
    assert taint_patch(GPU, [other], label, "41") == [{"op": "add", "path": "/spec/taints/-", "value": TAINT}]
    assert taint_patch(GPU, [other, TAINT], label, "41") is None
    assert taint_patch({}, None, label, "41") is None
    assert taint_patch({"nvidia.com/gpu.present": "false"}, None, label, "41") is None
    assert taint_patch(GPU, None, "", "41") is None


def test_the_operators_namespace_comes_from_its_service_account() -> None:
    assert own_namespace("system:serviceaccount:gpuslice-system:gpuslice-operator") == ["gpuslice-system"]
    assert own_namespace("devcluster-admin") == []


def test_isolation_policies_bind_where_they_must() -> None:
    objs = admission_objects(AdmissionConfig(("op",), exempt_namespaces=("kube-system", "gs")))
    by = {(o["kind"], o["metadata"]["name"]): o for o in objs}
    vapb = "ValidatingAdmissionPolicyBinding"
    gpu_nodes = by[(vapb, "gpuslice-gpu-nodes")]["spec"]["matchResources"]["namespaceSelector"]
    assert gpu_nodes == {
        "matchExpressions": [
            {"key": c.LABEL_NAMESPACE_NAME, "operator": "NotIn", "values": ["gs", "kube-system"]}
        ]
    }
    for name in ("gpuslice-namespace-labels", "gpuslice-other-claims", "gpuslice-other-claim-templates"):
        assert "matchResources" not in by[(vapb, name)]["spec"], name  # every namespace
    mutation = by[("MutatingAdmissionPolicyBinding", "gpuslice-gpu-node-toleration")]["spec"]
    assert mutation["matchResources"]["namespaceSelector"]["matchExpressions"][0]["key"] == c.LABEL_TENANT
    protect = by[("ValidatingAdmissionPolicy", "gpuslice-protect")]["spec"]["validations"][0]["expression"]
    assert "kube-system:resource-claim-controller" in protect and "startsWith" not in protect
