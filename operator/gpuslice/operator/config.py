"""Operator settings from the command line."""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator

from gpuslice.api.quantity import parse_int_quantity


class OperatorConfig(BaseModel):
    kubeconfig: str | None = None
    #: Usernames allowed to write gpuslice-owned objects; the operator's own identity (from a
    #: SelfSubjectReview) is always added.
    operator_identities: tuple[str, ...] = ()
    memory_floor: str = "1Gi"
    #: Safety-net resync of every slice's status; changes normally arrive by watch events.
    resync_seconds: float = Field(default=30.0, gt=0)
    #: How often what no watch event announces is re-read (capacity elsewhere, for Pending slices and
    #: package status; DeviceClasses, policies and quotas whose write was refused) and the delay before
    #: Kopf retries a refused write.
    recheck_seconds: float = Field(default=5.0, gt=0)
    #: How long a computed capacity snapshot is reused across status computations.
    capacity_cache_seconds: float = Field(default=1.0, ge=0)
    liveness_endpoint: str | None = None
    standalone: bool = True
    priority: int = 0
    metrics_port: int | None = None

    @field_validator("memory_floor")
    @classmethod
    def _floor(cls, v: str) -> str:
        try:
            parse_int_quantity(v)
        except ValueError as exc:
            raise ValueError(f"--memory-floor {v!r} is not a quantity like 1Gi or 512Mi") from exc
        return v
