"""The manifests against the real control plane: server-side dry-run of everything, the tenant role
and the agent's own-node admission policy exercised with real requests.

The dev cluster may be shared: objects that other tests also define (roles, the agent policy) are
applied under test-unique names and identities here, and removed afterwards.
"""

from __future__ import annotations

import copy
import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuslice import constants
from gpuslice_dev.devcluster.cluster import DevCluster
from gpuslice_dev.tools import prometheus_operator_crds
from support import get_json, wait_for

pytestmark = pytest.mark.cluster

NAMESPACE = "gpuslice-system"
FIELD_MANAGER = "gpuslice-manifests-test"
AGENT_SA_USER = f"system:serviceaccount:{NAMESPACE}:gpuslice-agent"
NODE_CLAIM = "authentication.kubernetes.io/node-name"

Doc = dict[str, Any]


def one(docs: list[Doc], kind: str, name: str) -> Doc:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return copy.deepcopy(doc)


def dry_run(cluster: DevCluster, docs: list[Doc], *extra: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    # --force-conflicts: in a shared dev cluster some of these objects exist under another field
    # manager (the dev agent RBAC); a dry run changes nothing either way.
    return cluster.kubectl(
        "apply",
        "--server-side",
        "--dry-run=server",
        "--force-conflicts",
        f"--field-manager={FIELD_MANAGER}",
        *extra,
        "-f",
        "-",
        input=yaml.safe_dump_all(docs),
        check=False,
        **kw,
    )


def assert_all_dry_run_applied(proc: subprocess.CompletedProcess[str], docs: list[Doc]) -> None:
    assert proc.returncode == 0, proc.stderr
    applied = [
        line for line in proc.stdout.splitlines() if line.endswith("serverside-applied (server dry run)")
    ]
    assert len(applied) == len(docs), proc.stdout
    for doc in docs:
        assert any(f"/{doc['metadata']['name']} " in line for line in applied), doc["metadata"]["name"]


def has_crd(cluster: DevCluster, name: str) -> bool:
    return get_json(cluster, "customresourcedefinition", name) is not None


def exists_settled(cluster: DevCluster, *args: str) -> bool:
    """Whether the object exists; one being deleted (say, by an earlier run) is waited out first."""
    found = get_json(cluster, *args)
    if found is not None and found["metadata"].get("deletionTimestamp"):
        wait_for(lambda: get_json(cluster, *args) is None, timeout=120, what=f"{' '.join(args)} deleted")
        return False
    return found is not None


@pytest.fixture(scope="module")
def installed(cluster: DevCluster, base: list[Doc]) -> Iterator[None]:
    """What a dry run of the rest needs for real: the CRDs and the namespace. Only what this fixture
    created is removed again."""
    cluster.apply_crds()
    created: list[tuple[str, str]] = []
    kopf = "clusterkopfpeerings.kopf.dev"
    if not exists_settled(cluster, "customresourcedefinition", kopf):
        cluster.apply(yaml.safe_dump(one(base, "CustomResourceDefinition", kopf)))
        created.append(("customresourcedefinition", kopf))
        cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{kopf}")
    if not exists_settled(cluster, "namespace", NAMESPACE):
        cluster.apply(yaml.safe_dump(one(base, "Namespace", NAMESPACE)))
        created.append(("namespace", NAMESPACE))
    # The Prometheus Operator's own CRDs (from its Go module), so the API server validates the
    # ServiceMonitor like everything else. Left in place: they are the upstream ones, and other
    # sessions sharing the cluster may be using them.
    for crd in prometheus_operator_crds():
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))
    cluster.kubectl(
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd/servicemonitors.monitoring.coreos.com",
        "crd/podmonitors.monitoring.coreos.com",
        "crd/prometheusrules.monitoring.coreos.com",
    )
    yield
    for kind, name in reversed(created):
        cluster.kubectl("delete", kind, name, "--wait=false", check=False)


def test_the_whole_base_passes_server_side_dry_run(
    cluster: DevCluster, base: list[Doc], installed: None
) -> None:
    assert_all_dry_run_applied(dry_run(cluster, base), base)


def test_the_monitoring_overlay_passes_server_side_dry_run(
    cluster: DevCluster, with_monitoring: list[Doc], installed: None
) -> None:
    docs = [d for d in with_monitoring if d["kind"] not in ("ServiceMonitor", "PrometheusRule")]
    assert_all_dry_run_applied(dry_run(cluster, docs), docs)


