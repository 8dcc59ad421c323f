"""GpuPackage `spec.sharing`: how a package's entitlements are shared between tenants."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field, model_validator

from gpuslice.api.camel import CamelModel
from gpuslice.api.selector import LabelSelector


class SharingMode(StrEnum):
    #: Each entitlement is a hard ResourceQuota: idle slices stay idle (the default).
    QUOTA = "Quota"
    #: Kueue governs: each entitled namespace gets a ClusterQueue in the package's cohort whose
    #: nominal quota is its entitlement; idle quota is lent within the cohort and reclaimed by
    #: preemption when its owner asks for it.
    KUEUE = "Kueue"


class ShareWeight(CamelModel):
    """Kueue's fair-sharing weight of the namespaces a selector matches: when borrowers compete for
    the cohort's idle slices, each gets a share of them in proportion to its weight (Kueue compares
    borrowed slices / weight; 0: only what nobody else wants)."""

    namespace_selector: LabelSelector = Field(alias="namespaceSelector")
    weight: float = Field(ge=0, le=1000)

    @model_validator(mode="after")
    def _kueue_bound(self) -> ShareWeight:
        # Kueue refuses a weight in (0, 1e-9]; a thousandth is the finest it is given here.
        if 0 < self.weight < 0.001:
            raise ValueError("a weight is 0 or at least 0.001")
        return self


class Sharing(CamelModel):
    mode: SharingMode = SharingMode.QUOTA
    #: The Kueue cohort of the package's ClusterQueues (default: gpuslice-<package>).
    cohort: str | None = Field(default=None, min_length=1, max_length=63)
    #: Slices of its entitlement a namespace may lend out at most (None: all of them).
    lending_limit: int | None = Field(default=None, alias="lendingLimit", ge=0)
    #: Slices a namespace may borrow beyond its entitlement at most; required in mode Kueue: the
    #: namespace's ResourceQuota is its entitlement plus this, the ceiling a pod that bypasses
    #: Kueue (no queue-name label) cannot pass either.
    borrowing_limit: int | None = Field(default=None, alias="borrowingLimit", ge=0)
    #: Fair-sharing weights (Kueue's ClusterQueue `fairSharing.weight`); a namespace no selector
    #: matches weighs 1, Kueue's default; where several match, the largest applies.
    weights: list[ShareWeight] = Field(default_factory=list, max_length=64)

    @model_validator(mode="after")
    def _kueue_fields_need_kueue(self) -> Sharing:
        if self.mode is SharingMode.QUOTA and (
            self.cohort is not None or self.lending_limit is not None or self.borrowing_limit is not None
        ):
            raise ValueError("cohort, lendingLimit and borrowingLimit apply to mode Kueue only")
        if self.mode is SharingMode.QUOTA and self.weights:
            raise ValueError("weights apply to mode Kueue only")
        if self.mode is SharingMode.KUEUE and self.borrowing_limit is None:
            raise ValueError("mode Kueue needs borrowingLimit (0: lend, never borrow)")
        return self
