"""GpuPackage handlers: DeviceClass, quotas everywhere it is entitled, capacity status, held deletion.

Watch events apply changes at once (a fast path). The per-package timer is what converges: it runs
every `recheck_seconds`, writes only what the indexes show missing or different (DeviceClass, quotas
whose write was refused, admission policies), and Kopf retries it after a refusal.

status.capacity does not wait for that timer: every allocation, release or device taint opens a
recount window (`domain.capacity_window`), and the package's capacity daemon recounts when it closes.
"""

from __future__ import annotations

import time
from typing import Any

import kopf

from gpuslice import constants as c
from gpuslice.api.package import GpuPackageSpec, GpuPackageStatus
from gpuslice.api.slice import Phase
from gpuslice.domain.capacity import Capacity
from gpuslice.domain.capacity_window import recount_in
from gpuslice.domain.conditions import same_status
from gpuslice.domain.deviceclass import desired_fingerprint, device_class
from gpuslice.domain.package_status import capacity_patch, deletion_condition, package_status
from gpuslice.domain.pod_slices import resource_of
from gpuslice.domain.tenancy import entitled_slices
from gpuslice.domain.views import uses_gpuslice
from gpuslice.logs import get
from gpuslice.metrics import (
    PACKAGE_CAPACITY_SLICES,
    PACKAGE_FREE_SLICES,
    SLICES,
    STATUS_UPDATES,
    forget_package,
)
from gpuslice.operator import heap
from gpuslice.operator.config import OperatorConfig
from gpuslice.operator.indexes import MANAGED, Indexes, SliceView
from gpuslice.operator.pod_slices import package_specs
from gpuslice.operator.policies import ensure_policies
from gpuslice.operator.queues import conditions as queue_conditions
from gpuslice.operator.queues import forget as forget_queues
from gpuslice.operator.queues import reconcile_queues
from gpuslice.operator.retry import fast_path, refusal_is_temporary
from gpuslice.operator.slices import recheck, refresh_routed, sync_package_capacity
from gpuslice.operator.state import OperatorState, now, one, values
from gpuslice.operator.tenancy import reconcile_all, recount_slice_counts, retry_unsynced

log = get(__name__)
TIMER = "package_timer"


def resource_name(state: OperatorState, idx: Indexes, package: str, spec: GpuPackageSpec) -> str | None:
    """The extended resource the package's DeviceClass names (None: off, another package has it, or
    the API server drops the field)."""
    if state.extended_resource_dropped:
        return None
    return resource_of(package, {**package_specs(idx), package: spec})


def device_class_current(state: OperatorState, idx: Indexes, package: str, spec: GpuPackageSpec) -> bool:
    """The DeviceClass exists, selects what it should and names the package's extended resource
    (someone may have edited it, or the package changed its extendedResourceName)."""
    desired = desired_fingerprint(package, spec, resource_name(state, idx, package, spec))
    return one(idx.device_classes, c.device_class_name(package)) == desired


async def ensure_device_class(
    state: OperatorState, idx: Indexes, name: str, uid: str | None, spec: GpuPackageSpec
) -> None:
    body = device_class(name, uid, spec, resource_name(state, idx, name, spec))
    with refusal_is_temporary(f"DeviceClass of {name}", state.config.recheck_seconds):
        stored = await state.kube.apply(body)
    if "extendedResourceName" in body["spec"] and "extendedResourceName" not in (stored.get("spec") or {}):
        # Applying it again would only be dropped again, every recheck: compare without it.
        state.extended_resource_dropped = True
        log.warning(
            "the API server dropped DeviceClass.spec.extendedResourceName: products cannot be asked for "
            "in resources.limits; turn on the DRAExtendedResource feature gate (GA from 1.37)",
            device_class=body["metadata"]["name"],
        )


@kopf.on.event(c.API_GROUP, c.API_VERSION, c.PACKAGE_PLURAL)
async def package_event(name: str, type: str | None, body: kopf.Body, memo: kopf.Memo, **kw: Any) -> None:
    """Level-triggered: every event of a package re-derives its DeviceClass and all tenant quotas;
    only differences are written."""
    idx = Indexes(kw, memo.state.workloads)
    state: OperatorState = memo.state
    if type == "DELETED":
        await fast_path(reconcile_all(state, idx, exclude=name), TIMER)
        return
    meta = body.get("metadata", {})
    if meta.get("deletionTimestamp") is None:
        spec = GpuPackageSpec.model_validate(dict(body.get("spec", {})))
        # The DeviceClass depends on name and gpuModel, which cannot change, and on
        # extendedResourceName, which can: apply it on first sight (a no-op when it is already
        # right) and whenever the index shows it different.
        if type in (None, "ADDED") or not device_class_current(state, idx, name, spec):
            await fast_path(ensure_device_class(state, idx, name, meta.get("uid"), spec), TIMER)
    await fast_path(reconcile_all(state, idx), TIMER)
    if type == "ADDED":
        # Slices that named this package before it existed were Failed (PackageNotFound): go on now.
        await refresh_routed(state, values(idx.package_slices, name), idx)


