"""`gpuslice check` says, one line per prerequisite, whether a cluster can run gpuslice and how to fix
what is missing; the agent refuses to run where the API server drops its counters.

The dropped-fields path runs against a second, real kube-apiserver started with the DRA gates off.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from gpuslice.check import (
    Outcome,
    agent_runtime_class,
    evaluate_agents,
    evaluate_operator,
    evaluate_packages,
    evaluate_probe,
    evaluate_runtime_class,
    evaluate_version,
    exit_code,
    fail,
    ok,
    probe_slices,
    render,
)
from gpuslice_dev.devcluster.cluster import DevCluster
from support import V100, check_line, counters_kept, gpuslice_check, package_doc, published

GATES_OFF = "DRAPartitionableDevices=false,DRAConsumableCapacity=false"
NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)


# --- the decisions ---------------------------------------------------------------------------------


def test_versions_from_1_36_pass_1_34_passes_with_a_note_older_fails() -> None:
    assert evaluate_version("v1.37.2").outcome == Outcome.OK
    older = evaluate_version("v1.35.1")
    assert older.outcome == Outcome.OK and "alpha gates" in older.detail
    ancient = evaluate_version("v1.34.6")
    assert (
        ancient.outcome == Outcome.FAIL
        and "older than gpuslice supports (1.35, 1.36, 1.37)" in ancient.detail
    )
    assert "upgrade the cluster to 1.35, 1.36, 1.37" in ancient.fix
    newer = evaluate_version("v1.38.0")
    assert newer.outcome == Outcome.FAIL and "newer than gpuslice was tested on" in newer.detail


def test_probe_names_each_dropped_field_and_the_gate_that_keeps_it() -> None:
    sent = probe_slices()
    kept = evaluate_probe(sent, sent)
    assert [r.outcome for r in kept] == [Outcome.OK, Outcome.OK]
    stripped = [{"spec": {k: v for k, v in s["spec"].items() if k != "sharedCounters"}} for s in sent]
    stripped[1]["spec"]["devices"] = [{"name": d["name"]} for d in sent[1]["spec"]["devices"]]
    partitionable, consumable = evaluate_probe(sent, stripped)
    assert partitionable.outcome == Outcome.FAIL
    assert "spec.sharedCounters, spec.devices[partition].consumesCounters" in partitionable.detail
    assert "--feature-gates=DRAPartitionableDevices=true" in partitionable.fix
    assert consumable.outcome == Outcome.FAIL and "DRAConsumableCapacity=true" in consumable.fix


def test_operator_is_running_while_a_peer_renews_its_keepalive() -> None:
    fresh = {"status": {"p1": {"lastseen": (NOW - timedelta(seconds=10)).isoformat(), "lifetime": 60}}}
    stale = {"status": {"p1": {"lastseen": (NOW - timedelta(seconds=90)).isoformat(), "lifetime": 60}}}
    assert evaluate_operator(fresh, None, NOW).outcome == Outcome.OK
    gone = evaluate_operator(stale, None, NOW)
    assert gone.outcome == Outcome.FAIL and "within its lifetime" in gone.detail
    assert "rollout status deploy/gpuslice-operator" in gone.fix
    deployed = {"status": {"availableReplicas": 2}}
    assert evaluate_operator(None, deployed, NOW).outcome == Outcome.OK


def test_gpu_nodes_without_slices_and_packages_without_gpus_are_named() -> None:
    slices = published("n1", 2, {"v100-8g": 25})
    assert evaluate_agents(["n1"], slices).detail == "2 GPU(s) on 1 node(s)"
    silent = evaluate_agents(["n1", "n2"], slices)
    assert silent.outcome == Outcome.FAIL and "n2" in silent.detail and "n1" not in silent.detail
    assert evaluate_agents([], []).outcome == Outcome.FAIL
    pkgs = [package_doc("v100-8g", 25), package_doc("a100", 25, model="NVIDIA A100-SXM4-40GB")]
    unmatched = evaluate_packages(pkgs, {V100})
    assert unmatched.outcome == Outcome.FAIL and "a100 ('NVIDIA A100-SXM4-40GB')" in unmatched.detail
    assert evaluate_packages([], {V100}).outcome == Outcome.SKIP


def test_the_runtime_class_asked_for_is_the_deployed_agents() -> None:
    def agent(runtime_class: str | None) -> dict[str, Any]:
        pod: dict[str, Any] = {"containers": [{"name": "agent"}]}
        if runtime_class:
            pod["runtimeClassName"] = runtime_class
        return {"spec": {"template": {"spec": pod}}}

    # Not deployed yet: the base manifests' nvidia.
    assert agent_runtime_class(None) == "nvidia"
    assert evaluate_runtime_class("nvidia", False, deployed=False).outcome is Outcome.FAIL
    # Deployed without one (the devcluster overlay): nothing to ask for.
    assert agent_runtime_class(agent(None)) is None
    assert evaluate_runtime_class(None, None, deployed=True).outcome is Outcome.OK
    # Deployed with another (a platform's own handler name): that one is checked, and named.
    assert agent_runtime_class(agent("nvidia-cdi")) == "nvidia-cdi"
    missing = evaluate_runtime_class("nvidia-cdi", False, deployed=True)
    assert missing.outcome is Outcome.FAIL and "nvidia-cdi" in missing.detail and "nvidia-cdi" in missing.fix
    assert evaluate_runtime_class("nvidia-cdi", True, deployed=True).outcome is Outcome.OK


def test_output_is_one_line_per_check_with_the_fix_under_a_failure() -> None:
    results = [ok("a", "fine"), fail("b", "broken", "do this")]
    assert render("https://k", results).splitlines() == [
        "gpuslice check against https://k",
        "\u221a a: fine",
        "\u00d7 b: broken",
        "    fix: do this",
        "1 check(s) failed",
    ]
    assert exit_code(results) == 1 and exit_code(results[:1]) == 0


# --- on real API servers ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gates_off(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    """A second control plane whose kube-apiserver runs with the DRA gates off, as 1.34/1.35 do."""
    dc = DevCluster(
        tmp_path_factory.mktemp("gates-off"),
        progress=lambda m: print(f"[gates-off] {m}", file=sys.stderr),
        apiserver_feature_gates=GATES_OFF,
    )
    try:
        dc.up(nodes=0, crds=False)
        yield dc
    finally:
        dc.down()


@pytest.mark.cluster
def test_check_fails_and_names_the_gates_when_the_api_server_drops_the_counters(
    gates_off: DevCluster,
) -> None:
    proc = gpuslice_check(gates_off.kubeconfig)
    out = proc.stdout
    print(out)
    assert proc.returncode == 1, proc.stderr
    assert check_line(out, "resource.k8s.io/v1 (DRA) is served").startswith("\u221a ")
    partitionable = check_line(out, "partitionable devices (DRAPartitionableDevices) kept by the API server")
    assert partitionable.startswith("\u00d7 ")
    assert "spec.sharedCounters, spec.devices[partition].consumesCounters" in partitionable
    fix = out.splitlines()[out.splitlines().index(partitionable) + 1]
    assert fix.startswith("    fix: ") and "--feature-gates=DRAPartitionableDevices=true" in fix
    assert check_line(out, "consumable capacity (DRAConsumableCapacity)").startswith("\u00d7 ")


def _publish(dc: DevCluster, node: str, *, start_up: bool = False) -> tuple[list[dict[str, Any]], str | None]:
    """The agent's publisher, against a real API server; returns the pool as stored and why the
    publisher refused (None: it did not). start_up: first decide from what the server serves, as the
    agent does when it starts."""
    from gpuslice.agent.kube import Kube, api_client
    from gpuslice.agent.publisher import Publisher
    from gpuslice.platform import read_platform
    from support import gpu

    async def publish() -> tuple[list[dict[str, Any]], str | None]:
        api = api_client(dc.kubeconfig)
        kube = Kube(api)
        try:
            publisher = Publisher(node, [gpu(0, node=node)], kube)
            if start_up and (refusal := (await read_platform(api, device_class=False)).publish_refusal):
                publisher.refuse(refusal)
            publisher.packages_listed([package_doc("v100-8g", 25)])
            publisher.node_seen({"metadata": {"name": node}})
            try:
                await publisher.sync()
                return await kube.list_pool_slices(node), publisher.refused
            finally:
                await publisher.withdraw()
        finally:
            await api.close()

    return asyncio.run(publish())


@pytest.mark.cluster
def test_the_agent_publishes_nothing_when_its_slices_would_come_back_without_counters(
    gates_off: DevCluster,
) -> None:
    # Devices stored without consumesCounters would be independent devices: kube-scheduler could then
    # place a 32 GiB slice and four 8 GiB ones on one 32 GiB card. The agent offers none and says why,
    # and stays up (no crash loop): decided at start-up from the dry-run probe, and again should a
    # publish come back stripped (a gate turned off while it runs).
    for start_up in (True, False):
        pool, refused = _publish(gates_off, f"gpu-node-{int(start_up)}", start_up=start_up)
        assert pool == [], start_up
        assert refused is not None
        assert "DRAPartitionableDevices" in refused
        assert "sold" in refused and "one card's memory" in refused, refused


@pytest.mark.cluster
def test_the_agent_publishes_where_the_api_server_keeps_the_counters(cluster: DevCluster) -> None:
    # The refusal above must not be a false alarm: with the gates on, the same publish goes through.
    stored, refused = _publish(cluster, "check-gates-on-node", start_up=True)
    if not counters_kept(cluster):  # 1.35 with its default gates: the refusal, as on gates_off
        assert stored == [] and refused is not None and "DRAPartitionableDevices" in refused
        return
    assert refused is None
    assert any(s["spec"].get("sharedCounters") for s in stored)
    assert all(d.get("consumesCounters") for s in stored for d in s["spec"].get("devices") or [])
