"""NVIDIA's CUDA runtime from its PyPI wheels, and C programs built against it (no CUDA toolkit).

`build_program(source, "12", out)` compiles a C file with gcc against the headers of the runtime
wheel (and the `crt/` headers of the nvcc wheel, which cuda_runtime_api.h includes) and links it to
that wheel's `libcudart.so.<major>` with an RPATH, so it runs on whatever `libcuda.so.1` the loader
finds: the driver double with `simulate.fake_driver_env`, the real driver otherwise.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from gpuslice_dev.gpusim.kernels import NVCC_WHEEL
from gpuslice_dev.wheels import ensure_unpacked


@dataclass(frozen=True)
class Runtime:
    wheel: str
    version: str
    subdir: str  # where the wheel keeps include/ and lib/
    soname: str


#: The runtimes the tests run: CUDA 12.9 (PyTorch's and CuPy's CUDA 12 builds) and CUDA 13.0.
RUNTIMES: dict[str, Runtime] = {
    "12": Runtime("nvidia-cuda-runtime-cu12", "12.9.79", "nvidia/cuda_runtime", "libcudart.so.12"),
    "13": Runtime("nvidia-cuda-runtime", "13.0.96", "nvidia/cu13", "libcudart.so.13"),
}


def runtime_dir(major: str) -> Path:
    rt = RUNTIMES[major]
    return ensure_unpacked(rt.wheel, rt.version) / rt.subdir


def build_program(source: Path, major: str, out: Path) -> Path:
    """`source` compiled and linked against libcudart `major` ("12" or "13") into `out`."""
    rt = RUNTIMES[major]
    root = runtime_dir(major)
    crt = ensure_unpacked(*NVCC_WHEEL) / "nvidia" / "cuda_nvcc" / "include"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        "gcc", "-std=gnu11", "-O1", "-g", "-Wall", "-Wextra", "-Werror",
        f"-I{root / 'include'}", f"-I{crt}", "-o", str(out), str(source),
        f"-L{root / 'lib'}", f"-l:{rt.soname}", f"-Wl,-rpath,{root / 'lib'}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr}")
    return out
