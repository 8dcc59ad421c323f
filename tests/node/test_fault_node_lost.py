"""A second real node whose kubelet stops for good while a slice's pod runs there. Its own file: it
waits out the node's grace period.

Kubernetes marks the node NotReady after kube-controller-manager's grace period, and evicts the pod
once its toleration of the unreachable/not-ready taints runs out (5 s here). The pod then stays
Terminating: no kubelet confirms its containers are gone, so its claim stays allocated on the dead
node. That is Kubernetes' non-graceful node shutdown: an admin (or a cloud's node controller)
declares the node out of service, the pod is removed, the claim freed, and the Deployment's next pod
gets a slice on the node that lives. Every invariant holds within 30 s of that."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from gpuslice_dev.devcluster import faults
from gpuslice_dev.devcluster.cluster import DevCluster
from gpuslice_dev.devcluster.images import PAUSE_IMAGE
from gpuslice_dev.devcluster.node_agents import start_agents
from gpuslice_dev.devcluster.realnode import process_names, start_real_nodes, stop_node
from invariants import Invariants, real_node
from node.node_cluster import GPU_SPEC, PROBE, TENANT, delete
from support import get_json, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow(seconds=130)]
LIVES, DIES = "real-node-0", "real-node-1"
TOLERATION_SECONDS = 5


@pytest.fixture
def second_node(node_cluster: DevCluster) -> Iterator[str]:
    start_real_nodes(node_cluster, 2)
    start_agents(node_cluster, GPU_SPEC)
    try:
        yield DIES
    finally:
        node_cluster.stop_processes(
            lambda name: name.endswith(f"/{DIES}") and name.split("/")[0] != "kubelet"
        )
        stop_node(node_cluster, DIES)
        node_cluster.kubectl("delete", "node", DIES, "--ignore-not-found", check=False)
        node_cluster.kubectl("uncordon", LIVES, check=False)


def deployment(name: str) -> list[dict[str, Any]]:
    """A GpuSlice and a Deployment whose pod holds its claim and tolerates a lost node 5 s."""
    tolerations = [
        {"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": TOLERATION_SECONDS}
        for key in ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")
    ]
    pod = {
        "metadata": {"labels": {"app": name}},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "tolerations": tolerations,
            "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
            "containers": [
                {
                    "name": "main",
                    "image": PROBE,
                    "command": ["sleep", "3600"],
                    "resources": {"claims": [{"name": "gpu"}], "limits": {"memory": "1Gi"}},
                }
            ],
        },
    }
    return [
        {
            "apiVersion": "gpuslice.io/v1beta1",
            "kind": "GpuSlice",
            "metadata": {"name": name, "namespace": TENANT},
            "spec": {"package": "v100-8g"},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name, "namespace": TENANT},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}}, "template": pod},
        },
    ]


def pods_of(cluster: DevCluster, app: str) -> list[dict[str, Any]]:
    return list(get_json(cluster, "pods", "-n", TENANT, "-l", f"app={app}")["items"])


def slice_status(cluster: DevCluster, name: str) -> dict[str, Any]:
    return dict(get_json(cluster, "gpuslice", name, "-n", TENANT).get("status") or {})


#: client-go's reflectors retry a failed watch with a backoff that stops at [30, 60) s: after an API
#: server outage of minutes kube-scheduler's Node watch may be back up to a minute after its Pod watch
SCHEDULER_CATCH_UP = 120


def cordon_seen_by_the_scheduler(cluster: DevCluster, node: str) -> float:
    """Cordon `node` and wait until kube-scheduler refuses a probe pod there for that reason; returns
    the seconds that took. `kubectl cordon` returns once the API server has the change; the scheduler
    learns of it through its Node watch, in no order with its Pod watch, so a pod created at once may
    still be placed there (seen after an API-server outage: the probe was bound to the cordoned node,
    and kube-controller-manager added the node's unschedulable taint 17 s after the cordon)."""
    cluster.kubectl("cordon", node)
    started = time.monotonic()
    name = f"cordon-probe-{node}"
    probe: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": TENANT},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "pause", "image": PAUSE_IMAGE}],
        },
    }

    def verdict() -> str | None:
        pod = get_json(cluster, "pod", name, "-n", TENANT) or {}
        if pod.get("spec", {}).get("nodeName"):
            return "placed"
        conds = pod.get("status", {}).get("conditions") or []
        refused = any(
            c["type"] == "PodScheduled" and c["status"] == "False" and "unschedulable" in c.get("message", "")
            for c in conds
        )
        return "refused" if refused else None

    try:
        while True:
            cluster.apply(json.dumps(probe))
            left = SCHEDULER_CATCH_UP - (time.monotonic() - started)
            if wait_for(verdict, max(left, 1), f"kube-scheduler to see {node} cordoned") == "refused":
                return time.monotonic() - started
            delete(cluster, "pod", name)  # placed by a Node view from before the cordon: again
            assert time.monotonic() - started < SCHEDULER_CATCH_UP, (
                f"kube-scheduler never saw {node} cordoned"
            )
    finally:
        delete(cluster, "pod", name)


