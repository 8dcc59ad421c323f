"""`gpuslice usage` without a cluster: the period it reads, and its table, CSV and JSON from GpuUsage
objects as the API returns them (the cluster test runs it against a real ledger)."""

from __future__ import annotations

import argparse
import csv
import io
import json
from datetime import UTC, datetime

import pytest

from gpuslice.api.usage import GpuUsage
from gpuslice.cli import build_parser
from gpuslice.domain.ledger import Product, advise, totals
from gpuslice.usage import UsageError, advice_rows, interval_rows, intervals_of, period, render, usage_rows

NOW = datetime(2026, 12, 5, 12, 0, 0, tzinfo=UTC)


def args(*argv: str) -> argparse.Namespace:
    return build_parser(["usage", *argv]).parse_args(["usage", *argv])


def iv(
    slice_: str, start: str, end: str | None, price: str | None = "0.45", **kw: object
) -> dict[str, object]:
    out: dict[str, object] = {
        "package": "v100-16g",
        "slice": slice_,
        "claim": slice_,
        "claimUID": "uid-" + slice_,
        "pod": slice_ + "-pod",
        "node": "node-1",
        "gpu": "GPU-1",
        "start": start,
        **kw,
    }
    if end:
        out["end"] = end
    if price:
        out["pricePerHour"], out["currency"] = price, "EUR"
    return out


OBJECTS = [
    (
        "team-a",
        GpuUsage.model_validate(
            {
                "month": "2026-12",
                "intervals": [
                    iv(
                        "llm",
                        "2026-12-05T08:00:00Z",
                        "2026-12-05T10:00:00Z",
                        peakMemoryBytes=3 * 2**30,
                        memoryLimitBytes=16 * 2**30,
                        meanUtilizationPercent=40.0,
                        observedSeconds=7200,
                        cards=0.5,
                    ),
                    iv("web", "2026-12-05T09:00:00Z", None, cards=0.5),
                ],
            }
        ),
    ),
    (
        "team-b",
        GpuUsage.model_validate(
            {
                "month": "2026-12",
                "intervals": [iv("train", "2026-12-04T00:00:00Z", "2026-12-04T01:30:00Z", None)],
            }
        ),
    ),
]


def test_the_period_is_this_month_a_named_month_or_since_until() -> None:
    assert period(args(), NOW) == (datetime(2026, 12, 1, tzinfo=UTC), NOW)
    assert period(args("--month", "2026-11"), NOW) == (
        datetime(2026, 11, 1, tzinfo=UTC),
        datetime(2026, 12, 1, tzinfo=UTC),
    )
    assert period(args("--since", "2026-12-05", "--until", "2026-12-05T10:30:00Z"), NOW) == (
        datetime(2026, 12, 5, tzinfo=UTC),
        datetime(2026, 12, 5, 10, 30, tzinfo=UTC),
    )
    with pytest.raises(UsageError, match="give one"):
        period(args("--month", "2026-11", "--since", "2026-11-02"), NOW)
    with pytest.raises(UsageError, match="--since 'yesterday'"):
        period(args("--since", "yesterday"), NOW)
    with pytest.raises(SystemExit):
        args("-n", "a", "-A")  # one or the other


def test_since_and_until_take_any_rfc3339_zone() -> None:
    # A time copied from a tool that writes its offset means the same instant as its Z form.
    assert period(
        args("--since", "2026-12-05T11:30:00+01:00", "--until", "2026-12-05T06:00:00-05:00"), NOW
    ) == (
        datetime(2026, 12, 5, 10, 30, tzinfo=UTC),
        datetime(2026, 12, 5, 11, 0, tzinfo=UTC),
    )
    with pytest.raises(UsageError, match="--until '2026-12-05T10:30:00': give 2026-12-05T10:00:00Z"):
        period(args("--until", "2026-12-05T10:30:00"), NOW)  # no zone: which one was meant?


def _outputs(output: str, since: datetime, until: datetime, with_rest: bool = False) -> str:
    rows = intervals_of(OBJECTS)
    usage = usage_rows(totals(rows, until, since))
    intervals = interval_rows(rows, since, until) if with_rest else None
    products = [
        Product("v100-8g", "Tesla V100-PCIE-32GB", 25),
        Product("v100-16g", "Tesla V100-PCIE-32GB", 50),
    ]
    advice = advice_rows(advise(rows, products, until)) if with_rest else None
    return render(output, since, until, usage, intervals, advice)


def test_json_has_namespace_package_slice_seconds_cost_and_currency() -> None:
    doc = json.loads(_outputs("json", datetime(2026, 12, 1, tzinfo=UTC), NOW, with_rest=True))
    rows = {(r["namespace"], r["package"], r["currency"]): r for r in doc["usage"]}
    a = rows[("team-a", "v100-16g", "EUR")]
    # llm 2 h closed, web open since 09:00 counted up to now (12:00): 5 h at 0.45.
    assert (a["sliceSeconds"], a["cost"], a["peakSlices"], a["intervals"]) == (5 * 3600, "2.25", 2, 2)
    b = rows[("team-b", "v100-16g", None)]
    assert (b["sliceSeconds"], b["cost"]) == (5400, None)
    web = next(x for x in doc["intervals"] if x["slice"] == "web")
    assert (web["end"], web["sliceSeconds"]) == (None, 3 * 3600)
    # llm peaked at 3 GiB of 16; web and train never showed a process on the GPU.
    assert {(x["slice"], x["advice"], x["suggest"]) for x in doc["advice"]} == {
        ("llm", "smaller", "v100-8g"),
        ("web", "idle", None),
        ("train", "idle", None),
    }


