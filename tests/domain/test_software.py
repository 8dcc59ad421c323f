"""SoftwareCompatible and GpuIdle: what a tenant is told when its software cannot use the slice's GPU."""

from __future__ import annotations

from typing import Any

from gpuslice.domain.slice_status import slice_status
from gpuslice.domain.views import claim_view, pod_view
from support import allocated_claim

NOW = "2026-12-05T12:00:00Z"
NO_VOLTA = {
    "reason": "NoKernelImageForGpu", "process": "python3", "pid": 7,
    "imageArchitectures": ["sm_75", "sm_80", "sm_90", "compute_90"], "imageCount": 4, "cudaError": 209,
    "gpuArchitecture": "sm_70", "driverCudaVersion": "12.2", "time": "2026-12-05T11:59:00Z",
}  # fmt: skip


def status_with(usage: dict[str, Any] | None, previous: Any = None) -> dict[str, Any]:
    # facts() of the status tests, with the slice allocated and its pod running
    from domain.test_views_status import facts, pod  # type: ignore[import-not-found]

    claim = claim_view(allocated_claim("ns", "s", "n0", "gpu-0-v100-8g-1", reserved_for=["p"]))
    running = pod_view(pod("p", claim="s", node=True, phase="Running"))
    st = slice_status(facts(claims=[claim], pods=[running], usage=usage, previous=previous), NOW)
    return {"status": st, "conditions": {c.type: c for c in st.conditions}}


def test_a_build_without_the_gpus_architecture_says_what_it_carries_and_what_to_do() -> None:
    cond = status_with({"software": NO_VOLTA})["conditions"]["SoftwareCompatible"]
    assert (cond.status, cond.reason) == ("False", "NoKernelImageForGpu")
    for part in (
        "python3",
        "sm_75, sm_80, sm_90, compute_90",
        "Tesla V100-PCIE-32GB, sm_70",
        "includes sm_70",
    ):
        assert part in cond.message


def test_pytorchs_kernels_on_a_v100_name_the_library_and_the_builds_that_carry_volta() -> None:
    torch = {**NO_VOLTA, "library": "libtorch_cuda.so"}
    message = status_with({"software": torch})["conditions"]["SoftwareCompatible"].message
    assert "(in libtorch_cuda.so)" in message
    assert "https://download.pytorch.org/whl/cu126" in message and "torch 2.9.1 from PyPI" in message
    # another library's kernels are not told to install PyTorch
    other = {**NO_VOLTA, "library": "libggml-cuda.so"}
    message = status_with({"software": other})["conditions"]["SoftwareCompatible"].message
    assert "(in libggml-cuda.so)" in message and "torch" not in message
    # nor is PyTorch on a GPU its CUDA 12.6 builds are not about
    pascal = {**torch, "gpuArchitecture": "sm_60"}
    assert "cu126" not in status_with({"software": pascal})["conditions"]["SoftwareCompatible"].message


def test_a_runtime_newer_than_the_driver_is_named_with_the_versions() -> None:
    sw = {"reason": "DriverTooOld", "process": "ollama", "pid": 1, "runtimeCudaVersion": "13.0",
          "driverCudaVersion": "12.2", "imageArchitectures": [], "imageCount": 0}  # fmt: skip
    cond = status_with({"software": sw})["conditions"]["SoftwareCompatible"]
    assert (cond.status, cond.reason) == ("False", "DriverTooOld")
    assert "CUDA 13.0 runtime" in cond.message and "supports CUDA 12.2" in cond.message
    assert "CUDA 12.x" in cond.message


def test_compatible_software_and_no_record_read_true() -> None:
    conds = status_with({"memoryUsedBytes": 1, "firstGpuUseTime": "2026-12-05T11:00:00Z"})["conditions"]
    assert conds["SoftwareCompatible"].status == "True"
    assert (conds["GpuIdle"].status, conds["GpuIdle"].reason) == ("False", "GpuUsed")


def test_the_condition_clears_when_the_record_is_gone_and_its_time_moves_only_on_flips() -> None:
    bad = status_with({"software": NO_VOLTA})["status"]
    good = status_with({"firstGpuUseTime": NOW}, previous=bad)["conditions"]["SoftwareCompatible"]
    assert good.status == "True"
    again = status_with({"software": NO_VOLTA}, previous=bad)["conditions"]["SoftwareCompatible"]
    before = {c.type: c for c in bad.conditions}["SoftwareCompatible"]
    assert again.last_transition_time == before.last_transition_time


def test_a_slice_held_without_gpu_use_is_reported_idle_and_still_billed() -> None:
    conds = status_with({"gpuIdleSince": "2026-12-05T11:40:00Z"})["conditions"]
    idle = conds["GpuIdle"]
    assert (idle.status, idle.reason) == ("True", "NoGpuUse")
    assert "11:40:00Z" in idle.message and "still billed" in idle.message and "CPU" in idle.message


def test_an_unallocated_slice_has_neither_condition() -> None:
    from domain.test_views_status import facts, unallocated_claim  # type: ignore[import-not-found]

    st = slice_status(facts(claims=[unallocated_claim()], usage={"software": NO_VOLTA}), NOW)
    assert not {"SoftwareCompatible", "GpuIdle"} & {c.type for c in st.conditions}


def test_a_warning_event_when_a_condition_turns_bad_and_none_while_it_stays() -> None:
    from gpuslice.domain.software import warnings_raised

    good = status_with({"firstGpuUseTime": NOW})["status"].model_dump(by_alias=True, mode="json")
    bad = status_with({"software": NO_VOLTA})["status"].model_dump(by_alias=True, mode="json")
    idle = status_with({"gpuIdleSince": NOW})["status"].model_dump(by_alias=True, mode="json")
    assert [r for r, _ in warnings_raised(good, bad)] == ["NoKernelImageForGpu"]
    assert warnings_raised(bad, bad) == [] and warnings_raised(bad, good) == []
    assert [r for r, _ in warnings_raised(good, idle)] == ["NoGpuUse"]
    assert [r for r, _ in warnings_raised({}, bad)] == ["NoKernelImageForGpu"]
