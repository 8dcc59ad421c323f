"""Real usage into status: what status.usage says and when it is written (shim bypasses:
test_attribution.py)."""

from __future__ import annotations

from gpuslice.agent.usage import should_write, usage_status
from gpuslice.shim.region import ProcessUsage, UsageSnapshot

GIB = 1024**3


def _snapshot(used: int, procs: list[tuple[int, int]], refused: int = 0) -> UsageSnapshot:
    return UsageSnapshot(
        initialized=True, version=1, memory_limit_bytes=8 * GIB, memory_used_bytes=used, compute_share=25,
        processes=[
            ProcessUsage(pid=pid, start_time=1, memory_used_bytes=b, memory_granted_bytes=b,
                         memory_peak_bytes=b, context_overhead_bytes=0, refused_allocations=0,
                         throttled_seconds=0.0)
            for pid, b in procs
        ],
        refused_allocations_total=refused, throttled_seconds_total=0.5, shim_utilization_percent=23.0,
        shim_utilization_time=1.0, throttle_delay_ns=0, lock_recoveries_total=0,
    )  # fmt: skip


def test_usage_status_reports_memory_processes_and_refusals() -> None:
    usage = usage_status(
        _snapshot(3 * GIB, [(7, 2 * GIB), (3, GIB)], refused=2), 8 * GIB, "2026-12-02T00:00:00Z"
    )
    assert usage["memoryUsedBytes"] == 3 * GIB
    assert usage["memoryLimitBytes"] == 8 * GIB
    assert [p["pid"] for p in usage["processes"]] == [3, 7]
    assert usage["refusedAllocations"] == 2
    assert usage["computeUtilizationPercent"] == 23.0
    assert "violation" not in usage


def test_no_write_when_only_the_time_changed_and_at_most_one_per_interval() -> None:
    a = usage_status(_snapshot(GIB, [(1, GIB)]), 8 * GIB, "t1")
    same_later = usage_status(_snapshot(GIB, [(1, GIB)]), 8 * GIB, "t2")
    changed = usage_status(_snapshot(2 * GIB, [(1, 2 * GIB)]), 8 * GIB, "t3")
    assert should_write(None, a, None, 0.0, 10.0)
    assert not should_write(a, same_later, 0.0, 100.0, 10.0)
    assert not should_write(a, changed, 0.0, 5.0, 10.0)  # changed, but inside the interval
    assert should_write(a, changed, 0.0, 10.0, 10.0)
