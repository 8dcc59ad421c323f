"""`gpuslice check` passes line by line on a cluster set up for gpuslice: CRDs, the operator running
with peering, an agent's ResourceSlices on a labelled GPU node, a package of that model, RuntimeClass."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from gpuslice import constants as c
from gpuslice_dev.devcluster.cluster import DevCluster, free_port
from support import (
    apply,
    check_line,
    get_json,
    gpuslice_check,
    package_doc,
    published,
    remove_operator_policies,
    wait_for,
)

from .operator_cluster import OperatorProcess

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.cluster
def test_check_passes_line_by_line_on_a_cluster_set_up_for_gpuslice(
    cluster: DevCluster, tmp_path: Path
) -> None:
    cluster.apply_crds()
    cluster.kubectl("apply", "--server-side", "-f", str(REPO / "manifests/crds/kopf-peering-crd.yaml"))
    cluster.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s", "crd/clusterkopfpeerings.kopf.dev"
    )
    cluster.kubectl("apply", "--server-side", "-f", str(REPO / "manifests/base/operator/peering.yaml"))
    token = "chk" + uuid.uuid4().hex[:5]
    node = cluster.nodes[0]
    pkg = f"{token}-8g"
    label = "gpuslice-test/check"
    slices = published(node, 1, {pkg: 25})
    for s in slices:
        s["metadata"]["name"] = f"{token}-{s['metadata']['name']}"
        s["metadata"]["labels"][label] = "true"
        s["spec"]["pool"]["name"] = f"{token}-{node}"
    op = OperatorProcess(cluster, tmp_path / "operator.log", "--peering", f"--metrics-port={free_port()}")
    had_runtime_class = get_json(cluster, "runtimeclass", "nvidia") is not None
    op.start()
    try:
        apply(cluster, [package_doc(pkg, 25, labels={label: "true"}), *slices])
        cluster.kubectl("label", "node", node, "nvidia.com/gpu.present=true", "--overwrite")
        cluster.apply(
            '{"apiVersion":"node.k8s.io/v1","kind":"RuntimeClass","metadata":{"name":"nvidia"},"handler":"nvidia"}'
        )
        wait_for(
            lambda: (get_json(cluster, "clusterkopfpeering", c.PEERING_NAME) or {}).get("status"),
            60,
            "the operator's peering keep-alive",
        )
        proc = gpuslice_check(cluster.kubeconfig)
    finally:
        # The package carries the operator's finalizer: delete it while the operator still runs, and
        # the admission policies the operator made once it is stopped (as test_operator_cluster does).
        cluster.kubectl("delete", "gpupackages.gpuslice.io", "-l", label, "--timeout=60s", check=False)
        op.stop()
        remove_operator_policies(cluster)
        cluster.kubectl("label", "node", node, "nvidia.com/gpu.present-", check=False)
        cluster.kubectl("delete", "resourceslices", "-l", label, check=False)
        if not had_runtime_class:
            cluster.kubectl("delete", "runtimeclass", "nvidia", check=False)
    out = proc.stdout
    print(out)
    assert get_json(cluster, "gpupackages.gpuslice.io", pkg) is None, "the test's package was left behind"
    for name in (
        "Kubernetes version: v1.37.2",
        "your RBAC allows the checks",
        "resource.k8s.io/v1 (DRA) is served",
        "partitionable devices (DRAPartitionableDevices) kept by the API server",
        "consumable capacity (DRAConsumableCapacity) kept by the API server",
        "CRDs installed and Established",
        "operator running: 1 replica(s) keep ClusterKopfPeering gpuslice alive",
        "RuntimeClass nvidia",
    ):
        assert check_line(out, name).startswith("\u221a "), out
    assert check_line(out, "agents publish GPUs").startswith("\u221a "), out
    # The dry-run probe leaves nothing behind.
    assert get_json(cluster, "resourceslice", "gpuslice-check-probe-counters") is None
