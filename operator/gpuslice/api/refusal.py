"""What the API server's refusal messages mean, where gpuslice acts on them."""

from __future__ import annotations

#: kube-apiserver's ResourceQuota admission: `... is forbidden: exceeded quota: <name>, requested: ...`.
QUOTA_EXCEEDED = "exceeded quota"


def is_quota_refusal(message: str | None) -> bool:
    """A create refused because a ResourceQuota of the namespace is used up."""
    return bool(message) and QUOTA_EXCEEDED in (message or "")
