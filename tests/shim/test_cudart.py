"""NVIDIA's own CUDA runtime (libcudart 12.9 and 13.0 from PyPI) on the driver test double.

A C program linked against the wheel's libcudart (shim/tests/cudart_probe.c) starts the runtime,
reads the device's properties, allocates, copies, uses streams, events, a stream-ordered pool,
managed memory, a graph with a memory node, loads a real kernel image (PTX assembled by NVIDIA's
ptxas, in a fatbin) the way nvcc-built programs register theirs, launches it and resets the device.
The double must answer what the runtime asks exactly as far as the runtime can tell; where it does
not, the runtime refuses to start (cudaErrorCallRequiresNewerDriver, 36, in every call).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpuslice_dev.gpusim import cudart, kernels, simulate
from gpuslice_dev.gpusim.build import ShimPaths
from gpuslice_dev.paths import SHIM_SOURCE_DIR
from shim.shim_helpers import GIB, V100, run, values

PROBE_SOURCE = SHIM_SOURCE_DIR / "tests" / "cudart_probe.c"
PROCS_DATA = SHIM_SOURCE_DIR / "tests" / "data"


@pytest.fixture(scope="module")
def probes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("cudart")
    return {
        major: cudart.build_program(PROBE_SOURCE, major, out / f"cudart_probe{major}")
        for major in ("12", "13")
    }


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Real kernel images: cubins by ptxas, PTX, packed into fatbins as nvcc packs them."""
    return kernels.write_builds(tmp_path_factory.mktemp("images"))


