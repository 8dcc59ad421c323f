"""Keeps this node's ResourceSlice pool equal to what its GPUs and the GpuPackages offer.

Reads (packages and the Node from watches, the pool's slices from the API), asks the pure builder and
`plan_publish` what the pool should be, writes with server-side apply. Changes arriving while a
publish runs are coalesced into one more publish.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import aiohttp
from pydantic import ValidationError

from gpuslice import logs, metrics
from gpuslice.agent.gpus import GpuInfo
from gpuslice.agent.kube import Kube
from gpuslice.agent.slices import Package, build_specs, plan_publish
from gpuslice.api.package import GpuPackageSpec
from gpuslice.api.resourceslice import dropped_fields, dropped_message, dropped_taints
from gpuslice.kubehttp import ApiError

log = logs.get(__name__)


def parse_package(obj: dict[str, Any]) -> Package | None:
    name = obj.get("metadata", {}).get("name", "")
    try:
        return Package(name=name, spec=GpuPackageSpec.model_validate(obj.get("spec") or {}))
    except ValidationError as exc:
        # the CRD schema should make this impossible; an invalid package offers nothing
        log.warning("ignoring invalid GpuPackage", package=name, errors=exc.errors(include_url=False))
        return None


class Publisher:
    def __init__(self, node: str, gpus: Sequence[GpuInfo], kube: Kube) -> None:
        self.node = node
        self.gpus = list(gpus)
        self.kube = kube
        self.packages: dict[str, Package] = {}
        self.node_present = False
        self.node_uid: str | None = None
        # publish only once both watches have listed, so start-up does not publish a half picture
        self._packages_known = False
        self._node_known = False
        self._dirty = asyncio.Event()
        self.published = asyncio.Event()  # set after the first successful publish
        # why this node's GPUs must not be published now (agent.toolkit); None: they may
        self.blocked: str | None = None
        # DRA device taints of unhealthy cards, by UUID (agent.health)
        self.taints: dict[str, list[dict[str, Any]]] = {}
        # why the API server cannot be given these devices safely (domain.features: counters it would
        # drop), until the agent restarts; None: it can
        self.refused: str | None = None
        # the API server drops device taints: an unhealthy card's devices are left out instead
        self.taints_dropped = False

    # --- inputs ------------------------------------------------------------------------------------

    def packages_listed(self, objects: Sequence[dict[str, Any]]) -> None:
        self.packages = {p.name: p for p in map(parse_package, objects) if p is not None}
        self._packages_known = True
        self._dirty.set()

    def package_event(self, kind: str, obj: dict[str, Any]) -> None:
        name = obj.get("metadata", {}).get("name", "")
        package = parse_package(obj) if kind != "DELETED" else None
        if package is None:
            self.packages.pop(name, None)
        else:
            self.packages[name] = package
        self._dirty.set()

    def node_seen(self, node: dict[str, Any] | None) -> None:
        """The Node object as last seen, or None once it is gone."""
        present = node is not None
        if present != self.node_present:
            log.info("node present" if present else "node gone, withdrawing its slices", node=self.node)
        self.node_present = present
        self.node_uid = node.get("metadata", {}).get("uid") if node else None
        self._node_known = True
        self._dirty.set()

    def set_blocked(self, reason: str | None) -> None:
        """While `reason` is set the pool is empty (its slices are withdrawn); None publishes again."""
        self.blocked = reason
        self._dirty.set()

    def refuse(self, reason: str) -> None:
        """Publish nothing from now on (a guarantee would break): withdraw the pool, say why."""
        if reason != self.refused:
            log.error("publishing no device", node=self.node, reason=reason)
        self.refused = reason
        self._dirty.set()

    def set_taints(self, taints: dict[str, list[dict[str, Any]]]) -> None:
        """Every device of card `uuid` carries `taints[uuid]` from the next publish on."""
        if taints != self.taints:
            self.taints = taints
            self._dirty.set()

    # --- output ------------------------------------------------------------------------------------

    async def sync(self) -> None:
        publish = self.node_present and self.blocked is None and self.refused is None
        gpus, taints = self.gpus, self.taints
        if self.taints_dropped and taints:
            # A taint would be dropped: the unhealthy cards' devices are not offered at all.
            gpus, taints = [g for g in gpus if g.uuid not in taints], {}
        desired = build_specs(self.node, gpus, self.packages.values(), taints) if publish else []
        existing = await self.kube.list_pool_slices(self.node)
        plan = plan_publish(self.node, desired, existing, self.node_uid)
        for body in plan.apply:
            stored = await self.kube.apply_slice(body)
            dropped = dropped_fields(body["spec"], (stored or {}).get("spec") or {})
            if dropped:
                # Devices without their counters could be sold twice on one card: offer none.
                self.refuse(dropped_message(dropped))
                await self.withdraw()
                return
            if untainted := dropped_taints(body["spec"], (stored or {}).get("spec") or {}):
                log.error(
                    "the API server dropped the device taints of an unhealthy card: it stays on sale; "
                    "turn on the feature gate DRADeviceTaints (kube-apiserver, kube-scheduler, "
                    "kube-controller-manager)", devices=untainted[:5],
                )  # fmt: skip
        for name in plan.delete:
            await self.kube.delete_slice(name)
        devices = sum(len(s.get("devices", [])) for _, s in desired)
        metrics.PUBLISHED_DEVICES.labels(node=self.node).set(devices)
        metrics.PUBLISHED_RESOURCESLICES.labels(node=self.node).set(len(desired))
        if not plan.empty:
            metrics.PUBLISHES.labels(node=self.node).inc()
            generation = plan.apply[0]["spec"]["pool"]["generation"] if plan.apply else 0
            metrics.POOL_GENERATION.labels(node=self.node).set(generation)
            log.info(
                "pool published", node=self.node, generation=generation, slices=len(plan.apply),
                devices=devices, deleted=len(plan.delete), packages=sorted(self.packages),
            )  # fmt: skip

    async def run(self) -> None:
        delay = 1.0
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            if not (self._packages_known and self._node_known):
                continue
            try:
                await self.sync()
                self.published.set()
                delay = 1.0
            except (TimeoutError, ApiError, OSError, aiohttp.ClientError) as exc:
                log.warning("publishing failed, retrying", error=str(exc), retry_in=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
                self._dirty.set()

    async def withdraw(self) -> None:
        """Delete every slice of this node's pool (shutdown)."""
        existing = await self.kube.list_pool_slices(self.node)
        for name in plan_publish(self.node, [], existing).delete:
            await self.kube.delete_slice(name)
        log.info("pool withdrawn", node=self.node, deleted=len(existing))
