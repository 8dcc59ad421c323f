"""The slice's limits file, mounted read-only at c.CONTAINER_CONFIG_PATH for the shim."""

from __future__ import annotations

from pathlib import Path

from gpuslice import constants as c
from gpuslice.shim.config import SliceConfig


def write_limits(path: Path, *, memory_bytes: int | None, compute_share: int, gpu_uuid: str) -> None:
    """Write the limits in the shim's format. The usage dir named inside is the container path the
    CDI spec mounts the slice's usage region at."""
    SliceConfig(
        memory_bytes=memory_bytes,
        compute_share=compute_share,
        gpu_uuid=gpu_uuid,
        usage_dir=c.CONTAINER_USAGE_DIR,
    ).write(path)
