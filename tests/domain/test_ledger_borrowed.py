"""Borrowed slice-hours (sharing mode Kueue): of a namespace's open intervals, as many as its
ClusterQueue's status counts borrowed are marked borrowed, split where the count changes, kept
across a restart (the objects carry the mark), and totalled apart."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from decimal import Decimal

from gpuslice.api.usage import GpuUsage, Price
from gpuslice.domain.ledger import Holding, Ledger, encode, load, mark_borrowed, reconcile, reprice, totals

NS = "team-b"
PKG = "v100-8g"
EUR = Price(perHour="0.45", currency="EUR")


def t(s: str) -> datetime:
    return datetime.strptime(s, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)


def holding(uid: str, at: str) -> Holding:
    return Holding(NS, PKG, f"s-{uid}", f"c-{uid}", uid, f"p-{uid}", "node-1", "GPU-0", t(at))


def test_slices_above_the_entitlement_are_borrowed_from_their_start_and_billed_apart() -> None:
    books: dict[str, Ledger] = {}
    held = [holding("a", "2026-12-05 10:00:00"), holding("b", "2026-12-05 10:00:00")]
    reconcile(books, NS, held, {}, {PKG: EUR}, t("2026-12-05 10:00:01"))
    assert mark_borrowed(books, PKG, 0, t("2026-12-05 10:00:01")) == set()
    # A third slice, two hours later, on quota Kueue lent: its ClusterQueue's status says 1 borrowed
    # a moment after the claim was allocated. It is borrowed from its start, not from the moment.
    held.append(holding("c", "2026-12-05 12:00:00"))
    reconcile(books, NS, held, {}, {PKG: EUR}, t("2026-12-05 12:00:02"))
    assert mark_borrowed(books, PKG, 1, t("2026-12-05 12:00:04")) == {"2026-12"}
    ivs = {iv.claim_uid: iv for iv in books["2026-12"].intervals}
    assert [uid for uid, iv in sorted(ivs.items()) if iv.borrowed] == ["c"]
    assert ivs["c"].start == t("2026-12-05 12:00:00")
    # The same count again changes nothing (no write).
    assert mark_borrowed(books, PKG, 1, t("2026-12-05 12:30:00")) == set()
    # At 13:00 slice a is released: c is within the entitlement from then on (Kueue says 0).
    reconcile(books, NS, held[1:], {"a": t("2026-12-05 13:00:00")}, {PKG: EUR}, t("2026-12-05 13:00:01"))
    assert mark_borrowed(books, PKG, 0, t("2026-12-05 13:00:01")) == {"2026-12"}
    c_ivs = [iv for iv in books["2026-12"].intervals if iv.claim_uid == "c"]
    assert [(iv.start, iv.end, iv.borrowed) for iv in c_ivs] == [
        (t("2026-12-05 12:00:00"), t("2026-12-05 13:00:01"), True),
        (t("2026-12-05 13:00:01"), None, False),
    ]
    (total,) = totals(((NS, iv) for iv in books["2026-12"].intervals), t("2026-12-05 14:00:00"))
    # a: 3 h, b: 4 h, c: 2 h of which 1 h 0 min 1 s borrowed
    assert total.slice_seconds == 3 * 3600 + 4 * 3600 + 2 * 3600
    assert total.borrowed_seconds == 3601
    assert total.borrowed_cost == Decimal("0.45") * 3601 / 3600


def test_the_mark_survives_a_restart_and_the_totals_carry_borrowed_seconds() -> None:
    books: dict[str, Ledger] = {}
    held = [holding("a", "2026-12-05 10:00:00"), holding("b", "2026-12-05 10:00:00")]
    reconcile(books, NS, held, {}, {PKG: EUR}, t("2026-12-05 10:00:02"))
    mark_borrowed(books, PKG, 1, t("2026-12-05 10:00:03"))
    books["2026-12"].confirmed_at = t("2026-12-05 11:00:00")
    saved = encode(books["2026-12"], t("2026-12-05 11:00:00"))
    assert saved[0].packages[0].borrowed_slice_seconds == 3600
    wire = [GpuUsage.model_validate(json.loads(s.model_dump_json(by_alias=True))) for s in saved.values()]
    after = {"2026-12": load(NS, wire)}
    # A new process, Kueue still counting 1 borrowed: nothing changes, nothing is lost.
    assert reconcile(after, NS, held, {}, {PKG: EUR}, t("2026-12-05 11:30:00")) == set()
    assert mark_borrowed(after, PKG, 1, t("2026-12-05 11:30:00")) == set()
    assert sorted(iv.borrowed for iv in after["2026-12"].intervals) == [False, True]
    (total,) = totals(((NS, iv) for iv in after["2026-12"].intervals), t("2026-12-05 12:00:00"))
    assert total.borrowed_seconds == 2 * 3600


def test_a_ledger_written_before_sharing_reads_the_same() -> None:
    books: dict[str, Ledger] = {}
    reconcile(books, NS, [holding("a", "2026-12-05 10:00:00")], {}, {}, t("2026-12-05 10:00:02"))
    shard = encode(books["2026-12"], t("2026-12-05 10:00:02"))[0]
    dumped = shard.model_dump(by_alias=True, exclude_none=True)
    assert "borrowed" not in dumped["intervals"][0]
    assert "borrowedSliceSeconds" not in dumped["packages"][0]


def test_a_count_kueue_has_not_updated_yet_moves_no_mark() -> None:
    """Kueue writes its count a moment after the claims change, in either order. A borrowed slice
    released while the count still says 1 hands no mark to an older slice (it split b's interval
    twice, into borrowed and entitled pieces, in a loaded suite); a count that fell before the
    borrowed slice's claim went releases nothing until it has held for BORROW_SETTLE."""
    books: dict[str, Ledger] = {}
    held = [holding("a", "2026-12-05 10:00:00"), holding("b", "2026-12-05 10:00:00")]
    reconcile(books, NS, held, {}, {PKG: EUR}, t("2026-12-05 10:00:01"))
    held.append(holding("c", "2026-12-05 11:00:00"))
    reconcile(books, NS, held, {}, {PKG: EUR}, t("2026-12-05 11:00:01"))
    assert mark_borrowed(books, PKG, 1, t("2026-12-05 11:00:02")) == {"2026-12"}
    # Kueue's count falls first: c stays borrowed while the lower count has not held for 10 s.
    assert mark_borrowed(books, PKG, 0, t("2026-12-05 12:00:00"), release=False) == set()
    # c's claim goes; Kueue still says 1 for a moment: neither a nor b becomes borrowed.
    reconcile(books, NS, held[:2], {"c": t("2026-12-05 12:00:01")}, {PKG: EUR}, t("2026-12-05 12:00:01"))
    assert mark_borrowed(books, PKG, 1, t("2026-12-05 12:00:02")) == set()
    ivs = books["2026-12"].intervals
    assert sorted((iv.claim_uid, iv.borrowed) for iv in ivs) == [("a", False), ("b", False), ("c", True)]
    assert [iv.end for iv in ivs if iv.claim_uid == "c"] == [t("2026-12-05 12:00:01")]


