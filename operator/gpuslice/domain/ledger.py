"""The metering ledger's bookkeeping: which intervals a namespace's month holds, their totals and costs,
and what real usage says about a slice's size. Pure: the operator passes what the API shows and the
time; nothing here reads a clock or the cluster.

An interval is one slice held without a break, in one month, at one price. It opens at its claim's
allocation (the time kube-scheduler's status write carries in the claim's managedFields), so an
operator that starts late still bills from the allocation; it closes at the deallocation (the time of
the status write that removed it), the deletion (deletionTimestamp), the month's end (a continuation
opens in the next month) or a price change (a continuation at the new price opens). A month is made
final once it has ended and every interval in it is closed: a final month is never written again.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from gpuslice.api.usage import (
    MAX_OBJECT_BYTES,
    SHARD_MAX_INTERVALS,
    GpuUsage,
    PackageTotals,
    Price,
    UsageInterval,
    object_name,
)
from gpuslice.timefmt import parse_rfc3339, rfc3339

#: A month is made final this long after it ended: a claim allocated in its last seconds may reach
#: the operator's watch a moment later and must still be recorded in it.
FINAL_GRACE = timedelta(minutes=5)


class LedgerFull(Exception):
    """An object would pass the size etcd accepts: refused loudly, never truncated."""


def month_of(t: datetime) -> str:
    if t.tzinfo is not UTC:
        t = t.astimezone(UTC)
    return f"{t.year:04d}-{t.month:02d}"


@functools.lru_cache(maxsize=256)
def month_start(month: str) -> datetime:
    year, _, mon = month.partition("-")
    if len(year) != 4 or len(mon) != 2 or not (year + mon).isdigit():
        raise ValueError(f"month {month!r} is not YYYY-MM")
    return datetime(int(year), int(mon), 1, tzinfo=UTC)


@functools.lru_cache(maxsize=256)
def month_end(month: str) -> datetime:
    """The first instant of the next month."""
    start = month_start(month)
    return datetime(start.year + start.month // 12, start.month % 12 + 1, 1, tzinfo=UTC)


def months_between(first: datetime, last: datetime) -> list[str]:
    """Every month from `first`'s to `last`'s, in order."""
    out, month = [], month_of(first)
    while month <= month_of(last):
        out.append(month)
        month = month_of(month_end(month))
    return out


@dataclass(frozen=True, slots=True)
class Holding:
    """An allocated gpuslice claim as the API shows it now."""

    namespace: str
    package: str
    slice: str
    claim: str
    claim_uid: str
    pod: str
    node: str
    gpu: str
    allocated_at: datetime
    #: When its deletion was requested, if it was: the slice counts until then.
    ended_at: datetime | None = None
    #: One of a template GpuSlice's per-pod claims (the agent reports their usage in metrics only).
    template: bool = False
    #: Cards the product takes from the fleet (`domain.multigpu.cards_held`: 2 for a 2-card
    #: product, 0.25 for a 25 % slice); None: its package is not known.
    cards: float | None = None
    #: Every card of a claim of several (a multi-GPU product), in the claim's order; None for a
    #: claim of one card (`gpu` names it), so a slice's interval is written as it always was.
    gpus: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class Reading:
    """One node-agent reading of a slice's real usage (its status.usage)."""

    at: datetime
    memory_used_bytes: int
    memory_limit_bytes: int
    utilization_percent: float | None
    refused_allocations: int


@dataclass(slots=True)
class Interval:
    package: str
    slice: str
    claim: str
    claim_uid: str
    pod: str
    node: str
    gpu: str
    start: datetime
    end: datetime | None = None
    price: Price | None = None
    template: bool = False
    peak_memory_bytes: int = 0
    memory_limit_bytes: int = 0
    mean_utilization_percent: float = 0.0
    observed_seconds: int = 0
    refused_allocations: int = 0
    #: Held above its namespace's entitlement, on quota Kueue lent from the cohort (its ClusterQueue's
    #: status says how many of the namespace's slices are borrowed): priced apart.
    borrowed: bool = False
    #: Which object of the month holds it (see `api.usage.SHARD_MAX_INTERVALS`).
    shard: int = 0
    #: Cards held (`Holding.cards`); None: written before card-seconds were kept, package unknown.
    cards: float | None = None
    #: Every card of a multi-GPU product (`Holding.gpus`); None: a claim of one card.
    gpus: list[str] | None = None

    def seconds(self, until: datetime) -> int:
        """Seconds held; an open interval counts up to `until`."""
        end = self.end if self.end is not None else until
        return max(0, int((end - self.start).total_seconds()))

    def card_seconds(self, until: datetime) -> float | None:
        """Seconds held times the cards held (to a thousandth); None when the cards are not known."""
        if self.cards is None:
            return None
        return round(self.seconds(until) * self.cards, 3)

    def cost(self, until: datetime) -> Decimal | None:
        if self.price is None:
            return None
        return Decimal(self.price.rate(self.borrowed)) * self.seconds(until) / 3600


