"""Work-conserving compute: the share each burst slice of a card may use now.

The node agent sees every slice's utilization on a card; the shim of one slice sees only its own. So
the agent decides, every measurement, and writes each burst slice's allowance into the file its shim
already steers on. The rule is deliberately simple, so the promise is easy to state:

- a neighbour (a slice that does not burst) that runs anything (utilization at or above ACTIVE_PERCENT)
  wants its share: every burst slice of the card is held to its own share;
- otherwise the active burst slices split the whole card in proportion to their shares;
- an idle burst slice is held to its share (it has nothing to run; its neighbours need not wait for
  it to be slowed down once it starts).
"""

from __future__ import annotations

from dataclasses import dataclass

#: utilization (percent of the card) from which a slice counts as running
ACTIVE_PERCENT = 1.0


@dataclass(frozen=True)
class SliceLoad:
    uid: str
    share: int
    burst: bool
    utilization: float | None  # None: not measured (no process yet): idle


def allowances(card: list[SliceLoad]) -> dict[str, float]:
    """The share (percent of the card) each burst slice of one card may use now."""

    def active(s: SliceLoad) -> bool:
        return s.utilization is not None and s.utilization >= ACTIVE_PERCENT

    bursting = [s for s in card if s.burst]
    if any(active(s) for s in card if not s.burst):
        return {s.uid: float(s.share) for s in bursting}
    running = {s.uid for s in bursting if active(s)}
    total = sum(s.share for s in bursting if s.uid in running)
    return {s.uid: (100.0 * s.share / total if s.uid in running else float(s.share)) for s in bursting}
