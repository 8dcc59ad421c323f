"""Faults on the real node and its control plane while slice pods run: etcd, kubelet and containerd
killed and started again, the agent killed during a burst of prepares. After each, every invariant of
`invariants` must hold again within 30 s of the fault's end, without a manual step."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator

import pytest

from gpuslice import constants as c
from gpuslice_dev.devcluster import faults
from gpuslice_dev.devcluster.cluster import DevCluster
from gpuslice_dev.devcluster.node_agents import agent_process_name, start_agents
from gpuslice_dev.devcluster.realnode import process_names
from invariants import Invariants, real_node
from node.node_cluster import GPU_SPEC, TENANT, delete, run_pod, slice_pod
from support import get_json, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow(seconds=110)]
NODE = "real-node-0"
STEADY = ("steady-0", "steady-1")


@pytest.fixture(scope="module")
def steady(node_cluster: DevCluster) -> Iterator[Invariants]:
    """Two slice pods that run through every fault of the module, and the invariants over them."""
    for name in STEADY:
        run_pod(node_cluster, slice_pod(name, ["sleep", "3600"]))
    inv = Invariants(node_cluster, {TENANT}, [real_node(node_cluster, NODE)])
    try:
        yield inv
    finally:
        for name in STEADY:
            delete(node_cluster, "pod", name)
            delete(node_cluster, "gpuslice", name)


def prepared(inv: Invariants) -> dict[str, str]:
    """The agent's checkpoint: {claim uid: state}."""
    node = inv.nodes[NODE]
    return {uid: rec["state"] for uid, rec in json.loads(node.checkpoint.read_text())["claims"].items()}


def new_pod_starts(cluster: DevCluster, name: str) -> None:
    """After the fault a new slice pod starts (claim made, allocated, prepared, container run)."""
    run_pod(cluster, slice_pod(name, ["sleep", "3600"]), timeout=120)
    delete(cluster, "pod", name)
    delete(cluster, "gpuslice", name)


def test_etcd_sigkilled_and_started_again(node_cluster: DevCluster, steady: Invariants) -> None:
    steady.baseline()
    ended = faults.restart(node_cluster, "etcd", signal.SIGKILL, down_for=5)
    steady.settle("etcd SIGKILLed, down 5 s", ended)
    new_pod_starts(node_cluster, "after-etcd")


def test_kubelet_restart_keeps_prepared_claims_and_pods(node_cluster: DevCluster, steady: Invariants) -> None:
    steady.baseline()
    before = prepared(steady)
    ended = faults.restart(node_cluster, process_names(NODE)["kubelet"], signal.SIGKILL, down_for=5)
    steady.settle("kubelet SIGKILLed, down 5 s", ended)
    assert prepared(steady) == before, "kubelet's restart changed the prepared claims"
    new_pod_starts(node_cluster, "after-kubelet")


def test_containerd_restart_leaves_running_containers_alone(
    node_cluster: DevCluster, steady: Invariants
) -> None:
    steady.baseline()
    before = prepared(steady)
    ended = faults.restart(node_cluster, process_names(NODE)["containerd"], signal.SIGKILL, down_for=5)
    steady.settle("containerd SIGKILLed, down 5 s", ended)
    assert prepared(steady) == before
    new_pod_starts(node_cluster, "after-containerd")


def test_agent_killed_during_a_burst_of_prepares(node_cluster: DevCluster, steady: Invariants) -> None:
    steady.baseline()
    already = len(prepared(steady))
    burst = [f"burst-{i}" for i in range(4)]
    docs = [d for name in burst for d in slice_pod(name, ["sleep", "3600"])]
    node_cluster.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
    try:
        # killed once kubelet has asked it to prepare the first of them
        wait_for(lambda: len(prepared(steady)) > already, 60, "a prepare of the burst", interval=0.05)
        faults.kill(node_cluster, agent_process_name(NODE), signal.SIGKILL)
        time.sleep(3)
        assert start_agents(node_cluster, GPU_SPEC) == [NODE]
        steady.settle("agent SIGKILLed during 4 prepares, down 3 s", time.monotonic())
        for i in range(len(burst)):
            run_pod(node_cluster, [docs[2 * i + 1]], timeout=120)
        # each claim prepared once and finished, none left half-done
        uids = {get_json(node_cluster, "resourceclaim", n, "-n", TENANT)["metadata"]["uid"] for n in burst}
        states = prepared(steady)
        assert uids <= set(states) and set(states.values()) == {"Prepared"}, states
    finally:
        for name in burst:
            delete(node_cluster, "pod", name)
            delete(node_cluster, "gpuslice", name)


def _node_slices(cluster: DevCluster) -> dict[str, str]:
    """{ResourceSlice name: uid} of the real node's gpuslice.io pool."""
    items = get_json(cluster, "resourceslices", "--field-selector", f"spec.nodeName={NODE}")["items"]
    return {
        s["metadata"]["name"]: s["metadata"]["uid"] for s in items if s["spec"]["driver"] == c.DRIVER_NAME
    }


def test_agent_stopped_as_a_rollout_stops_it_keeps_the_pool_and_kubelet_wipes_it_only_if_none_returns(
    node_cluster: DevCluster, steady: Invariants
) -> None:
    """A DaemonSet rollout SIGTERMs the old agent before the new one registers. The pool stays
    published meanwhile (a pod created then is scheduled at once and runs once the new agent is up);
    only when no agent registers again does kubelet delete the pool, as it does for every DRA driver."""
    steady.baseline()
    before = _node_slices(node_cluster)
    assert before
    faults.kill(node_cluster, agent_process_name(NODE), signal.SIGTERM)
    try:
        assert _node_slices(node_cluster) == before, "the stopping agent withdrew its pool"
        node_cluster.apply(
            json.dumps(
                {"apiVersion": "v1", "kind": "List", "items": slice_pod("mid-rollout", ["sleep", "3600"])}
            )
        )
        wait_for(
            lambda: get_json(node_cluster, "pod", "mid-rollout", "-n", TENANT)["spec"].get("nodeName"),
            30, "the pod created while no agent runs to be scheduled on the kept pool",
        )  # fmt: skip
        time.sleep(3)
    finally:
        assert start_agents(node_cluster, GPU_SPEC) == [NODE]
    try:
        run_pod(node_cluster, [slice_pod("mid-rollout", ["sleep", "3600"])[1]], timeout=120)
        steady.settle("agent SIGTERMed as a rollout does, down 3 s", time.monotonic())
        assert _node_slices(node_cluster) == before, "the new agent re-created slices it could update"
    finally:
        delete(node_cluster, "pod", "mid-rollout")
        delete(node_cluster, "gpuslice", "mid-rollout")
    # uninstall: the agent stops and none registers again -> kubelet wipes the pool after its delay
    faults.kill(node_cluster, agent_process_name(NODE), signal.SIGTERM)
    stopped = time.monotonic()
    try:
        wait_for(lambda: not _node_slices(node_cluster), 75, "kubelet to wipe the pool of a gone plugin")
        print(f"\n[rollout] kubelet wiped the pool {time.monotonic() - stopped:.0f}s after the agent stopped")
    finally:
        assert start_agents(node_cluster, GPU_SPEC) == [NODE]
    wait_for(lambda: _node_slices(node_cluster), 60, "the pool published again")
    steady.settle("agent stopped for good, then started again", time.monotonic())