@dataclass
class Ledger:
    """One namespace's month, every shard of it."""

    namespace: str
    month: str
    intervals: list[Interval] = field(default_factory=list)
    final: bool = False
    confirmed_at: datetime | None = None

    @property
    def end(self) -> datetime:
        return month_end(self.month)

    def open_intervals(self) -> list[Interval]:
        return [iv for iv in self.intervals if iv.end is None]

    def append(self, interval: Interval) -> None:
        # Shards fill in order, each to SHARD_MAX_INTERVALS before the next begins.
        last = self.intervals[-1].shard if self.intervals else 0
        count = len(self.intervals) - last * SHARD_MAX_INTERVALS
        interval.shard = last + 1 if count >= SHARD_MAX_INTERVALS else last
        self.intervals.append(interval)


def _same_price(a: Price | None, b: Price | None) -> bool:
    if a is None or b is None:
        return a is b
    if a.borrowed_per_hour is None or b.borrowed_per_hour is None:
        same_borrowed = a.borrowed_per_hour is b.borrowed_per_hour
    else:
        same_borrowed = Decimal(a.borrowed_per_hour) == Decimal(b.borrowed_per_hour)
    return Decimal(a.per_hour) == Decimal(b.per_hour) and a.currency == b.currency and same_borrowed


#: What names an interval's slice: copied alike from a holding into its intervals.
_WHO = ("package", "slice", "claim", "claim_uid", "pod", "node", "gpu", "template", "cards")
#: What an interval and its wire form hold alike, the slice's names and the usage readings recorded
#: (`UsageInterval` takes these Python names as well as its camelCase ones).
_CARRIED = (
    *_WHO,
    "gpus",
    "peak_memory_bytes",
    "memory_limit_bytes",
    "mean_utilization_percent",
    "observed_seconds",
    "refused_allocations",
)


def _fields(source: object, names: tuple[str, ...]) -> dict[str, Any]:
    return {name: getattr(source, name) for name in names}


def _open(holding: Holding, start: datetime, price: Price | None) -> Interval:
    gpus = list(holding.gpus) if holding.gpus else None
    return Interval(**_fields(holding, _WHO), gpus=gpus, start=start, price=price)


def _continuation(interval: Interval, start: datetime, end: datetime | None, price: Price | None) -> Interval:
    """The interval going on from `start`: same claim, its own readings from then on. The refused
    count is the claim's running total (the agent's counter), so it goes on; so does the limit."""
    return dataclasses.replace(
        interval,
        start=start,
        end=end,
        price=price,
        peak_memory_bytes=0,
        mean_utilization_percent=0.0,
        observed_seconds=0,
    )


def _close(interval: Interval, at: datetime, ledger: Ledger) -> None:
    interval.end = min(max(at, interval.start), ledger.end)


