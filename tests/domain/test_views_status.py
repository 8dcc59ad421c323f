"""Why a GpuSlice waits, and what it says when it does not: status from the cluster's own objects."""

from __future__ import annotations

from typing import Any

from gpuslice import constants as c
from gpuslice.api.slice import GpuSliceStatus, Phase
from gpuslice.domain.capacity import Capacity
from gpuslice.domain.ownership import owner_reference
from gpuslice.domain.slice_status import Reason, SliceFacts, slice_status
from gpuslice.domain.views import claim_view, pod_view, quota_view, uses_gpuslice, workload_view
from support import allocated_claim

NOW = "2026-12-02T12:00:00Z"
KEY = c.quota_key("v100-8g")
ROOMY = Capacity(gpus=2, total=8, allocated=1, free=7, memory_per_slice_bytes=8 * c.GIB)


def pod(name: str, claim: str | None = None, template: str | None = None, **status: Any) -> dict[str, Any]:
    ref: dict[str, str] = {"name": "gpu"}
    if claim:
        ref["resourceClaimName"] = claim
    if template:
        ref["resourceClaimTemplateName"] = template
    spec: dict[str, Any] = {"resourceClaims": [ref], "containers": [{"name": "c"}]}
    if status.pop("node", None):
        spec["nodeName"] = "n0"
    return {
        "metadata": {"namespace": "ns", "name": name},
        "spec": spec,
        "status": {"phase": "Pending", **status},
    }


def unschedulable(msg: str) -> dict[str, Any]:
    return {
        "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": msg}]
    }


def _no_gpu_for_claim_s() -> Any:
    """Pod p of claim s, left Pending by kube-scheduler: no GPU can take the claim."""
    return pod_view(
        pod("p", claim="s", **unschedulable("0/3 nodes are available: 3 cannot allocate all claims."))
    )


def quota(used: int, hard: int, name: str = "gpuslice") -> Any:
    return quota_view(
        {
            "metadata": {"namespace": "ns", "name": name, "labels": {c.LABEL_MANAGED_BY: "gpuslice"}},
            "spec": {"hard": {KEY: str(hard)}},
            "status": {"hard": {KEY: str(hard)}, "used": {KEY: str(used)}},
        }
    )


def facts(**kw: Any) -> SliceFacts:
    base: dict[str, Any] = dict(
        namespace="ns",
        name="s",
        package="v100-8g",
        template=False,
        generation=1,
        package_found=True,
        gpu_model="Tesla V100-PCIE-32GB",
        claims=[],
        pods=[],
        quotas=[quota(1, 2)],
        workloads=[],
        capacity=ROOMY,
    )
    base.update(kw)
    return SliceFacts(**base)


def unallocated_claim(name: str = "s") -> Any:
    return claim_view({"metadata": {"namespace": "ns", "name": name}, "spec": {}, "status": {}})


def test_missing_package_fails_and_says_how_to_fix_it() -> None:
    st = slice_status(facts(package_found=False), NOW)
    assert st.phase == Phase.FAILED and st.reason == Reason.PACKAGE_NOT_FOUND
    assert "kubectl get gpupackages" in st.message


def test_quota_refusal_says_x_of_y() -> None:
    st = slice_status(
        facts(
            quotas=[quota(2, 2)],
            create_error='resourceclaims "s" is forbidden: exceeded quota: gpuslice, requested: ...=1, '
            "used: ...=2, limited: ...=2",
        ),
        NOW,
    )
    assert st.phase == Phase.PENDING and st.reason == Reason.QUOTA_EXCEEDED
    assert "2 of 2 v100-8g slices" in st.message
    assert st.quota is not None and (st.quota.used, st.quota.hard, st.quota.quota) == (2, 2, "gpuslice")


