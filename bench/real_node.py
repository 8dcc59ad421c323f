"""What a real node costs on this machine, against a kwok node measured in the same run.

    .venv/bin/python bench/real_node.py [--pods 20] [--dir DIR] [--json]

Starts a fresh devcluster (control plane + one kwok node), then one real node (kubelet, containerd,
runc, CNI); measures
- `up` time: the control plane alone, then what the real node adds (containerd, image import,
  kubelet until the Node is Ready);
- pod create -> Running latency, one pod after the other (median and max of `--pods`), for plain
  probe-image pods on the real node against the same pods on the kwok node (kwok plays the kubelet,
  so the ratio is what a real kubelet + runtime add);
- the same for GpuSlice pods on the real node (operator + agent + DRA prepare + CDI);
- idle RSS of kubelet + containerd after the pods are gone.
Prints a table, then one line with the ratios (or JSON with --json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "operator"))

from gpuslice_dev.devcluster.cluster import DevCluster  # noqa: E402
from gpuslice_dev.devcluster.node_agents import start_agents  # noqa: E402
from gpuslice_dev.devcluster.realnode import process_names, start_real_nodes  # noqa: E402

PROBE = "localhost/gpuslice/probe:dev"
NS = "bench"


def pod(name: str, node: str, claim: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": 0,
        "nodeSelector": {"kubernetes.io/hostname": node},
        "containers": [{"name": "main", "image": PROBE, "command": ["sleep", "3600"]}],
    }
    if claim:
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim}]
        spec["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS}, "spec": spec}


def running(cluster: DevCluster, name: str) -> bool:
    out = cluster.kubectl("get", "pod", name, "-n", NS, "-o", "jsonpath={.status.phase}", check=False)
    return out.stdout == "Running"


def latencies(cluster: DevCluster, node: str, count: int, *, slices: bool = False) -> list[float]:
    times = []
    for i in range(count):
        name = f"{'slice' if slices else 'plain'}-{node}-{i}"
        docs = [pod(name, node, claim=name if slices else None)]
        if slices:
            meta = {"name": name, "namespace": NS}
            gpuslice = {"apiVersion": "gpuslice.io/v1alpha1", "kind": "GpuSlice", "metadata": meta}
            cluster.apply(json.dumps(gpuslice | {"spec": {"package": "v100-8g"}}))
        started = time.monotonic()
        cluster.apply(json.dumps(docs[0]))
        while not running(cluster, name):
            if time.monotonic() - started > 120:
                raise SystemExit(f"pod {name} not Running after 120 s")
            time.sleep(0.05)
        times.append(time.monotonic() - started)
        cluster.kubectl("delete", "pod", name, "-n", NS, "--wait=true", "--grace-period=0", "--force")
        if slices:
            cluster.kubectl("delete", "gpuslice", name, "-n", NS, "--wait=true")
    return times


def rss_mib(cluster: DevCluster, node: str) -> dict[str, float]:
    st = cluster.state()
    assert st is not None
    return {k: st.processes[v].rss_bytes() / 2**20 for k, v in process_names(node).items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pods", type=int, default=20)
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    directory = args.dir or Path(tempfile.mkdtemp(prefix="gpuslice-bench-node-"))
    cluster = DevCluster(directory)
    cluster.wipe()
    try:
        t0 = time.monotonic()
        cluster.up(nodes=1)
        control_plane = time.monotonic() - t0
        t1 = time.monotonic()
        start_real_nodes(cluster, 1)
        real_node_up = time.monotonic() - t1
        cluster.apply_crds()
        cluster.apply(REPO / "manifests" / "samples" / "v100-8g.yaml")
        cluster.create_namespace(NS, {"tenant.example.com/project": "team-a"})
        cluster.start_process("operator", [sys.executable, "-m", "gpuslice", "operator",
                                           "--kubeconfig", str(cluster.kubeconfig)])  # fmt: skip
        start_agents(cluster, "1x Tesla V100-PCIE-32GB")
        kwok = latencies(cluster, "kwok-node-0", args.pods)
        real = latencies(cluster, "real-node-0", args.pods)
        sliced = latencies(cluster, "real-node-0", args.pods, slices=True)
        time.sleep(10)  # let the node settle after the last pod
        rss = rss_mib(cluster, "real-node-0")
    finally:
        cluster.down()
    result = {
        "control_plane_up_s": round(control_plane, 2),
        "real_node_up_s": round(real_node_up, 2),
        "pod_running_median_s": {
            "kwok": round(statistics.median(kwok), 3),
            "real": round(statistics.median(real), 3),
            "real_gpuslice": round(statistics.median(sliced), 3),
        },
        "pod_running_max_s": {
            "kwok": round(max(kwok), 3),
            "real": round(max(real), 3),
            "real_gpuslice": round(max(sliced), 3),
        },
        "idle_rss_mib": {k: round(v, 1) for k, v in rss.items()} | {"total": round(sum(rss.values()), 1)},
        "pods": args.pods,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    med = result["pod_running_median_s"]
    print(f"{'':34}{'median s':>10}{'max s':>10}")
    for key, label in (("kwok", "pod -> Running, kwok node"), ("real", "pod -> Running, real node"),
                       ("real_gpuslice", "GpuSlice pod -> Running, real node")):  # fmt: skip
        print(f"{label:34}{med[key]:>10.3f}{result['pod_running_max_s'][key]:>10.3f}")
    print(f"control plane up {control_plane:.1f} s; real node adds {real_node_up:.1f} s")
    print(f"idle RSS: kubelet {rss['kubelet']:.0f} MiB + containerd {rss['containerd']:.0f} MiB")
    print(
        f"ratio real/kwok pod start {med['real'] / med['kwok']:.2f}x, "
        f"gpuslice/real {med['real_gpuslice'] / med['real']:.2f}x, "
        f"real node up +{real_node_up / control_plane:.2f}x of the control plane's, "
        f"idle RSS {sum(rss.values()):.0f} MiB"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
