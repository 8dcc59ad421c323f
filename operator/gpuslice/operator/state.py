"""What the operator keeps between handler calls (Kopf's memo), and helpers to read indexes."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import kopf

from gpuslice.api.package import GpuPackageSpec
from gpuslice.api.resourceslice import PublishedSlice
from gpuslice.domain.capacity import Capacity, package_capacity
from gpuslice.domain.capacity_window import open_windows
from gpuslice.domain.drains import with_rule_taints
from gpuslice.domain.features import Platform
from gpuslice.domain.mig import package_profile
from gpuslice.domain.multigpu import cards_from_published, placement, products_free
from gpuslice.domain.views import ClaimView
from gpuslice.operator.changes import Changes
from gpuslice.operator.config import OperatorConfig
from gpuslice.operator.kube import Kube
from gpuslice.operator.metering import Metering
from gpuslice.operator.workloads import Workloads
from gpuslice.timefmt import rfc3339

K = TypeVar("K")
V = TypeVar("V")

#: Slice refreshes at once (see `changes`): each holds its facts and the status it decides until its
#: write is answered, so thousands at once cost memory, and the writes queue anyway (`kube`).
REFRESHES_IN_FLIGHT = 64

#: What `one` and `values` read: a Kopf index, or one of the operator's own (`workloads.ViewIndex`).
Lookup = Mapping[K, Collection[V]]


def one(index: Lookup[K, V], key: K) -> V | None:
    """The single value under `key`, or None."""
    store = index.get(key)
    if not store:
        return None
    return next(iter(store), None)


def values(index: Lookup[K, V], key: K) -> list[V]:
    store = index.get(key)
    return list(store) if store else []


@dataclass
class Snapshot:
    """ResourceSlices and allocations at one moment, shared by status computations for a short while."""

    taken_at: float
    slices: list[PublishedSlice]
    allocated: list[tuple[str, str]]
    uuids: dict[tuple[str, str], str]
    #: the taints of tainted devices (an unhealthy card's), by (pool, device)
    taints: dict[tuple[str, str], tuple[Mapping[str, Any], ...]] = field(default_factory=dict)
    _capacity: dict[tuple[str, tuple[str, str] | None], Capacity] = field(default_factory=dict)

    def capacity(self, package: str, spec: GpuPackageSpec | None = None) -> Capacity:
        """`spec`: the package's, needed for a Hardware package (its devices carry no package) and for a
        multi-GPU package (`products_free` too)."""
        profile = package_profile(spec) if spec is not None else None
        mig = (spec.gpu_model, profile) if spec is not None and profile else None
        key = (package, mig)
        if key not in self._capacity:
            self._capacity[key] = package_capacity(package, self.slices, self.allocated, mig)
        found = self._capacity[key]
        if spec is None or spec.gpus is None:
            return found
        cards = cards_from_published(self.slices, self.allocated, package)
        fit = placement(cards, spec.gpus, spec.topology, spec.gpu_model)
        return dataclasses.replace(
            found,
            products_free=products_free(cards, spec.gpus, spec.topology),
            placement_message=None if fit.fits else fit.message,
        )


@dataclass
class OperatorState:
    config: OperatorConfig
    kube: Kube
    #: (namespace, slice) -> the API server's message from the last failed claim/template create.
    create_errors: dict[tuple[str, str], str] = field(default_factory=dict)
    #: (namespace, slice) -> how many creates in a row were refused for another reason than quota.
    refusals: dict[tuple[str, str], int] = field(default_factory=dict)
    snapshot: Snapshot | None = None
    #: (namespace, slice) -> when this process last applied its claim or template; the watch stream
    #: delivers the new object a moment later, and until then the index does not show it.
    applied: dict[tuple[str, str], float] = field(default_factory=dict)
    #: (namespace, slice) -> the claim as its apply answered, until the index shows it.
    created: dict[tuple[str, str], ClaimView] = field(default_factory=dict)
    #: (namespace, slice) -> (uid, status) this process last wrote.
    written: dict[tuple[str, str], tuple[str, dict[str, Any]]] = field(default_factory=dict)
    #: package -> when its slices were last all recomputed (monotonic seconds).
    resynced: dict[str, float] = field(default_factory=dict)
    #: package -> the status.capacity this process last wrote for it (the index may lag behind).
    package_capacity: dict[str, dict[str, int]] = field(default_factory=dict)
    #: package -> when its capacity is to be recounted (monotonic; `domain.capacity_window`).
    capacity_due: dict[str, float] = field(default_factory=dict)
    #: When the last allocation, release or device taint was seen (monotonic): a snapshot older than
    #: that cannot be recounted from.
    capacity_changed_at: float = float("-inf")
    _locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    #: The API server dropped a DeviceClass's extendedResourceName (DRAExtendedResource off, Kubernetes
    #: 1.34/1.35): products are not requestable in resources.limits, and classes are compared without it.
    extended_resource_dropped: bool = False
    #: What this cluster's API server serves, read at start-up (domain.features); None: not read.
    platform: Platform | None = None
    #: Namespaces whose last tenancy write was refused: the package timers retry them.
    unsynced_namespaces: set[str] = field(default_factory=set)
    #: Namespace -> when its GpuSlice-count quota was last re-counted (monotonic; -inf: never), for
    #: each whose count kube-controller-manager has not computed (domain.tenancy.slice_count_unknown).
    slice_count_unknown: dict[str, float] = field(default_factory=dict)
    #: Some namespace's GpuSlice count is known: kube-controller-manager has discovered GpuSlices.
    slice_count_known: bool = False
    #: (kind, name) -> the admission policies and bindings this configuration wants (see policies).
    admission: dict[tuple[str, str], dict[str, Any]] | None = None
    #: Pods and ReplicaSets that reference claims (watched outside Kopf; see `workloads`).
    workloads: Workloads = field(default_factory=Workloads)
    refresh_slots: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(REFRESHES_IN_FLIGHT))
    #: The metering ledger's book-keeping (see `ledger`).
    metering: Metering = field(default_factory=Metering)

    @property
    def changes(self) -> Changes:
        """The slices marked for a refresh (by events, timers and the pod watches)."""
        return self.workloads.changes

    def capacity_changed(self, packages: Iterable[str]) -> None:
        """An allocation, release or device taint that may change these packages' capacity was seen."""
        now = time.monotonic()
        self.capacity_due = open_windows(self.capacity_due, packages, now)
        self.capacity_changed_at = now

    def lock(self, key: tuple[str, str]) -> asyncio.Lock:
        return self._locks.setdefault(key, asyncio.Lock())

    def forget(self, key: tuple[str, str]) -> None:
        """A slice is gone: drop what was kept for it."""
        self.create_errors.pop(key, None)
        self.refusals.pop(key, None)
        self.written.pop(key, None)
        self.applied.pop(key, None)
        self.created.pop(key, None)
        lock = self._locks.get(key)
        if lock is not None and not lock.locked():
            del self._locks[key]

    def published(
        self,
        resource_slices: kopf.Index[str, PublishedSlice],
        pool_claims: kopf.Index[str, tuple[str, str]],
        claims: kopf.Index[tuple[str, str], ClaimView],
        need: Iterable[tuple[str, str]] = (),
        rules: kopf.Index[str, dict[str, Any]] | None = None,
    ) -> Snapshot:
        """The cached snapshot, unless it is old or does not know an allocated (pool, device) in
        `need`: a status computed from a snapshot older than the device's ResourceSlice would lack
        the GPU and stay so until the next event. (A snapshot older than the slice's own claim is
        fine: capacity only explains why an unallocated slice waits; requiring the claim in it
        rebuilt the snapshot for every newly allocated slice of a burst.)"""
        now = time.monotonic()
        cached = self.snapshot
        if (
            cached
            and now - cached.taken_at < self.config.capacity_cache_seconds
            and all(d in cached.uuids for d in need)
        ):
            return cached
        slices: list[PublishedSlice] = [s for pool in resource_slices for s in resource_slices[pool]]
        if rules:
            slices = with_rule_taints(slices, [r for name in rules for r in rules[name]])
        allocated: set[tuple[str, str]] = set()
        for pool in pool_claims:
            for ref in pool_claims[pool]:
                view = one(claims, ref)
                if view is not None and view.allocated:
                    allocated.update(view.devices)
        uuids = {(d.pool, d.name): d.uuid for s in slices for d in s.devices if d.uuid}
        taints = {(d.pool, d.name): d.taints for s in slices for d in s.devices if d.taints}
        self.snapshot = Snapshot(now, slices, sorted(allocated), uuids, taints)
        return self.snapshot


def now() -> str:
    """RFC 3339 in UTC with seconds, as metav1.Time serialises."""
    return rfc3339(datetime.now(UTC))
