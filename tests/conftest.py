"""Shared fixtures: one real local control plane per test session.

Set GPUSLICE_TEST_CLUSTER_DIR to the --dir of a running `gpuslice-dev devcluster up` to reuse it
(fast iteration); otherwise the session starts its own in a temporary directory and stops it.
GPUSLICE_KUBERNETES (1.35, 1.36, 1.37; `make test KUBERNETES=1.36`) picks the Kubernetes minor of
every devcluster the suite starts.
"""

from __future__ import annotations

import os
import re
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuslice_dev.devcluster.binaries import KUBERNETES_ENV, BuildError, kubernetes_release
from gpuslice_dev.devcluster.cluster import DevCluster

REPO_ROOT = Path(__file__).resolve().parents[1]
TEST_NODES = int(os.environ.get("GPUSLICE_TEST_NODES", "3"))


def pytest_configure(config: pytest.Config) -> None:
    # A bad GPUSLICE_KUBERNETES stops the session here, before any cluster starts.
    try:
        kubernetes_release()
    except BuildError as exc:
        raise pytest.UsageError(str(exc)) from exc


def pytest_report_header() -> str:
    return (
        f"Kubernetes {kubernetes_release()} (${KUBERNETES_ENV}={os.environ.get(KUBERNETES_ENV) or 'unset'})"
    )


def _progress(msg: str) -> None:
    print(f"[devcluster] {msg}", file=sys.stderr, flush=True)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    reuse = os.environ.get("GPUSLICE_TEST_CLUSTER_DIR")
    if reuse:
        c = DevCluster(Path(reuse), progress=_progress)
        if not c.status() or not all(c.status().values()):
            pytest.fail(f"GPUSLICE_TEST_CLUSTER_DIR={reuse} holds no running devcluster")
        yield c
        return
    c = DevCluster(tmp_path_factory.mktemp("devcluster"), progress=_progress)
    try:
        c.up(nodes=TEST_NODES)
        yield c
    finally:
        c.down()


@pytest.fixture
def namespace(cluster: DevCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace per test, named after it; deleted afterwards (without waiting)."""
    base = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].rstrip("-")
    name = f"{base}-{uuid.uuid4().hex[:5]}"
    cluster.create_namespace(name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def _file_seconds(item: pytest.Item) -> float:
    """About how long the item's file takes: `slow(seconds=N)` on the file, else 0."""
    marker = item.get_closest_marker("slow")
    return float(marker.kwargs.get("seconds", 0)) if marker else 0.0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest files first, each file's tests kept together and in order: `make test` hands whole files to
    its workers in this order (with --no-loadscope-reorder), so a file of several minutes (the API
    server's outage) starts at once beside the others instead of last, alone, as the suite's tail."""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    ordered = sorted(files.values(), key=lambda tests: -max(_file_seconds(t) for t in tests))
    items[:] = [item for tests in ordered for item in tests]
