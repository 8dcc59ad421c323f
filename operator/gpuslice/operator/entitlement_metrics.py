"""The operator's per-namespace entitlement series, kept in step with each tenant's gpuslice quota."""

from __future__ import annotations

from collections.abc import Mapping

from gpuslice.metrics import NAMESPACE_ENTITLED_SLICES, NAMESPACE_HELD_SLICES

_ENTITLEMENT_SERIES: dict[str, set[str]] = {}


def set_namespace_entitlements(namespace: str, use: Mapping[str, tuple[int, int]]) -> None:
    """A namespace's entitled and held slices per package (domain.entitlement_use); the series of a
    package no longer counted there, or of a namespace no longer a tenant (`use` empty), go."""
    for package in _ENTITLEMENT_SERIES.get(namespace, set()) - set(use):
        NAMESPACE_ENTITLED_SLICES.remove(namespace, package)
        NAMESPACE_HELD_SLICES.remove(namespace, package)
    for package, (entitled, held) in use.items():
        NAMESPACE_ENTITLED_SLICES.labels(namespace, package).set(entitled)
        NAMESPACE_HELD_SLICES.labels(namespace, package).set(held)
    if use:
        _ENTITLEMENT_SERIES[namespace] = set(use)
    else:
        _ENTITLEMENT_SERIES.pop(namespace, None)
