"""kube-apiserver down for 5 minutes (past every client's backoff) with a slice pod running on the real
node. Its own file, so the suite's workers (one file each) run it beside the rest.

While it is down the node keeps its promises without it (checked through CRI every 30 s): the
container runs, the shim refuses an allocation past the slice, NVML and the agent's prepared claims
fit the cards. Once it is back the operator and the agent recover by themselves (same processes),
every invariant holds again within 30 s, and a new slice pod starts."""

from __future__ import annotations

import os
import signal
import time
from datetime import UTC, datetime

import pytest

from gpuslice_dev.devcluster import faults
from gpuslice_dev.devcluster.cluster import DevCluster
from gpuslice_dev.devcluster.node_agents import agent_process_name
from invariants import Invariants, real_node
from node.node_cluster import TENANT, delete, run_pod, slice_pod
from support import get_json

pytestmark = pytest.mark.cluster
NODE = "real-node-0"
#: seconds the API server stays down; client-go's and Kopf's longest backoffs are well under 300
OUTAGE = float(os.environ.get("GPUSLICE_APISERVER_OUTAGE_SECONDS", "300"))
CHECK_EVERY = 30.0


def _stages(cluster: DevCluster, name: str, since: datetime) -> str:
    """Seconds after `since` at which the new slice's objects reached each stage (where it waited)."""

    def after(stamp: str | None) -> str:
        if not stamp:
            return "-"
        return f"{(datetime.fromisoformat(stamp.replace('Z', '+00:00')) - since).total_seconds():.0f}s"

    claim = get_json(cluster, "resourceclaim", name, "-n", TENANT) or {"metadata": {}}
    pod = get_json(cluster, "pod", name, "-n", TENANT) or {"metadata": {}, "status": {}}
    node = get_json(cluster, "node", NODE)
    stages = {"claim created": claim["metadata"].get("creationTimestamp")}
    for cond in pod["status"].get("conditions") or []:
        stages[f"pod {cond['type']}"] = cond.get("lastTransitionTime")
    for cond in node["status"].get("conditions") or []:
        if cond["type"] == "Ready":
            stages[f"node Ready={cond['status']}"] = cond.get("lastTransitionTime")
    taints = [t["key"] for t in node["spec"].get("taints") or []]
    return ", ".join(f"{k} {after(v)}" for k, v in stages.items()) + f"; node taints now {taints}"


def test_kube_apiserver_down_for_minutes(node_cluster: DevCluster) -> None:
    run_pod(node_cluster, slice_pod("outage", ["sleep", "3600"]))
    inv = Invariants(node_cluster, None, [real_node(node_cluster, NODE)])
    try:
        inv.baseline()
        ours = ("operator", agent_process_name(NODE))
        pids = {name: faults.record(node_cluster, name).pid for name in ours}
        rec = faults.kill(node_cluster, "kube-apiserver", signal.SIGKILL)
        down = time.monotonic()
        checks = 0
        while (left := OUTAGE - (time.monotonic() - down)) > 0:
            problems = inv.node_side()
            assert not problems, f"{time.monotonic() - down:.0f}s into the outage:\n" + "\n".join(problems)
            checks += 1
            for name in ours:
                assert faults.record(node_cluster, name).alive(), f"{name} died during the outage"
            time.sleep(min(CHECK_EVERY, max(left, 0)))
        assert checks >= OUTAGE // CHECK_EVERY
        faults.start_again(node_cluster, "kube-apiserver", rec)
        ended = time.monotonic()
        inv.settle(f"kube-apiserver down {OUTAGE:.0f} s", ended)
        assert {name: faults.record(node_cluster, name).pid for name in ours} == pids, "restarted"
        back = datetime.now(UTC)
        run_pod(node_cluster, slice_pod("after-outage", ["sleep", "3600"]), timeout=180)
        print(
            f"\n[outage] a new slice pod ran {(datetime.now(UTC) - back).total_seconds():.1f}s "
            "after the apiserver came back"
        )
        print("[outage] " + _stages(node_cluster, "after-outage", back))
    finally:
        for name in ("outage", "after-outage"):
            delete(node_cluster, "pod", name)
            delete(node_cluster, "gpuslice", name)
