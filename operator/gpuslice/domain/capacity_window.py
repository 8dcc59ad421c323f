"""When a package's status.capacity is recomputed after what changes it: allocations, releases and
device taints.

A change opens a window for every package it concerns; the package's capacity is recomputed once
when the window closes, with whatever else changed meanwhile. So a burst of claim changes costs one
status write per package per window (and none when the count came out the same, `capacity_behind`),
and the count `kubectl get gpupackages` prints is never older than the window plus one write.
Devices of every package on a card draw from the card's counters, so a claim of one package changes
the free count of the others on that card: a change concerns every package.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

#: Seconds from the first change to the recount that includes it (and every change after it until then).
CAPACITY_WINDOW_SECONDS = 1.0
#: What the README promises: the window, the recount, the write and its watch event, on a busy operator.
CAPACITY_BOUND_SECONDS = 3.0


def open_windows(
    due: Mapping[str, float], packages: Iterable[str], now: float, window: float = CAPACITY_WINDOW_SECONDS
) -> dict[str, float]:
    """The recount deadlines after a change at `now` that concerns `packages`. A package whose window
    is open keeps its deadline: the change joins that recount, so a steady stream of changes still
    gets a recount every `window` instead of being put off until the stream stops."""
    out = dict(due)
    for package in packages:
        out.setdefault(package, now + window)
    return out


def recount_in(due: Mapping[str, float], package: str, now: float) -> float | None:
    """Seconds until `package`'s capacity is to be recounted: 0 when its window has closed, None when
    nothing changed since its last recount."""
    deadline = due.get(package)
    if deadline is None:
        return None
    return max(0.0, deadline - now)
