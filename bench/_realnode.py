"""What the real-node benchmarks share: their command line and their devcluster.

bench/real_node.py, bench/pod_start_stages.py and bench/product_form.py each start a fresh
devcluster with one real node (kubelet, containerd, runc) over one simulated V100, the v100-8g
product, a tenant namespace, the operator and the node agent, then time pods on it. Not a benchmark
itself (the leading underscore): the scripts import it from beside them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "operator"))

from gpuslice_dev.devcluster.cluster import DevCluster  # noqa: E402
from gpuslice_dev.devcluster.node_agents import start_agents  # noqa: E402
from gpuslice_dev.devcluster.realnode import start_real_nodes  # noqa: E402

PROBE = "localhost/gpuslice/probe:dev"
NS = "bench"
PACKAGE = "v100-8g"
GPUS = "1x Tesla V100-PCIE-32GB"


def parse_args(doc: str | None, pods: int) -> argparse.Namespace:
    """`--pods N` (default `pods`), `--dir DIR`, `--json`; `--help` prints the script's docstring."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pods", type=int, default=pods)
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--json", action="store_true")
    return ap.parse_args()


def fresh_cluster(directory: Path | None, prefix: str) -> DevCluster:
    """A devcluster in `directory` (else a new temporary one named `prefix`...), emptied of any
    earlier run's data."""
    cluster = DevCluster(directory or Path(tempfile.mkdtemp(prefix=prefix)))
    cluster.wipe()
    return cluster


@dataclass(frozen=True)
class UpTimes:
    """Seconds `cluster.up` took (the control plane and its kwok nodes), then the real node."""

    control_plane_s: float
    real_node_s: float


def start_real_node_cluster(cluster: DevCluster, *, kwok_nodes: int = 0) -> UpTimes:
    """Bring up the control plane with `kwok_nodes` kwok nodes, then real-node-0; apply the CRDs,
    the v100-8g sample product and the tenant namespace `NS` (project team-a); start the operator
    and the node agent over one simulated V100."""
    t0 = time.monotonic()
    cluster.up(nodes=kwok_nodes)
    control_plane = time.monotonic() - t0
    t1 = time.monotonic()
    start_real_nodes(cluster, 1)
    real_node = time.monotonic() - t1
    cluster.apply_crds()
    cluster.apply(REPO / "manifests" / "samples" / f"{PACKAGE}.yaml")
    cluster.create_namespace(NS, {"tenant.example.com/project": "team-a"})
    cluster.start_process("operator", [sys.executable, "-m", "gpuslice", "operator",
                                       "--kubeconfig", str(cluster.kubeconfig)])  # fmt: skip
    start_agents(cluster, GPUS)
    return UpTimes(control_plane, real_node)


def gpuslice(name: str) -> dict[str, Any]:
    """A GpuSlice of the v100-8g product in `NS`; its claim is named after it."""
    meta = {"name": name, "namespace": NS}
    return {
        "apiVersion": "gpuslice.io/v1beta1",
        "kind": "GpuSlice",
        "metadata": meta,
        "spec": {"package": PACKAGE},
    }
