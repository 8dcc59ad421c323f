"""What every test folder shares: waiting for the cluster, reading it, and building the objects the
product reads and writes, in the shape the API server returns them.

Kubernetes objects are built here once; the folders' own helpers (`operator/operator_cluster.py`,
`agent/agent_cluster.py`) add only what is theirs (a test label, a node selector).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from gpuslice import constants as c
from gpuslice.agent.gpus import GpuInfo
from gpuslice.agent.slices import Package, build_specs, with_generation
from gpuslice.api.package import GpuPackageSpec
from gpuslice.domain.claims import documented_claim_spec
from gpuslice.domain.deviceclass import device_selector_expression
from gpuslice_dev.devcluster.cluster import DevCluster

T = TypeVar("T")

V100 = "Tesla V100-PCIE-32GB"
V100_PACKAGES = {"v100-8g": 25, "v100-16g": 50, "v100-32g": 100}
DRA_API = c.DRA_GROUP_VERSION


# --- waiting and reading ----------------------------------------------------------------------------

ARGOCD_HEALTH = Path(__file__).resolve().parents[1] / "manifests/argocd/health.lua"


def argocd_health(obj: Mapping[str, Any], script: Path = ARGOCD_HEALTH) -> dict[str, str]:
    """Run Argo CD's health check (Lua) on an object as Argo CD does: the object as the global `obj`,
    the script's returned table as the verdict ({"status": ..., "message": ...})."""
    import lupa

    lua = lupa.LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(json.loads(json.dumps(obj)), recursive=True)
    verdict = lua.execute(script.read_text())
    return {k: str(v) for k, v in dict(verdict).items()}


