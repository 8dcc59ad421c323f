"""When a refused GpuSlice claim is applied again."""

from __future__ import annotations

from gpuslice.domain.claim_retry import (
    QUOTA_RETRY_MAX_SECONDS,
    REFUSED_RETRY_MAX_SECONDS,
    quota_retry_delay,
    refused_retry_delay,
)


def test_a_slice_refused_for_quota_waits_for_the_quota_event_while_the_quota_shows_no_room() -> None:
    assert quota_retry_delay(quota_full=True, refusals=0) is None
    assert quota_retry_delay(quota_full=True, refusals=5) is None


def test_room_shown_by_the_quota_event_is_tried_at_once() -> None:
    assert quota_retry_delay(quota_full=False, refusals=0) == 0.0


def test_a_refusal_while_the_quota_shows_room_is_tried_again_within_seconds_growing() -> None:
    # The quota event that showed the room came before the refusal: no other comes before the
    # resync, which left a tenant's freed slot unused for up to 30 s.
    delays = [quota_retry_delay(quota_full=False, refusals=n) for n in range(1, 8)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0]
    assert max(d for d in delays if d is not None) == QUOTA_RETRY_MAX_SECONDS


def test_other_refusals_back_off_to_half_a_minute() -> None:
    assert [refused_retry_delay(n) for n in range(0, 8)] == [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert refused_retry_delay(100) == REFUSED_RETRY_MAX_SECONDS
