"""The kustomize base agrees with the code it deploys: names, paths, command lines, privileges."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from gpuslice import constants
from gpuslice.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "gpuslice-system"
DEV_AGENT_BINDING = "devtools/gpuslice_dev/manifests/dev-agent-binding.yaml"

Doc = dict[str, Any]


def one(docs: list[Doc], kind: str, name: str) -> Doc:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def pod_spec(doc: Doc) -> Doc:
    spec: Doc = doc["spec"]["template"]["spec"]
    return spec


def container(doc: Doc, name: str) -> Doc:
    (c,) = [c for c in pod_spec(doc)["containers"] if c["name"] == name]
    return c


def parse_command(c: Doc, env: dict[str, str]) -> Any:
    """The container's command line as the real `gpuslice` CLI parses it, $(VAR) expanded like kubelet."""
    argv = [*c["command"], *c.get("args", [])]
    assert argv[0] == "gpuslice"
    for var, value in env.items():
        argv = [a.replace(f"$({var})", value) for a in argv]
    return build_parser().parse_args(argv[1:])


def test_every_crd_file_is_in_the_crds_kustomization_and_in_the_base(base):
    listed = yaml.safe_load((REPO / "crds" / "Kustomization").read_text())["resources"]
    files = sorted(p.name for p in (REPO / "crds").glob("*.yaml"))
    assert sorted(listed) == files
    crds = {d["metadata"]["name"] for d in base if d["kind"] == "CustomResourceDefinition"}
    assert crds == {
        f"{constants.PACKAGE_PLURAL}.{constants.API_GROUP}",
        f"{constants.SLICE_PLURAL}.{constants.API_GROUP}",
        f"{constants.USAGE_PLURAL}.{constants.API_GROUP}",
        "clusterkopfpeerings.kopf.dev",
    }


def test_namespaced_objects_live_in_gpuslice_system(base):
    one(base, "Namespace", NAMESPACE)
    cluster_scoped = {
        "Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering",
        "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
    }  # fmt: skip
    for doc in base:
        where = doc["metadata"].get("namespace")
        if doc["kind"] in cluster_scoped:
            assert where is None, f"{doc['kind']} {doc['metadata']['name']} is cluster-scoped"
        else:
            assert where == NAMESPACE, f"{doc['kind']} {doc['metadata']['name']} in {where}"


def test_operator_runs_two_peered_replicas_with_kopf_health_probes(base):
    deploy = one(base, "Deployment", "gpuslice-operator")
    assert deploy["spec"]["replicas"] == 2
    c = container(deploy, "operator")
    args = parse_command(c, {})
    assert args.command == "operator" and args.peering is True
    peering = one(base, "ClusterKopfPeering", constants.PEERING_NAME)
    assert peering["apiVersion"] == "kopf.dev/v1"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert args.metrics_port == ports["metrics"]
    # Kopf serves its health endpoint at the URL given; both probes must hit exactly that.
    host_port, path = args.liveness.removeprefix("http://").split("/", 1)
    assert host_port.split(":")[1] == str(ports["health"])
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": f"/{path}", "port": "health"}
    assert pod_spec(deploy)["serviceAccountName"] == "gpuslice-operator"


