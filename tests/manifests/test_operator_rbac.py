"""The operator does its whole job with exactly the permissions manifests/ grants it, and no more.

The real `gpuslice operator` runs as its service account's user name (a client certificate for
system:serviceaccount:gpuslice-system:gpuslice-operator, which RBAC matches like the account's token)
bound to the manifests' ClusterRole. A missing verb shows up as a Forbidden in its log and as work
left undone. Run on a cluster where no other gpuslice operator is working: two operators would
fight over the admission policies.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuslice import constants
from gpuslice_dev.devcluster.cluster import DevCluster
from support import (
    get_json,
    metrics_readers,
    remove_operator_policies,
    scrape,
    wait_for,
    wait_until_not_terminating,
)

pytestmark = pytest.mark.cluster

OPERATOR_USER = "system:serviceaccount:gpuslice-system:gpuslice-operator"
OPERATOR_GROUPS = ("system:serviceaccounts", "system:serviceaccounts:gpuslice-system", "system:authenticated")
REPO = Path(__file__).resolve().parents[2]

Doc = dict[str, Any]


def one(docs: list[Doc], kind: str, name: str) -> Doc:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return copy.deepcopy(doc)


@pytest.fixture
def operator_kubeconfig(cluster: DevCluster, base: list[Doc]) -> Iterator[Path]:
    """The manifests' operator role and binding (under test-unique names) and credentials for the
    service account they bind."""
    suffix = "t" + uuid.uuid4().hex[:7]  # a letter first: YAML reads "8031e9" as a number
    role = one(base, "ClusterRole", "gpuslice-operator")
    binding = one(base, "ClusterRoleBinding", "gpuslice-operator")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "gpuslice-operator", "namespace": "gpuslice-system"}
    ]
    role["metadata"]["name"] = binding["metadata"]["name"] = binding["roleRef"]["name"] = (
        f"gpuslice-op-{suffix}"
    )
    # The ledger heartbeat's Lease, in the operator's own namespace.
    lease_role = one(base, "Role", "gpuslice-operator-ledger")
    lease_binding = one(base, "RoleBinding", "gpuslice-operator-ledger")
    lease_role["metadata"]["name"] = lease_binding["metadata"]["name"] = lease_binding["roleRef"]["name"] = (
        f"gpuslice-op-ledger-{suffix}"
    )
    wait_until_not_terminating(cluster, "gpuslice-system")
    cluster.create_namespace("gpuslice-system")
    cluster.apply(yaml.safe_dump_all([role, binding, lease_role, lease_binding]))
    try:
        yield cluster.tenant_kubeconfig(OPERATOR_USER, groups=OPERATOR_GROUPS)
    finally:
        for kind, name in (("rolebinding", lease_binding), ("role", lease_role)):
            cluster.kubectl(
                "delete", kind, name["metadata"]["name"], "-n", "gpuslice-system", "--wait=false", check=False
            )
        cluster.kubectl(
            "delete", "clusterrolebinding", binding["metadata"]["name"], "--wait=false", check=False
        )
        cluster.kubectl("delete", "clusterrole", role["metadata"]["name"], "--wait=false", check=False)


def can_i(cluster: DevCluster, kubeconfig: Path, *args: str) -> bool:
    proc = cluster.kubectl("auth", "can-i", *args, kubeconfig=kubeconfig, check=False)
    return proc.stdout.strip() == "yes"


def test_operator_role_grants_no_more_than_its_job(cluster: DevCluster, operator_kubeconfig: Path) -> None:
    wait_for(
        lambda: can_i(cluster, operator_kubeconfig, "create", "deviceclasses.resource.k8s.io"),
        what="operator role bound",
    )
    denied = [
        ("get", "secrets", "-A"),
        ("create", "pods", "-A"),
        ("create", "resourceslices.resource.k8s.io"),
        ("delete", "nodes"),
        ("update", "clusterroles.rbac.authorization.k8s.io"),
        ("create", "mutatingwebhookconfigurations.admissionregistration.k8s.io"),
    ]
    assert [d for d in denied if can_i(cluster, operator_kubeconfig, *d)] == []


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_operator_does_its_job_with_the_deployed_role(
    cluster: DevCluster, operator_kubeconfig: Path, namespace: str, tmp_path: Path
) -> None:
    cluster.apply_crds()
    suffix = "t" + uuid.uuid4().hex[:6]  # a letter first: YAML reads "8031e9" as a number
    package = f"rbac-{suffix}-8g"
    cluster.kubectl("label", "namespace", namespace, f"manifests-test.example.com/team={suffix}")
    docs = [
        {
            "apiVersion": constants.GROUP_VERSION,
            "kind": constants.PACKAGE_KIND,
            "metadata": {"name": package},
            "spec": {
                "gpuModel": "Tesla V100-PCIE-32GB",
                "fraction": 25,
                "entitlements": [
                    {
                        "namespaceSelector": {"matchLabels": {"manifests-test.example.com/team": suffix}},
                        "slices": 2,
                    }
                ],
            },
        },
        {
            "apiVersion": constants.GROUP_VERSION,
            "kind": constants.SLICE_KIND,
            "metadata": {"name": "llm", "namespace": namespace},
            "spec": {"package": package},
        },
    ]
    log = tmp_path / "operator.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpuslice", "operator", f"--kubeconfig={operator_kubeconfig}"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            cwd=REPO,
        )
    try:
        cluster.apply(yaml.safe_dump_all(docs))
        device_class = constants.device_class_name(package)
        wait_for(
            lambda: get_json(cluster, "deviceclass", device_class),
            timeout=90,
            what=f"DeviceClass {device_class}",
        )
        wait_for(
            lambda: (
                (q := get_json(cluster, "resourcequota", constants.QUOTA_NAME, "-n", namespace))
                and constants.quota_key(package) in q["spec"]["hard"]
            ),
            timeout=60,
            what="the tenant's gpuslice quota",
        )
        wait_for(
            lambda: get_json(cluster, "resourceclaim", "llm", "-n", namespace), timeout=60, what="claim llm"
        )
        wait_for(
            lambda: ((get_json(cluster, "gpuslice", "llm", "-n", namespace) or {}).get("status") or {}).get(
                "phase"
            ),
            timeout=60,
            what="GpuSlice status written",
        )
        wait_for(
            lambda: ((get_json(cluster, "gpupackage", package) or {}).get("status") or {}).get(
                "deviceClassName"
            ),
            timeout=60,
            what="GpuPackage status written",
        )
        # A pod asking for the product in resources.limits: the operator makes its GpuSlice.
        wait_for(
            lambda: get_json(cluster, "namespace", namespace)["metadata"]["labels"].get(
                constants.LABEL_TENANT
            ),
            timeout=60,
            what="the namespace a tenant",
        )
        limits = {constants.extended_resource_name(package): "1"}
        container = {"name": "main", "image": "busybox", "resources": {"limits": limits}}
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "chart", "namespace": namespace}}
        cluster.apply(json.dumps({**pod, "spec": {"containers": [container]}}))
        wait_for(
            lambda: ((get_json(cluster, "gpuslice", "chart", "-n", namespace) or {}).get("spec") or {}).get(
                "pod"
            ),
            timeout=60,
            what="the pod's GpuSlice",
        )
        cluster.kubectl("delete", "pod", "chart", "-n", namespace, "--wait=false")
        # Deletion runs through the operator's finalizers: it must be allowed to remove them.
        cluster.kubectl("delete", "gpuslice", "llm", "-n", namespace, "--timeout=60s")
        cluster.kubectl("delete", "gpupackage", package, "--timeout=60s")
        assert proc.poll() is None, f"the operator exited:\n{log.read_text(errors='replace')[-3000:]}"
    finally:
        _stop(proc)
        for args in (("gpuslice", "llm", "-n", namespace), ("gpupackage", package)):
            cluster.kubectl(
                "patch", *args, "--type=merge", "-p", '{"metadata":{"finalizers":null}}', check=False
            )
            cluster.kubectl("delete", *args, "--wait=false", check=False)
        remove_operator_policies(cluster)
    text = log.read_text(errors="replace")
    refused = [line for line in text.splitlines() if "Forbidden" in line or " 403" in line]
    assert refused == [], "\n".join(refused[:10])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as rsp:
            return int(rsp.status)
    except (urllib.error.URLError, OSError):
        return 0


@pytest.fixture
def peering_object(cluster: DevCluster, base: list[Doc]) -> Iterator[str]:
    """Kopf's peering CRD and the ClusterKopfPeering the Deployment's replicas report to."""
    created: list[tuple[str, str]] = []
    crd = "clusterkopfpeerings.kopf.dev"
    if get_json(cluster, "customresourcedefinition", crd) is None:
        cluster.apply(yaml.safe_dump(one(base, "CustomResourceDefinition", crd)))
        created.append(("customresourcedefinition", crd))
        cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{crd}")
    if get_json(cluster, "clusterkopfpeering", constants.PEERING_NAME) is None:
        cluster.apply(yaml.safe_dump(one(base, "ClusterKopfPeering", constants.PEERING_NAME)))
        created.append(("clusterkopfpeering", constants.PEERING_NAME))
    yield constants.PEERING_NAME
    for kind, name in reversed(created):
        cluster.kubectl("delete", kind, name, "--wait=false", check=False)


@pytest.fixture
def prometheus_token(cluster: DevCluster) -> Iterator[str]:
    """A service account token bound to the manifests' metrics-reader role, as Prometheus holds one."""
    with metrics_readers(cluster) as readers:
        yield readers.prometheus


