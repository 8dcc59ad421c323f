"""The agent's one boundary to NVML (nvidia-ml-py): initialisation, device handles and every query.

No other agent module imports pynvml; each asks this one for plain Python values, so what the agent
knows of the driver, and which NVML errors it expects, is in one place (as `nvlib.go` is in NVIDIA's
DRA driver). NVML's own init is reference-counted: each `session()` opens and closes one reference,
so the sessions of the reporting loops nest inside whatever reference another loop holds.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pynvml

from gpuslice import logs
from gpuslice.domain.gpu_processes import GpuProcess

log = logs.get(__name__)

#: every NVML failure the agent sees; callers catch this, never a pynvml class
Error = pynvml.NVMLError


@dataclass(frozen=True)
class DeviceFacts:
    """What NVML says about one physical GPU, as NVML says it."""

    index: int
    uuid: str
    name: str
    memory_total: int
    compute_capability: tuple[int, int]
    minor_number: int
    pci_bus_id: str


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@contextmanager
def session() -> Iterator[None]:
    """One NVML reference for the block (raises `Error` when the driver cannot be initialised)."""
    pynvml.nvmlInit()
    try:
        yield
    finally:
        pynvml.nvmlShutdown()


def driver_versions() -> tuple[str, int]:
    """The driver version as NVML prints it ("535.104.05") and the CUDA driver version (12020)."""
    return _text(pynvml.nvmlSystemGetDriverVersion()), int(pynvml.nvmlSystemGetCudaDriverVersion())


def devices() -> list[DeviceFacts]:
    """Every GPU NVML reports, in index order."""
    out = []
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
        out.append(
            DeviceFacts(
                index=index,
                uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                name=_text(pynvml.nvmlDeviceGetName(handle)),
                memory_total=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                compute_capability=(int(major), int(minor)),
                minor_number=int(pynvml.nvmlDeviceGetMinorNumber(handle)),
                pci_bus_id=_text(pynvml.nvmlDeviceGetPciInfo(handle).busId),
            )
        )
    return out


def compute_processes(gpu_uuids: Sequence[str]) -> list[GpuProcess]:
    """Compute processes of the given GPUs (host PIDs and their memory); a card whose query fails is
    logged and skipped, since the others' processes still count."""
    if not gpu_uuids:
        return []
    with session():
        out: list[GpuProcess] = []
        for uuid in gpu_uuids:
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
                procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            except pynvml.NVMLError as exc:
                log.warning("NVML process query failed", gpu=uuid, error=str(exc))
                continue
            for p in procs:
                used = p.usedGpuMemory
                if used is None or used == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
                    continue
                out.append(GpuProcess(uuid, int(p.pid), int(used)))
        return out


@dataclass
class UtilizationMeter:
    """One GPU's per-process utilization (host PIDs), sample by sample; call inside a `session()`."""

    gpu_uuid: str
    last_seen_us: int = 0

    def samples(self) -> list[tuple[int, float]] | None:
        """New (pid, smUtil) samples since the last call; None when NVML has nothing new."""
        handle = pynvml.nvmlDeviceGetHandleByUUID(self.gpu_uuid)
        if self.last_seen_us == 0:  # the first call would return the whole history
            self.last_seen_us = int(time.time() * 1e6) - 500_000
        try:
            raw = pynvml.nvmlDeviceGetProcessUtilization(handle, self.last_seen_us)
        except pynvml.NVMLError_NotFound:
            return None
        if not raw:
            return None
        self.last_seen_us = max(self.last_seen_us, *(int(r.timeStamp) for r in raw))
        return [(int(r.pid), float(r.smUtil)) for r in raw]