@kopf.on.event(c.DRA_GROUP, c.DRA_VERSION, "deviceclasses", labels=MANAGED)
async def device_class_event(name: str, type: str | None, memo: kopf.Memo, **kw: Any) -> None:
    """A gpuslice DeviceClass deleted or edited by someone else: put it back while its package lives."""
    idx = Indexes(kw, memo.state.workloads)
    package = one(idx.packages, name.removesuffix(c.DEVICE_CLASS_SUFFIX))
    if package is None or package.deleting:
        return
    if type in ("DELETED", "MODIFIED"):
        await fast_path(ensure_device_class(memo.state, idx, package.name, package.uid, package.spec), TIMER)


@kopf.on.delete(c.API_GROUP, c.API_VERSION, c.PACKAGE_PLURAL)
async def package_deleted(name: str, body: kopf.Body, memo: kopf.Memo, **kw: Any) -> None:
    """Held while GpuSlices use the package, with a condition that names them; then clean up."""
    idx = Indexes(kw, memo.state.workloads)
    state: OperatorState = memo.state
    users = sorted(f"{ns}/{n}" for ns, n in values(idx.package_slices, name))
    if users:
        cond = deletion_condition(users).model_dump(by_alias=True, exclude_none=True)
        conditions = [
            x for x in (body.get("status") or {}).get("conditions") or [] if x.get("type") != "Deleting"
        ]
        await state.kube.patch_status(
            c.GROUP_VERSION, c.PACKAGE_KIND, name, None, {"conditions": [*conditions, cond]}
        )
        raise kopf.TemporaryError(cond["message"], delay=max(2.0, min(state.config.resync_seconds, 10.0)))
    await state.kube.delete(c.DRA_GROUP_VERSION, "DeviceClass", c.device_class_name(name))
    await reconcile_all(state, idx, exclude=name)
    forget_package(name)
    forget_queues(name)
    state.package_capacity.pop(name, None)
    state.capacity_due.pop(name, None)
    log.info("package deleted", package=name)


async def package_timer(name: str, body: kopf.Body, meta: kopf.Meta, memo: kopf.Memo, **kw: Any) -> None:
    """Capacity and the rest of the status (written only when it changed); then whatever a refused
    write left undone. A refusal raises TemporaryError, which Kopf retries after its delay."""
    idx = Indexes(kw, memo.state.workloads)
    state: OperatorState = memo.state
    if meta.get("deletionTimestamp") is not None:
        return
    spec = GpuPackageSpec.model_validate(dict(body.get("spec", {})))
    recheck(state, name, idx)
    await reconcile_queues(state, idx, name, spec)
    await _write_status(state, name, spec, body, idx)
    if not device_class_current(state, idx, name, spec):
        await ensure_device_class(state, idx, name, meta.get("uid"), spec)
    await retry_unsynced(state, idx)
    await recount_slice_counts(state, idx)
    await ensure_policies(state, idx)
    heap.trim(state.config.recheck_seconds)


#: How often a capacity daemon looks whether its package's recount window has closed (part of the bound).
CAPACITY_POLL_SECONDS = 0.25


@kopf.on.event(c.DRA_GROUP, c.DRA_VERSION, "resourceclaims")
async def claim_capacity_event(body: kopf.Body, memo: kopf.Memo, **kw: Any) -> None:
    """A gpuslice claim allocated, released or gone: the packages' capacity is recounted shortly."""
    if uses_gpuslice(body):
        memo.state.capacity_changed(Indexes(kw, memo.state.workloads).packages)


@kopf.on.event(c.DRA_GROUP, c.DRA_VERSION, "resourceslices")
async def slice_capacity_event(spec: kopf.Spec, memo: kopf.Memo, **kw: Any) -> None:
    """A node republished (a card appeared, failed or recovered): the packages' capacity follows."""
    if spec.get("driver") == c.DRIVER_NAME:
        memo.state.capacity_changed(Indexes(kw, memo.state.workloads).packages)


