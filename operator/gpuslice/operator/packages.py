"""GpuPackage handlers: DeviceClass, quotas everywhere it is entitled, capacity status, held deletion."""

from __future__ import annotations

from typing import Any

import kopf
from kubernetes_asyncio.client.exceptions import ApiException

from gpuslice import constants as c
from gpuslice.api.package import GpuPackageSpec, GpuPackageStatus
from gpuslice.api.slice import Phase
from gpuslice.domain.capacity import Capacity
from gpuslice.domain.conditions import same_status
from gpuslice.domain.deviceclass import device_class
from gpuslice.domain.package_status import deletion_condition, package_status
from gpuslice.domain.tenancy import entitled_slices
from gpuslice.logs import get
from gpuslice.metrics import (
    PACKAGE_CAPACITY_SLICES,
    PACKAGE_FREE_SLICES,
    SLICES,
    STATUS_UPDATES,
    WRITES,
    forget_package,
)
from gpuslice.operator.indexes import MANAGED, Indexes
from gpuslice.operator.kube import error_message
from gpuslice.operator.slices import refresh_many
from gpuslice.operator.state import OperatorState, now, one, values
from gpuslice.operator.tenancy import reconcile_all

log = get(__name__)
DRA_API = f"{c.DRA_GROUP}/{c.DRA_VERSION}"


async def ensure_device_class(state: OperatorState, name: str, uid: str | None, spec: GpuPackageSpec) -> None:
    try:
        await state.kube.apply(device_class(name, uid, spec))
    except ApiException as exc:
        raise kopf.TemporaryError(f"DeviceClass of {name}: {error_message(exc)}", delay=5) from exc
    WRITES.labels("DeviceClass", "apply").inc()


@kopf.on.event(c.API_GROUP, c.API_VERSION, c.PACKAGE_PLURAL)
async def package_event(
    name: str,
    type: Any,
    body: Any,
    memo: Any,
    **kw: Any,
) -> None:
    """Level-triggered: every event of a package re-derives its DeviceClass and all tenant quotas;
    only differences are written."""
    idx = Indexes(kw)
    state: OperatorState = memo.state
    if type == "DELETED":
        await reconcile_all(state, idx, exclude=name)
        return
    meta = body.get("metadata", {})
    if meta.get("deletionTimestamp") is None:
        spec = GpuPackageSpec.model_validate(dict(body.get("spec", {})))
        # The DeviceClass depends only on name and gpuModel, which cannot change: apply it on first
        # sight (a no-op when it is already right) and whenever the index lacks it.
        if type in (None, "ADDED") or one(idx.device_classes, c.device_class_name(name)) is None:
            await ensure_device_class(state, name, meta.get("uid"), spec)
    await reconcile_all(state, idx)
    if type == "ADDED":
        # Slices that named this package before it existed were Failed (PackageNotFound): go on now.
        refs = [tuple(r.split("/", 1)) for r in values(idx.slices, ("package", name))]
        await refresh_many(state, [(ns, n) for ns, n in refs], idx)


@kopf.on.event(c.DRA_GROUP, c.DRA_VERSION, "deviceclasses", labels=MANAGED)
async def device_class_event(name: str, type: Any, memo: Any, **kw: Any) -> None:
    """A gpuslice DeviceClass deleted or edited by someone else: put it back while its package lives."""
    idx = Indexes(kw)
    package = name.removesuffix(c.DEVICE_CLASS_SUFFIX)
    entry = one(idx.packages, package)
    if entry is None or entry["deleting"]:
        return
    if type in ("DELETED", "MODIFIED"):
        await ensure_device_class(memo.state, package, entry["uid"], entry["spec"])


@kopf.on.delete(c.API_GROUP, c.API_VERSION, c.PACKAGE_PLURAL)
async def package_deleted(
    name: str,
    body: Any,
    memo: Any,
    **kw: Any,
) -> None:
    """Held while GpuSlices use the package, with a condition that names them; then clean up."""
    idx = Indexes(kw)
    state: OperatorState = memo.state
    users = sorted(values(idx.slices, ("package", name)))
    if users:
        cond = deletion_condition(users).model_dump(by_alias=True, exclude_none=True)
        conditions = [
            x for x in (body.get("status") or {}).get("conditions") or [] if x.get("type") != "Deleting"
        ]
        await state.kube.patch_status(
            c.GROUP_VERSION, c.PACKAGE_KIND, name, None, {"conditions": [*conditions, cond]}
        )
        raise kopf.TemporaryError(cond["message"], delay=max(2.0, min(state.config.resync_seconds, 10.0)))
    await state.kube.delete(DRA_API, "DeviceClass", c.device_class_name(name))
    await reconcile_all(state, idx, exclude=name)
    forget_package(name)
    log.info("package deleted", package=name)


@kopf.timer(c.API_GROUP, c.API_VERSION, c.PACKAGE_PLURAL, interval=5.0, initial_delay=1.0)
async def package_status_timer(
    name: str,
    body: Any,
    meta: Any,
    memo: Any,
    **kw: Any,
) -> None:
    """Capacity and the rest of the status; written only when it changed."""
    idx = Indexes(kw)
    state: OperatorState = memo.state
    if meta.get("deletionTimestamp") is not None:
        return
    spec = GpuPackageSpec.model_validate(dict(body.get("spec", {})))
    snapshot = state.published(idx.resource_slices, idx.claims)
    _export(name, snapshot.capacity(name), idx.slices)
    entitled = 0
    for ns in idx.namespaces:
        entry = one(idx.namespaces, ns)
        if entry and not entry["terminating"] and entitled_slices(spec, entry["labels"]) is not None:
            entitled += 1
    present = one(idx.device_classes, c.device_class_name(name)) is not None
    current = dict(body.get("status") or {})
    previous = GpuPackageStatus.model_validate(current).conditions
    new = package_status(
        name,
        spec,
        meta.get("generation"),
        snapshot.capacity(name),
        entitled,
        present,
        previous=previous,
        now=now(),
    )
    desired = new.model_dump(by_alias=True, exclude_none=True)
    if same_status(current, desired):
        return
    await state.kube.patch_status(c.GROUP_VERSION, c.PACKAGE_KIND, name, None, desired)
    STATUS_UPDATES.labels("GpuPackage").inc()


def _export(name: str, capacity: Capacity, slices: kopf.Index[Any, Any]) -> None:
    """Package gauges: capacity, and slices by phase (from the index, no API call)."""
    PACKAGE_CAPACITY_SLICES.labels(name).set(capacity.total)
    PACKAGE_FREE_SLICES.labels(name).set(capacity.free)
    counts = dict.fromkeys(Phase, 0)
    for ref in values(slices, ("package", name)):
        ns, _, slice_name = ref.partition("/")
        entry = one(slices, ("slice", ns, slice_name))
        phase = ((entry or {}).get("status") or {}).get("phase") or Phase.PENDING.value
        counts[Phase(phase)] += 1
    for phase, n in counts.items():
        SLICES.labels(name, phase.value).set(n)
