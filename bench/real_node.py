"""What a real node costs on this machine, against a kwok node measured in the same run.

    .venv/bin/python bench/real_node.py [--pods 20] [--dir DIR] [--json]

Starts a fresh devcluster (control plane + one kwok node), then one real node (kubelet, containerd,
runc, CNI); measures
- `up` time: the control plane alone, then what the real node adds (containerd, image import,
  kubelet until the Node is Ready);
- pod create -> Running latency as one pod watch sees both (no client start-up, no polling
  interval in it), one pod after the other (median, quartiles and extremes of `--pods`),
  for plain probe-image pods on the kwok node (kwok plays the kubelet), then for plain pods, plain
  pods with the RuntimeDefault seccomp profile (what restricted Pod Security requires of every
  tenant pod, and what a GpuSlice pod is given) and GpuSlice pods on the real node, taking turns, so
  the machine's load weighs on all alike: the GpuSlice/plain ratios (operator + agent + DRA
  allocation and prepare + CDI, and against the plain pod also the seccomp profile) are taken within
  one run, of the medians and pair by pair;
- idle RSS of kubelet + containerd after the pods are gone.
Prints a table, then one line with the ratios (or JSON with --json).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import threading
import time
from typing import Any

from _realnode import NS, PROBE, fresh_cluster, gpuslice, parse_args, start_real_node_cluster

from gpuslice_dev.devcluster.cluster import DevCluster
from gpuslice_dev.devcluster.realnode import process_names


def pod(name: str, node: str, claim: str | None = None, *, seccomp: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": 0,
        "nodeSelector": {"kubernetes.io/hostname": node},
        "containers": [{"name": "main", "image": PROBE, "command": ["sleep", "3600"]}],
    }
    if seccomp:
        # What the slice-seccomp policy gives a GpuSlice pod, and what restricted Pod Security
        # requires of every tenant pod.
        spec["securityContext"] = {"seccompProfile": {"type": "RuntimeDefault"}}
    if claim:
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim}]
        spec["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS}, "spec": spec}


class Watch:
    """`kubectl get <resource> -w -o json`, each object stamped with the time it arrived."""

    def __init__(self, cluster: DevCluster, resource: str = "pods") -> None:
        argv = [
            "kubectl",
            "--kubeconfig",
            str(cluster.kubeconfig),
            "get",
            resource,
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


def is_running(obj: dict[str, Any]) -> bool:
    return bool(obj.get("status", {}).get("phase") == "Running")


def one_pod(
    cluster: DevCluster, node: str, name: str, watch: Watch, *, sliced: bool, seccomp: bool = False
) -> float:
    """Create one pod (a GpuSlice's when `sliced`), time create -> Running as a watch sees them (the
    API server's news of the pod, not kubectl's start-up or a polling interval), then delete it
    (and its slice and claim, so the namespace's slice quota is free for the next one)."""
    if sliced:
        cluster.apply(json.dumps(gpuslice(name)))
    cluster.apply(json.dumps(pod(name, node, claim=name if sliced else None, seccomp=seccomp)))
    deadline = time.monotonic() + 120
    while (running := watch.first(name, is_running)) is None:
        if time.monotonic() > deadline:
            raise SystemExit(f"pod {name} not Running after 120 s")
        time.sleep(0.02)
    created = watch.first(name, lambda o: True)
    assert created is not None
    took = running - created
    cluster.kubectl("delete", "pod", name, "-n", NS, "--wait=true", "--grace-period=0", "--force")
    if sliced:
        cluster.kubectl("delete", "gpuslice", name, "-n", NS, "--wait=true")
        # the claim goes by garbage collection, after the slice; until then it counts in the quota
        cluster.kubectl(
            "wait", "--for=delete", f"resourceclaim/{name}", "-n", NS, "--timeout=60s", check=False
        )
    return took


def latencies(cluster: DevCluster, node: str, count: int, watch: Watch) -> list[float]:
    return [one_pod(cluster, node, f"plain-{node}-{i}", watch, sliced=False) for i in range(count)]


KINDS = ("plain", "seccomp", "slice")


def interleaved(cluster: DevCluster, node: str, count: int, watch: Watch) -> dict[str, list[float]]:
    """`count` plain pods, `count` plain pods with the RuntimeDefault seccomp profile and `count`
    GpuSlice pods on `node`, taking turns (the order rotating), so the machine's load at any moment
    weighs on all alike."""
    out: dict[str, list[float]] = {k: [] for k in KINDS}
    for i in range(count):
        for kind in KINDS[i % 3 :] + KINDS[: i % 3]:
            took = one_pod(
                cluster, node, f"{kind}-{node}-{i}", watch, sliced=kind == "slice", seccomp=kind == "seccomp"
            )
            out[kind].append(took)
    return out


def spread(values: list[float]) -> dict[str, float]:
    """Median, interquartile range and extremes, in seconds."""
    q1, med, q3 = statistics.quantiles(values, n=4, method="inclusive")
    named = {"median": med, "p25": q1, "p75": q3, "min": min(values), "max": max(values)}
    return {k: round(v, 3) for k, v in named.items()}


def rss_mib(cluster: DevCluster, node: str) -> dict[str, float]:
    st = cluster.state()
    assert st is not None
    return {k: st.processes[v].rss_bytes() / 2**20 for k, v in process_names(node).items()}


def main() -> int:
    args = parse_args(__doc__, pods=20)
    cluster = fresh_cluster(args.dir, "gpuslice-bench-node-")
    try:
        up = start_real_node_cluster(cluster, kwok_nodes=1)
        control_plane, real_node_up = up.control_plane_s, up.real_node_s
        watch = Watch(cluster)
        try:
            kwok = latencies(cluster, "kwok-node-0", args.pods, watch)
            times = interleaved(cluster, "real-node-0", args.pods, watch)
        finally:
            watch.stop()
        real, seccomp, sliced = times["plain"], times["seccomp"], times["slice"]
        load = os.getloadavg()
        time.sleep(10)  # let the node settle after the last pod
        rss = rss_mib(cluster, "real-node-0")
    finally:
        cluster.down()
    pods = {
        "kwok": spread(kwok),
        "real": spread(real),
        "real_seccomp": spread(seccomp),
        "real_gpuslice": spread(sliced),
    }
    ratios = [s / p for p, s in zip(real, sliced, strict=True)]
    ratios_seccomp = [s / p for p, s in zip(seccomp, sliced, strict=True)]
    result = {
        "control_plane_up_s": round(control_plane, 2),
        "real_node_up_s": round(real_node_up, 2),
        "pod_running_s": pods,
        "gpuslice_over_real": {
            "of_medians": round(pods["real_gpuslice"]["median"] / pods["real"]["median"], 3),
            "pairs": spread(ratios),
        },
        "gpuslice_over_real_seccomp": {
            "of_medians": round(pods["real_gpuslice"]["median"] / pods["real_seccomp"]["median"], 3),
            "pairs": spread(ratios_seccomp),
        },
        "idle_rss_mib": {k: round(v, 1) for k, v in rss.items()} | {"total": round(sum(rss.values()), 1)},
        "pods": args.pods,
        "load_average_1m": round(load[0], 2),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{'pod create -> Running':34}{'median s':>10}{'p25':>8}{'p75':>8}{'min':>8}{'max':>8}")
    for key, label in (("kwok", "plain pod, kwok node"), ("real", "plain pod, real node"),
                       ("real_seccomp", "plain + RuntimeDefault, real node"),
                       ("real_gpuslice", "GpuSlice pod, real node")):  # fmt: skip
        row = pods[key]
        print(
            f"{label:34}{row['median']:>10.3f}"
            + "".join(f"{row[k]:>8.3f}" for k in ("p25", "p75", "min", "max"))
        )
    pairs = result["gpuslice_over_real"]["pairs"]
    print(
        f"GpuSlice/plain on the real node: {result['gpuslice_over_real']['of_medians']:.2f}x of the medians; "
        f"pairwise {pairs['median']:.2f}x (p25 {pairs['p25']:.2f}, p75 {pairs['p75']:.2f}); "
        f"{args.pods} pods of each, interleaved; load average {load[0]:.1f}"
    )
    pairs = result["gpuslice_over_real_seccomp"]["pairs"]
    print(
        f"GpuSlice/plain with RuntimeDefault seccomp: "
        f"{result['gpuslice_over_real_seccomp']['of_medians']:.2f}x of the medians; "
        f"pairwise {pairs['median']:.2f}x (p25 {pairs['p25']:.2f}, p75 {pairs['p75']:.2f})"
    )
    print(f"control plane up {control_plane:.1f} s; real node adds {real_node_up:.1f} s")
    print(f"idle RSS: kubelet {rss['kubelet']:.0f} MiB + containerd {rss['containerd']:.0f} MiB")
    print(
        f"ratio real/kwok pod start {pods['real']['median'] / pods['kwok']['median']:.2f}x, "
        f"real node up +{real_node_up / control_plane:.2f}x of the control plane's, "
        f"idle RSS {sum(rss.values()):.0f} MiB"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