LENT_PRICE = Price(perHour="0.45", borrowedPerHour="0.30", currency="EUR")


def test_a_borrowed_price_bills_the_borrowed_part_only_and_rides_the_objects_through_a_restart() -> None:
    books: dict[str, Ledger] = {}
    held = [holding("a", "2026-12-05 10:00:00"), holding("b", "2026-12-05 11:00:00")]
    reconcile(books, NS, held, {}, {PKG: LENT_PRICE}, t("2026-12-05 11:00:01"))
    mark_borrowed(books, PKG, 1, t("2026-12-05 11:00:02"))  # b, on lent quota
    # b goes back to the entitlement at 12:00 (Kueue: 0): its rest is at perHour.
    mark_borrowed(books, PKG, 0, t("2026-12-05 12:00:00"))
    until = t("2026-12-05 13:00:00")
    (total,) = totals(((NS, iv) for iv in books["2026-12"].intervals), until)
    # a: 3 h at 0.45; b: 1 h borrowed at 0.30 and 1 h at 0.45
    assert total.borrowed_seconds == 3600
    assert total.borrowed_cost == Decimal("0.30")
    assert total.cost == Decimal("0.45") * 4 + Decimal("0.30")
    books["2026-12"].confirmed_at = until
    saved = encode(books["2026-12"], until)
    dumped = saved[0].model_dump(by_alias=True, exclude_none=True)
    assert {iv.get("borrowedPricePerHour") for iv in dumped["intervals"]} == {"0.30"}
    wire = [GpuUsage.model_validate(json.loads(s.model_dump_json(by_alias=True))) for s in saved.values()]
    after = {"2026-12": load(NS, wire)}
    (again,) = totals(((NS, iv) for iv in after["2026-12"].intervals), until)
    assert (again.cost, again.borrowed_cost) == (total.cost, total.borrowed_cost)


def test_a_change_of_the_borrowed_price_splits_open_intervals_like_any_price_change() -> None:
    books: dict[str, Ledger] = {}
    reconcile(
        books, NS, [holding("a", "2026-12-05 10:00:00")], {}, {PKG: LENT_PRICE}, t("2026-12-05 10:00:01")
    )
    mark_borrowed(books, PKG, 1, t("2026-12-05 10:00:02"))
    dearer = Price(perHour="0.45", borrowedPerHour="0.60", currency="EUR")
    assert reprice(books, PKG, dearer, t("2026-12-05 11:00:00")) == {"2026-12"}
    ivs = books["2026-12"].intervals
    assert [(iv.end, iv.price.borrowed_per_hour if iv.price else None, iv.borrowed) for iv in ivs] == [
        (t("2026-12-05 11:00:00"), "0.30", True),
        (None, "0.60", True),
    ]
    # The same price again, however written, splits nothing.
    assert (
        reprice(
            books,
            PKG,
            Price(perHour="0.450", borrowedPerHour="0.6", currency="EUR"),
            t("2026-12-05 11:30:00"),
        )
        == set()
    )
    (total,) = totals(((NS, iv) for iv in ivs), t("2026-12-05 12:00:00"))
    assert total.borrowed_cost == Decimal("0.30") + Decimal("0.60")


def test_without_a_borrowed_price_a_borrowed_slice_costs_per_hour() -> None:
    assert EUR.rate(borrowed=True) == EUR.rate(borrowed=False) == "0.45"
    assert LENT_PRICE.rate(borrowed=True) == "0.30" and LENT_PRICE.rate(borrowed=False) == "0.45"
