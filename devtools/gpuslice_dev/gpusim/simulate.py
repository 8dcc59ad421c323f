"""Describe simulated GPUs for the NVIDIA driver test double and load it into this process.

The double (shim/build/fake/libcuda.so.1 + libnvidia-ml.so.1) reads its GPUs from the file named by
FAKE_GPU_CONFIG_ENV. It is the project's only fake: the shim, pynvml and the node agent run their
real code paths against it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
from pathlib import Path
from typing import Final

from pydantic import BaseModel, ConfigDict

from gpuslice import constants as c
from gpuslice.files import atomic_write

FAKE_GPU_CONFIG_ENV = "GPUSLICE_FAKE_GPU_CONFIG"
#: where the agent reads the driver's /proc files (the simulated node's, next to its GPU description)
PROC_ROOT_ENV = c.PROC_ROOT_ENV
#: where the agent reads the cards' PCI topology (the simulated node's sysfs, next to the same)
SYS_ROOT_ENV = c.SYS_ROOT_ENV
DEFAULT_DRIVER_VERSION = "535.183.01"
DEFAULT_CUDA_DRIVER_VERSION = 12020  # what a 535 driver reports: CUDA 12.2

#: Driver branches the double simulates: the version nvidia-smi shows and the CUDA version
#: cuDriverGetVersion reports. A CUDA 13 runtime refuses a 535 driver (insufficient driver); a 580
#: driver runs CUDA 12 and 13 runtimes.
DRIVERS: dict[str, tuple[str, int]] = {
    "535": (DEFAULT_DRIVER_VERSION, DEFAULT_CUDA_DRIVER_VERSION),
    "580": ("580.95.05", 13000),
}


def driver_versions(branch: str) -> tuple[str, int]:
    """(driver_version, cuda_driver_version) of a driver branch such as "535" or "580"."""
    try:
        return DRIVERS[branch]
    except KeyError:
        raise GpuSpecError(f"unknown driver branch {branch!r}; known: {', '.join(DRIVERS)}") from None


class FakeGpu(BaseModel):
    model_config = ConfigDict(frozen=True)

    index: int
    name: str
    uuid: str
    memory_bytes: int
    compute_capability: str
    multiprocessors: int
    pci_bus_id: str
    pci_device_id: str
    minor: int
    serial: str
    #: the peer's bus id at the end of each NVLink (one entry per link; empty on a PCIe board)
    nvlink: tuple[str, ...] = ()
    #: the PCIe root complex the card hangs off, as sysfs names it, and the NUMA node of that root
    #: (`write_sysfs` lays them out where the agent reads them on a real node)
    pcie_root: str = "pci0000:00"
    numa_node: int = 0


class _Model(BaseModel):
    memory_bytes: int
    compute_capability: str
    multiprocessors: int
    pci_device_id: str
    # What the driver reports besides (the double's table in shim/fake/cuda_device.c holds the same;
    # tests/shim/test_cudart.py compares both through the real runtime's cudaGetDeviceProperties).
    clock_khz: int  # boost clock, CU_DEVICE_ATTRIBUTE_CLOCK_RATE
    memory_clock_khz: int
    memory_bus_width: int  # bits
    l2_cache_bytes: int


#: Models the double can impersonate, with what their drivers report.
KNOWN_MODELS: dict[str, _Model] = {
    "Tesla V100-PCIE-32GB": _Model(memory_bytes=32 * c.GIB, compute_capability="7.0", multiprocessors=80,
                                   pci_device_id="1DB610DE", clock_khz=1380000, memory_clock_khz=877000,
                                   memory_bus_width=4096, l2_cache_bytes=6 * c.MIB),
    "Tesla V100-PCIE-16GB": _Model(memory_bytes=16 * c.GIB, compute_capability="7.0", multiprocessors=80,
                                   pci_device_id="1DB410DE", clock_khz=1380000, memory_clock_khz=877000,
                                   memory_bus_width=4096, l2_cache_bytes=6 * c.MIB),
    "Tesla V100-SXM2-16GB": _Model(memory_bytes=16 * c.GIB, compute_capability="7.0", multiprocessors=80,
                                   pci_device_id="1DB110DE", clock_khz=1530000, memory_clock_khz=877000,
                                   memory_bus_width=4096, l2_cache_bytes=6 * c.MIB),
    "Tesla V100-SXM2-32GB": _Model(memory_bytes=32 * c.GIB, compute_capability="7.0", multiprocessors=80,
                                   pci_device_id="1DB510DE", clock_khz=1530000, memory_clock_khz=877000,
                                   memory_bus_width=4096, l2_cache_bytes=6 * c.MIB),
    "Tesla T4": _Model(memory_bytes=15360 * c.MIB, compute_capability="7.5", multiprocessors=40,
                       pci_device_id="1EB810DE", clock_khz=1590000, memory_clock_khz=5001000,
                       memory_bus_width=256, l2_cache_bytes=4 * c.MIB),
    "NVIDIA A100-SXM4-40GB": _Model(memory_bytes=40 * c.GIB, compute_capability="8.0", multiprocessors=108,
                                    pci_device_id="20B010DE", clock_khz=1410000, memory_clock_khz=1215000,
                                    memory_bus_width=5120, l2_cache_bytes=40 * c.MIB),
    "NVIDIA A100-PCIE-40GB": _Model(memory_bytes=40 * c.GIB, compute_capability="8.0", multiprocessors=108,
                                    pci_device_id="20F110DE", clock_khz=1410000, memory_clock_khz=1215000,
                                    memory_bus_width=5120, l2_cache_bytes=40 * c.MIB),
    "NVIDIA A100-SXM4-80GB": _Model(memory_bytes=80 * c.GIB, compute_capability="8.0", multiprocessors=108,
                                    pci_device_id="20B210DE", clock_khz=1410000, memory_clock_khz=1593000,
                                    memory_bus_width=5120, l2_cache_bytes=40 * c.MIB),
    "NVIDIA H100 80GB HBM3": _Model(memory_bytes=81559 * c.MIB, compute_capability="9.0", multiprocessors=132,
                                    pci_device_id="233010DE", clock_khz=1980000, memory_clock_khz=2619000,
                                    memory_bus_width=5120, l2_cache_bytes=50 * c.MIB),
}  # fmt: skip

_PART = re.compile(r"^\s*(?:(\d+)\s*[xX]\s+)?(.+?)\s*$")


class GpuSpecError(ValueError):
    pass


def _uuid(seed: str, index: int, model: str) -> str:
    h = hashlib.sha256(f"gpuslice-fake-gpu\0{seed}\0{index}\0{model}".encode()).hexdigest()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def parse_gpu_spec(spec: str, seed: str = "gpuslice") -> list[FakeGpu]:
    """GPUs from a spec like "2x Tesla V100-PCIE-32GB" or "1x Tesla T4, 1x NVIDIA A100-SXM4-40GB".

    `seed` (e.g. the node name) makes UUIDs deterministic, and different between nodes.
    """
    gpus: list[FakeGpu] = []
    by_lower = {name.lower(): name for name in KNOWN_MODELS}
    for part in spec.split(","):
        match = _PART.match(part)
        if not match or not match.group(2):
            raise GpuSpecError(f"GPU spec part {part!r} is not like '2x Tesla V100-PCIE-32GB'")
        count = int(match.group(1) or 1)
        name = by_lower.get(match.group(2).lower())
        if name is None:
            raise GpuSpecError(
                f"unknown GPU model {match.group(2)!r}; known models: {', '.join(KNOWN_MODELS)}"
            )
        if count < 1:
            raise GpuSpecError(f"GPU count must be at least 1 in {part!r}")
        model = KNOWN_MODELS[name]
        for _ in range(count):
            i = len(gpus)
            gpus.append(
                FakeGpu(
                    index=i,
                    name=name,
                    uuid=_uuid(seed, i, name),
                    memory_bytes=model.memory_bytes,
                    compute_capability=model.compute_capability,
                    multiprocessors=model.multiprocessors,
                    pci_bus_id=f"00000000:{4 + i:02X}:00.0",
                    pci_device_id=model.pci_device_id,
                    minor=i,
                    serial=f"{int(_uuid(seed, i, 'serial')[4:12], 16):013d}",
                )
            )
    if not gpus:
        raise GpuSpecError("GPU spec is empty; give e.g. '1x Tesla V100-PCIE-32GB'")
    gpus = with_nvlinks(with_topology(gpus))
    if len(gpus) > 16:
        raise GpuSpecError(f"the driver test double simulates at most 16 GPUs, spec asks for {len(gpus)}")
    return gpus


#: NVLinks of a DGX-1 with V100 (the hybrid cube-mesh `nvidia-smi topo -m` shows): card -> (peer,
#: links). Six links per card; cards 0-3 and 4-7 form two quads joined card to card.
DGX1_NVLINKS: dict[int, tuple[tuple[int, int], ...]] = {
    0: ((1, 1), (2, 1), (3, 2), (4, 2)),
    1: ((0, 1), (2, 2), (3, 1), (5, 2)),
    2: ((0, 1), (1, 2), (3, 2), (6, 1)),
    3: ((0, 2), (1, 1), (2, 2), (7, 1)),
    4: ((0, 2), (5, 1), (6, 1), (7, 2)),
    5: ((1, 2), (4, 1), (6, 2), (7, 1)),
    6: ((2, 1), (4, 1), (5, 2), (7, 2)),
    7: ((3, 1), (4, 2), (5, 1), (6, 2)),
}


#: Where a DGX-1 puts its 8 V100-SXM2 boards, in nvidia-smi's order: (bus, PCIe root, NUMA node).
#: Cards 0-3 hang off the first CPU socket's root complex, 4-7 off the second's.
DGX1_SLOTS: tuple[tuple[int, str, int], ...] = (
    (0x06, "pci0000:00", 0), (0x07, "pci0000:00", 0), (0x0A, "pci0000:00", 0), (0x0B, "pci0000:00", 0),
    (0x85, "pci0000:80", 1), (0x86, "pci0000:80", 1), (0x89, "pci0000:80", 1), (0x8A, "pci0000:80", 1),
)  # fmt: skip


def with_topology(gpus: list[FakeGpu]) -> list[FakeGpu]:
    """Bus ids and PCIe roots as the node's boards have them: the first 8 SXM2 boards sit in a
    DGX-1's slots (two roots, one per socket and NUMA node, 4 cards each); every other card is a PCIe
    board on the first socket's root, at the next free bus from 04."""
    sxm2 = [g.index for g in gpus if "SXM2" in g.name][: len(DGX1_SLOTS)]
    slot = {index: DGX1_SLOTS[k] for k, index in enumerate(sxm2)}
    used = {bus for bus, _, _ in slot.values()}
    out, bus = [], 4
    for g in gpus:
        if g.index in slot:
            b, root, numa = slot[g.index]
        else:
            while bus in used:
                bus += 1
            b, root, numa = bus, "pci0000:00", 0
            used.add(bus)
        out.append(
            g.model_copy(
                update={"pci_bus_id": f"00000000:{b:02X}:00.0", "pcie_root": root, "numa_node": numa}
            )
        )
    return out