def reconcile(
    ledgers: dict[str, Ledger],
    namespace: str,
    holdings: Iterable[Holding],
    released: Mapping[str, datetime],
    prices: Mapping[str, Price | None],
    now: datetime,
    seen_until: datetime | None = None,
) -> set[str]:
    """Bring a namespace's months in line with what the API shows at `now`; returns the months changed.

    `holdings`: the namespace's allocated claims. `released`: claim uid -> when its slice stopped
    counting (deleted) for claims no longer allocated, as far as anyone saw it. An open interval whose
    claim is in neither was released while no operator watched, and a deallocated claim keeps no
    time: it is closed at the last moment an operator saw it held, its month's `confirmed_at` or
    `seen_until` (the operator's heartbeat), whichever is later. `prices`: each package's price now,
    for intervals that open now (a change of price for open ones is `reprice`'s).
    """
    changed: set[str] = set()
    # By claim uid, per month: a burst of thousands of holdings must not scan every interval each.
    claims: dict[str, dict[str, list[Interval]]] = {}
    open_starts: dict[str, list[datetime]] = {}
    for month, book in ledgers.items():
        index = claims.setdefault(month, {})
        for iv in book.intervals:
            index.setdefault(iv.claim_uid, []).append(iv)
            if iv.end is None and not book.final:
                open_starts.setdefault(iv.claim_uid, []).append(iv.start)
    held = [_continuing(open_starts, h) for h in holdings]
    by_uid: dict[str, list[Holding]] = {}
    for h in held:
        by_uid.setdefault(h.claim_uid, []).append(h)
    for h in held:
        last = min(h.ended_at or now, now)
        for month in months_between(h.allocated_at, last):
            start = max(h.allocated_at, month_start(month))
            if start > h.allocated_at and last <= start:
                continue  # it ended exactly at this month's start
            ledger = ledgers.get(month)
            if ledger is None:
                ledger = ledgers[month] = Ledger(namespace, month)
            if ledger.final:
                continue  # never rewritten
            index = claims.setdefault(month, {})
            mine = [iv for iv in index.get(h.claim_uid, ()) if iv.start >= start]
            if not mine:
                ledger.append(_open(h, start, prices.get(h.package)))
                mine = [ledger.intervals[-1]]
                index.setdefault(h.claim_uid, []).append(mine[0])
                changed.add(month)
            stop = h.ended_at if h.ended_at is not None else None
            if ledger.end <= now and (stop is None or stop > ledger.end):
                stop = ledger.end
            for iv in mine:
                if iv.end is None and stop is not None:
                    _close(iv, stop, ledger)
                    changed.add(month)
    for month, ledger in sorted(ledgers.items()):
        if ledger.final:
            continue
        for iv in ledger.open_intervals():
            owners = [h for h in by_uid.get(iv.claim_uid, ()) if h.allocated_at <= iv.start]
            if owners:
                continue
            # Not held any more (or held again by a later allocation, which has its own interval).
            later = [h.allocated_at for h in by_uid.get(iv.claim_uid, ()) if h.allocated_at > iv.start]
            seen = max((x for x in (ledger.confirmed_at, seen_until) if x is not None), default=None)
            at = released.get(iv.claim_uid) or (min(later) if later else None) or seen
            _close(iv, at or iv.start, ledger)
            changed.add(month)
            if at is not None and at > ledger.end:
                changed |= _carry(ledgers, namespace, iv, at)
    # (After the closing: a continuation `_carry` made in a later month is looked at too.)
    for month, ledger in ledgers.items():
        if not ledger.final and ledger.end + FINAL_GRACE <= now and not ledger.open_intervals():
            ledger.final = True
            changed.add(month)
    return changed


def _continuing(open_starts: Mapping[str, list[datetime]], holding: Holding) -> Holding:
    """The holding as its open interval began, if it has one that began earlier: kube-scheduler's
    status write (whose time is the allocation's) moves on when it reserves a shared claim for
    another pod, and that must not cut the interval in two."""
    starts = [t for t in open_starts.get(holding.claim_uid, ()) if t < holding.allocated_at]
    return dataclasses.replace(holding, allocated_at=min(starts)) if starts else holding


def _carry(ledgers: dict[str, Ledger], namespace: str, interval: Interval, until: datetime) -> set[str]:
    """An interval that was open at its month's end and whose slice was released at `until`, in a
    later month (the operator did not run at the month's end): its continuations up to `until`."""
    changed = set()
    for month in months_between(month_end(month_of(interval.start)), until):
        start = month_start(month)
        if start >= until:
            break
        ledger = ledgers.get(month)
        if ledger is None:
            ledger = ledgers[month] = Ledger(namespace, month)
        if ledger.final or any(
            iv.claim_uid == interval.claim_uid and start <= iv.start < until for iv in ledger.intervals
        ):
            continue
        ledger.append(_continuation(interval, start, min(until, ledger.end), interval.price))
        changed.add(month)
    return changed


