"""Time from an XID to the device taint and to the replacement pod Running, on a real node.

    .venv/bin/python bench/gpu_health.py [--runs 5] [--dir D] [--json]

A devcluster with one real node over two simulated V100s, the operator, the agent and the v100-8g
package (or the running one in `--dir`, set up the same way), a Deployment of one replica holding a
GpuSlice's claim. Each run raises XID 79 on the card the pod's slice is on and measures, by polling
the API (kubectl, about 0.1-0.2 s a call on a 2-core machine, so each figure is an upper bound):
the XID to every device of that card carrying the taint, and to a replacement pod Running on the
other card; then resets the card (`--clear`) and waits for it to be untainted. Prints the median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from gpuslice_dev.devcluster.cluster import DevCluster
from gpuslice_dev.devcluster.node_agents import fake_gpu_config, start_agents
from gpuslice_dev.devcluster.realnode import start_real_nodes
from gpuslice_dev.gpusim import faults

REPO = Path(__file__).resolve().parents[1]
NODE, TENANT, APP = "real-node-0", "bench-health", "moving"


def get(cluster: DevCluster, *args: str) -> Any:
    proc = cluster.kubectl("get", *args, "-o", "json", check=False)
    return json.loads(proc.stdout) if proc.returncode == 0 else None


def card_of_claim(cluster: DevCluster) -> int | None:
    obj = get(cluster, "resourceclaim", APP, "-n", TENANT) or {}
    results = (((obj.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
    return int(results[0]["device"].split("-")[1]) if results else None


def card_tainted(cluster: DevCluster, index: int) -> bool:
    slices = (get(cluster, "resourceslices", "--field-selector", f"spec.nodeName={NODE}") or {}).get(
        "items", []
    )
    devices = [
        d
        for s in slices
        for d in s["spec"].get("devices") or []
        if d["attributes"]["gpuIndex"]["int"] == index
    ]
    return bool(devices) and all(d.get("taints") for d in devices)


def running(cluster: DevCluster, not_named: str | None = None) -> str | None:
    pods = (get(cluster, "pods", "-n", TENANT, "-l", f"app={APP}") or {}).get("items", [])
    for p in pods:
        name = p["metadata"]["name"]
        if (
            name != not_named
            and p["status"].get("phase") == "Running"
            and not p["metadata"].get("deletionTimestamp")
        ):
            return str(name)
    return None


def until(check: Any, timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(interval)
    raise SystemExit(f"timed out waiting for {what}")


def setup(cluster: DevCluster, fresh: bool) -> None:
    if fresh:
        cluster.up(nodes=0)
        start_real_nodes(cluster, 1)
        cluster.apply_crds()
        cluster.start_process(
            "operator",
            [sys.executable, "-m", "gpuslice", "operator", "--kubeconfig", str(cluster.kubeconfig)],
        )
        start_agents(cluster, "2x Tesla V100-PCIE-32GB")
    package = yaml.safe_load((REPO / "manifests" / "samples" / "v100-8g.yaml").read_text())
    package["spec"]["entitlements"][0]["slices"] = 8
    package["spec"]["entitlements"][0]["namespaceSelector"] = {"matchLabels": {"bench": TENANT}}
    cluster.apply(yaml.safe_dump(package))
    cluster.create_namespace(TENANT, {"bench": TENANT})
    until(lambda: get(cluster, "deviceclass", "v100-8g.gpuslice.io"), 90, "the DeviceClass", 0.5)
    spec = {
        "terminationGracePeriodSeconds": 1,
        "resourceClaims": [{"name": "gpu", "resourceClaimName": APP}],
        "containers": [{"name": "main", "image": "localhost/gpuslice/probe:dev", "command": ["sleep", "3600"],
                        "resources": {"claims": [{"name": "gpu"}], "limits": {"memory": "1Gi"}}}],
    }  # fmt: skip
    docs = [
        {"apiVersion": "gpuslice.io/v1beta1", "kind": "GpuSlice",
         "metadata": {"name": APP, "namespace": TENANT}, "spec": {"package": "v100-8g"}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": APP, "namespace": TENANT},
         "spec": {"replicas": 1, "selector": {"matchLabels": {"app": APP}},
                  "template": {"metadata": {"labels": {"app": APP}}, "spec": spec}}},
    ]  # fmt: skip
    cluster.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
    until(lambda: running(cluster), 180, "the first pod Running", 0.5)


def one_run(cluster: DevCluster) -> dict[str, float]:
    config = fake_gpu_config(cluster, NODE)
    old = until(lambda: running(cluster), 120, "a running pod")
    card = until(lambda: (c := card_of_claim(cluster)) is not None and str(c), 60, "the slice's card")
    card_i = int(card)
    t0 = time.monotonic()
    faults.inject(config, card, xid=79)
    until(lambda: card_tainted(cluster, card_i), 60, "the taint")
    t_taint = time.monotonic() - t0
    until(lambda: running(cluster, not_named=old), 180, "the replacement Running")
    t_running = time.monotonic() - t0
    if card_of_claim(cluster) != 1 - card_i:
        raise SystemExit("the replacement is not on the other card")
    faults.inject(config, card, clear=True)
    t1 = time.monotonic()
    until(lambda: not card_tainted(cluster, card_i), 60, "the reset card untainted")
    return {"taint_s": t_taint, "replacement_running_s": t_running, "untaint_s": time.monotonic() - t1}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument(
        "--dir", type=Path, default=None, help="a running devcluster set up as above (else a fresh one)"
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    cluster = DevCluster(args.dir or Path(f"/tmp/gpuslice-bench-health-{int(time.time())}"))
    try:
        setup(cluster, fresh=args.dir is None)
        runs = [one_run(cluster) for _ in range(args.runs)]
    finally:
        cluster.kubectl("delete", "namespace", TENANT, "--wait=false", check=False)
        if args.dir is None:
            cluster.down()
    report = {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}
    report["runs"] = len(runs)  # type: ignore[assignment]
    if args.json:
        print(json.dumps({"median": report, "runs": runs}))
    else:
        print(f"median of {len(runs)}: XID -> taint {report['taint_s']} s, -> replacement Running "
              f"{report['replacement_running_s']} s; reset -> untainted {report['untaint_s']} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
