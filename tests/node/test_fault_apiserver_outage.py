"""kube-apiserver down for 5 minutes (past every client's backoff) with a slice pod running on the real
node. Its own file, so the suite's workers (one file each) run it
beside the rest.

While it is down the node keeps its promises without it (checked through CRI every 30 s): the
container runs, the shim refuses an allocation past the slice, NVML and the agent's prepared claims
fit the cards; meanwhile containerd and then kubelet are SIGKILLed and started again (the outage's
wait shared with those faults). Once it is back the operator and the agent recover by themselves
(same processes), every invariant holds again within 30 s, and a new slice pod starts.

It brings up a cluster of its own: what it leaves behind is not a state the other node files are
written for. client-go's reflectors retry a failed watch with a backoff that stops at [30, 60) s, so
after minutes of outage kube-scheduler's and kube-controller-manager's watches come back one by one,
up to a minute after the API server (a new pod waited 11-56 s for the scheduler); meanwhile they act
on what they saw before it. A node file run after this one on the same cluster saw kube-scheduler
place a pod on a node cordoned a moment before, by a Node view from before the cordon
(tests/node/test_fault_node_lost.py now waits until the scheduler refuses a probe pod there)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from gpuslice_dev.devcluster import faults
from gpuslice_dev.devcluster.cluster import DevCluster
from gpuslice_dev.devcluster.node_agents import agent_process_name
from gpuslice_dev.devcluster.realnode import process_names
from invariants import Invariants, real_node
from node.node_cluster import TENANT, delete, fresh_node_cluster, run_pod, slice_pod
from support import get_json, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow(seconds=420)]
NODE = "real-node-0"
#: seconds the API server stays down; client-go's and Kopf's longest backoffs are well under 300 (the
#: kubelet/containerd kills are scheduled within it: shorter outages need their schedule re-checked)
OUTAGE = float(os.environ.get("GPUSLICE_APISERVER_OUTAGE_SECONDS", "300"))
CHECK_EVERY = 30.0
#: client-go's reflectors retry a failed watch at [30, 60) s intervals after minutes of failures
EXEC_BACK = 90.0


@pytest.fixture(scope="module")
def node_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    with fresh_node_cluster(tmp_path_factory.mktemp("outage")) as c:
        yield c


def _node_ready(cluster: DevCluster) -> bool:
    node = get_json(cluster, "node", NODE)
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"]["conditions"])
    return ready and not [
        t for t in node["spec"].get("taints") or [] if t["key"].startswith("node.kubernetes.io/")
    ]


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
        # The wait is shared with two node faults that need no API server: containerd and then
        # kubelet SIGKILLed and started again while it is down.
        node_faults = [process_names(NODE)["containerd"], process_names(NODE)["kubelet"]]
        while (left := OUTAGE - (time.monotonic() - down)) > 0:
            problems = inv.node_side()
            assert not problems, f"{time.monotonic() - down:.0f}s into the outage:\n" + "\n".join(problems)
            checks += 1
            if node_faults and checks % 3 == 0:
                faults.restart(node_cluster, node_faults.pop(0), signal.SIGKILL, down_for=5)
            for name in ours:
                assert faults.record(node_cluster, name).alive(), f"{name} died during the outage"
            time.sleep(min(CHECK_EVERY, max(left, 0)))
        assert checks >= OUTAGE // CHECK_EVERY and not node_faults
        faults.start_again(node_cluster, "kube-apiserver", rec)
        ended = time.monotonic()
        inv.shim_through_node = True
        inv.settle(f"kube-apiserver down {OUTAGE:.0f} s (containerd, kubelet restarted meanwhile)", ended)
        # A tenant's `kubectl exec` reaches the pod once kubelet (restarted in the outage) has its
        # pods from the API server again: Kubernetes' own backoff, not a promise of gpuslice's
        inv.shim_through_node = False
        wait_for(lambda: not inv.violations(), EXEC_BACK, "kubectl exec into the running slice pod again")
        print(f"\n[outage] kubectl exec into the running pod works {time.monotonic() - ended:.0f}s after")
        assert {name: faults.record(node_cluster, name).pid for name in ours} == pids, "restarted"
        back = datetime.now(UTC)
        run_pod(node_cluster, slice_pod("after-outage", ["sleep", "3600"]), timeout=180)
        print(
            f"\n[outage] a new slice pod ran {(datetime.now(UTC) - back).total_seconds():.1f}s "
            "after the apiserver came back"
        )
        print("[outage] " + _stages(node_cluster, "after-outage", back))
        # kube-controller-manager may mark the node unreachable on its return (it saw no lease renewed
        # for minutes): its NoExecute taint evicts the pods after their 300 s toleration unless the
        # node is Ready again first
        wait_for(lambda: _node_ready(node_cluster), 240, "the node Ready and untainted", interval=2)
        print(f"[outage] node Ready and untainted {(datetime.now(UTC) - back).total_seconds():.0f}s after")
        assert not inv.violations(), inv.violations()
    finally:
        for name in ("outage", "after-outage"):
            delete(node_cluster, "pod", name)
            delete(node_cluster, "gpuslice", name)