def reprice(ledgers: Mapping[str, Ledger], package: str, price: Price | None, at: datetime) -> set[str]:
    """A package's price changed at `at`: its open intervals close there and go on at the new price,
    so what was held before is billed at the price of its time."""
    changed = set()
    for month, ledger in ledgers.items():
        if ledger.final:
            continue
        for iv in ledger.open_intervals():
            if iv.package != package or _same_price(iv.price, price):
                continue
            if at <= iv.start:
                iv.price = price  # nothing was held at the old price yet
            else:
                _close(iv, at, ledger)
                if at < ledger.end:
                    ledger.append(_continuation(iv, at, None, price))
            changed.add(month)
    return changed


#: An interval opened this recently when Kueue's status first counts it borrowed is marked borrowed
#: from its start, not split: Kueue admitted the pod (and so decided the borrowing) before its claim
#: was allocated, and its ClusterQueue's status is written a moment after the admission.
BORROW_SETTLE = timedelta(seconds=10)


def borrowed_open(ledgers: Mapping[str, Ledger], package: str) -> int:
    """How many of the namespace's open intervals of `package` are marked borrowed."""
    return sum(
        1
        for ledger in ledgers.values()
        if not ledger.final
        for iv in ledger.open_intervals()
        if iv.package == package and iv.borrowed
    )


def mark_borrowed(
    ledgers: Mapping[str, Ledger], package: str, borrowed: int, now: datetime, *, release: bool = True
) -> set[str]:
    """Make `borrowed` of the namespace's open intervals of `package` the borrowed ones (Kueue's
    count of its slices held above the entitlement); returns the months changed. Kueue counts
    quota, not which pod holds it, and writes its count a moment after the claims change: so only
    an interval in its first `BORROW_SETTLE` becomes borrowed (the newest first), from its start (a
    count that stays up after a borrowed slice ended names no other slice), and, where the count
    falls, the oldest borrowed go back to the entitlement, split at `now`, only with `release` (the
    caller's word that the lower count has held for `BORROW_SETTLE`, not a status written before the
    borrowed slice's own claim went)."""
    changed: set[str] = set()
    rows = [
        (ledger, iv)
        for month, ledger in sorted(ledgers.items())
        if not ledger.final
        for iv in ledger.open_intervals()
        if iv.package == package
    ]
    want = max(0, min(borrowed, len(rows)))
    marked = [r for r in rows if r[1].borrowed]
    if len(marked) < want:
        fresh = [r for r in rows if not r[1].borrowed and now - r[1].start <= BORROW_SETTLE]
        fresh.sort(key=lambda r: r[1].start, reverse=True)
        flips = [(ledger, iv, True) for ledger, iv in fresh[: want - len(marked)]]
    elif release:
        marked.sort(key=lambda r: r[1].start)
        flips = [(ledger, iv, False) for ledger, iv in marked[: len(marked) - want]]
    else:
        flips = []
    for ledger, iv, to in flips:
        if to or now <= iv.start:
            iv.borrowed = to
        else:
            _close(iv, now, ledger)
            if now < ledger.end:
                nxt = _continuation(iv, now, None, iv.price)
                nxt.borrowed = to
                ledger.append(nxt)
        changed.add(ledger.month)
    return changed


def observe(interval: Interval, reading: Reading, previous: Reading | None) -> bool:
    """Fold one usage reading into an open interval; True when a recorded number changed. The mean
    utilization is weighted by time: `previous` (the reading before, same interval) held until now."""
    one = accumulator()
    one.peak_memory_bytes = reading.memory_used_bytes
    one.memory_limit_bytes = reading.memory_limit_bytes
    one.refused_allocations = reading.refused_allocations
    if previous is not None and previous.at >= interval.start:
        one.observed_seconds = max(0, int((reading.at - previous.at).total_seconds()))
        one.mean_utilization_percent = previous.utilization_percent or 0.0
    return merge(interval, one)


def accumulator() -> Interval:
    """An interval-shaped sum of readings not folded into the ledger yet (see `merge`)."""
    return Interval("", "", "", "", "", "", "", datetime.min.replace(tzinfo=UTC))