def wait_for(
    check: Callable[[], T | None], timeout: float = 60, what: str = "", *, interval: float = 0.25
) -> T:
    """Poll until `check` returns something truthy; fail with `what` and the last value otherwise."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or check}; last value: {last!r}")


def lag_of(
    read: Callable[[], dict[str, Any]],
    cause: Callable[[dict[str, Any]], bool],
    effect: Callable[[dict[str, Any]], bool],
    what: str,
    since: float | None = None,
    timeout: float = 60,
) -> float:
    """Seconds from `cause` to the first `read` that shows `effect`, counted from no later than the
    cause: `since` (the moment before the test's own write), else the start of the last read that did
    not show it. The reads' own time is included, so the system's real lag is smaller."""
    before = time.monotonic() if since is None else since
    seen = since is not None
    deadline = time.monotonic() + timeout
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        started = time.monotonic()
        last = read()
        if not seen:
            if cause(last):
                seen = True
            else:
                before = started
        if seen and effect(last):
            lag = time.monotonic() - before
            print(f"\n[lag] {what}: {lag:.2f} s", flush=True)
            return lag
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; last: {json.dumps(last)[:2000]}")


def objects(cluster: DevCluster, namespace: str, *refs: str) -> dict[str, Any]:
    """`kind/name` objects read in one `kubectl get` (cluster-scoped ones too): kind/name -> object,
    absent when not found."""
    out = cluster.kubectl("get", "-n", namespace, *refs, "--ignore-not-found", "-o", "json").stdout
    found = json.loads(out) if out.strip() else {"items": []}
    items = found.get("items", [found])  # one object comes back as itself
    return {f"{x['kind']}/{x['metadata']['name']}": x for x in items}


def get_json(cluster: DevCluster, *args: str, **kw: Any) -> Any:
    """`kubectl get ... -o json`, parsed; None when not found."""
    proc = cluster.kubectl("get", *args, "-o", "json", check=False, **kw)
    if proc.returncode != 0:
        if "NotFound" in proc.stderr or "not found" in proc.stderr:
            return None
        raise AssertionError(f"kubectl get {' '.join(args)} failed: {proc.stderr}")
    return json.loads(proc.stdout)


def remove_operator_policies(cluster: DevCluster) -> None:
    """The admission policies an operator applied outlive it: they admit writes to gpuslice-owned objects
    by its identity only and refuse GPU tolerations outside tenant namespaces, so a file that started an
    operator on the shared cluster removes them, or they judge the files that run after it."""
    selector = f"{c.LABEL_MANAGED_BY}={c.MANAGED_BY_VALUE}"
    # one kind a call: a version that does not serve a kind (1.35 has no MutatingAdmissionPolicy by
    # default) fails the whole call, which would leave the kinds it does serve in place
    # bindings first, so no binding is left naming a policy already gone
    for kind in sorted(c.ADMISSION_PLURALS.values(), key=lambda plural: not plural.endswith("bindings")):
        cluster.kubectl("delete", kind, "-l", selector, "--wait=false", check=False)


def wait_until_not_terminating(cluster: DevCluster, namespace: str, timeout: float = 120) -> None:
    """An earlier file may have deleted the namespace without waiting; nothing can be created in it until
    it is gone."""

    def settled() -> bool:
        ns = get_json(cluster, "namespace", namespace)
        return ns is None or not ns["metadata"].get("deletionTimestamp")

    wait_for(settled, timeout, f"namespace {namespace} to finish terminating", interval=0.5)


def apply(cluster: DevCluster, docs: list[dict[str, Any]], *, kubeconfig: Path | None = None) -> None:
    """Server-side apply, sent as JSON: YAML would turn a name like `n` into a boolean for Go."""
    cluster.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}), kubeconfig=kubeconfig)


# --- reading gpuslice's /metrics ----------------------------------------------------------------------

METRICS_READER_ROLE = Path(__file__).resolve().parents[1] / "manifests/base/metrics-reader.yaml"


@dataclass(frozen=True)
class MetricsReaders:
    """Service account tokens for scraping a gated /metrics port, as pods in the cluster hold them."""

    #: a tenant's pod: `edit` in its own namespace, nothing on /metrics
    tenant: str
    #: Prometheus: bound to the manifests' ClusterRole gpuslice-metrics-reader
    prometheus: str


@contextmanager
def metrics_readers(cluster: DevCluster) -> Iterator[MetricsReaders]:
    """Two service accounts in a namespace of their own; the manifests' metrics-reader role (under a
    test-unique name, so files on one cluster do not share it) bound to `prometheus` only."""
    token = uuid.uuid4().hex[:6]
    ns = cluster.create_namespace(f"metrics-{token}")
    (role,) = [d for d in yaml.safe_load_all(METRICS_READER_ROLE.read_text()) if d]
    role["metadata"]["name"] = name = f"gpuslice-metrics-reader-{token}"
    apply(
        cluster,
        [
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": n, "namespace": ns}}
            for n in ("tenant", "prometheus")
        ]
        + [
            role,
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": name},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
                "subjects": [{"kind": "ServiceAccount", "name": "prometheus", "namespace": ns}],
            },
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": {"name": "tenant-edit", "namespace": ns},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
                "subjects": [{"kind": "ServiceAccount", "name": "tenant", "namespace": ns}],
            },
        ],
    )
    tokens = {
        n: cluster.kubectl("create", "token", n, "-n", ns).stdout.strip() for n in ("tenant", "prometheus")
    }
    try:
        yield MetricsReaders(tenant=tokens["tenant"], prometheus=tokens["prometheus"])
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        cluster.kubectl("delete", "clusterrole,clusterrolebinding", name, "--wait=false", check=False)


def scrape(url: str, token: str | None, timeout: float = 20) -> tuple[int, str]:
    """GET a metrics URL with `Authorization: Bearer <token>` (none without a token): status and body."""
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


# --- GPUs and what the agent publishes for them -----------------------------------------------------


def gpu(index: int, model: str = V100, memory: int = 32 * c.GIB, *, node: str | None = None) -> GpuInfo:
    """A card as NVML reports it; with `node`, its UUID names the node (unique across a test's pools)."""
    return GpuInfo(
        index=index,
        uuid=f"GPU-{node}-{index}" if node else f"GPU-{index:08x}-0000-0000-0000-000000000000",
        product_name=model,
        memory_bytes=memory,
        cuda_compute_capability="7.0",
        driver_version="535.104.05",
        cuda_driver_version="12.2",
        minor_number=index,
        pci_bus_id=f"00000000:{index:02X}:00.0",
    )


def package_spec(fraction: int, model: str = V100, **kw: Any) -> GpuPackageSpec:
    return GpuPackageSpec.model_validate({"gpuModel": model, "fraction": fraction, **kw})


def published(
    node: str,
    gpus: int,
    packages: Mapping[str, int] | None = None,
    generation: int = 1,
    model: str = V100,
    taints: Mapping[int, list[dict[str, Any]]] | None = None,
) -> list[dict[str, Any]]:
    """The ResourceSlices the node agent publishes for `gpus` cards (the agent's own builder);
    `taints`: the device taints of unhealthy cards, by card index."""
    pk = [Package(n, package_spec(f, model)) for n, f in (packages or V100_PACKAGES).items()]
    cards = [gpu(i, node=node, model=model) for i in range(gpus)]
    by_uuid = {cards[i].uuid: t for i, t in (taints or {}).items()}
    return with_generation(node, build_specs(node, cards, pk, by_uuid), generation)


# --- gpuslice objects -------------------------------------------------------------------------------


def package_doc(
    name: str,
    fraction: int,
    selector: dict[str, str] | None = None,
    slices: int = 2,
    model: str = V100,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A GpuPackage; with `selector`, entitled to `slices` slices in the namespaces it matches."""
    spec: dict[str, Any] = {"gpuModel": model, "fraction": fraction}
    if selector:
        spec["entitlements"] = [{"namespaceSelector": {"matchLabels": selector}, "slices": slices}]
    return {
        "apiVersion": c.GROUP_VERSION,
        "kind": c.PACKAGE_KIND,
        "metadata": {"name": name, **({"labels": labels} if labels else {})},
        "spec": spec,
    }


def slice_doc(name: str, namespace: str, package: str, template: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {"package": package}
    if template:
        spec["template"] = True
    return {
        "apiVersion": c.GROUP_VERSION,
        "kind": c.SLICE_KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


# --- DRA objects and workloads ------------------------------------------------------------------------


def device_class_doc(package: str, model: str = V100) -> dict[str, Any]:
    """The DeviceClass the operator generates for a package, without its ownership (for tests that run
    no operator)."""
    expression = device_selector_expression(package, package_spec(100, model))
    return {
        "apiVersion": DRA_API,
        "kind": "DeviceClass",
        "metadata": {"name": c.device_class_name(package)},
        "spec": {"selectors": [{"cel": {"expression": expression}}]},
    }


def claim_doc(name: str, namespace: str, package: str) -> dict[str, Any]:
    """A ResourceClaim of the documented form (the product's own), written by hand, not by a GpuSlice."""
    return {
        "apiVersion": DRA_API,
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "labels": {c.LABEL_PACKAGE: package}},
        "spec": documented_claim_spec(package),
    }


def allocated_claim(
    namespace: str, name: str, node: str, device: str, reserved_for: tuple[str, ...] = ()
) -> dict[str, Any]:
    """A claim as the API server shows it once kube-scheduler allocated `device` of pool `node`."""
    return {
        "metadata": {"namespace": namespace, "name": name, "labels": {}},
        "spec": {
            "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "v100-8g.gpuslice.io"}}]}
        },
        "status": {
            "allocation": {
                "devices": {
                    "results": [{"request": "gpu", "driver": c.DRIVER_NAME, "pool": node, "device": device}]
                },
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                    ]
                },
            },
            "reservedFor": [{"resource": "pods", "name": p, "uid": f"uid-{p}"} for p in reserved_for],
        },
    }