def test_since_until_clips_intervals_and_their_cost() -> None:
    doc = json.loads(
        _outputs("json", datetime(2026, 12, 5, 9, 30, tzinfo=UTC), datetime(2026, 12, 5, 10, 30, tzinfo=UTC))
    )
    (a,) = doc["usage"]
    # llm 09:30-10:00, web 09:30-10:30: 1.5 h.
    assert (a["namespace"], a["sliceSeconds"], a["cost"]) == ("team-a", 5400, "0.675")


def test_csv_and_table_carry_the_same_rows() -> None:
    since = datetime(2026, 12, 1, tzinfo=UTC)
    rows = list(csv.DictReader(io.StringIO(_outputs("csv", since, NOW))))
    assert [(r["namespace"], r["sliceSeconds"], r["cardSeconds"], r["cost"]) for r in rows] == [
        ("team-a", "18000", "9000.0", "2.25"),
        ("team-b", "5400", "", ""),
    ]
    table = _outputs("table", since, NOW, with_rest=True).splitlines()
    assert table[0] == "2026-12-01T00:00:00Z .. 2026-12-05T12:00:00Z"
    assert table[1].split() == [
        "NAMESPACE",
        "PACKAGE",
        "SLICE-HOURS",
        "CARD-HOURS",
        "PEAK",
        "INTERVALS",
        "COST",
        "CURRENCY",
    ]
    # team-a's slices are half a card each (5 slice-hours, 2.5 card-hours); team-b's month was
    # written before card-seconds were kept (no cards known: "-").
    assert table[2].split() == ["team-a", "v100-16g", "5.00", "2.50", "2", "2", "2.25", "EUR"]
    assert table[3].split() == ["team-b", "v100-16g", "1.50", "-", "1", "1", "-", "-"]
    assert any(
        line.startswith("team-a/llm (v100-16g): use a smaller package v100-8g: peak 3.0 GiB of 16.0 GiB")
        for line in table
    )


def test_borrowed_hours_are_shown_apart_where_any_were_borrowed() -> None:
    found = [
        (
            "team-b",
            GpuUsage.model_validate(
                {
                    "month": "2026-12",
                    "intervals": [
                        iv("own", "2026-12-05T08:00:00Z", "2026-12-05T10:00:00Z"),
                        iv("lent", "2026-12-05T09:00:00Z", "2026-12-05T09:30:00Z", borrowed=True),
                    ],
                }
            ),
        )
    ]
    rows = intervals_of(found)
    since = datetime(2026, 12, 1, tzinfo=UTC)
    usage = usage_rows(totals(rows, NOW, since))
    (row,) = usage
    assert (row["sliceSeconds"], row["borrowedSliceSeconds"], row["borrowedCost"]) == (9000, 1800, "0.225")
    table = render("table", since, NOW, usage, interval_rows(rows, since, NOW), None).splitlines()
    assert table[1].split()[-2:] == ["BORROWED-HOURS", "BORROWED-COST"]
    assert table[2].split()[-2:] == ["0.50", "0.23"]
    # Without borrowing, the table is as it always was.
    plain = usage_rows(totals(intervals_of(OBJECTS), NOW, since))
    assert "BORROWED-HOURS" not in render("table", since, NOW, plain, None, None)


def test_a_borrowed_price_prices_the_borrowed_hours_and_the_cost() -> None:
    found = [
        (
            "team-b",
            GpuUsage.model_validate(
                {
                    "month": "2026-12",
                    "intervals": [
                        iv(
                            "own", "2026-12-05T08:00:00Z", "2026-12-05T10:00:00Z", borrowedPricePerHour="0.30"
                        ),
                        iv(
                            "lent",
                            "2026-12-05T09:00:00Z",
                            "2026-12-05T09:30:00Z",
                            borrowed=True,
                            borrowedPricePerHour="0.30",
                        ),
                    ],
                }
            ),
        )
    ]
    rows = intervals_of(found)
    since = datetime(2026, 12, 1, tzinfo=UTC)
    (row,) = usage_rows(totals(rows, NOW, since))
    # own: 2 h at 0.45; lent: 0.5 h at the borrowed 0.30
    assert (row["borrowedSliceSeconds"], row["borrowedCost"], row["cost"]) == (1800, "0.15", "1.05")
    table = render("table", since, NOW, [row], interval_rows(rows, since, NOW), None).splitlines()
    assert table[2].split()[-1] == "0.15"
    # each interval row shows the rate it is billed at
    by_slice = {r["slice"]: r for r in interval_rows(rows, since, NOW)}
    assert (by_slice["own"]["pricePerHour"], by_slice["lent"]["pricePerHour"]) == ("0.45", "0.30")
    assert (by_slice["own"]["cost"], by_slice["lent"]["cost"]) == ("0.9", "0.15")
