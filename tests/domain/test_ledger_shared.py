"""A claim is one device: however many pods share it, and whatever an older operator wrote for it,
its month bills it once. Ledgers written before that held an interval per consumer (a second one
opened when another pod reserved the claim); they are read merged, so they bill once too."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuslice.api.usage import GpuUsage, Price
from gpuslice.domain.ledger import Holding, Interval, Ledger, encode, load, reconcile, totals

NS = "team-a"
T0 = datetime(2026, 12, 5, 10, 0, 0, tzinfo=UTC)
EUR = Price(perHour="0.45", currency="EUR")


def at(seconds: int) -> datetime:
    return T0 + timedelta(seconds=seconds)


def interval(uid: str, start: int, end: int | None, pod: str = "llm") -> Interval:
    return Interval(
        package="v100-8g", slice="llm", claim="llm", claim_uid=uid, pod=pod, node="node-1",
        gpu="GPU-0", start=at(start), end=at(end) if end is not None else None, price=EUR,
    )  # fmt: skip


def stored(*intervals: Interval) -> list[GpuUsage]:
    """A month as an older operator wrote it (its intervals as they were, duplicates included)."""
    return list(encode(Ledger(NS, "2026-12", list(intervals)), at(10_000)).values())


def seconds_and_peak(book: Ledger, now: datetime) -> tuple[int, int]:
    (total,) = totals(((NS, iv) for iv in book.intervals), now)
    return total.slice_seconds, total.peak_slices


def test_a_stored_month_with_two_overlapping_intervals_of_one_claim_bills_it_once() -> None:
    # The ledger: the slice's pod opened one at 0 s, a second pod's reservation another at
    # 143 s; both closed at 193 s. The device was held 193 s, not 193 + 50.
    book = load(NS, stored(interval("claim-1", 0, 193), interval("claim-1", 143, 193, pod="second")))
    assert seconds_and_peak(book, at(1_000)) == (193, 1)
    assert [(iv.start, iv.end) for iv in book.intervals] == [(at(0), at(193))]
    # What `gpuslice usage` prints comes from the same numbers, and so does the rewritten object.
    (shard,) = encode(book, at(1_000)).values()
    assert (shard.packages[0].slice_seconds, shard.packages[0].peak_slices) == (193, 1)


def test_an_open_duplicate_stays_open_and_two_claims_are_two_devices() -> None:
    book = load(
        NS, stored(interval("claim-1", 0, None), interval("claim-1", 50, 120), interval("claim-2", 60, 90))
    )
    assert [(iv.claim_uid, iv.start, iv.end) for iv in book.intervals] == [
        ("claim-1", at(0), None),
        ("claim-2", at(60), at(90)),
    ]
    assert seconds_and_peak(book, at(300)) == (300 + 30, 2)


def test_a_claim_released_and_allocated_again_keeps_both_intervals() -> None:
    # Touching is not overlapping: a price split or a month's continuation ends where the next begins.
    book = load(
        NS, stored(interval("claim-1", 0, 100), interval("claim-1", 100, 150), interval("claim-1", 200, 260))
    )
    assert len(book.intervals) == 3
    assert seconds_and_peak(book, at(1_000)) == (210, 1)


@settings(max_examples=200, deadline=None)
@given(
    spans=st.lists(
        st.tuples(st.integers(0, 5_000), st.one_of(st.none(), st.integers(1, 5_000))),
        min_size=1,
        max_size=8,
    )
)
def test_any_duplicates_of_one_claim_bill_the_seconds_it_was_held(
    spans: list[tuple[int, int | None]],
) -> None:
    """Whatever intervals an older ledger holds for one claim, it bills each second in their union once."""
    ivs = [interval("claim-1", s, s + d if d is not None else None) for s, d in spans]
    now = 20_000
    held = set()
    for iv in ivs:
        end = iv.end if iv.end is not None else at(now)
        held.update(range(int((iv.start - T0).total_seconds()), int((end - T0).total_seconds())))
    book = load(NS, stored(*ivs))
    assert seconds_and_peak(book, at(now)) == (len(held), 1)


@settings(max_examples=100, deadline=None)
@given(
    pods=st.lists(st.tuples(st.integers(1, 900), st.integers(1, 900)), min_size=1, max_size=5),
    restarts=st.sets(st.integers(0, 12)),
    legacy=st.booleans(),
)
def test_reservations_in_any_order_and_restarts_bill_a_shared_device_once(
    pods: list[tuple[int, int]], restarts: set[int], legacy: bool
) -> None:
    """Pods reserve one claim (allocated at 0 s) and release it in any order; the device is released
    when the last one ends. Each reservation moves the claim's status write (its allocation time as
    the operator reads it). The operator reconciles at every change and may restart between any two
    (its books then only what it stored); `legacy`: an older operator had opened a second interval for
    the second consumer. Billed: exactly the seconds from the allocation to the last pod's end."""
    events = sorted({(s, +1) for s, _ in pods} | {(s + d, -1) for s, d in pods})
    released = max(s + d for s, d in pods)
    books: dict[str, Ledger] = {}
    first = Holding(NS, "v100-8g", "llm", "llm", "claim-1", "p0", "node-1", "GPU-0", at(0))
    reconcile(books, NS, [first], {}, {"v100-8g": EUR}, at(0))
    for step, (when, _kind) in enumerate(events):
        if when >= released:
            break
        moved = Holding(NS, "v100-8g", "llm", "llm", "claim-1", f"p{step}", "node-1", "GPU-0", at(when))
        reconcile(books, NS, [moved], {}, {"v100-8g": EUR}, at(when))
        if legacy and step == 0:
            books["2026-12"].intervals.append(interval("claim-1", when, None, pod="second"))
        if step in restarts:
            books = {m: load(NS, list(encode(b, at(when)).values())) for m, b in books.items()}
    reconcile(books, NS, [], {"claim-1": at(released)}, {"v100-8g": EUR}, at(released + 5))
    books = {m: load(NS, list(encode(b, at(released + 5)).values())) for m, b in books.items()}
    assert seconds_and_peak(books["2026-12"], at(released + 1_000)) == (released, 1)


def test_duplicates_at_two_prices_bill_each_second_once_at_the_later_price_from_its_start() -> None:
    dearer = Price(perHour="0.90", currency="EUR")
    older = interval("claim-1", 0, 100)
    newer = interval("claim-1", 40, 160)
    newer.price = dearer
    book = load(NS, stored(older, newer))
    assert [(iv.start, iv.end, iv.price) for iv in book.intervals] == [
        (at(0), at(40), EUR),
        (at(40), at(160), dearer),
    ]
    assert seconds_and_peak(book, at(1_000)) == (160, 1)
