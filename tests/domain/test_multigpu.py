"""Multi-GPU products: the claim a product asks for, how many fit, and why one waits."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gpuslice.agent.slices import Package, build_specs, with_generation
from gpuslice.api.package import GpuPackageSpec, Topology
from gpuslice.api.resourceslice import parse_resource_slices
from gpuslice.domain.multigpu import (
    NUMA_NODE_ATTRIBUTE,
    PCIE_ROOT_ATTRIBUTE,
    Card,
    card_seconds,
    cards_from_published,
    claim_spec,
    placement,
    products_free,
    quota_devices,
)
from gpuslice.domain.package_status import capacity_status
from gpuslice.operator.state import Snapshot
from support import gpu

V100 = "Tesla V100-SXM2-16GB"


def spec(**kw: object) -> GpuPackageSpec:
    return GpuPackageSpec.model_validate({"gpuModel": V100, **kw})


def node(
    name: str, roots: list[str], free: list[bool] | None = None, numa: list[int] | None = None
) -> list[Card]:
    free = free if free is not None else [True] * len(roots)
    numa = numa if numa is not None else [0] * len(roots)
    return [
        Card(node=name, device=f"gpu-{i}", pcie_root=r, numa_node=n, free=f)
        for i, (r, f, n) in enumerate(zip(roots, free, numa, strict=True))
    ]


def test_a_multi_gpu_package_is_whole_cards_and_refuses_a_fraction() -> None:
    assert spec(gpus=4).fraction == 100
    assert spec(gpus=2, fraction=100).cards_per_product == 2
    with pytest.raises(ValidationError, match="fraction must be 100 or absent"):
        spec(gpus=2, fraction=50)
    with pytest.raises(ValidationError):
        spec(gpus=3)
    assert spec(fraction=25).cards_per_product == 1


def test_the_claim_asks_for_n_devices_on_one_pcie_root() -> None:
    devices = claim_spec("v100x4", spec(gpus=4, topology="SamePcieRoot"))["devices"]
    assert devices["requests"][0]["exactly"] == {
        "deviceClassName": "v100x4.gpuslice.io",
        "allocationMode": "ExactCount",
        "count": 4,
    }
    assert devices["constraints"] == [{"requests": ["gpu"], "matchAttribute": PCIE_ROOT_ATTRIBUTE}]
    numa = claim_spec("v100x2", spec(gpus=2, topology="SameNumaNode"))["devices"]
    assert numa["constraints"][0]["matchAttribute"] == NUMA_NODE_ATTRIBUTE
    assert "constraints" not in claim_spec("v100x2", spec(gpus=2))["devices"]
    assert claim_spec("v100-8g", spec(fraction=50))["devices"]["requests"][0]["exactly"]["count"] == 1


def test_products_free_counts_whole_products_per_root() -> None:
    # A PCIe node of 4 cards on 2 roots: two 2-card products on one root each, no 4-card one.
    pcie = node("pcie-a", ["pci0000:00", "pci0000:00", "pci0000:80", "pci0000:80"])
    assert products_free(pcie, 2, Topology.SAME_PCIE_ROOT) == 2
    assert products_free(pcie, 4, Topology.SAME_PCIE_ROOT) == 0
    assert products_free(pcie, 4, Topology.ANY) == 1
    # One card of each root taken: no 2-card product on one root, one anywhere on the node.
    half = node(
        "pcie-b", ["pci0000:00", "pci0000:00", "pci0000:80", "pci0000:80"], [False, True, True, False]
    )
    assert products_free(half, 2, Topology.SAME_PCIE_ROOT) == 0
    assert products_free(half, 2, Topology.ANY) == 1
    # Products never span nodes.
    assert products_free(node("x", ["r"]) + node("y", ["r"]), 2, Topology.ANY) == 0


def test_same_numa_node_groups_by_numa_not_root() -> None:
    dgx = node("dgx", [f"pci0000:{i:02x}" for i in range(8)], numa=[0, 0, 0, 0, 1, 1, 1, 1])
    assert products_free(dgx, 4, Topology.SAME_NUMA_NODE) == 2
    assert products_free(dgx, 4, Topology.SAME_PCIE_ROOT) == 0


def test_a_product_that_fits_nowhere_says_how_close_a_node_comes() -> None:
    pcie = node("pcie-a", ["pci0000:00", "pci0000:00", "pci0000:80", "pci0000:80"], [True, True, True, False])
    fit = placement(pcie, 4, Topology.SAME_PCIE_ROOT, V100)
    assert not fit.fits and fit.reason == "NoNodeFits"
    assert (
        fit.message == f"no node has 4 free cards of {V100} on one PCIe root"
        " (most: 2 on node pcie-a PCIe root pci0000:00)"
    )
    assert placement(pcie, 2, Topology.SAME_PCIE_ROOT, V100).fits
    assert "no node publishes cards" in placement([], 2, Topology.ANY, V100).message
    unknown = [Card("n", "gpu-0", None, None, True), Card("n", "gpu-1", None, None, True)]
    assert (
        "no card publishes resource.kubernetes.io/pcieRoot"
        in placement(unknown, 2, Topology.SAME_PCIE_ROOT, V100).message
    )
    assert placement(unknown, 2, Topology.ANY, V100).fits


def test_quota_and_metering_count_cards() -> None:
    four = spec(gpus=4)
    assert quota_devices(four, 3) == 12
    assert card_seconds(four, 60.0) == 240.0
    assert card_seconds(spec(fraction=25), 60.0) == 15.0


def test_package_status_counts_products_free_from_what_the_node_publishes() -> None:
    # A PCIe node of 4 cards on 2 roots, offering a 2-card product and a quarter slice on every card.
    cards = [
        gpu(i, V100, node="pcie").model_copy(update={"pcie_root": f"pci0000:{0x40 * (i // 2):02x}"})
        for i in range(4)
    ]
    x2, quarter = spec(gpus=2, topology="SamePcieRoot"), spec(fraction=25)
    objs = with_generation("pcie", build_specs("pcie", cards, [Package("x2", x2), Package("q", quarter)]), 1)
    published = parse_resource_slices(objs)
    assert products_free(cards_from_published(published, [], "x2"), 2, x2.topology) == 2
    # One quarter slice on card 0 leaves card 0 not whole: one product left, on the other root.
    slice_on_0 = next(
        d.name for s in published for d in s.devices if d.package == "q" and d.counter_set == "gpu-0"
    )
    left = cards_from_published(published, [("pcie", slice_on_0)], "x2")
    assert products_free(left, 2, x2.topology) == 1
    assert not placement(left, 4, Topology.ANY, V100).fits
    snapshot = Snapshot(taken_at=0.0, slices=published, allocated=[("pcie", slice_on_0)], uuids={})
    status = capacity_status(snapshot.capacity("x2", x2)).model_dump(by_alias=True, exclude_none=True)
    assert status["productsFree"] == 1 and status["slicesFree"] == 3
    assert "productsFree" not in capacity_status(snapshot.capacity("q", quarter)).model_dump(
        exclude_none=True
    )
