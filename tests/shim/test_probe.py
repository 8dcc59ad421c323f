"""gpuslice-probe, the probe image's tenant program, against the driver test double on the host.

With the shim (LD_PRELOAD of a private libgpuslice.so and a limits file) it must show what a tenant
sees in a slice; without it, the card.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from gpuslice_dev.devcluster.images import probe_binary
from gpuslice_dev.gpusim.build import ShimPaths
from shim.shim_helpers import GIB, env_of, run

LIMIT = 8 * GIB


@pytest.fixture(scope="module")
def gp(built: ShimPaths) -> Path:
    path = probe_binary(built)
    assert path.is_file(), f"make -C shim did not build {path}"
    return path


def _lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line]


def test_is_dynamically_linked_against_glibc_and_the_driver_by_soname(gp: Path) -> None:
    dyn = subprocess.run(["readelf", "-d", str(gp)], capture_output=True, text=True, check=True).stdout
    needed = {line.split("[")[1].rstrip("]") for line in dyn.splitlines() if "(NEEDED)" in line}
    assert {"libcuda.so.1", "libnvidia-ml.so.1", "libc.so.6"} <= needed
    assert "RPATH" not in dyn and "RUNPATH" not in dyn  # the loader (or CDI) decides which driver
    interp = subprocess.run(["readelf", "-l", str(gp)], capture_output=True, text=True, check=True).stdout
    assert "/lib64/ld-linux-x86-64.so.2" in interp


def test_smi_prints_the_card_without_the_shim(make_slice, gp: Path) -> None:
    s = make_slice(memory_bytes=None, simulate_gpus="1x Tesla V100-PCIE-32GB, 1x Tesla T4")
    result = run(s, [gp, "smi"], shim=False)
    assert result.returncode == 0, result.stderr
    assert _lines(result.stdout) == ["Tesla V100-PCIE-32GB, 32768 MiB", "Tesla T4, 15360 MiB"]


def test_smi_prints_the_slice_under_the_shim(make_slice, gp: Path) -> None:
    s = make_slice(memory_bytes=LIMIT)
    result = run(s, [gp, "smi"])
    assert result.returncode == 0, result.stderr
    assert _lines(result.stdout) == ["Tesla V100-PCIE-32GB, 8192 MiB"]


def test_alloc_past_the_slice_is_out_of_memory_and_memory_is_kept_until_exit(make_slice, gp: Path) -> None:
    s = make_slice(memory_bytes=LIMIT)
    result = run(s, [gp, "alloc", "6Gi", "2Gi", "1", "1Gi"])
    assert result.returncode == 0, result.stderr
    assert _lines(result.stdout) == [
        f"cuMemAlloc({6 * GIB}) -> 0 CUDA_SUCCESS",
        f"cuMemAlloc({2 * GIB}) -> 0 CUDA_SUCCESS",
        "cuMemAlloc(1) -> 2 CUDA_ERROR_OUT_OF_MEMORY",
        f"cuMemAlloc({GIB}) -> 2 CUDA_ERROR_OUT_OF_MEMORY",
    ]
    # the process ended: its memory is back
    again = run(s, [gp, "alloc", "8Gi"])
    assert _lines(again.stdout) == [f"cuMemAlloc({LIMIT}) -> 0 CUDA_SUCCESS"]
    over = run(s, [gp, "alloc", str(LIMIT + 1)])
    assert _lines(over.stdout) == [f"cuMemAlloc({LIMIT + 1}) -> 2 CUDA_ERROR_OUT_OF_MEMORY"]


def test_alloc_without_the_shim_reaches_the_card(make_slice, gp: Path) -> None:
    s = make_slice(memory_bytes=LIMIT)
    result = run(s, [gp, "alloc", "16Gi", "17179869184", "1Gi"], shim=False)
    assert result.returncode == 0, result.stderr
    assert _lines(result.stdout)[:2] == [f"cuMemAlloc({16 * GIB}) -> 0 CUDA_SUCCESS"] * 2
    assert _lines(result.stdout)[2] == f"cuMemAlloc({GIB}) -> 2 CUDA_ERROR_OUT_OF_MEMORY"


@pytest.mark.parametrize(
    ("arg", "nbytes"),
    [("4096", 4096), ("4Ki", 4096), ("4KiB", 4096), ("512Mi", 512 << 20), ("3M", 3 << 20), ("2G", 2 * GIB)],
)
def test_sizes_take_binary_suffixes(make_slice, gp: Path, arg: str, nbytes: int) -> None:
    s = make_slice(memory_bytes=LIMIT)
    assert _lines(run(s, [gp, "alloc", arg]).stdout) == [f"cuMemAlloc({nbytes}) -> 0 CUDA_SUCCESS"]


def test_an_unexpected_driver_error_exits_1(make_slice, gp: Path) -> None:
    s = make_slice(memory_bytes=LIMIT)
    result = run(s, [gp, "alloc", "0"])
    assert _lines(result.stdout) == ["cuMemAlloc(0) -> 1 CUDA_ERROR_INVALID_VALUE"]
    assert result.returncode == 1


def test_an_nvml_failure_is_named_and_exits_1(make_slice, gp: Path, tmp_path: Path) -> None:
    s = make_slice(memory_bytes=None)
    env = {**env_of(s, shim=False), "GPUSLICE_FAKE_GPU_CONFIG": str(tmp_path / "missing.conf")}
    result = subprocess.run(
        [str(gp), "smi"], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 1
    assert "gpuslice-probe: nvmlInit_v2 failed:" in result.stderr


@pytest.mark.parametrize(
    "args",
    [[], ["alloc"], ["alloc", "12x"], ["alloc", "-1"], ["hold", "1Gi"], ["hold", "1Gi", "soon"],
     ["burn"], ["burn", "0"], ["burn", "1", "0"], ["burn", "1", "1000", "soon"], ["smi", "extra"],
     ["frobnicate"]],
)  # fmt: skip
def test_usage_errors_exit_2_with_help(make_slice, gp: Path, args: list[str]) -> None:
    s = make_slice(memory_bytes=LIMIT)
    result = run(s, [gp, *args])
    assert result.returncode == 2
    assert "usage: gpuslice-probe COMMAND" in result.stderr
    assert result.stdout == ""


def test_help_goes_to_stdout(make_slice, gp: Path) -> None:
    result = run(make_slice(memory_bytes=LIMIT), [gp, "--help"])
    assert result.returncode == 0
    for command in ("smi", "alloc SIZE...", "hold SIZE SECONDS", "burn SECONDS"):
        assert command in result.stdout


def test_hold_keeps_its_memory_until_sigterm_then_frees_and_exits_0(make_slice, gp: Path) -> None:
    s = make_slice(memory_bytes=LIMIT)
    holder = subprocess.Popen(
        [str(gp), "hold", "6Gi", "0"],
        env=env_of(s),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == f"held {6 * GIB} -> 0 CUDA_SUCCESS"
        # the slice is shared by every process in it
        assert _lines(run(s, [gp, "alloc", "4Gi"]).stdout) == [
            f"cuMemAlloc({4 * GIB}) -> 2 CUDA_ERROR_OUT_OF_MEMORY"
        ]
        holder.send_signal(signal.SIGTERM)
        assert holder.wait(timeout=30) == 0
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert _lines(run(s, [gp, "alloc", "4Gi"]).stdout) == [f"cuMemAlloc({4 * GIB}) -> 0 CUDA_SUCCESS"]


def test_hold_for_seconds_ends_by_itself(make_slice, gp: Path) -> None:
    s = make_slice(memory_bytes=LIMIT)
    result = run(s, [gp, "hold", "1Gi", "0.3"], timeout=30)
    assert result.returncode == 0, result.stderr
    assert _lines(result.stdout) == [f"held {GIB} -> 0 CUDA_SUCCESS"]


def test_hold_past_the_slice_says_so_and_exits_1(make_slice, gp: Path) -> None:
    s = make_slice(memory_bytes=LIMIT)
    result = run(s, [gp, "hold", "9Gi", "0"], timeout=30)
    assert result.returncode == 1
    assert _lines(result.stdout) == [f"held {9 * GIB} -> 2 CUDA_ERROR_OUT_OF_MEMORY"]


def _share(stdout: str) -> float:
    last = _lines(stdout)[-1]
    assert last.startswith("share "), stdout
    return float(last.split()[1])


#: microseconds per kernel where a burn must reach the whole card: each launch costs the host a wake-up
#: on top of the kernel (the double's kernel is a sleep), a fraction of a millisecond on a loaded
#: machine, which 1 ms kernels would count as idle GPU time; 20 ms kernels keep it a few percent
LONG_KERNEL_US = "20000"


def test_burn_takes_the_whole_card_without_a_limit(make_slice, gp: Path) -> None:
    s = make_slice(memory_bytes=LIMIT, compute_share=100)
    result = run(s, [gp, "burn", "2", LONG_KERNEL_US])
    assert result.returncode == 0, result.stderr
    assert any(line.startswith("progress t=1s launches=") for line in result.stdout.splitlines())
    assert 75 <= _share(result.stdout) <= 100


def test_burn_is_steered_toward_the_slice_share(make_slice, gp: Path) -> None:
    s = make_slice(memory_bytes=LIMIT, compute_share=25)
    result = run(s, [gp, "burn", "5"])
    assert result.returncode == 0, result.stderr
    assert 15 <= _share(result.stdout) <= 35


def test_burn_stopped_by_sigterm_still_reports_its_share(make_slice, gp: Path) -> None:
    s = make_slice(memory_bytes=LIMIT)
    proc = subprocess.Popen(
        [str(gp), "burn", "600", LONG_KERNEL_US], env=env_of(s), stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith("burn seconds=600 ")
    assert proc.stdout.readline().startswith("progress t=1s ")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert _share(out) > 50
