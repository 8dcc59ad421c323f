"""RFC 3339 as the API server writes it (gpuslice.timefmt): metav1.Time and MicroTime out, any RFC 3339
zone in, naive datetimes refused."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuslice.timefmt import micro_time, parse_rfc3339, rfc3339

AT = datetime(2026, 12, 5, 10, 0, 7, 999_999, tzinfo=UTC)

aware = st.datetimes(
    min_value=datetime(1, 1, 2),
    max_value=datetime(9999, 12, 30),
    timezones=st.sampled_from([UTC, timezone(timedelta(hours=-5)), timezone(timedelta(hours=5, minutes=30))]),
)


def test_time_has_whole_seconds_and_micro_time_six_digits_both_in_utc_with_z() -> None:
    assert rfc3339(AT) == "2026-12-05T10:00:07Z"  # cut off, never rounded up to :08
    assert micro_time(AT) == "2026-12-05T10:00:07.999999Z"
    assert micro_time(AT.replace(microsecond=5)) == "2026-12-05T10:00:07.000005Z"
    east = AT.astimezone(timezone(timedelta(hours=2)))
    assert (rfc3339(east), micro_time(east)) == (rfc3339(AT), micro_time(AT))
    assert rfc3339(datetime(999, 1, 2, tzinfo=UTC)) == "0999-01-02T00:00:00Z"


@given(aware)
def test_what_is_written_reads_back_as_the_same_instant(t: datetime) -> None:
    assert parse_rfc3339(micro_time(t)) == t
    assert parse_rfc3339(rfc3339(t)) == t.replace(microsecond=0)
    assert parse_rfc3339(t.isoformat()) == t
    assert parse_rfc3339(rfc3339(t)).tzinfo is UTC


@pytest.mark.parametrize(
    "text",
    [
        "2026-12-05T10:00:00Z",
        "2026-12-05T10:00:00+00:00",
        "2026-12-05t10:00:00z",
        "2026-12-05T10:00:00.000Z",
        "2026-12-05T05:00:00-05:00",
        "2026-12-05T15:30:00+05:30",
    ],
)
def test_any_zone_reads_as_the_same_utc_instant(text: str) -> None:
    t = parse_rfc3339(text)
    assert t == datetime(2026, 12, 5, 10, 0, tzinfo=UTC)
    assert t.tzinfo is UTC


def test_fraction_digits_past_the_sixth_are_cut_off() -> None:
    assert parse_rfc3339("2026-12-05T10:00:00.1234567891Z").microsecond == 123456


def test_naive_datetimes_are_refused_not_guessed() -> None:
    naive = datetime(2026, 12, 5, 10, 0)
    for write in (rfc3339, micro_time):
        with pytest.raises(ValueError, match=r"no zone; give an aware one, e\.g\. datetime\.now\(UTC\)"):
            write(naive)
    with pytest.raises(ValueError, match="has no zone; write it like 2026-12-05T10:00:00Z"):
        parse_rfc3339("2026-12-05T10:00:00")
    # Only where the caller says so (Kopf's older peering lastseen) is a zone-less time UTC.
    assert parse_rfc3339("2026-12-05T10:00:00.5", assume_utc=True) == datetime(
        2026, 12, 5, 10, 0, 0, 500_000, tzinfo=UTC
    )


@pytest.mark.parametrize(
    "text",
    [
        "",
        "2026-12-05",
        "2026-12-05 10:00:00Z",
        "20261205T100000Z",
        "2026-W49-6T10:00:00Z",
        "2026-12-05T10:00Z",
    ],
)
def test_what_is_not_rfc3339_is_refused_with_an_example(text: str) -> None:
    with pytest.raises(ValueError, match="is not RFC 3339; write it like 2026-12-05T10:00:00Z"):
        parse_rfc3339(text)


def test_an_impossible_date_is_refused() -> None:
    with pytest.raises(ValueError, match="not a valid date and time"):
        parse_rfc3339("2026-02-30T10:00:00Z")
