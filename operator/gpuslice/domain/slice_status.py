"""GpuSlice status from the cluster's own objects: phase, conditions and why a slice waits.

Inputs are the views in `views` plus package capacity; the result is the complete status. The
operator writes it only when it differs from what the object already shows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from gpuslice import constants as c
from gpuslice.api.package import Condition
from gpuslice.api.refusal import is_quota_refusal
from gpuslice.api.slice import CapacitySeen, GpuSliceStatus, Phase, QueuePosition, QuotaUsage, SliceAllocation
from gpuslice.domain.capacity import Capacity
from gpuslice.domain.claims import pod_claim_snippet
from gpuslice.domain.conditions import Health, health_conditions, stamp
from gpuslice.domain.health import SLICE_CONDITION, slice_gpu_condition
from gpuslice.domain.queues import KueueWait
from gpuslice.domain.software import software_conditions
from gpuslice.domain.views import ClaimView, PodView, QuotaView, WorkloadView


class Reason(StrEnum):
    """status.reason of a GpuSlice: why it is in its phase (a StrEnum, like `Phase`)."""

    PACKAGE_NOT_FOUND = "PackageNotFound"
    CLAIM_REJECTED = "ClaimRejected"
    CREATING_CLAIM = "CreatingClaim"
    QUOTA_EXCEEDED = "QuotaExceeded"
    NOT_ENTITLED = "NotEntitled"
    WAITING_FOR_POD = "WaitingForPod"
    NO_MATCHING_GPU = "NoMatchingGpu"
    GPUS_FULL = "AllGpusFull"
    #: a multi-GPU product: no node has N free whole cards with the package's topology
    NO_NODE_FITS = "NoNodeFits"
    GPUS_UNHEALTHY = "GpusUnhealthy"
    UNSCHEDULABLE = "Unschedulable"
    SCHEDULING = "Scheduling"
    #: Kueue holds the pod (its admission gate) until its queue has quota for it
    QUEUED = "Queued"
    POD_BLOCKED_BY_QUOTA = "PodBlockedByQuota"
    POD_CREATE_FAILED = "PodCreateFailed"
    ALLOCATED = "Allocated"
    IN_USE = "InUse"
    RELEASED = "Released"


#: GitOps health of a slice by reason. Ready: usable as it is (a claim a pod can use, or one in use).
#: Reconciling: it gets there by itself (the claim is being made, the pod scheduled, a slice frees on
#: a full GPU). Stalled: it waits on someone (an entitlement, quota, a node with such a GPU, a pod spec
#: the scheduler or the namespace's quota refuses, a package that does not exist).
HEALTH: Mapping[str, Health] = {
    Reason.WAITING_FOR_POD: Health.READY,
    Reason.ALLOCATED: Health.READY,
    Reason.IN_USE: Health.READY,
    Reason.RELEASED: Health.READY,
    Reason.CREATING_CLAIM: Health.RECONCILING,
    Reason.SCHEDULING: Health.RECONCILING,
    Reason.QUEUED: Health.RECONCILING,
    Reason.GPUS_FULL: Health.RECONCILING,
    Reason.NO_NODE_FITS: Health.RECONCILING,
    Reason.QUOTA_EXCEEDED: Health.STALLED,
    Reason.NOT_ENTITLED: Health.STALLED,
    Reason.NO_MATCHING_GPU: Health.STALLED,
    Reason.GPUS_UNHEALTHY: Health.STALLED,
    Reason.UNSCHEDULABLE: Health.STALLED,
    Reason.POD_BLOCKED_BY_QUOTA: Health.STALLED,
    Reason.POD_CREATE_FAILED: Health.STALLED,
    Reason.CLAIM_REJECTED: Health.STALLED,
    Reason.PACKAGE_NOT_FOUND: Health.STALLED,
}


#: Reasons decided on the package's capacity: the slice's status records the numbers it saw.
CAPACITY_REASONS: frozenset[str] = frozenset(
    {Reason.GPUS_FULL, Reason.NO_MATCHING_GPU, Reason.GPUS_UNHEALTHY, Reason.NO_NODE_FITS}
)


def slice_health(phase: Phase, reason: str) -> Health:
    """A Failed slice is Stalled whatever its reason; an unknown reason is still converging."""
    if phase == Phase.FAILED:
        return Health.STALLED
    return HEALTH.get(reason, Health.RECONCILING)


@dataclass(frozen=True)
class SliceFacts:
    namespace: str
    name: str
    package: str
    template: bool
    generation: int | None
    package_found: bool
    gpu_model: str | None
    #: Direct form: the claim named like the slice (if it exists). Template form: generated claims.
    claims: Sequence[ClaimView]
    #: Pods that reference the claim (direct) or the template (template form).
    pods: Sequence[PodView]
    quotas: Sequence[QuotaView]
    workloads: Sequence[WorkloadView]
    capacity: Capacity | None
    #: The message of the operator's last failed attempt to create the claim or template.
    create_error: str | None = None
    uuids: Mapping[tuple[str, str], str] = field(default_factory=dict)
    previous: GpuSliceStatus | None = None
    #: What the node agent's NVML cross-check found (status.usage.violation), if anything.
    memory_violation: str | None = None
    #: The slice's own uid: a claim whose owner reference names another GpuSlice uid is not its claim.
    uid: str | None = None
    #: Taints of tainted published devices by (pool, device): an unhealthy or drained card's.
    device_taints: Mapping[tuple[str, str], Sequence[Mapping[str, Any]]] = field(default_factory=dict)
    #: Claims of the package the namespace holds, those being deleted too (the quota counts them
    #: until they are gone), looked up after a create was refused for quota: the quota may count more
    #: (Kubernetes charges a create before storing it, and one that then fails stays counted until
    #: kube-controller-manager recounts).
    held: Sequence[ClaimView] | None = None
    #: The slice the operator keeps for a pod that asks for the product in resources.limits: that
    #: pod's name (`pods` holds the pod while it exists, `claims` kube-scheduler's claim for it).
    pod: str | None = None
    #: status.usage as the node agent wrote it (software compatibility, GPU use).
    usage: Mapping[str, Any] | None = None
    #: The package's MIG profile (isolation.mode Hardware), None for a software package.
    mig_profile: str | None = None
    #: Pods Kueue holds (its admission gate), by name: where each waits in its queue, as read from
    #: the namespace's Workloads; a gated pod missing here has no pending Workload yet.
    queued: Mapping[str, KueueWait] = field(default_factory=dict)


def _pod_form(facts: SliceFacts, usage: QuotaUsage | None) -> _Verdict:
    """A pod's slice: kube-scheduler makes the claim when it schedules the pod, so until then the
    slice waits on the scheduler, and the scheduler's word on the pod is the reason."""
    pod = next((p for p in facts.pods if p.name == facts.pod), None)
    if pod is None:
        return _Verdict(
            Phase.RELEASED,
            Reason.RELEASED,
            f"pod {facts.pod} is gone; this slice is deleted with it (the pod owns it)",
        )
    claim = next(iter(facts.claims), None)
    if claim is not None:
        return _claim_verdict(facts, claim, [pod])
    if (queued := _queued_verdict(facts, pod)) is not None:
        return queued
    if pod.unschedulable:
        if is_quota_refusal(pod.unschedulable):
            return _quota_verdict(facts, usage) or _Verdict(
                Phase.PENDING,
                Reason.QUOTA_EXCEEDED,
                f"pod {pod.name} waits: kube-scheduler's claim for it is refused by the namespace's "
                f"quota: {pod.unschedulable}",
            )
        return _unschedulable_verdict(facts, pod)
    return _Verdict(
        Phase.PENDING,
        Reason.SCHEDULING,
        f"pod {pod.name} is being scheduled; kube-scheduler makes its claim for {facts.package}",
    )


