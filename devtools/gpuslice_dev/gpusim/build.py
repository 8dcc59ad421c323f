"""Build libgpuslice.so and the NVIDIA driver test double from the repository's `shim/` with make."""

from __future__ import annotations

import fcntl
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from gpuslice_dev.paths import SHIM_SOURCE_DIR

#: devtools/gpuslice_dev/gpusim/build.py -> repository root
BUILD_DIR = SHIM_SOURCE_DIR / "build"


@dataclass(frozen=True)
class ShimPaths:
    shim: Path
    fake_cuda: Path
    fake_nvml: Path
    fake_dir: Path
    tests_dir: Path
    bench: Path
    driverd: Path  # the double's host-side part: gpuslice-fake-driverd --config <fake-gpus.conf>
    fault_tool: Path  # gpuslice-fake-gpu-fault: a card fails or recovers (gpusim.faults)


class ShimBuildError(RuntimeError):
    pass


def paths(build_dir: Path = BUILD_DIR) -> ShimPaths:
    fake = build_dir / "fake"
    return ShimPaths(
        shim=build_dir / "libgpuslice.so",
        fake_cuda=fake / "libcuda.so.1",
        fake_nvml=fake / "libnvidia-ml.so.1",
        fake_dir=fake,
        tests_dir=build_dir / "tests",
        bench=build_dir / "shim_bench",
        driverd=fake / "gpuslice-fake-driverd",
        fault_tool=fake / "gpuslice-fake-gpu-fault",
    )


def ensure_built(target: str = "all") -> ShimPaths:
    """Run `make -C shim` (a no-op when everything is current) and return the built paths.

    Concurrent callers serialize on a lock file, so parallel test processes never race in make.
    Raises ShimBuildError naming the build log when make fails.
    """
    if not (SHIM_SOURCE_DIR / "Makefile").is_file():
        raise ShimBuildError(
            f"shim sources not found at {SHIM_SOURCE_DIR}: "
            "building the shim needs a source checkout of gpuslice"
        )
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    log_path = BUILD_DIR / "make.log"
    with open(BUILD_DIR / ".make.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with open(log_path, "w") as log:
            result = subprocess.run(
                ["make", "-C", str(SHIM_SOURCE_DIR), target],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "MAKEFLAGS": ""},
                check=False,
            )
    if result.returncode != 0:
        tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise ShimBuildError(
            f"building the shim failed (make exit {result.returncode}); full log: {log_path}\n{tail}"
        )
    built = paths()
    missing = [p for p in (built.shim, built.fake_cuda, built.fake_nvml, built.driverd) if not p.is_file()]
    if missing:
        raise ShimBuildError(
            f"make succeeded but did not produce {', '.join(map(str, missing))}; see {log_path}"
        )
    return built
