"""Card-seconds in the ledger: every interval and every package's totals count seconds held times the
cards the product takes (`domain.multigpu.cards_held`): a `gpus: N` product N cards, a software slice
its fraction of one card, a MIG instance its compute slices of 7."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

import pytest

from gpuslice.api.package import GpuPackageSpec
from gpuslice.api.usage import GpuUsage
from gpuslice.domain.ledger import Holding, Ledger, encode, fill_cards, load, reconcile, totals
from gpuslice.domain.multigpu import card_seconds, cards_held

NS = "team-a"
START = datetime(2026, 12, 5, 10, 0, 0, tzinfo=UTC)
HOUR = datetime(2026, 12, 5, 11, 0, 0, tzinfo=UTC)


def spec(**kw: object) -> GpuPackageSpec:
    return GpuPackageSpec.model_validate({"gpuModel": "Tesla V100-SXM2-16GB", **kw})


@pytest.mark.parametrize(
    ("fields", "cards"),
    [
        ({"gpus": 4}, 4.0),
        ({"gpus": 2, "fraction": 100}, 2.0),
        ({"fraction": 25}, 0.25),
        ({"fraction": 100}, 1.0),
        ({"fraction": 100, "isolation": {"mode": "Hardware"}, "migProfile": "3g.40gb"}, 3 / 7),
        ({"fraction": 100, "isolation": {"mode": "Hardware"}, "migProfile": "7g.80gb"}, 1.0),
    ],
)
def test_a_product_holds_its_share_of_the_fleets_cards(fields: dict[str, object], cards: float) -> None:
    assert cards_held(spec(**fields)) == pytest.approx(cards)
    assert card_seconds(spec(**fields), 3600.0) == pytest.approx(3600 * cards)


def holding(uid: str, package: str, cards: float | None) -> Holding:
    return Holding(
        namespace=NS,
        package=package,
        slice=uid,
        claim=uid,
        claim_uid=uid,
        pod="worker",
        node="node-1",
        gpu="GPU-0",
        allocated_at=START,
        cards=cards,
    )


def test_a_2_card_product_held_an_hour_is_2_card_hours_a_quarter_slice_a_quarter() -> None:
    books: dict[str, Ledger] = {}
    held = [holding("pair", "x2", 2.0), holding("q1", "q", 0.25), holding("q2", "q", 0.25)]
    reconcile(books, NS, held, {}, {}, START)
    reconcile(books, NS, [], {"pair": HOUR, "q1": HOUR, "q2": HOUR}, {}, HOUR)
    (month,) = encode(books["2026-12"], HOUR).values()
    by_claim = {iv.claim: iv for iv in month.intervals}
    assert (by_claim["pair"].cards, by_claim["pair"].card_seconds) == (2.0, 7200.0)
    assert (by_claim["q1"].cards, by_claim["q1"].card_seconds) == (0.25, 900.0)
    per_package = {p.package: p for p in month.packages}
    assert (per_package["x2"].slice_seconds, per_package["x2"].card_seconds) == (3600, 7200.0)
    # Two quarter slices for an hour: two slice-hours, half a card-hour.
    assert (per_package["q"].slice_seconds, per_package["q"].card_seconds) == (7200, 1800.0)
    assert (month.slice_hours, month.card_hours) == ("3.00", "2.50")


def test_an_open_interval_counts_card_seconds_up_to_the_objects_confirmed_time() -> None:
    books: dict[str, Ledger] = {}
    reconcile(books, NS, [holding("pair", "x2", 2.0)], {}, {}, START)
    ledger = books["2026-12"]
    ledger.confirmed_at = datetime(2026, 12, 5, 10, 10, 0, tzinfo=UTC)
    (month,) = encode(ledger, HOUR).values()
    (iv,) = month.intervals
    assert iv.end is None and iv.card_seconds == 1200.0
    assert month.packages[0].card_seconds == 1200.0


def test_cards_survive_the_objects_round_trip_and_a_month_from_before_gets_its_packages() -> None:
    books: dict[str, Ledger] = {}
    reconcile(books, NS, [holding("pair", "x2", 2.0)], {}, {}, START)
    wire = encode(books["2026-12"], HOUR)
    dumped = [GpuUsage.model_validate(o.model_dump(by_alias=True, exclude_none=True)) for o in wire.values()]
    again = load(NS, dumped)
    assert [iv.cards for iv in again.intervals] == [2.0]
    # A month written before card-seconds were kept: no cards, no card-seconds, until the operator
    # fills them in from the package (whose gpus and fraction never change).
    old = dataclasses.replace(again.intervals[0], cards=None)
    before = Ledger(NS, "2026-12", intervals=[old])
    (row,) = totals([(NS, old)], HOUR)
    assert row.card_seconds is None and row.slice_seconds == 3600
    (month,) = encode(before, HOUR).values()
    assert month.card_hours is None and month.intervals[0].card_seconds is None
    assert fill_cards({"2026-12": before}, {"x2": 2.0}) == {"2026-12"}
    assert fill_cards({"2026-12": before}, {"x2": 2.0}) == set()
    (row,) = totals([(NS, old)], HOUR)
    assert row.card_seconds == 7200.0
