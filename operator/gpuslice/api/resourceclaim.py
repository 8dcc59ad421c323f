"""DRA ResourceClaims as gpuslice reads them: the allocation kube-scheduler wrote into their status."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpuslice import constants as c

#: Node labels/fields kube-scheduler puts in an allocation's node selector.
_NODE_KEYS = ("metadata.name", "kubernetes.io/hostname")


@dataclass(frozen=True, slots=True)
class AllocationResult:
    """One entry of `status.allocation.devices.results`."""

    request: str
    driver: str
    pool: str
    device: str


def allocation(claim: Mapping[str, Any]) -> Mapping[str, Any] | None:
    allocated: Mapping[str, Any] | None = (claim.get("status") or {}).get("allocation")
    return allocated


def allocation_results(
    claim: Mapping[str, Any], driver: str | None = c.DRIVER_NAME
) -> list[AllocationResult]:
    """The allocated devices of `driver` (every driver's with None)."""
    results = ((allocation(claim) or {}).get("devices") or {}).get("results") or []
    return [
        AllocationResult(
            request=str(r.get("request", "")),
            driver=str(r["driver"]),
            pool=str(r["pool"]),
            device=str(r["device"]),
        )
        for r in results
        if driver is None or r.get("driver") == driver
    ]


def allocated_devices(claim: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(pool, device) of every gpuslice.io device in a claim's allocation."""
    return [(r.pool, r.device) for r in allocation_results(claim)]


def allocated_node(claim: Mapping[str, Any]) -> str | None:
    """The node an allocation is bound to, from its node selector; None when not allocated or not bound
    to one node by name."""
    for term in ((allocation(claim) or {}).get("nodeSelector") or {}).get("nodeSelectorTerms") or []:
        for req in (term.get("matchFields") or []) + (term.get("matchExpressions") or []):
            if req.get("key") in _NODE_KEYS and req.get("values"):
                return str(req["values"][0])
    return None
