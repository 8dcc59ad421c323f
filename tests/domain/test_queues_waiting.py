"""A slice whose pod Kueue holds waits Queued: Kueue's reason and the pod's place in its queue, read
from the namespace's Workloads as Kueue writes them (v1beta2)."""

from __future__ import annotations

from typing import Any

from gpuslice import constants as c
from gpuslice.api.slice import Phase
from gpuslice.domain.queues import kueue_wait
from gpuslice.domain.slice_status import Reason, slice_status
from gpuslice.domain.views import pod_view
from gpuslice.explain import explain

from .test_views_status import NOW, facts, pod, product_pod, unallocated_claim

NO_QUOTA = (
    "couldn't assign flavors to pod set main: insufficient unused quota for gpuslice.io/v100-8g in "
    "flavor gpuslice-tesla-v100-pcie-32gb, 1 more needed"
)


def workload(
    name: str,
    pod_uid: str,
    created: str,
    *,
    queue: str = "gpuslice-v100-8g",
    priority: int = 0,
    reserved: bool = False,
    message: str = NO_QUOTA,
) -> dict[str, Any]:
    conditions = [
        {
            "type": "QuotaReserved",
            "status": "True" if reserved else "False",
            "reason": "QuotaReserved" if reserved else "Pending",
            "message": "Quota reserved in ClusterQueue cq" if reserved else message,
        }
    ]
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "creationTimestamp": created,
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": name, "uid": pod_uid}],
        },
        "spec": {"queueName": queue, "priority": priority, "active": True},
        "status": {"conditions": conditions},
    }


def gated(view: dict[str, Any], uid: str) -> dict[str, Any]:
    view["metadata"]["uid"] = uid
    view["spec"]["schedulingGates"] = [{"name": c.KUEUE_ADMISSION_GATE}]
    view["status"]["conditions"] = [
        {
            "type": "PodScheduled",
            "status": "False",
            "reason": "SchedulingGated",
            "message": "Scheduling is blocked due to non-empty scheduling gates",
        }
    ]
    return view


WORKLOADS = [
    workload("pod-running", "u0", "2026-12-07T10:00:00Z", reserved=True),
    workload("pod-first", "u1", "2026-12-07T10:00:01Z"),
    workload("pod-mine", "u2", "2026-12-07T10:00:02Z"),
    workload("pod-later", "u3", "2026-12-07T10:00:03Z"),
    workload("pod-other-queue", "u4", "2026-12-07T09:00:00Z", queue="someone-elses"),
]


def test_the_place_is_among_the_queues_pending_workloads_oldest_first() -> None:
    wait = kueue_wait("u2", WORKLOADS)
    assert wait is not None
    # the admitted one and another queue's do not count; one older pending is ahead
    assert (wait.workload, wait.local_queue, wait.position, wait.pending) == (
        "pod-mine",
        "gpuslice-v100-8g",
        2,
        3,
    )
    assert wait.message == NO_QUOTA


def test_a_higher_priority_goes_first_whatever_its_age() -> None:
    urgent = workload("pod-urgent", "u9", "2026-12-07T11:00:00Z", priority=100)
    wait = kueue_wait("u2", [*WORKLOADS, urgent])
    assert wait is not None and (wait.position, wait.pending) == (3, 4)
    first = kueue_wait("u9", [*WORKLOADS, urgent])
    assert first is not None and first.position == 1


def test_no_wait_when_admitted_or_when_kueue_has_no_workload_for_the_pod_yet() -> None:
    assert kueue_wait("u0", WORKLOADS) is None
    assert kueue_wait("nobody", WORKLOADS) is None


def test_a_pod_form_slice_kueue_holds_is_queued_with_kueues_reason_and_place() -> None:
    p = pod_view(gated(product_pod(), "u2"))
    assert p is not None
    wait = kueue_wait("u2", WORKLOADS)
    assert wait is not None
    st = slice_status(facts(name="p", pod="p", pods=[p], queued={"p": wait}), NOW)
    assert (st.phase, st.reason) == (Phase.PENDING, Reason.QUEUED)
    assert st.message == (
        "pod p waits in Kueue's queue gpuslice-v100-8g: 2nd of 3 pending (Workload pod-mine); "
        f"Kueue: {NO_QUOTA}"
    )
    assert st.queue is not None and (st.queue.position, st.queue.pending) == (2, 3)
    # what the scheduler says of a gated pod is not the reason
    assert "SchedulingGated" not in st.message and "non-empty" not in st.message
    shown = explain(
        {
            "metadata": {"namespace": "ns", "name": "p"},
            "spec": {"package": "v100-8g"},
            "status": st.model_dump(by_alias=True, exclude_none=True, mode="json"),
        },
        None,
    )
    assert "state:    Pending (Queued)" in shown
    where = "queue:    position 2 of 3 pending in Kueue's LocalQueue gpuslice-v100-8g (Workload pod-mine)"
    assert where in shown
    assert "Kueue admits the pod when its queue has quota" in shown


def test_a_gated_pod_without_its_workload_yet_is_queued_too_and_a_claim_forms_pod_likewise() -> None:
    p = pod_view(gated(product_pod(), "u7"))
    st = slice_status(facts(name="p", pod="p", pods=[p]), NOW)
    assert st.reason == Reason.QUEUED and "Kueue has not queued its Workload yet" in st.message
    assert st.queue is None
    # the claim form: a pod of the slice's claim that Kueue holds
    q = pod_view(gated(pod("q", claim="s"), "u2"))
    wait = kueue_wait("u2", WORKLOADS)
    assert q is not None and wait is not None
    st = slice_status(facts(claims=[unallocated_claim()], pods=[q], queued={"q": wait}), NOW)
    assert st.reason == Reason.QUEUED and st.message.startswith("pod q waits in Kueue's queue")


def test_once_kueue_lifts_its_gate_the_slice_is_scheduled_as_before() -> None:
    p = pod_view(product_pod())
    st = slice_status(facts(name="p", pod="p", pods=[p]), NOW)
    assert st.reason == Reason.SCHEDULING and st.queue is None