def test_a_quota_counting_more_than_the_namespace_holds_says_it_recounts_by_itself() -> None:
    """Kubernetes charged a create that failed: the advice to delete a slice would be wrong."""
    refused = 'resourceclaims "s" is forbidden: exceeded quota: gpuslice, requested: ...=1, used: ...=2'
    st = slice_status(facts(quotas=[quota(2, 2)], create_error=refused, held=[package_claim("a")]), NOW)
    assert st.reason == Reason.QUOTA_EXCEEDED
    assert "counts 2 of 2 v100-8g slices used, but namespace ns holds 1 of them" in st.message
    assert "recounts" in st.message and "delete a GpuSlice" not in st.message
    held = [package_claim("a"), package_claim("b")]
    st = slice_status(facts(quotas=[quota(2, 2)], create_error=refused, held=held), NOW)
    assert "delete a GpuSlice or workload you no longer need" in st.message


def package_claim(name: str, deleting: bool = False, pods: tuple[str, ...] = ()) -> Any:
    meta: dict[str, Any] = {"namespace": "ns", "name": name, "labels": {c.LABEL_PACKAGE: "v100-8g"}}
    if deleting:
        meta["deletionTimestamp"] = NOW
    status = {"reservedFor": [{"resource": "pods", "name": p, "uid": p} for p in pods]}
    return claim_view({"metadata": meta, "spec": {}, "status": status})


def test_a_quota_held_by_a_deleted_slices_stopping_pod_names_the_pod_and_says_it_goes_on_by_itself() -> None:
    """Delete a slice and create another at once: the old claim counts until its pod has stopped
    (its grace period). Neither "recounts in 5 minutes" nor "delete a GpuSlice" is the right word."""
    refused = 'resourceclaims "s" is forbidden: exceeded quota: gpuslice, requested: ...=1, used: ...=2'
    held = [package_claim("a"), package_claim("old", deleting=True, pods=("trainer-0",))]
    st = slice_status(facts(quotas=[quota(2, 2)], create_error=refused, held=held), NOW)
    assert st.reason == Reason.QUOTA_EXCEEDED
    assert "claim old (being deleted) counts until pod trainer-0 has stopped" in st.message
    assert "by itself" in st.message
    assert "recounts" not in st.message and "delete a GpuSlice" not in st.message


def test_zero_quota_means_not_entitled() -> None:
    st = slice_status(facts(quotas=[quota(0, 0)], create_error="exceeded quota: gpuslice"), NOW)
    assert st.reason == Reason.NOT_ENTITLED and "ask the platform team" in st.message


def test_admission_refusal_fails_with_the_api_servers_words() -> None:
    st = slice_status(facts(create_error="this namespace holds no gpuslice entitlement"), NOW)
    assert st.phase == Phase.FAILED and st.reason == Reason.CLAIM_REJECTED
    assert "holds no gpuslice entitlement" in st.message


def test_claim_without_pod_waits_for_one_and_shows_how_to_use_it() -> None:
    st = slice_status(facts(claims=[unallocated_claim()]), NOW)
    assert st.phase == Phase.PENDING and st.reason == Reason.WAITING_FOR_POD
    assert "resourceClaimName: s" in st.message
    assert {c.type: c.status for c in st.conditions} == {
        "Ready": "True",
        "ClaimReady": "True",
        "Allocated": "False",
        "InUse": "False",
    }


def test_no_gpu_of_the_model_is_named() -> None:
    p = _no_gpu_for_claim_s()
    empty = Capacity(gpus=0, total=0, allocated=0, free=0, memory_per_slice_bytes=None)
    st = slice_status(facts(claims=[unallocated_claim()], pods=[p], capacity=empty), NOW)
    assert (
        st.reason == Reason.NO_MATCHING_GPU and "Tesla V100-PCIE-32GB" in st.message and "pod p" in st.message
    )


def test_all_gpus_full_says_entitlement_is_not_a_reservation() -> None:
    p = _no_gpu_for_claim_s()
    full = Capacity(gpus=2, total=8, allocated=8, free=0, memory_per_slice_bytes=8 * c.GIB)
    st = slice_status(facts(claims=[unallocated_claim()], pods=[p], capacity=full), NOW)
    assert st.reason == Reason.GPUS_FULL
    assert "all 8 v100-8g slices on 2 GPU(s)" in st.message and "not a reservation" in st.message


