"""The software-compatibility check on real framework wheels, not test fatbins: PyTorch as PyPI serves
it, run as a tenant's process under an 8 GiB slice of a simulated card, judged by the shim at its
first kernel and told to the tenant as the operator's SoftwareCompatible condition.

PyTorch 2.15 (CUDA 13.2) carries sm_75 to sm_120 cubins (zstd-compressed) in its libtorch_cuda.so
and no Volta code: on a V100 its first kernel fails with PyTorch's own "no kernel image is
available" error and the condition names what the library carries, the missing sm_70 and the
builds that still carry it. The same wheel on a T4 or an A100 runs, and so does PyTorch 2.9.1
(CUDA 12.8, with sm_70) on a V100 with the 535 driver. The double runs no kernels: what is judged is
whether the driver accepts them for the device, not computed values.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuslice.agent.usage import usage_status
from gpuslice.domain.software import SOFTWARE_COMPATIBLE, software_conditions
from gpuslice.shim.region import read_usage
from gpuslice_dev.gpusim.build import ShimPaths
from gpuslice_dev.gpusim.runner import prepare
from shim.matrix import CLIENTS, REAL_GPU, SLICE, TORCH, TORCH215, Tenant, explain, facts, torch_env

# warm, on one worker of the loaded 2-core machine: four PyTorch imports (6 to 45 s each under load)
pytestmark = [
    pytest.mark.slow(seconds=60),
    pytest.mark.skipif(REAL_GPU, reason="simulated cards of other architectures: the double only"),
]
SCRIPT = str(CLIENTS / "torch_compat.py")
V100 = "1x Tesla V100-PCIE-32GB"
NOW = "2026-12-07T12:00:00Z"


def run_torch(built: ShimPaths, workdir: Path, spec: str, driver: str, wheels: list[tuple[str, str]]):
    """PyTorch's first GPU work in a process of an 8 GiB slice of `spec` on the `driver` branch; its
    facts and the slice's SoftwareCompatible condition as the operator writes it."""
    prepared = prepare(
        workdir=workdir, built=built, memory_bytes=SLICE, simulate_gpus=spec, driver=driver, seed="test-node"
    )
    assert prepared.fake_gpus
    model = prepared.fake_gpus[0].name
    t = Tenant(prepared, True, SLICE, model)
    proc = t.run([SCRIPT], extra_env=torch_env(t, wheels), timeout=600)
    assert proc.returncode == 0, explain(proc)
    usage = usage_status(read_usage(prepared.usage_dir), SLICE, NOW)
    (cond,) = [c for c in software_conditions(usage, model, 1) if c.type == SOFTWARE_COMPATIBLE]
    return facts(proc.stdout), cond, usage, explain(proc)


def test_pytorch_2_15_on_a_v100_is_incompatible_and_says_which_build_runs(
    built: ShimPaths, tmp_path: Path
) -> None:
    f, cond, usage, why = run_torch(built, tmp_path, V100, "580", TORCH215)
    assert (f["torch"], f["cuda"], f["cc"]) == ("2.15.0+cu132", "13.2", "7.0"), why
    assert "sm_70" not in f["arch_list"].split(","), why  # PyTorch's own build list: no Volta
    assert f["kernels_ok"] == "0", why
    assert f["kernel_error"].endswith("no kernel image is available for execution on the device"), why
    sw = usage["software"]
    assert (sw["reason"], sw["cudaError"], sw["library"]) == ("NoKernelImageForGpu", 209, "libtorch_cuda.so")
    # what the library's fatbin carries, read by the shim from the real (zstd-compressed) images
    assert sw["imageArchitectures"] == ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
    assert (cond.status, cond.reason) == ("False", "NoKernelImageForGpu")
    for part in (
        "(in libtorch_cuda.so)",
        "Tesla V100-PCIE-32GB, sm_70",
        "includes sm_70",
        "--index-url https://download.pytorch.org/whl/cu126",
        "torch 2.9.1 from PyPI (CUDA 12.8)",
    ):
        assert part in cond.message, cond.message


@pytest.mark.parametrize("spec", ["1x Tesla T4", "1x NVIDIA A100-SXM4-40GB"], ids=["t4", "a100"])
def test_pytorch_2_15_on_a_t4_or_an_a100_is_compatible(built: ShimPaths, tmp_path: Path, spec: str) -> None:
    f, cond, usage, why = run_torch(built, tmp_path, spec, "580", TORCH215)
    assert f["kernels_ok"] == "1", why
    assert "software" not in usage
    assert (cond.status, cond.reason) == ("True", "NoIncompatibleImages")


def test_pytorch_2_9_1_on_a_v100_with_the_535_driver_is_compatible(built: ShimPaths, tmp_path: Path) -> None:
    f, cond, usage, why = run_torch(built, tmp_path, V100, "535", TORCH)
    assert (f["torch"], f["cc"]) == ("2.9.1+cu128", "7.0"), why
    assert "sm_70" in f["arch_list"].split(","), why
    assert f["kernels_ok"] == "1", why
    assert "software" not in usage
    assert (cond.status, cond.reason) == ("True", "NoIncompatibleImages")