def test_a_node_whose_kubelet_stops_for_good(node_cluster: DevCluster, second_node: str) -> None:
    seen = cordon_seen_by_the_scheduler(node_cluster, LIVES)  # the pod starts on the node that will die
    print(f"\n[node lost] kube-scheduler saw the cordon {seen:.1f}s after it")
    node_cluster.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": deployment("wanderer")}))
    try:

        def running_on(node: str) -> dict[str, Any] | None:
            pods = [
                p for p in pods_of(node_cluster, "wanderer") if not p["metadata"].get("deletionTimestamp")
            ]
            ok = [
                p for p in pods if p["spec"].get("nodeName") == node and p["status"].get("phase") == "Running"
            ]
            return ok[0] if ok else None

        first = wait_for(lambda: running_on(DIES), 120, f"the pod running on {DIES}")
        node_cluster.kubectl("uncordon", LIVES)
        inv = Invariants(node_cluster, {TENANT}, [real_node(node_cluster, LIVES)])
        inv.lost_nodes = {DIES}
        inv.baseline()
        assert slice_status(node_cluster, "wanderer")["node"] == DIES

        faults.kill(node_cluster, process_names(DIES)["kubelet"])
        died = time.monotonic()

        def evicted() -> dict[str, Any] | None:
            p = get_json(node_cluster, "pod", first["metadata"]["name"], "-n", TENANT)
            return p if p and p["metadata"].get("deletionTimestamp") else None

        wait_for(evicted, 180, "the pod evicted from the lost node", interval=1)
        evicted_after = time.monotonic() - died
        # where the slice is: still allocated on the lost node, and no longer in use
        st = slice_status(node_cluster, "wanderer")
        assert (st["phase"], st["node"]) == ("Allocated", DIES), st
        # the Deployment's replacement waits for the claim, which the Terminating pod still holds
        time.sleep(5)
        assert not running_on(LIVES)

        # non-graceful node shutdown: the admin declares the node out of service
        node_cluster.kubectl(
            "taint", "node", DIES, "node.kubernetes.io/out-of-service=nodeshutdown:NoExecute", "--overwrite"
        )
        declared = time.monotonic()
        inv.settle("a node lost for good, after it is declared out of service", declared)
        second = wait_for(lambda: running_on(LIVES), 120, f"the Deployment's next pod running on {LIVES}")
        moved = time.monotonic() - declared
        st = slice_status(node_cluster, "wanderer")
        assert (st["phase"], st["node"]) == ("InUse", LIVES), st
        assert second["metadata"]["uid"] != first["metadata"]["uid"]
        print(
            f"\n[node lost] pod evicted {evicted_after:.0f}s after the kubelet died; "
            f"after the out-of-service taint its slice ran on {LIVES} {moved:.1f}s later"
        )
    finally:
        node_cluster.kubectl("delete", "deployment", "wanderer", "-n", TENANT, "--wait=false", check=False)
        node_cluster.kubectl(
            "delete", "pods", "-n", TENANT, "-l", "app=wanderer", "--force", "--grace-period=0", check=False
        )
        delete(node_cluster, "gpuslice", "wanderer")
