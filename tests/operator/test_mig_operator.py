"""A MIG (Hardware) product through the operator like any product: a package sized by memory sells
its 1g.10gb placements, a GpuSlice of it is allocated one, counts in the namespace's quota (a second
one waits for it), shows in `gpuslice explain` as a MIG instance, and the ledger gets its interval."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from gpuslice import constants as c
from gpuslice.agent.slices import Package, build_specs, with_generation
from gpuslice.api.package import GpuPackageSpec
from gpuslice.domain import mig
from gpuslice_dev.devcluster.cluster import DevCluster
from support import apply, get_json, gpu, pod_doc, slice_doc, wait_for

from .operator_cluster import POOL_PREFIX, TEST_LABEL, OperatorProcess, module_operator, wait_status

pytestmark = pytest.mark.slow(seconds=60)

A100 = "NVIDIA A100-SXM4-80GB"
#: the driver's 1g.10gb of an A100-SXM4-80GB (tests/agent/test_agent_mig_sizes.py holds the table to it)
P1G = mig.MigProfile(19, "1g.10gb", 1, 7, 9728, 14, tuple((k, 1) for k in range(7)))


@pytest.fixture(scope="module")
def operator(cluster: DevCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    with module_operator(cluster, tmp_path_factory.mktemp("operator") / "operator.log") as op:
        yield op


def _explain(cluster: DevCluster, ref: str) -> str:
    argv = [sys.executable, "-m", "gpuslice", "explain", ref, f"--kubeconfig={cluster.kubeconfig}"]
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


def test_a_mig_slice_is_placed_counted_explained_and_metered(
    cluster: DevCluster, namespace: str, operator: OperatorProcess
) -> None:
    token = "h" + uuid.uuid4().hex[:5]
    pkg = f"{token}-9g"
    spec: dict[str, Any] = {
        "gpuModel": A100,
        "fraction": 100,
        "isolation": {"mode": "Hardware", "memory": "9Gi"},
        "entitlements": [{"namespaceSelector": {"matchLabels": {"hw": token}}, "slices": 1}],
        "price": {"perHour": "1.50", "currency": "EUR"},
    }
    package = {"apiVersion": c.GROUP_VERSION, "kind": c.PACKAGE_KIND,
               "metadata": {"name": pkg, "labels": {TEST_LABEL: "true"}}, "spec": spec}  # fmt: skip
    cluster.create_namespace(namespace, {"hw": token})
    apply(cluster, [package])
    wait_for(lambda: get_json(cluster, "deviceclass", c.device_class_name(pkg)), 30, "DeviceClass")
    # a card in MIG mode as its agent publishes it, on a kwok node, in a pool of this test's own
    node = cluster.nodes[0]
    pool = f"{POOL_PREFIX}{token}-{node}"
    card = gpu(0, A100, 80 * c.GIB, node=pool).model_copy(update={"mig_profiles": (P1G,)})
    docs = with_generation(
        pool, build_specs(pool, [card], [Package(pkg, GpuPackageSpec.model_validate(spec))]), 1
    )
    for d in docs:
        d["spec"]["nodeName"] = node
        d["metadata"]["labels"][TEST_LABEL] = "true"
    apply(cluster, docs)

    # the package: the profile 9Gi maps to, its 7 placements, one entitled to the namespace
    def sold() -> dict[str, Any] | None:
        st = (get_json(cluster, "gpupackage", pkg) or {}).get("status") or {}
        return st if (st.get("capacity") or {}).get("slicesTotal") == 7 else None

    pstat = wait_for(sold, 60, "the package to count its 7 placements")
    assert pstat["migProfile"] == "1g.10gb" and pstat["memoryPerSlice"] == "9728Mi"

    def hard() -> str | None:
        q = get_json(cluster, "resourcequota", c.QUOTA_NAME, "-n", namespace) or {}
        return (q.get("spec") or {}).get("hard", {}).get(c.quota_key(pkg))

    assert wait_for(hard, 30, "quota") == "1"

    apply(cluster, [slice_doc("hw", namespace, pkg)])
    wait_for(lambda: get_json(cluster, "resourceclaim", "hw", "-n", namespace), 30, "the slice's claim")
    apply(cluster, [pod_doc("hw", namespace, "hw")])
    st = wait_status(cluster, namespace, "hw", phase="InUse")
    (alloc,) = st["allocations"]
    assert alloc["device"].startswith("gpu-0-mig-1g-10gb-") and alloc["node"] == node

    def used() -> str | None:  # kube-controller-manager's count of the namespace's claims of the class
        q = get_json(cluster, "resourcequota", c.QUOTA_NAME, "-n", namespace) or {}
        return (q.get("status") or {}).get("used", {}).get(c.quota_key(pkg))

    assert wait_for(lambda: used() == "1", 60, "the quota to count the MIG slice's claim")

    # the namespace's one entitled MIG slice is held: a second waits on the quota, saying so
    apply(cluster, [slice_doc("hw2", namespace, pkg)])
    waiting = wait_status(cluster, namespace, "hw2", reason="QuotaExceeded")
    assert waiting["phase"] == "Pending" and "1 of 1" in waiting["message"], waiting
    assert waiting["quota"] == {"used": 1, "hard": 1, "quota": c.QUOTA_NAME}

    explained = _explain(cluster, f"{namespace}/hw")
    assert f"9728Mi of a {A100}, MIG instance 1g.10gb (hardware isolation)" in explained, explained
    assert f"device {alloc['device']}" in explained and "held by pod hw" in explained, explained
    explained = _explain(cluster, f"{namespace}/hw2")
    assert "MIG instance 1g.10gb" in explained and "QuotaExceeded" in explained, explained
    assert f"quota:    1 of 1 {pkg} slices used in {namespace}" in explained, explained

    month = datetime.now(UTC).strftime("%Y-%m")

    def interval(closed: bool) -> dict[str, Any] | None:
        usage = get_json(cluster, "gpuusages.gpuslice.io", month, "-n", namespace) or {}
        for iv in usage.get("intervals") or []:
            if iv["claim"] == "hw" and (iv.get("end") is not None) == closed:
                return dict(iv)
        return None

    iv = wait_for(lambda: interval(False), 30, "the MIG slice's open ledger interval")
    assert (iv["package"], iv["slice"], iv["node"]) == (pkg, "hw", node)
    assert iv["pricePerHour"] == "1.50" and iv["currency"] == "EUR"
    # released: the interval closes, and the waiting slice gets the freed entitlement
    cluster.kubectl("delete", "pod", "hw", "-n", namespace, "--grace-period=0", "--force")
    cluster.kubectl("delete", "gpuslices.gpuslice.io", "hw", "-n", namespace)
    closed = wait_for(lambda: interval(True), 60, "the MIG slice's interval to close")
    assert closed["start"] == iv["start"]
    wait_for(lambda: get_json(cluster, "resourceclaim", "hw2", "-n", namespace), 90, "the claim of hw2")
