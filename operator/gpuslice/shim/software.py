"""The usage region's software record: what a slice's software could not do on its GPU.

Layout: `gs_software` in shim/src/gs_region.h (header offset 512). The shim writes it when a process
loads a kernel image none of whose images runs on the device (or the driver refuses one), or when a
CUDA runtime of a newer major than the driver's asks for its entry points; and it keeps the time of
the last image that loaded fine and of the slice's first context. Tenant-writable like the whole
region: shown to the tenant, never used for a decision about another slice.
"""

from __future__ import annotations

import struct
from enum import StrEnum

from pydantic import BaseModel

OFFSET = 512
_RECORD = struct.Struct("<IIIIIIiI16H16sQQQQ32s")
ARCH_PTX = 0x8000


class SoftwareKind(StrEnum):
    NO_KERNEL_IMAGE = "NoKernelImageForGpu"
    PTX_TOO_NEW = "PtxTooNewForDriver"
    DRIVER_TOO_OLD = "DriverTooOld"


_KINDS = {1: SoftwareKind.NO_KERNEL_IMAGE, 2: SoftwareKind.PTX_TOO_NEW, 3: SoftwareKind.DRIVER_TOO_OLD}


class SoftwareRecord(BaseModel):
    kind: SoftwareKind
    #: the driver's answer to the load (209 CUDA_ERROR_NO_BINARY_FOR_GPU, ...); 0 when it loaded
    #: (lazily) but no image in it runs on the device
    cuda_error: int
    #: the GPU's architecture as the shim read it (70 = sm_70); 0 unknown
    device_arch: int
    #: CUDA version the driver supports (12020 = 12.2) and the runtime asked for (0 unknown)
    driver_version: int
    runtime_version: int
    pid: int
    process: str
    #: the images the kernel image carries: "sm_75" (cubin), "compute_90" (PTX); and how many in all
    image_architectures: list[str]
    image_count: int
    #: unix seconds
    time: float
    #: the file the image was in ("libtorch_cuda.so"; empty: memory the process built, or a shim
    #: older than this record's field)
    library: str = ""


class SoftwareState(BaseModel):
    record: SoftwareRecord | None
    #: unix seconds of the last kernel image that loaded and runs on the device (None: none yet)
    compatible_time: float | None
    #: unix seconds of the slice's first context (None: no process used the GPU yet)
    first_use_time: float | None


def _arch_name(word: int) -> str:
    return f"compute_{word & 0x7FFF}" if word & ARCH_PTX else f"sm_{word}"


def parse_software(header: bytes) -> SoftwareState:
    """The software state from the region's header bytes (at least OFFSET + 144 of them).

    A record being written (odd sequence number) or of an unknown kind reads as absent; the reader
    tries again at its next interval."""
    (seq, kind, err, dev, drv, rt, pid, count, *rest) = _RECORD.unpack_from(header, OFFSET)
    archs, name, t_ms, ok_ms, first_ms, total, lib = rest[:16], *rest[16:22]
    record = None
    if total and seq % 2 == 0 and kind in _KINDS:
        record = SoftwareRecord(
            kind=_KINDS[kind], cuda_error=err, device_arch=dev, driver_version=drv, runtime_version=rt,
            pid=pid, process=name.split(b"\0", 1)[0].decode("utf-8", "replace"),
            image_architectures=[_arch_name(a) for a in archs[: min(count, 16)] if a],
            image_count=count, time=t_ms / 1000, library=lib.split(b"\0", 1)[0].decode("utf-8", "replace"),
        )  # fmt: skip
    return SoftwareState(
        record=record,
        compatible_time=ok_ms / 1000 if ok_ms else None,
        first_use_time=first_ms / 1000 if first_ms else None,
    )
