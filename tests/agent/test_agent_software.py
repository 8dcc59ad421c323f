"""status.usage says what the slice's software could not do on the GPU and whether the GPU is used."""

from __future__ import annotations

from gpuslice.agent.usage import idle_since, usage_status
from gpuslice.shim.region import ProcessUsage, UsageSnapshot
from gpuslice.shim.software import SoftwareKind, SoftwareRecord, SoftwareState

NOW = "2026-12-05T12:00:00Z"
RECORD = SoftwareRecord(
    kind=SoftwareKind.NO_KERNEL_IMAGE, cuda_error=209, device_arch=70, driver_version=12020,
    runtime_version=0, pid=7, process="python3", image_architectures=["sm_80", "compute_90"],
    image_count=2, time=1_796_400_000.0,
)  # fmt: skip


def snapshot(software: SoftwareState, used: int = 0) -> UsageSnapshot:
    procs = [] if not used else [ProcessUsage(
        pid=7, start_time=1, memory_used_bytes=used, memory_granted_bytes=used, memory_peak_bytes=used,
        context_overhead_bytes=0, refused_allocations=0, throttled_seconds=0.0)]  # fmt: skip
    return UsageSnapshot(
        initialized=True, version=1, memory_limit_bytes=8 << 30, memory_used_bytes=used, compute_share=25,
        processes=procs, refused_allocations_total=0, throttled_seconds_total=0.0,
        shim_utilization_percent=None, shim_utilization_time=None, throttle_delay_ns=0,
        lock_recoveries_total=0, software=software,
    )  # fmt: skip


def test_a_record_reaches_status_usage_until_a_later_image_loads_fine() -> None:
    bad = usage_status(
        snapshot(SoftwareState(record=RECORD, compatible_time=None, first_use_time=None)), 1, NOW
    )
    assert bad["software"] == {
        "reason": "NoKernelImageForGpu", "process": "python3", "pid": 7,
        "imageArchitectures": ["sm_80", "compute_90"], "imageCount": 2, "cudaError": 209,
        "time": "2026-12-04T16:00:00Z", "gpuArchitecture": "sm_70",
        "driverCudaVersion": "12.2",
    }  # fmt: skip
    fixed = SoftwareState(record=RECORD, compatible_time=RECORD.time + 5, first_use_time=RECORD.time + 5)
    good = usage_status(snapshot(fixed), 1, NOW)
    assert "software" not in good and good["firstGpuUseTime"] == "2026-12-04T16:00:05Z"


def test_idle_only_past_the_threshold_and_only_without_any_gpu_use() -> None:
    unused = snapshot(SoftwareState(record=None, compatible_time=None, first_use_time=None))
    assert idle_since(unused, held_since=1000.0, now=1599.0, idle_after=600) is None
    assert idle_since(unused, held_since=1000.0, now=1600.0, idle_after=600) == 1000.0
    assert usage_status(unused, 1, NOW, idle_since=1000.0)["gpuIdleSince"] == "1970-01-01T00:16:40Z"
    holding = snapshot(SoftwareState(record=None, compatible_time=None, first_use_time=None), used=1 << 20)
    assert idle_since(holding, held_since=1000.0, now=5000.0, idle_after=600) is None
    used = snapshot(SoftwareState(record=None, compatible_time=None, first_use_time=1200.0))
    assert idle_since(used, held_since=1000.0, now=5000.0, idle_after=600) is None
    assert "gpuIdleSince" not in usage_status(used, 1, NOW, idle_since=1000.0)