def predecessor_claim(facts: SliceFacts) -> ClaimView | None:
    """Direct form: the claim named like the slice when it belongs to another GpuSlice of that name,
    one deleted before this one was created, which the garbage collector deletes (once no pod holds
    it). It is not this slice's: neither its claim nor its allocation, and none is created meanwhile."""
    if facts.template or facts.pod is not None or facts.uid is None:
        return None
    return next(
        (
            cl
            for cl in facts.claims
            if cl.name == facts.name and cl.owner_uid is not None and cl.owner_uid != facts.uid
        ),
        None,
    )


def own_claims(facts: SliceFacts) -> list[ClaimView]:
    old = predecessor_claim(facts)
    return [cl for cl in facts.claims if cl is not old]


@dataclass(frozen=True)
class _Verdict:
    phase: Phase
    reason: str
    message: str


def quota_usage(facts: SliceFacts) -> QuotaUsage | None:
    """x of y for the package's quota key; the tightest quota in the namespace wins."""
    key = c.quota_key(facts.package)
    best: QuotaUsage | None = None
    for q in facts.quotas:
        u = q.usage(key)
        if u is None:
            continue
        cand = QuotaUsage(used=u[0], hard=u[1], quota=q.name)
        if best is None or (cand.hard - cand.used) < (best.hard - best.used):
            best = cand
    return best