def test_servicemonitor_passes_server_side_dry_run(
    cluster: DevCluster, with_monitoring: list[Doc], installed: None
) -> None:
    assert has_crd(cluster, "servicemonitors.monitoring.coreos.com")
    assert has_crd(cluster, "prometheusrules.monitoring.coreos.com")
    docs = [d for d in with_monitoring if d["kind"] in ("ServiceMonitor", "PrometheusRule")]
    assert_all_dry_run_applied(dry_run(cluster, docs), docs)


def test_a_broken_servicemonitor_is_refused_by_the_prometheus_operators_schema(
    cluster: DevCluster, with_monitoring: list[Doc], installed: None
) -> None:
    (sm,) = [copy.deepcopy(d) for d in with_monitoring if d["kind"] == "ServiceMonitor"]
    sm["spec"]["endpoints"][0]["scheme"] = "gopher"
    proc = dry_run(cluster, [sm])
    assert proc.returncode != 0
    assert "spec.endpoints[0].scheme" in proc.stderr, proc.stderr


def test_a_broken_manifest_fails_the_dry_run(cluster: DevCluster, base: list[Doc], installed: None) -> None:
    # The check above can fail: the API server validates, it does not just parse.
    deploy = one(base, "Deployment", "gpuslice-operator")
    deploy["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["port"] = "no_such_port!"
    proc = dry_run(cluster, [deploy])
    assert proc.returncode != 0
    assert "livenessProbe.httpGet.port" in proc.stderr


def _in_namespace(doc: Doc, namespace: str) -> Doc:
    doc["metadata"]["namespace"] = namespace
    return doc


def test_operator_pods_meet_the_restricted_pod_security_level(
    cluster: DevCluster, base: list[Doc], namespace: str
) -> None:
    cluster.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/warn=restricted")
    operator = dry_run(cluster, [_in_namespace(one(base, "Deployment", "gpuslice-operator"), namespace)])
    assert operator.returncode == 0, operator.stderr
    assert "PodSecurity" not in operator.stderr
    # The agent needs host access and does not meet it; the same check says so.
    agent = dry_run(cluster, [_in_namespace(one(base, "DaemonSet", "gpuslice-agent"), namespace)])
    assert 'would violate PodSecurity "restricted:latest"' in agent.stderr
    assert "hostPID=true" in agent.stderr and '"hostPath"' in agent.stderr
    assert "seccompProfile" not in agent.stderr


@pytest.fixture
def nvidia_runtime_class(cluster: DevCluster) -> Iterator[None]:
    """The NVIDIA runtime's RuntimeClass, which the agent's pods name (made only if missing)."""
    created = get_json(cluster, "runtimeclass", "nvidia") is None
    if created:
        runtime = {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": "nvidia"}}
        cluster.apply(yaml.safe_dump({**runtime, "handler": "nvidia"}))
    yield
    if created:
        cluster.kubectl("delete", "runtimeclass", "nvidia", "--wait=false", check=False)


def _pod_from(workload: Doc, namespace: str) -> str:
    template = workload["spec"]["template"]
    meta = {"name": f"{workload['metadata']['name']}-dry-run", "namespace": namespace}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {**meta, "labels": template["metadata"]["labels"]}}
    return yaml.safe_dump({**pod, "spec": template["spec"]})


def test_the_workloads_pods_are_admitted_under_the_namespaces_pod_security(
    cluster: DevCluster, base: list[Doc], namespace: str, nvidia_runtime_class: None
) -> None:
    # Pod admission (Pod Security at the namespace's enforce level, service account, priority class,
    # RuntimeClass) judges pods, not their Deployment or DaemonSet. A fresh namespace carries the
    # base namespace's labels, so the verdict does not depend on what gpuslice-system holds now.
    labels = one(base, "Namespace", NAMESPACE)["metadata"]["labels"]
    cluster.kubectl("label", "--overwrite", "namespace", namespace, *(f"{k}={v}" for k, v in labels.items()))
    for sa in ("gpuslice-operator", "gpuslice-agent"):
        cluster.apply(yaml.safe_dump(_in_namespace(one(base, "ServiceAccount", sa), namespace)))
    for kind, name in (("Deployment", "gpuslice-operator"), ("DaemonSet", "gpuslice-agent")):
        pod = _pod_from(one(base, kind, name), namespace)
        proc = cluster.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-", input=pod, check=False)
        assert proc.returncode == 0, f"{kind} {name}: {proc.stderr}"
        admitted = json.loads(proc.stdout)
        if kind == "DaemonSet":
            assert admitted["spec"]["priority"] > 1_000_000_000, "system-node-critical was not resolved"
    # The label is what admits the agent: at `baseline` its host paths and hostPID are refused.
    cluster.kubectl(
        "label", "--overwrite", "namespace", namespace, "pod-security.kubernetes.io/enforce=baseline"
    )
    pod = _pod_from(one(base, "DaemonSet", "gpuslice-agent"), namespace)
    refused = cluster.kubectl("create", "--dry-run=server", "-f", "-", input=pod, check=False)
    assert refused.returncode != 0 and 'violates PodSecurity "baseline:latest"' in refused.stderr


# --- tenant role -------------------------------------------------------------------------------------
def _unique_tenant_roles(base: list[Doc], suffix: str) -> list[Doc]:
    """The tenant roles under unique names and a unique aggregation label, leaving the built-in
    admin/edit/view roles untouched."""
    main = one(base, "ClusterRole", "gpuslice-tenant")
    (selector,) = main["aggregationRule"]["clusterRoleSelectors"]
    ((key, value),) = selector["matchLabels"].items()
    roles = [main]
    for doc in base:
        if doc["kind"] == "ClusterRole" and doc["metadata"].get("labels", {}).get(key) == value:
            roles.append(copy.deepcopy(doc))
    assert len(roles) > 1, "the tenant role aggregates nothing"
    for role in roles:
        role["metadata"]["name"] += f"-{suffix}"
        role["metadata"]["labels"] = {
            k: v
            for k, v in role["metadata"].get("labels", {}).items()
            if not k.startswith("rbac.authorization.k8s.io/aggregate-to-")
        }
        if role is not main:
            role["metadata"]["labels"][key] = suffix
    selector["matchLabels"] = {key: suffix}
    return roles


@pytest.fixture
def tenant(cluster: DevCluster, base: list[Doc], namespace: str, installed: None) -> Iterator[Path]:
    suffix = "t" + uuid.uuid4().hex[:7]  # a letter first: YAML reads "8031e9" as a number
    roles = _unique_tenant_roles(base, suffix)
    cluster.apply(yaml.safe_dump_all(roles))
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "gpu-tenant", "namespace": namespace},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": roles[0]["metadata"]["name"],
        },
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": f"team-{suffix}"}],
    }
    cluster.apply(yaml.safe_dump(binding))
    # kube-controller-manager fills the aggregated role's rules.
    wait_for(
        lambda: (r := get_json(cluster, "clusterrole", roles[0]["metadata"]["name"])) and r.get("rules"),
        what="aggregated tenant role filled in",
    )
    try:
        yield cluster.tenant_kubeconfig(f"user-{suffix}", groups=(f"team-{suffix}",))
    finally:
        for role in roles:
            cluster.kubectl("delete", "clusterrole", role["metadata"]["name"], "--wait=false", check=False)