@kopf.on.event(c.DRA_GROUP, c.DRA_VERSION, "devicetaintrules")
async def taint_rule_capacity_event(memo: kopf.Memo, **kw: Any) -> None:
    """A drain began or ended: its cards leave or rejoin the packages' capacity."""
    memo.state.capacity_changed(Indexes(kw, memo.state.workloads).packages)


@kopf.daemon(c.API_GROUP, c.API_VERSION, c.PACKAGE_PLURAL, cancellation_timeout=5.0)
async def capacity_daemon(
    name: str, body: kopf.Body, stopped: kopf.DaemonStopped, memo: kopf.Memo, **kw: Any
) -> None:
    """Recounts the package's capacity when its window closes and writes status.capacity if the count
    moved. A daemon, so only the active replica writes; a refused write reopens the window."""
    state: OperatorState = memo.state
    idx = Indexes(kw, state.workloads)
    while not stopped:
        wait = recount_in(state.capacity_due, name, time.monotonic())
        if wait is None or wait > 0:
            await stopped.wait(CAPACITY_POLL_SECONDS if wait is None else min(wait, CAPACITY_POLL_SECONDS))
            continue
        del state.capacity_due[name]
        if (body.get("metadata") or {}).get("deletionTimestamp") is not None:
            continue
        try:
            await _recount(state, name, body, idx)
        except Exception as exc:
            # Not raised to Kopf: it restarts a failed daemon only after its 60 s backoff, the very
            # staleness this daemon is for. The next window retries.
            log.warning("capacity recount failed; retried", package=name, error=str(exc))
            state.capacity_changed([name])


async def _recount(state: OperatorState, name: str, body: kopf.Body, idx: Indexes) -> None:
    if state.snapshot is not None and state.snapshot.taken_at <= state.capacity_changed_at:
        state.snapshot = None  # taken before the change: recount from the indexes as they are now
    spec = GpuPackageSpec.model_validate(dict(body.get("spec", {})))
    snapshot = state.published(idx.resource_slices, idx.pool_claims, idx.claims, rules=idx.device_taint_rules)
    live = snapshot.capacity(name, spec)
    _export(name, live, idx)
    await sync_package_capacity(state, name, live, idx)


def register(config: OperatorConfig, registry: kopf.OperatorRegistry | None = None) -> None:
    """The package timer, at the configured interval (called once, before Kopf starts)."""
    kopf.timer(
        c.API_GROUP,
        c.API_VERSION,
        c.PACKAGE_PLURAL,
        interval=config.recheck_seconds,
        initial_delay=1.0,
        registry=registry,
    )(package_timer)


async def _write_status(
    state: OperatorState, name: str, spec: GpuPackageSpec, body: kopf.Body, idx: Indexes
) -> None:
    snapshot = state.published(idx.resource_slices, idx.pool_claims, idx.claims, rules=idx.device_taint_rules)
    _export(name, snapshot.capacity(name, spec), idx)
    entitled = 0
    for ns in idx.namespaces:
        entry = one(idx.namespaces, ns)
        if entry and not entry.terminating and entitled_slices(spec, entry.labels) is not None:
            entitled += 1
    present = one(idx.device_classes, c.device_class_name(name)) is not None
    current = dict(body.get("status") or {})
    previous = GpuPackageStatus.model_validate(current).conditions
    new = package_status(
        name,
        spec,
        body.get("metadata", {}).get("generation"),
        snapshot.capacity(name, spec),
        entitled,
        present,
        previous=previous,
        now=now(),
        resource=resource_name(state, idx, name, spec),
        platform=state.platform,
        extra=queue_conditions(name),
    )
    desired = new.model_dump(by_alias=True, exclude_none=True)
    if same_status(current, desired):
        state.package_capacity[name] = desired["capacity"]
        return
    patch = {**desired, "capacity": capacity_patch(desired.get("capacity") or {})}
    await state.kube.patch_status(c.GROUP_VERSION, c.PACKAGE_KIND, name, None, patch)
    state.package_capacity[name] = desired["capacity"]
    STATUS_UPDATES.labels("GpuPackage").inc()


def _export(name: str, capacity: Capacity, idx: Indexes) -> None:
    """Package gauges: capacity, and slices by phase (from the index, no API call)."""
    PACKAGE_CAPACITY_SLICES.labels(name).set(capacity.total)
    PACKAGE_FREE_SLICES.labels(name).set(capacity.free)
    counts = dict.fromkeys(Phase, 0)
    for ref in values(idx.package_slices, name):
        entry: SliceView | None = one(idx.slices, ref)
        counts[Phase((entry.phase if entry else None) or Phase.PENDING.value)] += 1
    for phase, n in counts.items():
        SLICES.labels(name, phase.value).set(n)
