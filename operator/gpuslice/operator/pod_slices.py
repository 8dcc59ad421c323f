"""The GpuSlice of each pod that asks for a product in resources.limits, made by the package daemon.

The pod watch (`workloads`) marks `(namespace, pod)`; the package daemon routes the mark to the
pod's package (`product_pod_package`), creates the slice if it is missing (`ensure_pod_slices`) and
refreshes it like any other. The package timer marks pods whose slice is still missing.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuslice.api.package import GpuPackageSpec
from gpuslice.domain.pod_slices import pod_slice, product_packages
from gpuslice.kubehttp import ApiError
from gpuslice.logs import get
from gpuslice.operator.changes import Ref
from gpuslice.operator.indexes import Indexes
from gpuslice.operator.state import OperatorState, one

log = get(__name__)

#: Pods past these phases hold no slice any more; none is made for them.
TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})


def package_specs(idx: Indexes) -> dict[str, GpuPackageSpec]:
    return {name: view.spec for name in idx.packages if (view := one(idx.packages, name)) is not None}


def _package(idx: Indexes, ref: Ref, products: dict[str, str]) -> str | None:
    pod = one(idx.product_pods, ref)
    if pod is None or pod.product is None:
        return None
    return products.get(pod.product)


def product_pod_package(idx: Indexes, ref: Ref) -> str | None:
    """The package whose product the pod `ref` asks for in resources.limits; None if none sells it.
    (Called for every mark without a slice, most of them claims' names: the pod lookup comes first.)"""
    if one(idx.product_pods, ref) is None:
        return None
    return _package(idx, ref, product_packages(package_specs(idx)))


def pods_without_slice(idx: Indexes, package: str) -> list[Ref]:
    products = product_packages(package_specs(idx))
    return [
        ref
        for ref in list(idx.product_pods)
        if one(idx.slices, ref) is None and _package(idx, ref, products) == package
    ]


async def ensure_pod_slices(state: OperatorState, refs: Iterable[Ref], idx: Indexes) -> None:
    """Create the GpuSlice of each pod in `refs` that asks for a product and has none yet. A GpuSlice
    of the pod's name that is not the pod's (a tenant's, or a deleted pod's that the garbage
    collector has yet to remove) is left alone: the package timer tries again."""
    products = product_packages(package_specs(idx))
    for ref in refs:
        pod = one(idx.product_pods, ref)
        package = _package(idx, ref, products)
        if pod is None or package is None or not pod.uid or pod.deleting or pod.phase in TERMINAL_PHASES:
            continue
        if one(idx.slices, ref) is not None:
            continue
        try:
            await state.kube.create(pod_slice(pod.namespace, pod.name, pod.uid, package))
        except ApiError as exc:
            if exc.status == 409:
                continue  # made a moment ago, or a GpuSlice of that name that is not the pod's
            log.warning(
                "pod slice create refused; the package timer retries",
                namespace=pod.namespace,
                pod=pod.name,
                error=str(exc),
            )
            continue
        log.info("pod slice created", namespace=pod.namespace, pod=pod.name, package=package)
