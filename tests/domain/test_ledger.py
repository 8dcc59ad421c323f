"""The ledger's bookkeeping (domain.ledger): intervals from allocations, month splits, final months,
price changes, restarts, totals, the size of the objects, and right-sizing advice. The clock is an
argument, so a month's end is a value here, not a wait."""

from __future__ import annotations

import itertools
import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuslice.api.usage import MAX_OBJECT_BYTES, SHARD_MAX_INTERVALS, GpuUsage, Price
from gpuslice.domain.ledger import (
    EDGE_REFUSALS,
    FINAL_GRACE,
    Holding,
    Interval,
    Ledger,
    LedgerFull,
    Product,
    Reading,
    accumulator,
    advise,
    encode,
    load,
    merge,
    month_end,
    month_start,
    observe,
    reconcile,
    reprice,
    totals,
)

NS = "team-a"
EUR = Price(perHour="0.45", currency="EUR")


def t(s: str) -> datetime:
    return datetime.strptime(s, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)


def holding(uid: str = "u1", at: str = "2026-12-05 10:00:00", ended: str | None = None, **kw: str) -> Holding:
    return Holding(
        namespace=NS,
        package=kw.get("package", "v100-8g"),
        slice=kw.get("slice", "llm"),
        claim=kw.get("claim", "llm"),
        claim_uid=uid,
        pod=kw.get("pod", "worker"),
        node="node-1",
        gpu="GPU-0",
        allocated_at=t(at),
        ended_at=t(ended) if ended else None,
    )


def billed(ledgers: dict[str, Ledger], now: datetime) -> dict[tuple[str, str | None], int]:
    rows = [(NS, iv) for led in ledgers.values() for iv in led.intervals]
    return {(x.package, x.currency): x.slice_seconds for x in totals(rows, now)}


def test_a_held_slice_is_billed_from_its_allocation_until_its_release() -> None:
    books: dict[str, Ledger] = {}
    changed = reconcile(books, NS, [holding()], {}, {"v100-8g": EUR}, t("2026-12-05 10:00:03"))
    assert changed == {"2026-12"}
    (iv,) = books["2026-12"].intervals
    assert (iv.start, iv.end, iv.pod, iv.gpu, iv.price) == (
        t("2026-12-05 10:00:00"),
        None,
        "worker",
        "GPU-0",
        EUR,
    )
    # Nothing new: nothing changes (a second reconcile writes nothing).
    assert reconcile(books, NS, [holding()], {}, {"v100-8g": EUR}, t("2026-12-05 10:30:00")) == set()
    # Deallocated at 11:00 (the time of the status write that removed the allocation).
    released = {"u1": t("2026-12-05 11:00:00")}
    assert reconcile(books, NS, [], released, {}, t("2026-12-05 11:00:02")) == {"2026-12"}
    assert iv.end == t("2026-12-05 11:00:00")
    (total,) = totals([(NS, iv)], t("2026-12-06 00:00:00"))
    assert (total.slice_seconds, total.cost, total.currency) == (3600, Decimal("0.45"), "EUR")


def test_deletion_requested_ends_the_interval_at_its_timestamp() -> None:
    books: dict[str, Ledger] = {}
    reconcile(books, NS, [holding()], {}, {}, t("2026-12-05 10:00:01"))
    reconcile(books, NS, [holding(ended="2026-12-05 10:20:00")], {}, {}, t("2026-12-05 10:20:05"))
    assert books["2026-12"].intervals[0].end == t("2026-12-05 10:20:00")


def test_a_restart_continues_what_is_still_held_and_closes_what_was_released_meanwhile() -> None:
    """The operator died; on restart it has only the objects (load) and the API's claims."""
    books: dict[str, Ledger] = {}
    reconcile(
        books, NS, [holding("u1"), holding("u2", slice="b", claim="b")], {}, {}, t("2026-12-05 10:00:01")
    )
    books["2026-12"].confirmed_at = t("2026-12-05 10:05:00")
    saved = encode(books["2026-12"], t("2026-12-05 10:05:00"))
    wire = [GpuUsage.model_validate(json.loads(s.model_dump_json(by_alias=True))) for s in saved.values()]
    # An hour later: u1 still allocated, u2 deallocated at 10:30 (the claim shows when), and a third
    # claim allocated at 10:40 while no operator ran.
    after = {"2026-12": load(NS, wire)}
    now = t("2026-12-05 11:05:00")
    reconcile(
        after,
        NS,
        [holding("u1"), holding("u3", at="2026-12-05 10:40:00")],
        {"u2": t("2026-12-05 10:30:00")},
        {},
        now,
    )
    ivs = {iv.claim_uid: iv for iv in after["2026-12"].intervals}
    assert ivs["u1"].end is None and ivs["u1"].start == t("2026-12-05 10:00:00")
    assert ivs["u2"].end == t("2026-12-05 10:30:00")
    assert ivs["u3"].start == t("2026-12-05 10:40:00")
    assert len(after["2026-12"].intervals) == 3


