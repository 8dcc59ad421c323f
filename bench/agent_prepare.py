"""Prepare latency, resident memory and CPU at rest of a node agent with `--gpus` cards and `--claims` claims.

    .venv/bin/python bench/agent_prepare.py [--gpus 8] [--claims 64] [--fraction 12] [--concurrency 8]
                                            [--rounds 3] [--rest 30] [--json] [--keep]

Starts a fresh `gpuslice-dev devcluster` with two kwok nodes and the product's agent on each, speaking
kubelet's DRA gRPC on its plugin socket, with simulated V100-32GB cards (the driver test double): the
measured agent with `--gpus` cards and, for the baseline, one with a single card. One package of
`--fraction` percent (12: 8 slices of 3,932 MiB per card, so 64 claims fill 8 cards; the product
takes any whole percent, a card offers 100 // fraction slices). The bench creates `--claims`
documented-form claims with a pod each on the measured node and one on the baseline node;
kube-scheduler allocates them. Then, playing kubelet (one NodePrepareResources /
NodeUnprepareResources call per pod, timed at the gRPC client), `--rounds` times:

- prepare every claim one at a time, each followed by a prepare and unprepare of the baseline's claim
  (the same load on both agents, so the ratio holds on a shared machine);
- unprepare them one at a time;
- prepare them with `--concurrency` calls in flight, as kubelet does when many pods start;
- unprepare them with as many in flight.

Finally it prepares every claim once more (and the baseline's), lets the usage reporter run, and
reads the agents' VmRSS / VmHWM and the CPU seconds they use over `--rest` seconds. RSS is also read
after every phase, so growth per prepared claim or per round shows.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
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
DRA = c.DRA_GROUP_VERSION
NAMESPACE = "prep"
#: Seconds the agents run after a change before RSS is read: a few of the dev cluster's usage readings.
SETTLE = 12.0


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


def wait(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    raise RuntimeError(f"timed out waiting for {what}")


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile: with 192 values, p99 is the second largest (with 64, the largest)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summary_ms(seconds: Sequence[float]) -> dict[str, float]:
    ms = [s * 1000 for s in seconds]
    return {
        "n": len(ms),
        "p50": round(statistics.median(ms), 1),
        "p99": round(percentile(ms, 99), 1),
        "max": round(max(ms), 1),
    }


@dataclass
class Agent:
    """One running agent, called as kubelet calls it: one gRPC call per pod, timed at the client."""

    node: str
    gpus: int
    proc: subprocess.Popen[bytes]
    channel: grpc.Channel
    rss_mib: dict[str, float] = field(default_factory=dict)

    @property
    def stub(self) -> dra_grpc.DRAPluginStub:
        return dra_grpc.DRAPluginStub(self.channel)

    def prepare(self, claim: dra.Claim) -> float:
        t0 = time.perf_counter()
        reply = self.stub.NodePrepareResources(dra.NodePrepareResourcesRequest(claims=[claim]), timeout=60)
        took = time.perf_counter() - t0
        result = reply.claims[claim.uid]
        if result.error or not result.devices:
            raise RuntimeError(f"{self.node}: prepare of {claim.name} failed: {result.error or 'no device'}")
        return took

    def unprepare(self, claim: dra.Claim) -> float:
        t0 = time.perf_counter()
        reply = self.stub.NodeUnprepareResources(
            dra.NodeUnprepareResourcesRequest(claims=[claim]), timeout=60
        )
        took = time.perf_counter() - t0
        if reply.claims[claim.uid].error:
            raise RuntimeError(
                f"{self.node}: unprepare of {claim.name} failed: {reply.claims[claim.uid].error}"
            )
        return took

    def note_rss(self, when: str) -> None:
        self.rss_mib[when] = round(status_kib(self.proc.pid, "VmRSS") / 1024, 1)

    def peak_rss_mib(self) -> float:
        return round(status_kib(self.proc.pid, "VmHWM") / 1024, 1)


def in_flight(
    call: Callable[[dra.Claim], float], claims: Sequence[dra.Claim], concurrency: int
) -> list[float]:
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(call, claims))


def claim_and_pod(name: str, node: str) -> list[dict[str, Any]]:
    return [
        {"apiVersion": DRA, "kind": "ResourceClaim",
         "metadata": {"name": name, "namespace": NAMESPACE, "labels": {c.LABEL_PACKAGE: PACKAGE}},
         "spec": documented_claim_spec(PACKAGE)},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE},
         "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
                  "nodeSelector": {"type": "kwok", "kubernetes.io/hostname": node},
                  "containers": [{"name": "m", "image": "pause",
                                  "resources": {"claims": [{"name": "gpu"}]}}]}},
    ]  # fmt: skip


def start_agents(cluster: DevCluster, workdir: Path, gpus: Sequence[int]) -> list[Agent]:
    root = workdir / "agents"
    agents = []
    for i, (node, count) in enumerate(zip(cluster.nodes, gpus, strict=False)):
        kubeconfig = agent_kubeconfig(cluster, node, install=i == 0)
        proc = spawn_agent(node, f"{count}x {MODEL}", kubeconfig, root, workdir / f"agent-{node}.log")
        endpoint = f"unix://{agent_dirs(root, node)['plugins'] / c.DRIVER_NAME / 'dra.sock'}"
        agents.append(Agent(node, count, proc, grpc.insecure_channel(endpoint)))
    return agents


def devices_per_node(cluster: DevCluster) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in kubectl_json(cluster, "resourceslices")["items"]:
        node = s["spec"].get("nodeName", "")
        out[node] = out.get(node, 0) + len(s["spec"].get("devices") or [])
    return out


def run(args: argparse.Namespace, cluster: DevCluster, workdir: Path, agents: list[Agent]) -> dict[str, Any]:
    cluster.up(nodes=2)
    cluster.apply_crds()
    spec = GpuPackageSpec.model_validate({"gpuModel": MODEL, "fraction": args.fraction})
    docs: list[dict[str, Any]] = [
        {"apiVersion": c.GROUP_VERSION, "kind": c.PACKAGE_KIND, "metadata": {"name": PACKAGE},
         "spec": {"gpuModel": MODEL, "fraction": args.fraction}},
        {"apiVersion": DRA, "kind": "DeviceClass", "metadata": {"name": c.device_class_name(PACKAGE)},
         "spec": {"selectors": [{"cel": {"expression": device_selector_expression(PACKAGE, spec)}}]}},
    ]  # fmt: skip
    cluster.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
    agents.extend(start_agents(cluster, workdir, [args.gpus, 1]))
    big, base = agents
    want = {a.node: a.gpus * spec.slices_per_card() for a in agents}
    wait(lambda: devices_per_node(cluster) == want, 120, f"published devices {want}")
    log(f"agents published {want}; {args.claims} claims on {big.node}, 1 on {base.node}")

    cluster.create_namespace(NAMESPACE)
    objs = [o for i in range(args.claims) for o in claim_and_pod(f"c{i}", big.node)]
    objs += claim_and_pod("base", base.node)
    cluster.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": objs}))

    def allocated() -> dict[str, dra.Claim] | None:
        items = kubectl_json(cluster, "resourceclaims", "-n", NAMESPACE)["items"]
        done = {
            x["metadata"]["name"]: dra.Claim(
                namespace=NAMESPACE, name=x["metadata"]["name"], uid=x["metadata"]["uid"]
            )
            for x in items
            if (x.get("status") or {}).get("allocation")
        }
        return done if len(done) == args.claims + 1 else None

    by_name = wait(allocated, 300, f"{args.claims + 1} claims allocated")
    claims = [by_name[f"c{i}"] for i in range(args.claims)]
    base_claim = by_name["base"]
    time.sleep(SETTLE)
    for a in agents:
        a.note_rss("idle")

    times: dict[str, list[float]] = {
        k: [] for k in ("prepare_serial", "prepare_concurrent", "unprepare_serial", "unprepare_concurrent",
                        "base_prepare", "base_unprepare")
    }  # fmt: skip
    # p50 of the first and last eighth of each one-at-a-time round: does a prepare cost more when
    # many claims are prepared already?
    first, last = [], []
    wall = {"prepare_serial": 0.0, "prepare_concurrent": 0.0}  # seconds to prepare every claim
    # CPU seconds the measured agent used in those phases (its background loops included)
    cpu_used = dict.fromkeys(wall, 0.0)
    eighth = max(1, args.claims // 8)
    for r in range(args.rounds):
        round_times = []
        cpu0 = cpu_seconds(big.proc.pid)
        for claim in claims:
            round_times.append(big.prepare(claim))
            wall["prepare_serial"] += round_times[-1]
            times["base_prepare"].append(base.prepare(base_claim))
            times["base_unprepare"].append(base.unprepare(base_claim))
        cpu_used["prepare_serial"] += cpu_seconds(big.proc.pid) - cpu0
        times["prepare_serial"] += round_times
        first += round_times[:eighth]
        last += round_times[-eighth:]
        big.note_rss(f"round {r + 1}: {args.claims} prepared one at a time")
        times["unprepare_serial"] += [big.unprepare(claim) for claim in claims]
        big.note_rss(f"round {r + 1}: all unprepared")
        t0, cpu0 = time.perf_counter(), cpu_seconds(big.proc.pid)
        times["prepare_concurrent"] += in_flight(big.prepare, claims, args.concurrency)
        wall["prepare_concurrent"] += time.perf_counter() - t0
        cpu_used["prepare_concurrent"] += cpu_seconds(big.proc.pid) - cpu0
        big.note_rss(f"round {r + 1}: {args.claims} prepared {args.concurrency} in flight")
        times["unprepare_concurrent"] += in_flight(big.unprepare, claims, args.concurrency)
        log(f"round {r + 1} of {args.rounds} done")

    in_flight(big.prepare, claims, args.concurrency)
    base.prepare(base_claim)
    log(f"{args.claims} + 1 claims prepared; letting the usage reporter run")
    time.sleep(SETTLE)
    at_rest = {a.node: cpu_seconds(a.proc.pid) for a in agents}
    t0 = time.monotonic()
    time.sleep(args.rest)
    elapsed = time.monotonic() - t0
    cpu = {a.node: round((cpu_seconds(a.proc.pid) - at_rest[a.node]) / elapsed * 100, 2) for a in agents}
    big.note_rss(f"{args.claims} prepared, at rest")
    base.note_rss("1 prepared, at rest")

    figures = {k: summary_ms(v) for k, v in times.items()}
    base_p = figures["base_prepare"]
    ratios = {
        mode: {q: round(figures[mode][q] / base_p[q], 2) for q in ("p50", "p99")}
        for mode in ("prepare_serial", "prepare_concurrent")
    }
    return {
        "gpus": args.gpus,
        "claims": args.claims,
        "fraction": args.fraction,
        "slices_per_card": spec.slices_per_card(),
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "latency_ms": figures,
        "prepare_vs_baseline": ratios,
        "prepared_claims_per_second": {k: round(args.claims * args.rounds / v, 1) for k, v in wall.items()},
        "agent_cpu_ms_per_prepare": {
            k: round(v * 1000 / (args.claims * args.rounds), 1) for k, v in cpu_used.items()
        },
        "prepare_serial_p50_first_vs_last_eighth_ms": [
            round(statistics.median(first) * 1000, 1),
            round(statistics.median(last) * 1000, 1),
        ],
        "agent_rss_mib": big.rss_mib,
        "agent_peak_rss_mib": big.peak_rss_mib(),
        "agent_cpu_at_rest_percent": cpu[big.node],
        "baseline_rss_mib": base.rss_mib,
        "baseline_peak_rss_mib": base.peak_rss_mib(),
        "baseline_cpu_at_rest_percent": cpu[base.node],
        "rest_seconds": args.rest,
    }


def print_table(report: dict[str, Any]) -> None:
    g, n, k = report["gpus"], report["claims"], report["concurrency"]
    rows = [
        (f"prepare, one at a time ({g} cards, {n} claims)", "prepare_serial"),
        (f"prepare, {k} in flight ({g} cards)", "prepare_concurrent"),
        ("prepare, baseline (1 card, 1 claim)", "base_prepare"),
        (f"unprepare, one at a time ({g} cards)", "unprepare_serial"),
        (f"unprepare, {k} in flight ({g} cards)", "unprepare_concurrent"),
        ("unprepare, baseline (1 card, 1 claim)", "base_unprepare"),
    ]
    lat = report["latency_ms"]
    print(f"{'gRPC call, as kubelet sees it':<44} {'n':>5} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for label, key in rows:
        f = lat[key]
        print(f"{label:<44} {f['n']:>5} {f['p50']:>8} {f['p99']:>8} {f['max']:>8}")
    ratios = report["prepare_vs_baseline"]
    for mode, label in (("prepare_serial", "one at a time"), ("prepare_concurrent", f"{k} in flight")):
        r = ratios[mode]
        print(f"prepare {label} vs baseline: p50 {r['p50']}x, p99 {r['p99']}x")
    rate = report["prepared_claims_per_second"]
    print(
        f"claims prepared per second: {rate['prepare_serial']} one at a time, "
        f"{rate['prepare_concurrent']} {k} in flight"
    )
    cpu = report["agent_cpu_ms_per_prepare"]
    print(
        f"agent CPU per prepare: {cpu['prepare_serial']} ms one at a time, "
        f"{cpu['prepare_concurrent']} ms {k} in flight"
    )
    a, b = report["prepare_serial_p50_first_vs_last_eighth_ms"]
    print(f"prepare one at a time, p50 of the first / last {n // 8} claims of a round: {a} / {b} ms")
    print(f"agent RSS MiB ({g} cards):")
    for when, mib in report["agent_rss_mib"].items():
        print(f"  {when:<50} {mib:>7}")
    print(f"  {'peak (VmHWM)':<50} {report['agent_peak_rss_mib']:>7}")
    base = report["baseline_rss_mib"]
    print(
        f"baseline agent RSS MiB (1 card): idle {base['idle']}, 1 prepared {base['1 prepared, at rest']}, "
        f"peak {report['baseline_peak_rss_mib']}"
    )
    print(
        f"CPU at rest over {report['rest_seconds']} s: {report['agent_cpu_at_rest_percent']} % "
        f"({n} prepared), baseline {report['baseline_cpu_at_rest_percent']} % (1 prepared)"
    )
    rss, load = report["agent_rss_mib"], report["load_average"]
    s, cc = lat["prepare_serial"], lat["prepare_concurrent"]
    print(
        f"agent with {g} GPUs and {n} claims: prepare p50 {s['p50']} ms p99 {s['p99']} ms "
        f"({ratios['prepare_serial']['p99']}x the 1-card agent's p99), {k} in flight p50 {cc['p50']} ms "
        f"p99 {cc['p99']} ms; unprepare p99 {lat['unprepare_serial']['p99']} ms; RSS idle {rss['idle']} MiB, "
        f"{n} prepared {rss[f'{n} prepared, at rest']} MiB, peak {report['agent_peak_rss_mib']} MiB; "
        f"CPU at rest {report['agent_cpu_at_rest_percent']} %; load average {load['start_1min']} at start, "
        f"{'/'.join(map(str, load['end_1_5_15min']))} (1/5/15 min) at end"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--claims", type=int, default=64)
    p.add_argument("--fraction", type=int, default=12, help="package fraction (slices per card: 100 // it)")
    p.add_argument("--concurrency", type=int, default=8, help="calls in flight in the concurrent rounds")
    p.add_argument("--rounds", type=int, default=3, help="prepare/unprepare rounds measured")
    p.add_argument("--rest", type=float, default=30, help="seconds of CPU measured at rest")
    p.add_argument("--json", action="store_true")
    p.add_argument("--keep", action="store_true", help="leave the cluster and its directory")
    args = p.parse_args()
    capacity = args.gpus * (100 // args.fraction)
    if not 1 <= args.claims <= capacity:
        p.error(f"{args.claims} claims do not fit on {args.gpus} cards of {100 // args.fraction} slices")
    workdir = Path(tempfile.mkdtemp(prefix="gs-agent-prepare-"))
    cluster = DevCluster(workdir, progress=log)
    agents: list[Agent] = []
    load_before = os.getloadavg()
    try:
        report = run(args, cluster, workdir, agents)
        report["load_average"] = {
            "start_1min": round(load_before[0], 2),
            "end_1_5_15min": [round(x, 2) for x in os.getloadavg()],
        }
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            print_table(report)
        return 0
    finally:
        for a in agents:
            a.channel.close()
            if a.proc.poll() is None:
                a.proc.terminate()
                try:
                    a.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    a.proc.kill()
        if args.keep:
            log(f"cluster and agent logs kept in {workdir}")
        else:
            cluster.down()
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
