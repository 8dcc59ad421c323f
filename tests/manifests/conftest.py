"""Fixtures for the deploy manifests: the kustomize output, rendered by the kubectl the project builds."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuslice_dev.devcluster.binaries import ensure_binaries

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "manifests"

Doc = dict[str, Any]


def render(kubectl: Path, directory: Path) -> list[Doc]:
    """`kubectl kustomize <directory>` as a list of objects; fails with kustomize's own message."""
    proc = subprocess.run(
        [str(kubectl), "kustomize", str(directory)], capture_output=True, text=True, timeout=60, check=False
    )
    if proc.returncode != 0:
        raise AssertionError(f"kubectl kustomize {directory} failed:\n{proc.stderr}")
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@pytest.fixture(scope="session")
def kubectl() -> Path:
    return ensure_binaries().kubectl


@pytest.fixture(scope="session")
def base(kubectl: Path) -> list[Doc]:
    return render(kubectl, MANIFESTS)


@pytest.fixture(scope="session")
def with_monitoring(kubectl: Path) -> list[Doc]:
    return render(kubectl, MANIFESTS / "overlays" / "monitoring")


@pytest.fixture(scope="session")
def renderer(kubectl: Path) -> Callable[[Path], list[Doc]]:
    return lambda directory: render(kubectl, directory)
