"""A GPU card's health: what an XID means for the card, and the DRA device taint that says it.

The XID classes follow NVIDIA's XID catalog ("XID Errors", docs.nvidia.com/deploy/xid-errors) and
what NVIDIA's own Kubernetes components do with them: the device plugin and the DRA driver for
GPUs (`k8s-dra-driver-gpu`, device health) skip the application XIDs 13, 31, 43, 45, 68 and 109
(an application's own fault, the card is fine) and take a card out of service on the others.
gpuslice acts only on the XIDs it knows to be the card's fault:

- fatal for the card (NoExecute: its slices' pods are evicted by kube-controller-manager):
  48 double-bit ECC, 62 internal micro-controller halt, 64 row-remap/retirement failure,
  74 NVLink error, 79 fallen off the bus, 92 high single-bit ECC rate, 94 contained ECC,
  95 uncontained ECC, 119 GSP RPC timeout, 120 GSP error;
- a pending retirement/remap (63, or NVML's pending status without an event): NoSchedule, so
  running work may finish and the card takes nothing new until it is reset;
- application XIDs: counted, nothing else;
- any other XID: counted and logged as unclassified, nothing else (no outage on a guess).

A failed card is healthy again when NVML shows it reset: a lost card answers again, a pending
retirement/remap is gone. A fatal XID that leaves nothing visible in NVML (74, 92, 119, ...) holds
until the agent restarts and finds the card healthy, as NVIDIA's device plugin does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

from gpuslice import constants as c

#: The product's one device taint key (a label name).
TAINT_KEY: Final = f"{c.ANNOTATION_PREFIX}gpu-unhealthy"

FATAL_XIDS: Final = frozenset({48, 62, 64, 74, 79, 92, 94, 95, 119, 120})
PENDING_XIDS: Final = frozenset({63})
APPLICATION_XIDS: Final = frozenset({13, 31, 43, 45, 68, 109})
#: XID 79: the card fell off the bus; NVML answers NVML_ERROR_GPU_IS_LOST for it from then on
XID_LOST: Final = 79

XID_NAMES: Final = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup",
    48: "double-bit ECC error",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remap recorded",
    64: "ECC page retirement or row remap failure",
    68: "video decoder exception",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    109: "context switch timeout",
    119: "GSP RPC timeout",
    120: "GSP error",
}


class XidClass(StrEnum):
    FATAL = "fatal"
    PENDING = "pending"
    APPLICATION = "application"
    UNCLASSIFIED = "unclassified"


def classify(xid: int) -> XidClass:
    if xid in FATAL_XIDS:
        return XidClass.FATAL
    if xid in PENDING_XIDS:
        return XidClass.PENDING
    if xid in APPLICATION_XIDS:
        return XidClass.APPLICATION
    return XidClass.UNCLASSIFIED


def xid_text(xid: int) -> str:
    name = XID_NAMES.get(xid)
    return f"XID {xid} ({name})" if name else f"XID {xid}"


class Condition(StrEnum):
    HEALTHY = "Healthy"
    PENDING_REMAP = "PendingRemap"  # NoSchedule
    FAILED = "Failed"  # NoExecute
    LOST = "Lost"  # NoExecute


@dataclass(frozen=True)
class Probe:
    """What NVML shows of a card now."""

    lost: bool = False
    pending: bool = False  # a page retirement or row remap waits for a reset
    remap_failed: bool = False


@dataclass(frozen=True)
class CardHealth:
    condition: Condition = Condition.HEALTHY
    xid: int | None = None  # the XID that made it so (None: seen by probing)
    since: str | None = None  # RFC 3339, when it became so (the taint's timeAdded)
    #: the failure shows in NVML (lost, pending, remap failure): it is over when NVML shows none
    visible: bool = False

    @property
    def healthy(self) -> bool:
        return self.condition is Condition.HEALTHY


HEALTHY: Final = CardHealth()


def after_xid(h: CardHealth, xid: int, now: str) -> CardHealth:
    """The card's health once XID `xid` was raised on it."""
    cls = classify(xid)
    if cls is XidClass.FATAL:
        if xid == XID_LOST and h.condition is not Condition.LOST:
            return CardHealth(Condition.LOST, xid, h.since if h.condition is Condition.FAILED else now)
        if xid == XID_LOST and h.xid is None:
            # the probe saw the card lost before the event thread delivered its XID: the cause is
            # now known, so the taint names it as when the XID comes first (same since: same eviction)
            return dataclasses.replace(h, xid=xid)
        if h.condition in (Condition.FAILED, Condition.LOST):
            return h  # the first failure stands (its taint's time is when the eviction began)
        return CardHealth(Condition.FAILED, xid, now)
    if cls is XidClass.PENDING and h.condition is Condition.HEALTHY:
        return CardHealth(Condition.PENDING_REMAP, xid, now)
    return h


def after_probe(h: CardHealth, p: Probe, now: str) -> CardHealth:
    """The card's health once NVML showed `p`."""
    failing = h.condition in (Condition.FAILED, Condition.LOST)
    if p.lost:
        if h.condition is Condition.LOST:
            return dataclasses.replace(h, visible=True)
        return CardHealth(Condition.LOST, h.xid if failing else None, h.since if failing else now, True)
    if failing:
        if p.pending or p.remap_failed:
            return dataclasses.replace(h, visible=True)
        if h.visible or h.condition is Condition.LOST:
            return HEALTHY  # it was reset: a lost card answers again, the pending work is done
        return h  # a fatal XID that NVML cannot show: held until the agent restarts
    if p.remap_failed:
        return CardHealth(Condition.FAILED, None, now, True)
    if p.pending:
        if h.condition is Condition.PENDING_REMAP:
            return dataclasses.replace(h, visible=True)
        return CardHealth(Condition.PENDING_REMAP, None, now, True)
    return HEALTHY


