"""What the metering ledger keeps between handler calls (part of the operator's memo)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import datetime

from gpuslice.api.usage import GpuUsage, Price
from gpuslice.domain.ledger import Interval, Ledger, Reading


@dataclass
class Metering:
    #: namespace -> month -> its ledger, as this process last wrote it (loaded from the API once).
    books: dict[str, dict[str, Ledger]] = field(default_factory=dict)
    #: namespace -> its GpuUsage objects of months not final, as read when this process took over,
    #: until the namespace is loaded into `books`; None: not read yet.
    preloaded: dict[str, list[GpuUsage]] | None = None
    #: (namespace, object name) -> digest of the fields last written (or read): only a difference is.
    written: dict[tuple[str, str], str] = field(default_factory=dict)
    #: Namespaces whose claims changed since their last reconcile.
    dirty: set[str] = field(default_factory=set)
    #: (namespace, month) whose usage numbers changed: written with the next write or checkpoint.
    stats_dirty: set[tuple[str, str]] = field(default_factory=set)
    #: claim uid -> when a deleted claim stopped counting (its deletionTimestamp, or when its
    #: deletion was seen), until the interval it closes is written.
    released: dict[str, datetime] = field(default_factory=dict)
    #: claim uids this process reconciled as allocated: when one shows no allocation any more, this
    #: process saw the deallocation happen (the claim itself keeps no time of it).
    seen_allocated: set[str] = field(default_factory=set)
    #: (namespace, slice) -> the node agent's readings not folded into the ledger yet, summed into
    #: one interval-shaped accumulator (`domain.ledger.merge`), and the last reading (the mean
    #: utilization is weighted by the time until the next one).
    pending: dict[tuple[str, str], Interval] = field(default_factory=dict)
    last_reading: dict[tuple[str, str], Reading] = field(default_factory=dict)
    #: package -> the price this process last saw (a change splits open intervals).
    prices: dict[str, Price | None] = field(default_factory=dict)
    #: package -> the cards one of its products takes, for card-seconds.
    cards: dict[str, float] = field(default_factory=dict)
    #: namespace -> label values of its gpuslice_slice_allocated series.
    exported: dict[str, set[tuple[str, ...]]] = field(default_factory=dict)
    #: monotonic time of the last checkpoint (confirmedAt of every open month); None: none yet.
    checkpointed: float | None = None
    #: The heartbeat Lease's renewTime as this process found it when it took over: until then a
    #: previous operator saw every open interval held.
    heartbeat_at: datetime | None = None
    heartbeat_read: bool = False
    #: monotonic time this process last renewed the heartbeat.
    heartbeat_sent: float | None = None
    #: namespace -> monotonic time before which a refused write is not tried again.
    retry_at: dict[str, float] = field(default_factory=dict)
    #: namespace -> monotonic time until which its Kueue borrowed count is read again every flush.
    borrow_recheck: dict[str, float] = field(default_factory=dict)
    #: (namespace, package): when Kueue's borrowed count was first read below the marked intervals
    borrow_low_since: dict[tuple[str, str], datetime] = field(default_factory=dict)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)

    def mark(self, namespace: str) -> None:
        if namespace not in self.dirty:
            self.dirty.add(namespace)
            self.wakeup.set()