def can_i(cluster: DevCluster, kubeconfig: Path, verb: str, resource: str, namespace: str) -> bool:
    resource, _, sub = resource.partition("/")
    extra = [f"--subresource={sub}"] if sub else []
    proc = cluster.kubectl(
        "auth", "can-i", verb, resource, *extra, "-n", namespace, kubeconfig=kubeconfig, check=False
    )
    return proc.stdout.strip() == "yes"


def test_tenant_role_allows_slices_and_denies_products_classes_and_device_slices(
    cluster: DevCluster, tenant: Path, namespace: str
) -> None:
    group = constants.API_GROUP
    allowed = [
        ("create", f"gpuslices.{group}"),
        ("delete", f"gpuslices.{group}"),
        ("list", f"gpuslices.{group}"),
        ("get", "resourceclaims.resource.k8s.io"),
        ("create", "pods"),
    ]
    denied = [
        ("create", f"gpupackages.{group}"),
        ("create", "deviceclasses.resource.k8s.io"),
        ("create", "resourceslices.resource.k8s.io"),
        ("create", "resourceclaims.resource.k8s.io"),
        ("update", f"gpuslices.{group}/status"),
    ]
    assert [a for a in allowed if not can_i(cluster, tenant, *a, namespace)] == []
    assert [d for d in denied if can_i(cluster, tenant, *d, namespace)] == []
    assert not can_i(cluster, tenant, "create", f"gpuslices.{group}", "default")


