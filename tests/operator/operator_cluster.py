"""Helpers for the operator's tests on the real control plane: run the operator, publish GPUs by
hand (as the node agent would), act as a tenant."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from gpuslice import constants as c
from gpuslice.agent.slices import Package, build_specs, with_generation
from gpuslice.api.package import GpuPackageSpec
from gpuslice.dev.devcluster.cluster import DevCluster

from .fixtures import V100, gpu

REPO = Path(__file__).resolve().parents[2]
#: Test objects carry this label so teardown finds them, and pools this prefix so they never
#: collide with what a node agent publishes in the same cluster.
TEST_LABEL = "gpuslice-test/operator"
POOL_PREFIX = "optest-"


class OperatorProcess:
    """`gpuslice operator` as a subprocess, logging to a file; restartable, killable."""

    def __init__(self, cluster: DevCluster, log: Path, *extra: str) -> None:
        self.cluster, self.log, self.extra = cluster, log, extra
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "gpuslice",
                    "operator",
                    f"--kubeconfig={self.cluster.kubeconfig}",
                    *self.extra,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO,
            )

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:]) if self.log.exists() else ""


def package_doc(
    name: str, fraction: int, selector: dict[str, str] | None, slices: int = 2, model: str = V100
) -> dict[str, Any]:
    spec: dict[str, Any] = {"gpuModel": model, "fraction": fraction}
    if selector:
        spec["entitlements"] = [{"namespaceSelector": {"matchLabels": selector}, "slices": slices}]
    return {
        "apiVersion": c.GROUP_VERSION,
        "kind": c.PACKAGE_KIND,
        "metadata": {"name": name, "labels": {TEST_LABEL: "true"}},
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


def pod_doc(
    name: str,
    namespace: str,
    claim: str | None = None,
    *,
    template: str | None = None,
    cpu: str = "100m",
    memory: str = "2Gi",
) -> dict[str, Any]:
    ref: dict[str, str] = {"name": "gpu"}
    if template:
        ref["resourceClaimTemplateName"] = template
    else:
        ref["resourceClaimName"] = claim or name
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "resourceClaims": [ref],
            "containers": [
                {
                    "name": "main",
                    "image": "cuda:test",
                    "resources": {
                        "claims": [{"name": "gpu"}],
                        "requests": {"cpu": cpu, "memory": memory},
                        "limits": {"memory": memory},
                    },
                }
            ],
        },
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
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": pod["spec"]},
        },
    }


def publish_gpus(
    cluster: DevCluster, token: str, node: str, gpus: int, packages: dict[str, int], model: str = V100
) -> str:
    """ResourceSlices for `gpus` cards on `node`, built by the agent's own builder, in a pool of the
    test's own (`optest-<token>-<node>`); returns the pool name, which prefixes the GPU UUIDs."""
    pk = [
        Package(n, GpuPackageSpec.model_validate({"gpuModel": model, "fraction": f}))
        for n, f in packages.items()
    ]
    pool = f"{POOL_PREFIX}{token}-{node}"
    cards = [gpu(pool, i, model=model) for i in range(gpus)]
    docs = with_generation(pool, build_specs(pool, cards, pk), 1)
    for d in docs:
        d["spec"]["nodeName"] = node
        d["metadata"]["labels"][TEST_LABEL] = "true"
    apply(cluster, docs)
    return pool


def apply(cluster: DevCluster, docs: list[dict[str, Any]], *, kubeconfig: Path | None = None) -> None:
    """Server-side apply, sent as JSON: YAML would turn a name like `n` into a boolean for Go."""
    cluster.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}), kubeconfig=kubeconfig)


def kubectl_as(
    cluster: DevCluster, kubeconfig: Path, *args: str, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    return cluster.kubectl(*args, kubeconfig=kubeconfig, input=input, check=False)


def create_as(cluster: DevCluster, kubeconfig: Path, doc: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    return kubectl_as(cluster, kubeconfig, "create", "-f", "-", input=json.dumps(doc))


def get(cluster: DevCluster, *args: str) -> Any:
    proc = cluster.kubectl("get", *args, "-o", "json", check=False)
    if proc.returncode != 0:
        return None
    return json.loads(proc.stdout)


def slice_status(cluster: DevCluster, namespace: str, name: str) -> dict[str, Any]:
    obj = get(cluster, "gpuslices.gpuslice.io", name, "-n", namespace)
    return (obj or {}).get("status") or {}


def apply_tenant_roles(cluster: DevCluster) -> None:
    """The tenant roles of manifests/base. An aggregated role's rules belong to kube-controller-manager's
    aggregation controller, so they are left out of the apply (applying `rules: []` again conflicts)."""
    docs = [d for d in yaml.safe_load_all((REPO / "manifests/base/tenant/rbac.yaml").read_text()) if d]
    for d in docs:
        if "aggregationRule" in d:
            d.pop("rules", None)
    apply(cluster, docs)


@contextmanager
def tenant_rbac(cluster: DevCluster, namespace: str, user: str) -> Iterator[Path]:
    """A client-certificate user with `edit` plus the gpuslice tenant role in one namespace."""
    apply_tenant_roles(cluster)
    bindings = [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": f"{user}-{role}", "namespace": namespace},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
        }
        for role in ("edit", "gpuslice-tenant")
    ]
    apply(cluster, bindings)
    # The tenant role is aggregated by kube-controller-manager; wait until it grants GpuSlices.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        can = cluster.kubectl(
            "auth", "can-i", "create", "gpuslices.gpuslice.io", "-n", namespace, f"--as={user}", check=False
        )
        if can.stdout.strip() == "yes":
            break
        time.sleep(0.3)
    yield cluster.tenant_kubeconfig(user, groups=("gpuslice:tenants",))


def wait_status(
    cluster: DevCluster, namespace: str, name: str, timeout: float = 60, **want: str
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    st: dict[str, Any] = {}
    while time.monotonic() < deadline:
        st = slice_status(cluster, namespace, name)
        if all(st.get(k) == v for k, v in want.items()):
            return st
        time.sleep(0.3)
    raise AssertionError(
        f"GpuSlice {namespace}/{name}: wanted {want}, last status {json.dumps(st, indent=1)}"
    )
