"""What an XID or an NVML probe means for a card, and the DRA device taint that says it."""

from __future__ import annotations

import pytest

from domain.test_views_status import (  # the status tests' builders
    facts,
    pod,
    unallocated_claim,
    unschedulable,
)
from gpuslice.domain import drains
from gpuslice.domain import health as h
from gpuslice.domain.capacity import Capacity
from gpuslice.domain.health import HEALTHY, CardHealth, Condition, Probe, XidClass
from gpuslice.domain.slice_status import Reason, slice_status
from gpuslice.domain.views import claim_view, pod_view
from support import allocated_claim

T0, T1, T2 = "2026-12-05T00:00:00Z", "2026-12-05T00:01:00Z", "2026-12-05T00:02:00Z"


def _taint(value: str, effect: str) -> dict[str, str]:
    return {"key": h.TAINT_KEY, "value": value, "effect": effect, "timeAdded": T0}


@pytest.mark.parametrize("xid", [48, 62, 64, 74, 79, 92, 94, 95, 119, 120])
def test_a_fatal_xid_takes_the_card_out_and_evicts(xid: int) -> None:
    assert h.classify(xid) is XidClass.FATAL
    after = h.after_xid(HEALTHY, xid, T0)
    assert after.condition is (Condition.LOST if xid == 79 else Condition.FAILED)
    assert h.taint(after) == _taint(f"xid-{xid}", "NoExecute")
    assert h.TAINT_KEY == "gpuslice.io/gpu-unhealthy"


@pytest.mark.parametrize("xid", [13, 31, 43, 45, 68, 109])
def test_an_application_xid_changes_nothing(xid: int) -> None:
    assert h.classify(xid) is XidClass.APPLICATION
    assert h.after_xid(HEALTHY, xid, T0) == HEALTHY
    assert h.taint(h.after_xid(HEALTHY, xid, T0)) is None


def test_an_unclassified_xid_changes_nothing() -> None:
    assert h.classify(999) is XidClass.UNCLASSIFIED
    assert h.after_xid(HEALTHY, 999, T0) == HEALTHY


def test_a_pending_remap_stops_new_slices_only_until_reset() -> None:
    assert h.classify(63) is XidClass.PENDING
    pending = h.after_xid(HEALTHY, 63, T0)
    assert h.taint(pending) == _taint("xid-63", "NoSchedule")
    still = h.after_probe(pending, Probe(pending=True), T1)
    assert still.condition is Condition.PENDING_REMAP and still.since == T0
    assert h.after_probe(still, Probe(), T2) == HEALTHY
    # seen by probing alone, without an event
    probed = h.after_probe(HEALTHY, Probe(pending=True), T0)
    assert h.taint(probed) == _taint("pending-remap", "NoSchedule")


def test_a_lost_card_is_healthy_once_it_answers_again() -> None:
    lost = h.after_probe(h.after_xid(HEALTHY, 79, T0), Probe(lost=True), T1)
    assert lost.condition is Condition.LOST and lost.since == T0 and lost.xid == 79
    assert h.after_probe(lost, Probe(), T2) == HEALTHY
    silently = h.after_probe(HEALTHY, Probe(lost=True), T0)
    assert h.taint(silently) == _taint("gpu-lost", "NoExecute")


def test_a_fatal_xid_nvml_cannot_show_holds_until_restart_one_it_shows_until_reset() -> None:
    nvlink = h.after_xid(HEALTHY, 74, T0)
    assert h.after_probe(nvlink, Probe(), T1) == nvlink, "nothing says it was reset"
    ecc = h.after_probe(h.after_xid(HEALTHY, 48, T0), Probe(pending=True), T1)
    assert ecc.condition is Condition.FAILED and ecc.visible
    assert h.after_probe(ecc, Probe(), T2) == HEALTHY, "the pending retirement is gone: reset"


def test_the_first_failure_stands_and_a_lost_card_says_lost() -> None:
    failed = h.after_xid(HEALTHY, 48, T0)
    assert h.after_xid(failed, 94, T1) == failed
    lost = h.after_xid(failed, 79, T1)
    assert (lost.condition, lost.xid, lost.since) == (Condition.LOST, 79, T0)
    assert h.after_xid(lost, 31, T2) == lost


def test_a_failed_remap_is_fatal() -> None:
    failed = h.after_probe(HEALTHY, Probe(remap_failed=True), T0)
    assert h.taint(failed) == _taint("row-remap-failure", "NoExecute")


