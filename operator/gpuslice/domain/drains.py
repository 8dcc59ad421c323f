"""Maintenance: draining a node or one card with DRA DeviceTaintRules, and what a rule does to the
devices gpuslice counts (`gpuslice drain` / `uncordon` write them; the operator reads them)."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Mapping
from typing import Any, Final

from gpuslice import constants as c
from gpuslice.api.resourceslice import PublishedSlice

#: the taint key of a drain (a DeviceTaintRule's; its value says who/why)
DRAIN_KEY: Final = f"{c.ANNOTATION_PREFIX}drain"
LABEL_DRAIN_NODE: Final = f"{c.ANNOTATION_PREFIX}drain-node"
LABEL_DRAIN_GPU: Final = f"{c.ANNOTATION_PREFIX}drain-gpu"


def drain_rules(
    node: str, devices: Iterable[tuple[str, str]], gpu: str | None, evict: bool, reason: str = "maintenance"
) -> list[dict[str, Any]]:
    """DeviceTaintRules (resource.k8s.io/v1) that drain `node`: the whole pool when `gpu` is None,
    else one rule per device (name, card UUID) of that card, since a rule selects by driver, pool and
    device name only. NoSchedule, or NoExecute with `evict` (kube-controller-manager evicts)."""
    labels = {c.LABEL_MANAGED_BY: c.MANAGED_BY_VALUE, LABEL_DRAIN_NODE: node}
    taint = {"key": DRAIN_KEY, "value": reason, "effect": "NoExecute" if evict else "NoSchedule"}

    def rule(name: str, selector: dict[str, str], extra: dict[str, str]) -> dict[str, Any]:
        return {
            "apiVersion": c.DRA_GROUP_VERSION,
            "kind": "DeviceTaintRule",
            "metadata": {"name": name, "labels": {**labels, **extra}},
            "spec": {"deviceSelector": {"driver": c.DRIVER_NAME, "pool": node, **selector},
                     "taint": dict(taint)},
        }  # fmt: skip

    digest = hashlib.sha256(node.encode()).hexdigest()[:8]
    if gpu is None:
        return [rule(f"gpuslice-drain-{digest}", {}, {})]
    mine = sorted(name for name, uuid in devices if uuid == gpu)
    return [
        rule(f"gpuslice-drain-{digest}-{name}"[:253], {"device": name}, {LABEL_DRAIN_GPU: gpu})
        for name in mine
    ]


def with_rule_taints(
    slices: Iterable[PublishedSlice], rules: Iterable[Mapping[str, Any]]
) -> list[PublishedSlice]:
    """The published slices with each DeviceTaintRule's taint (`spec`) added to the devices its
    selector (driver, pool, device; absent: any) names: a drained card is then unhealthy to capacity
    and to the slices on it like a card the agent tainted."""
    rules = [r for r in rules if (r.get("deviceSelector") or {}).get("driver") in (None, c.DRIVER_NAME)]
    if not rules:
        return list(slices)

    def matches(sel: Mapping[str, Any], pool: str, device: str) -> bool:
        return sel.get("pool") in (None, pool) and sel.get("device") in (None, device)

    out = []
    for s in slices:
        devices = []
        for d in s.devices:
            extra = tuple(
                r["taint"]
                for r in rules
                if r.get("taint") and matches(r.get("deviceSelector") or {}, d.pool, d.name)
            )
            devices.append(dataclasses.replace(d, taints=(*d.taints, *extra)) if extra else d)
        out.append(dataclasses.replace(s, devices=tuple(devices)))
    return out