def _quota_verdict(facts: SliceFacts, usage: QuotaUsage | None) -> _Verdict | None:
    if usage is None:
        return None
    if usage.hard == 0:
        return _Verdict(
            Phase.PENDING,
            Reason.NOT_ENTITLED,
            f"namespace {facts.namespace} holds no entitlement to package {facts.package} "
            f"(ResourceQuota {usage.quota}: 0 slices); ask the platform team for an entitlement "
            "that selects this namespace, or use a package you are entitled to",
        )
    going = [cl for cl in facts.held or () if cl.deleting]
    if usage.used >= usage.hard and going:
        return _Verdict(
            Phase.PENDING,
            Reason.QUOTA_EXCEEDED,
            f"quota used up until a deleted slice's claim is gone: namespace {facts.namespace} holds "
            f"{usage.used} of {usage.hard} {facts.package} slices (ResourceQuota {usage.quota}); "
            + "; ".join(_until_gone(cl) for cl in going[:3])
            + "; this slice's claim is created then, by itself",
        )
    if usage.used >= usage.hard and facts.held is not None and len(facts.held) < usage.used:
        return _Verdict(
            Phase.PENDING,
            Reason.QUOTA_EXCEEDED,
            f"quota counted as used up: ResourceQuota {usage.quota} counts {usage.used} of {usage.hard} "
            f"{facts.package} slices used, but namespace {facts.namespace} holds {len(facts.held)} of them: "
            "Kubernetes counted a create that did not complete (a client stopped mid-request, or a "
            "create of a claim that already existed). kube-controller-manager recounts on its quota "
            "resync (--resource-quota-sync-period, 5 min by default) and this slice's claim is created "
            "then, by itself",
        )
    if usage.used >= usage.hard:
        return _Verdict(
            Phase.PENDING,
            Reason.QUOTA_EXCEEDED,
            f"quota used up: namespace {facts.namespace} holds {usage.used} of {usage.hard} "
            f"{facts.package} slices (ResourceQuota {usage.quota}); delete a GpuSlice or workload you "
            "no longer need, or ask the platform team for a larger entitlement",
        )
    return None


def _until_gone(claim: ClaimView) -> str:
    if claim.reserved_for:
        pods = ", ".join(claim.reserved_for)
        return (
            f"claim {claim.name} (being deleted) counts until pod {pods} has stopped "
            "(its terminationGracePeriodSeconds at most)"
        )
    return f"claim {claim.name} (being deleted) counts until it is removed (seconds)"