def test_two_replicas_of_the_deployment_are_one_active_and_one_healthy_standby(
    cluster: DevCluster,
    base: list[Doc],
    operator_kubeconfig: Path,
    peering_object: str,
    prometheus_token: str,
    tmp_path: Path,
) -> None:
    container = one(base, "Deployment", "gpuslice-operator")["spec"]["template"]["spec"]["containers"][0]
    argv = [*container["command"], *container["args"]]
    assert argv[0] == "gpuslice"
    replicas: dict[str, tuple[subprocess.Popen[bytes], Path, int, int]] = {}
    try:
        for name in ("replica-a", "replica-b"):
            health, metrics_port = _free_port(), _free_port()
            # The Deployment's own command line; only the ports move, as both run on one host here.
            args = [
                f"--liveness=http://127.0.0.1:{health}/healthz"
                if a.startswith("--liveness=")
                else f"--metrics-port={metrics_port}"
                if a.startswith("--metrics-port=")
                else a
                for a in argv[1:]
            ]
            log = tmp_path / f"{name}.log"
            with log.open("ab") as out:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "gpuslice", *args, f"--kubeconfig={operator_kubeconfig}"],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "PYTHONUNBUFFERED": "1", "POD_ID": name},
                    cwd=REPO,
                )
            replicas[name] = (proc, log, health, metrics_port)

        def peers() -> dict[str, Any]:
            found = get_json(cluster, "clusterkopfpeering", peering_object) or {}
            return {k: v for k, v in (found.get("status") or {}).items() if k in replicas}

        both = wait_for(
            lambda: len(peers()) == 2 and peers(), timeout=60, what="both replicas in the peering"
        )
        assert both["replica-a"]["priority"] != both["replica-b"]["priority"]
        standby = min(both, key=lambda n: both[n]["priority"])
        active = next(n for n in replicas if n != standby)
        wait_for(
            lambda: "Pausing operations in favour of" in replicas[standby][1].read_text(errors="replace"),
            timeout=60,
            what=f"{standby} pausing for {active}",
        )
        assert "Pausing operations" not in replicas[active][1].read_text(errors="replace")
        # The standby answers the liveness/readiness probe too: the kubelet must not restart it.
        for name, (proc, _, health, metrics_port) in replicas.items():
            assert proc.poll() is None, f"{name} exited"
            wait_for(
                lambda h=health: _http_status(f"http://127.0.0.1:{h}/healthz") == 200, what=f"{name} healthy"
            )
            # Both serve their metrics to Prometheus, which only the manifests' role lets them review.
            status, body = scrape(f"http://127.0.0.1:{metrics_port}/metrics", prometheus_token)
            assert status == 200 and "gpuslice_operator_writes_total" in body, (name, status, body)
    finally:
        for proc, _, _, _ in replicas.values():
            _stop(proc)
        remove_operator_policies(cluster)
