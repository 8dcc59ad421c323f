"""Where a GpuSlice pod's create -> Running goes, stage by stage, against a plain pod on the same node.

    .venv/bin/python bench/pod_start_stages.py [--pods 10] [--dir DIR] [--json]

Starts the devcluster of `bench/real_node.py` (control plane, one real node, operator, agent), runs
plain and GpuSlice pods on the real node alternately (as real_node.py does) and times each stage
from three clocks of the same machine: a pod watch (created, bound by kube-scheduler, kubelet's
Initialized, Running), containerd's log (RunPodSandbox, CreateContainer, StartContainer) and the
agent's log (claim prepared). Prints the median of each stage for both kinds and the difference:
- scheduling: created -> bound (kube-scheduler; for slice pods its DRA allocation and claim write);
- kubelet, before the sandbox: bound -> RunPodSandbox (for slice pods kubelet's NodePrepareResources
  call to the agent is in it: the agent's "claim prepared" comes just before the sandbox);
- sandbox, container create (CDI injection), container start (runc: mounts, devices, seccomp);
- the status write: container started -> Running seen.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from _realnode import fresh_cluster, parse_args, start_real_node_cluster
from real_node import Watch, interleaved, is_running

from gpuslice_dev.devcluster.cluster import DevCluster

NODE = "real-node-0"
STAGES = (
    ("scheduling", "created", "bound"),
    ("kubelet before sandbox", "bound", "sandbox_start"),
    ("sandbox", "sandbox_start", "sandbox_ready"),
    ("container create", "sandbox_ready", "container_created"),
    ("container start", "container_created", "container_started"),
    ("started -> Running seen", "container_started", "running"),
    ("total (created -> Running)", "created", "running"),
)


def _condition(name: str) -> Any:
    return lambda o: any(
        c["type"] == name and c["status"] == "True" for c in o.get("status", {}).get("conditions", [])
    )


def _stamp(line: str) -> float:
    found = re.search(r'time="([^"]+)"', line)
    assert found is not None
    return datetime.fromisoformat(found.group(1)[:26] + "+00:00").timestamp()


def containerd_times(log: Path) -> dict[str, dict[str, float]]:
    """Per pod name: when its sandbox and its (one) container were asked for and done."""
    sandboxes: dict[str, str] = {}
    containers: dict[str, str] = {}
    out: dict[str, dict[str, float]] = {}
    for line in log.read_text(errors="replace").splitlines():
        if "RunPodSandbox for name" in line:
            found = re.search(r'name:\\"([^\\]+)', line)
            assert found is not None
            pod = found.group(1)
            done = re.search(r'returns sandbox id \\"(\w+)', line)
            if done:
                sandboxes[done.group(1)] = pod
            out.setdefault(pod, {})["sandbox_ready" if done else "sandbox_start"] = _stamp(line)
        elif "CreateContainer within sandbox" in line:
            found = re.search(r'sandbox \\"(\w+)', line)
            done = re.search(r'returns container id \\"(\w+)', line)
            if found and done and found.group(1) in sandboxes:
                containers[done.group(1)] = sandboxes[found.group(1)]
                out[sandboxes[found.group(1)]]["container_created"] = _stamp(line)
        elif "StartContainer for" in line and "returns successfully" in line:
            found = re.search(r'StartContainer for \\"(\w+)', line)
            if found and found.group(1) in containers:
                out[containers[found.group(1)]]["container_started"] = _stamp(line)
    return out


def agent_prepared(log: Path) -> dict[str, float]:
    out = {}
    for line in log.read_text(errors="replace").splitlines():
        if '"claim prepared"' in line:
            rec = json.loads(line)
            stamp = datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00")).timestamp()
            out[rec["claim"].split("/", 1)[1]] = stamp
    return out


def metric_total(text: str, metric: str, selector: str) -> float:
    """The sum of a Prometheus text exposition's `metric` samples whose labels contain `selector`."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(metric + "{") and selector in line
    )


def kubelet_dra_means(cluster: DevCluster) -> dict[str, float]:
    """From kubelet's own histograms: its whole DRA prepare per GpuSlice pod (its claim read and
    checkpoints, and the agent's gRPC call; plain pods' calls cost nothing and add nothing to the
    sum) and the agent's gRPC call alone, in mean seconds."""
    text = cluster.kubectl("get", "--raw", f"/api/v1/nodes/{NODE}/proxy/metrics").stdout
    grpc = "dra_grpc_operations_duration_seconds"
    calls = metric_total(text, f"{grpc}_count", 'NodePrepareResources"')
    if not calls:
        return {}
    prepare = metric_total(text, "dra_operations_duration_seconds_sum", 'operation_name="PrepareResources"')
    return {
        "kubelet DRA prepare (mean)": prepare / calls,
        "  of it the agent's gRPC (mean)": metric_total(text, f"{grpc}_sum", 'NodePrepareResources"') / calls,
    }