def _queued_verdict(facts: SliceFacts, pod: PodView) -> _Verdict | None:
    """A pod Kueue has not admitted yet waits in its queue, whatever the scheduler says of it (a
    gated pod is "SchedulingGated" to it): Kueue's reason and the pod's place are why."""
    if c.KUEUE_ADMISSION_GATE not in pod.gates:
        return None
    wait = facts.queued.get(pod.name)
    if wait is None:
        return _Verdict(
            Phase.PENDING,
            Reason.QUEUED,
            f"pod {pod.name} is held by Kueue (scheduling gate {c.KUEUE_ADMISSION_GATE}) until it "
            "admits the pod; Kueue has not queued its Workload yet",
        )
    said = f"; Kueue: {wait.message}" if wait.message else ""
    return _Verdict(
        Phase.PENDING,
        Reason.QUEUED,
        f"pod {pod.name} waits in Kueue's queue {wait.local_queue}: {_ordinal(wait.position)} of "
        f"{wait.pending} pending (Workload {wait.workload}){said}",
    )


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _first_queued(facts: SliceFacts) -> KueueWait | None:
    for pod in sorted(facts.pods, key=lambda p: p.name):
        if c.KUEUE_ADMISSION_GATE in pod.gates and pod.name in facts.queued:
            return facts.queued[pod.name]
    return None


def _unschedulable_verdict(facts: SliceFacts, pod: PodView) -> _Verdict:
    cap = facts.capacity
    model = facts.gpu_model or "?"
    if cap is not None and cap.total == 0 and cap.unhealthy_gpus:
        return _Verdict(
            Phase.PENDING,
            Reason.GPUS_UNHEALTHY,
            f"pod {pod.name} waits: the only GPU(s) of model {model!r} for package {facts.package} "
            f"({cap.unhealthy_gpus}) are unhealthy (failed, lost or waiting for a reset: their devices "
            "carry the taint gpuslice.io/gpu-unhealthy); it starts once one is healthy again",
        )
    if cap is not None and cap.total == 0:
        return _Verdict(
            Phase.PENDING,
            Reason.NO_MATCHING_GPU,
            f"pod {pod.name} waits: no node publishes a GPU of model {model!r} for package "
            f"{facts.package}; it starts once a node with such a GPU runs the gpuslice agent",
        )
    if cap is not None and cap.products_free == 0 and cap.placement_message:
        return _Verdict(
            Phase.PENDING,
            Reason.NO_NODE_FITS,
            f"pod {pod.name} waits: {cap.placement_message}; quota is an entitlement, not a "
            "reservation, so the pod starts when enough cards free on one node",
        )
    if cap is not None and cap.free == 0 and facts.mig_profile is not None:
        return _Verdict(
            Phase.PENDING,
            Reason.GPUS_FULL,
            f"pod {pod.name} waits: none of the {cap.total} placements of MIG profile {facts.mig_profile} "
            f"on {cap.gpus} GPU(s) of model {model!r} is free ({cap.allocated} allocated to this package; "
            "the others overlap MIG instances in use, which hold the memory or compute slices it needs, "
            "however many slices are free elsewhere on the card); quota is an entitlement, not a "
            "reservation, so the pod starts when instances on one card are freed",
        )
    if cap is not None and cap.free == 0:
        return _Verdict(
            Phase.PENDING,
            Reason.GPUS_FULL,
            f"pod {pod.name} waits: all {cap.total} {facts.package} slices on {cap.gpus} GPU(s) of "
            f"model {model!r} are taken ({cap.allocated} allocated to this package, the rest used by "
            "other packages on the same cards); quota is an entitlement, not a reservation, so the pod "
            "starts when a slice frees"
            + (f" ({cap.unhealthy_gpus} more GPU(s) of the model are unhealthy and sell nothing)"
               if cap.unhealthy_gpus else ""),
        )  # fmt: skip
    return _Verdict(
        Phase.PENDING,
        Reason.UNSCHEDULABLE,
        f"pod {pod.name} is not scheduled: {pod.unschedulable}",
    )


