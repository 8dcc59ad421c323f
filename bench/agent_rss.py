"""Resident memory and CPU at rest of one node agent with `--gpus` cards and `--claims` prepared claims.

    .venv/bin/python bench/agent_rss.py [--gpus 8] [--claims 50] [--rest 20] [--json]

Starts a fresh `gpuslice-dev devcluster` with one kwok node and the product's agent on it (simulated
V100s), one package of `--fraction` percent, then `--claims` documented-form claims with a pod each,
which kube-scheduler allocates on the node; the bench then calls NodePrepareResources for all of them
over the agent's DRA socket, as kubelet would. After the usage reporter has run a few times it reads
the agent's VmRSS / VmHWM and the CPU seconds it used over `--rest` seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from gpuslice import constants as c
from gpuslice.agent.proto import dra_v1_pb2 as dra
from gpuslice.agent.proto import dra_v1_pb2_grpc as dra_grpc
from gpuslice.api.package import GpuPackageSpec
from gpuslice.domain.claims import documented_claim_spec
from gpuslice.domain.deviceclass import device_selector_expression
from gpuslice_dev.agents import agent_dirs, agent_kubeconfig, spawn_agent
from gpuslice_dev.devcluster.cluster import DevCluster

MODEL = "Tesla V100-PCIE-32GB"
PACKAGE = "bench-v100"
DRA = f"{c.DRA_GROUP}/{c.DRA_VERSION}"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def kubectl_json(cluster: DevCluster, *args: str) -> Any:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    raise RuntimeError(f"timed out waiting for {what}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--claims", type=int, default=50)
    p.add_argument("--fraction", type=int, default=10, help="package fraction (slots per card: 100 // it)")
    p.add_argument("--rest", type=float, default=20, help="seconds of CPU measured at rest")
    p.add_argument("--json", action="store_true")
    p.add_argument("--keep", action="store_true")
    args = p.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="gs-agent-rss-"))
    cluster = DevCluster(workdir, progress=lambda m: log(m))
    proc = None
    try:
        cluster.up(nodes=1)
        cluster.apply_crds()
        node = cluster.nodes[0]
        spec = GpuPackageSpec.model_validate({"gpuModel": MODEL, "fraction": args.fraction})
        docs: list[dict[str, Any]] = [
            {"apiVersion": c.GROUP_VERSION, "kind": c.PACKAGE_KIND, "metadata": {"name": PACKAGE},
             "spec": {"gpuModel": MODEL, "fraction": args.fraction}},
            {"apiVersion": DRA, "kind": "DeviceClass", "metadata": {"name": c.device_class_name(PACKAGE)},
             "spec": {"selectors": [{"cel": {"expression": device_selector_expression(PACKAGE, spec)}}]}},
        ]  # fmt: skip
        cluster.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
        kubeconfig = agent_kubeconfig(cluster, node)
        root = workdir / "agents"
        proc = spawn_agent(node, f"{args.gpus}x {MODEL}", kubeconfig, root, workdir / "agent.log")
        want = args.gpus * (100 // args.fraction)

        def published() -> bool:
            items = kubectl_json(cluster, "resourceslices")["items"]
            return sum(len(s["spec"].get("devices") or []) for s in items) == want

        wait(published, 120, f"{want} published devices")
        cluster.create_namespace("rss")
        objs: list[dict[str, Any]] = []
        for i in range(args.claims):
            objs.append(
                {"apiVersion": DRA, "kind": "ResourceClaim",
                 "metadata": {"name": f"c{i}", "namespace": "rss", "labels": {c.LABEL_PACKAGE: PACKAGE}},
                 "spec": documented_claim_spec(PACKAGE)}
            )  # fmt: skip
            objs.append(
                {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"p{i}", "namespace": "rss"},
                 "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimName": f"c{i}"}],
                          "nodeSelector": {"type": "kwok"},
                          "containers": [{"name": "m", "image": "pause",
                                          "resources": {"claims": [{"name": "gpu"}]}}]}}
            )  # fmt: skip
        cluster.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": objs}))

        def allocated() -> list[dict[str, Any]] | None:
            items = kubectl_json(cluster, "resourceclaims", "-n", "rss")["items"]
            done = [x for x in items if (x.get("status") or {}).get("allocation")]
            return done if len(done) == args.claims else None

        claims = wait(allocated, 300, f"{args.claims} claims allocated")
        endpoint = f"unix://{agent_dirs(root, node)['plugins'] / c.DRIVER_NAME / 'dra.sock'}"
        with grpc.insecure_channel(endpoint) as ch:
            kubelet = [
                dra.Claim(namespace="rss", name=x["metadata"]["name"], uid=x["metadata"]["uid"])
                for x in claims
            ]
            req = dra.NodePrepareResourcesRequest(claims=kubelet)
            reply = dra_grpc.DRAPluginStub(ch).NodePrepareResources(req, timeout=120)
        errors = [e.error for e in reply.claims.values() if e.error]
        if errors:
            raise RuntimeError(f"prepare failed: {errors[:3]}")
        log(f"{args.claims} claims prepared; letting the usage reporter run")
        time.sleep(25)
        cpu0, t0 = cpu_seconds(proc.pid), time.monotonic()
        time.sleep(args.rest)
        cpu_rest = (cpu_seconds(proc.pid) - cpu0) / (time.monotonic() - t0)
        report = {
            "gpus": args.gpus,
            "prepared_claims": args.claims,
            "agent_rss_mib": round(status_kib(proc.pid, "VmRSS") / 1024, 1),
            "agent_peak_rss_mib": round(status_kib(proc.pid, "VmHWM") / 1024, 1),
            "agent_cpu_at_rest_percent": round(cpu_rest * 100, 2),
        }
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            print(
                f"agent with {args.gpus} GPUs and {args.claims} prepared claims: RSS "
                f"{report['agent_rss_mib']} MiB (peak {report['agent_peak_rss_mib']} MiB), CPU at rest "
                f"{report['agent_cpu_at_rest_percent']} %"
            )
        return 0
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except Exception:
                proc.kill()
        if not args.keep:
            cluster.down()
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