def test_tenant_creates_a_gpuslice_but_is_forbidden_products_and_devices(
    cluster: DevCluster, tenant: Path, namespace: str
) -> None:
    gpuslice = {
        "apiVersion": constants.GROUP_VERSION,
        "kind": constants.SLICE_KIND,
        "metadata": {"name": "llm", "namespace": namespace},
        "spec": {"package": "manifests-test-8g"},
    }
    made = cluster.kubectl(
        "create", "-f", "-", input=yaml.safe_dump(gpuslice), kubeconfig=tenant, check=False
    )
    assert made.returncode == 0, made.stderr
    assert (
        cluster.kubectl(
            "delete", "gpuslice", "llm", "-n", namespace, "--wait=false", kubeconfig=tenant, check=False
        ).returncode
        == 0
    )
    package = {
        "apiVersion": constants.GROUP_VERSION,
        "kind": constants.PACKAGE_KIND,
        "metadata": {"name": "manifests-test-8g"},
        "spec": {"gpuModel": "Tesla V100-PCIE-32GB", "fraction": 25},
    }
    device_class = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": "mine.example.com"},
    }
    device_slice = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "mine"},
        "spec": {
            "driver": constants.DRIVER_NAME,
            "nodeName": cluster.nodes[0],
            "pool": {"name": cluster.nodes[0], "generation": 1, "resourceSliceCount": 1},
        },
    }
    for obj in (package, device_class, device_slice):
        proc = cluster.kubectl("create", "-f", "-", input=yaml.safe_dump(obj), kubeconfig=tenant, check=False)
        assert proc.returncode != 0 and "Forbidden" in proc.stderr, (obj["kind"], proc.stderr)


# --- the agent's own-node policy ---------------------------------------------------------------------
class Agent:
    """The own-node policy applied under a unique name for a unique service account, so it judges
    only this test's requests (and the dev cluster's own agent policy none of them)."""

    def __init__(self, cluster: DevCluster, base: list[Doc]) -> None:
        self.cluster = cluster
        self.suffix = "t" + uuid.uuid4().hex[:7]  # a letter first: YAML reads "8031e9" as a number
        self.user = f"system:serviceaccount:{NAMESPACE}:agent-{self.suffix}"
        #: Stands in for the dev cluster's agent group gpuslice:agents.
        self.group = f"agents-{self.suffix}"
        policy = one(base, "ValidatingAdmissionPolicy", "gpuslice-agent-own-node-slices")
        binding = one(base, "ValidatingAdmissionPolicyBinding", "gpuslice-agent-own-node-slices")
        self.name = f"gpuslice-agent-own-node-slices-{self.suffix}"
        text = json.dumps(policy)
        assert text.count(f"'{AGENT_SA_USER}'") == 1 and text.count("'gpuslice:agents'") == 1
        policy = json.loads(
            text.replace(f"'{AGENT_SA_USER}'", f"'{self.user}'").replace(
                "'gpuslice:agents'", f"'{self.group}'"
            )
        )
        policy["metadata"]["name"] = binding["metadata"]["name"] = binding["spec"]["policyName"] = self.name
        role = one(base, "ClusterRole", "gpuslice-agent")
        role["metadata"]["name"] = self.name
        role_binding = {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": self.name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": self.name},
            "subjects": [
                {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": self.user},
                {"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": self.group},
            ],
        }
        self.objects = [
            ("validatingadmissionpolicybinding", binding),
            ("validatingadmissionpolicy", policy),
            ("clusterrolebinding", role_binding),
            ("clusterrole", role),
        ]
        cluster.apply(yaml.safe_dump_all([obj for _, obj in reversed(self.objects)]))

    def policy(self) -> Doc:
        found: Doc = get_json(self.cluster, "validatingadmissionpolicy", self.name)
        return found

    def remove(self) -> None:
        for kind, obj in self.objects:
            self.cluster.kubectl("delete", kind, obj["metadata"]["name"], "--wait=false", check=False)

    def request(
        self, *args: str, node: str | None, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        who = [f"--as={self.user}", "--as-group=system:serviceaccounts", "--as-group=system:authenticated"]
        if node is not None:
            who.append(f"--as-user-extra={NODE_CLAIM}={node}")
        return self.cluster.kubectl(*who, *args, input=input, check=False)

    def create(self, doc: Doc, node: str | None) -> subprocess.CompletedProcess[str]:
        # Dry run: admission judges the request, and no ResourceSlice reaches the scheduler.
        return self.request("create", "--dry-run=server", "-f", "-", node=node, input=yaml.safe_dump(doc))


def resource_slice(name: str, node: str | None, driver: str = constants.DRIVER_NAME) -> Doc:
    spec: Doc = {
        "driver": driver,
        "pool": {"name": node or "shared", "generation": 1, "resourceSliceCount": 1},
    }
    if node is None:
        spec["allNodes"] = True
    else:
        spec["nodeName"] = node
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": spec,
    }