def reason(h: CardHealth) -> str:
    """Why the card is out of service, in a few words (also the taint's value, a label value)."""
    if h.xid is not None:
        return f"xid-{h.xid}"
    return {
        Condition.LOST: "gpu-lost",
        Condition.FAILED: "row-remap-failure",
        Condition.PENDING_REMAP: "pending-remap",
        Condition.HEALTHY: "healthy",
    }[h.condition]


def describe(h: CardHealth) -> str:
    """One sentence for Events and logs."""
    what = xid_text(h.xid) if h.xid is not None else {
        Condition.LOST: "the card does not answer (NVML: GPU is lost)",
        Condition.FAILED: "a row remap failed",
        Condition.PENDING_REMAP: "a page retirement or row remap is pending",
        Condition.HEALTHY: "healthy",
    }[h.condition]  # fmt: skip
    effect = {
        Condition.LOST: "lost: its slices' pods are evicted (device taint NoExecute)",
        Condition.FAILED: "failed: its slices' pods are evicted (device taint NoExecute)",
        Condition.PENDING_REMAP: "needs a reset: no new slices, running ones may finish "
        "(device taint NoSchedule)",
        Condition.HEALTHY: "healthy",
    }[h.condition]
    return f"{what}; {effect}" if h.condition is not Condition.HEALTHY else "healthy again"


def taint(h: CardHealth) -> dict[str, Any] | None:
    """The DRA device taint (resource.k8s.io/v1 DeviceTaint) every device of the card carries."""
    if h.healthy:
        return None
    effect = "NoSchedule" if h.condition is Condition.PENDING_REMAP else "NoExecute"
    out: dict[str, Any] = {"key": TAINT_KEY, "value": reason(h), "effect": effect}
    if h.since:
        out["timeAdded"] = h.since
    return out


def tainted_effect(taints: Iterable[Mapping[str, Any]] | None) -> str | None:
    """The strongest effect among a published device's taints (NoExecute > NoSchedule), or None."""
    effects = {t.get("effect") for t in taints or []}
    for effect in ("NoExecute", "NoSchedule"):
        if effect in effects:
            return effect
    return None


#: GpuSlice condition while an allocation's device is tainted (absent while every card is healthy)
SLICE_CONDITION = "GpuHealthy"
REASON_GPU_FAILED = "GpuFailed"
REASON_GPU_PENDING_RESET = "GpuPendingReset"
REASON_GPU_DRAINING = "GpuDraining"


def slice_gpu_condition(
    allocations: Iterable[tuple[str | None, str | None, str | None, str | None]],
    device_taints: Mapping[tuple[str, str], Iterable[Mapping[str, Any]]],
) -> tuple[str, str] | None:
    """(reason, message) of GpuHealthy=False for a slice whose allocated device (pool, device, node,
    card UUID) is tainted, the strongest first; None while no allocation's device is."""
    found: list[tuple[int, str, str]] = []
    for pool, device, node, uuid in allocations:
        if not pool or not device:
            continue
        taints = list(device_taints.get((pool, device), ()))
        effect = tainted_effect(taints)
        if effect is None:
            continue
        ours = next((t for t in taints if t.get("key") == TAINT_KEY), None)
        t = ours or next(t for t in taints if t.get("effect") == effect)
        card = f"GPU {uuid or device} on node {node or pool}"
        since = f" since {t['timeAdded']}" if t.get("timeAdded") else ""
        what = f"{t.get('key')}={t.get('value', '')}:{t.get('effect')}{since}"
        if ours is None:
            reason, rank = REASON_GPU_DRAINING, 2
            text = f"{card} is drained ({what}): no new slices on it"
            if t.get("effect") == "NoExecute":
                text += "; its pods are evicted and a new pod of the slice gets another card"
        elif ours.get("effect") == "NoExecute":
            reason, rank = REASON_GPU_FAILED, 0
            value = str(ours.get("value", ""))
            cause = xid_text(int(value[4:])) if value.startswith("xid-") and value[4:].isdigit() else value
            text = (f"{card} failed: {cause} ({what}); kube-controller-manager evicts the pod using it, "
                    "a new pod of the slice gets a healthy card")  # fmt: skip
        else:
            reason, rank = REASON_GPU_PENDING_RESET, 1
            text = f"{card} waits for a reset ({what}): running work may finish, no new slices on it"
        found.append((rank, reason, text))
    if not found:
        return None
    _, reason, text = min(found)
    return reason, text


def stranded_claims(
    claims: Iterable[Any], device_taints: Mapping[tuple[str, str], Iterable[Mapping[str, Any]]]
) -> list[str]:
    """Names of a direct-form slice's own claims (`views.ClaimView`) allocated on a NoExecute-tainted
    device. kube-controller-manager evicts their pods, but a claim shared by name stays allocated as
    long as some pod reserves it, and a workload's replacement pod reserves it again on the failed
    card: released (deleted, then re-created by the operator) it is allocated afresh on a healthy card.
    """
    out = []
    for claim in claims:
        if not claim.allocated or claim.deleting:
            continue
        if any(tainted_effect(device_taints.get(d, ())) == "NoExecute" for d in claim.devices):
            out.append(claim.name)
    return out