def test_a_slice_waiting_for_capacity_records_the_count_it_was_decided_on() -> None:
    p = _no_gpu_for_claim_s()
    full = Capacity(gpus=1, total=2, allocated=0, free=0, memory_per_slice_bytes=16 * c.GIB)
    waiting = slice_status(facts(claims=[unallocated_claim()], pods=[p], capacity=full), NOW)
    assert waiting.reason == Reason.GPUS_FULL
    assert waiting.model_dump(by_alias=True, mode="json")["capacity"] == {
        "gpus": 1,
        "slicesTotal": 2,
        "slicesFree": 0,
    }
    # Only a verdict made on capacity carries it: nothing to rewrite in every other slice.
    ready = slice_status(facts(claims=[unallocated_claim()], capacity=full), NOW)
    assert ready.capacity is None


def health(st: GpuSliceStatus) -> dict[str, tuple[str, str, int | None]]:
    return {
        cd.type: (cd.status, cd.reason, cd.observed_generation)
        for cd in st.conditions
        if cd.type in ("Ready", "Reconciling", "Stalled")
    }


def test_ready_follows_kstatus_ready_reconciling_or_stalled() -> None:
    waiting_pod = _no_gpu_for_claim_s()
    full = Capacity(gpus=2, total=8, allocated=8, free=0, memory_per_slice_bytes=8 * c.GIB)
    allocated = claim_view(allocated_claim("ns", "s", "n0", "d", reserved_for=[]))
    cases = {
        "usable, no pod yet": (facts(claims=[unallocated_claim()], generation=3), "Ready"),
        "allocated": (facts(claims=[allocated], generation=3), "Ready"),
        "claim being made": (facts(generation=3), "Reconciling"),
        "every GPU full: starts by itself": (
            facts(claims=[unallocated_claim()], pods=[waiting_pod], capacity=full, generation=3),
            "Reconciling",
        ),
        "quota used up: someone must act": (
            facts(create_error="exceeded quota: gpuslice", quotas=[quota(2, 2)], generation=3),
            "Stalled",
        ),
        "no such package": (facts(package_found=False, generation=3), "Stalled"),
    }
    for what, (f, want) in cases.items():
        st = slice_status(f, NOW)
        got = health(st)
        if want == "Ready":
            assert got == {"Ready": ("True", st.reason, 3)}, what
        else:
            assert got == {"Ready": ("False", st.reason, 3), want: ("True", st.reason, 3)}, what
        assert st.observed_generation == 3, what


def test_other_scheduling_failures_pass_the_schedulers_message_through() -> None:
    p = pod_view(pod("p", claim="s", **unschedulable("0/3 nodes are available: 3 Insufficient cpu.")))
    st = slice_status(facts(claims=[unallocated_claim()], pods=[p]), NOW)
    assert st.reason == Reason.UNSCHEDULABLE and "3 Insufficient cpu" in st.message


def test_pod_blocked_by_the_namespaces_cpu_quota_is_reported() -> None:
    rs = workload_view(
        {
            "kind": "ReplicaSet",
            "metadata": {"namespace": "ns", "name": "web-1"},
            "spec": {"template": {"spec": {"resourceClaims": [{"name": "gpu", "resourceClaimName": "s"}]}}},
            "status": {
                "conditions": [
                    {
                        "type": "ReplicaFailure",
                        "status": "True",
                        "reason": "FailedCreate",
                        "message": 'pods "web-1-x" is forbidden: exceeded quota: compute, '
                        "requested: cpu=2, used: cpu=4, limited: cpu=4",
                    }
                ]
            },
        }
    )
    assert rs is not None
    st = slice_status(facts(claims=[unallocated_claim()], workloads=[rs]), NOW)
    assert st.phase == Phase.PENDING and st.reason == Reason.POD_BLOCKED_BY_QUOTA
    assert "ReplicaSet web-1" in st.message and "used: cpu=4, limited: cpu=4" in st.message


