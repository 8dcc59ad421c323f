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

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "operator"))
sys.path.insert(0, str(REPO / "bench"))

from real_node import NS, interleaved  # noqa: E402

from gpuslice_dev.devcluster.cluster import DevCluster  # noqa: E402
from gpuslice_dev.devcluster.node_agents import start_agents  # noqa: E402
from gpuslice_dev.devcluster.realnode import start_real_nodes  # noqa: E402

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


class PodWatch:
    """`kubectl get pods -w -o json`, each object stamped with the time it arrived."""

    def __init__(self, cluster: DevCluster) -> None:
        argv = [
            "kubectl",
            "--kubeconfig",
            str(cluster.kubeconfig),
            "get",
            "pods",
            "-n",
            NS,
            "-w",
            "-o",
            "json",
        ]
        self.events: list[tuple[float, dict[str, Any]]] = []
        self._proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        lines: list[str] = []
        for line in self._proc.stdout:
            lines.append(line)
            if line.rstrip("\n") == "}":  # kubectl indents; an object ends with a bare brace
                self.events.append((time.time(), json.loads("".join(lines))))
                lines = []

    def first(self, name: str, test: Any) -> float | None:
        return next((t for t, o in self.events if o["metadata"]["name"] == name and test(o)), None)

    def stop(self) -> None:
        self._proc.terminate()
        self._proc.wait()


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


def stage_table(cluster: DevCluster, watch: PodWatch, names: dict[str, list[str]]) -> dict[str, Any]:
    runtime = containerd_times(cluster.dir / "logs" / f"containerd-{NODE}.log")
    prepared = agent_prepared(cluster.dir / "logs" / f"agent-{NODE}.log")
    table: dict[str, Any] = {}
    for kind, pods in names.items():
        rows: list[dict[str, float]] = []
        for name in pods:
            seen = {
                "created": watch.first(name, lambda o: True),
                "bound": watch.first(name, lambda o: bool(o["spec"].get("nodeName"))),
                "running": watch.first(name, lambda o: o.get("status", {}).get("phase") == "Running"),
            }
            row = {k: v for k, v in seen.items() if v is not None} | runtime.get(name, {})
            if name in prepared:
                row["prepared"] = prepared[name]
            rows.append(row)
        stages = {
            label: statistics.median(r[b] - r[a] for r in rows if a in r and b in r) for label, a, b in STAGES
        }
        with_prepare = [r["sandbox_start"] - r["prepared"] for r in rows if "prepared" in r]
        if with_prepare:
            stages["agent's prepared -> sandbox start"] = statistics.median(with_prepare)
        table[kind] = {k: round(v, 3) for k, v in stages.items()}
    return table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pods", type=int, default=10)
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cluster = DevCluster(args.dir or Path(tempfile.mkdtemp(prefix="gpuslice-bench-stages-")))
    cluster.wipe()
    try:
        cluster.up(nodes=1)
        start_real_nodes(cluster, 1)
        cluster.apply_crds()
        cluster.apply(REPO / "manifests" / "samples" / "v100-8g.yaml")
        cluster.create_namespace(NS, {"tenant.example.com/project": "team-a"})
        cluster.start_process("operator", [sys.executable, "-m", "gpuslice", "operator",
                                           "--kubeconfig", str(cluster.kubeconfig)])  # fmt: skip
        start_agents(cluster, "1x Tesla V100-PCIE-32GB")
        watch = PodWatch(cluster)
        time.sleep(1)
        interleaved(cluster, NODE, args.pods)
        time.sleep(1)
        watch.stop()
        names = {
            "plain": [f"plain-{NODE}-{i}" for i in range(args.pods)],
            "gpuslice": [f"slice-{NODE}-{i}" for i in range(args.pods)],
        }
        table = stage_table(cluster, watch, names)
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