def merge(interval: Interval, acc: Interval) -> bool:
    """Fold an accumulator's readings into an open interval; True when a recorded number changed."""
    before = (interval.peak_memory_bytes, interval.memory_limit_bytes, interval.refused_allocations)
    before_seconds = interval.observed_seconds
    interval.peak_memory_bytes = max(interval.peak_memory_bytes, acc.peak_memory_bytes)
    interval.memory_limit_bytes = acc.memory_limit_bytes or interval.memory_limit_bytes
    interval.refused_allocations = max(interval.refused_allocations, acc.refused_allocations)
    if acc.observed_seconds:
        total = interval.observed_seconds + acc.observed_seconds
        weighted = interval.mean_utilization_percent * interval.observed_seconds
        weighted += acc.mean_utilization_percent * acc.observed_seconds
        interval.mean_utilization_percent = round(weighted / total, 1)
        interval.observed_seconds = total
    after = (interval.peak_memory_bytes, interval.memory_limit_bytes, interval.refused_allocations)
    return before != after or before_seconds != interval.observed_seconds


# --- totals ----------------------------------------------------------------------------------------


def peak_concurrent(intervals: Iterable[Interval], until: datetime) -> int:
    """The most of these intervals open at one instant (a continuation touching its predecessor, or a
    price split, does not count twice: an interval's end is exclusive)."""
    events = []
    for iv in intervals:
        end = iv.end if iv.end is not None else until
        if end > iv.start:
            events.append((iv.start, 1))
            events.append((end, -1))
    peak = current = 0
    events.sort()  # at one instant an end (-1) sorts before a start (+1)
    for _t, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


@dataclass(frozen=True)
class Total:
    namespace: str
    package: str
    currency: str | None
    slice_seconds: int
    peak_slices: int
    intervals: int
    cost: Decimal | None
    #: Of `slice_seconds`, those held on quota borrowed through Kueue, and their cost.
    borrowed_seconds: int = 0
    borrowed_cost: Decimal | None = None
    #: Card-seconds (`Interval.card_seconds`) of the intervals whose cards are known; None: of none.
    card_seconds: float | None = None


def clip(interval: Interval, since: datetime | None, until: datetime) -> Interval | None:
    """The part of an interval inside [since, until), or None (the interval itself when all of it is
    inside: an open one then counts up to `until` wherever it is read)."""
    if (since is None or interval.start >= since) and (interval.end is None or interval.end <= until):
        return interval if interval.start < until else None
    end = interval.end if interval.end is not None and interval.end < until else until
    start = interval.start if since is None or interval.start > since else since
    if end <= start:
        return None
    return dataclasses.replace(interval, start=start, end=end)


def totals(
    rows: Iterable[tuple[str, Interval]], until: datetime, since: datetime | None = None
) -> list[Total]:
    """Per (namespace, package, currency): slice-seconds, peak slices held at once and cost of the
    intervals' parts inside [since, until)."""
    groups: dict[tuple[str, str, str | None], list[Interval]] = {}
    for namespace, iv in rows:
        part = clip(iv, since, until)
        if part is None:
            continue
        currency = iv.price.currency if iv.price else None
        groups.setdefault((namespace, iv.package, currency), []).append(part)
    out = []
    for (namespace, package, currency), ivs in sorted(
        groups.items(), key=lambda g: (g[0][0], g[0][1], g[0][2] or "")
    ):
        costs = [iv.cost(until) for iv in ivs]
        priced = [x for x in costs if x is not None]
        lent = [iv for iv in ivs if iv.borrowed]
        lent_costs = [x for x in (iv.cost(until) for iv in lent) if x is not None]
        card_seconds = [x for x in (iv.card_seconds(until) for iv in ivs) if x is not None]
        out.append(
            Total(
                namespace=namespace,
                package=package,
                currency=currency,
                slice_seconds=sum(iv.seconds(until) for iv in ivs),
                peak_slices=peak_concurrent(ivs, until),
                intervals=len(ivs),
                cost=sum(priced, Decimal(0)) if priced else None,
                borrowed_seconds=sum(iv.seconds(until) for iv in lent),
                borrowed_cost=sum(lent_costs, Decimal(0)) if lent_costs else None,
                card_seconds=round(sum(card_seconds), 3) if card_seconds else None,
            )
        )
    return out