def _workload_verdict(facts: SliceFacts) -> _Verdict | None:
    for w in facts.workloads:
        if not w.failure:
            continue
        if is_quota_refusal(w.failure):
            return _Verdict(
                Phase.PENDING,
                Reason.POD_BLOCKED_BY_QUOTA,
                f"{w.kind} {w.name} cannot create its pod, blocked by the namespace's quota for host "
                f"resources: {w.failure}; free CPU/memory quota in {facts.namespace} or lower the pod's "
                "requests",
            )
        return _Verdict(
            Phase.PENDING,
            Reason.POD_CREATE_FAILED,
            f"{w.kind} {w.name} cannot create its pod: {w.failure}",
        )
    return None


def _pod_running(pod: PodView | None) -> bool:
    return pod is not None and pod.phase == "Running" and not pod.deleting


def _waiting_verdict(facts: SliceFacts) -> _Verdict:
    blocked = _workload_verdict(facts)
    if blocked:
        return blocked
    return _Verdict(
        Phase.PENDING,
        Reason.WAITING_FOR_POD,
        f"ready to use; kube-scheduler allocates the slice when a pod uses it: "
        f"{pod_claim_snippet(facts.name, facts.template)}",
    )


def _claim_verdict(facts: SliceFacts, claim: ClaimView, pods: Sequence[PodView]) -> _Verdict:
    """One claim and the pods that use it."""
    if claim.allocated:
        users = [p for p in pods if p.name in claim.reserved_for]
        running = [p for p in users if _pod_running(p)]
        where = f"node {claim.node}" if claim.node else "a node"
        if running:
            return _Verdict(Phase.IN_USE, Reason.IN_USE, f"used by pod {running[0].name} on {where}")
        if users:
            return _Verdict(
                Phase.ALLOCATED, Reason.ALLOCATED, f"allocated on {where}; pod {users[0].name} is starting"
            )
        return _Verdict(Phase.ALLOCATED, Reason.ALLOCATED, f"allocated on {where}")
    waiting = [p for p in pods if not p.deleting]
    for pod in waiting:
        if (queued := _queued_verdict(facts, pod)) is not None:
            return queued
        if pod.unschedulable:
            return _unschedulable_verdict(facts, pod)
    if waiting:
        return _Verdict(Phase.PENDING, Reason.SCHEDULING, f"pod {waiting[0].name} is being scheduled")
    return _waiting_verdict(facts)


def _direct(facts: SliceFacts, usage: QuotaUsage | None) -> _Verdict:
    old = predecessor_claim(facts)
    if old is not None:
        holders = [p.name for p in facts.pods if p.name in old.reserved_for]
        owner = f"ResourceClaim {facts.name} belongs to a deleted GpuSlice {facts.name} (uid {old.owner_uid})"
        return _Verdict(
            Phase.PENDING,
            Reason.CREATING_CLAIM,
            (
                f"{owner}; pod {holders[0]} holds it, so it is garbage-collected once that pod is gone. "
                f"Then this slice's own ResourceClaim {facts.name} is created (re-create pod {holders[0]} "
                "to use it)"
            )
            if holders
            else f"{owner} and is being garbage-collected; then this slice's own ResourceClaim "
            f"{facts.name} is created",
        )
    claim = next((cl for cl in facts.claims if cl.name == facts.name), None)
    if claim is None:
        if facts.create_error:
            by_quota = is_quota_refusal(facts.create_error)
            return (_quota_verdict(facts, usage) if by_quota else None) or _Verdict(
                Phase.PENDING if by_quota else Phase.FAILED,
                Reason.QUOTA_EXCEEDED if by_quota else Reason.CLAIM_REJECTED,
                f"the ResourceClaim could not be created: {facts.create_error}",
            )
        return _Verdict(Phase.PENDING, Reason.CREATING_CLAIM, f"creating ResourceClaim {facts.name}")
    verdict = _claim_verdict(facts, claim, facts.pods)
    was_allocated = facts.previous is not None and facts.previous.phase in (
        Phase.ALLOCATED,
        Phase.IN_USE,
        Phase.RELEASED,
    )
    if verdict.reason == Reason.WAITING_FOR_POD and was_allocated:
        return _Verdict(
            Phase.RELEASED,
            Reason.RELEASED,
            "the pod that used this slice is gone and the slice was released; a new pod that uses "
            f"claim {facts.name} gets a slice again",
        )
    return verdict


