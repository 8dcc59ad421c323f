"""Pods' (and pod templates') references to ResourceClaims, as the API server returns them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """One entry of `spec.resourceClaims`: a claim by name, or a template the pod's claim is made from."""

    #: The name containers use in `resources.claims`.
    name: str
    claim: str | None = None
    template: str | None = None


def claim_refs(pod_spec: Mapping[str, Any]) -> list[ClaimRef]:
    out = []
    for ref in pod_spec.get("resourceClaims") or []:
        out.append(
            ClaimRef(
                name=str(ref.get("name", "")),
                claim=ref.get("resourceClaimName") or None,
                template=None
                if ref.get("resourceClaimName")
                else ref.get("resourceClaimTemplateName") or None,
            )
        )
    return out


def generated_claims(pod: Mapping[str, Any]) -> dict[str, str | None]:
    """Pod claim name -> the ResourceClaim kube-controller-manager generated from its template."""
    statuses = (pod.get("status") or {}).get("resourceClaimStatuses") or []
    return {s.get("name"): s.get("resourceClaimName") for s in statuses}


def resolved_claims(pod: Mapping[str, Any]) -> dict[str, str | None]:
    """Pod claim name -> the ResourceClaim it uses (direct, or generated; None until generated)."""
    generated = generated_claims(pod)
    return {
        ref.name: ref.claim if ref.claim else generated.get(ref.name)
        for ref in claim_refs(pod.get("spec") or {})
        if ref.claim or ref.template
    }
