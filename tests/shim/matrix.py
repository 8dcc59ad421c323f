"""The compatibility matrix's clients: NVIDIA's runtime and CuPy from their PyPI wheels, run on the
driver test double alone and under an 8 GiB slice of a simulated V100 (as `gpuslice-dev shim run
--memory 8Gi --simulate-gpus '1x Tesla V100-PCIE-32GB' -- ...` runs them).

Wheels are fetched once into ~/.cache/gpuslice/wheels (gpuslice_dev.wheels) and used unpacked from
there: nothing is installed into the test environment. Each client runs in its own process and
prints `key=value` facts (tests/shim/clients/); the tests judge them against the device the client
should see.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from gpuslice_dev.gpusim import simulate
from gpuslice_dev.gpusim.runner import PreparedSlice
from gpuslice_dev.wheels import ensure_unpacked

GIB = 1 << 30
SLICE = 8 * GIB
CLIENTS = Path(__file__).resolve().parent / "clients"

CUDART12 = ("nvidia-cuda-runtime-cu12", "12.9.79")
CUDART13 = ("nvidia-cuda-runtime", "13.0.96")
CUPY = [("cupy-cuda12x", "14.2.0"), ("cuda-pathfinder", "1.3.4"), ("numpy", "2.3.5"), CUDART12]
#: A 580 driver (CUDA 13.0): the first that starts a CUDA 13 runtime.
DRIVER_580 = ("580.65.06", 13000)

MODES = ["double", "slice"]


def cudart(major: int) -> Path:
    if major == 12:
        return ensure_unpacked(*CUDART12) / "nvidia" / "cuda_runtime" / "lib" / "libcudart.so.12"
    return ensure_unpacked(*CUDART13) / "nvidia" / "cu13" / "lib" / "libcudart.so.13"


def cupy_pythonpath() -> str:
    return os.pathsep.join(str(ensure_unpacked(name, version)) for name, version in CUPY)


@dataclass
class Tenant:
    """Where a client runs: the double alone (`shim=False`) or under the slice; what it should see."""

    prepared: PreparedSlice
    shim: bool
    total: int  # the memory the client must see: the slice's, or the whole simulated card's
    name: str

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {**os.environ, **self.prepared.env, **(extra or {})}
        if not self.shim:
            env.pop("LD_PRELOAD", None)
        return env

    def run(self, argv: list[str], *, extra_env: dict[str, str] | None = None, timeout: float = 180):
        return subprocess.run(
            [sys.executable, *argv],
            env=self.env(extra_env),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def popen(self, argv: list[str], *, extra_env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, *argv],
            env=self.env(extra_env),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )


def tenant(make_slice, mode: str, driver: tuple[str, int] | None = None) -> Tenant:
    prepared = make_slice(memory_bytes=SLICE)
    gpus = prepared.fake_gpus
    assert gpus
    if driver is not None:
        simulate.write_fake_config(
            gpus, prepared.workdir / "fake-gpus.conf", driver_version=driver[0], cuda_driver_version=driver[1]
        )
    shim = mode == "slice"
    return Tenant(prepared, shim, SLICE if shim else gpus[0].memory_bytes, gpus[0].name)


def facts(out: str) -> dict[str, str]:
    return dict(
        line.split("=", 1) for line in out.splitlines() if "=" in line and " " not in line.split("=")[0]
    )


def explain(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"


class Holder:
    """A client process that allocates, says `ready` on its first line, and holds until closed."""

    def __init__(
        self, t: Tenant, argv: list[str], ready: str, extra_env: dict[str, str] | None = None
    ) -> None:
        self.proc = t.popen(argv, extra_env=extra_env)
        self.ready = ready

    def __enter__(self) -> Holder:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if line != self.ready:
            self.__exit__()
            raise AssertionError(
                f"the holding process said {line!r}, not {self.ready!r}: {self.stderr[-3000:]}"
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.stderr = self.proc.stderr.read() if self.proc.stderr else ""

    stderr = ""