def scheduler_points(cluster: DevCluster) -> dict[str, float]:
    """kube-scheduler's seconds per extension point, summed over all pods of the run (plain pods add
    near nothing to the DRA points); the caller divides by the GpuSlice pods."""
    st = cluster.state()
    assert st is not None
    user = yaml.safe_load(cluster.kubeconfig.read_text())["users"][0]["user"]
    port = st.ports["kube-scheduler"]
    argv = ["curl", "-sk", "--cert", user["client-certificate"], "--key", user["client-key"]]
    text = subprocess.run([*argv, f"https://127.0.0.1:{port}/metrics"], capture_output=True, text=True).stdout
    return {
        f"  scheduler {point} (sum per slice pod)": metric_total(
            text, "scheduler_framework_extension_point_duration_seconds_sum", f'extension_point="{point}"'
        )
        for point in ("PreFilter", "Filter", "Reserve", "PreBind", "Bind")
    }


def stage_table(
    cluster: DevCluster, watch: Watch, claims: Watch, names: dict[str, list[str]]
) -> dict[str, Any]:
    runtime = containerd_times(cluster.dir / "logs" / f"containerd-{NODE}.log")
    prepared = agent_prepared(cluster.dir / "logs" / f"agent-{NODE}.log")
    table: dict[str, Any] = {}
    for kind, pods in names.items():
        rows: list[dict[str, float]] = []
        for name in pods:
            seen = {
                "created": watch.first(name, lambda o: True),
                "bound": watch.first(name, lambda o: bool(o["spec"].get("nodeName"))),
                "running": watch.first(name, is_running),
                # a GpuSlice pod's claim (named after it): made by the operator, allocated by kube-scheduler
                "claim_made": claims.first(name, lambda o: True),
                "allocated": claims.first(name, lambda o: bool(o.get("status", {}).get("allocation"))),
            }
            row = {k: v for k, v in seen.items() if v is not None} | runtime.get(name, {})
            if name in prepared:
                row["prepared"] = prepared[name]
            rows.append(row)
        stages = {
            label: statistics.median(r[b] - r[a] for r in rows if a in r and b in r) for label, a, b in STAGES
        }
        for label, a, b in (
            ("  claim made by the operator (from the pod's create)", "created", "claim_made"),
            ("  claim allocated (from the pod's create)", "created", "allocated"),
            ("  allocated -> bound", "allocated", "bound"),
        ):
            gaps = [r[b] - r[a] for r in rows if a in r and b in r]
            if gaps:
                stages[label] = statistics.median(gaps)
        with_prepare = [r["sandbox_start"] - r["prepared"] for r in rows if "prepared" in r]
        if with_prepare:
            stages["agent's prepared -> sandbox start"] = statistics.median(with_prepare)
        table[kind] = {k: round(v, 3) for k, v in stages.items()}
    return table


def main() -> int:
    args = parse_args(__doc__, pods=10)
    cluster = fresh_cluster(args.dir, "gpuslice-bench-stages-")
    try:
        start_real_node_cluster(cluster, kwok_nodes=1)
        watch = Watch(cluster)
        claims = Watch(cluster, "resourceclaims")
        time.sleep(1)
        interleaved(cluster, NODE, args.pods, watch)
        time.sleep(1)
        watch.stop()
        claims.stop()
        names = {
            "plain": [f"plain-{NODE}-{i}" for i in range(args.pods)],
            "gpuslice": [f"slice-{NODE}-{i}" for i in range(args.pods)],
        }
        table = stage_table(cluster, watch, claims, names)
        table["gpuslice"] |= {k: round(v, 4) for k, v in kubelet_dra_means(cluster).items()}
        points = scheduler_points(cluster)
        table["gpuslice"] |= {k: round(v / args.pods, 4) for k, v in points.items()}
    finally:
        cluster.down()
    if args.json:
        print(json.dumps(table, indent=2))
        return 0
    print(f"{'stage (median s)':34}{'plain':>9}{'GpuSlice':>10}{'diff':>8}")
    for label in table["gpuslice"]:
        plain = table["plain"].get(label)
        sliced = table["gpuslice"][label]
        if plain is None:
            print(f"{label:34}{'':>9}{sliced:>10.3f}")
        else:
            print(f"{label:34}{plain:>9.3f}{sliced:>10.3f}{sliced - plain:>+8.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
