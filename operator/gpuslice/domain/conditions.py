"""Condition bookkeeping shared by both kinds' status."""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Any

from gpuslice.api.package import Condition


class Health(StrEnum):
    """What GitOps tools read from an object (kstatus): done, still converging, or stuck."""

    READY = "Ready"
    #: Converging on its own (kstatus `Reconciling`, Argo CD `Progressing`).
    RECONCILING = "Reconciling"
    #: Cannot get on without someone acting (kstatus `Stalled`, Argo CD `Degraded`).
    STALLED = "Stalled"


def health_conditions(health: Health, reason: str, message: str, generation: int | None) -> list[Condition]:
    """`Ready` (normal-true) and, when it is False, the one abnormal-true kstatus condition that says
    why: `Reconciling` or `Stalled`. An abnormal condition is left out while it would be False, so
    `Ready=True` is the whole story of a healthy object."""
    ready = health == Health.READY
    out = [
        Condition(
            type="Ready",
            status="True" if ready else "False",
            reason=reason,
            message=message,
            observedGeneration=generation,
        )
    ]
    if not ready:
        out.append(
            Condition(
                type=health.value,
                status="True",
                reason=reason,
                message=message,
                observedGeneration=generation,
            )
        )
    return out


def stamp(conditions: Sequence[Condition], previous: Sequence[Condition], now: str) -> list[Condition]:
    """Keep lastTransitionTime while a condition's status stays the same; `now` when it flips."""
    before = {cd.type: cd for cd in previous}
    out = []
    for cd in conditions:
        old = before.get(cd.type)
        t = old.last_transition_time if old and old.status == cd.status and old.last_transition_time else now
        out.append(cd.model_copy(update={"last_transition_time": t}))
    return out


def same_status(current: dict[str, Any], desired: dict[str, Any]) -> bool:
    """Equal apart from condition timestamps: nothing worth a write."""

    def strip(status: dict[str, Any]) -> dict[str, Any]:
        out = dict(status)
        out["conditions"] = [
            {k: v for k, v in cd.items() if k != "lastTransitionTime"}
            for cd in status.get("conditions") or []
        ]
        return out

    return strip(current) == strip(desired)


def contains(actual: Any, desired: Any) -> bool:
    """True when every field of `desired` has the same value in `actual` (which may hold more: the
    API server's defaults and other managers' fields). Lists must match item by item."""
    if isinstance(desired, dict):
        return isinstance(actual, dict) and all(
            k in actual and contains(actual[k], v) for k, v in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(actual, list)
            and len(actual) == len(desired)
            and all(contains(a, d) for a, d in zip(actual, desired, strict=True))
        )
    return bool(actual == desired)
