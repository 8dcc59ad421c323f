"""Allocation latency through the node agents and kube-scheduler, on a local dev cluster.

    .venv/bin/python bench/agent_allocation.py [--nodes 20] [--gpus 4] [--slices 200] [--dir DIR] [--keep]

Starts (or reuses, with --dir of a running one) `gpuslice-dev devcluster` with N kwok nodes and one
simulated agent per node ("<gpus>x Tesla V100-PCIE-32GB"), creates the 8g/16g/32g packages and their
DeviceClasses, then creates `--slices` claims of the documented form and one pod per claim, one pod
after the other, and measures for each the time from the pod's creation (the API server's reply to the
create) to the moment a watch sees its claim allocated. Also reports ResourceSlice count and size per
node and the agents' resident memory. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client, config, watch

from gpuslice import constants
from gpuslice.api.package import GpuPackageSpec
from gpuslice.domain.deviceclass import device_selector_expression
from gpuslice_dev.devcluster.cluster import DevCluster
from gpuslice_dev.devcluster.node_agents import agent_process_name, start_agents

PACKAGES = {"v100-8g": 25, "v100-16g": 50, "v100-32g": 100}
MODEL = "Tesla V100-PCIE-32GB"


def setup(cluster: DevCluster, nodes: int, gpus: int) -> None:
    cluster.up(nodes=nodes)
    cluster.apply_crds()
    docs = []
    for name, fraction in PACKAGES.items():
        docs.append(
            {
                "apiVersion": constants.GROUP_VERSION,
                "kind": constants.PACKAGE_KIND,
                "metadata": {"name": name},
                "spec": {"gpuModel": MODEL, "fraction": fraction},
            }
        )
        expr = device_selector_expression(
            name, GpuPackageSpec.model_validate({"gpuModel": MODEL, "fraction": fraction})
        )
        docs.append(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "DeviceClass",
                "metadata": {"name": constants.device_class_name(name)},
                "spec": {"selectors": [{"cel": {"expression": expr}}]},
            }
        )
    cluster.apply("\n---\n".join(json.dumps(d) for d in docs))
    start_agents(cluster, f"{gpus}x {MODEL}", progress=lambda m: print(m, file=sys.stderr))


def slices_per_node(cluster: DevCluster) -> dict[str, Any]:
    items = json.loads(cluster.kubectl("get", "resourceslices", "-o", "json").stdout)["items"]
    per_node: dict[str, list[int]] = {}
    devices: dict[str, int] = {}
    for s in items:
        if s["spec"]["driver"] != constants.DRIVER_NAME:
            continue
        node = s["spec"]["nodeName"]
        per_node.setdefault(node, []).append(len(json.dumps(s, separators=(",", ":"))))
        devices[node] = devices.get(node, 0) + len(s["spec"].get("devices") or [])
    return {"per_node": per_node, "devices": devices}


async def measure(kubeconfig: Path, namespace: str, count: int, package: str, serial: bool) -> list[float]:
    """Seconds from each pod's creation to its claim's allocation. `serial`: each pod is created only
    after the previous one's claim was allocated (pure latency); otherwise all pods in a burst (latency
    including kube-scheduler's queue)."""
    api = await config.new_client_from_config(config_file=str(kubeconfig))
    core = client.CoreV1Api(api)
    custom = client.CustomObjectsApi(api)
    ns: Any = {"metadata": {"name": namespace}}  # a dict body: the client serializes it as is
    await core.create_namespace(ns)
    for _ in range(100):  # pods need the namespace's default service account
        sas = await core.list_namespaced_service_account(namespace)
        if any(sa.metadata.name == "default" for sa in sas.items):
            break
        await asyncio.sleep(0.1)
    for i in range(count):
        await custom.create_namespaced_custom_object(
            "resource.k8s.io", "v1", namespace, "resourceclaims",
            {
                "metadata": {"name": f"c{i}"},
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                    "deviceClassName": constants.device_class_name(package),
                    "allocationMode": "ExactCount", "count": 1}}]}},
            },
        )  # fmt: skip
    created: dict[str, float] = {}
    allocated: dict[str, float] = {}
    done = asyncio.Event()
    progress = asyncio.Event()  # set on every allocation seen
    claims = await custom.list_namespaced_custom_object("resource.k8s.io", "v1", namespace, "resourceclaims")
    rv = claims["metadata"]["resourceVersion"]

    async def watch_claims() -> None:
        async with watch.Watch() as w:
            async for ev in w.stream(
                custom.list_namespaced_custom_object, "resource.k8s.io", "v1", namespace, "resourceclaims",
                resource_version=rv,
            ):  # fmt: skip
                obj = ev["raw_object"]
                name = obj["metadata"]["name"]
                if (obj.get("status") or {}).get("allocation") and name not in allocated:
                    allocated[name] = time.monotonic()
                    progress.set()
                    if len(allocated) == count:
                        done.set()
                        return

    watcher = asyncio.create_task(watch_claims())
    for i in range(count):
        pod: Any = {
            "metadata": {"name": f"p{i}"},
            "spec": {
                "resourceClaims": [{"name": "gpu", "resourceClaimName": f"c{i}"}],
                "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                                "resources": {"claims": [{"name": "gpu"}]}}],
                "nodeSelector": {"type": "kwok"},
            },
        }  # fmt: skip
        await core.create_namespaced_pod(namespace, pod)
        created[f"c{i}"] = time.monotonic()
        while serial and f"c{i}" not in allocated:
            progress.clear()
            await progress.wait()
    try:
        await asyncio.wait_for(done.wait(), timeout=600)
    finally:
        watcher.cancel()
        await api.close()
    return [allocated[c] - created[c] for c in created]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--nodes", type=int, default=20)
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--slices", type=int, default=200)
    p.add_argument("--package", default="v100-8g", choices=sorted(PACKAGES))
    p.add_argument("--dir", type=Path, help="dev cluster dir (reused if running; default: a new temp dir)")
    p.add_argument("--keep", action="store_true", help="leave the cluster running")
    p.add_argument("--modes", default="serial,burst", help="serial (one pod at a time), burst (all at once)")
    args = p.parse_args()

    capacity = args.nodes * args.gpus * (100 // PACKAGES[args.package])
    if args.slices > capacity:
        print(
            f"error: {args.slices} slices of {args.package} do not fit on {capacity} partitions",
            file=sys.stderr,
        )
        return 2
    cluster = DevCluster(args.dir or Path(tempfile.mkdtemp(prefix="gs-bench-")), progress=lambda m: None)
    try:
        t0 = time.monotonic()
        setup(cluster, args.nodes, args.gpus)
        nodes = cluster.nodes
        want = args.gpus * sum(100 // f for f in PACKAGES.values())
        deadline = time.monotonic() + 300
        while True:
            published = slices_per_node(cluster)
            if all(published["devices"].get(n) == want for n in nodes):
                break
            if time.monotonic() > deadline:
                print(f"error: agents did not publish in 300s: {published['devices']}", file=sys.stderr)
                return 1
            time.sleep(1)
        ready_s = time.monotonic() - t0
        results = {}
        for mode in args.modes.split(","):
            namespace = f"bench-{mode}-{int(time.time())}"
            latencies = asyncio.run(
                measure(cluster.kubeconfig, namespace, args.slices, args.package, serial=mode == "serial")
            )
            results[mode] = {
                "median": round(statistics.median(latencies) * 1000, 1),
                "p90": round(sorted(latencies)[int(0.9 * len(latencies)) - 1] * 1000, 1),
                "worst": round(max(latencies) * 1000, 1),
                "best": round(min(latencies) * 1000, 1),
            }
            # free the slices for the next mode
            cluster.kubectl("delete", "namespace", namespace, "--timeout=300s")
        st = cluster.state()
        assert st is not None
        rss = [st.processes[agent_process_name(n)].rss_bytes() for n in nodes]
        sizes = [size for per in published["per_node"].values() for size in per]
        counts = [len(per) for per in published["per_node"].values()]
        report = {
            "nodes": len(nodes),
            "gpus_per_node": args.gpus,
            "slices": args.slices,
            "package": args.package,
            "setup_seconds": round(ready_s, 1),
            "pod_created_to_claim_allocated_ms": results,
            "resourceslices_per_node": sorted(set(counts)),
            "resourceslice_bytes": {
                "min": min(sizes),
                "max": max(sizes),
                "per_node_total": sum(sizes) // len(nodes),
            },
            "devices_per_node": want,
            "agent_rss_mib": {
                "median": round(statistics.median(rss) / 2**20, 1),
                "max": round(max(rss) / 2**20, 1),
            },
        }
        print(json.dumps(report, indent=2))
        return 0
    finally:
        if not args.keep:
            cluster.down()


if __name__ == "__main__":
    raise SystemExit(main())
