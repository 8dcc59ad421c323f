"""The real-node devcluster the node files share (`node_cluster.fresh_node_cluster`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gpuslice_dev.devcluster.cluster import DevCluster
from node.node_cluster import fresh_node_cluster


@pytest.fixture(scope="session")
def node_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    with fresh_node_cluster(tmp_path_factory.mktemp("realnode")) as c:
        yield c