def test_descriptions_say_what_happened_and_what_follows() -> None:
    assert h.describe(h.after_xid(HEALTHY, 79, T0)) == (
        "XID 79 (GPU has fallen off the bus); lost: its slices' pods are evicted (device taint NoExecute)"
    )
    assert "no new slices" in h.describe(CardHealth(Condition.PENDING_REMAP, None, T0))


def test_strongest_taint_effect() -> None:
    assert h.tainted_effect([{"effect": "NoSchedule"}, {"effect": "NoExecute"}]) == "NoExecute"
    assert h.tainted_effect([{"effect": "None"}]) is None
    assert h.tainted_effect(None) is None


def test_a_slice_on_a_failed_card_says_gpu_failed_with_the_xid_and_the_card() -> None:
    claim = claim_view(allocated_claim("ns", "s", "n0", "gpu-0-v100-8g-1", reserved_for=["p"]))
    running = pod_view(pod("p", claim="s", node=True, phase="Running"))
    uuids = {("n0", "gpu-0-v100-8g-1"): "GPU-abc"}
    healthy = slice_status(facts(claims=[claim], pods=[running], uuids=uuids), T1)
    assert h.SLICE_CONDITION not in {c.type for c in healthy.conditions}, "no condition while healthy"

    taints = {("n0", "gpu-0-v100-8g-1"): [_taint("xid-79", "NoExecute")]}
    st = slice_status(facts(claims=[claim], pods=[running], uuids=uuids, device_taints=taints), T1)
    [cond] = [c for c in st.conditions if c.type == h.SLICE_CONDITION]
    assert (cond.status, cond.reason) == ("False", "GpuFailed")
    assert cond.message.startswith("GPU GPU-abc on node n0 failed: XID 79 (GPU has fallen off the bus)")
    assert "evicts the pod" in cond.message and T0 in cond.message

    pending = {("n0", "gpu-0-v100-8g-1"): [_taint("xid-63", "NoSchedule")]}
    st = slice_status(facts(claims=[claim], pods=[running], uuids=uuids, device_taints=pending), T1)
    assert [c.reason for c in st.conditions if c.type == h.SLICE_CONDITION] == ["GpuPendingReset"]

    drain = {"key": "gpuslice.io/drain", "value": "x", "effect": "NoSchedule"}
    drained = {("n0", "gpu-0-v100-8g-1"): [drain]}
    st = slice_status(facts(claims=[claim], pods=[running], uuids=uuids, device_taints=drained), T1)
    assert [c.reason for c in st.conditions if c.type == h.SLICE_CONDITION] == ["GpuDraining"]


def test_a_slice_whose_only_matching_cards_are_unhealthy_says_so() -> None:
    p = pod_view(
        pod("p", claim="s", **unschedulable("0/1 nodes are available: 1 cannot allocate all claims."))
    )
    sick = Capacity(gpus=0, total=0, allocated=0, free=0, memory_per_slice_bytes=None, unhealthy_gpus=2)
    st = slice_status(facts(claims=[unallocated_claim()], pods=[p], capacity=sick), T0)
    assert st.reason == Reason.GPUS_UNHEALTHY
    assert (
        "the only GPU(s) of model 'Tesla V100-PCIE-32GB'" in st.message and "(2) are unhealthy" in st.message
    )
    some = Capacity(gpus=1, total=4, allocated=4, free=0, memory_per_slice_bytes=None, unhealthy_gpus=1)
    st = slice_status(facts(claims=[unallocated_claim()], pods=[p], capacity=some), T0)
    assert st.reason == Reason.GPUS_FULL and "1 more GPU(s) of the model are unhealthy" in st.message


def test_only_a_claim_on_a_noexecute_device_is_released() -> None:
    on_0 = claim_view(allocated_claim("ns", "s", "n0", "gpu-0-v100-8g-1", reserved_for=["p"]))
    failed = {("n0", "gpu-0-v100-8g-1"): [_taint("xid-79", "NoExecute")]}
    pending = {("n0", "gpu-0-v100-8g-1"): [_taint("xid-63", "NoSchedule")]}
    assert h.stranded_claims([on_0], failed) == ["s"]
    assert h.stranded_claims([on_0], pending) == [], "running work may finish on a card waiting for a reset"
    assert h.stranded_claims([on_0], {}) == []
    assert h.stranded_claims([unallocated_claim()], failed) == []


