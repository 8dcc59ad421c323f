"""Scheduling latency of a multi-GPU product against a one-slice product, on many simulated nodes.

    .venv/bin/python bench/multigpu_scheduling.py [--nodes 100] [--probes 10] [--dir DIR] [--json]

Starts a fresh `gpuslice-dev devcluster` of `--nodes` kwok nodes whose ResourceSlices are what the
node agents publish (the agent's own builder) for 8 V100-SXM2 each, on two PCIe roots of 4 cards, and
two packages cut from them: `x4` (gpus: 4, topology: SamePcieRoot, one whole-card device per card)
and `s1` (fraction 25, four slices per card), both drawing from each card's shared counters. Then,
the two forms taking turns so that load on the machine falls on both alike, `--probes` times each:
a ResourceClaim of the product's form and a pod using it are created, and the time from the create
to the claim's allocation (kube-scheduler's answer) is taken; claim and pod are deleted before the
next. No operator runs: this is what kube-scheduler costs for each form. The allocation is seen by
polling `kubectl get` every 50 ms, an overhead both forms share. Prints medians, maxima and, last,
the ratio of the x4 median to the s1 median.
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

from _kwok import card, node_slices

from gpuslice import constants as c
from gpuslice.agent.gpus import GpuInfo
from gpuslice.agent.slices import Package
from gpuslice.api.package import GpuPackageSpec
from gpuslice.domain.deviceclass import device_class
from gpuslice.domain.multigpu import claim_spec
from gpuslice_dev.devcluster.cluster import DevCluster

MODEL = "Tesla V100-SXM2-16GB"
NS = "bench-multigpu"
SPECS = {
    "x4": GpuPackageSpec.model_validate({"gpuModel": MODEL, "gpus": 4, "topology": "SamePcieRoot"}),
    "s1": GpuPackageSpec.model_validate({"gpuModel": MODEL, "fraction": 25}),
}


def cards(node: str) -> list[GpuInfo]:
    return [
        card(
            node,
            i,
            MODEL,
            16 * c.GIB,
            bus=i + 4,
            pcie_root="pci0000:00" if i < 4 else "pci0000:80",
            numa_node=i // 4,
        )
        for i in range(8)
    ]


def published(nodes: list[str]) -> list[dict[str, Any]]:
    return node_slices(nodes, cards, [Package(n, s) for n, s in SPECS.items()])


def probe(cluster: DevCluster, form: str, i: int) -> float:
    name = f"{form}-{i}"
    claim = {
        "apiVersion": c.DRA_GROUP_VERSION,
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NS},
        "spec": claim_spec(form, SPECS[form]),
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
            "containers": [{"name": "main", "image": "x", "resources": {"claims": [{"name": "gpu"}]}}],
        },
    }
    body = json.dumps({"apiVersion": "v1", "kind": "List", "items": [claim, pod]})
    started = time.monotonic()
    cluster.kubectl("create", "-f", "-", input=body)
    while True:
        out = cluster.kubectl(
            "get",
            "resourceclaim",
            name,
            "-n",
            NS,
            "-o",
            "jsonpath={.status.allocation.devices.results[*].device}",
        )
        if out.stdout.split():
            took = time.monotonic() - started
            break
        if time.monotonic() - started > 120:
            raise SystemExit(f"{name} not allocated after 120 s")
        time.sleep(0.05)
    if len(out.stdout.split()) != SPECS[form].cards_per_product:
        raise SystemExit(f"{name}: allocated {out.stdout!r}")
    cluster.kubectl("delete", "pod,resourceclaim", name, "-n", NS, "--grace-period=0", "--wait=true")
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--probes", type=int, default=10)
    ap.add_argument("--dir", type=Path)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    cluster = DevCluster(a.dir or Path(tempfile.mkdtemp(prefix="bench-multigpu-")))
    cluster.up(nodes=a.nodes)
    try:
        nodes = cluster.nodes[: a.nodes]
        classes = [device_class(n, None, s, None) for n, s in SPECS.items()]
        docs = classes + published(nodes)
        cluster.kubectl(
            "apply",
            "--server-side",
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}),
        )
        cluster.create_namespace(NS)
        time.sleep(2)  # the scheduler's informers see the slices
        times: dict[str, list[float]] = {f: [] for f in SPECS}
        for i in range(a.probes):
            for form in ("s1", "x4") if i % 2 == 0 else ("x4", "s1"):
                times[form].append(probe(cluster, form, i))
    finally:
        cluster.down()
    result = {
        "nodes": len(nodes),
        "cards": 8 * len(nodes),
        "probes": a.probes,
        **{f"{f}_median_s": round(statistics.median(t), 3) for f, t in times.items()},
        **{f"{f}_max_s": round(max(t), 3) for f, t in times.items()},
    }
    result["ratio_x4_to_s1"] = round(result["x4_median_s"] / result["s1_median_s"], 2)
    if a.json:
        print(json.dumps(result))
        return 0
    print(f"{'form':6} {'median s':>9} {'max s':>7}")
    for f in SPECS:
        print(f"{f:6} {result[f + '_median_s']:9.3f} {result[f + '_max_s']:7.3f}")
    print(
        f"ratio x4/s1 (median create -> allocated): {result['ratio_x4_to_s1']}"
        f" on {len(nodes)} nodes x 8 cards"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
