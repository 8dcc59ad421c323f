"""What nvidia-smi-style tools and DCGM-style exporters read through NVML, from the driver double.

pynvml (the real client library) queries the double in a child process, on an idle card and on a
card kept busy by gpuslice-probe's kernels: the board's fixed values are the model's, and power,
clocks and temperature follow the simulated load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gpuslice_dev.devcluster.images import probe_binary
from gpuslice_dev.gpusim import simulate
from gpuslice_dev.gpusim.build import ShimPaths

QUERY = r"""
import json, pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
bar1 = n.nvmlDeviceGetBAR1MemoryInfo(h)
cur, pend = n.nvmlDeviceGetEccMode(h)
print(json.dumps({
    "bar1_total": bar1.bar1Total, "bar1_used": bar1.bar1Used,
    "power_mw": n.nvmlDeviceGetPowerUsage(h), "limit_mw": n.nvmlDeviceGetEnforcedPowerLimit(h),
    "energy_mj": n.nvmlDeviceGetTotalEnergyConsumption(h),
    "temp": n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU),
    "sm_mhz": n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM),
    "sm_max_mhz": n.nvmlDeviceGetMaxClockInfo(h, n.NVML_CLOCK_SM),
    "mem_mhz": n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM),
    "pstate": n.nvmlDeviceGetPerformanceState(h),
    "ecc": [cur, pend],
    "ecc_errors": n.nvmlDeviceGetTotalEccErrors(h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC),
    "persistence": n.nvmlDeviceGetPersistenceMode(h),
    "pcie": [n.nvmlDeviceGetCurrPcieLinkGeneration(h), n.nvmlDeviceGetCurrPcieLinkWidth(h)],
    "util": n.nvmlDeviceGetUtilizationRates(h).gpu,
}))
n.nvmlShutdown()
"""


@pytest.fixture
def env(built: ShimPaths, tmp_path: Path) -> dict[str, str]:
    config = simulate.write_fake_config(
        simulate.parse_gpu_spec("1x Tesla V100-PCIE-32GB", seed="nvml"), tmp_path / "fake-gpus.conf"
    )
    return {**os.environ, **simulate.fake_driver_env(config, built.fake_dir)}


def query(env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", QUERY], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_an_idle_v100_reads_as_its_board(env: dict[str, str]) -> None:
    got = query(env)
    assert got["bar1_total"] == 32 << 30 and 0 < got["bar1_used"] < got["bar1_total"]
    assert got["limit_mw"] == 250_000
    assert 0 < got["power_mw"] < 250_000
    assert got["sm_max_mhz"] == 1380 and got["mem_mhz"] == 877
    assert got["sm_mhz"] < got["sm_max_mhz"]
    assert got["pstate"] == 0 and got["ecc"] == [1, 1] and got["ecc_errors"] == 0 and got["persistence"] == 1
    assert got["pcie"] == [3, 16]
    assert got["util"] == 0


def test_power_clocks_and_temperature_follow_the_load(env: dict[str, str], built: ShimPaths) -> None:
    idle = query(env)
    burn = subprocess.Popen(
        [str(probe_binary(built)), "burn", "4"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        time.sleep(1.5)
        busy = query(env)
    finally:
        burn.terminate()
        burn.wait(timeout=30)
    assert busy["util"] > 50
    assert busy["power_mw"] > idle["power_mw"]
    assert busy["sm_mhz"] == 1380
    assert busy["temp"] > idle["temp"]
    assert busy["energy_mj"] >= idle["energy_mj"]


#: What PyTorch's c10 CUDA driver API resolves from libnvidia-ml.so.1 (it asserts on a missing one).
TORCH_NVML_NAMES = [
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetGpuFabricInfoV",
    "nvmlDeviceGetHandleByPciBusId_v2",
    "nvmlDeviceGetNvLinkRemoteDeviceType",
    "nvmlDeviceGetNvLinkRemotePciInfo_v2",
    "nvmlInit_v2",
    "nvmlSystemGetCudaDriverVersion_v2",
]

NVLINK = r"""
import ctypes, pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
lib = n.nvmlLib if hasattr(n, "nvmlLib") else ctypes.CDLL("libnvidia-ml.so.1")
kind = ctypes.c_int(0)
print(lib.nvmlDeviceGetNvLinkRemoteDeviceType(h, 0, ctypes.byref(kind)))
buf = ctypes.create_string_buffer(512)
print(lib.nvmlDeviceGetGpuFabricInfoV(h, buf))
"""


def test_what_pytorch_resolves_is_there_and_a_pcie_v100_has_no_nvlink(
    env: dict[str, str], built: ShimPaths
) -> None:
    import ctypes

    lib = ctypes.CDLL(str(built.fake_nvml))
    assert [name for name in TORCH_NVML_NAMES if not hasattr(lib, name)] == []
    proc = subprocess.run([sys.executable, "-c", NVLINK], env=env, capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["3", "3"], proc.stdout + proc.stderr  # NVML_ERROR_NOT_SUPPORTED