def test_drain_rules_select_the_pool_or_each_device_of_the_card() -> None:
    devices = [("gpu-0-a-0", "GPU-0"), ("gpu-0-a-1", "GPU-0"), ("gpu-1-a-0", "GPU-1")]
    [node] = drains.drain_rules("n0", devices, None, evict=False)
    assert node["kind"] == "DeviceTaintRule" and node["apiVersion"] == "resource.k8s.io/v1"
    assert node["spec"] == {
        "deviceSelector": {"driver": "gpuslice.io", "pool": "n0"},
        "taint": {"key": "gpuslice.io/drain", "value": "maintenance", "effect": "NoSchedule"},
    }
    card = drains.drain_rules("n0", devices, "GPU-0", evict=True)
    assert [r["spec"]["deviceSelector"]["device"] for r in card] == ["gpu-0-a-0", "gpu-0-a-1"]
    assert {r["spec"]["taint"]["effect"] for r in card} == {"NoExecute"}
    assert all(r["metadata"]["labels"][drains.LABEL_DRAIN_GPU] == "GPU-0" for r in card)
    assert len({r["metadata"]["name"] for r in card}) == 2


def test_a_lost_card_gets_the_same_taint_whichever_path_sees_it_first() -> None:
    # XID 79 arrives on the event thread; the NVML probe may see the card lost before it is delivered.
    xid_first = h.after_probe(h.after_xid(HEALTHY, 79, T0), Probe(lost=True), T1)
    probe_first = h.after_xid(h.after_probe(HEALTHY, Probe(lost=True), T0), 79, T1)
    assert h.taint(probe_first) == h.taint(xid_first) == _taint("xid-79", "NoExecute")
    assert probe_first.since == T0, "the eviction began when the card was first seen lost"


def _two_card_claim() -> dict[str, object]:
    """A claim of a 2-card product as the API server shows it: one result per whole card."""
    doc = allocated_claim("ns", "pair", "n0", "gpu-0-v100-x2", reserved_for=("p",))
    results = doc["status"]["allocation"]["devices"]["results"]
    results.append({**results[0], "device": "gpu-1-v100-x2"})
    return doc


def test_a_product_whose_second_card_fails_says_gpu_failed_naming_that_card() -> None:
    claim = claim_view(_two_card_claim())
    running = pod_view(pod("p", claim="pair", node=True, phase="Running"))
    uuids = {("n0", "gpu-0-v100-x2"): "GPU-first", ("n0", "gpu-1-v100-x2"): "GPU-second"}
    healthy = slice_status(facts(claims=[claim], pods=[running], uuids=uuids), T1)
    assert h.SLICE_CONDITION not in {c.type for c in healthy.conditions}

    taints = {("n0", "gpu-1-v100-x2"): [_taint("xid-79", "NoExecute")]}
    st = slice_status(facts(claims=[claim], pods=[running], uuids=uuids, device_taints=taints), T1)
    [cond] = [c for c in st.conditions if c.type == h.SLICE_CONDITION]
    assert (cond.status, cond.reason) == ("False", "GpuFailed")
    assert cond.message.startswith("GPU GPU-second on node n0 failed: XID 79 (GPU has fallen off the bus)")


def test_a_products_status_names_every_card_and_counts_them() -> None:
    claim = claim_view(_two_card_claim())
    running = pod_view(pod("p", claim="pair", node=True, phase="Running"))
    uuids = {("n0", "gpu-0-v100-x2"): "GPU-first", ("n0", "gpu-1-v100-x2"): "GPU-second"}
    st = slice_status(facts(claims=[claim], pods=[running], uuids=uuids), T1)
    assert (st.gpu_uuid, st.device, st.gpus) == ("GPU-first", "gpu-0-v100-x2", 2), "gpuUUID stays the first"
    assert st.gpu_uuids == ["GPU-first", "GPU-second"]
    [alloc] = st.allocations
    assert alloc.gpu_uuids == ["GPU-first", "GPU-second"]
    assert alloc.devices == ["gpu-0-v100-x2", "gpu-1-v100-x2"]
    wire = st.model_dump(by_alias=True, exclude_none=True)
    assert wire["gpuUUIDs"] == ["GPU-first", "GPU-second"] and wire["gpus"] == 2

    one = claim_view(allocated_claim("ns", "s", "n0", "gpu-0-v100-8g-1", reserved_for=("p",)))
    single = slice_status(facts(claims=[one], pods=[running], uuids={("n0", "gpu-0-v100-8g-1"): "GPU-a"}), T1)
    assert (single.gpus, single.gpu_uuids) == (1, ["GPU-a"])
