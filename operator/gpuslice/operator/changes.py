"""Which slices need their status recomputed: marked by every trigger, taken by the package daemons.

Watch events, the recheck timer and the operator's own pod watches only mark a slice here; its
package's daemon (`slices.refresh_changed`) recomputes the marked ones, a bounded number at a time.
Before, every event handler refreshed its slice itself: at 5,000 slices thousands of refreshes (each
holding its facts and status while it waited for a write slot) ran at once, and Kopf indexes an
object's next event only after its handler returns, so the claims index lagged minutes behind and
claims were applied again. A mark costs a set entry, and ten events of one slice cost one refresh.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

#: (namespace, name) of a namespaced object.
Ref = tuple[str, str]


class Changes:
    def __init__(self) -> None:
        #: (namespace, name) that may be a slice whose status needs recomputing.
        self.changed: set[Ref] = set()
        self._listeners: dict[str, asyncio.Event] = {}

    def mark(self, refs: Iterable[Ref]) -> None:
        before = len(self.changed)
        self.changed.update(refs)
        if len(self.changed) == before:
            return  # nothing new: whoever takes them is already woken
        for event in self._listeners.values():
            event.set()

    def listen(self, package: str) -> asyncio.Event:
        return self._listeners.setdefault(package, asyncio.Event())

    def unlisten(self, package: str) -> None:
        self._listeners.pop(package, None)

    def take(self, mine: Callable[[Ref], bool | None]) -> list[Ref]:
        """The changed refs `mine` claims (True), dropping those it says no slice has (None)."""
        out: list[Ref] = []
        for ref in list(self.changed):
            verdict = mine(ref)
            if verdict is None:
                self.changed.discard(ref)
            elif verdict:
                self.changed.discard(ref)
                out.append(ref)
        return out
