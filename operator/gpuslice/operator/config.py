"""Operator settings from the command line."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from gpuslice import constants as c
from gpuslice.api.quantity import parse_int_quantity


class OperatorConfig(BaseModel):
    kubeconfig: str | None = None
    #: Usernames allowed to write gpuslice-owned objects; the operator's own identity (from a
    #: SelfSubjectReview) is always added.
    operator_identities: tuple[str, ...] = ()
    memory_floor: str = "1Gi"
    #: Pod Security level enforced on every tenant namespace; never weaker than baseline.
    pod_security: Literal["baseline", "restricted"] = "baseline"
    #: Platform namespaces whose pods may tolerate the GPU node taint; the operator's own namespace is
    #: added at start-up (from its service account).
    exempt_namespaces: tuple[str, ...] = ("kube-system",)
    #: GpuSlice objects a tenant namespace may hold, whatever its entitlements (quota gpuslice-objects).
    max_slices_per_namespace: int = Field(default=c.DEFAULT_MAX_SLICES_PER_NAMESPACE, ge=1)
    #: PriorityClasses a pod in a tenant namespace may name (besides none); see domain.tenant_pods.
    tenant_priority_classes: tuple[str, ...] = ()
    #: `key=value` of the label that marks GPU nodes; the operator taints them. Empty: no tainting.
    gpu_node_label: str = c.GPU_NODE_LABEL
    #: Safety-net resync of every slice's status; changes normally arrive by watch events.
    resync_seconds: float = Field(default=30.0, gt=0)
    #: How often what no watch event announces is re-read (capacity elsewhere, for Pending slices and
    #: package status; DeviceClasses, policies and quotas whose write was refused) and the delay before
    #: Kopf retries a refused write.
    recheck_seconds: float = Field(default=5.0, gt=0)
    #: How long a computed capacity snapshot is reused across status computations.
    capacity_cache_seconds: float = Field(default=1.0, ge=0)
    #: Seconds a replica's peering record counts as alive without a keep-alive: how long a standby
    #: waits for a replica that died without saying goodbye (Kopf's default is 60).
    peering_lifetime: int = Field(default=10, ge=2)
    #: How often each GpuUsage object with open intervals is rewritten (its `confirmedAt` and totals).
    ledger_checkpoint_seconds: float = Field(default=900.0, gt=0)
    #: How often, while slices are held, the ledger's heartbeat (Lease `gpuslice-ledger`) says that
    #: every open interval was still held: a claim released while no operator ran is closed there.
    ledger_heartbeat_seconds: float = Field(default=10.0, gt=0)
    #: Namespace of that Lease: the operator's own (from its service account), else `default`.
    ledger_namespace: str = "default"
    liveness_endpoint: str | None = None
    standalone: bool = True
    priority: int = 0
    metrics_port: int | None = None
    #: PEM serving certificate and key: the metrics port speaks only HTTPS (metrics_auth).
    metrics_tls_cert_file: Path | None = None
    metrics_tls_private_key_file: Path | None = None

    @field_validator("memory_floor")
    @classmethod
    def _floor(cls, v: str) -> str:
        try:
            parse_int_quantity(v)
        except ValueError as exc:
            raise ValueError(f"--memory-floor {v!r} is not a quantity like 1Gi or 512Mi") from exc
        return v

    @field_validator("gpu_node_label")
    @classmethod
    def _node_label(cls, v: str) -> str:
        if v and ("=" not in v or not v.split("=", 1)[0]):
            raise ValueError(f"--gpu-node-label {v!r} is not key=value, like {c.GPU_NODE_LABEL}")
        return v
