"""GpuSlice: a tenant's request for one slice of a GpuPackage (namespaced)."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import Field

from gpuslice.api.camel import CamelModel
from gpuslice.api.package import Condition


class GpuSliceSpec(CamelModel):
    package: str = Field(min_length=1)
    #: False: one ResourceClaim named like the slice. True: a ResourceClaimTemplate named like the slice,
    #: so every pod (every Deployment replica) that references it gets its own slice.
    template: bool = False
    #: Set by the operator only, on the slice it makes for a pod that asks for the product in
    #: resources.limits: that pod's name. The pod owns the slice; its claim is kube-scheduler's.
    pod: str | None = None


class Phase(StrEnum):
    PENDING = "Pending"
    ALLOCATED = "Allocated"
    IN_USE = "InUse"
    RELEASED = "Released"
    FAILED = "Failed"
    #: Deleted while pods still use its claim: it stays until they end (`domain.releasing`).
    RELEASING = "Releasing"


class SliceAllocation(CamelModel):
    """Where kube-scheduler put one claim of the slice, read from the claim's status.allocation."""

    claim: str
    node: str | None = None
    gpu_uuid: str | None = Field(default=None, alias="gpuUUID")
    device: str | None = None
    pool: str | None = None
    pod: str | None = None
    #: Every card and DRA device of the claim, in the claim's order (a multi-GPU product holds
    #: several; gpuUUID and device name the first).
    gpu_uuids: list[str] | None = Field(default=None, alias="gpuUUIDs")
    devices: list[str] | None = None


class QuotaUsage(CamelModel):
    used: int
    hard: int
    quota: str


class QueuePosition(CamelModel):
    """Only while Kueue holds the slice's pod (reason Queued): where it waits."""

    workload: str
    local_queue: str = Field(alias="localQueue")
    #: 1: the next the queue admits when quota frees
    position: int
    pending: int


class CapacitySeen(CamelModel):
    """The package's capacity a waiting slice's verdict was made on (AllGpusFull, NoMatchingGpu)."""

    gpus: int
    slices_total: int = Field(alias="slicesTotal")
    slices_free: int = Field(alias="slicesFree")


class ProcessUsageStatus(CamelModel):
    pid: int | None = None
    memory_used_bytes: int | None = Field(default=None, alias="memoryUsedBytes")
    refused_allocations: int | None = Field(default=None, alias="refusedAllocations")


class SoftwareUsage(CamelModel):
    """status.usage.software: what the slice's software could not do on its GPU (the shim's record)."""

    reason: Literal["NoKernelImageForGpu", "PtxTooNewForDriver", "DriverTooOld"]
    process: str | None = None
    pid: int | None = None
    image_architectures: list[str] = Field(default_factory=list, alias="imageArchitectures")
    image_count: int | None = Field(default=None, alias="imageCount")
    cuda_error: int | None = Field(default=None, alias="cudaError")
    gpu_architecture: str | None = Field(default=None, alias="gpuArchitecture")
    driver_cuda_version: str | None = Field(default=None, alias="driverCudaVersion")
    runtime_cuda_version: str | None = Field(default=None, alias="runtimeCudaVersion")
    library: str | None = None
    time: str | None = None


class SliceUsage(CamelModel):
    """status.usage: what the node agent read from the slice's usage region (it alone writes it)."""

    memory_used_bytes: int | None = Field(default=None, alias="memoryUsedBytes")
    memory_limit_bytes: int | None = Field(default=None, alias="memoryLimitBytes")
    compute_share: int | None = Field(default=None, alias="computeShare")
    compute_utilization_percent: float | None = Field(default=None, alias="computeUtilizationPercent")
    refused_allocations: int | None = Field(default=None, alias="refusedAllocations")
    throttled_seconds: float | None = Field(default=None, alias="throttledSeconds")
    processes: list[ProcessUsageStatus] = Field(default_factory=list)
    time: str | None = None
    violation: str | None = None
    software: SoftwareUsage | None = None
    first_gpu_use_time: str | None = Field(default=None, alias="firstGpuUseTime")
    gpu_idle_since: str | None = Field(default=None, alias="gpuIdleSince")


class GpuSliceStatus(CamelModel):
    phase: Phase = Phase.PENDING
    reason: str = ""
    message: str = ""
    claim_name: str | None = Field(default=None, alias="claimName")
    claim_template_name: str | None = Field(default=None, alias="claimTemplateName")
    node: str | None = None
    gpu_uuid: str | None = Field(default=None, alias="gpuUUID")
    device: str | None = None
    #: Cards the (first) allocation holds, and their UUIDs (gpuUUID is the first of them).
    gpus: int | None = None
    gpu_uuids: list[str] | None = Field(default=None, alias="gpuUUIDs")
    allocations: list[SliceAllocation] = Field(default_factory=list)
    quota: QuotaUsage | None = None
    queue: QueuePosition | None = None
    capacity: CapacitySeen | None = None
    conditions: list[Condition] = Field(default_factory=list)
    observed_generation: int | None = Field(default=None, alias="observedGeneration")
    usage: SliceUsage | None = None
    #: While Releasing: the pods that still hold its claim.
    held_by: list[str] | None = Field(default=None, alias="heldBy")
