"""What the kwok-node benchmarks share: simulated cards and the ResourceSlices their agent would publish.

bench/operator_scale.py, bench/multigpu_scheduling.py and bench/mig_packing.py run a devcluster of
kwok nodes (no agent, no GPU) and publish for each node exactly what the node agent's own builder
(`gpuslice.agent.slices.build_specs`) makes of its cards, so kube-scheduler sees real devices. Not a
benchmark itself (the leading underscore): the scripts import it from beside them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from gpuslice.agent.gpus import GpuInfo
from gpuslice.agent.slices import Package, build_specs, with_generation


def card(
    node: str,
    index: int,
    model: str,
    memory_bytes: int,
    compute_capability: str = "7.0",
    bus: int | None = None,
    **extra: Any,
) -> GpuInfo:
    """One simulated card of `node` (UUID `GPU-<node>-<index>`, PCI bus `bus`, default `index`);
    `extra`: further GpuInfo fields (topology, MIG profiles)."""
    return GpuInfo(
        index=index,
        uuid=f"GPU-{node}-{index}",
        product_name=model,
        memory_bytes=memory_bytes,
        cuda_compute_capability=compute_capability,
        driver_version="535.104.05",
        cuda_driver_version="12.2",
        minor_number=index,
        pci_bus_id=f"00000000:{index if bus is None else bus:02X}:00.0",
        **extra,
    )


def node_slices(
    nodes: Iterable[str], cards: Callable[[str], Sequence[GpuInfo]], packages: Sequence[Package]
) -> list[dict[str, Any]]:
    """Every node's ResourceSlices for its `cards(node)` and the packages, generation 1."""
    return [s for n in nodes for s in with_generation(n, build_specs(n, list(cards(n)), list(packages)), 1)]
