"""The card topology the agent publishes for multi-GPU products: PCIe root and NUMA node as the
kernel's sysfs shows them, NVLink peers as NVML reports them, on every whole-card device."""

from __future__ import annotations

from pathlib import Path

from gpuslice.agent.gpus import nvlink_peers, pci_topology
from gpuslice.agent.slices import Package, build_specs
from gpuslice.api.package import GpuPackageSpec
from support import gpu


def lay_out(sysfs: Path, root: str, bridge: str, bus: str, numa: int, vendor: str = "0x10de") -> None:
    """A PCI device as Linux lays it out: /sys/devices/<root>/<bridge>/<bus> with a
    /sys/bus/pci/devices/<bus> symlink to it."""
    real = sysfs / "devices" / root / bridge / bus
    real.mkdir(parents=True)
    (real / "numa_node").write_text(f"{numa}\n")
    (real / "vendor").write_text(f"{vendor}\n")
    links = sysfs / "bus" / "pci" / "devices"
    links.mkdir(parents=True, exist_ok=True)
    (links / bus).symlink_to(real)


def test_root_and_numa_node_come_from_sysfs(tmp_path: Path) -> None:
    lay_out(tmp_path, "pci0000:00", "0000:00:01.0", "0000:04:00.0", 0)
    lay_out(tmp_path, "pci0000:80", "0000:80:02.0", "0000:86:00.0", 1)
    lay_out(tmp_path, "pci0000:40", "0000:40:01.0", "0000:41:00.0", -1)
    lay_out(tmp_path, "pci0000:20", "0000:20:01.0", "0000:21:00.0", 0, vendor="0x8086")
    assert pci_topology("00000000:04:00.0", tmp_path) == ("pci0000:00", 0)
    assert pci_topology("00000000:86:00.0", tmp_path) == ("pci0000:80", 1)
    assert pci_topology("00000000:41:00.0", tmp_path) == ("pci0000:40", None), "numa_node -1 is none"
    assert pci_topology("00000000:21:00.0", tmp_path) == (None, None), "not an NVIDIA device"
    assert pci_topology("00000000:99:00.0", tmp_path) == (None, None), "no such device"


def test_nvlink_peers_are_the_cards_at_the_far_end() -> None:
    index = {"00000000:04:00.0": 0, "00000000:05:00.0": 1, "00000000:06:00.0": 2}
    assert nvlink_peers(("00000000:05:00.0", "00000000:05:00.0", "00000000:06:00.0"), index) == (1, 2)
    assert nvlink_peers(("00000000:ff:00.0",), index) == (), "an NVSwitch or unknown card is no peer"
    assert nvlink_peers((), index) == ()


def test_every_whole_card_device_carries_its_topology() -> None:
    cards = [
        gpu(0).model_copy(update={"pcie_root": "pci0000:00", "numa_node": 0, "nvlink_peers": (1, 3)}),
        gpu(1),
    ]
    whole = Package("v100x2", GpuPackageSpec.model_validate({"gpuModel": cards[0].product_name, "gpus": 2}))
    specs = build_specs("node-a", cards, [whole])
    devices = [d for _, s in specs for d in s.get("devices", [])]
    assert len(devices) == 2, "one whole-card device per card"
    first, second = (d["attributes"] for d in devices)
    assert first["resource.kubernetes.io/pcieRoot"] == {"string": "pci0000:00"}
    assert first["numaNode"] == {"int": 0}
    assert first["nvlinkPeers"] == {"string": "1,3"}
    assert not {"resource.kubernetes.io/pcieRoot", "numaNode", "nvlinkPeers"} & set(second), (
        "a card whose topology the node does not show publishes none"
    )
    consumed = devices[0]["consumesCounters"][0]["counters"]
    assert consumed["compute"] == {"value": "100"} and consumed["memory"] == {
        "value": str(cards[0].memory_bytes)
    }
