"""GpuPackage status: its DeviceClass, slice size, capacity, guarantees in words, deletion hold."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gpuslice import constants as c
from gpuslice.api.package import Condition, GpuPackageSpec, GpuPackageStatus, Guarantees, PackageCapacity
from gpuslice.domain.capacity import Capacity
from gpuslice.domain.conditions import Health, health_conditions, stamp
from gpuslice.domain.features import Platform
from gpuslice.domain.mig import package_profile, profile_choice

GUARANTEES = Guarantees(
    memory="Enforced",
    compute="Cooperative",
    quota="Entitlement",
    summary="memory Enforced (hard limit), compute Cooperative (a share, not a throughput guarantee), "
    "quota Entitlement (not a reservation: when GPUs are full, workloads wait)",
)
#: A Hardware (MIG) package: the driver keeps the instance's memory, SMs and faults apart.
HARDWARE_GUARANTEES = Guarantees(
    memory="Enforced",
    compute="Dedicated",
    quota="Entitlement",
    summary="memory Enforced (by the driver: a MIG instance), compute Dedicated (the instance's own SMs), "
    "quota Entitlement (not a reservation: when GPUs are full, workloads wait)",
)


def _slices_per_gpu(spec: GpuPackageSpec, capacity: Capacity) -> int | None:
    """A fraction's slices per card; a MIG profile's placements per card (they do not overlap one
    another), known only once a card publishes them."""
    if not spec.hardware:
        return spec.slices_per_card()
    return capacity.total // capacity.gpus if capacity.gpus else None


BURST_GUARANTEES = GUARANTEES.model_copy(
    update={
        "compute": "CooperativeBurst",
        "summary": "memory Enforced (hard limit), compute CooperativeBurst (a share, not a throughput "
        "guarantee; alone on its card a slice may use the idle compute up to the whole card, and is held "
        "back to its share within 2 s once a neighbouring slice runs), quota Entitlement (not a "
        "reservation: when GPUs are full, workloads wait)",
    }
)


def guarantees_for(spec: GpuPackageSpec) -> Guarantees:
    """What the package's status promises, in words (its computeBurst changes the compute part)."""
    return BURST_GUARANTEES if spec.compute_burst else GUARANTEES


def format_bytes(n: int) -> str:
    """Largest binary unit that divides evenly, as Kubernetes writes quantities: 8589934592 -> 8Gi."""
    for suffix, size in (("Ti", 1024**4), ("Gi", c.GIB), ("Mi", c.MIB), ("Ki", 1024)):
        if n and n % size == 0:
            return f"{n // size}{suffix}"
    return str(n)


def capacity_status(capacity: Capacity) -> PackageCapacity:
    """What status.capacity (and so `kubectl get gpupackages`) shows for a capacity count."""
    return PackageCapacity(
        gpus=capacity.gpus,
        slicesTotal=capacity.total,
        slicesAllocated=capacity.allocated,
        slicesFree=capacity.free,
        unhealthyGpus=capacity.unhealthy_gpus or None,
        productsFree=capacity.products_free,
    )


def capacity_patch(capacity: Mapping[str, int]) -> dict[str, int | None]:
    """status.capacity as a merge patch: a field the count no longer has (no unhealthy GPU left) is
    written as null, which removes it."""
    return {"unhealthyGpus": None, **capacity}


def capacity_write(live: Capacity) -> dict[str, object]:
    """The status patch of a capacity recount, written apart from the package's other status: with
    status.capacity goes what one slice holds, known only once cards are published, so a package
    never shows cards without the size of their slices."""
    patch: dict[str, object] = {
        "capacity": capacity_patch(capacity_status(live).model_dump(by_alias=True, exclude_none=True))
    }
    if live.memory_per_slice_bytes:
        patch["memoryPerSlice"] = format_bytes(live.memory_per_slice_bytes)
    return patch


def capacity_behind(
    shown: Mapping[str, int] | None, last_written: Mapping[str, int] | None, live: Capacity
) -> bool:
    """Whether the package's status.capacity must be written before a slice's status is: the count a
    slice's verdict is made on must already be what `kubectl get gpupackages` prints. What this process
    last wrote stands in for what the object shows until the watch delivers it."""
    current = last_written if last_written is not None else shown
    return dict(current or {}) != capacity_status(live).model_dump(by_alias=True, exclude_none=True)


def deletion_condition(blocking: Sequence[str]) -> Condition:
    """The condition a package shows while its deletion waits for GpuSlices that still use it."""
    shown = ", ".join(blocking[:5]) + (f" and {len(blocking) - 5} more" if len(blocking) > 5 else "")
    return Condition(
        type="Deleting",
        status="True",
        reason="SlicesStillExist",
        message=f"deletion is held: {len(blocking)} GpuSlice(s) still use this package ({shown}); "
        "delete them first, then the package and its DeviceClass go away",
    )


def features_condition(platform: Platform | None) -> Condition | None:
    """`KubernetesFeaturesOff` (abnormal-true, like Reconciling): what this cluster's Kubernetes cannot
    do for the package and why, naming its version and each feature. None where everything gpuslice
    uses is served (or it was not read), so a healthy package still shows `Ready` alone."""
    if platform is None or not (platform.off or platform.version_problem):
        return None
    return Condition(
        type="KubernetesFeaturesOff",
        status="True",
        reason="UnsupportedVersion" if platform.version_problem else "FeaturesNotServed",
        message=platform.summary(),
    )


def package_status(
    name: str,
    spec: GpuPackageSpec,
    generation: int | None,
    capacity: Capacity,
    entitled_namespaces: int,
    device_class_present: bool,
    blocking: Sequence[str] = (),
    previous: Sequence[Condition] = (),
    now: str = "",
    resource: str | None = None,
    platform: Platform | None = None,
    extra: Sequence[Condition] = (),
) -> GpuPackageStatus:
    dc = c.device_class_name(name)
    choice = profile_choice(spec)
    if choice is not None and choice.profile is None:
        # sized by isolation.memory, and no MIG profile of the model holds it: nothing to sell until
        # the package is replaced (the size is immutable)
        conditions = health_conditions(Health.STALLED, "NoMigProfileHoldsMemory", choice.message, generation)
    else:
        conditions = health_conditions(
            Health.READY if device_class_present else Health.RECONCILING,
            "DeviceClassReady" if device_class_present else "DeviceClassMissing",
            (f"DeviceClass {dc} selects this package's devices" if device_class_present
             else f"DeviceClass {dc} is being created")
            + (f"; {choice.message}" if choice is not None else ""),
            generation,
        )  # fmt: skip
    if (feats := features_condition(platform)) is not None:
        conditions.append(feats.model_copy(update={"observed_generation": generation}))
    if blocking:
        conditions.append(deletion_condition(blocking).model_copy(update={"observed_generation": generation}))
    # Others' conditions of the package (the Kueue queues of sharing mode Kueue).
    conditions += [x.model_copy(update={"observed_generation": generation}) for x in extra]
    return GpuPackageStatus(
        deviceClassName=c.device_class_name(name),
        quotaKey=c.quota_key(name),
        resourceName=resource,
        memoryPerSlice=format_bytes(capacity.memory_per_slice_bytes)
        if capacity.memory_per_slice_bytes
        else None,
        slicesPerGpu=_slices_per_gpu(spec, capacity),
        migProfile=package_profile(spec),
        capacity=capacity_status(capacity),
        entitledNamespaces=entitled_namespaces,
        guarantees=HARDWARE_GUARANTEES if spec.hardware else guarantees_for(spec),
        conditions=stamp(conditions, previous, now),
        observedGeneration=generation,
    )