def money(value: Decimal) -> str:
    """A cost as a decimal string: exact to 1e-6, no exponent."""
    return f"{value.quantize(Decimal('0.000001')).normalize():f}"


def hours(seconds: int) -> str:
    return f"{seconds / 3600:.2f}"


def hours_of(seconds: float) -> str:
    """Card-seconds as card-hours, to two places like slice-hours."""
    return f"{seconds / 3600:.2f}"


def fill_cards(ledgers: Mapping[str, Ledger], cards: Mapping[str, float]) -> set[str]:
    """Give the intervals of months not final that were written before card-seconds were kept
    their package's cards (a package's fraction, gpus and MIG profile never change, so its cards
    now are its cards then); returns the months changed. A package no longer known stays None."""
    changed = set()
    for month, ledger in ledgers.items():
        if ledger.final:
            continue
        for iv in ledger.intervals:
            if iv.cards is None and iv.package in cards:
                iv.cards = cards[iv.package]
                changed.add(month)
    return changed


# --- the API objects -------------------------------------------------------------------------------


def to_wire(interval: Interval, until: datetime) -> UsageInterval:
    """The interval as its object holds it; an open one's cardSeconds count up to `until` (the
    object's confirmedAt, as its totals do)."""
    return UsageInterval(
        **_fields(interval, _CARRIED),
        cardSeconds=interval.card_seconds(until),
        start=rfc3339(interval.start),
        end=rfc3339(interval.end) if interval.end is not None else None,
        pricePerHour=interval.price.per_hour if interval.price else None,
        borrowedPricePerHour=interval.price.borrowed_per_hour if interval.price else None,
        currency=interval.price.currency if interval.price else None,
        borrowed=True if interval.borrowed else None,
    )


def from_wire(wire: UsageInterval, shard: int) -> Interval:
    price = (
        Price(
            perHour=wire.price_per_hour,
            currency=wire.currency,
            borrowedPerHour=wire.borrowed_price_per_hour,
        )
        if wire.price_per_hour is not None and wire.currency
        else None
    )
    return Interval(
        **_fields(wire, _CARRIED),
        start=parse_rfc3339(wire.start),
        end=parse_rfc3339(wire.end) if wire.end else None,
        price=price,
        shard=shard,
        borrowed=bool(wire.borrowed),
    )


def load(namespace: str, shards: Sequence[GpuUsage]) -> Ledger:
    """A month from its objects (any order)."""
    ordered = sorted(shards, key=lambda s: s.shard)
    first = ordered[0]
    ledger = Ledger(namespace, first.month)
    ledger.final = any(s.final for s in ordered)
    confirmed = [parse_rfc3339(s.confirmed_at) for s in ordered if s.confirmed_at]
    ledger.confirmed_at = max(confirmed) if confirmed else None
    for s in ordered:
        ledger.intervals.extend(from_wire(w, s.shard) for w in s.intervals)
    ledger.intervals = one_per_device(ledger.intervals)
    return ledger


def one_per_device(intervals: list[Interval]) -> list[Interval]:
    """The intervals with those of one claim that overlap merged: a claim is one device, billed once
    however many pods share it. Operators before 0.2.0 opened a second interval when another pod
    reserved a shared claim; a month they wrote is read (and written back, at its next write) as one.
    Touching intervals (a price split, a month's continuation, a release and a new allocation) stay
    apart; of two overlapping at different prices, the later price holds from its start."""
    by_claim: dict[str, list[Interval]] = {}
    for iv in intervals:
        by_claim.setdefault(iv.claim_uid, []).append(iv)
    if all(len(ivs) == 1 for ivs in by_claim.values()):
        return intervals
    dropped: set[int] = set()
    for ivs in by_claim.values():
        kept: list[Interval] = []
        for iv in sorted(ivs, key=lambda x: (x.start, x.end is None, x.end or x.start)):
            last = kept[-1] if kept else None
            if last is None or (last.end is not None and iv.start >= last.end):
                kept.append(iv)
            elif _same_price(last.price, iv.price):
                last.end = None if last.end is None or iv.end is None else max(last.end, iv.end)
                _fold_duplicate(last, iv)
                dropped.add(id(iv))
            elif iv.end is not None and last.end is not None and iv.end <= last.end:
                dropped.add(id(iv))  # wholly inside the one kept
            elif last.end is None or last.end > iv.start:
                last.end = iv.start  # the later price from its start
                kept.append(iv)
        for iv in kept:
            if iv.end is not None and iv.end <= iv.start and len(kept) > 1:
                dropped.add(id(iv))
    return [iv for iv in intervals if id(iv) not in dropped]


