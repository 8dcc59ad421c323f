"""Pod create -> Running on a real node: a product in resources.limits against a GpuSlice's claim.

    .venv/bin/python bench/product_form.py [--pods 10] [--dir DIR] [--json]

Starts a fresh devcluster with one real node (kubelet, containerd, runc) over one simulated V100,
the v100-8g product, a tenant namespace, the operator and the node agent; then, one pod at a time
and the forms taking turns (so load on the machine falls on all of them alike):
- `limits`: a pod with `resources.limits: {gpuslice.io/v100-8g: 1}` (kube-scheduler makes its claim),
  timed from the pod's create to Running, and to its GpuSlice (the operator's, spec.pod) InUse;
- `gpuslice`: a GpuSlice applied first, then the pod using its claim, timed from the pod's create
  (what bench/real_node.py measures);
- `gpuslice+create`: the GpuSlice and the pod applied together, timed from the GpuSlice's apply
  (what a tenant who applies both at once waits).
Prints a table of medians and maxima (or JSON with --json).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from _realnode import NS, PACKAGE, PROBE, fresh_cluster, gpuslice, parse_args, start_real_node_cluster

from gpuslice_dev.devcluster.cluster import DevCluster

PRODUCT = f"gpuslice.io/{PACKAGE}"


def pod(name: str, claim: str | None = None) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "main", "image": PROBE, "command": ["sleep", "3600"]}
    spec: dict[str, Any] = {"terminationGracePeriodSeconds": 0, "containers": [container]}
    if claim:
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim}]
        container["resources"] = {"claims": [{"name": "gpu"}]}
    else:
        container["resources"] = {"limits": {PRODUCT: "1"}}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS}, "spec": spec}


def jsonpath(cluster: DevCluster, kind: str, name: str, path: str) -> str:
    out = cluster.kubectl("get", kind, name, "-n", NS, "-o", f"jsonpath={path}", check=False)
    return out.stdout


def until(check: Callable[[], bool], started: float, what: str) -> float:
    while not check():
        if time.monotonic() - started > 120:
            raise SystemExit(f"{what} not reached after 120 s")
        time.sleep(0.05)
    return time.monotonic() - started


def one(cluster: DevCluster, form: str, i: int) -> dict[str, float]:
    name = f"{form.replace('+', '-')}-{i}"
    out: dict[str, float] = {}
    running = lambda: jsonpath(cluster, "pod", name, "{.status.phase}") == "Running"  # noqa: E731
    if form == "limits":
        started = time.monotonic()
        cluster.apply(json.dumps(pod(name)))
        out["running"] = until(running, started, f"pod {name} Running")
        in_use = lambda: jsonpath(cluster, "gpuslice", name, "{.status.phase}") == "InUse"  # noqa: E731
        out["slice_in_use"] = until(in_use, started, f"GpuSlice {name} InUse")
    elif form == "gpuslice":
        cluster.apply(json.dumps(gpuslice(name)))
        until(
            lambda: bool(jsonpath(cluster, "resourceclaim", name, "{.metadata.uid}")),
            time.monotonic(),
            "claim",
        )
        started = time.monotonic()
        cluster.apply(json.dumps(pod(name, claim=name)))
        out["running"] = until(running, started, f"pod {name} Running")
    else:
        started = time.monotonic()
        cluster.apply(
            json.dumps({"apiVersion": "v1", "kind": "List", "items": [gpuslice(name), pod(name, name)]})
        )
        out["running"] = until(running, started, f"pod {name} Running")
    cluster.kubectl("delete", "pod", name, "-n", NS, "--wait=true", "--grace-period=0", "--force")
    if form != "limits":
        cluster.kubectl("delete", "gpuslice", name, "-n", NS, "--wait=true")
    # the next pod starts on a node that has unprepared this one's claim
    until(lambda: not cluster.kubectl("get", "resourceclaims", "-n", NS, "-o", "name").stdout.strip(),
          time.monotonic(), "claims gone")  # fmt: skip
    return out


def main() -> int:
    args = parse_args(__doc__, pods=10)
    cluster = fresh_cluster(args.dir, "gpuslice-bench-form-")
    forms = ("limits", "gpuslice", "gpuslice+create")
    samples: dict[str, list[dict[str, float]]] = {f: [] for f in forms}
    try:
        start_real_node_cluster(cluster, kwok_nodes=0)
        one(cluster, "limits", -1)  # warm-up: admission policies in place, images and paths cached
        for i in range(args.pods):
            for form in forms:
                samples[form].append(one(cluster, form, i))
    finally:
        cluster.down()
    result: dict[str, Any] = {"pods": args.pods}
    for form, runs in samples.items():
        for key in runs[0]:
            values = [r[key] for r in runs]
            result[f"{form}.{key}"] = {
                "median_s": round(statistics.median(values), 3),
                "max_s": round(max(values), 3),
            }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{'':44}{'median s':>10}{'max s':>10}")
    labels = {
        "limits.running": "resources.limits pod -> Running",
        "limits.slice_in_use": "resources.limits pod -> its GpuSlice InUse",
        "gpuslice.running": "pod of an existing GpuSlice -> Running",
        "gpuslice+create.running": "GpuSlice + pod applied together -> Running",
    }
    for key, label in labels.items():
        print(f"{label:44}{result[key]['median_s']:>10.3f}{result[key]['max_s']:>10.3f}")
    print(f"({args.pods} pods of each form, one at a time, forms taking turns)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
