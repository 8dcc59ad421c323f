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
from gpuslice.domain.mig import MigProfile

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
    #: PCI bus ids at the far end of each active NVLink (empty on PCIe boards, which have none)
    nvlink_remote_bus_ids: tuple[str, ...] = ()


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
                nvlink_remote_bus_ids=_nvlink_remotes(handle),
            )
        )
    return out


def _nvlink_remotes(handle: Any) -> tuple[str, ...]:
    """The bus id at the other end of every active NVLink of the card. NVML answers NotSupported for
    a board without NVLink (or a link index past its last), which ends the walk."""
    out: list[str] = []
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(handle, link) != pynvml.NVML_FEATURE_ENABLED:
                continue
            out.append(_text(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId))
        except pynvml.NVMLError_NotSupported:
            break
        except pynvml.NVMLError:
            continue
    return tuple(out)


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


# ---------------------------------------------------------------- MIG
# A card's MIG mode, its profiles and placements as the driver reports them, and GPU + compute
# instances made and removed at a placement (dynamic MIG: made at prepare, removed at unprepare).
# Both operations are idempotent, so an agent that restarts between NVML's answer and its own
# checkpoint converges: `mig_create` at a placement where an instance of that profile already stands
# returns that instance (its MIG UUID), `mig_destroy` of a MIG device that is gone returns False.
# Call inside `session()`.

#: NVML_GPU_INSTANCE_PROFILE_* indexes, and the compute instance profile spanning n slices
_GI_PROFILE_INDEXES = range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT)
_CI_PROFILE_OF_SLICES = {
    1: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE,
    2: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE,
    3: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE,
    4: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE,
    7: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE,
}


class MigError(Exception):
    """A MIG operation the driver refused; `code` is NVML's (23: the placement is taken)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class MigInstance:
    """A GPU instance with its compute instance, i.e. one MIG device."""

    gpu_uuid: str
    profile_id: int
    start: int
    size: int
    gpu_instance_id: int
    compute_instance_id: int
    uuid: str  # "MIG-..."; what CUDA_VISIBLE_DEVICES names


def minor_number(gpu_uuid: str) -> int:
    """The card's /dev/nvidia<minor>; also the `gpu<N>` of its MIG capabilities."""
    return int(pynvml.nvmlDeviceGetMinorNumber(handle(gpu_uuid)))


def mig_mode(gpu_uuid: str) -> tuple[bool, bool] | None:
    """(current, pending) MIG mode, or None for a card without MIG."""
    try:
        current, pending = pynvml.nvmlDeviceGetMigMode(handle(gpu_uuid))
    except pynvml.NVMLError_NotSupported:
        return None
    return bool(current), bool(pending)


def _profile_infos(h: Any) -> list[Any]:
    out = []
    for index in _GI_PROFILE_INDEXES:
        try:
            out.append(pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h, index))
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument):
            continue
    return out


def mig_profiles(gpu_uuid: str) -> list[MigProfile]:
    """The card's GPU instance profiles with their placements; empty while MIG mode is off."""
    h = handle(gpu_uuid)
    out = []
    for info in _profile_infos(h):
        count = ctypes.c_uint(0)
        pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, info.id, None, ctypes.byref(count))
        arr = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
        pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, info.id, arr, ctypes.byref(count))
        out.append(
            MigProfile(
                id=int(info.id),
                name=_text(info.name).removeprefix("MIG "),
                slices=int(info.sliceCount),
                instances=int(info.instanceCount),
                memory_mib=int(info.memorySizeMB),
                multiprocessors=int(info.multiprocessorCount),
                placements=tuple((int(p.start), int(p.size)) for p in arr[: count.value]),
            )
        )
    return out


def _mig_uuids(h: Any) -> dict[tuple[int, int], str]:
    """MIG device UUID by (GPU instance id, compute instance id)."""
    out = {}
    for k in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(h)):
        try:
            m = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, k)
        except pynvml.NVMLError_NotFound:
            continue
        gi = int(pynvml.nvmlDeviceGetGpuInstanceId(m))
        ci = int(pynvml.nvmlDeviceGetComputeInstanceId(m))
        out[(gi, ci)] = _text(pynvml.nvmlDeviceGetUUID(m))
    return out


