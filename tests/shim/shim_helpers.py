"""Run the shim's C test programs under a prepared slice (shim + driver test double)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

from gpuslice.shim.config import SliceConfig, SliceConfigError
from gpuslice_dev.gpusim.build import ShimPaths
from gpuslice_dev.gpusim.runner import PreparedSlice

GIB = 1024**3
V100 = "1x Tesla V100-PCIE-32GB"


def env_of(prepared: PreparedSlice, shim: bool = True) -> dict[str, str]:
    env = {**os.environ, **prepared.env}
    if not shim:
        env.pop("LD_PRELOAD", None)
    return env


def run(prepared: PreparedSlice, args: Sequence[str | Path], *, shim: bool = True, timeout: float = 120):
    return subprocess.run(
        [str(a) for a in args],
        env=env_of(prepared, shim),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def python_config_view(text: str) -> str:
    """What SliceConfig.parse makes of a slice config, in the form the C parser's `config_check`
    prints: `error`, or `ok memory=... share=... uuid=... overhead=... usage=...`."""
    try:
        c = SliceConfig.parse(text)
    except SliceConfigError:
        return "error"
    memory = "unlimited" if c.memory_bytes is None else str(c.memory_bytes)
    return (
        f"ok memory={memory} share={c.compute_share} uuid={c.gpu_uuid} "
        f"overhead={c.context_overhead_bytes} usage={c.usage_dir}"
    )


def values(output: str) -> dict[str, str]:
    """key=value lines of a probe's output."""
    return dict(
        line.split("=", 1) for line in output.splitlines() if "=" in line and " " not in line.split("=")[0]
    )


def probe(built: ShimPaths, name: str = "cuda_probe") -> Path:
    return built.tests_dir / name


class Holder:
    """A cuda_probe that allocates and keeps the memory until closed (a long-running tenant process)."""

    def __init__(self, prepared: PreparedSlice, built: ShimPaths, nbytes: int) -> None:
        self.proc = subprocess.Popen(
            [str(probe(built)), "hold", str(nbytes)],
            env=env_of(prepared),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("held rc="), (
            f"holder said {line!r}; stderr: {self.proc.stderr and self.proc.stderr.read()}"
        )
        self.rc = int(line.strip().split("=")[1])

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=30)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)
