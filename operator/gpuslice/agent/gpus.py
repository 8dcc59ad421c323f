"""GPU discovery (through `agent.nvml`) and the facts the agent publishes about each card.

The same code path serves real and simulated nodes: on a simulated node the dev tooling starts the
agent with the NVIDIA driver test double on its library path (`gpuslice_dev.gpusim.simulate`), so
NVML's init binds to it and nothing in the agent knows the difference.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from gpuslice import logs
from gpuslice.agent import nvml
from gpuslice.domain.mig import MigProfile
from gpuslice.files import atomic_write

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
    #: The card's MIG GPU instance profiles while MIG mode is on (it then sells only Hardware
    #: products); None: MIG mode off or no MIG, it sells software slices.
    mig_profiles: tuple[MigProfile, ...] | None = None


class DiscoveryError(RuntimeError):
    """NVML could not be initialised or queried; the message says what to check."""


def discover() -> list[GpuInfo]:
    """Query every GPU NVML reports."""
    try:
        with nvml.session():
            try:
                driver, cuda = nvml.driver_versions()
                facts = nvml.devices()
                migs = {d.uuid: _mig_profiles(d.uuid) for d in facts}
            except nvml.Error as exc:
                raise DiscoveryError(f"NVML query failed: {exc}") from exc
    except nvml.Error as exc:
        raise DiscoveryError(
            f"NVML initialisation failed ({exc}); is the NVIDIA driver installed and "
            "libnvidia-ml.so.1 on the library path? On a machine without GPUs, run the agent through "
            "`gpuslice-dev devcluster up --simulate-gpus SPEC`, which points it at the driver test double."
        ) from exc
    cuda_version = f"{cuda // 1000}.{(cuda % 1000) // 10}"
    return [
        GpuInfo(
            index=d.index,
            uuid=d.uuid,
            product_name=d.name,
            memory_bytes=d.memory_total,
            cuda_compute_capability=f"{d.compute_capability[0]}.{d.compute_capability[1]}",
            driver_version=driver,
            cuda_driver_version=cuda_version,
            minor_number=d.minor_number,
            pci_bus_id=d.pci_bus_id,
            mig_profiles=migs[d.uuid],
        )
        for d in facts
    ]


def _mig_profiles(uuid: str) -> tuple[MigProfile, ...] | None:
    """The card's MIG profiles when its current MIG mode is on; a pending change counts only after the
    card is reset (the driver serves the current mode)."""
    mode = nvml.mig_mode(uuid)
    if mode is None or not mode[0]:
        return None
    return tuple(nvml.mig_profiles(uuid))


def with_remembered(found: list[GpuInfo], state_dir: Path) -> list[GpuInfo]:
    """The cards NVML lists now plus those it listed at an earlier start but cannot reach now (a lost
    card keeps its devices published, tainted, so the pods on it are evicted), remembered in
    `<state_dir>/gpus.json`."""
    path = state_dir / "gpus.json"
    try:
        before = [GpuInfo.model_validate(g) for g in json.loads(path.read_text())]
    except (OSError, ValueError) as exc:
        if not isinstance(exc, FileNotFoundError):
            log.warning("ignoring unreadable GPU memory", path=str(path), error=str(exc))
        before = []
    uuids, indexes = {g.uuid for g in found}, {g.index for g in found}
    missing = [g for g in before if g.uuid not in uuids and g.index not in indexes]
    for g in missing:
        log.warning("GPU known from an earlier start does not answer; publishing it as lost", gpu=g.index,
                    uuid=g.uuid)  # fmt: skip
    merged = sorted([*found, *missing], key=lambda g: g.index)
    state_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps([g.model_dump() for g in merged]))
    return merged


_NUMBER = re.compile(r"\d+")


def semver(version: str) -> str:
    """A DRA `version` attribute from an NVIDIA version string: "535.104.05" -> "535.104.5",
    "7.0" -> "7.0.0". Semver forbids leading zeros, so each numeric part is normalised."""
    parts = [str(int(p)) for p in _NUMBER.findall(version)][:3]
    if not parts:
        raise ValueError(f"version {version!r} has no numeric part")
    return ".".join(parts + ["0"] * (3 - len(parts)))
