"""A card in MIG mode against the real control plane: the real agent over the driver double's
A100-SXM4-80GB (MIG mode turned on before it starts, as a platform does with `nvidia-smi -mig 1`)
publishes the card's MIG placements, the API server accepts them, and the real kube-scheduler
allocates Hardware products of two profiles side by side on one card without overlapping them,
through the DeviceClasses the operator makes for Hardware packages, next to a software package of
the same model whose class must neither match nor trip over the MIG devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from agent.agent_cluster import apply_docs, claim_doc, get_items, pod_doc, pool_slices, simulated_agent
from gpuslice import constants
from gpuslice.api.package import GpuPackageSpec
from gpuslice.api.resourceclaim import allocated_devices
from gpuslice.domain import mig
from gpuslice.domain.deviceclass import device_class
from gpuslice_dev.agents import agent_dirs
from gpuslice_dev.devcluster.cluster import DevCluster, node_manifest
from support import get_json, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow(seconds=60)]

A100 = "NVIDIA A100-SXM4-80GB"
SPEC = f"1x {A100}"
HARDWARE = {"mig-1g": "1g.10gb", "mig-3g": "3g.40gb", "mig-4g": "4g.40gb"}
SOFTWARE = {"a100-half": 50}

MIG_ON = """
import sys
from pathlib import Path
import pynvml
from gpuslice_dev.gpusim import simulate
simulate.use_fake_driver(simulate.write_node_config(sys.argv[1], sys.argv[2], Path(sys.argv[3])))
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)
assert pynvml.nvmlDeviceSetMigMode(h, 1) == 0
assert pynvml.nvmlDeviceGetMigMode(h)[0] == 1
"""


def _package_doc(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": constants.GROUP_VERSION, "kind": constants.PACKAGE_KIND, "metadata": {"name": name},
            "spec": spec}  # fmt: skip


def _specs() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {
        n: {"gpuModel": A100, "fraction": 100, "isolation": {"mode": "Hardware"}, "migProfile": p}
        for n, p in HARDWARE.items()
    }
    out |= {n: {"gpuModel": A100, "fraction": f} for n, f in SOFTWARE.items()}
    return out


@pytest.fixture
def mig_node(
    cluster: DevCluster, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[str]:
    """A kwok node whose agent simulates SPEC (or the test's `indirect` parameter), card 0 in MIG mode."""
    spec = getattr(request, "param", SPEC)
    cluster.apply_crds()
    node = f"mig-{os.getpid() % 10000}"
    apply_docs(cluster, [node_manifest(node)])
    root = tmp_path_factory.mktemp("mig")
    # the card's MIG mode, on in the double's state before the agent first looks at it
    simulated = agent_dirs(root, node)["state"] / "simulated"
    proc = subprocess.run([sys.executable, "-c", MIG_ON, spec, node, str(simulated)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    specs = _specs()
    docs = [_package_doc(n, s) for n, s in specs.items()]
    docs += [device_class(n, None, GpuPackageSpec.model_validate(s), None) for n, s in specs.items()]
    apply_docs(cluster, docs)
    try:
        with simulated_agent(cluster, node, spec, root):
            yield node
    finally:
        cluster.kubectl("delete", "gpupackage", *specs, "--wait=false", check=False)
        classes = [constants.device_class_name(n) for n in specs]
        cluster.kubectl("delete", "deviceclass", *classes, check=False)


def _devices(cluster: DevCluster, node: str) -> list[dict[str, Any]]:
    return [d for s in pool_slices(cluster, node) for d in s["spec"].get("devices") or []]


def test_a_mig_card_publishes_its_placements_and_two_profiles_are_allocated_side_by_side(
    cluster: DevCluster, mig_node: str, namespace: str
) -> None:
    slices = pool_slices(cluster, mig_node)
    sets = {cs["name"]: cs["counters"] for s in slices for cs in s["spec"].get("sharedCounters") or []}
    # the card is its MIG counters only: nothing can take it whole, or as a software fraction
    assert list(sets) == [mig.counter_set_name(0)]
    assert sets[mig.counter_set_name(0)][mig.COUNTER_COMPUTE_SLICES] == {"value": "7"}
    assert all(sets[mig.counter_set_name(0)][mig.memory_slice_counter(k)] == {"value": "1"} for k in range(8))
    devices = _devices(cluster, mig_node)
    profiles = sorted(d["attributes"]["migProfile"]["string"] for d in devices)
    assert profiles == ["1g.10gb"] * 7 + ["3g.40gb"] * 2 + ["4g.40gb"], "every placement of the sold profiles"
    assert not [d for d in devices if "package" in d["attributes"]], "no software slice on a MIG card"
    one_g = next(d for d in devices if d["attributes"]["migProfile"]["string"] == "1g.10gb")
    assert one_g["attributes"]["productName"] == {"string": A100}
    assert one_g["capacity"]["memory"]["value"] in ("9728Mi", str(9728 * 1024 * 1024))

    # a 3g.40gb and a 1g.10gb claim, and a software half of the same model that the card cannot sell
    docs: list[dict[str, Any]] = []
    for name, package in (("big", "mig-3g"), ("small", "mig-1g"), ("soft", "a100-half")):
        docs += [claim_doc(name, namespace, package), pod_doc(name, namespace, name, node=mig_node)]
    apply_docs(cluster, docs)

    def allocated(name: str) -> dict[str, Any] | None:
        c = get_json(cluster, "resourceclaim", name, "-n", namespace)
        return c if c and (c.get("status") or {}).get("allocation") else None

    big = wait_for(lambda: allocated("big"), timeout=60, what="the 3g.40gb claim to be allocated")
    small = wait_for(lambda: allocated("small"), timeout=60, what="the 1g.10gb claim to be allocated")
    by_name = {d["name"]: d for d in devices}
    chosen = []
    for claim in (big, small):
        ((pool, dev),) = allocated_devices(claim)
        assert pool == mig_node
        attrs = by_name[dev]["attributes"]
        chosen.append((attrs["migPlacementStart"]["int"], attrs["migPlacementSize"]["int"]))
    (b0, bn), (s0, sn) = chosen
    assert bn == 4 and sn == 1
    assert s0 + sn <= b0 or b0 + bn <= s0, f"3g.40gb at {chosen[0]} and 1g.10gb at {chosen[1]} overlap"

    # the software claim is not allocated a MIG device, and its pod is told it does not fit (not a
    # CEL error from reading the MIG devices' missing package attribute)
    def soft_verdict() -> str | None:
        pod = get_json(cluster, "pod", "soft", "-n", namespace) or {}
        for cond in (pod.get("status") or {}).get("conditions") or []:
            if cond["type"] == "PodScheduled" and cond["status"] == "False" and cond.get("message"):
                return str(cond["message"])
        return None

    message = wait_for(soft_verdict, timeout=60, what="the software pod's scheduling verdict")
    assert "CEL" not in message and "runtime error" not in message, message
    assert allocated("soft") is None
    events = json.dumps(get_items(cluster, "events", "-n", namespace))
    assert "CEL runtime error" not in events


def test_a_4g_waits_while_a_1g_splits_its_only_placement_and_gets_it_when_that_frees(
    cluster: DevCluster, mig_node: str, namespace: str
) -> None:
    # 4g.40gb has one placement (memory slices 0-3); a 1g.10gb at slice 1 leaves 6 of 7 compute
    # slices and 7 of 8 memory slices free, yet no 4g fits: the counters model placements, not sums
    small = claim_doc("small", namespace, "mig-1g")
    (request,) = small["spec"]["devices"]["requests"]
    request["exactly"]["selectors"] = [
        {"cel": {"expression": 'device.attributes["gpuslice.io"].migPlacementStart == 1'}}
    ]
    apply_docs(cluster, [small, pod_doc("small", namespace, "small", node=mig_node)])
    wait_for(
        lambda: (
            (get_json(cluster, "resourceclaim", "small", "-n", namespace) or {})
            .get("status", {})
            .get("allocation")
        ),
        timeout=60,
        what="the 1g.10gb claim to be allocated",
    )
    apply_docs(
        cluster, [claim_doc("big", namespace, "mig-4g"), pod_doc("big", namespace, "big", node=mig_node)]
    )

    def unschedulable() -> str | None:
        pod = get_json(cluster, "pod", "big", "-n", namespace) or {}
        for cond in (pod.get("status") or {}).get("conditions") or []:
            if cond["type"] == "PodScheduled" and cond.get("reason") == "Unschedulable":
                return str(cond.get("message", ""))
        return None

    message = wait_for(unschedulable, timeout=60, what="the 4g.40gb pod to be found unschedulable")
    assert "claim" in message and "CEL" not in message, message
    assert (
        not (get_json(cluster, "resourceclaim", "big", "-n", namespace) or {})
        .get("status", {})
        .get("allocation")
    )

    # the 1g's pod and claim go: the 4g gets the card's only 4g placement
    cluster.kubectl("delete", "pod", "small", "-n", namespace, "--grace-period=0", "--force")
    cluster.kubectl("delete", "resourceclaim", "small", "-n", namespace)
    big = wait_for(
        lambda: (
            (get_json(cluster, "resourceclaim", "big", "-n", namespace) or {})
            .get("status", {})
            .get("allocation")
        ),
        timeout=90,
        what="the 4g.40gb claim to be allocated once the 1g.10gb is gone",
    )
    ((pool, dev),) = allocated_devices({"status": {"allocation": big}})
    by_name = {d["name"]: d for d in _devices(cluster, mig_node)}
    assert pool == mig_node and by_name[dev]["attributes"]["migProfile"] == {"string": "4g.40gb"}


@pytest.mark.parametrize("mig_node", [f"2x {A100}"], indirect=True)
def test_a_node_sells_mig_on_one_card_and_software_slices_on_the_other(
    cluster: DevCluster, mig_node: str, namespace: str
) -> None:
    devices = _devices(cluster, mig_node)
    on = {i: [d for d in devices if d["attributes"]["gpuIndex"]["int"] == i] for i in (0, 1)}
    assert all("migProfile" in d["attributes"] and "package" not in d["attributes"] for d in on[0])
    assert [d["attributes"]["package"]["string"] for d in on[1]] == ["a100-half", "a100-half"]
    docs: list[dict[str, Any]] = []
    for name, package in (("small", "mig-1g"), ("soft", "a100-half")):
        docs += [claim_doc(name, namespace, package), pod_doc(name, namespace, name, node=mig_node)]
    apply_docs(cluster, docs)
    got = {}
    for name in ("small", "soft"):
        claim = wait_for(
            lambda n=name: (
                (get_json(cluster, "resourceclaim", n, "-n", namespace) or {})
                .get("status", {})
                .get("allocation")
            ),
            timeout=60,
            what=f"claim {name} to be allocated",
        )
        ((_, got[name]),) = allocated_devices({"status": {"allocation": claim}})
    by_name = {d["name"]: d for d in devices}
    # the software class, evaluated on the MIG card's devices too, matched only the other card
    assert by_name[got["soft"]]["attributes"]["gpuIndex"] == {"int": 1}
    assert by_name[got["small"]]["attributes"]["gpuIndex"] == {"int": 0}
    assert by_name[got["small"]]["attributes"]["migProfile"] == {"string": "1g.10gb"}
