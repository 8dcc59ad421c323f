"""Which slices need their status recomputed: marked by every trigger, taken by the package daemons.

Watch events, the recheck timer and the operator's own pod watches only mark a slice here; its
package's daemon (`slices.refresh_changed`) recomputes the marked ones, a bounded number at a time.
Handlers do not refresh themselves because Kopf indexes an object's next event only after its
handler returns: handlers that wait for writes make the indexes lag behind a burst (and a lagging
claims index applies claims again; bench/operator_scale.py). A mark costs a set entry, and ten
events of one slice cost one refresh.

Marks whose package is known wake only that package's daemon. The pod watches know a claim, not its
package: those are kept unrouted, and the first daemon that runs routes them all, so no daemon
scans what belongs to the others.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

#: (namespace, name) of a namespaced object.
Ref = tuple[str, str]


class Changes:
    def __init__(self) -> None:
        #: (namespace, name) that may be a slice whose status needs recomputing; package not known yet.
        self.unrouted: set[Ref] = set()
        #: package -> its marked slices.
        self.routed: dict[str, set[Ref]] = {}
        self._listeners: dict[str, asyncio.Event] = {}

    def mark(self, refs: Iterable[Ref], package: str | None = None) -> None:
        """Mark `refs` (slices of `package`, or of a package not known here)."""
        into = self.unrouted if package is None else self.routed.setdefault(package, set())
        before = len(into)
        into.update(refs)
        if len(into) == before:
            return  # nothing new: whoever takes them is already woken
        if package is None:
            for event in self._listeners.values():
                event.set()
        elif package in self._listeners:
            self._listeners[package].set()
        # No listener: the package's daemon takes them when it starts (it begins with a take).

    def listen(self, package: str) -> asyncio.Event:
        return self._listeners.setdefault(package, asyncio.Event())

    def unlisten(self, package: str) -> None:
        self._listeners.pop(package, None)

    def take(self, package: str, package_of: Callable[[Ref], str | None]) -> list[Ref]:
        """`package`'s marked slices; routes the unrouted ones first (`package_of`: the package of the
        slice, None when there is no such slice, which drops the mark)."""
        if self.unrouted:
            refs, self.unrouted = self.unrouted, set()
            for ref in refs:
                owner = package_of(ref)
                if owner is not None and owner != package:
                    self.mark([ref], owner)
                elif owner == package:
                    self.routed.setdefault(package, set()).add(ref)
        return sorted(self.routed.pop(package, ()))
