from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from gpuslice_dev.gpusim.build import ShimPaths, ensure_built
from gpuslice_dev.gpusim.runner import PreparedSlice, prepare


@pytest.fixture(scope="session")
def built() -> ShimPaths:
    return ensure_built()


@pytest.fixture
def make_slice(built: ShimPaths, tmp_path: Path) -> Callable[..., PreparedSlice]:
    """A slice on the driver test double: prepare(memory_bytes=..., compute_share=..., ...)."""
    count = 0

    def factory(**kwargs: object) -> PreparedSlice:
        nonlocal count
        count += 1
        kwargs.setdefault("simulate_gpus", "1x Tesla V100-PCIE-32GB")
        kwargs.setdefault("seed", "test-node")
        return prepare(workdir=tmp_path / f"slice{count}", built=built, **kwargs)  # type: ignore[arg-type]

    return factory