@dataclass
class Double:
    """The runtime probes and kernel images, run on the driver double (no shim)."""

    built: ShimPaths
    probes: dict[str, Path]
    images: dict[str, Path]
    tmp_path: Path

    def env(self, spec: str = V100, driver: str = "535") -> dict[str, str]:
        """The environment that loads the double simulating `spec` under a `driver` driver."""
        config = simulate.write_fake_config(
            simulate.parse_gpu_spec(spec, seed="cudart"),
            self.tmp_path / "fake-gpus.conf",
            *simulate.driver_versions(driver),
        )
        return {**os.environ, **simulate.fake_driver_env(config, self.built.fake_dir)}

    def run(
        self,
        major: str,
        *args: str | Path,
        spec: str = V100,
        driver: str = "535",
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """The CUDA `major` runtime's probe with `args`, in `env` or on the double as `env()` sets it."""
        return subprocess.run(
            [str(self.probes[major]), *map(str, args)],
            env=env if env is not None else self.env(spec, driver),
            capture_output=True,
            text=True,
            timeout=120,
        )


@pytest.fixture
def double(built: ShimPaths, probes: dict[str, Path], images: dict[str, Path], tmp_path: Path) -> Double:
    return Double(built, probes, images, tmp_path)


def assert_all_steps_pass(proc: subprocess.CompletedProcess[str]) -> None:
    failed = [line for line in proc.stdout.splitlines() if " FAIL " in line]
    assert proc.returncode == 0 and not failed and "failures=0" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("spec", list(simulate.KNOWN_MODELS))
def test_the_runtime_reads_each_models_properties(double: Double, spec: str) -> None:
    proc = double.run("12", "props", spec=f"1x {spec}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got, model = values(proc.stdout), simulate.KNOWN_MODELS[spec]
    assert got["name"] == spec
    assert int(got["total"]) == model.memory_bytes == int(got["mem_total"])
    assert got["cc"] == model.compute_capability
    assert int(got["sms"]) == model.multiprocessors
    assert int(got["clock_khz"]) == model.clock_khz
    assert int(got["memory_clock_khz"]) == model.memory_clock_khz
    assert int(got["bus_width"]) == model.memory_bus_width
    assert int(got["l2"]) == model.l2_cache_bytes
    assert int(got["warp"]) == 32 and int(got["regs_per_block"]) == 65536


def test_v100_limits_as_the_driver_reports_them(double: Double) -> None:
    got = values(double.run("12", "props").stdout)
    assert int(got["threads_per_sm"]) == 2048
    assert int(got["shared_per_sm"]) == 96 * 1024
    assert int(got["shared_per_block"]) == 48 * 1024
    assert got["managed"] == "1" and got["concurrent_managed"] == "1"
    assert got["pci"] == "0000:04:00"


@pytest.mark.parametrize(("major", "driver"), [("12", "535"), ("12", "580"), ("13", "580")])
def test_the_runtime_runs_on_the_double(double: Double, major: str, driver: str) -> None:
    assert_all_steps_pass(double.run(major, "all", double.images["sm70"], "fill", driver=driver))


def test_a_cuda13_runtime_is_refused_by_a_535_driver(double: Double) -> None:
    out = double.run("13", "version", driver="535").stdout
    assert "runtime=13000 driver=12020 count=35 cudaErrorInsufficientDriver" in out, out
    out = double.run("13", "version", driver="580").stdout
    assert "runtime=13000 driver=13000 count=0 cudaSuccess devices=1" in out, out


@pytest.mark.parametrize(
    ("spec", "image", "driver", "load", "kernel"),
    [
        (V100, "sm70", "535", "0 cudaSuccess", "0 cudaSuccess"),
        # no code for 7.0 and PTX for a newer target: the driver's "no kernel image"
        (V100, "no-volta", "580", "209 cudaErrorNoKernelImageForDevice", None),
        ("1x Tesla T4", "no-volta", "580", "0 cudaSuccess", "0 cudaSuccess"),  # sm_75 code runs on 7.5
        (V100, "ptx85", "535", "222 cudaErrorUnsupportedPtxVersion", None),  # PTX ISA 8.5 > 12.2's 8.2
        (V100, "ptx85", "580", "0 cudaSuccess", "0 cudaSuccess"),  # a 580 driver JIT-compiles it
    ],
)
def test_the_double_picks_kernel_images_like_the_driver(
    double: Double, spec: str, image: str, driver: str, load: str, kernel: str | None
) -> None:
    out = double.run("12", "load", double.images[image], "fill", spec=spec, driver=driver).stdout
    assert f"load {load}" in out, out
    if kernel:
        assert f"kernel {kernel}" in out, out


def test_the_runtime_sees_the_slice_under_the_shim(make_slice, probes: dict[str, Path]) -> None:
    prepared = make_slice(memory_bytes=8 * GIB, simulate_gpus=V100)
    proc = run(prepared, [probes["12"], "props"])
    got = values(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert got["name"] == "Tesla V100-PCIE-32GB"
    assert int(got["total"]) == 8 * GIB and int(got["mem_total"]) == 8 * GIB


@pytest.mark.parametrize(("major", "driver"), [("12", "535"), ("13", "580")])
def test_the_runtime_runs_under_an_8gib_slice(
    make_slice, probes: dict[str, Path], images: dict[str, Path], major: str, driver: str
) -> None:
    prepared = make_slice(memory_bytes=8 * GIB, simulate_gpus=V100, driver=driver)
    assert_all_steps_pass(run(prepared, [probes[major], "all", images["sm70"], "fill"]))


def test_the_integrity_check_uses_md2() -> None:
    """The keyed hash the runtime verifies is HMAC over MD2: the double's MD2 gives RFC 1319's answers."""
    from gpuslice_dev.gpusim.build import ensure_built

    lib = ctypes.CDLL(str(ensure_built().fake_cuda))
    out = ctypes.create_string_buffer(16)
    for message, digest in [
        (b"", "8350e5a3e24c153df2275c9f80692773"),
        (b"abc", "da853b0d3f88d99b30283a69e6ded6bb"),
        (b"12345678901234567890123456789012345678901234567890123456789012345678901234567890",
         "d5976f79d83d3a0dc9806c3c66f3efd8"),
    ]:  # fmt: skip
        lib.gpuslice_fake_md2(message, ctypes.c_size_t(len(message)), out)
        assert out.raw.hex() == digest


@pytest.mark.parametrize(("major", "driver", "data"), [("12", "535", "cudart-12.9-procs.txt"),
                                                        ("13", "580", "cudart-13.0-procs.txt")])  # fmt: skip
def test_every_name_the_runtime_looks_up_is_answered_as_by_the_driver(
    double: Double, major: str, driver: str, data: str
) -> None:
    """The recorded list (test data for replays through the shim) is what the runtime asks today, and
    the double answers each name except those newer than the simulated driver."""
    log = double.tmp_path / "procs.log"
    env = {**double.env(driver=driver), "GPUSLICE_FAKE_PROC_LOG": str(log)}
    assert_all_steps_pass(double.run(major, "all", double.images["sm70"], "fill", env=env))
    asked = [line.split("\t") for line in log.read_text().splitlines()]
    recorded = [
        line.split() for line in (PROCS_DATA / data).read_text().splitlines() if not line.startswith("#")
    ]
    assert [(n, v, f) for n, v, f, *_ in asked if n] == [tuple(r) for r in recorded]
    driver_version = simulate.driver_versions(driver)[1]
    refused = {n for n, _v, _f, rc, *_ in asked if n and rc != "0"}
    # a name is refused only if the simulated driver is older than every variant of it
    newest_known = _since_by_name()
    assert all(newest_known[n] > driver_version for n in refused if n in newest_known), refused
    assert refused <= set(newest_known), refused - set(newest_known)


def _since_by_name() -> dict[str, int]:
    """The oldest CUDA version each name is served from, from src/gs_procs.h."""
    import re

    text = (SHIM_SOURCE_DIR / "src" / "gs_procs.h").read_text()
    since: dict[str, int] = {}
    for name, version in re.findall(r"XP?\((cu\w+), (\d+),", text):
        since[name] = min(since.get(name, 1 << 30), int(version))
    return since


def toc(built: ShimPaths, image: bytes, tmp_path: Path) -> list[list[str]]:
    path = tmp_path / "image.fatbin"
    path.write_bytes(image)
    out = subprocess.run(
        [str(built.tests_dir / "fatbin_toc"), str(path)], capture_output=True, text=True, check=True
    )
    return [line.split() for line in out.stdout.splitlines()]


def test_the_fatbin_parser_reads_nvidias_own_images(built: ShimPaths, tmp_path: Path) -> None:
    """The device runtime's fatbins in the wheels: CUDA 12.9 carries sm_70 (LZ4: decoded, its ELF
    header agrees), CUDA 13.0 has dropped Volta and starts at sm_75 (zstd)."""
    cuda12 = toc(built, kernels.device_runtime_fatbin("12"), tmp_path)
    cuda13 = toc(built, kernels.device_runtime_fatbin("13"), tmp_path)
    cubins12 = {int(e[1]): e for e in cuda12 if e[0] == "cubin"}
    assert {50, 60, 70, 75, 80, 90} <= set(cubins12)
    assert cubins12[70][2] == "lz4" and cubins12[70][5] == "elf-sm70"
    assert all(e[5] == f"elf-sm{e[1]}" for e in cubins12.values())
    archs13 = {int(e[1]) for e in cuda13 if e[0] == "cubin"}
    assert min(archs13) == 75 and 70 not in archs13
    assert {e[2] for e in cuda13} == {"zstd"}


def test_a_v100_has_no_kernel_image_in_a_cuda13_build(double: Double) -> None:
    image = double.tmp_path / "devrt13.fatbin"
    image.write_bytes(kernels.device_runtime_fatbin("13"))
    out = double.run("13", "load", image, "x", driver="580").stdout
    assert "load 209 cudaErrorNoKernelImageForDevice" in out, out


@pytest.fixture(scope="module")
def curand(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """A fatbin of cuRAND 12 and of cuRAND 13 (real nvcc output) with kernels, and one kernel's name."""
    out = tmp_path_factory.mktemp("curand")
    images: dict[str, tuple[Path, str]] = {}
    for major in ("12", "13"):
        fatbin, name = kernels.library_kernel_fatbin(major)
        path = out / f"curand{major}.fatbin"
        path.write_bytes(fatbin)
        images[major] = (path, name)
    return images


@pytest.mark.parametrize(
    ("major", "driver", "spec", "load", "kernel"),
    [
        ("12", "535", V100, "0 cudaSuccess", "0 cudaSuccess"),  # carries sm_70: runs
        ("13", "580", V100, "209 cudaErrorNoKernelImageForDevice", None),  # Volta dropped: no image
        ("13", "580", "1x Tesla T4", "0 cudaSuccess", "0 cudaSuccess"),  # sm_75 code: runs on a T4
    ],
)
def test_real_library_images_load_where_the_driver_loads_them(
    double: Double,
    curand: dict[str, tuple[Path, str]],
    major: str,
    driver: str,
    spec: str,
    load: str,
    kernel: str | None,
) -> None:
    path, name = curand[major]
    env = double.env(spec, driver)
    out = double.run(major, "load", path, name, env=env).stdout
    assert f"load {load}" in out, out
    if kernel:
        assert f"kernel {kernel}" in out, out
        out = double.run(major, "load", path, "no_such_kernel", env=env).stdout
        assert "kernel 500 cudaErrorSymbolNotFound" in out, out


def test_shim_run_simulates_the_driver_branch_asked_for(probes: dict[str, Path]) -> None:
    from shim.test_shim_cli import gpuslice_dev

    base = ["shim", "run", "--memory", "8Gi", "--simulate-gpus", V100]
    on_580 = gpuslice_dev(*base, "--simulate-driver", "580", "--", str(probes["13"]), "version")
    assert "runtime=13000 driver=13000 count=0 cudaSuccess" in on_580.stdout, on_580.stdout + on_580.stderr
    unknown = gpuslice_dev(*base, "--simulate-driver", "470", "--", "true")
    assert unknown.returncode == 2 and "unknown driver branch '470'; known: 535, 580" in unknown.stderr
