"""The card topology the agent publishes for multi-GPU products: PCIe root and NUMA node as the
kernel's sysfs shows them, NVLink peers as NVML reports them, on every whole-card device; and the
sysfs tree the driver double's tooling lays out for a simulated node, in the kernel's form."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuslice import constants as c
from gpuslice.agent.gpus import NVIDIA_PCI_VENDOR, nvlink_peers, pci_topology, sys_root
from gpuslice.agent.slices import Package, build_specs
from gpuslice.api.package import GpuPackageSpec
from gpuslice_dev.gpusim import simulate
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


def simulated(spec: str, where: Path) -> tuple[list[simulate.FakeGpu], Path]:
    cards = simulate.parse_gpu_spec(spec, seed="topo")
    return cards, simulate.sys_root(simulate.write_fake_config(cards, where / "fake-gpus.conf"))


def test_a_simulated_dgx1_is_laid_out_as_the_kernel_shows_pci_devices(tmp_path: Path) -> None:
    cards, sysfs = simulated("8x Tesla V100-SXM2-16GB", tmp_path)
    assert [g.pci_bus_id[9:11] for g in cards] == ["06", "07", "0A", "0B", "85", "86", "89", "8A"]
    link = sysfs / "bus" / "pci" / "devices" / "0000:85:00.0"
    # the kernel's form: a relative link from bus/pci/devices into devices/<root>/.../<address>
    assert os.readlink(link) == "../../../devices/pci0000:80/0000:80:01.0/0000:85:00.0"
    card = link.resolve(strict=True)
    assert (card / "vendor").read_text() == "0x10de\n" and (card / "device").read_text() == "0x1db1\n"
    assert (card / "class").read_text() == "0x030200\n" and (card / "numa_node").read_text() == "1\n"
    assert [pci_topology(g.pci_bus_id, sysfs) for g in cards] == [("pci0000:00", 0)] * 4 + [
        ("pci0000:80", 1)
    ] * 4
    # the root port above a card is listed too, as on Linux, and is no NVIDIA card
    assert (sysfs / "bus" / "pci" / "devices" / "0000:80:01.0").resolve() == card.parent
    assert pci_topology("00000000:80:01.0", sysfs) == (None, None)


def test_a_simulated_pcie_node_has_one_root_and_a_rewrite_drops_the_old_cards(tmp_path: Path) -> None:
    simulated("8x Tesla V100-SXM2-16GB", tmp_path)
    cards, sysfs = simulated("4x Tesla V100-PCIE-32GB", tmp_path)
    assert [g.pci_bus_id for g in cards] == [f"00000000:0{4 + i}:00.0" for i in range(4)]
    assert {pci_topology(g.pci_bus_id, sysfs) for g in cards} == {("pci0000:00", 0)}
    assert pci_topology("00000000:85:00.0", sysfs) == (None, None), "the DGX-1's cards are gone"
    assert sorted(p.name for p in (sysfs / "bus" / "pci" / "devices").iterdir()) == [
        *(f"0000:00:0{i}.0" for i in range(1, 5)),
        *(f"0000:0{4 + i}:00.0" for i in range(4)),
    ]


def test_the_agent_reads_the_hosts_sysfs_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(c.SYS_ROOT_ENV, raising=False)
    assert sys_root() == Path("/sys")
    monkeypatch.setenv(c.SYS_ROOT_ENV, "/run/simulated/sys")
    assert sys_root() == Path("/run/simulated/sys")


def test_the_hosts_own_pci_devices_are_no_cards() -> None:
    # This machine's real sysfs, read by the same function: a device that is no NVIDIA card gives
    # nothing (a simulated card's bus id read there takes no other device's topology); a real card
    # gives the root directory its kernel path starts with.
    host = sorted((Path("/sys") / "bus" / "pci" / "devices").glob("*"))
    if not host:
        pytest.skip("this machine shows no PCI devices")
    for p in host:
        real = p.resolve(strict=True)
        assert real.is_relative_to(Path("/sys/devices")), real
        root, _ = pci_topology(f"0000{p.name}", Path("/sys"))
        if (p / "vendor").read_text().strip() == NVIDIA_PCI_VENDOR:
            assert root == real.relative_to("/sys/devices").parts[0], real
        else:
            assert root is None, real
