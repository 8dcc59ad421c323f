"""Whether a slice's software can use its GPU, from what the agent read in the slice's usage region.

Two conditions a tenant reads in `kubectl describe gpuslice` and `gpuslice explain`:
- SoftwareCompatible=False when a process loaded kernels with no image for the GPU (a CUDA 13 build
  on a V100: CUDA 13 dropped sm_70), PTX newer than the driver compiles, or a CUDA runtime newer than
  the driver; it clears when a later process loads kernels that run.
- GpuIdle=True when the slice has been held for the agent's idle threshold with no process ever
  creating a CUDA context: software that checks the GPU itself and quietly runs on the CPU leaves no
  error, only this (the slice is still billed).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpuslice.api.package import Condition

SOFTWARE_COMPATIBLE = "SoftwareCompatible"
GPU_IDLE = "GpuIdle"


def _archs(sw: Mapping[str, Any]) -> str:
    archs = list(sw.get("imageArchitectures") or [])
    count = sw.get("imageCount") or len(archs)
    listed = ", ".join(archs) if archs else "no image this parser reads"
    return listed + (f" (and {count - len(archs)} more)" if count > len(archs) else "")


def _who(sw: Mapping[str, Any]) -> str:
    return f"process {sw.get('process') or '?'} (pid {sw.get('pid', '?')})"


def software_message(sw: Mapping[str, Any], gpu_model: str | None) -> str:
    """What went wrong and what to do, for the tenant."""
    gpu = sw.get("gpuArchitecture") or "this GPU's architecture"
    card = f"{gpu_model}, {gpu}" if gpu_model else gpu
    driver = sw.get("driverCudaVersion") or "?"
    reason = sw.get("reason")
    if reason == "DriverTooOld":
        runtime = sw.get("runtimeCudaVersion") or "a newer CUDA"
        return (
            f"{_who(sw)} uses the CUDA {runtime} runtime; the node's driver supports CUDA {driver}, so the "
            f"runtime refuses to start (cudaErrorInsufficientDriver). Use an image built with CUDA "
            f"{driver.split('.')[0]}.x (on a V100 a CUDA 12 build: CUDA 13 also dropped sm_70), or ask the "
            "platform team for a package on nodes with a newer driver"
        )
    if reason == "PtxTooNewForDriver":
        return (
            f"{_who(sw)} loaded kernels with only PTX the node's driver (CUDA {driver}) cannot compile "
            f"({_archs(sw)}) and no binary for the GPU ({card}). Use a build that carries {gpu} code, or "
            f"one compiled with CUDA {driver} or older"
        )
    library = sw.get("library")
    origin = f" (in {library})" if library else ""
    return (
        f"{_who(sw)} loaded kernels built for {_archs(sw)}{origin}; none runs on the slice's GPU ({card}): "
        f"'no kernel image is available for execution on the device'. Use a build of your software that "
        f"includes {gpu} (or compute_{gpu.removeprefix('sm_')} PTX) — CUDA 13 builds and PyTorch's newest "
        f"wheels no longer include Volta (sm_70) —{_torch_advice(library, gpu)} or a package on a newer GPU"
    )


def _torch_advice(library: object, gpu: str) -> str:
    """Which PyTorch still runs on a V100, when the kernels were PyTorch's (libtorch_cuda.so): its
    CUDA 13 wheels on PyPI carry sm_75 and newer only; its CUDA 12.6 builds keep Volta (what PyTorch's
    own warning tells), and so does torch 2.9.1 from PyPI (CUDA 12.8)."""
    if gpu != "sm_70" or not str(library or "").startswith("libtorch"):
        return ""
    return (
        " for PyTorch: the CUDA 12.6 build of the same version (pip install torch==<version> --index-url "
        "https://download.pytorch.org/whl/cu126), or torch 2.9.1 from PyPI (CUDA 12.8), which carry sm_70; "
    )


def software_conditions(
    usage: Mapping[str, Any] | None, gpu_model: str | None, generation: int | None
) -> list[Condition]:
    """SoftwareCompatible and GpuIdle of an allocated slice, from its status.usage."""
    usage = usage or {}
    sw = usage.get("software")
    compatible = Condition(
        type=SOFTWARE_COMPATIBLE,
        status="False" if sw else "True",
        reason=str(sw.get("reason")) if sw else "NoIncompatibleImages",
        message=software_message(sw, gpu_model)
        if sw
        else "no process of the slice has loaded software that cannot run on its GPU",
        observedGeneration=generation,
    )
    idle_since = usage.get("gpuIdleSince")
    if idle_since:
        idle = Condition(
            type=GPU_IDLE,
            status="True",
            reason="NoGpuUse",
            message=(
                f"held since {idle_since} and no process has created a CUDA context: the software may not "
                f"support this GPU{f' ({gpu_model})' if gpu_model else ''} and run on the CPU instead, "
                "silently (check its logs for the GPU it found). The slice is still billed: delete it if "
                "it is not needed"
            ),
            observedGeneration=generation,
        )
    else:
        used = usage.get("firstGpuUseTime")
        idle = Condition(
            type=GPU_IDLE,
            status="False",
            reason="GpuUsed" if used else "NotIdleYet",
            message=f"first used at {used}" if used else "no GPU use yet, within the agent's idle allowance",
            observedGeneration=generation,
        )
    return [compatible, idle]


#: Conditions whose turn to this status is told to the tenant as a Warning Event (type -> status).
_WARN_WHEN = {SOFTWARE_COMPATIBLE: "False", GPU_IDLE: "True"}


def warnings_raised(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(event reason, message) for each software condition that turned bad between two statuses, or
    changed its reason while bad (another kind of incompatibility)."""

    def bad(status: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
        return {
            c["type"]: (c.get("reason", ""), c.get("message", ""))
            for c in status.get("conditions") or []
            if _WARN_WHEN.get(c.get("type", "")) == c.get("status")
        }

    was, now = bad(before), bad(after)
    return [now[t] for t in _WARN_WHEN if t in now and was.get(t, ("",))[0] != now[t][0]]
