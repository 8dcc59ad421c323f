"""A card fails on the real node (two simulated V100s): its slice pod is evicted by Kubernetes and its
replacement runs on the other card; an application XID changes nothing; a reset brings it back."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from gpuslice.domain.capacity_window import CAPACITY_BOUND_SECONDS
from gpuslice.domain.health import TAINT_KEY
from gpuslice_dev.devcluster.cluster import DevCluster
from gpuslice_dev.devcluster.node_agents import fake_gpu_config
from gpuslice_dev.gpusim import faults
from node.node_cluster import PROBE, TENANT, delete, slice_pod
from support import get_json, lag_of, objects, skip_unless_served, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow(seconds=90)]
NODE = "real-node-0"
PACKAGE = "v100-8g"


def deployment(name: str) -> dict[str, Any]:
    """One replica holding the GpuSlice's claim: a new pod of it reuses the claim, as a workload's."""
    labels = {"app": name}
    pod = slice_pod(name, ["sleep", "3600"])[1]
    spec = dict(pod["spec"])  # type: ignore[arg-type]
    assert spec["containers"][0]["image"] == PROBE
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": TENANT},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": spec},
        },
    }


def pods_of(cluster: DevCluster, app: str) -> list[dict[str, Any]]:
    return list(get_json(cluster, "pods", "-n", TENANT, "-l", f"app={app}")["items"])


def card_of_claim(cluster: DevCluster, claim: str) -> int | None:
    obj = get_json(cluster, "resourceclaim", claim, "-n", TENANT) or {}
    results = (((obj.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
    return int(results[0]["device"].split("-")[1]) if results else None


def card_taints(cluster: DevCluster, index: int) -> list[dict[str, Any]]:
    """The taints every published device of card `index` carries (one list per device)."""
    slices = get_json(cluster, "resourceslices", "--field-selector", f"spec.nodeName={NODE}")["items"]
    out = []
    for s in slices:
        for d in s["spec"].get("devices") or []:
            if d["attributes"]["gpuIndex"]["int"] == index:
                out.append(d.get("taints") or [])
    return out


def capacity(cluster: DevCluster) -> dict[str, Any]:
    return dict((get_json(cluster, "gpupackage", PACKAGE).get("status") or {}).get("capacity") or {})


def running_pod(cluster: DevCluster, app: str, not_named: str | None = None) -> dict[str, Any] | None:
    for p in pods_of(cluster, app):
        running = (p.get("status") or {}).get("phase") == "Running"
        if p["metadata"]["name"] != not_named and running and not p["metadata"].get("deletionTimestamp"):
            return p
    return None


@pytest.fixture
def moving(node_cluster: DevCluster) -> Iterator[str]:
    name = "moving"
    slice_doc = slice_pod(name, ["sleep", "3600"])[0]
    node_cluster.apply(
        json.dumps({"apiVersion": "v1", "kind": "List", "items": [slice_doc, deployment(name)]})
    )
    config = fake_gpu_config(node_cluster, NODE)
    try:
        wait_for(lambda: running_pod(node_cluster, name), 120, "the slice's first pod Running")
        yield name
    finally:
        for card in ("0", "1"):
            faults.inject(config, card, clear=True)
        delete(node_cluster, "deployment", name)
        delete(node_cluster, "gpuslice", name)


def events(cluster: DevCluster, namespace: str, name: str) -> list[dict[str, Any]]:
    items = get_json(cluster, "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}")
    return list(items["items"])


def test_a_failed_card_evicts_its_slice_pod_and_the_replacement_runs_on_the_healthy_card(
    node_cluster: DevCluster, moving: str
) -> None:
    config = fake_gpu_config(node_cluster, NODE)
    first = running_pod(node_cluster, moving)
    assert first is not None
    card = card_of_claim(node_cluster, moving)
    assert card in (0, 1)
    wait_for(lambda: capacity(node_cluster).get("gpus") == 2, 60, "both cards sold")

    t0 = time.monotonic()
    faults.inject(config, str(card), xid=79)
    tainted = wait_for(
        lambda: (t := card_taints(node_cluster, card)) and all(t) and t,
        30,
        "the failed card's devices tainted",
        interval=0.1,
    )
    t_taint = time.monotonic() - t0
    for device_taints in tainted:
        [taint] = device_taints
        assert (taint["key"], taint["value"], taint["effect"]) == (TAINT_KEY, "xid-79", "NoExecute")
        assert taint["timeAdded"]
    assert not any(card_taints(node_cluster, 1 - card)), "the healthy card stays untainted"

    old = first["metadata"]["name"]
    replacement = wait_for(
        lambda: running_pod(node_cluster, moving, not_named=old), 120, "a replacement running", interval=0.2
    )
    t_running = time.monotonic() - t0
    assert card_of_claim(node_cluster, moving) == 1 - card, "the new pod's slice is on the healthy card"
    wait_for(lambda: get_json(node_cluster, "pod", old, "-n", TENANT) is None, 60, "the old pod evicted")
    print(f"\nXID 79 -> taint {t_taint:.2f} s, -> replacement Running {t_running:.2f} s")

    cap = wait_for(
        lambda: (c := capacity(node_cluster)).get("unhealthyGpus") == 1 and c, 60, "capacity without the card"
    )
    assert (cap["gpus"], cap["slicesTotal"]) == (1, 4), cap
    node_events = {e["reason"]: e["message"] for e in events(node_cluster, "default", NODE)}
    assert "XID 79 (GPU has fallen off the bus)" in node_events.get("GpuUnhealthy", ""), node_events
    slice_events = {e["reason"]: e for e in events(node_cluster, TENANT, moving)}
    assert "GpuFailed" in slice_events, sorted(slice_events)
    assert slice_events["GpuFailed"]["type"] == "Warning"
    assert "XID 79" in slice_events["GpuFailed"]["message"]

    faults.inject(config, str(card), clear=True)
    wait_for(lambda: not any(card_taints(node_cluster, card)), 30, "the reset card untainted")
    cap = wait_for(lambda: (c := capacity(node_cluster)).get("gpus") == 2 and c, 60, "capacity back")
    assert "unhealthyGpus" not in cap, cap
    assert running_pod(node_cluster, moving)["metadata"]["name"] == replacement["metadata"]["name"]


def test_an_application_xid_changes_nothing(node_cluster: DevCluster, moving: str) -> None:
    config = fake_gpu_config(node_cluster, NODE)
    pod = running_pod(node_cluster, moving)
    assert pod is not None
    card = card_of_claim(node_cluster, moving)
    assert card is not None
    faults.inject(config, str(card), xid=13)  # graphics engine exception: the application's own fault
    time.sleep(3)
    assert not any(card_taints(node_cluster, card))
    assert running_pod(node_cluster, moving)["metadata"]["name"] == pod["metadata"]["name"]
    assert capacity(node_cluster).get("gpus") == 2


def test_drain_with_evict_moves_the_slice_and_uncordon_puts_the_card_back(
    node_cluster: DevCluster, moving: str
) -> None:
    skip_unless_served(
        node_cluster, "resource.k8s.io/v1", "devicetaintrules", "gpuslice drain (DeviceTaintRules)"
    )
    old = running_pod(node_cluster, moving)
    card = card_of_claim(node_cluster, moving)
    assert old is not None and card is not None
    uuid = next(
        d["attributes"]["uuid"]["string"]
        for s in get_json(node_cluster, "resourceslices", "--field-selector", f"spec.nodeName={NODE}")[
            "items"
        ]
        for d in s["spec"].get("devices") or []
        if d["attributes"]["gpuIndex"]["int"] == card
    )
    drain = subprocess.run(
        [sys.executable, "-m", "gpuslice", "drain", "--node", NODE, "--gpu", uuid, "--evict", "--wait",
         "--timeout", "120", "--kubeconfig", str(node_cluster.kubeconfig)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert drain.returncode == 0, drain.stderr
    assert "no slice is allocated there any more" in drain.stdout
    rules = get_json(node_cluster, "devicetaintrules", "-l", f"gpuslice.io/drain-node={NODE}")["items"]
    # one rule per device the card published when drain read it: the package's 4 quarter slices, and
    # the devices of other packages on the card (the real node is the session's: files run before this
    # one on the same worker may have left theirs)
    assert f"drained card {uuid} of node {NODE}: {len(rules)} DeviceTaintRule(s)" in drain.stdout
    assert {r["spec"]["taint"]["effect"] for r in rules} == {"NoExecute"} and len(rules) >= 4
    assert {r["metadata"]["labels"]["gpuslice.io/drain-gpu"] for r in rules} == {uuid}
    new = wait_for(
        lambda: running_pod(node_cluster, moving, not_named=old["metadata"]["name"]), 120, "the moved pod"
    )
    assert card_of_claim(node_cluster, moving) == 1 - card, new["metadata"]["name"]

    uncordon = subprocess.run(
        [sys.executable, "-m", "gpuslice", "uncordon", "--node", NODE,
         "--kubeconfig", str(node_cluster.kubeconfig)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    # every rule drain made
    assert uncordon.returncode == 0, uncordon.stderr
    assert f"uncordoned: {len(rules)} DeviceTaintRule(s) of {NODE} deleted" in uncordon.stdout
    assert not get_json(node_cluster, "devicetaintrules", "-l", f"gpuslice.io/drain-node={NODE}")["items"]


def test_a_pending_remap_stops_sales_of_the_card_but_lets_the_pod_run(
    node_cluster: DevCluster, moving: str
) -> None:
    config = fake_gpu_config(node_cluster, NODE)
    pod = running_pod(node_cluster, moving)
    card = card_of_claim(node_cluster, moving)
    assert pod is not None and card is not None
    faults.inject(config, str(card), pending_remap=True)
    tainted = wait_for(lambda: (t := card_taints(node_cluster, card)) and all(t) and t, 30, "NoSchedule")
    assert {(t[0]["value"], t[0]["effect"]) for t in tainted} == {("pending-remap", "NoSchedule")}

    def device_status() -> list[dict[str, Any]]:
        return list((get_json(node_cluster, "resourceclaim", moving, "-n", TENANT).get("status") or {}).get(
            "devices") or [])  # fmt: skip

    [status] = wait_for(lambda: (d := device_status()) and d, 30, "the claim's device status")
    [cond] = status["conditions"]
    assert (cond["type"], cond["status"], cond["reason"]) == ("GpuHealthy", "False", "GpuPendingReset")
    time.sleep(3)
    assert running_pod(node_cluster, moving)["metadata"]["name"] == pod["metadata"]["name"], "it runs on"
    faults.inject(config, str(card), clear=True)
    wait_for(lambda: not any(card_taints(node_cluster, card)), 30, "untainted after the reset")
    wait_for(lambda: device_status()[0]["conditions"][0]["status"] == "True", 30, "GpuHealthy=True")


def test_package_capacity_is_current_within_the_bound_through_a_failed_card(
    node_cluster: DevCluster, moving: str
) -> None:
    """The story a new user tried: a slice pod running, XID 79 on its card, the pod evicted and its
    replacement Running on the other card. `kubectl get gpupackages` shows each step within the bound,
    with the operator's recheck timer at its default."""
    config = fake_gpu_config(node_cluster, NODE)
    card = card_of_claim(node_cluster, moving)
    assert card in (0, 1)
    slices = get_json(node_cluster, "resourceslices", "--field-selector", f"spec.nodeName={NODE}")["items"]
    refs = [
        f"gpupackages.gpuslice.io/{PACKAGE}",
        f"resourceclaims.resource.k8s.io/{moving}",
        *(f"resourceslices.resource.k8s.io/{s['metadata']['name']}" for s in slices),
    ]

    def read() -> dict[str, Any]:
        return objects(node_cluster, TENANT, *refs)

    def cap(o: dict[str, Any]) -> dict[str, Any]:
        return dict((o.get(f"GpuPackage/{PACKAGE}") or {}).get("status", {}).get("capacity") or {})

    def card_tainted(o: dict[str, Any], index: int) -> bool:
        devices = [
            d
            for k, s in o.items()
            if k.startswith("ResourceSlice/")
            for d in s["spec"].get("devices") or []
            if d["attributes"]["gpuIndex"]["int"] == index
        ]
        return bool(devices) and all(d.get("taints") for d in devices)

    def claim_card(o: dict[str, Any]) -> int | None:
        claim = o.get(f"ResourceClaim/{moving}") or {}
        results = ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get(
            "results"
        ) or []
        return int(results[0]["device"].split("-")[1]) if results else None

    lags = {
        # The pod runs, so its claim was allocated before now: the count already shows it, or soon.
        "pod Running -> allocated 1": lag_of(
            read,
            lambda o: claim_card(o) == card,
            lambda o: cap(o) == {"gpus": 2, "slicesTotal": 8, "slicesAllocated": 1, "slicesFree": 7},
            "the running slice counted",
        )
    }
    faults.inject(config, str(card), xid=79)
    lags["card tainted -> counted out"] = lag_of(
        read,
        lambda o: card_tainted(o, card),
        lambda o: cap(o).get("unhealthyGpus") == 1 and cap(o).get("gpus") == 1 and cap(o)["slicesTotal"] == 4,
        "the failed card counted out",
    )
    lags["replacement allocated -> counted"] = lag_of(
        read,
        lambda o: claim_card(o) == 1 - card,
        lambda o: (
            cap(o) == {"gpus": 1, "slicesTotal": 4, "slicesAllocated": 1, "slicesFree": 3, "unhealthyGpus": 1}
        ),
        "the replacement's slice counted on the healthy card",
        timeout=120,
    )
    wait_for(lambda: running_pod(node_cluster, moving), 120, "the replacement Running")
    shown = node_cluster.kubectl("get", "gpupackages", PACKAGE).stdout.split("\n")[1].split()
    assert shown[3:7] == ["1", "4", "1", "3"], shown  # GPUS TOTAL ALLOCATED FREE
    print("\n[capacity lag, real node] " + ", ".join(f"{k} {v:.2f} s" for k, v in lags.items()))
    assert all(v <= CAPACITY_BOUND_SECONDS for v in lags.values()), lags
