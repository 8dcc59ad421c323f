"""Labels and owner references that mark an object as gpuslice's own."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpuslice import constants as c


def managed_labels(**extra: str) -> dict[str, str]:
    """`app.kubernetes.io/managed-by: gpuslice` plus gpuslice.io/<key> labels (underscores -> dashes)."""
    labels = {c.LABEL_MANAGED_BY: c.MANAGED_BY_VALUE}
    for key, value in extra.items():
        labels[c.LABEL_PREFIX + key.replace("_", "-")] = value
    return labels


def owner_reference(kind: str, name: str, uid: str, *, controller: bool = True) -> dict[str, Any]:
    return {
        "apiVersion": c.GROUP_VERSION,
        "kind": kind,
        "name": name,
        "uid": uid,
        "controller": controller,
        "blockOwnerDeletion": False,
    }


def slice_owner(meta: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The owner reference to a GpuSlice (gpuslice's API group) among an object's, if any: the
    claims and templates gpuslice makes carry exactly one."""
    return next(
        (
            ref
            for ref in meta.get("ownerReferences") or []
            if ref.get("kind") == c.SLICE_KIND and str(ref.get("apiVersion", "")).startswith(c.API_GROUP)
        ),
        None,
    )
