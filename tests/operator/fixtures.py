"""Builders of cluster objects for the operator's unit tests, in the shape the API server returns."""

from __future__ import annotations

from typing import Any

from gpuslice import constants as c
from gpuslice.agent.gpus import GpuInfo
from gpuslice.agent.slices import Package, build_specs, with_generation
from gpuslice.api.package import GpuPackageSpec

V100 = "Tesla V100-PCIE-32GB"
V100_PACKAGES = {"v100-8g": 25, "v100-16g": 50, "v100-32g": 100}


def package_spec(fraction: int, **kw: Any) -> GpuPackageSpec:
    return GpuPackageSpec.model_validate({"gpuModel": V100, "fraction": fraction, **kw})


def gpu(node: str, index: int, model: str = V100, memory: int = 32 * c.GIB) -> GpuInfo:
    return GpuInfo(
        index=index,
        uuid=f"GPU-{node}-{index}",
        product_name=model,
        memory_bytes=memory,
        cuda_compute_capability="7.0",
        driver_version="535.104.05",
        cuda_driver_version="12.2",
        minor_number=index,
        pci_bus_id=f"0000:{index:02x}:00.0",
    )


def published(
    node: str, gpus: int, packages: dict[str, int] | None = None, generation: int = 1
) -> list[dict[str, Any]]:
    """The ResourceSlices the node agent publishes for `gpus` V100 cards (the agent's own builder)."""
    pk = [Package(n, package_spec(f)) for n, f in (packages or V100_PACKAGES).items()]
    cards = [gpu(node, i) for i in range(gpus)]
    return with_generation(node, build_specs(node, cards, pk), generation)


def allocated_claim(
    namespace: str, name: str, node: str, device: str, reserved_for: tuple[str, ...] = ()
) -> dict[str, Any]:
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
