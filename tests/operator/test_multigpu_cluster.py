"""Multi-GPU products on the real control plane: kube-scheduler places the product's one claim of N
whole cards (with the package's matchAttribute constraint) on kwok nodes whose ResourceSlices the
agent's own builder made, with the topology a DGX-1-like node and a PCIe node of 4 cards show."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from gpuslice import constants as c
from gpuslice.agent.gpus import GpuInfo
from gpuslice.agent.slices import Package, build_specs, with_generation
from gpuslice.api.package import GpuPackageSpec
from gpuslice.domain.deviceclass import device_class
from gpuslice.domain.multigpu import PCIE_ROOT_ATTRIBUTE, cards_from_slices, claim_spec, placement
from gpuslice_dev.devcluster.cluster import DevCluster
from support import apply, get_json, gpu, pod_doc, wait_for

pytestmark = pytest.mark.slow(seconds=60)

SXM2 = "Tesla V100-SXM2-16GB"
TEST_LABEL = "gpuslice-test/multigpu"


def dgx(node: str) -> list[GpuInfo]:
    """8 V100-SXM2 on two roots (one per CPU socket and NUMA node), 4 each. The roots alternate in
    index order, so a scheduler that ignored the constraint would take cards of both."""
    return [
        gpu(i, SXM2, 16 * c.GIB, node=node).model_copy(
            update={"pcie_root": "pci0000:00" if i % 2 == 0 else "pci0000:80", "numa_node": i % 2}
        )
        for i in range(8)
    ]


def pcie4(node: str) -> list[GpuInfo]:
    """4 cards on 2 roots, 2 each, alternating in index order."""
    return [
        gpu(i, SXM2, 16 * c.GIB, node=node).model_copy(
            update={"pcie_root": f"pci0000:{0x40 * (i % 2):02x}", "numa_node": i % 2}
        )
        for i in range(4)
    ]


def slices(node: str, cards: list[GpuInfo], packages: list[Package]) -> list[dict[str, Any]]:
    docs = with_generation(node, build_specs(node, cards, packages), 1)
    for d in docs:
        d["metadata"]["labels"][TEST_LABEL] = "true"
    return docs


@pytest.fixture(scope="module")
def world(cluster: DevCluster) -> Any:
    token = "m" + uuid.uuid4().hex[:5]
    nodes = cluster.nodes[:2]
    specs = {
        f"{token}-x4": GpuPackageSpec.model_validate(
            {"gpuModel": SXM2, "gpus": 4, "topology": "SamePcieRoot"}
        ),
        f"{token}-x2": GpuPackageSpec.model_validate(
            {"gpuModel": SXM2, "gpus": 2, "topology": "SamePcieRoot"}
        ),
    }
    packages = [Package(n, s) for n, s in specs.items()]
    classes = [device_class(n, None, s, None) for n, s in specs.items()]
    for cls in classes:
        cls["metadata"]["labels"][TEST_LABEL] = "true"
    published = slices(nodes[0], dgx(nodes[0]), packages) + slices(nodes[1], pcie4(nodes[1]), packages)
    apply(cluster, classes + published)
    try:
        yield token, nodes, specs
    finally:
        cluster.kubectl("delete", "resourceslices,deviceclasses", "-l", TEST_LABEL, check=False)


def product(cluster: DevCluster, ns: str, name: str, package: str, spec: GpuPackageSpec, node: str) -> None:
    claim = {
        "apiVersion": c.DRA_GROUP_VERSION,
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": ns, "labels": {c.LABEL_PACKAGE: package}},
        "spec": claim_spec(package, spec),
    }
    apply(cluster, [claim, pod_doc(name, ns, node_selector={"kubernetes.io/hostname": node})])


def allocated_roots(cluster: DevCluster, ns: str, name: str, label: str = TEST_LABEL) -> list[str] | None:
    claim = get_json(cluster, "resourceclaim", name, "-n", ns)
    results = ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results")
    if not results:
        return None
    published = get_json(cluster, "resourceslices", "-l", label)["items"]
    root = {
        (s["spec"]["pool"]["name"], d["name"]): d["attributes"][PCIE_ROOT_ATTRIBUTE]["string"]
        for s in published
        for d in s["spec"].get("devices") or []
    }
    return [root[(r["pool"], r["device"])] for r in results]


def test_a_4_card_product_gets_4_cards_on_one_root(cluster: DevCluster, namespace: str, world: Any) -> None:
    token, (big, _), specs = world
    product(cluster, namespace, "x4", f"{token}-x4", specs[f"{token}-x4"], big)
    roots = wait_for(lambda: allocated_roots(cluster, namespace, "x4"), 60, "4-card claim allocated")
    assert len(roots) == 4 and len(set(roots)) == 1, roots
    # The second 4-card product takes the other root; a third finds none and waits.
    product(cluster, namespace, "x4b", f"{token}-x4", specs[f"{token}-x4"], big)
    second = wait_for(lambda: allocated_roots(cluster, namespace, "x4b"), 60, "second 4-card claim")
    assert len(set(second)) == 1 and set(second) != set(roots)


def test_2_cards_on_one_root_fit_a_pcie_node_4_do_not(
    cluster: DevCluster, namespace: str, world: Any
) -> None:
    token, (_, small), specs = world
    product(cluster, namespace, "x2", f"{token}-x2", specs[f"{token}-x2"], small)
    roots = wait_for(lambda: allocated_roots(cluster, namespace, "x2"), 60, "2-card claim allocated")
    assert len(roots) == 2 and len(set(roots)) == 1, roots

    product(cluster, namespace, "x4", f"{token}-x4", specs[f"{token}-x4"], small)

    def unschedulable() -> str | None:
        pod = get_json(cluster, "pod", "x4", "-n", namespace)
        cond = [x for x in pod.get("status", {}).get("conditions", []) if x["type"] == "PodScheduled"]
        return cond[0].get("message") if cond and cond[0]["status"] == "False" else None

    assert wait_for(unschedulable, 60, "4-card pod unschedulable on the PCIe node")
    assert allocated_roots(cluster, namespace, "x4") is None
    # What explain and the slice's status say, computed from what the node publishes.
    published = get_json(cluster, "resourceslices", "-l", TEST_LABEL)["items"]
    claims = get_json(cluster, "resourceclaims", "-n", namespace)["items"]
    taken = {
        (r["pool"], r["device"])
        for cl in claims
        for r in ((cl.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results", [])
    }
    on_small = [x for x in cards_from_slices(published, taken, f"{token}-x4") if x.node == small]
    fit = placement(on_small, 4, specs[f"{token}-x4"].topology, SXM2)
    assert not fit.fits and fit.reason == "NoNodeFits"
    assert fit.message.startswith(
        f"no node has 4 free cards of {SXM2} on one PCIe root (most: 2 on node {small}"
    )


def test_the_crd_refuses_a_fraction_of_a_multi_gpu_product(cluster: DevCluster) -> None:
    cluster.apply_crds()
    doc = json.dumps(
        {
            "apiVersion": c.GROUP_VERSION,
            "kind": c.PACKAGE_KIND,
            "metadata": {"name": "mg-bad"},
            "spec": {"gpuModel": SXM2, "gpus": 2, "fraction": 50},
        }
    )
    out = cluster.kubectl("create", "--dry-run=server", "-f", "-", input=doc, check=False)
    assert out.returncode != 0 and "fraction must be 100 or absent" in out.stderr
    bad = doc.replace('"gpus": 2, "fraction": 50', '"gpus": 3')
    out = cluster.kubectl("create", "--dry-run=server", "-f", "-", input=bad, check=False)
    assert out.returncode != 0 and "spec.gpus" in out.stderr
    ok = doc.replace(', "fraction": 50', "")
    assert cluster.kubectl("create", "--dry-run=server", "-f", "-", input=ok, check=False).returncode == 0
