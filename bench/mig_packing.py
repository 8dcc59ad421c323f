"""How well kube-scheduler packs mixed MIG profiles onto cards, against the best packing.

    .venv/bin/python bench/mig_packing.py [--nodes 5] [--cards 10] [--seed 1] [--dir DIR] [--keep]

`--nodes` kwok nodes of `--cards` simulated A100-SXM4-80GB each, every card in MIG mode. Their
ResourceSlices are the agent's own (`agent.slices.build_specs`, the card's MIG profiles read from the
driver double through NVML, as the agent reads them), published without agent processes: the bench is
about kube-scheduler's choices, not the agent. Five Hardware packages sell 1g.10gb, 2g.20gb, 3g.40gb,
4g.40gb and 7g.80gb, through the DeviceClasses the operator makes for them.

The demand is built so that the best packing serves all of it: every card gets a random layout the
driver can hold at once and nothing more fits beside (a maximal set of non-overlapping placements), and
the demand is the union of those instances. One claim and one pod per instance, all created at once
in a random order; once every pod is decided and nothing changes, the bench counts what kube-scheduler
allocated. Prints one JSON document: pods and compute slices asked for (= the best packing), allocated,
and the ratio, per profile too.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml
from _kwok import card, node_slices

from gpuslice import constants
from gpuslice.agent.gpus import GpuInfo
from gpuslice.agent.slices import Package
from gpuslice.api.package import GpuPackageSpec
from gpuslice.domain import mig
from gpuslice.domain.claims import documented_claim_spec
from gpuslice.domain.deviceclass import device_class
from gpuslice_dev.devcluster.cluster import DevCluster

MODEL = "NVIDIA A100-SXM4-80GB"
PROFILES = ["1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]
NAMESPACE = "mig-packing"

READ_PROFILES = """
import json, sys
from pathlib import Path
import pynvml
from gpuslice.agent import nvml
from gpuslice_dev.gpusim import simulate
simulate.use_fake_driver(simulate.write_node_config(sys.argv[1], "bench", Path(sys.argv[2])))
with nvml.session():
    uuid = nvml.devices()[0].uuid
    pynvml.nvmlDeviceSetMigMode(nvml.handle(uuid), 1)
    print(json.dumps([p.__dict__ for p in nvml.mig_profiles(uuid)]))