def test_a_claim_gone_without_trace_is_closed_where_the_operator_last_saw_it() -> None:
    books: dict[str, Ledger] = {}
    reconcile(books, NS, [holding()], {}, {}, t("2026-12-05 10:00:01"))
    books["2026-12"].confirmed_at = t("2026-12-05 10:10:00")
    reconcile(books, NS, [], {}, {}, t("2026-12-05 12:00:00"))
    assert books["2026-12"].intervals[0].end == t("2026-12-05 10:10:00")


def test_a_month_boundary_splits_the_interval_and_the_ended_month_becomes_final() -> None:
    books: dict[str, Ledger] = {}
    h = holding(at="2026-11-30 23:00:00")
    reconcile(books, NS, [h], {}, {}, t("2026-11-30 23:00:01"))
    # 00:01 on December 1st: November's part ends at midnight, December's starts there.
    reconcile(books, NS, [h], {}, {}, t("2026-12-01 00:01:00"))
    nov, dec = books["2026-11"], books["2026-12"]
    assert nov.intervals[0].end == t("2026-12-01 00:00:00")
    assert dec.intervals[0].start == t("2026-12-01 00:00:00") and dec.intervals[0].end is None
    assert not nov.final  # a late claim of November may still arrive
    reconcile(books, NS, [h], {}, {}, t("2026-12-01 00:00:00") + FINAL_GRACE)
    assert nov.final
    # Final is final: a claim that shows up later claiming November is not written into it.
    late = holding("u9", at="2026-11-30 22:00:00", ended="2026-11-30 22:30:00")
    changed = reconcile(books, NS, [h, late], {}, {}, t("2026-12-02 00:00:00"))
    assert "2026-11" not in changed and len(nov.intervals) == 1
    assert billed(books, t("2026-12-01 01:00:00")) == {("v100-8g", None): 7200}


def test_an_operator_down_across_the_month_end_splits_the_same_way() -> None:
    books: dict[str, Ledger] = {}
    h = holding(at="2026-11-30 20:00:00")
    reconcile(books, NS, [h], {}, {}, t("2026-11-30 20:00:05"))
    # Back on December 3rd: November closes at its end and is final; December runs from midnight.
    reconcile(books, NS, [h], {}, {}, t("2026-12-03 09:00:00"))
    assert books["2026-11"].intervals[0].end == month_end("2026-11")
    assert books["2026-11"].final
    assert books["2026-12"].intervals[0].start == month_end("2026-11")


def test_a_slice_allocated_before_a_month_no_operator_saw_is_billed_in_each_month() -> None:
    books: dict[str, Ledger] = {}
    h = holding(at="2026-10-31 23:30:00", ended="2026-12-01 00:30:00")
    reconcile(books, NS, [h], {}, {}, t("2026-12-01 01:00:00"))
    assert sorted(books) == ["2026-10", "2026-11", "2026-12"]
    assert books["2026-11"].intervals[0].seconds(t("2027-01-01 00:00:00")) == 30 * 86400
    assert billed(books, t("2026-12-02 00:00:00")) == {("v100-8g", None): 30 * 86400 + 3600}