def _gpu_instances(h: Any) -> list[tuple[Any, Any]]:
    """(GPU instance handle, its nvmlGpuInstanceInfo_t) of every instance on the card."""
    out: list[tuple[Any, Any]] = []
    for info in _profile_infos(h):
        arr = (pynvml.c_nvmlGpuInstance_t * max(1, int(info.instanceCount)))()
        n = ctypes.c_uint(0)
        pynvml.nvmlDeviceGetGpuInstances(h, info.id, arr, ctypes.byref(n))
        out.extend((arr[i], pynvml.nvmlGpuInstanceGetInfo(arr[i])) for i in range(n.value))
    return out


def _compute_instances(gi: Any) -> list[Any]:
    out: list[Any] = []
    for ci_profile in _CI_PROFILE_OF_SLICES.values():
        arr = (pynvml.c_nvmlComputeInstance_t * 8)()
        n = ctypes.c_uint(0)
        try:
            pynvml.nvmlGpuInstanceGetComputeInstances(gi, ci_profile, arr, ctypes.byref(n))
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument):
            continue
        out.extend(arr[i] for i in range(n.value))
    return out


def mig_instances(gpu_uuid: str) -> list[MigInstance]:
    """The card's MIG devices: GPU instances that have a compute instance."""
    h = handle(gpu_uuid)
    uuids = _mig_uuids(h)
    out = []
    for gi, info in _gpu_instances(h):
        for ci in _compute_instances(gi):
            ci_id = int(pynvml.nvmlComputeInstanceGetInfo(ci).id)
            uuid = uuids.get((int(info.id), ci_id))
            if uuid:
                start, size = int(info.placement.start), int(info.placement.size)
                out.append(MigInstance(gpu_uuid, int(info.profileId), start, size, int(info.id), ci_id, uuid))
    return out


def mig_create(gpu_uuid: str, profile: MigProfile, start: int) -> MigInstance:
    """A GPU instance of `profile` at memory slice `start` with one compute instance spanning it; the
    one already there if a previous attempt made it. Raises MigError when the driver refuses (the
    placement overlaps an instance: code 23, NVML_ERROR_INSUFFICIENT_RESOURCES)."""
    for existing in mig_instances(gpu_uuid):
        if existing.profile_id == profile.id and existing.start == start:
            return existing
    h = handle(gpu_uuid)
    size = next((sz for st, sz in profile.placements if st == start), None)
    if size is None:
        raise MigError(
            f"{profile.name} has no placement at memory slice {start}", pynvml.NVML_ERROR_INVALID_ARGUMENT
        )
    placement = pynvml.c_nvmlGpuInstancePlacement_t(start, size)
    try:
        gi = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, profile.id, ctypes.byref(placement))
    except pynvml.NVMLError as exc:
        raise MigError(f"creating {profile.name} at {start}:{size} on {gpu_uuid}: {exc}", exc.value) from exc
    try:
        ci_profile = _CI_PROFILE_OF_SLICES[profile.slices]
        info = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
            gi, ci_profile, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
        )
        pynvml.nvmlGpuInstanceCreateComputeInstance(gi, info.id)
    except (KeyError, pynvml.NVMLError) as exc:
        pynvml.nvmlGpuInstanceDestroy(gi)  # no half-made instance is left behind
        code = exc.value if isinstance(exc, pynvml.NVMLError) else pynvml.NVML_ERROR_NOT_SUPPORTED
        raise MigError(f"compute instance for {profile.name} on {gpu_uuid}: {exc}", code) from exc
    made = next(i for i in mig_instances(gpu_uuid) if i.profile_id == profile.id and i.start == start)
    log.info("MIG instance created", gpu=gpu_uuid, profile=profile.name, start=start, mig=made.uuid)
    return made


def mig_destroy(gpu_uuid: str, mig_uuid: str) -> bool:
    """Removes the MIG device (its compute instances, then its GPU instance). False when it is not
    there (already removed); MigError (code 19, NVML_ERROR_IN_USE) while a process still uses it."""
    h = handle(gpu_uuid)
    target = next((i for i in mig_instances(gpu_uuid) if i.uuid == mig_uuid), None)
    if target is None:
        return False
    gi = pynvml.nvmlDeviceGetGpuInstanceById(h, target.gpu_instance_id)
    try:
        for ci in _compute_instances(gi):
            pynvml.nvmlComputeInstanceDestroy(ci)
        pynvml.nvmlGpuInstanceDestroy(gi)
    except pynvml.NVMLError as exc:
        raise MigError(f"destroying {mig_uuid} on {gpu_uuid}: {exc}", exc.value) from exc
    log.info("MIG instance destroyed", gpu=gpu_uuid, mig=mig_uuid)
    return True