def pod_doc(
    name: str,
    namespace: str,
    claim: str | None = None,
    *,
    template: str | None = None,
    cpu: str | None = "100m",
    memory: str = "2Gi",
    image: str = "cuda:test",
    node_selector: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A pod whose container holds the claim `claim` (default: named like the pod) or one made from
    `template`; it requests `cpu` and `memory` (no requests with cpu=None, memory is always limited)."""
    ref: dict[str, str] = {"name": "gpu"}
    if template:
        ref["resourceClaimTemplateName"] = template
    else:
        ref["resourceClaimName"] = claim or name
    resources: dict[str, Any] = {"claims": [{"name": "gpu"}], "limits": {"memory": memory}}
    if cpu:
        resources["requests"] = {"cpu": cpu, "memory": memory}
    spec: dict[str, Any] = {
        "resourceClaims": [ref],
        "containers": [{"name": "main", "image": image, "resources": resources}],
    }
    if node_selector:
        spec["nodeSelector"] = node_selector
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def deployment_doc(
    name: str,
    namespace: str,
    *,
    claim: str | None = None,
    template: str | None = None,
    replicas: int = 1,
    cpu: str = "100m",
) -> dict[str, Any]:
    pod = pod_doc(name, namespace, claim, template=template, cpu=cpu)
    return deployment_of(name, namespace, pod["spec"], replicas)


def deployment_of(name: str, namespace: str, pod_spec: dict[str, Any], replicas: int = 1) -> dict[str, Any]:
    """A Deployment `name` of `replicas` pods of `pod_spec`, labelled and selected by `app: name`."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": pod_spec},
        },
    }


# --- running gpuslice as a user does ----------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]


def gpuslice_check(kubeconfig: Path) -> subprocess.CompletedProcess[str]:
    """`gpuslice check` as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "gpuslice", "check", f"--kubeconfig={kubeconfig}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=False,
    )


def check_line(output: str, name: str) -> str:
    """The one line of `gpuslice check`'s output for prerequisite `name`."""
    (found,) = [x for x in output.splitlines() if x[2:].startswith(name)]
    return found


def counters_kept(cluster: DevCluster) -> bool:
    """Does this devcluster's API server keep ResourceSlice shared counters? Off by default only on
    1.35, where DRAPartitionableDevices is alpha (README "Kubernetes versions")."""
    from gpuslice_dev.devcluster.binaries import minor_of
    from gpuslice_dev.devcluster.components import gates_map

    gate = gates_map(cluster.apiserver_feature_gates).get("DRAPartitionableDevices")
    return gate if gate is not None else minor_of(cluster.kubernetes) != "1.35"


def served(cluster: DevCluster, group_version: str, resource: str) -> bool:
    """Does this devcluster's API server serve `resource` in `group_version` (discovery)?"""
    out = cluster.kubectl("get", "--raw", f"/apis/{group_version}", check=False)
    return out.returncode == 0 and any(r.get("name") == resource for r in json.loads(out.stdout)["resources"])


def skip_unless_served(cluster: DevCluster, group_version: str, resource: str, feature: str) -> None:
    """Skip a test of `feature` where this minor does not serve it (README "Kubernetes versions":
    `tests/operator/test_versions_cluster.py` checks that gpuslice says so there)."""
    if not served(cluster, group_version, resource):
        pytest.skip(
            f"Kubernetes {cluster.kubernetes} does not serve {group_version} {resource}: {feature} is off"
        )