def test_a_price_change_bills_the_past_at_the_old_price() -> None:
    books: dict[str, Ledger] = {}
    reconcile(books, NS, [holding()], {}, {"v100-8g": EUR}, t("2026-12-05 10:00:01"))
    usd = Price(perHour="1.20", currency="USD")
    changed = reprice(books, "v100-8g", Price(perHour="0.90", currency="EUR"), t("2026-12-05 11:00:00"))
    assert changed == {"2026-12"}
    reprice(books, "v100-8g", usd, t("2026-12-05 12:00:00"))
    # Still held: the continuation is the same holding, no third interval opens.
    assert reconcile(books, NS, [holding()], {}, {"v100-8g": usd}, t("2026-12-05 12:30:00")) == set()
    rows = [(NS, iv) for iv in books["2026-12"].intervals]
    got = {(x.currency, x.slice_seconds, x.cost) for x in totals(rows, t("2026-12-05 13:00:00"))}
    assert got == {("EUR", 7200, Decimal("1.35")), ("USD", 3600, Decimal("1.2"))}
    # Peak slices: one slice, even though three intervals touch end to start.
    assert books["2026-12"].intervals[0].price == EUR
    shard0 = encode(books["2026-12"], t("2026-12-05 13:00:00"))[0]
    assert shard0.packages[0].peak_slices == 1 and shard0.packages[0].cost == {"EUR": "1.35", "USD": "1.2"}


def test_template_slices_count_one_interval_per_pod_and_peak_counts_them_at_once() -> None:
    books: dict[str, Ledger] = {}
    pods = [holding(f"u{i}", slice="web", claim=f"web-{i}-gpu", pod=f"web-{i}") for i in range(3)]
    reconcile(books, NS, pods, {}, {}, t("2026-12-05 10:00:01"))
    reconcile(
        books,
        NS,
        pods[:1],
        {"u1": t("2026-12-05 10:30:00"), "u2": t("2026-12-05 10:30:00")},
        {},
        t("2026-12-05 10:31:00"),
    )
    shard0 = encode(books["2026-12"], t("2026-12-05 11:00:00"))[0]
    (pkg,) = shard0.packages
    assert (pkg.peak_slices, pkg.intervals, pkg.slice_seconds) == (3, 3, 3600 + 2 * 1800)
    assert shard0.slice_hours == "2.00"


def _long(prefix: str, i: int) -> str:
    return (prefix + "-" + str(i)).ljust(253, "x")


