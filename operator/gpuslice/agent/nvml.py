"""The agent's one boundary to NVML (nvidia-ml-py): initialisation, device handles and every query.

No other agent module imports pynvml; each asks this one for plain Python values, so what the agent
knows of the driver, and which NVML errors it expects, is in one place (as `nvlib.go` is in NVIDIA's
DRA driver). NVML's own init is reference-counted: each `session()` opens and closes one reference,
so the sessions of the reporting loops nest inside whatever reference another loop holds.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
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
    """Every GPU NVML reports, in index order; a card that is lost (fallen off the bus) is left out
    with a warning, since NVML cannot say what it is."""
    out = []
    for index in range(pynvml.nvmlDeviceGetCount()):
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except pynvml.NVMLError_GpuIsLost:
            log.warning("GPU is lost (fallen off the bus); not discovered", gpu=index)
            continue
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
                procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle(uuid))
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
        h = handle(self.gpu_uuid)
        if self.last_seen_us == 0:  # the first call would return the whole history
            self.last_seen_us = int(time.time() * 1e6) - 500_000
        try:
            raw = pynvml.nvmlDeviceGetProcessUtilization(h, self.last_seen_us)
        except pynvml.NVMLError_NotFound:
            return None
        if not raw:
            return None
        self.last_seen_us = max(self.last_seen_us, *(int(r.timeStamp) for r in raw))
        return [(int(r.pid), float(r.smUtil)) for r in raw]


def _lost() -> pynvml.NVMLError:
    return pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)


def handle(uuid: str) -> Any:
    """The card's handle. NVML's lookup by UUID fails for every card while any card is lost, so
    then the answering cards are searched by index; the lost card itself raises GPU_IS_LOST."""
    try:
        return pynvml.nvmlDeviceGetHandleByUUID(uuid)
    except pynvml.NVMLError_GpuIsLost:
        pass
    for index in range(pynvml.nvmlDeviceGetCount()):
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(index)
            if _text(pynvml.nvmlDeviceGetUUID(h)) == uuid:
                return h
        except pynvml.NVMLError_GpuIsLost:
            continue
    raise _lost()


def is_lost(exc: BaseException) -> bool:
    return isinstance(exc, pynvml.NVMLError_GpuIsLost)


@dataclass(frozen=True)
class CardProbe:
    """What NVML shows of one card's health."""

    lost: bool = False
    pending: bool = False  # a page retirement or row remap waits for a reset
    remap_failed: bool = False


def probe(uuid: str) -> CardProbe:
    """The card's health as NVML shows it (call inside a `session()`)."""
    try:
        h = handle(uuid)
        try:
            pending = bool(pynvml.nvmlDeviceGetRetiredPagesPendingStatus(h))
        except pynvml.NVMLError_NotSupported:
            pending = False
        try:
            _corrected, _uncorrected, remap_pending, failed = pynvml.nvmlDeviceGetRemappedRows(h)
        except pynvml.NVMLError_NotSupported:  # row remapping exists from Ampere on
            remap_pending, failed = 0, 0
    except pynvml.NVMLError_GpuIsLost:
        return CardProbe(lost=True)
    return CardProbe(pending=pending or bool(remap_pending), remap_failed=bool(failed))


def _address(h: Any) -> int | None:
    return ctypes.cast(h, ctypes.c_void_p).value


class XidWatch:
    """An NVML event set with the XID events (nvmlEventTypeXidCriticalError) of the given cards
    registered. It holds its own NVML reference until `close()`; `wait` blocks, so it runs in a
    thread of its own. Cards lost at registration are in `unregistered`."""

    def __init__(self, uuids: Sequence[str]) -> None:
        pynvml.nvmlInit()
        self._set: Any = None
        self._uuids: dict[int | None, str] = {}
        self.unregistered: set[str] = set()
        try:
            self._set = pynvml.nvmlEventSetCreate()
            for uuid in uuids:
                try:
                    h = handle(uuid)
                    pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, self._set)
                    self._uuids[_address(h)] = uuid
                except pynvml.NVMLError_GpuIsLost:
                    self.unregistered.add(uuid)
        except BaseException:
            self.close()
            raise

    def wait(self, timeout_ms: int) -> tuple[str, int] | None:
        """(card UUID, XID) of the next XID event, or None when none came within the timeout."""
        try:
            e = pynvml.nvmlEventSetWait_v2(self._set, timeout_ms)
        except pynvml.NVMLError_Timeout:
            return None
        if not e.eventType & pynvml.nvmlEventTypeXidCriticalError:
            return None
        uuid = self._uuids.get(_address(e.device))
        if uuid is None:
            return None
        return uuid, int(e.eventData)

    def close(self) -> None:
        if self._set is not None:
            with suppress(pynvml.NVMLError):
                pynvml.nvmlEventSetFree(self._set)
            self._set = None
        pynvml.nvmlShutdown()