def _template(facts: SliceFacts, usage: QuotaUsage | None) -> _Verdict:
    if facts.create_error and not facts.claims and not facts.pods:
        return _Verdict(
            Phase.FAILED,
            Reason.CLAIM_REJECTED,
            f"the ResourceClaimTemplate could not be created: {facts.create_error}",
        )
    pods = [p for p in facts.pods if not p.deleting]
    if not pods:
        return _waiting_verdict(facts)
    claims = {cl.name: cl for cl in facts.claims}
    verdicts: list[_Verdict] = []
    for pod in sorted(pods, key=lambda p: p.name):
        names = [n for pc, n in pod.claims.items() if pc in pod.templates and pod.templates[pc] == facts.name]
        claim = claims.get(names[0]) if names and names[0] else None
        if claim is None and (queued := _queued_verdict(facts, pod)) is not None:
            verdicts.append(queued)
            continue
        if claim is None:
            quota = _quota_verdict(facts, usage) if pod.waiting else None
            verdicts.append(
                quota
                or _Verdict(
                    Phase.PENDING,
                    Reason.CREATING_CLAIM,
                    f"pod {pod.name} waits for kube-controller-manager to create its claim"
                    + (f": {pod.unschedulable}" if pod.unschedulable else ""),
                )
            )
            continue
        verdicts.append(_claim_verdict(facts, claim, [pod]))
    waiting = [v for v in verdicts if v.phase == Phase.PENDING]
    if waiting:
        first = waiting[0]
        prefix = f"{len(waiting)} of {len(verdicts)} pods wait; " if len(verdicts) > 1 else ""
        return _Verdict(Phase.PENDING, first.reason, prefix + first.message)
    in_use = [v for v in verdicts if v.phase == Phase.IN_USE]
    if len(in_use) == len(verdicts):
        return _Verdict(Phase.IN_USE, Reason.IN_USE, f"{len(in_use)} pod(s) hold a slice each")
    return _Verdict(
        Phase.ALLOCATED, Reason.ALLOCATED, f"{len(verdicts)} slice(s) allocated, {len(in_use)} in use"
    )


def _allocations(
    facts: SliceFacts, claims: Sequence[ClaimView], pods: Sequence[PodView]
) -> list[SliceAllocation]:
    out = []
    for claim in sorted(claims, key=lambda cl: cl.name):
        if not claim.allocated or claim.deleting:
            continue
        pool, device = claim.devices[0] if claim.devices else (None, None)
        users = [p.name for p in pods if p.name in claim.reserved_for]
        # every card of the claim, in its order; a card whose UUID is not published yet is unnamed
        uuids = [u for d in claim.devices if (u := facts.uuids.get(d))]
        out.append(
            SliceAllocation(
                claim=claim.name,
                node=claim.node,
                gpuUUID=facts.uuids.get((pool, device)) if pool and device else None,
                device=device,
                pool=pool,
                pod=users[0] if users else None,
                gpuUUIDs=uuids or None,
                devices=[d for _, d in claim.devices] or None,
            )
        )
    return out


def _condition(type_: str, ok: bool, reason: str, message: str, generation: int | None) -> Condition:
    return Condition(
        type=type_,
        status="True" if ok else "False",
        reason=reason,
        message=message,
        observedGeneration=generation,
    )