def test_allocation_then_use_then_release() -> None:
    claim = claim_view(allocated_claim("ns", "s", "n0", "gpu-0-v100-8g-1", reserved_for=["p"]))
    uuids = {("n0", "gpu-0-v100-8g-1"): "GPU-abc"}
    starting = pod_view(pod("p", claim="s", node=True))
    st = slice_status(facts(claims=[claim], pods=[starting], uuids=uuids), NOW)
    assert st.phase == Phase.ALLOCATED and (st.node, st.gpu_uuid, st.device) == (
        "n0",
        "GPU-abc",
        "gpu-0-v100-8g-1",
    )
    running = pod_view(pod("p", claim="s", node=True, phase="Running"))
    st2 = slice_status(facts(claims=[claim], pods=[running], uuids=uuids, previous=st), NOW)
    assert st2.phase == Phase.IN_USE and "pod p on node n0" in st2.message
    st3 = slice_status(facts(claims=[unallocated_claim()], previous=st2), NOW)
    assert st3.phase == Phase.RELEASED and st3.node is None


def test_condition_times_change_only_on_flips() -> None:
    first = slice_status(facts(claims=[unallocated_claim()]), "2026-01-01T00:00:00Z")
    again = slice_status(facts(claims=[unallocated_claim()], previous=first), "2026-01-01T00:05:00Z")
    assert [c.last_transition_time for c in again.conditions] == ["2026-01-01T00:00:00Z"] * 4
    claim = claim_view(allocated_claim("ns", "s", "n0", "d", reserved_for=[]))
    flipped = slice_status(facts(claims=[claim], previous=again), "2026-01-01T00:09:00Z")
    times = {c.type: c.last_transition_time for c in flipped.conditions}
    assert times == {
        "Ready": "2026-01-01T00:00:00Z",
        "ClaimReady": "2026-01-01T00:00:00Z",
        "Allocated": "2026-01-01T00:09:00Z",
        "InUse": "2026-01-01T00:00:00Z",
        "MemoryIsolated": "2026-01-01T00:09:00Z",
        "SoftwareCompatible": "2026-01-01T00:09:00Z",
        "GpuIdle": "2026-01-01T00:09:00Z",
    }


def test_a_shim_bypass_the_agent_found_shows_as_a_condition() -> None:
    claim = claim_view(allocated_claim("ns", "s", "n0", "gpu-0-v100-8g-1", reserved_for=["p"]))
    running = pod_view(pod("p", claim="s", node=True, phase="Running"))
    clean = slice_status(facts(claims=[claim], pods=[running]), NOW)
    assert {c.type: c.status for c in clean.conditions}["MemoryIsolated"] == "True"
    found = "process 42 holds 20480 MiB on GPU GPU-abc, more than any slice on it allows (8192 MiB)"
    st = slice_status(facts(claims=[claim], pods=[running], memory_violation=found, previous=clean), NOW)
    cond = {c.type: c for c in st.conditions}["MemoryIsolated"]
    assert (cond.status, cond.reason, cond.message) == ("False", "ShimBypassed", found)
    assert st.phase == Phase.IN_USE


def test_template_slice_counts_each_pod() -> None:
    a = claim_view(allocated_claim("ns", "w-a-gpu", "n0", "d0", reserved_for=["w-a"]))
    pa = pod_view(
        pod(
            "w-a",
            template="w",
            node=True,
            phase="Running",
            resourceClaimStatuses=[{"name": "gpu", "resourceClaimName": "w-a-gpu"}],
        )
    )
    pb = pod_view(pod("w-b", template="w", **unschedulable("waiting for resource claim")))
    st = slice_status(facts(name="w", template=True, claims=[a], pods=[pa, pb], quotas=[quota(2, 2)]), NOW)
    assert st.phase == Phase.PENDING and st.reason == Reason.QUOTA_EXCEEDED
    assert st.message.startswith("1 of 2 pods wait; quota used up")
    assert st.claim_template_name == "w" and st.claim_name is None
    assert [x.claim for x in st.allocations] == ["w-a-gpu"]
    st2 = slice_status(facts(name="w", template=True, claims=[a], pods=[pa]), NOW)
    assert st2.phase == Phase.IN_USE