def test_agent_command_line_parses_to_the_node_paths_it_mounts(base):
    ds = one(base, "DaemonSet", "gpuslice-agent")
    c = container(ds, "agent")
    args = parse_command(c, {"NODE_NAME": "gpu-node-7"})
    assert args.command == "agent" and args.node == "gpu-node-7"
    node_env = next(e for e in c["env"] if e["name"] == "NODE_NAME")
    assert node_env["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert args.metrics_port == next(p["containerPort"] for p in c["ports"] if p["name"] == "metrics")
    volumes = {v["name"]: v for v in pod_spec(ds)["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}

    def host_path_at(path: str) -> str:
        return str(volumes[mounts[path]["name"]]["hostPath"]["path"])

    # Each directory the agent uses is the host's own, mounted at the same path: the CDI specs it
    # writes name these paths for the container runtime on the host.
    dra_socket_dir = f"{args.plugins_dir}/{constants.DRIVER_NAME}"
    for path in (
        dra_socket_dir,
        str(args.registry_dir),
        str(args.cdi_dir),
        str(args.state_dir),
        str(args.run_dir),
        constants.HOST_SHIM_DIR,
    ):
        assert host_path_at(path) == path
    assert args.plugins_dir == Path(constants.KUBELET_PLUGINS_DIR)
    assert args.registry_dir == Path(constants.KUBELET_REGISTRY_DIR)
    assert args.cdi_dir == Path(constants.CDI_DIR)
    assert args.state_dir == Path(constants.HOST_STATE_DIR)
    assert args.run_dir == Path(constants.HOST_RUN_DIR)
    assert mounts[constants.HOST_SHIM_DIR].get("readOnly") is True


def test_shim_install_puts_the_library_where_the_agent_points_cdi_specs(base):
    ds = one(base, "DaemonSet", "gpuslice-agent")
    (init,) = pod_spec(ds)["initContainers"]
    script = init["command"][-1]
    target = f"/host{constants.CONTAINER_SHIM_PATH}"
    assert f"mv -f /host{constants.HOST_SHIM_DIR}/.libgpuslice.so.new {target}" in script
    (mount,) = init["volumeMounts"]
    shim_volume = next(v for v in pod_spec(ds)["volumes"] if v["name"] == mount["name"])
    assert shim_volume["hostPath"]["path"] == constants.HOST_SHIM_DIR
    assert mount["mountPath"] == f"/host{constants.HOST_SHIM_DIR}"


#: Capabilities a container adds back after dropping ALL, and why (manifests/base/agent/daemonset.yaml):
#: the NVIDIA runtime injects the agent's GPUs (NVML) only into containers with CAP_SYS_ADMIN once the
#: node is safe for tenants, and KILL stops a process past its slice whatever its uid.
ADDED_CAPABILITIES = {"gpuslice-agent/agent": ["SYS_ADMIN", "KILL"]}


def test_no_container_is_privileged_and_all_drop_every_capability(base):
    for doc in base:
        if doc["kind"] not in ("Deployment", "DaemonSet"):
            continue
        spec = pod_spec(doc)
        assert not spec.get("hostNetwork")
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            sc = c["securityContext"]
            where = f"{doc['metadata']['name']}/{c['name']}"
            assert not sc.get("privileged"), where
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["readOnlyRootFilesystem"] is True, where
            added = {"add": ADDED_CAPABILITIES[where]} if where in ADDED_CAPABILITIES else {}
            want = {"drop": ["ALL"]} | added
            assert sc["capabilities"] == want, where
    operator = pod_spec(one(base, "Deployment", "gpuslice-operator"))
    assert operator["securityContext"]["runAsNonRoot"] is True


def test_agent_policy_names_the_service_account_the_daemonset_runs_as(base):
    ds = one(base, "DaemonSet", "gpuslice-agent")
    sa = one(base, "ServiceAccount", pod_spec(ds)["serviceAccountName"])
    username = f"system:serviceaccount:{sa['metadata']['namespace']}:{sa['metadata']['name']}"
    policy = one(base, "ValidatingAdmissionPolicy", "gpuslice-agent-own-node-slices")
    (condition,) = policy["spec"]["matchConditions"]
    assert f"'{username}'" in condition["expression"]
    binding = one(base, "ValidatingAdmissionPolicyBinding", "gpuslice-agent-own-node-slices")
    assert binding["spec"] == {"policyName": "gpuslice-agent-own-node-slices", "validationActions": ["Deny"]}


def _grants(rules: list[Doc]) -> set[tuple[str, str, str]]:
    return {
        (g, r, v)
        for rule in rules
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }


def test_dev_cluster_agents_get_the_deployed_role_and_policy(base):
    # The dev cluster applies manifests/base/agent/ as it is, and binds its client-certificate agents
    # to the same role: they must be the agents the own-node policy confines.
    docs = [d for d in yaml.safe_load_all((REPO / DEV_AGENT_BINDING).read_text()) if d]
    (dev,) = [
        d for d in docs if d["kind"] == "ClusterRoleBinding" and d["roleRef"]["name"] == "gpuslice-agent"
    ]
    # beside it only the arbitrary-node verb for a claim's status.devices of driver gpuslice.io
    # (client-certificate users are no node-bound service account)
    extra = [d for d in docs if d["kind"] == "ClusterRole"]
    assert [r for d in extra for r in d["rules"]] == [
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims/driver"],
         "resourceNames": ["gpuslice.io"], "verbs": ["arbitrary-node:patch"]}
    ]  # fmt: skip
    role = one(base, "ClusterRole", dev["roleRef"]["name"])
    assert role["rules"], "the dev agents' role grants nothing"
    (condition,) = one(base, "ValidatingAdmissionPolicy", "gpuslice-agent-own-node-slices")["spec"][
        "matchConditions"
    ]
    for subject in dev["subjects"]:
        assert subject["kind"] == "Group"
        assert f"'{subject['name']}' in request.userInfo.groups" in condition["expression"]


def test_service_accounts_are_bound_to_their_roles(base):
    for name in ("gpuslice-operator", "gpuslice-agent"):
        binding = one(base, "ClusterRoleBinding", name)
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": name,
        }
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": NAMESPACE}]


def test_tenant_role_never_grants_products_device_classes_or_resource_slices(base):
    aggregated = one(base, "ClusterRole", "gpuslice-tenant")["aggregationRule"]["clusterRoleSelectors"]
    parts = [
        d
        for d in base
        if d["kind"] == "ClusterRole"
        and any(s["matchLabels"].items() <= d["metadata"].get("labels", {}).items() for s in aggregated)
    ]
    grants = _grants([r for p in parts for r in p["rules"]])
    assert ("gpuslice.io", "gpuslices", "create") in grants
    forbidden = {"gpupackages", "gpuslices/status", "deviceclasses", "resourceslices"}
    assert not [g for g in grants if g[1] in forbidden]
    assert {v for _, r, v in grants if r == "gpuusages"} == {"get", "list", "watch"}, (
        "the ledger is the operator's"
    )
    assert {v for _, r, v in grants if r == "gpuusages"} == {"get", "list", "watch"}, (
        "the ledger is read-only"
    )
    claim_verbs = {v for _, r, v in grants if r in ("resourceclaims", "resourceclaimtemplates")}
    assert claim_verbs == {"get", "list", "watch"}, "claims are the operator's to write"


SCRAPERS = {"namespaceSelector": {"matchLabels": {"gpuslice.io/metrics-scraper": "true"}}}


def test_every_metrics_port_is_reachable_from_scraper_namespaces_only(base):
    # The operator's and the agents' series name tenants' namespaces and slices: besides each
    # reader's token, only the monitoring namespace's pods may connect to the port at all.
    workloads = [d for d in base if d["kind"] in ("Deployment", "DaemonSet")]
    serving = [
        w
        for w in workloads
        if any(p["name"] == "metrics" for c in pod_spec(w)["containers"] for p in c.get("ports", []))
    ]
    assert {w["metadata"]["name"] for w in serving} == {"gpuslice-operator", "gpuslice-agent"}
    for w in serving:
        labels = w["spec"]["template"]["metadata"]["labels"]
        policies = [
            p
            for p in base
            if p["kind"] == "NetworkPolicy"
            and p["metadata"]["namespace"] == w["metadata"]["namespace"]
            and p["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
            and "Ingress" in p["spec"]["policyTypes"]
        ]
        rules = [r for p in policies for r in p["spec"].get("ingress", [])]
        to_metrics = [r for r in rules if "ports" not in r or any(p["port"] == "metrics" for p in r["ports"])]
        name = w["metadata"]["name"]
        assert to_metrics, f"{name}: no NetworkPolicy admits its metrics port, or none selects it"
        assert all(r.get("from") == [SCRAPERS] for r in to_metrics), (name, to_metrics)


def test_both_processes_may_ask_the_api_server_who_reads_their_metrics(base):
    # gpuslice.metrics_auth reviews each scraper's token (TokenReview) and its right to GET /metrics
    # (SubjectAccessReview) with the process's own service account.
    def grants(account: str) -> set[tuple[str, str, str]]:
        roles = {
            b["roleRef"]["name"]
            for b in base
            if b["kind"] == "ClusterRoleBinding"
            and {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE} in b["subjects"]
        }
        out = set()
        for r in base:
            if r["kind"] == "ClusterRole" and r["metadata"]["name"] in roles:
                for rule in r.get("rules", []):
                    for g in rule.get("apiGroups", []):
                        for res in rule.get("resources", []):
                            out.update((g, res, v) for v in rule["verbs"])
        if "system:auth-delegator" in roles:  # Kubernetes' own role: exactly these two
            out |= {("authentication.k8s.io", "tokenreviews", "create")}
            out |= {("authorization.k8s.io", "subjectaccessreviews", "create")}
        return out

    for account in ("gpuslice-operator", "gpuslice-agent"):
        assert {
            ("authentication.k8s.io", "tokenreviews", "create"),
            ("authorization.k8s.io", "subjectaccessreviews", "create"),
        } <= grants(account), account