"""


def driver_profiles(tmp: Path) -> tuple[mig.MigProfile, ...]:
    """The A100-80GB's MIG profiles as the driver double's NVML reports them to the agent."""
    proc = subprocess.run(
        [sys.executable, "-c", READ_PROFILES, f"1x {MODEL}", str(tmp)],
        capture_output=True,
        text=True,
        check=True,
    )
    raw = json.loads(proc.stdout.strip().splitlines()[-1])
    return tuple(mig.MigProfile(**{**p, "placements": tuple(tuple(x) for x in p["placements"])}) for p in raw)


def package_name(profile: str) -> str:
    return "mig-" + profile.replace(".", "-")


def random_full_layout(rng: random.Random, profiles: tuple[mig.MigProfile, ...]) -> list[mig.MigPlacement]:
    """Placements added in random order while one still fits: a layout the card can hold, maximal."""
    candidates = [p for p in mig.placements(0, profiles) if p.profile.name in PROFILES]
    chosen: list[mig.MigPlacement] = []
    while True:
        fitting = [p for p in candidates if mig.fits_together([*chosen, p])]
        if not fitting:
            return chosen
        # a profile first, then one of its placements: else the many 1g placements would dominate
        name = rng.choice(sorted({p.profile.name for p in fitting}))
        chosen.append(rng.choice([p for p in fitting if p.profile.name == name]))


def mig_card(node: str, index: int, profiles: tuple[mig.MigProfile, ...]) -> GpuInfo:
    return card(node, index, MODEL, 80 * constants.GIB, compute_capability="8.0", mig_profiles=profiles)


def kubectl_apply(cluster: DevCluster, docs: list[dict[str, Any]]) -> None:
    cluster.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(docs))


def pod(name: str) -> dict[str, Any]:
    resources = {"claims": [{"name": "gpu"}], "limits": {"memory": "64Mi"}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
            "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10", "resources": resources}],
            "nodeSelector": {"type": "kwok"},
        },
    }


def decided(cluster: DevCluster) -> tuple[int, int, dict[str, str]] | None:
    """(scheduled, unschedulable, claim -> allocated device) once every pod is decided."""
    pods = json.loads(cluster.kubectl("get", "pods", "-n", NAMESPACE, "-o", "json").stdout)["items"]
    scheduled = sum(1 for p in pods if p["spec"].get("nodeName"))
    unschedulable = sum(
        1
        for p in pods
        if not p["spec"].get("nodeName")
        and any(
            c["type"] == "PodScheduled" and c["status"] == "False" and c.get("reason") == "Unschedulable"
            for c in (p.get("status") or {}).get("conditions") or []
        )
    )
    if scheduled + unschedulable < len(pods):
        return None
    claims = json.loads(cluster.kubectl("get", "resourceclaims", "-n", NAMESPACE, "-o", "json").stdout)[
        "items"
    ]
    devices = {}
    for cl in claims:
        for r in (((cl.get("status") or {}).get("allocation") or {}).get("devices") or {}).get(
            "results"
        ) or []:
            devices[cl["metadata"]["name"]] = f"{r['pool']}/{r['device']}"
    return scheduled, unschedulable, devices


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--nodes", type=int, default=5)
    p.add_argument("--cards", type=int, default=10, help="cards per node")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dir", type=Path, help="dev cluster dir (reused if running; default: a new temp dir)")
    p.add_argument("--keep", action="store_true", help="leave the cluster running")
    p.add_argument(
        "--settle", type=float, default=15.0, help="seconds with nothing changing that end the run"
    )
    args = p.parse_args()
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="mig-packing-"))
    profiles = driver_profiles(work / "driver")
    cluster = DevCluster(args.dir or work / "cluster", progress=lambda m: print(m, file=sys.stderr))
    try:
        cluster.up(nodes=args.nodes)
        nodes = cluster.nodes[: args.nodes]
        specs = {
            package_name(q): GpuPackageSpec.model_validate(
                {"gpuModel": MODEL, "fraction": 100, "isolation": {"mode": "Hardware"}, "migProfile": q}
            )
            for q in PROFILES
        }
        docs: list[dict[str, Any]] = [device_class(n, None, s, None) for n, s in specs.items()]
        packages = [Package(n, s) for n, s in specs.items()]
        docs += node_slices(nodes, lambda n: [mig_card(n, i, profiles) for i in range(args.cards)], packages)
        kubectl_apply(cluster, docs)
        cluster.kubectl("create", "namespace", NAMESPACE, check=False)
        demand = [
            pl.profile.name
            for _ in range(len(nodes) * args.cards)
            for pl in random_full_layout(rng, profiles)
        ]
        rng.shuffle(demand)
        slices_of = {q.name: q.slices for q in profiles}
        work_docs: list[dict[str, Any]] = []
        for i, profile in enumerate(demand):
            name = f"c{i}-{profile.replace('.', '-')}"
            claim = {
                "apiVersion": constants.DRA_GROUP_VERSION,
                "kind": "ResourceClaim",
                "metadata": {"name": name, "namespace": NAMESPACE},
                "spec": documented_claim_spec(package_name(profile)),
            }
            work_docs += [claim, pod(name)]
        start = time.monotonic()
        kubectl_apply(cluster, work_docs)
        last, stable_since = None, time.monotonic()
        while True:
            now = decided(cluster)
            if now != last:
                last, stable_since = now, time.monotonic()
            elif now is not None and time.monotonic() - stable_since >= args.settle:
                break
            if time.monotonic() - start > 900:
                raise SystemExit("pods not decided within 15 minutes")
            time.sleep(2)
        assert last is not None
        scheduled, unschedulable, devices = last
        allocated = Counter(n.split("-", 1)[1].replace("-", ".", 1) for n in devices)
        asked = Counter(demand)
        out = {
            "cards": len(nodes) * args.cards,
            "seed": args.seed,
            "pods": len(demand),
            "pods_allocated": sum(allocated.values()),
            "pods_unschedulable": unschedulable,
            "compute_slices_best": sum(slices_of[q] * n for q, n in asked.items()),
            "compute_slices_allocated": sum(slices_of[q] * n for q, n in allocated.items()),
            "per_profile": {q: {"asked": asked[q], "allocated": allocated[q]} for q in PROFILES},
            "seconds_to_settle": round(stable_since - start, 1),
        }
        out["ratio"] = round(out["compute_slices_allocated"] / out["compute_slices_best"], 3)
        assert scheduled == out["pods_allocated"]
        # what kube-scheduler chose, checked against the driver's rule: no two instances of a card overlap
        where = {mig.device_name(pl): pl for pl in mig.placements(0, profiles)}
        per_card: dict[tuple[str, int], list[mig.MigPlacement]] = {}
        for ref in devices.values():
            node, dev = ref.split("/", 1)
            index, rest = dev.removeprefix("gpu-").split("-", 1)
            per_card.setdefault((node, int(index)), []).append(where[f"gpu-0-{rest}"])
        out["cards_with_overlap"] = sum(1 for chosen in per_card.values() if not mig.fits_together(chosen))
        print(json.dumps(out, indent=1))
    finally:
        if not args.keep and not args.dir:
            cluster.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
