"""GPU discovery (through `agent.nvml`) and the facts the agent publishes about each card.

The same code path serves real and simulated nodes: on a simulated node the dev tooling starts the
agent with the NVIDIA driver test double on its library path (`gpuslice_dev.gpusim.simulate`), so
NVML's init binds to it and nothing in the agent knows the difference.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from gpuslice import constants as c
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
    #: Topology, where the node shows it (None / empty where not): the PCIe root complex the card
    #: hangs off (sysfs name, e.g. "pci0000:00"), its NUMA node, and the indices of the cards NVML
    #: reports an active NVLink to.
    pcie_root: str | None = None
    numa_node: int | None = None
    nvlink_peers: tuple[int, ...] = ()
    #: The card's MIG GPU instance profiles while MIG mode is on (it then sells only Hardware
    #: products); None: MIG mode off or no MIG, it sells software slices.
    mig_profiles: tuple[MigProfile, ...] | None = None
    #: A static MIG layout (`gpuslice agent --mig-layout static`): the (profile, first memory slice)
    #: of each instance the platform made on the card, which it sells as they are; None: dynamic MIG.
    mig_layout: tuple[tuple[str, int], ...] | None = None


class DiscoveryError(RuntimeError):
    """NVML could not be initialised or queried; the message says what to check."""


def discover(static_mig: bool = False) -> list[GpuInfo]:
    """Query every GPU NVML reports; `static_mig`: record the MIG instances each card in MIG mode has
    (the platform's layout, sold as it is)."""
    try:
        with nvml.session():
            try:
                driver, cuda = nvml.driver_versions()
                facts = nvml.devices()
                migs = {d.uuid: _mig_profiles(d.uuid) for d in facts}
                layouts = {d.uuid: _mig_layout(d.uuid, migs[d.uuid]) if static_mig else None for d in facts}
            except nvml.Error as exc:
                raise DiscoveryError(f"NVML query failed: {exc}") from exc
    except nvml.Error as exc:
        raise DiscoveryError(
            f"NVML initialisation failed ({exc}); is the NVIDIA driver installed and "
            "libnvidia-ml.so.1 on the library path? On a machine without GPUs, run the agent through "
            "`gpuslice-dev devcluster up --simulate-gpus SPEC`, which points it at the driver test double."
        ) from exc
    cuda_version = f"{cuda // 1000}.{(cuda % 1000) // 10}"
    sysfs = sys_root()
    topology = {d.index: pci_topology(d.pci_bus_id, sysfs) for d in facts}
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
            pcie_root=topology[d.index][0],
            numa_node=topology[d.index][1],
            nvlink_peers=nvlink_peers(d.nvlink_remote_bus_ids, {f.pci_bus_id: f.index for f in facts}),
            mig_profiles=migs[d.uuid],
            mig_layout=layouts[d.uuid],
        )
        for d in facts
    ]


NVIDIA_PCI_VENDOR = "0x10de"


def sys_root() -> Path:
    """Where the kernel shows PCI devices: /sys, or a simulated node's tree that the driver double's
    tooling lays out next to its GPU description (the host's sysfs has no simulated card)."""
    return Path(os.environ.get(c.SYS_ROOT_ENV) or c.SYS_ROOT)


def _sysfs_name(bus_id: str) -> str:
    """NVML's "00000000:04:00.0" as sysfs names it: "0000:04:00.0" (4-digit domain, lower case)."""
    domain, _, rest = bus_id.partition(":")
    return f"{int(domain, 16) & 0xFFFF:04x}:{rest}".lower()


def pci_topology(bus_id: str, sysfs: Path) -> tuple[str | None, int | None]:
    """The card's PCIe root complex and NUMA node as the kernel shows them: the first `pciDDDD:BB`
    directory of the card's device path (`/sys/devices/pci0000:00/0000:00:01.0/0000:04:00.0`), the
    name Kubernetes' `resource.kubernetes.io/pcieRoot` uses, and `numa_node` (-1: none). Nothing
    where `sysfs` has no NVIDIA device at that address."""
    try:
        real = (sysfs / "bus" / "pci" / "devices" / _sysfs_name(bus_id)).resolve(strict=True)
        vendor = (real / "vendor").read_text().strip().lower()
        devices = (sysfs / "devices").resolve(strict=True)
    except (OSError, RuntimeError, ValueError):
        return None, None
    if vendor != NVIDIA_PCI_VENDOR:
        # Not an NVIDIA card at that address: a simulated card's bus id read against the host's
        # sysfs, where some other device of this machine happens to have it; its topology is not
        # the card's.
        return None, None
    # Only the part under devices/ names the root: the directories above a simulated node's tree
    # are wherever its state lives.
    parts = real.parts[len(devices.parts) :] if real.is_relative_to(devices) else real.parts
    root = next((p for p in parts if p.startswith("pci") and ":" in p), None)
    try:
        numa = int((real / "numa_node").read_text().strip())
    except (OSError, ValueError):
        numa = -1
    return root, numa if numa >= 0 else None


def nvlink_peers(remote_bus_ids: tuple[str, ...], index_by_bus_id: dict[str, int]) -> tuple[int, ...]:
    """Indices of the cards at the far end of the card's NVLinks (a link to an NVSwitch or to a card
    NVML does not list names no peer); NVML's bus ids compared case-insensitively."""
    by_bus = {b.lower(): i for b, i in index_by_bus_id.items()}
    return tuple(sorted({by_bus[b.lower()] for b in remote_bus_ids if b.lower() in by_bus}))


def _mig_profiles(uuid: str) -> tuple[MigProfile, ...] | None:
    """The card's MIG profiles when its current MIG mode is on; a pending change counts only after the
    card is reset (the driver serves the current mode)."""
    mode = nvml.mig_mode(uuid)
    if mode is None or not mode[0]:
        return None
    return tuple(nvml.mig_profiles(uuid))


def _mig_layout(uuid: str, profiles: tuple[MigProfile, ...] | None) -> tuple[tuple[str, int], ...] | None:
    if profiles is None:
        return None
    names = {p.id: p.name for p in profiles}
    made = nvml.mig_instances(uuid)
    return tuple(sorted((names[i.profile_id], i.start) for i in made if i.profile_id in names))


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
