"""Run a command under the shim outside Kubernetes: what `gpuslice-dev shim run` and the tests use.

Prepares a private directory with the limits file, a copy of libgpuslice.so patched to read it, and
(when simulating) the driver test double's GPU description; the command gets LD_PRELOAD of that copy.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuslice.shim.config import SliceConfig
from gpuslice.shim.region import create_usage_region
from gpuslice_dev.gpusim import patch, simulate
from gpuslice_dev.gpusim.build import ShimPaths, ensure_built


class ShimRunError(RuntimeError):
    pass


@dataclass(frozen=True)
class PreparedSlice:
    workdir: Path
    config_path: Path
    shim: Path
    usage_dir: Path
    config: SliceConfig
    env: dict[str, str]
    fake_gpus: list[simulate.FakeGpu] | None


def discover_gpu_uuid(index: int = 0) -> str:
    """UUID of the host's GPU `index` through NVML (the real driver, or the double if loaded)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(index))
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # pynvml raises NVMLError subclasses and OSError when no driver
        raise ShimRunError(
            f"cannot find GPU {index} through NVML ({exc}); pass --gpu-uuid, or --simulate-gpus to use "
            "the driver test double"
        ) from exc
    return uuid.decode() if isinstance(uuid, bytes) else str(uuid)


def prepare(
    *,
    memory_bytes: int | None,
    compute_share: int = 100,
    simulate_gpus: str | None = None,
    gpu_uuid: str | None = None,
    usage_dir: Path | None = None,
    context_overhead_bytes: int = 0,
    workdir: Path | None = None,
    seed: str | None = None,
    built: ShimPaths | None = None,
    driver: str = "535",
) -> PreparedSlice:
    built = built or ensure_built()
    workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="gpuslice-shim-"))
    workdir.mkdir(parents=True, exist_ok=True)
    env: dict[str, str] = {}
    fake_gpus = None
    if simulate_gpus:
        fake_gpus = simulate.parse_gpu_spec(simulate_gpus, seed=seed or os.uname().nodename)
        driver_version, cuda_driver_version = simulate.driver_versions(driver)
        fake_config = simulate.write_fake_config(
            fake_gpus, workdir / "fake-gpus.conf", driver_version, cuda_driver_version
        )
        env.update(simulate.fake_driver_env(fake_config, built.fake_dir))
        gpu_uuid = gpu_uuid or fake_gpus[0].uuid
    uuid = gpu_uuid or discover_gpu_uuid()
    usage = Path(usage_dir) if usage_dir else workdir / "usage"
    create_usage_region(usage)  # as the node agent prepares it: any uid's shim can use it
    config = SliceConfig(
        memory_bytes=memory_bytes,
        compute_share=compute_share,
        gpu_uuid=uuid,
        usage_dir=str(usage.resolve()),
        context_overhead_bytes=context_overhead_bytes,
    )
    config_path = workdir / "slice.conf"
    config.write(config_path)
    shim = patch.write_private_shim(built.shim, config_path.resolve(), workdir / "lib")
    preload = os.environ.get("LD_PRELOAD")
    env["LD_PRELOAD"] = f"{shim} {preload}" if preload else str(shim)
    return PreparedSlice(workdir, config_path, shim, usage, config, env, fake_gpus)


def run(prepared: PreparedSlice, command: Sequence[str], **popen: object) -> int:
    """Run `command` under the prepared slice; returns its exit status (128+N for signal N)."""
    if not command:
        raise ShimRunError(
            "no command given: put it after `--`, e.g. gpuslice-dev shim run --memory 8Gi -- nvidia-smi"
        )
    try:
        proc = subprocess.run(list(command), env={**os.environ, **prepared.env}, check=False, **popen)  # type: ignore[call-overload]
    except FileNotFoundError as exc:
        raise ShimRunError(f"command not found: {command[0]}") from exc
    rc = int(proc.returncode)
    return 128 - rc if rc < 0 else rc