def test_ten_thousand_intervals_of_the_longest_names_fit_in_objects_etcd_accepts() -> None:
    books: dict[str, Ledger] = {}
    start = t("2026-12-01 00:00:00")
    hs = [
        Holding(
            namespace=NS,
            package=_long("p", i % 3)[:63],
            slice=_long("s", i),
            claim=_long("c", i),
            claim_uid=f"{i:08d}-aaaa-bbbb-cccc-dddddddddddd",
            pod=_long("pod", i),
            node=_long("node", i % 100),
            gpu=f"GPU-{i:08d}-1111-2222-3333-444444444444",
            allocated_at=start + timedelta(seconds=i * 60),
            ended_at=start + timedelta(seconds=i * 60 + 30),
        )
        for i in range(10_000)
    ]
    reconcile(
        books,
        NS,
        hs,
        {},
        {p: Price(perHour="123456789.123456", currency="EUR") for p in {h.package for h in hs}},
        t("2026-12-29 00:00:00"),
    )
    shards = encode(books["2026-12"], t("2026-12-29 00:00:00"))
    assert len(shards) == -(-10_000 // SHARD_MAX_INTERVALS)
    sizes = [len(s.model_dump_json(by_alias=True, exclude_none=True)) for s in shards.values()]
    assert max(sizes) < MAX_OBJECT_BYTES < 1.5 * 2**20
    assert sum(len(s.intervals) for s in shards.values()) == 10_000
    assert shards[0].interval_count == 10_000


def test_an_object_past_the_limit_is_refused_loudly() -> None:
    ledger = Ledger(NS, "2026-12")
    for i in range(SHARD_MAX_INTERVALS):
        ledger.intervals.append(
            Interval("p", "s" * 3000, "c", str(i), "pod", "n", "g", t("2026-12-01 00:00:00"))
        )
    with pytest.raises(LedgerFull, match="past the"):
        encode(ledger, t("2026-12-02 00:00:00"))


def test_usage_readings_fold_into_peak_mean_and_refusals() -> None:
    iv = Interval("v100-16g", "llm", "llm", "u1", "p", "n", "g", t("2026-12-05 10:00:00"))
    r1 = Reading(t("2026-12-05 10:00:10"), 2 * 2**30, 16 * 2**30, 80.0, 0)
    r2 = Reading(t("2026-12-05 10:00:40"), 3 * 2**30, 16 * 2**30, 20.0, 1)
    r3 = Reading(t("2026-12-05 10:01:40"), 1 * 2**30, 16 * 2**30, 0.0, 1)
    assert observe(iv, r1, None)
    assert observe(iv, r2, r1)
    assert observe(iv, r3, r2)
    # 30 s at 80 % then 60 s at 20 %: 40 % over 90 s.
    assert (iv.peak_memory_bytes, iv.mean_utilization_percent, iv.observed_seconds) == (3 * 2**30, 40.0, 90)
    assert iv.refused_allocations == 1


def test_readings_summed_before_the_interval_is_at_hand_fold_in_the_same() -> None:
    """The operator sums a slice's readings as they come and folds the sum in at its next flush."""
    readings = [
        Reading(t("2026-12-05 10:00:10"), 2 * 2**30, 16 * 2**30, 80.0, 0),
        Reading(t("2026-12-05 10:00:40"), 3 * 2**30, 16 * 2**30, 20.0, 1),
        Reading(t("2026-12-05 10:01:40"), 1 * 2**30, 16 * 2**30, 0.0, 1),
    ]
    direct = Interval("v100-16g", "llm", "llm", "u1", "p", "n", "g", t("2026-12-05 10:00:00"))
    later = Interval("v100-16g", "llm", "llm", "u1", "p", "n", "g", t("2026-12-05 10:00:00"))
    acc, previous = accumulator(), None
    for r in readings:
        observe(direct, r, previous)
        observe(acc, r, previous)
        previous = r
    assert merge(later, acc)
    assert (later.peak_memory_bytes, later.mean_utilization_percent, later.observed_seconds) == (
        direct.peak_memory_bytes,
        direct.mean_utilization_percent,
        direct.observed_seconds,
    )
    assert later.refused_allocations == direct.refused_allocations == 1
    assert not merge(later, accumulator())


V100 = [
    Product("v100-8g", "Tesla V100-PCIE-32GB", 25),
    Product("v100-16g", "Tesla V100-PCIE-32GB", 50),
    Product("v100-32g", "Tesla V100-PCIE-32GB", 100),
]


def _used(
    package: str, name: str, peak_gib: float, limit_gib: int, refused: int = 0, util: float = 50.0
) -> Interval:
    return Interval(
        package,
        name,
        name,
        "uid-" + name,
        "p",
        "n",
        "g",
        t("2026-12-05 00:00:00"),
        t("2026-12-05 05:00:00"),
        peak_memory_bytes=int(peak_gib * 2**30),
        memory_limit_bytes=limit_gib * 2**30,
        mean_utilization_percent=util if peak_gib else 0.0,
        observed_seconds=3600 if peak_gib else 0,
        refused_allocations=refused,
    )


def test_advice_names_the_package_and_why() -> None:
    rows = [
        (NS, _used("v100-16g", "small", 3.0, 16)),  # 3 GiB of 16: v100-8g (8 GiB) holds it
        (NS, _used("v100-16g", "snug", 7.0, 16)),  # 7 of 8 GiB is past the margin: no advice
        (NS, _used("v100-8g", "edge", 8.0, 8, refused=EDGE_REFUSALS)),
        (NS, _used("v100-8g", "idle", 0.0, 0)),
    ]
    got = {(a.slice, a.kind, a.suggest): a.reason for a in advise(rows, V100, t("2026-12-06 00:00:00"))}
    assert set(got) == {
        ("small", "smaller", "v100-8g"),
        ("edge", "larger", "v100-16g"),
        ("idle", "idle", None),
    }
    assert "peak 3.0 GiB of 16.0 GiB" in got[("small", "smaller", "v100-8g")]
    assert "3 allocations refused at the 8.0 GiB edge" in got[("edge", "larger", "v100-16g")]
    assert "no process used the GPU" in got[("idle", "idle", None)]


# --- properties -----------------------------------------------------------------------------------

BASE = t("2026-11-20 00:00:00")


@st.composite
def histories(draw: st.DrawFn) -> tuple[list[tuple[int, int | None]], list[int]]:
    """Allocations (start, end or None) in minutes after BASE over ~3 months, and the minutes at which
    an operator reconciled (any number of them: restarts, outages)."""
    allocs = draw(
        st.lists(
            st.tuples(st.integers(0, 90 * 1440), st.one_of(st.none(), st.integers(1, 40 * 1440))),
            max_size=6,
        )
    )
    spans = [(a, None if d is None else a + d) for a, d in allocs]
    ticks = sorted(draw(st.lists(st.integers(0, 100 * 1440), min_size=1, max_size=8)))
    return spans, ticks


@settings(max_examples=150, deadline=None)
@given(histories())
def test_whenever_the_operator_looks_every_second_held_is_billed_once(
    history: tuple[list[tuple[int, int | None]], list[int]],
) -> None:
    """However rarely the operator runs (a restart at each tick, from the objects alone), the months
    add up to exactly the time each claim it saw allocated was held up to the last look, each second
    once, and no interval crosses a month or overlaps another of its claim."""
    spans, ticks = history
    books: dict[str, Ledger] = {}
    for tick in ticks:
        now = BASE + timedelta(minutes=tick)
        held, released = [], {}
        for i, (a, e) in enumerate(spans):
            start = BASE + timedelta(minutes=a)
            end = None if e is None else BASE + timedelta(minutes=e)
            if start > now:
                continue
            if end is not None and end <= now:
                released[f"u{i}"] = end  # the API shows the deallocation time
            else:
                held.append(holding(f"u{i}", at=start.strftime("%Y-%m-%d %H:%M:%S")))
        reconcile(books, NS, held, released, {}, now)
        for led in books.values():
            led.confirmed_at = now
        # A restart: only what the objects say survives.
        books = {m: load(NS, list(encode(led, now).values())) for m, led in books.items()}
    last = BASE + timedelta(minutes=ticks[-1])
    looks = [BASE + timedelta(minutes=x) for x in ticks]
    for i, (a, e) in enumerate(spans):
        start = BASE + timedelta(minutes=a)
        if start > last:
            continue
        end = min(last, BASE + timedelta(minutes=e)) if e is not None else last
        ivs = [iv for led in books.values() for iv in led.intervals if iv.claim_uid == f"u{i}"]
        released_at = BASE + timedelta(minutes=e) if e is not None else None
        seen = any(start <= x and (released_at is None or x < released_at) for x in looks)
        # Allocated and deallocated between two looks, the API keeps no trace of it (the claim's
        # managedFields lose the allocation's time with the allocation): nothing to bill from.
        expected = int((end - start).total_seconds()) if seen else 0
        assert sum(iv.seconds(last) for iv in ivs) == expected
        for led in books.values():
            for iv in led.intervals:
                assert month_start(led.month) <= iv.start < led.end
                assert iv.end is None or iv.end <= led.end
        ordered = sorted(ivs, key=lambda iv: iv.start)
        for x, y in itertools.pairwise(ordered):
            assert x.end is not None and x.end <= y.start
    for led in books.values():
        if led.end + FINAL_GRACE <= last:
            assert led.final and not led.open_intervals()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 500), st.integers(1, 500)), max_size=12))
