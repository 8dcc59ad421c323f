"""SCRATCH (not committed): outage then repeated cordon+schedule on the same cluster."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from gpuslice_dev.devcluster.cluster import DevCluster
from node.node_cluster import TENANT, delete
from node import test_fault_apiserver_outage as outage
from node.test_fault_node_lost import LIVES, deployment, pods_of, second_node  # noqa: F401
from support import get_json

pytestmark = [pytest.mark.cluster]


def test_a_outage(node_cluster: DevCluster) -> None:
    outage.test_kube_apiserver_down_for_minutes.__wrapped__(node_cluster) if hasattr(
        outage.test_kube_apiserver_down_for_minutes, "__wrapped__"
    ) else outage.test_kube_apiserver_down_for_minutes(node_cluster)


def test_b_cordon_is_respected(node_cluster: DevCluster, second_node: str) -> None:  # noqa: F811
    bad = []
    for i in range(12):
        name = f"wander{i}"
        node_cluster.kubectl("cordon", LIVES)
        cordoned = get_json(node_cluster, "node", LIVES)
        node_cluster.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": deployment(name)}))
        where = None
        for _ in range(300):
            pods = pods_of(node_cluster, name)
            if pods and pods[0]["spec"].get("nodeName"):
                where = pods[0]["spec"]["nodeName"]
                break
            time.sleep(0.2)
        print(f"[repro] {name}: bound to {where}", flush=True)
        if where == LIVES:
            out = Path("/tmp/repro") / f"repro-{name}"
            out.mkdir(exist_ok=True)
            (out / "node-at-cordon.json").write_text(json.dumps(cordoned, indent=1))
            (out / "node-now.json").write_text(json.dumps(get_json(node_cluster, "node", LIVES), indent=1))
            (out / "pods.json").write_text(json.dumps(pods, indent=1))
            ev = node_cluster.kubectl("get", "events", "-n", TENANT, "-o", "json", check=False).stdout
            (out / "events.json").write_text(ev)
            bad.append(name)
        node_cluster.kubectl(
            "delete", "deployment", name, "-n", TENANT, "--wait=true", "--timeout=60s", check=False
        )
        node_cluster.kubectl(
            "delete", "pods", "-n", TENANT, "-l", f"app={name}", "--wait=true", "--timeout=60s", check=False
        )
        delete(node_cluster, "gpuslice", name)
        node_cluster.kubectl("uncordon", LIVES)
    assert not bad, bad