def _fold_duplicate(into: Interval, dup: Interval) -> None:
    """A duplicate saw the same readings (they are folded into every open interval of the slice):
    the larger figures, not their sum."""
    into.peak_memory_bytes = max(into.peak_memory_bytes, dup.peak_memory_bytes)
    into.memory_limit_bytes = max(into.memory_limit_bytes, dup.memory_limit_bytes)
    into.refused_allocations = max(into.refused_allocations, dup.refused_allocations)
    if dup.observed_seconds > into.observed_seconds:
        into.observed_seconds = dup.observed_seconds
        into.mean_utilization_percent = dup.mean_utilization_percent


def _summary(rows: list[Total]) -> tuple[str, str]:
    seconds = sum(t.slice_seconds for t in rows)
    costs: dict[str, Decimal] = {}
    for t in rows:
        if t.cost is not None and t.currency:
            costs[t.currency] = costs.get(t.currency, Decimal(0)) + t.cost
    cost = ", ".join(f"{v.quantize(Decimal('0.01'))} {cur}" for cur, v in sorted(costs.items()))
    return hours(seconds), cost


def encode(ledger: Ledger, now: datetime) -> dict[int, GpuUsage]:
    """The month's objects by shard; shard 0 carries the month's totals (open intervals counted up
    to `confirmed_at`, or `now`). Raises LedgerFull when an object would pass `MAX_OBJECT_BYTES`."""
    until = min(ledger.confirmed_at or now, ledger.end)
    rows = totals(((ledger.namespace, iv) for iv in ledger.intervals), until)
    per_package: dict[str, PackageTotals] = {}
    for t in rows:
        entry = per_package.setdefault(
            t.package, PackageTotals(package=t.package, sliceSeconds=0, peakSlices=0, intervals=0)
        )
        entry.slice_seconds += t.slice_seconds
        entry.intervals += t.intervals
        if t.card_seconds is not None:
            entry.card_seconds = round((entry.card_seconds or 0.0) + t.card_seconds, 3)
        if t.borrowed_seconds:
            entry.borrowed_slice_seconds = (entry.borrowed_slice_seconds or 0) + t.borrowed_seconds
        if t.cost is not None and t.currency:
            entry.cost[t.currency] = money(t.cost)
    for package, entry in per_package.items():
        entry.peak_slices = peak_concurrent((iv for iv in ledger.intervals if iv.package == package), until)
    slice_hours, cost = _summary(rows)
    shards: dict[int, GpuUsage] = {}
    for iv in ledger.intervals:
        shards.setdefault(iv.shard, GpuUsage(month=ledger.month, shard=iv.shard)).intervals.append(
            to_wire(iv, until)
        )
    first = shards.setdefault(0, GpuUsage(month=ledger.month, shard=0))
    first.packages = [per_package[p] for p in sorted(per_package)]
    first.slice_hours = slice_hours
    known = [t.card_seconds for t in rows if t.card_seconds is not None]
    first.card_hours = hours_of(sum(known)) if known else None
    first.cost = cost
    first.interval_count = len(ledger.intervals)
    for shard in shards.values():
        shard.final = ledger.final
        shard.confirmed_at = rfc3339(ledger.confirmed_at) if ledger.confirmed_at else None
        size = len(shard.model_dump_json(by_alias=True, exclude_none=True))
        if size > MAX_OBJECT_BYTES:
            raise LedgerFull(
                f"GpuUsage {ledger.namespace}/{object_name(ledger.month, shard.shard)} would be {size} "
                f"bytes, past the {MAX_OBJECT_BYTES} etcd accepts; not written"
            )
    return shards


# --- right-sizing ----------------------------------------------------------------------------------