def test_peak_is_the_most_held_at_one_instant(spans: list[tuple[int, int]]) -> None:
    ivs = [
        Interval(
            "p", "s", "c", str(i), "", "", "", BASE + timedelta(seconds=a), BASE + timedelta(seconds=a + d)
        )
        for i, (a, d) in enumerate(spans)
    ]
    brute = max((sum(1 for a, d in spans if a <= x < a + d) for x in range(0, 1001)), default=0)
    rows = [(NS, iv) for iv in ivs]
    got = totals(rows, BASE + timedelta(days=1))
    assert (got[0].peak_slices if got else 0) == brute


def test_advice_names_only_packages_the_namespace_is_entitled_to() -> None:
    rows = [(NS, _used("v100-16g", "small", 3.0, 16))]
    other = Product("a-v100-8g-other", "Tesla V100-PCIE-32GB", 25)
    until = t("2026-12-06 00:00:00")
    (anywhere,) = advise(rows, [*V100, other], until)
    assert anywhere.suggest == "a-v100-8g-other"  # first by name among the 25 % ones
    (mine,) = advise(rows, [*V100, other], until, {NS: {"v100-8g", "v100-16g"}})
    assert mine.suggest == "v100-8g"
    assert advise(rows, [*V100, other], until, {NS: {"v100-16g"}}) == []  # nothing smaller it may hold