@pytest.fixture
def agent(cluster: DevCluster, base: list[Doc]) -> Iterator[Agent]:
    a = Agent(cluster, base)
    try:
        # Admission acts on a new policy once the API server's informer has it; the node-less probe
        # is denied by this policy only.
        wait_for(
            lambda: a.name in a.create(resource_slice(f"probe-{a.suffix}", None), node="probe").stderr,
            timeout=30,
            what="the own-node policy in force",
        )
        yield a
    finally:
        a.remove()


def test_agent_may_write_only_its_own_nodes_resource_slices(cluster: DevCluster, agent: Agent) -> None:
    mine, other = cluster.nodes[0], cluster.nodes[1]
    own = agent.create(resource_slice(f"{mine}-{agent.suffix}", mine), node=mine)
    assert own.returncode == 0, own.stderr

    foreign = agent.create(resource_slice(f"{other}-{agent.suffix}", other), node=mine)
    assert foreign.returncode != 0
    assert agent.name in foreign.stderr
    assert (
        f"the gpuslice agent of node {mine} may only write ResourceSlices with spec.nodeName {mine}"
        in foreign.stderr
    )
    assert f"is for node {other}" in foreign.stderr

    shared = agent.create(resource_slice(f"all-{agent.suffix}", None), node=mine)
    assert shared.returncode != 0 and "has no spec.nodeName" in shared.stderr

    other_driver = agent.create(resource_slice(f"gpu-{agent.suffix}", mine, "gpu.example.com"), node=mine)
    assert (
        other_driver.returncode != 0
        and "only write ResourceSlices of driver gpuslice.io" in other_driver.stderr
    )


def test_agent_without_a_node_claim_is_refused(cluster: DevCluster, agent: Agent) -> None:
    proc = agent.create(resource_slice(f"x-{agent.suffix}", cluster.nodes[0]), node=None)
    assert proc.returncode != 0
    assert f"the gpuslice agent {agent.user} is not tied to a node" in proc.stderr


def test_agent_may_not_change_or_delete_another_nodes_slice(cluster: DevCluster, agent: Agent) -> None:
    mine, other = cluster.nodes[0], cluster.nodes[1]
    # Another driver's slice, so no gpuslice agent or the operator counts it while it exists.
    existing = resource_slice(
        f"{other}-existing-{agent.suffix}", other, f"manifests-test-{agent.suffix}.example.com"
    )
    cluster.kubectl("create", "-f", "-", input=yaml.safe_dump(existing))
    try:
        name = existing["metadata"]["name"]
        deleted = agent.request("delete", "resourceslice", name, "--dry-run=server", node=mine)
        assert deleted.returncode != 0 and f"belongs to node {other}" in deleted.stderr
        changed = agent.request(
            "label",
            "resourceslice",
            name,
            "--dry-run=server",
            f"taken-by={mine}",
            node=mine,
        )
        assert changed.returncode != 0
        assert agent.name in changed.stderr and f"is for node {other}" in changed.stderr
    finally:
        cluster.kubectl("delete", "resourceslice", existing["metadata"]["name"], "--wait=false", check=False)


def test_dev_cluster_agent_identity_is_confined_the_same_way(cluster: DevCluster, agent: Agent) -> None:
    # Dev-cluster agents are certificate users gpuslice:agent:<node>; the node comes from the name.
    mine, other = cluster.nodes[0], cluster.nodes[1]

    def create_as(user: str, node: str) -> subprocess.CompletedProcess[str]:
        doc = yaml.safe_dump(resource_slice(f"{node}-dev-{agent.suffix}", node))
        who = (f"--as={user}", f"--as-group={agent.group}", "--as-group=system:authenticated")
        return cluster.kubectl(*who, "create", "--dry-run=server", "-f", "-", input=doc, check=False)

    own = create_as(f"gpuslice:agent:{mine}", mine)
    assert own.returncode == 0, own.stderr
    foreign = create_as(f"gpuslice:agent:{mine}", other)
    assert foreign.returncode != 0 and f"is for node {other}" in foreign.stderr