#: A smaller package fits when the slice's peak memory is at most this share of that package's memory.
FIT_MARGIN = Decimal("0.75")
#: Refused allocations over a period from which a slice "keeps hitting the edge".
EDGE_REFUSALS = 3
#: Held at least this long with no process on the GPU: idle.
IDLE_SECONDS = 3600


@dataclass(frozen=True)
class Product:
    """A GpuPackage as right-sizing needs it."""

    name: str
    gpu_model: str
    fraction: int
    price: Price | None = None


@dataclass(frozen=True)
class Advice:
    namespace: str
    slice: str
    package: str
    #: "smaller", "larger" or "idle".
    kind: str
    suggest: str | None
    reason: str


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def advise(
    rows: Iterable[tuple[str, Interval]],
    products: Sequence[Product],
    until: datetime,
    entitled: Mapping[str, Collection[str]] | None = None,
) -> list[Advice]:
    """Per slice over the intervals given: a larger package when allocations keep being refused at its
    edge, idle when held long with no process on the GPU, a smaller package when its peak memory fits
    one with `FIT_MARGIN` to spare. `entitled`: namespace -> the packages it may hold (its quota);
    a namespace in it is only advised those."""
    by_name = {p.name: p for p in products}
    groups: dict[tuple[str, str, str], list[Interval]] = {}
    for namespace, iv in rows:
        groups.setdefault((namespace, iv.slice, iv.package), []).append(iv)
    out = []
    for (namespace, name, package), ivs in sorted(groups.items()):
        held = sum(iv.seconds(until) for iv in ivs)
        peak = max(iv.peak_memory_bytes for iv in ivs)
        limit = max(iv.memory_limit_bytes for iv in ivs)
        # A claim's count is its running total: its largest value, summed over the slice's claims.
        per_claim: dict[str, int] = {}
        for iv in ivs:
            per_claim[iv.claim_uid] = max(per_claim.get(iv.claim_uid, 0), iv.refused_allocations)
        refused = sum(per_claim.values())
        observed = sum(iv.observed_seconds for iv in ivs)
        util = (
            sum(iv.mean_utilization_percent * iv.observed_seconds for iv in ivs) / observed
            if observed
            else 0.0
        )
        current = by_name.get(package)
        allowed = entitled.get(namespace) if entitled is not None else None
        same_model = sorted(
            (
                p
                for p in products
                if current
                and p.gpu_model == current.gpu_model
                and p.name != package
                and (allowed is None or p.name in allowed)
            ),
            key=lambda p: (p.fraction, p.name),
        )
        card = limit * 100 // current.fraction if current and limit else 0
        if refused >= EDGE_REFUSALS:
            bigger = [p for p in same_model if current and p.fraction > current.fraction]
            edge = f"the {_gib(limit)} edge" if limit else "its edge"
            reason = f"{refused} allocations refused at {edge}"
            out.append(
                Advice(
                    namespace,
                    name,
                    package,
                    "larger",
                    bigger[0].name if bigger else None,
                    reason
                    + (
                        f"; {bigger[0].name} holds {_gib(card * bigger[0].fraction // 100)}"
                        if bigger and card
                        else "; no larger package of this GPU model"
                    ),
                )
            )
        elif peak == 0 and util == 0 and held >= IDLE_SECONDS and not any(iv.template for iv in ivs):
            # (Template slices' usage is in metrics only: no reading is no evidence there.)
            out.append(
                Advice(
                    namespace,
                    name,
                    package,
                    "idle",
                    None,
                    f"held {hours(held)} h and no process used the GPU; "
                    "delete it or scale its workload to zero",
                )
            )
        elif peak > 0 and card and current:
            smaller = [
                p
                for p in same_model
                if p.fraction < current.fraction and peak <= card * p.fraction // 100 * FIT_MARGIN
            ]
            if smaller:
                best = smaller[0]
                out.append(
                    Advice(
                        namespace,
                        name,
                        package,
                        "smaller",
                        best.name,
                        f"peak {_gib(peak)} of {_gib(limit)}: "
                        f"{best.name} ({_gib(card * best.fraction // 100)}) "
                        f"holds it with {int((1 - FIT_MARGIN) * 100)} % to spare",
                    )
                )
    return out
