"""Compatibility matrix: numba-cuda 0.30.4 (PyPI; NVVM and libdevice from the nvcc 12.9 wheel, the
runtime and NVRTC 12.9 its `cu12` extra brings, NVIDIA's driver bindings 12.9.10) on the driver test
double alone and under an 8 GiB slice of a simulated V100 (shim/README.md, "Real CUDA software").

NVVM 12.9 writes PTX 8.8, which a driver JITs from CUDA 12.9 on: the row runs on the simulated 580
driver (CUDA 13.0), and on the 535 driver (CUDA 12.2) numba's first kernel fails as it does on a real
535 (no nvJitLink, so no minor-version compatibility). Without nvJitLink numba links every kernel,
and the `link=` files, with the driver's own JIT linker (cuLinkCreate ... through cuda-core).

numba's import and first compile are the cost, so each mode runs every path in one process (started
once for this file). The double does not execute kernels: that they compile, link, load and launch,
and the memory they and the arrays take and give back, is what is judged, never computed values.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuslice_dev.gpusim.build import ShimPaths
from gpuslice_dev.gpusim.runner import prepare
from shim.matrix import CLIENTS, GIB, MODES, REAL_GPU, Tenant, explain, facts, numba_cuda_env, tenant

pytestmark = pytest.mark.slow(seconds=20)
SCRIPT = str(CLIENTS / "numba_paths.py")
#: A device function `int twice(int)` in numba's calling convention (the result through the first
#: parameter, a status returned), as `nvcc -ptx` of a `__device__` function would write it.
TWICE_PTX = """.version 7.0
.target sm_70
.address_size 64

.visible .func (.param .b32 func_retval0) twice(
\t.param .b64 twice_param_0,
\t.param .b32 twice_param_1
)
{
\t.reg .b32 %r<4>;
\t.reg .b64 %rd<2>;
\tld.param.u64 %rd1, [twice_param_0];
\tld.param.u32 %r1, [twice_param_1];
\tshl.b32 %r2, %r1, 1;
\tst.u32 [%rd1], %r2;
\tmov.u32 %r3, 0;
\tst.param.b32 [func_retval0+0], %r3;
\tret;
}
"""


@pytest.fixture(scope="module")
def ptx_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("numba-link") / "twice.ptx"
    path.write_text(TWICE_PTX)
    return path


def _factory(built: ShimPaths, tmp_path_factory: pytest.TempPathFactory):
    def factory(**kwargs: object) -> object:
        kwargs.setdefault("simulate_gpus", "1x Tesla V100-PCIE-32GB")
        kwargs.setdefault("seed", "test-node")
        return prepare(workdir=tmp_path_factory.mktemp("numba"), built=built, **kwargs)  # type: ignore[arg-type]

    return factory


def _run(t: Tenant, ptx_file: Path, *paths: str) -> dict[str, str]:
    proc = t.run([SCRIPT, str(ptx_file), *paths], extra_env=numba_cuda_env(t), timeout=300)
    assert proc.returncode == 0, explain(proc)
    f = facts(proc.stdout)
    f["_explain"] = explain(proc)
    return f


@pytest.fixture(scope="module")
def runs(
    built: ShimPaths, tmp_path_factory: pytest.TempPathFactory, ptx_file: Path
) -> Iterator[dict[str, tuple[Tenant, dict[str, str]]]]:
    """Every path, once per mode, on the 580 driver."""
    out = {}
    for mode in MODES:
        t = tenant(_factory(built, tmp_path_factory), mode, driver="580")
        out[mode] = (t, _run(t, ptx_file))
    yield out


def _no_errors(f: dict[str, str]) -> None:
    errors = {k: v for k, v in f.items() if k.endswith("_error") and k != "oversize_error"}
    assert not errors, f"{errors}\n{f['_explain']}"


@pytest.mark.parametrize("mode", MODES)
def test_detect_and_memory_info(runs, mode):
    t, f = runs[mode]
    _no_errors(f)
    assert f["implementation"] == "NVIDIA"  # numba-cuda's target, not numba's own deprecated one
    assert (f["detect"], f["detect_supported"], f["detect_names"]) == ("True", "True", t.name)
    assert f["cc"] == "7.0" or t.real
    assert int(f["mem_total"]) == t.total
    assert int(f["mem_free"]) <= t.total if t.real else int(f["mem_free"]) == t.total


@pytest.mark.parametrize("mode", MODES)
def test_device_arrays_and_the_edge(runs, mode):
    """A 1 GiB device array takes 1 GiB; 9 GiB fits the card, not the slice (numba's CudaAPIError
    carrying the driver's OUT_OF_MEMORY, which the shim answers); both given back."""
    t, f = runs[mode]
    start = int(f["one_gib_start"])
    assert start - int(f["one_gib_free"]) == GIB
    if t.available(start) >= 10 * GIB:
        assert f["oversize"] == f"ok {9 * GIB}"
    else:
        assert f["oversize_error"] == (
            "CudaAPIError: [<CUresult.CUDA_ERROR_OUT_OF_MEMORY: 2>] Call to cuMemAlloc results in "
            "CUDA_ERROR_OUT_OF_MEMORY"
        ), f["oversize_error"]
    assert int(f["arrays_free_after"]) == start


@pytest.mark.parametrize("mode", MODES)
def test_jit_kernel_and_a_linked_ptx_file(runs, mode):
    """A `@cuda.jit` kernel (NVVM's PTX 8.8, linked by the driver's JIT linker), one calling a device
    function from an external PTX file (`link=`), and the same link driven through the bindings'
    cuLink* calls: compiled, linked, loaded, launched, synchronized; every byte back but the
    loaded kernels' variables."""
    t, f = runs[mode]
    _no_errors(f)
    assert (f["jit"], f["jit_ptx_version"], f["link"]) == ("ok", "8.8", "ok")
    calls = [
        "cu_link_create", "cu_link_add_data", "cu_link_add_file", "cu_link_complete",
        "cu_module_load_data", "cu_link_destroy", "cu_module_get_function", "cu_launch_kernel",
        "cu_ctx_synchronize", "cu_module_unload",
    ]  # fmt: skip
    assert {c: f[c] for c in calls} == dict.fromkeys(calls, "0")
    assert f["linked_size_positive"] == "True"
    assert t.given_back(int(f["free_after"]), int(f["mem_free"]))


@pytest.mark.skipif(REAL_GPU, reason="the simulated 535 driver; a real card has its own")
def test_a_535_driver_cannot_jit_nvvm_12_9s_ptx(built, tmp_path_factory, ptx_file):
    """CUDA 12.2 JITs PTX up to 8.2: numba's first kernel fails at the link with the driver's
    CUDA_ERROR_UNSUPPORTED_PTX_VERSION, named as a driver names it; arrays still work."""
    t = tenant(_factory(built, tmp_path_factory), "slice", driver="535")
    f = _run(t, ptx_file, "arrays", "jit")
    assert f["jit_error"].startswith("CUDAError: CUDA_ERROR_UNSUPPORTED_PTX_VERSION"), f["jit_error"]
    assert int(f["one_gib_start"]) - int(f["one_gib_free"]) == GIB
