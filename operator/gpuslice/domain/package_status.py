"""GpuPackage status: its DeviceClass, slice size, capacity, guarantees in words, deletion hold."""

from __future__ import annotations

from collections.abc import Sequence

from gpuslice import constants as c
from gpuslice.api.package import Condition, GpuPackageSpec, GpuPackageStatus, Guarantees, PackageCapacity
from gpuslice.domain.capacity import Capacity
from gpuslice.domain.conditions import stamp

GUARANTEES = Guarantees(
    memory="Enforced",
    compute="Cooperative",
    quota="Entitlement",
    summary="memory Enforced (hard limit), compute Cooperative (a share, not a throughput guarantee), "
    "quota Entitlement (not a reservation: when GPUs are full, workloads wait)",
)


def format_bytes(n: int) -> str:
    """Largest binary unit that divides evenly, as Kubernetes writes quantities: 8589934592 -> 8Gi."""
    for suffix, size in (("Ti", 1024**4), ("Gi", c.GIB), ("Mi", c.MIB), ("Ki", 1024)):
        if n and n % size == 0:
            return f"{n // size}{suffix}"
    return str(n)


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
) -> GpuPackageStatus:
    conditions = [
        Condition(
            type="Ready",
            status="True" if device_class_present else "False",
            reason="DeviceClassReady" if device_class_present else "DeviceClassMissing",
            message=f"DeviceClass {c.device_class_name(name)} selects this package's devices"
            if device_class_present
            else f"DeviceClass {c.device_class_name(name)} is being created",
            observedGeneration=generation,
        )
    ]
    if blocking:
        conditions.append(deletion_condition(blocking).model_copy(update={"observed_generation": generation}))
    return GpuPackageStatus(
        deviceClassName=c.device_class_name(name),
        quotaKey=c.quota_key(name),
        memoryPerSlice=format_bytes(capacity.memory_per_slice_bytes)
        if capacity.memory_per_slice_bytes
        else None,
        slicesPerGpu=spec.slices_per_card(),
        capacity=PackageCapacity(
            gpus=capacity.gpus,
            slicesTotal=capacity.total,
            slicesAllocated=capacity.allocated,
            slicesFree=capacity.free,
        ),
        entitledNamespaces=entitled_namespaces,
        guarantees=GUARANTEES,
        conditions=stamp(conditions, previous, now),
        observedGeneration=generation,
    )