def with_nvlinks(gpus: list[FakeGpu]) -> list[FakeGpu]:
    """SXM2 boards get the DGX-1's NVLinks among the first 8 of them (links to a card the node does
    not have stay down); other boards are PCIe and have none."""
    sxm2 = [g for g in gpus if "SXM2" in g.name][:8]
    slot = {g.index: k for k, g in enumerate(sxm2)}
    by_slot = {k: g for k, g in enumerate(sxm2)}
    out = []
    for g in gpus:
        k = slot.get(g.index)
        if k is None:
            out.append(g)
            continue
        links = tuple(by_slot[p].pci_bus_id for p, n in DGX1_NVLINKS[k] if p in by_slot for _ in range(n))
        out.append(g.model_copy(update={"nvlink": links}))
    return out


def render_fake_config(
    gpus: list[FakeGpu],
    driver_version: str = DEFAULT_DRIVER_VERSION,
    cuda_driver_version: int = DEFAULT_CUDA_DRIVER_VERSION,
) -> str:
    lines = ["version=1", f"driver_version={driver_version}", f"cuda_driver_version={cuda_driver_version}"]
    for g in gpus:
        p = f"gpu.{g.index}."
        lines += [
            f"{p}name={g.name}",
            f"{p}uuid={g.uuid}",
            f"{p}memory_bytes={g.memory_bytes}",
            f"{p}compute_capability={g.compute_capability}",
            f"{p}multiprocessors={g.multiprocessors}",
            f"{p}pci_bus_id={g.pci_bus_id}",
            f"{p}pci_device_id={g.pci_device_id}",
            f"{p}minor={g.minor}",
            f"{p}serial={g.serial}",
        ]
        if g.nvlink:
            lines.append(f"{p}nvlink={','.join(g.nvlink)}")
    return "\n".join(lines) + "\n"


