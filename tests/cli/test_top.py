"""`gpuslice top` puts each slice on its card, sums a card's memory and utilization, and sets each
namespace's slices held against its entitlement; the ResourceSlices are the agent's own builder's."""

from __future__ import annotations

from typing import Any

from gpuslice import constants as c
from gpuslice.agent.slices import Package, build_specs
from gpuslice.api.package import GpuPackageSpec
from gpuslice.top import Metrics, build, render
from support import V100, gpu

GIB = c.GIB
PKG = "v100-8g"


def resource_slices(
    node: str, cards: int, taints: dict[str, list[dict[str, Any]]] | None = None
) -> list[dict[str, Any]]:
    package = Package(PKG, GpuPackageSpec(gpuModel=V100, fraction=25))
    return [
        {"metadata": {"name": name}, "spec": spec}
        for name, spec in build_specs(node, [gpu(i) for i in range(cards)], [package], taints)
    ]


def uuid(i: int) -> str:
    return gpu(i).uuid


def gpuslice(
    name: str, ns: str = "team-a", phase: str = "InUse", card: int | None = 0, k: int = 0, **status: Any
) -> dict[str, Any]:
    st: dict[str, Any] = {"phase": phase, **status}
    if card is not None:
        device = f"gpu-{card}-{PKG}-{k}"
        st["allocations"] = [
            {"claim": name, "node": "n1", "pool": "n1", "gpuUUID": uuid(card), "device": device}
        ]
    return {"metadata": {"namespace": ns, "name": name}, "spec": {"package": PKG}, "status": st}


def quota(ns: str, hard: int, used: int) -> dict[str, Any]:
    key = c.quota_key(PKG)
    return {
        "metadata": {"namespace": ns, "name": c.QUOTA_NAME},
        "status": {"hard": {key: str(hard)}, "used": {key: str(used)}},
    }


def test_each_card_is_listed_with_its_slices_memory_and_summed_utilization() -> None:
    slices = [
        gpuslice("a", usage={"memoryUsedBytes": 3 * GIB, "computeUtilizationPercent": 30.0}),
        gpuslice("b", k=1, usage={"memoryUsedBytes": 1 * GIB, "computeUtilizationPercent": 25.0}),
        gpuslice("w", phase="Pending", card=None, reason="AllGpusFull"),
    ]
    package = {
        "metadata": {"name": PKG},
        "status": {"capacity": {"gpus": 2, "slicesTotal": 8, "slicesAllocated": 2, "slicesFree": 6}},
    }
    view = build(slices, [quota("team-a", 4, 2)], resource_slices("n1", 2), [package])
    assert view.cards is not None
    first, second = view.cards
    assert (first.gpu_uuid, first.model, first.slices, first.healthy) == (uuid(0), V100, 2, True)
    assert first.memory_total_bytes == gpu(0).memory_bytes
    assert first.memory_held_bytes == 2 * (gpu(0).memory_bytes // 4)
    assert first.memory_used_bytes == 4 * GIB
    assert first.utilization == 0.55
    # a card that holds no slice is still a card people want to see
    assert (second.gpu_uuid, second.slices, second.memory_used_bytes, second.utilization) == (
        uuid(1),
        0,
        None,
        None,
    )
    (ns,) = view.namespaces
    assert (ns.namespace, ns.package, ns.held, ns.entitled, ns.phases) == (
        "team-a",
        PKG,
        2,
        4,
        {"InUse": 2, "Pending": 1},
    )
    assert view.packages is not None
    assert [(p.package, p.gpus, p.total, p.allocated, p.free) for p in view.packages] == [(PKG, 2, 8, 2, 6)]
    text = render(view)
    assert "Pending (AllGpusFull)" in text
    assert "4.0Gi" in text and "55%" in text


def test_a_tainted_card_and_a_card_prometheus_says_is_unhealthy_are_shown_unhealthy() -> None:
    taint = {"key": "gpuslice.io/gpu-unhealthy", "value": "Xid79", "effect": "NoExecute"}
    view = build([], [], resource_slices("n1", 2, {uuid(0): [taint]}), [])
    assert view.cards is not None
    assert [k.healthy for k in view.cards] == [False, True]
    view = build([], [], resource_slices("n1", 2), [], Metrics(healthy={("n1", uuid(1)): 0.0}))
    assert view.cards is not None
    assert [k.healthy for k in view.cards] == [True, False]
    assert "UNHEALTHY" in render(view)


def test_metrics_replace_the_status_reading_and_give_a_template_slices_pods_theirs() -> None:
    template = gpuslice("t", usage={"memoryUsedBytes": 9 * GIB})
    template["status"]["allocations"].append(
        {
            "claim": "t-2",
            "node": "n1",
            "pool": "n1",
            "gpuUUID": uuid(1),
            "device": f"gpu-1-{PKG}-0",
            "pod": "p2",
        }
    )
    status_only = build([template], [], resource_slices("n1", 2), [])
    # one usage per GpuSlice in its status: not shown for either pod of a template
    assert [r.memory_used_bytes for r in status_only.slices] == [None, None]
    metrics = Metrics(memory_used={("team-a", "t", uuid(0)): 2.0 * GIB, ("team-a", "t", uuid(1)): 5.0 * GIB})
    view = build([template], [], resource_slices("n1", 2), [], metrics)
    assert [(r.gpu_uuid, r.memory_used_bytes, r.source) for r in view.slices] == [
        (uuid(0), 2 * GIB, "metrics"),
        (uuid(1), 5 * GIB, "metrics"),
    ]
    # one GpuSlice in the namespace's count, its two pods' memory summed
    (ns,) = view.namespaces
    assert (ns.phases, ns.memory_used_bytes) == ({"InUse": 1}, 7 * GIB)


def test_without_resourceslices_a_tenant_sees_its_slices_and_quota_and_is_told_why_no_cards() -> None:
    view = build([gpuslice("a")], [quota("team-a", 2, 1)], None, None)
    assert view.cards is None and view.packages is None
    (row,) = view.slices
    assert (row.namespace, row.slice, row.gpu_uuid) == ("team-a", "a", uuid(0))
    text = render(view)
    assert "no card view" in text
    assert text.splitlines()[0].startswith("NAMESPACE")  # no card table above the slices