def test_views_read_what_they_need() -> None:
    p = pod_view(pod("p", template="w", resourceClaimStatuses=[{"name": "gpu", "resourceClaimName": "gen"}]))
    assert p is not None and p.claims == {"gpu": "gen"} and p.templates == {"gpu": "w"}
    assert pod_view({"metadata": {}, "spec": {"containers": []}, "status": {}}) is None
    assert uses_gpuslice(
        {
            "spec": {
                "devices": {
                    "requests": [{"name": "x", "firstAvailable": [{"deviceClassName": "a.gpuslice.io"}]}]
                }
            }
        }
    )
    assert not uses_gpuslice(
        {"spec": {"devices": {"requests": [{"name": "x", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}}}
    )
    q = quota(3, 4)
    assert q.usage(KEY) == (3, 4) and q.usage("cpu") is None


def test_status_round_trips_through_the_api_shape() -> None:
    st = slice_status(facts(claims=[unallocated_claim()]), NOW)
    dumped = st.model_dump(by_alias=True, exclude_none=True, mode="json")
    assert dumped["phase"] == "Pending" and dumped["claimName"] == "s"
    assert GpuSliceStatus.model_validate(dumped) == st


def test_a_claim_left_by_a_deleted_slice_of_the_same_name_is_not_the_new_slices() -> None:
    """A GpuSlice deleted and re-created under its name: until the garbage collector has deleted the
    old slice's claim (its owner reference names the old uid), a pod may still hold that claim. It is
    not the new slice's: no allocation, no MemoryIsolated, and the slice says what it waits for."""
    body = allocated_claim("ns", "s", "n0", "gpu-0-v100-8g-1", reserved_for=["p"])
    body["metadata"]["ownerReferences"] = [owner_reference(c.SLICE_KIND, "s", "old-uid")]
    body["metadata"]["deletionTimestamp"] = "2026-12-02T11:59:59Z"
    old = claim_view(body)
    running = pod_view(pod("p", claim="s", node=True, phase="Running"))
    uuids = {("n0", "gpu-0-v100-8g-1"): "GPU-abc"}
    st = slice_status(facts(uid="new-uid", claims=[old], pods=[running], uuids=uuids), NOW)
    assert (st.phase, st.reason) == (Phase.PENDING, Reason.CREATING_CLAIM)
    assert "ResourceClaim s belongs to a deleted GpuSlice s" in st.message and "pod p holds it" in st.message
    assert st.allocations == [] and st.gpu_uuid is None
    conds = {cd.type: cd.status for cd in st.conditions}
    assert "MemoryIsolated" not in conds and conds["ClaimReady"] == "False" and conds["InUse"] == "False"
    # its own claim (the owner reference names this slice's uid) is its claim, as before
    body["metadata"]["ownerReferences"] = [owner_reference(c.SLICE_KIND, "s", "new-uid")]
    del body["metadata"]["deletionTimestamp"]
    mine = slice_status(facts(uid="new-uid", claims=[claim_view(body)], pods=[running], uuids=uuids), NOW)
    assert mine.phase == Phase.IN_USE and mine.gpu_uuid == "GPU-abc"
    assert {cd.type: cd.status for cd in mine.conditions}["MemoryIsolated"] == "True"


# --- a pod that asks for the product in resources.limits (its slice is the operator's, spec.pod) ---


def product_pod(name: str = "p", claim: str | None = None, **status: Any) -> dict[str, Any]:
    """A pod with `resources.limits: {gpuslice.io/v100-8g: 1}`; `claim`: kube-scheduler's claim for it."""
    spec: dict[str, Any] = {
        "containers": [
            {"name": "main", "resources": {"limits": {"gpuslice.io/v100-8g": "1", "memory": "1Gi"}}}
        ]
    }
    if status.pop("node", None):
        spec["nodeName"] = "n0"
    if claim:
        status["extendedResourceClaimStatus"] = {"resourceClaimName": claim, "requestMappings": []}
    return {
        "metadata": {"namespace": "ns", "name": name, "uid": "pod-uid"},
        "spec": spec,
        "status": {"phase": "Pending", **status},
    }


def test_a_pod_asking_for_a_product_is_viewed_with_the_schedulers_claim() -> None:
    p = pod_view(product_pod(claim="p-extended-resources-x"))
    assert (
        p is not None and p.product == "gpuslice.io/v100-8g" and p.extended_claim == "p-extended-resources-x"
    )
    assert p.uid == "pod-uid" and p.claims == {}
    unscheduled = pod_view(product_pod())
    assert unscheduled is not None and unscheduled.extended_claim is None


def test_a_pods_slice_waits_on_the_scheduler_and_says_why() -> None:
    full = Capacity(gpus=2, total=8, allocated=8, free=0, memory_per_slice_bytes=8 * c.GIB)
    waiting = pod_view(product_pod(**unschedulable("0/1 nodes are available: cannot allocate all claims.")))
    st = slice_status(facts(name="p", pod="p", pods=[waiting], capacity=full), NOW)
    assert st.phase == Phase.PENDING and st.reason == Reason.GPUS_FULL and "pod p waits" in st.message
    assert st.claim_name is None
    scheduling = slice_status(facts(name="p", pod="p", pods=[pod_view(product_pod())]), NOW)
    assert scheduling.reason == Reason.SCHEDULING and "kube-scheduler makes its claim" in scheduling.message
    refused = pod_view(
        product_pod(
            **unschedulable('resourceclaims "p-extended-resources-x" is forbidden: exceeded quota: gpuslice')
        )
    )
    st = slice_status(facts(name="p", pod="p", pods=[refused], quotas=[quota(2, 2)]), NOW)
    assert st.reason == Reason.QUOTA_EXCEEDED and "2 of 2 v100-8g slices" in st.message


def test_a_pods_slice_is_in_use_through_the_schedulers_claim() -> None:
    claim = claim_view(allocated_claim("ns", "p-extended-resources-x", "n0", "gpu-0-v100-8g-0", ("p",)))
    running = pod_view(product_pod(claim="p-extended-resources-x", node=True, phase="Running"))
    st = slice_status(facts(name="p", pod="p", pods=[running], claims=[claim]), NOW)
    assert st.phase == Phase.IN_USE and st.claim_name == "p-extended-resources-x"
    assert st.allocations[0].pod == "p" and st.allocations[0].device == "gpu-0-v100-8g-0"
    ready = {cd.type: cd.message for cd in st.conditions}["ClaimReady"]
    assert ready == "ResourceClaim p-extended-resources-x exists"
    gone = slice_status(facts(name="p", pod="p", pods=[], claims=[claim]), NOW)
    assert gone.phase == Phase.RELEASED and "deleted with it" in gone.message


def test_a_claim_is_of_its_package_by_label_or_for_kube_schedulers_claim_by_its_class() -> None:
    """Both forms count in one quota: the quota messages must count both."""
    assert package_claim("a").package == "v100-8g"
    requests = [{"name": "gpu", "exactly": {"deviceClassName": c.device_class_name("v100-8g")}}]
    scheduler_made = {
        "metadata": {"namespace": "ns", "name": "p-gpu-x"},
        "spec": {"devices": {"requests": requests}},
    }
    assert claim_view(scheduler_made).package == "v100-8g"
    other = {"metadata": {"namespace": "ns", "name": "o"}, "spec": {"devices": {"requests": [{"name": "x"}]}}}
    assert claim_view(other).package is None
