"""RFC 3339 timestamps as the Kubernetes API server writes them, always in UTC with a `Z`.

Two forms, as in the API's types: metav1.Time, whole seconds (`2026-12-05T10:00:00Z`: conditions'
lastTransitionTime, Events' first/lastTimestamp, the ledger's intervals), and metav1.MicroTime,
microseconds (`2026-12-05T10:00:00.123456Z`: a Lease's renewTime). Pure: no clock is read here.

A naive datetime (no tzinfo) is refused, when formatting and when parsing: whether it meant UTC or
the machine's local time cannot be told, and a wrong guess moves a bill or a heartbeat by hours. The
one producer of zone-less times the product reads (Kopf's peering `lastseen` in versions that wrote
`datetime.utcnow()`) is parsed with `assume_utc=True`, which says so where it is called.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime

#: RFC 3339's date-time: a `T` (or `t`) between date and time, optional fraction, `Z` or an offset.
#: (`datetime.fromisoformat` alone takes other ISO 8601 forms too: week dates, no separators.)
_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})?")

_EXAMPLE = "2026-12-05T10:00:00Z"


def _utc(value: datetime) -> datetime:
    """`value` in UTC; naive refused."""
    if value.tzinfo is None:
        raise ValueError(
            f"datetime {value.isoformat()} has no zone; give an aware one, e.g. datetime.now(UTC)"
        )
    return value.astimezone(UTC)


def rfc3339(value: datetime) -> str:
    """metav1.Time: UTC, whole seconds (a fraction is cut off, as the API server does)."""
    t = value if value.tzinfo is UTC else _utc(value)
    # Formatted by hand: strftime's %Y does not pad years before 1000, and this runs for every
    # interval of a ledger month.
    return f"{t.year:04d}-{t.month:02d}-{t.day:02d}T{t.hour:02d}:{t.minute:02d}:{t.second:02d}Z"


def micro_time(value: datetime) -> str:
    """metav1.MicroTime: UTC, six fraction digits."""
    t = value if value.tzinfo is UTC else _utc(value)
    return (
        f"{t.year:04d}-{t.month:02d}-{t.day:02d}"
        f"T{t.hour:02d}:{t.minute:02d}:{t.second:02d}.{t.microsecond:06d}Z"
    )


def parse_rfc3339(value: str, *, assume_utc: bool = False) -> datetime:
    """An aware UTC datetime from RFC 3339 with `Z` or an offset, with or without a fraction
    (digits past the sixth are cut off). A time without a zone is refused unless `assume_utc`."""
    match = _RFC3339.fullmatch(value)
    if match is None:
        raise ValueError(f"time {value!r} is not RFC 3339; write it like {_EXAMPLE}")
    if match[2] is None and not assume_utc:
        raise ValueError(f"time {value!r} has no zone; write it like {_EXAMPLE}")
    try:
        # Upper case: Python before 3.12 takes neither a `t` separator nor a `z` zone.
        t = datetime.fromisoformat(value.upper())
    except ValueError as exc:  # a 13th month, a 25th hour...
        raise ValueError(f"time {value!r} is not a valid date and time: {exc}") from None
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)
