"""Isolation decisions that are not CEL: the Pod Security level of a tenant namespace, and the GPU
node taint.

- Every tenant namespace gets Pod Security Admission labels at the configured level (baseline or
  restricted), never weaker than what the namespace already enforces, so the operator can only
  tighten a namespace, not loosen it.
- Every GPU node (the `--gpu-node-label`) carries the taint `gpuslice.io/gpu=present:NoExecute`:
  pods that do not tolerate it are neither scheduled there nor kept there (NoExecute evicts pods
  bound by spec.nodeName too); admission lets only gpuslice claim pods of tenant namespaces and pods
  of exempt platform namespaces tolerate it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpuslice import constants as c


def stronger_level(a: str, b: str) -> str:
    """The stricter of two Pod Security levels; an unknown level counts as none."""
    rank = {level: i for i, level in enumerate(c.PSA_LEVELS)}
    return a if rank.get(a, -1) >= rank.get(b, -1) else b


def pod_security_labels(current: Mapping[str, str], level: str) -> dict[str, str]:
    """The Pod Security labels a tenant namespace gets: enforce (and warn, audit) at `level` or the
    stricter level it already enforces, against the newest policy version."""
    if level not in c.PSA_LEVELS[1:]:
        raise ValueError(f"Pod Security level {level!r}: a tenant namespace is baseline or restricted")
    enforce = stronger_level(current.get(c.PSA_ENFORCE, ""), level)
    return {
        c.PSA_ENFORCE: enforce,
        c.PSA_ENFORCE_VERSION: "latest",
        c.PSA_WARN: enforce,
        c.PSA_AUDIT: enforce,
    }


def gpu_taint() -> dict[str, str]:
    return {"key": c.TAINT_GPU_KEY, "value": c.TAINT_GPU_VALUE, "effect": c.TAINT_GPU_EFFECT}


def is_gpu_node(labels: Mapping[str, str], gpu_node_label: str) -> bool:
    if not gpu_node_label:
        return False
    key, _, value = gpu_node_label.partition("=")
    return labels.get(key) == value


def taint_patch(
    labels: Mapping[str, str],
    taints: Sequence[Mapping[str, Any]] | None,
    gpu_node_label: str,
    resource_version: str,
) -> list[dict[str, Any]] | None:
    """The JSON patch that adds the GPU taint to a GPU node lacking it; None when nothing to do.

    An append, not a replacement of the list: other taints stay, and two racing appends cannot both
    succeed (the API server refuses a second taint with the same key and effect). A node seen with
    no taints gets the list itself, which would replace whatever was added since (node-lifecycle's
    not-ready taint on a new node): only if the node is still the version seen (`resource_version`).
    """
    if not is_gpu_node(labels, gpu_node_label):
        return None
    want = gpu_taint()
    if any(t.get("key") == want["key"] and t.get("effect") == want["effect"] for t in taints or ()):
        return None
    if not taints:
        return [
            {"op": "test", "path": "/metadata/resourceVersion", "value": resource_version},
            {"op": "add", "path": "/spec/taints", "value": [want]},
        ]
    return [{"op": "add", "path": "/spec/taints/-", "value": want}]