def slice_status(facts: SliceFacts, now: str) -> GpuSliceStatus:
    usage = quota_usage(facts)
    if not facts.package_found:
        verdict = _Verdict(
            Phase.FAILED,
            Reason.PACKAGE_NOT_FOUND,
            f"package {facts.package!r} does not exist; `kubectl get gpupackages` lists the products, "
            "set spec.package to one of them (delete and re-create the GpuSlice)",
        )
    elif facts.template:
        verdict = _template(facts, usage)
    elif facts.pod is not None:
        verdict = _pod_form(facts, usage)
    else:
        verdict = _direct(facts, usage)
    own = own_claims(facts)
    allocations = _allocations(facts, own, facts.pods)
    first = allocations[0] if allocations else None
    exists = bool(own) if not facts.template else (facts.package_found and not facts.create_error)
    claim_reason = "ClaimCreated" if exists else verdict.reason
    claim_name = facts.name
    if facts.pod is not None:
        claim_name = own[0].name if own else ""
    conditions = [
        *health_conditions(
            slice_health(verdict.phase, verdict.reason), verdict.reason, verdict.message, facts.generation
        ),
        _condition(
            "ClaimReady",
            exists,
            claim_reason,
            (f"{'ResourceClaimTemplate' if facts.template else 'ResourceClaim'} {claim_name} exists")
            if exists
            else verdict.message,
            facts.generation,
        ),
        _condition(
            "Allocated",
            bool(allocations),
            Reason.ALLOCATED if allocations else verdict.reason,
            f"{len(allocations)} slice(s) allocated" if allocations else verdict.message,
            facts.generation,
        ),
        _condition(
            "InUse",
            verdict.phase == Phase.IN_USE,
            verdict.reason,
            verdict.message,
            facts.generation,
        ),
    ]
    if allocations:
        conditions.append(
            _condition(
                "MemoryIsolated",
                facts.memory_violation is None,
                "WithinSlices" if facts.memory_violation is None else "ShimBypassed",
                "no process on the slice's GPU holds more memory than its slices allow (NVML cross-check)"
                if facts.memory_violation is None
                else facts.memory_violation,
                facts.generation,
            )
        )
        conditions.extend(software_conditions(facts.usage, facts.gpu_model, facts.generation))
    # every card of every allocated claim: a multi-GPU product fails when any of its cards does
    gpu = slice_gpu_condition(
        (
            (pool, device, claim.node, facts.uuids.get((pool, device)))
            for claim in own
            if claim.allocated and not claim.deleting
            for pool, device in claim.devices
        ),
        facts.device_taints,
    )
    if gpu is not None:
        conditions.append(_condition(SLICE_CONDITION, False, gpu[0], gpu[1], facts.generation))
    return GpuSliceStatus(
        phase=verdict.phase,
        reason=verdict.reason,
        message=verdict.message,
        claimName=None if facts.template else (claim_name or None),
        claimTemplateName=facts.name if facts.template else None,
        node=first.node if first else None,
        gpuUUID=first.gpu_uuid if first else None,
        device=first.device if first else None,
        gpus=len(first.devices) if first and first.devices else None,
        gpuUUIDs=first.gpu_uuids if first else None,
        allocations=allocations,
        # Only a slice that waits for quota shows it: live usage in every slice's status would rewrite
        # all of a namespace's slices whenever one claim comes or goes.
        quota=usage if verdict.reason in (Reason.QUOTA_EXCEEDED, Reason.NOT_ENTITLED) else None,
        queue=QueuePosition(
            workload=wait.workload, localQueue=wait.local_queue, position=wait.position, pending=wait.pending
        )
        if verdict.reason == Reason.QUEUED and (wait := _first_queued(facts)) is not None
        else None,
        # Likewise only a slice that waits for capacity shows the numbers it waits on, so that
        # `gpuslice explain` never sets a newer package count against an older verdict unsaid.
        capacity=CapacitySeen(gpus=cap.gpus, slicesTotal=cap.total, slicesFree=cap.free)
        if (cap := facts.capacity) is not None and verdict.reason in CAPACITY_REASONS
        else None,
        conditions=stamp(conditions, facts.previous.conditions if facts.previous else [], now),
        observedGeneration=facts.generation,
    )