def write_fake_config(
    gpus: list[FakeGpu],
    path: Path | str,
    driver_version: str = DEFAULT_DRIVER_VERSION,
    cuda_driver_version: int = DEFAULT_CUDA_DRIVER_VERSION,
) -> Path:
    """Write the double's GPU description. Its cross-process state lives in `<path>.state/`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, render_fake_config(gpus, driver_version, cuda_driver_version))
    write_procfs(proc_root(path))
    write_sysfs(sys_root(path), gpus)
    return path


def sys_root(config_path: Path | str) -> Path:
    """The simulated node's /sys (its PCI devices) next to its GPU description."""
    return Path(config_path).parent / "sys"


#: What sysfs shows of the CPU's PCIe root port each card hangs off (a PCI-to-PCI bridge).
ROOT_PORT_VENDOR: Final = "0x8086"
ROOT_PORT_CLASS: Final = "0x060400"
#: An NVIDIA datacenter card's PCI class: 3D controller (no display output).
GPU_CLASS: Final = "0x030200"


def _pci_name(domain: int, bus: int, device: int, function: int = 0) -> str:
    return f"{domain:04x}:{bus:02x}:{device:02x}.{function:x}"


def _pci_function(path: Path, vendor: str, device: str, pci_class: str, numa_node: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for name, value in (
        ("vendor", vendor),
        ("device", device),
        ("class", pci_class),
        ("numa_node", numa_node),
    ):
        atomic_write(path / name, f"{value}\n")


def _link(link: Path, target: Path) -> None:
    """A relative symlink, as the kernel makes bus/pci/devices/<address> -> ../../../devices/...;
    replaced in one step, so a reader never finds it missing."""
    tmp = link.with_name(f".{link.name}.tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(os.path.relpath(target, link.parent))
    os.replace(tmp, link)


def write_sysfs(root: Path, gpus: list[FakeGpu]) -> Path:
    """Lay the cards out under `root` as Linux shows PCI devices: each card at
    devices/<pcie root>/<root port>/<card> (`devices/pci0000:80/0000:80:01.0/0000:85:00.0`), a
    root port per card, every function with its vendor, device, class and numa_node, and the
    bus/pci/devices/<address> symlink to each; what the agent reads is the kernel's layout."""
    links = root / "bus" / "pci" / "devices"
    links.mkdir(parents=True, exist_ok=True)
    wanted: set[str] = set()
    ports: dict[str, int] = {}
    for g in sorted(gpus, key=lambda g: g.pci_bus_id):
        domain, bus, device = (int(x, 16) for x in g.pci_bus_id.replace(".", ":").split(":")[:3])
        root_bus = int(g.pcie_root.rpartition(":")[2], 16)
        ports[g.pcie_root] = ports.get(g.pcie_root, 0) + 1
        port = _pci_name(domain, root_bus, ports[g.pcie_root])
        card = _pci_name(domain, bus, device)
        port_dir = root / "devices" / g.pcie_root / port
        _pci_function(port_dir, ROOT_PORT_VENDOR, "0x1901", ROOT_PORT_CLASS, g.numa_node)
        card_id = int(g.pci_device_id, 16)
        card_dir = port_dir / card
        _pci_function(card_dir, f"0x{card_id & 0xFFFF:04x}", f"0x{card_id >> 16:04x}", GPU_CLASS, g.numa_node)
        for name, target in ((port, port_dir), (card, card_dir)):
            _link(links / name, target)
            wanted.add(name)
    for stale in links.iterdir():
        if stale.name not in wanted:
            stale.unlink()
    return root


#: NVIDIA_MAX_DEVICES of the kernel module: nvidia-caps numbers capabilities for that many cards
#: whatever the node has, 15 GPU instances each with 8 compute instances (a fixed layout, so a
#: minor never changes between boots).
PROC_MAX_GPUS: Final = 32
PROC_MAX_GI: Final = 15
PROC_MAX_CI: Final = 8
#: nvidia-caps' major is given out by the kernel at module load (any free one); fixed here, and read
#: back by name from /proc/devices, as on a real node.
NVIDIA_CAPS_MAJOR: Final = 237
NVIDIA_UVM_MAJOR: Final = 511


def proc_root(config_path: Path | str) -> Path:
    """The simulated node's /proc (the driver's part of it) next to its GPU description."""
    return Path(config_path).parent / "proc"


def render_mig_minors() -> str:
    """`/proc/driver/nvidia-caps/mig-minors` as the kernel module writes it: `config 1`,
    `monitor 2`, then per card (by its minor) each GPU instance's access capability followed by its
    compute instances' (gpu0/gi0/access 3, gpu0/gi0/ci0/access 4, ..., gpu3/gi3/ci3/access 439)."""
    lines = ["config 1", "monitor 2"]
    minor = 3
    for gpu in range(PROC_MAX_GPUS):
        for gi in range(PROC_MAX_GI):
            lines.append(f"gpu{gpu}/gi{gi}/access {minor}")
            minor += 1
            for ci in range(PROC_MAX_CI):
                lines.append(f"gpu{gpu}/gi{gi}/ci{ci}/access {minor}")
                minor += 1
    return "\n".join(lines) + "\n"


def render_proc_devices() -> str:
    """The character devices of /proc/devices the NVIDIA modules register (with a few of the
    kernel's own around them, as a reader must skip)."""
    return (
        "Character devices:\n  1 mem\n  4 /dev/vc/0\n  5 /dev/tty\n 10 misc\n195 nvidia-frontend\n"
        f"{NVIDIA_CAPS_MAJOR} nvidia-caps\n{NVIDIA_UVM_MAJOR} nvidia-uvm\n\n"
        "Block devices:\n  7 loop\n  8 sd\n259 blkext\n"
    )


def write_procfs(root: Path) -> Path:
    """What the simulated driver shows under /proc: `devices` and `driver/nvidia-caps/mig-minors`."""
    (root / "driver" / "nvidia-caps").mkdir(parents=True, exist_ok=True)
    atomic_write(root / "devices", render_proc_devices())
    atomic_write(root / "driver" / "nvidia-caps" / "mig-minors", render_mig_minors())
    return root


def fake_driver_env(config_path: Path | str, fake_dir: Path) -> dict[str, str]:
    """Environment for a child process that should load the double instead of a real driver."""
    old = os.environ.get("LD_LIBRARY_PATH")
    return {
        FAKE_GPU_CONFIG_ENV: str(config_path),
        PROC_ROOT_ENV: str(proc_root(config_path)),
        SYS_ROOT_ENV: str(sys_root(config_path)),
        "LD_LIBRARY_PATH": f"{fake_dir}:{old}" if old else str(fake_dir),
    }


def use_fake_driver(config_path: Path | str) -> ctypes.CDLL:
    """Make this process's later `pynvml.nvmlInit()` bind to the double.

    Call before the process first loads libnvidia-ml.so.1: glibc then resolves pynvml's
    CDLL("libnvidia-ml.so.1") to the already-loaded double by its SONAME.
    """
    from gpuslice_dev.gpusim.build import ensure_built

    built = ensure_built()
    os.environ[FAKE_GPU_CONFIG_ENV] = str(config_path)
    os.environ[PROC_ROOT_ENV] = str(proc_root(config_path))
    os.environ[SYS_ROOT_ENV] = str(sys_root(config_path))
    return ctypes.CDLL(str(built.fake_nvml), mode=ctypes.RTLD_GLOBAL)


def write_node_config(spec: str, node: str, state_dir: Path, driver: str = "535") -> Path:
    """Describe `spec` (e.g. "2x Tesla V100-PCIE-32GB") for `node` in `<state_dir>/fake-gpus.conf`.

    UUIDs are seeded by the node name so every simulated node has distinct, stable GPUs; `driver` is
    the simulated driver branch (`DRIVERS`).
    """
    gpus = parse_gpu_spec(spec, seed=node)
    return write_fake_config(gpus, state_dir / "fake-gpus.conf", *driver_versions(driver))


def driver_socket(config_path: Path | str) -> Path:
    """Where gpuslice-fake-driverd serves the double described by `config_path`."""
    return Path(f"{config_path}.state") / "driver.sock"


def start_fake_driverd(config_path: Path | str, timeout: float = 10.0) -> subprocess.Popen[bytes]:
    """Start the double's host-side part (the kernel module's role) and wait until it serves.

    While it runs, processes loading the double learn their host PID from it (NVML reports host PIDs
    whatever PID namespace they live in) and their memory is freed when they end, however they end.
    The caller terminates the returned process.
    """
    from gpuslice_dev.gpusim.build import ensure_built

    built = ensure_built()
    proc = subprocess.Popen(
        [str(built.driverd), "--config", str(config_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode(errors="replace")  # "serving <socket>" once it accepts
    if "serving" not in line:
        proc.kill()
        proc.wait(timeout=timeout)
        raise RuntimeError(f"gpuslice-fake-driverd did not start: {line.strip() or 'no output'}")
    return proc
