"""A devcluster with one real node (kubelet + containerd + runc) over simulated V100s, the operator,
the v100-8g product and a tenant namespace: what a tenant's pod meets on a GPU node."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from gpuslice_dev.devcluster.cluster import DevCluster
from gpuslice_dev.devcluster.node_agents import start_agents
from gpuslice_dev.devcluster.realnode import start_real_nodes
from node.node_cluster import GPU_SPEC, TENANT
from support import wait_for

REPO = Path(__file__).resolve().parents[2]


def _progress(msg: str) -> None:
    print(f"[real node] {msg}", file=sys.stderr, flush=True)


@pytest.fixture(scope="session")
def node_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    if os.geteuid() != 0:
        pytest.skip("real nodes need root (kubelet, containerd, runc)")
    c = DevCluster(tmp_path_factory.mktemp("realnode"), progress=_progress)
    try:
        c.up(nodes=0)
        start_real_nodes(c, 1)
        c.apply_crds()
        package = yaml.safe_load((REPO / "manifests" / "samples" / "v100-8g.yaml").read_text())
        package["spec"]["entitlements"][0]["slices"] = 8  # every 8 GiB slice of the node's two cards
        c.apply(yaml.safe_dump(package))
        c.create_namespace(TENANT, {"tenant.example.com/project": TENANT})
        c.start_process(
            "operator", [sys.executable, "-m", "gpuslice", "operator", "--kubeconfig", str(c.kubeconfig)]
        )
        start_agents(c, GPU_SPEC, progress=_progress)
        wait_for(
            lambda: c.kubectl("get", "deviceclass", "v100-8g.gpuslice.io", check=False).returncode == 0,
            90,
            "the operator's DeviceClass",
        )
        yield c
    finally:
        c.down()
