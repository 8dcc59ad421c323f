"""GPU discovery through NVML (nvidia-ml-py) and the facts the agent publishes about each card.

The same code path serves real and simulated nodes: on a simulated node the dev tooling starts the
agent with the NVIDIA driver test double on its library path (`gpuslice_dev.gpusim.simulate`), so
`pynvml.nvmlInit()` binds to it and nothing in the agent knows the difference.
"""

from __future__ import annotations

import re
from types import ModuleType
from typing import Any

import pynvml
from pydantic import BaseModel, ConfigDict

from gpuslice import logs

log = logs.get(__name__)


class GpuInfo(BaseModel):
    """What NVML says about one physical GPU."""

    model_config = ConfigDict(frozen=True)

    index: int
    uuid: str
    product_name: str
    memory_bytes: int
    cuda_compute_capability: str  # "7.0"
    driver_version: str  # as NVML prints it, e.g. "535.104.05"
    cuda_driver_version: str  # "12.2"
    minor_number: int
    pci_bus_id: str


class DiscoveryError(RuntimeError):
    """NVML could not be initialised or queried; the message says what to check."""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def discover(nvml: ModuleType = pynvml) -> list[GpuInfo]:
    """Query every GPU NVML reports. `nvml` is the pynvml module (a parameter only for unit tests)."""
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        raise DiscoveryError(
            f"NVML initialisation failed ({exc}); is the NVIDIA driver installed and "
            "libnvidia-ml.so.1 on the library path? On a machine without GPUs, run the agent through "
            "`gpuslice-dev devcluster up --simulate-gpus SPEC`, which points it at the driver test double."
        ) from exc
    try:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        cuda = int(nvml.nvmlSystemGetCudaDriverVersion())
        cuda_version = f"{cuda // 1000}.{(cuda % 1000) // 10}"
        gpus = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
            gpus.append(
                GpuInfo(
                    index=index,
                    uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                    product_name=_text(nvml.nvmlDeviceGetName(handle)),
                    memory_bytes=int(nvml.nvmlDeviceGetMemoryInfo(handle).total),
                    cuda_compute_capability=f"{major}.{minor}",
                    driver_version=driver,
                    cuda_driver_version=cuda_version,
                    minor_number=int(nvml.nvmlDeviceGetMinorNumber(handle)),
                    pci_bus_id=_text(nvml.nvmlDeviceGetPciInfo(handle).busId),
                )
            )
        return gpus
    except nvml.NVMLError as exc:
        raise DiscoveryError(f"NVML query failed: {exc}") from exc
    finally:
        nvml.nvmlShutdown()


_NUMBER = re.compile(r"\d+")


def semver(version: str) -> str:
    """A DRA `version` attribute from an NVIDIA version string: "535.104.05" -> "535.104.5",
    "7.0" -> "7.0.0". Semver forbids leading zeros, so each numeric part is normalised."""
    parts = [str(int(p)) for p in _NUMBER.findall(version)][:3]
    if not parts:
        raise ValueError(f"version {version!r} has no numeric part")
    return ".".join(parts + ["0"] * (3 - len(parts)))
