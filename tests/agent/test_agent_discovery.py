"""GPU discovery runs pynvml against the NVIDIA driver test double, exactly as against a real driver."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gpuslice import constants

DISCOVER = """
import json, sys
from pathlib import Path
from gpuslice import logs
from gpuslice.agent import gpus
from gpuslice_dev.gpusim import simulate
logs.configure()
simulate.use_fake_driver(simulate.write_node_config(sys.argv[1], sys.argv[2], Path(sys.argv[3])))
print(json.dumps([g.model_dump() for g in gpus.discover()]))
"""


def discover(spec: str, node: str, tmp: str) -> list[dict[str, object]]:
    # one process per discovery: the double is loaded into the process like the real driver
    out = subprocess.run(
        [sys.executable, "-c", DISCOVER, spec, node, tmp], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return list(json.loads(out.stdout))


def test_simulated_gpus_are_discovered_through_nvml(tmp_path: object) -> None:
    a = discover("2x Tesla V100-PCIE-32GB, 1x NVIDIA A100-SXM4-40GB", "node-a", f"{tmp_path}/a")
    assert [(g["index"], g["product_name"], g["memory_bytes"], g["cuda_compute_capability"]) for g in a] == [
        (0, "Tesla V100-PCIE-32GB", 32 * constants.GIB, "7.0"),
        (1, "Tesla V100-PCIE-32GB", 32 * constants.GIB, "7.0"),
        (2, "NVIDIA A100-SXM4-40GB", 40 * constants.GIB, "8.0"),
    ]
    for g in a:
        assert str(g["uuid"]).startswith("GPU-")
        assert g["driver_version"] and g["cuda_driver_version"]
        assert str(g["pci_bus_id"]).count(":") == 2
    assert [g["minor_number"] for g in a] == [0, 1, 2]
    assert len({g["uuid"] for g in a}) == 3

    again = discover("2x Tesla V100-PCIE-32GB, 1x NVIDIA A100-SXM4-40GB", "node-a", f"{tmp_path}/a2")
    other = discover("2x Tesla V100-PCIE-32GB, 1x NVIDIA A100-SXM4-40GB", "node-b", f"{tmp_path}/b")
    assert [g["uuid"] for g in again] == [g["uuid"] for g in a], "a node's cards keep their UUIDs"
    assert not {g["uuid"] for g in other} & {g["uuid"] for g in a}, "another node has other cards"


def agent(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuslice", "agent", *args], capture_output=True, text=True, timeout=300
    )


def test_without_a_driver_the_agent_says_what_to_do(tmp_path: object) -> None:
    # this machine has no NVIDIA driver: the real path must fail clearly, not fall back to a fake
    proc = agent("--node", "n", "--state-dir", f"{tmp_path}/s", "--plugins-dir", f"{tmp_path}/p",
                 "--registry-dir", f"{tmp_path}/r")  # fmt: skip
    assert proc.returncode == 1
    assert "NVML initialisation failed" in proc.stderr and "--simulate-gpus" in proc.stderr


def test_the_product_agent_has_no_simulation_switch(tmp_path: object) -> None:
    # simulation is dev tooling: the agent a cluster runs cannot be told to use a fake driver
    proc = agent("--node", "n", "--simulate-gpus", "1x Tesla V100-PCIE-32GB")
    assert proc.returncode == 2 and "unrecognized arguments: --simulate-gpus" in proc.stderr


def test_an_unknown_simulated_model_is_a_clear_error_before_anything_starts(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gpuslice_dev", "devcluster", "up", "--dir", str(tmp_path / "dc"),
         "--simulate-gpus", "2x Tesla Q900"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "unknown GPU model 'Tesla Q900'" in proc.stderr
    assert not (tmp_path / "dc" / "state.json").exists(), "nothing was started"


def test_the_topology_of_a_dgx1_and_a_pcie_node_comes_through_sysfs_and_nvml(tmp_path: object) -> None:
    # the double answers NVML's NvLink queries as a DGX-1's V100-SXM2 boards do (hybrid cube-mesh),
    # and its node's sysfs shows them on two root complexes, one per socket and NUMA node
    dgx = discover("8x Tesla V100-SXM2-16GB", "dgx", f"{tmp_path}/dgx")
    assert [g["nvlink_peers"] for g in dgx] == [
        [1, 2, 3, 4], [0, 2, 3, 5], [0, 1, 3, 6], [0, 1, 2, 7],
        [0, 5, 6, 7], [1, 4, 6, 7], [2, 4, 5, 7], [3, 4, 5, 6],
    ]  # fmt: skip
    assert [(g["pcie_root"], g["numa_node"]) for g in dgx] == [("pci0000:00", 0)] * 4 + [
        ("pci0000:80", 1)
    ] * 4
    # a PCIe board has no NVLink (NVML: NotSupported), nor does an SXM2 card without its peers
    pcie = discover("4x Tesla V100-PCIE-32GB", "pcie", f"{tmp_path}/pcie")
    assert [g["nvlink_peers"] for g in pcie] == [[], [], [], []]
    assert [(g["pcie_root"], g["numa_node"]) for g in pcie] == [("pci0000:00", 0)] * 4
    two = discover("2x Tesla V100-SXM2-16GB", "pair", f"{tmp_path}/pair")
    assert [g["nvlink_peers"] for g in two] == [[1], [0]]
