"""Multi-GPU products: a GpuPackage of `gpus: N` whole cards of one model on one node.

A product is one ResourceClaim with one request of `count: N` devices of the package's DeviceClass
(each device a whole card: fraction 100 gives one device per card that consumes all of the card's
counters), plus, where the package asks for a topology, a `matchAttribute` constraint so that
kube-scheduler only picks N cards that share the attribute (one PCIe root, one NUMA node). The
scheduler does the placing; this module says what to ask for and, from what the nodes publish,
how many products still fit and why none does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

from gpuslice import constants as c
from gpuslice.api.package import GpuPackageSpec, Topology
from gpuslice.api.resourceslice import PublishedSlice, newest_generation
from gpuslice.domain.health import tainted_effect
from gpuslice.domain.mig import COMPUTE_SLICES as MIG_COMPUTE_SLICES

#: The attribute Kubernetes standardises for a device's PCIe root complex (KEP 4381 "standardized
#: device attributes"); the agent publishes it under this fully qualified name.
PCIE_ROOT_ATTRIBUTE: Final = "resource.kubernetes.io/pcieRoot"
#: NUMA node of a card, in the driver's own attribute domain.
NUMA_NODE_ATTRIBUTE: Final = f"{c.DRIVER_NAME}/numaNode"
NVLINK_PEERS_ATTRIBUTE: Final = f"{c.DRIVER_NAME}/nvlinkPeers"

REASON_NO_NODE_FITS: Final = "NoNodeFits"

_WHERE: Final = {
    Topology.SAME_PCIE_ROOT: "on one PCIe root",
    Topology.SAME_NUMA_NODE: "on one NUMA node",
    Topology.ANY: "",
}


def match_attribute(topology: Topology) -> str | None:
    """The attribute all N cards must share, or None for `Any`."""
    if topology is Topology.SAME_PCIE_ROOT:
        return PCIE_ROOT_ATTRIBUTE
    if topology is Topology.SAME_NUMA_NODE:
        return NUMA_NODE_ATTRIBUTE
    return None


def claim_spec(package: str, spec: GpuPackageSpec) -> dict[str, Any]:
    """The ResourceClaim spec of one product: N whole cards, with the topology constraint if asked."""
    devices: dict[str, Any] = {
        "requests": [
            {
                "name": c.CLAIM_REQUEST_NAME,
                "exactly": {
                    "deviceClassName": c.device_class_name(package),
                    "allocationMode": "ExactCount",
                    "count": spec.cards_per_product,
                },
            }
        ]
    }
    attribute = match_attribute(spec.topology)
    if spec.gpus is not None and attribute is not None:
        devices["constraints"] = [{"requests": [c.CLAIM_REQUEST_NAME], "matchAttribute": attribute}]
    return {"devices": devices}


@dataclass(frozen=True, slots=True)
class Card:
    """One whole-card device of the package as a node publishes it, and whether a claim holds it
    (or any device of another package on the same card, which leaves it not whole)."""

    node: str
    device: str
    pcie_root: str | None
    numa_node: int | None
    free: bool


def _group(card: Card, topology: Topology) -> tuple[str, str | int | None]:
    if topology is Topology.SAME_PCIE_ROOT:
        return (card.node, card.pcie_root)
    if topology is Topology.SAME_NUMA_NODE:
        return (card.node, card.numa_node)
    return (card.node, None)


def _free_by_group(cards: Iterable[Card], topology: Topology) -> Counter[tuple[str, str | int | None]]:
    counts: Counter[tuple[str, str | int | None]] = Counter()
    for card in cards:
        key = _group(card, topology)
        # A card that does not publish the attribute cannot meet a constraint on it: the scheduler
        # skips it, so it counts for no group.
        if topology is not Topology.ANY and key[1] is None:
            continue
        counts[key] += 1 if card.free else 0
    return counts


def products_free(cards: Iterable[Card], gpus: int, topology: Topology) -> int:
    """Whole products kube-scheduler could place now: per node and topology group, free cards // N."""
    return sum(n // gpus for n in _free_by_group(cards, topology).values())


@dataclass(frozen=True, slots=True)
class Fit:
    fits: bool
    reason: str | None = None
    message: str = ""


def placement(cards: Iterable[Card], gpus: int, topology: Topology, gpu_model: str) -> Fit:
    """Whether a product of `gpus` cards fits on some node now; if not, the message says how close
    the best node comes, so a tenant sees why their product waits."""
    cards = list(cards)
    groups = _free_by_group(cards, topology)
    if any(n >= gpus for n in groups.values()):
        return Fit(True)
    where = _WHERE[topology]
    head = f"no node has {gpus} free cards of {gpu_model}" + (f" {where}" if where else "")
    if not cards:
        return Fit(False, REASON_NO_NODE_FITS, f"{head}: no node publishes cards of this package")
    (node, group), best = max(groups.items(), key=lambda kv: (kv[1], kv[0][0]), default=((None, None), 0))
    if node is None:
        attr = match_attribute(topology)
        return Fit(False, REASON_NO_NODE_FITS, f"{head}: no card publishes {attr}")
    at = f" {where.removeprefix('on one ')} {group}" if group is not None else ""
    return Fit(False, REASON_NO_NODE_FITS, f"{head} (most: {best} on node {node}{at})")


def quota_devices(spec: GpuPackageSpec, products: int) -> int:
    """What `products` of this package count against the DeviceClass devices quota: every card is
    one device in the claim, so a 4-card product uses 4 of the namespace's entitlement."""
    return products * spec.cards_per_product


def cards_held(spec: GpuPackageSpec) -> float:
    """How many cards one product (a GpuSlice) of the package takes from the fleet, for card-seconds:
    `gpus` for a multi-GPU product, `fraction` / 100 of one card for a software slice, and the
    instance's compute slices / 7 for a MIG instance (the profile name's leading "<n>g", e.g. 3/7
    for 3g.40gb). A share of a card, not the card touched: four 25 % slices on one card for an hour
    are one card-hour between them, as much as the card had to give, so card-hours summed over every
    namespace never pass cards x hours."""
    if spec.gpus is not None:
        return float(spec.gpus)
    if spec.mig_profile is not None:
        compute_slices = int(spec.mig_profile.split("g.", 1)[0])
        return compute_slices / MIG_COMPUTE_SLICES
    return spec.fraction / 100


def card_seconds(spec: GpuPackageSpec, held_seconds: float) -> float:
    """Card-seconds one product held for `held_seconds` stands for, for metering (`cards_held`)."""
    return held_seconds * cards_held(spec)


def cards_from_slices(
    slices: Iterable[dict[str, Any]], allocated: set[tuple[str, str]], package: str
) -> list[Card]:
    """The package's whole-card devices from ResourceSlice objects of driver gpuslice.io, with their
    topology attributes; `allocated`: (pool, device) of every device in an allocated claim."""
    out: list[Card] = []
    for s in slices:
        spec = s.get("spec") or {}
        if spec.get("driver") != c.DRIVER_NAME:
            continue
        pool = (spec.get("pool") or {}).get("name", "")
        node = spec.get("nodeName") or pool
        for d in spec.get("devices") or []:
            attrs = d.get("attributes") or {}
            if (attrs.get("package") or {}).get("string") != package:
                continue
            numa = (attrs.get("numaNode") or {}).get("int")
            out.append(
                Card(
                    node=node,
                    device=d["name"],
                    pcie_root=(attrs.get(PCIE_ROOT_ATTRIBUTE) or {}).get("string"),
                    numa_node=int(numa) if numa is not None else None,
                    free=(pool, d["name"]) not in allocated,
                )
            )
    return out


def cards_from_published(
    slices: Iterable[PublishedSlice], allocated: Iterable[tuple[str, str]], package: str
) -> list[Card]:
    """The package's whole-card devices from the operator's parsed ResourceSlices (newest generation
    of each pool). A card is free when no device on it, of this package or another, is allocated:
    a whole card needs all of its counters. A tainted (unhealthy) card is left out."""
    live = newest_generation(slices)
    taken = set(allocated)
    busy = {(d.pool, d.counter_set) for s in live for d in s.devices if (d.pool, d.name) in taken}
    return [
        Card(
            node=s.node or s.pool,
            device=d.name,
            pcie_root=d.pcie_root,
            numa_node=d.numa_node,
            free=(d.pool, d.counter_set) not in busy and (d.pool, d.name) not in taken,
        )
        for s in live
        for d in s.devices
        if d.package == package and not tainted_effect(d.taints)
    ]
