"""The shim tells what a slice's software cannot do on its GPU, from real runtimes and real images.

NVIDIA's libcudart (12.9 and 13.0 from PyPI) loads kernel images assembled by NVIDIA's ptxas, under
the shim on the driver test double; the usage region's software record (shim/src/gs_region.h,
`gs_software`) must name what the image carries and what the GPU needs, and the agent's
`status.usage.software` says it to the tenant. A build with the GPU's code records nothing.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpuslice.agent.usage import software_status, usage_status
from gpuslice.shim.region import read_usage
from gpuslice.shim.software import SoftwareKind
from gpuslice_dev.gpusim import cudart, kernels
from gpuslice_dev.gpusim.build import ShimPaths
from gpuslice_dev.paths import SHIM_SOURCE_DIR
from shim.shim_helpers import V100

T4 = "1x Tesla T4"


@pytest.fixture(scope="module")
def probes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("cudart")
    source = SHIM_SOURCE_DIR / "tests" / "cudart_probe.c"
    return {major: cudart.build_program(source, major, out / f"probe{major}") for major in ("12", "13")}


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return kernels.write_builds(tmp_path_factory.mktemp("images"))


def under_slice(
    built: ShimPaths, usage: Path, spec: str, driver: str, *cmd: str | Path
) -> subprocess.CompletedProcess[str]:
    del built  # the shim and the double are built by the fixture
    usage.mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, "-m", "gpuslice_dev", "shim", "run", "--memory", "8Gi", "--simulate-gpus", spec,
         "--simulate-driver", driver, "--usage-dir", str(usage), "--", *map(str, cmd)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_a_build_without_volta_is_recorded_with_its_architectures(
    built: ShimPaths, probes: dict[str, Path], images: dict[str, Path], tmp_path: Path
) -> None:
    out = under_slice(built, tmp_path / "u", V100, "535", probes["12"], "load", images["no-volta"], "fill")
    assert "load 209 cudaErrorNoKernelImageForDevice" in out.stdout, out.stdout + out.stderr
    rec = read_usage(tmp_path / "u").software.record
    assert rec is not None and rec.kind == SoftwareKind.NO_KERNEL_IMAGE
    assert (rec.image_architectures, rec.device_arch, rec.cuda_error) == (
        ["sm_75", "sm_90", "compute_90"],
        70,
        209,
    )
    assert rec.process == "probe12" and rec.driver_version == 12020
    assert rec.library == ""  # read into the process's memory, then loaded: no file to name


def test_a_build_with_the_gpus_code_records_nothing_and_clears_an_earlier_record(
    built: ShimPaths, probes: dict[str, Path], images: dict[str, Path], tmp_path: Path
) -> None:
    usage = tmp_path / "u"
    under_slice(built, usage, V100, "535", probes["12"], "load", images["no-volta"], "fill")
    assert software_status(read_usage(usage).software) is not None
    ok = under_slice(built, usage, V100, "535", probes["12"], "all", images["sm70"], "fill")
    assert "failures=0" in ok.stdout, ok.stdout + ok.stderr
    state = read_usage(usage).software
    assert software_status(state) is None  # a later process loaded kernels that run: condition clears
    assert state.first_use_time is not None  # and it created a context: the GPU is used


def test_the_same_build_runs_on_a_t4(
    built: ShimPaths, probes: dict[str, Path], images: dict[str, Path], tmp_path: Path
) -> None:
    out = under_slice(built, tmp_path / "u", T4, "580", probes["12"], "load", images["no-volta"], "fill")
    assert "load 0 cudaSuccess" in out.stdout, out.stdout + out.stderr
    assert read_usage(tmp_path / "u").software.record is None


def test_ptx_newer_than_the_driver_compiles_is_recorded(
    built: ShimPaths, probes: dict[str, Path], images: dict[str, Path], tmp_path: Path
) -> None:
    out = under_slice(built, tmp_path / "u", V100, "535", probes["12"], "load", images["ptx85"], "fill")
    assert "load 222 cudaErrorUnsupportedPtxVersion" in out.stdout, out.stdout + out.stderr
    rec = read_usage(tmp_path / "u").software.record
    assert (
        rec is not None and rec.kind == SoftwareKind.PTX_TOO_NEW and rec.image_architectures == ["compute_70"]
    )


def test_a_cuda13_runtime_on_a_535_driver_is_recorded_and_told(
    built: ShimPaths, probes: dict[str, Path], tmp_path: Path
) -> None:
    out = under_slice(built, tmp_path / "u", V100, "535", probes["13"], "version")
    assert "cudaErrorInsufficientDriver" in out.stdout, out.stdout + out.stderr
    snapshot = read_usage(tmp_path / "u")
    rec = snapshot.software.record
    assert rec is not None and rec.kind == SoftwareKind.DRIVER_TOO_OLD
    assert (rec.runtime_version, rec.driver_version) == (13000, 12020)
    sw = usage_status(snapshot, 8 << 30, "2026-12-05T12:00:00Z")["software"]
    assert (sw["reason"], sw["runtimeCudaVersion"], sw["driverCudaVersion"]) == (
        "DriverTooOld",
        "13.0",
        "12.2",
    )


def test_a_cuda13_runtime_on_a_580_driver_records_nothing(
    built: ShimPaths, probes: dict[str, Path], tmp_path: Path
) -> None:
    out = under_slice(built, tmp_path / "u", V100, "580", probes["13"], "version")
    assert "count=0 cudaSuccess" in out.stdout, out.stdout + out.stderr
    assert read_usage(tmp_path / "u").software.record is None
