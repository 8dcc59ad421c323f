"""Helpers for the operator's tests on the real control plane: run the operator, publish GPUs by
hand (as the node agent would), act as a tenant."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

import support
from gpuslice_dev.devcluster.cluster import DevCluster
from support import V100, apply, remove_operator_policies, wait_for

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
        #: the service account token `metrics` sends (one allowed GET /metrics: see `metrics_readers`)
        self.metrics_token: str | None = None

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

    @property
    def metrics_url(self) -> str:
        port = next(a.split("=", 1)[1] for a in self.extra if a.startswith("--metrics-port="))
        return f"http://127.0.0.1:{port}/metrics"

    def metrics(self) -> str:
        """The operator's /metrics, read with `metrics_token` as Prometheus reads it."""
        status, body = support.scrape(self.metrics_url, self.metrics_token)
        assert status == 200, f"GET {self.metrics_url}: {status} {body}"
        return body

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:]) if self.log.exists() else ""


@contextmanager
def module_operator(
    cluster: DevCluster, log: Path, *extra: str, metrics_token: str | None = None
) -> Iterator[OperatorProcess]:
    """A module's operator: the CRDs applied, `gpuslice operator *extra` started and its admission
    policies in place. On the way out the module's GpuSlices and GpuPackages (those with TEST_LABEL) go
    while it still runs (packages carry its finalizer), then it stops, its policies and the module's
    ResourceSlices are removed and the tail of its log is printed."""
    cluster.apply_crds()
    op = OperatorProcess(cluster, log, *extra)
    op.metrics_token = metrics_token
    op.start()
    try:
        wait_for(lambda: get(cluster, "validatingadmissionpolicybinding", "gpuslice-protect"), 60, "policies")
        yield op
    finally:
        cluster.kubectl(
            "delete", "gpuslices.gpuslice.io", "-A", "-l", TEST_LABEL, "--wait=false", check=False
        )
        cluster.kubectl("delete", "gpupackages.gpuslice.io", "-l", TEST_LABEL, "--timeout=60s", check=False)
        op.stop()
        remove_operator_policies(cluster)
        cluster.kubectl("delete", "resourceslices", "-l", TEST_LABEL, check=False)
        print(op.tail(), flush=True)


def package_doc(
    name: str, fraction: int, selector: dict[str, str] | None, slices: int = 2, model: str = V100
) -> dict[str, Any]:
    """A GpuPackage carrying the test label, so the module's teardown finds it."""
    return support.package_doc(name, fraction, selector, slices, model, labels={TEST_LABEL: "true"})


def publish_gpus(
    cluster: DevCluster, token: str, node: str, gpus: int, packages: dict[str, int], model: str = V100
) -> str:
    """ResourceSlices for `gpus` cards on `node`, built by the agent's own builder, in a pool of the
    test's own (`optest-<token>-<node>`); returns the pool name, which prefixes the GPU UUIDs."""
    pool = f"{POOL_PREFIX}{token}-{node}"
    docs = support.published(pool, gpus, packages, model=model)
    for d in docs:
        d["spec"]["nodeName"] = node
        d["metadata"]["labels"][TEST_LABEL] = "true"
    apply(cluster, docs)
    return pool


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
    wait_for(
        lambda: (
            cluster.kubectl(
                "auth",
                "can-i",
                "create",
                "gpuslices.gpuslice.io",
                "-n",
                namespace,
                f"--as={user}",
                check=False,
            ).stdout.strip()
            == "yes"
        ),
        30,
        what=f"{user} may create GpuSlices",
    )
    yield cluster.tenant_kubeconfig(user, groups=("gpuslice:tenants",))


def wait_status(
    cluster: DevCluster, namespace: str, name: str, timeout: float = 60, **want: str
) -> dict[str, Any]:
    """The slice's status once every field in `want` has its value."""
    last: dict[str, Any] = {}

    def reached() -> dict[str, Any] | None:
        last.clear()
        last.update(slice_status(cluster, namespace, name))
        return dict(last) if all(last.get(k) == v for k, v in want.items()) else None

    try:
        return wait_for(reached, timeout, what=f"GpuSlice {namespace}/{name} with {want}")
    except AssertionError:
        raise AssertionError(
            f"GpuSlice {namespace}/{name}: wanted {want}, last status {json.dumps(last, indent=1)}"
        ) from None
