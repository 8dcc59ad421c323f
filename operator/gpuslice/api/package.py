"""GpuPackage: a product cut from GPUs of one model (cluster-scoped)."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import Field, model_validator

from gpuslice import constants as c
from gpuslice.api.camel import CamelModel
from gpuslice.api.quantity import parse_int_quantity
from gpuslice.api.selector import LabelSelector
from gpuslice.api.sharing import Sharing, SharingMode
from gpuslice.api.usage import Price


class Entitlement(CamelModel):
    """How many slices of this package each namespace the selector matches may hold: per namespace, not
    shared by the selector (every selected namespace gets its own ResourceQuota of `slices`)."""

    namespace_selector: LabelSelector = Field(alias="namespaceSelector")
    slices: int = Field(ge=0)


class OnViolation(StrEnum):
    """What the node agent does with a process that holds more GPU memory than its slice."""

    #: Event, status.usage.violation (condition MemoryIsolated=False) and metric only.
    REPORT = "Report"
    #: The same, and SIGKILL for a process attributed with certainty to a slice of this package.
    STOP = "Stop"


class IsolationMode(StrEnum):
    """What keeps one slice from another."""

    #: The shim's memory limit and cooperative compute on a shared card (the slice is a fraction).
    SOFTWARE = "Software"
    #: A MIG instance of the card (spec.migProfile): own memory, SMs and fault domain, kept by the driver.
    HARDWARE = "Hardware"


class Isolation(CamelModel):
    """What isolates a slice, and how the node agent treats processes that bypass the shim."""

    mode: IsolationMode = Field(default=IsolationMode.SOFTWARE)
    on_violation: OnViolation = Field(default=OnViolation.STOP, alias="onViolation")
    #: With mode Hardware, instead of spec.migProfile: the memory one slice must hold ("10Gi"); the
    #: operator maps it to the smallest MIG profile of gpuModel that holds it.
    memory: str | None = Field(default=None, max_length=32)


class Topology(StrEnum):
    """Where the cards of a multi-GPU product must sit relative to each other on their node."""

    #: All cards under one PCIe root complex (DRA attribute `resource.kubernetes.io/pcieRoot`).
    SAME_PCIE_ROOT = "SamePcieRoot"
    #: All cards attached to one NUMA node (attribute `numaNode`).
    SAME_NUMA_NODE = "SameNumaNode"
    #: Any cards of the node.
    ANY = "Any"


class GpuPackageSpec(CamelModel):
    display_name: str | None = Field(default=None, alias="displayName")
    gpu_model: str = Field(alias="gpuModel", min_length=1)
    #: Required unless `gpus` is set (the CRD's CEL and `_whole_cards` say so); 100 for whole cards.
    fraction: int = Field(default=100, ge=1, le=100, description="percent of one card")
    #: Whole cards one product holds (on one node); None: one slice of one card (`fraction`).
    gpus: Literal[2, 4, 8] | None = None
    topology: Topology = Topology.ANY
    compute_share: int | None = Field(default=None, alias="computeShare", ge=1, le=100)
    #: Work-conserving compute: a slice may use idle compute of its card above its share and is held
    #: back to its share within 2 s once a neighbour runs (gpuslice.domain.burst).
    compute_burst: bool = Field(default=False, alias="computeBurst")
    entitlements: list[Entitlement] = Field(default_factory=list)
    isolation: Isolation = Field(default_factory=Isolation)
    #: What a slice costs per hour held; the metering ledger records it per interval.
    price: Price | None = None
    #: The extended resource a container asks for in `resources.limits` (DeviceClass
    #: `extendedResourceName`): None means `gpuslice.io/<package>`, "" means none.
    extended_resource_name: str | None = Field(default=None, alias="extendedResourceName")
    # --- sharing (gpuslice.api.sharing): entitlements lent through Kueue, opt-in ---
    sharing: Sharing = Field(default_factory=Sharing)
    #: The MIG GPU instance profile one slice is (isolation.mode Hardware only), e.g. "1g.10gb".
    mig_profile: str | None = Field(default=None, alias="migProfile", min_length=1, max_length=32)

    @model_validator(mode="after")
    def _mig_profile_with_hardware_only(self) -> GpuPackageSpec:
        # The CRD's CEL says the same to the user; this keeps a spec built in code just as honest.
        sized = self.isolation.memory is not None
        if self.hardware != (self.mig_profile is not None or sized):
            raise ValueError(
                "migProfile or isolation.memory is required with isolation.mode Hardware and both are "
                "forbidden otherwise"
            )
        if self.mig_profile is not None and sized:
            raise ValueError("name migProfile or isolation.memory, not both")
        if sized:
            parse_int_quantity(str(self.isolation.memory))  # a whole quantity, as the CRD checks
        if self.hardware and self.fraction != 100:
            raise ValueError("isolation.mode Hardware: fraction must be 100 (a slice is one MIG instance)")
        return self

    @model_validator(mode="after")
    def _borrowed_price_with_kueue_only(self) -> GpuPackageSpec:
        # As the CRD's CEL: without Kueue nothing is borrowed, so a borrowed price would bill nothing.
        if (
            self.price is not None
            and self.price.borrowed_per_hour is not None
            and self.sharing.mode is not SharingMode.KUEUE
        ):
            raise ValueError("price.borrowedPerHour applies to sharing.mode Kueue only")
        return self

    @property
    def hardware(self) -> bool:
        return self.isolation.mode == IsolationMode.HARDWARE

    @model_validator(mode="before")
    @classmethod
    def _whole_cards(cls, data: object) -> object:
        # A multi-GPU product is whole cards: fraction may be left out (it is 100) or say 100.
        if isinstance(data, dict) and data.get("gpus") is None and data.get("fraction") is None:
            raise ValueError("fraction is required (percent of one card) unless gpus is set (whole cards)")
        return data

    @model_validator(mode="after")
    def _whole_cards_only(self) -> GpuPackageSpec:
        if self.gpus is not None and self.fraction != 100:
            raise ValueError(f"gpus: {self.gpus} sells whole cards: fraction must be 100 or absent")
        return self

    @property
    def cards_per_product(self) -> int:
        """Cards one product (a GpuSlice) holds: 1 for a slice, `gpus` for a multi-GPU product."""
        return self.gpus or 1

    def extended_resource(self, package: str) -> str | None:
        """The product's extended resource name, or None when the package turns it off. A multi-GPU
        product has none: kube-scheduler's claim for `resources.limits` is for one device."""
        if self.gpus is not None:
            return None
        if self.extended_resource_name is None:
            return c.extended_resource_name(package)
        return self.extended_resource_name or None

    @property
    def effective_compute_share(self) -> int:
        return self.compute_share if self.compute_share is not None else self.fraction

    def memory_bytes(self, card_memory_bytes: int) -> int:
        """Memory of one slice on a card of the given size: fraction x card memory, rounded down to MiB."""
        mib = 1024 * 1024
        return (card_memory_bytes * self.fraction // 100) // mib * mib

    def slices_per_card(self) -> int:
        return 100 // self.fraction


class Condition(CamelModel):
    """A Kubernetes-style condition (metav1.Condition fields)."""

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str = ""
    last_transition_time: str | None = Field(default=None, alias="lastTransitionTime")
    observed_generation: int | None = Field(default=None, alias="observedGeneration")


class PackageCapacity(CamelModel):
    """Capacity of a package right now, counted from ResourceSlices and allocated ResourceClaims."""

    gpus: int = 0
    slices_total: int = Field(default=0, alias="slicesTotal")
    slices_allocated: int = Field(default=0, alias="slicesAllocated")
    slices_free: int = Field(default=0, alias="slicesFree")
    #: cards whose devices are tainted (domain.health): not in gpus, slicesTotal or slicesFree
    unhealthy_gpus: int | None = Field(default=None, alias="unhealthyGpus")  # None: none
    #: multi-GPU packages only: whole products (gpus free cards, topology kept) placeable now
    products_free: int | None = Field(default=None, alias="productsFree")


class Guarantees(CamelModel):
    memory: str = "Enforced"
    compute: str = "Cooperative"
    quota: str = "Entitlement"
    summary: str = ""


class GpuPackageStatus(CamelModel):
    device_class_name: str | None = Field(default=None, alias="deviceClassName")
    quota_key: str | None = Field(default=None, alias="quotaKey")
    #: What a container writes in resources.limits for one slice; None when the package turns it off.
    resource_name: str | None = Field(default=None, alias="resourceName")
    memory_per_slice: str | None = Field(default=None, alias="memoryPerSlice")
    #: The MIG profile one slice is (Hardware): spec.migProfile, or what spec.isolation.memory maps to.
    mig_profile: str | None = Field(default=None, alias="migProfile")
    slices_per_gpu: int | None = Field(default=None, alias="slicesPerGpu")
    capacity: PackageCapacity | None = None
    entitled_namespaces: int | None = Field(default=None, alias="entitledNamespaces")
    guarantees: Guarantees | None = None
    conditions: list[Condition] = Field(default_factory=list)
    observed_generation: int | None = Field(default=None, alias="observedGeneration")
