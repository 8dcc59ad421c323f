"""GpuSlice handlers: make its claim (or template), and keep its status true.

Status is recomputed from indexes whenever something it depends on changes (the slice, its claims,
pods that reference it, workloads that would create such pods, the namespace's quotas), and on a
slow resync; it is written only when it differs from what the object shows. Handlers only mark the
slice (`changes`); its package's daemon recomputes marked slices, a bounded number at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any, cast

import aiohttp
import kopf

from gpuslice import constants as c
from gpuslice.api.refusal import is_quota_refusal
from gpuslice.api.slice import GpuSliceStatus, Phase
from gpuslice.domain.capacity import Capacity
from gpuslice.domain.claim_retry import no_room, quota_retry_delay, refused_retry_delay
from gpuslice.domain.claims import protection_patch, slice_claim, slice_claim_template
from gpuslice.domain.conditions import same_status
from gpuslice.domain.health import stranded_claims
from gpuslice.domain.mig import package_profile
from gpuslice.domain.package_status import capacity_behind, capacity_status, capacity_write
from gpuslice.domain.pod_slices import resource_of
from gpuslice.domain.releasing import releasing as releasing_status
from gpuslice.domain.slice_status import CAPACITY_REASONS, Reason, SliceFacts, own_claims, slice_status
from gpuslice.domain.software import warnings_raised
from gpuslice.domain.views import ClaimView, claim_view
from gpuslice.kubehttp import ApiError
from gpuslice.logs import get
from gpuslice.metrics import RECONCILE_DURATION, SLICE_PENDING, STATUS_UPDATES, TRANSITIONS, WRITES
from gpuslice.operator import queues, releasing
from gpuslice.operator.config import OperatorConfig
from gpuslice.operator.indexes import MANAGED, Indexes, Ref, SliceView, ns_of
from gpuslice.operator.kube import error_message
from gpuslice.operator.pod_slices import ensure_pod_slices, pods_without_slice, product_pod_package
from gpuslice.operator.state import OperatorState, now, one, values
from gpuslice.timefmt import parse_rfc3339

log = get(__name__)

#: How long a claim this process applied may stay missing from the index before it applies again.
#: Once the index has shown it, the record is dropped: a claim deleted later is put back at once. So
#: this only covers an applied claim deleted before its watch event arrived; a watch that lags under
#: load must not turn every refresh into another apply.
APPLIED_GRACE_SECONDS = 120.0


def _facts(
    state: OperatorState,
    entry: SliceView,
    idx: Indexes,
    baseline: dict[str, Any],
    created: ClaimView | None = None,
    usage: dict[str, Any] | None = None,
) -> SliceFacts:
    """`created`: the claim this refresh just applied, which the index shows only a watch event later;
    `usage`: the node agent's status.usage as the object shows it."""
    ns, name, pkg = entry.namespace, entry.name, entry.package
    package = one(idx.packages, pkg)
    claims: list[ClaimView]
    if entry.pod is not None:
        pod = one(idx.product_pods, (ns, entry.pod))
        pods = [pod] if pod is not None and pod.uid == entry.pod_uid else []
        claim = one(idx.claims, (ns, pods[0].extended_claim)) if pods and pods[0].extended_claim else None
        claims = [claim] if claim else []
        workloads = []
    elif entry.template:
        claims = [v for ref in values(idx.template_claims, entry.ref) if (v := one(idx.claims, ref))]
        pods = values(idx.template_pods, entry.ref)
        workloads = values(idx.template_workloads, entry.ref)
    else:
        claim = one(idx.claims, entry.ref) or created
        claims = [claim] if claim else []
        pods = values(idx.claim_pods, entry.ref)
        workloads = values(idx.claim_workloads, entry.ref)
    need = [d for claim in claims if claim.allocated for d in claim.devices]
    snapshot = state.published(
        idx.resource_slices, idx.pool_claims, idx.claims, need, rules=idx.device_taint_rules
    )
    found = package is not None and (not package.deleting or bool(claims))
    # Refused by quota: our create of the claim, or kube-scheduler's for the pod of a pod's slice.
    quota_refused = is_quota_refusal(state.create_errors.get((ns, name))) or (
        entry.pod is not None and any(is_quota_refusal(p.unschedulable) for p in pods)
    )
    return SliceFacts(
        namespace=ns,
        name=name,
        package=pkg,
        template=entry.template,
        generation=entry.generation,
        package_found=found,
        gpu_model=package.spec.gpu_model if package else None,
        claims=claims,
        pods=pods,
        quotas=values(idx.quotas, ns),
        workloads=workloads,
        capacity=snapshot.capacity(pkg, package.spec) if package else None,
        mig_profile=package_profile(package.spec) if package else None,
        create_error=state.create_errors.get((ns, name)),
        uuids=snapshot.uuids,
        device_taints=snapshot.taints,
        previous=GpuSliceStatus.model_validate(baseline) if baseline else None,
        memory_violation=(usage or {}).get("violation"),
        usage=usage,
        uid=entry.uid,
        pod=entry.pod,
        held=_held(idx, ns, pkg) if quota_refused else None,
    )


def _held(idx: Indexes, ns: str, package: str) -> list[ClaimView]:
    """Claims of `package` in the namespace, of both forms and those being deleted too: the quota
    counts them all until they are gone (only after a quota refusal: it walks every claim). The claim
    of a GpuSlice being deleted (Releasing: pods still hold it) is going too, though nothing has
    asked for its own deletion yet: the garbage collector does once the slice has gone."""
    out = []
    for ref, views in idx.claims.items():
        if ref[0] != ns:
            continue
        for cl in views:
            if cl.package != package:
                continue
            owner = one(idx.slices, (ns, cl.labels.get(c.LABEL_SLICE, "")))
            if not cl.deleting and owner is not None and owner.deleting and owner.uid == cl.owner_uid:
                cl = dataclasses.replace(cl, deleting=True)
            out.append(cl)
    return out


async def ensure_claim(state: OperatorState, entry: SliceView, idx: Indexes) -> ClaimView | None:
    """Create the claim or template when the index lacks it; remember why it failed, if it did.
    Returns the claim as the API server answered its create (direct form only)."""
    ns, name, pkg = entry.namespace, entry.name, entry.package
    package = one(idx.packages, pkg)
    if package is None or package.deleting or not entry.uid or entry.pod is not None:
        return None  # a pod's slice: kube-scheduler makes its claim
    key = entry.ref
    if entry.template:
        if one(idx.templates, entry.ref) is not None:
            state.applied.pop(key, None)
            return None
        body = slice_claim_template(ns, name, entry.uid, pkg, package.spec)
    else:
        # Its own, or a deleted predecessor's of the same name (`predecessor_claim`): an apply over
        # that one would fail; its deletion (a claim event) refreshes this slice, which creates its own.
        if one(idx.claims, entry.ref) is not None:
            state.applied.pop(key, None)
            state.created.pop(key, None)
            return None
        body = slice_claim(ns, name, entry.uid, pkg, package.spec)
    error = state.create_errors.get(key)
    if error is None and time.monotonic() - state.applied.get(key, -1e9) < APPLIED_GRACE_SECONDS:
        # Applied, its watch event not here yet: the claim as the apply answered, so a refresh
        # meanwhile does not go back to CreatingClaim (and forth again when the event comes).
        return state.created.get(key)
    since = time.monotonic() - state.applied.get(key, -1e9)
    if is_quota_refusal(error):
        delay = quota_retry_delay(_quota_full(idx, ns, pkg), state.refusals.get(key, 0))
        if delay is None or since < delay:
            return None  # no room yet (its quota event rechecks it), or tried a moment ago
    elif since < refused_retry_delay(state.refusals.get(key, 0)):
        return None
    state.applied[key] = time.monotonic()
    try:
        answer = await state.kube.apply(body)
    except (ApiError, TimeoutError, aiohttp.ClientError) as exc:
        # No answer in time is a refusal too: retried after the delay below, not on the next event.
        message = (
            error_message(exc) if isinstance(exc, ApiError) else f"no answer from the API server: {exc!r}"
        )
        if state.create_errors.get((ns, name)) != message:
            log.info("claim create refused", namespace=ns, slice=name, reason=message)
        state.create_errors[(ns, name)] = message
        refusals = state.refusals.get(key, 0) + 1
        delay = quota_retry_delay(_quota_full(idx, ns, pkg), refusals) if is_quota_refusal(message) else 0.0
        if delay is None:
            state.refusals.pop(key, None)  # waits for the quota event that shows room, then goes at once
            return None
        state.refusals[key] = refusals
        if is_quota_refusal(message):
            # The quota shows room already, so the event that showed it came before this refusal:
            # none may mark the slice again before the resync. It marks itself.
            asyncio.get_running_loop().call_later(delay, state.changes.mark, [key], pkg)
        return None
    state.create_errors.pop((ns, name), None)
    state.refusals.pop(key, None)
    if body["kind"] != "ResourceClaim":
        return None
    state.created[key] = claim_view(answer)
    return state.created[key]


def _quota_full(idx: Indexes, ns: str, package: str) -> bool:
    """No room in the namespace's quotas for one more claim of `package`: under its devices key, or
    the `requests.<resource>` key its claims are charged too (which pods asking for the product in
    resources.limits use up at creation, before their claims count under the devices key)."""
    keys = [c.quota_key(package)]
    specs = {name: view.spec for name in idx.packages if (view := one(idx.packages, name)) is not None}
    if (resource := resource_of(package, specs)) is not None:
        keys.append(c.QUOTA_REQUESTS_PREFIX + resource)
    return no_room(values(idx.quotas, ns), keys)


async def refresh(state: OperatorState, ns: str, name: str, idx: Indexes) -> None:
    """Recompute one slice's status; write and post an event only if it changed.

    One refresh per slice at a time, compared with what this process last wrote: the watch stream
    may not have delivered that write yet, and re-deciding from the stale copy would write twice.
    """
    key = (ns, name)
    await state.workloads.ready()  # a status decided without the pods that use the slice would be wrong
    async with state.lock(key):
        entry = one(idx.slices, key)
        if entry is None:
            state.forget(key)
            return
        namespace = one(idx.namespaces, ns)
        if namespace is not None and namespace.terminating:
            # It goes with its namespace; nothing can be created there any more, not even Events.
            await releasing.settle(state, entry, [], namespace_terminating=True)
            return
        # A slice being deleted (Releasing) makes no claim again.
        created = None if entry.deleting else await ensure_claim(state, entry, idx)
        # status.usage belongs to the node agent: neither compared nor cleared here.
        status = entry.status
        shown = {k: v for k, v in status.items() if k not in c.AGENT_STATUS_FIELDS}
        mine = state.written.get(key)
        if mine is not None and (mine[0] != entry.uid or mine[1] == shown):
            # The index shows what this process wrote: no second copy of every status kept at rest.
            del state.written[key]
            mine = None
        baseline: dict[str, Any] = mine[1] if mine is not None else shown
        facts = await queues.with_kueue_waits(
            state, _facts(state, entry, idx, baseline, created, status.get("usage"))
        )
        if not facts.template and facts.pod is None:  # template and pod-form claims go with their pod
            await release_stranded_claims(state, facts)
            await protect_claims(state, facts)
        with RECONCILE_DURATION.labels("GpuSlice").time():
            new = slice_status(facts, now())
        release = await releasing.settle(state, entry, own_claims(facts))
        if release.held_by:
            new = releasing_status(new, new.claim_name or name, release.held_by)
        desired = new.model_dump(by_alias=True, exclude_none=True, mode="json")
        if facts.capacity is not None and new.reason in CAPACITY_REASONS:
            # Only a verdict made on the capacity needs the package to show the same count first; the
            # package timer writes the rest. (Before each status: 7.5 package writes per slice in a burst.)
            await sync_package_capacity(state, entry.package, facts.capacity, idx)
        if same_status(baseline, desired):
            return
        try:
            await state.kube.patch_status(
                c.GROUP_VERSION, c.SLICE_KIND, name, ns, _with_nulls(baseline, desired)
            )
        except ApiError as exc:
            if exc.status == 404:
                return
            raise
        state.written[key] = (entry.uid or "", desired)
        STATUS_UPDATES.labels("GpuSlice").inc()
        if (baseline.get("phase"), baseline.get("reason")) != (desired.get("phase"), desired.get("reason")):
            _announce(entry, baseline, desired)
        for reason, message in warnings_raised(baseline, desired):
            _warn(entry, reason, message)


async def release_stranded_claims(state: OperatorState, facts: SliceFacts) -> None:
    """Delete the slice's claim when it is allocated on a failed card (`domain.health.stranded_claims`);
    the claim waits for its evicted pods to go (kube-controller-manager evicts them, not this), and
    the operator then creates it again, unallocated."""
    for name in stranded_claims(own_claims(facts), facts.device_taints):
        log.warning("claim allocated on a failed GPU: releasing it", namespace=facts.namespace, claim=name)
        await state.kube.delete(c.DRA_GROUP_VERSION, "ResourceClaim", name, facts.namespace)


async def protect_claims(state: OperatorState, facts: SliceFacts) -> None:
    """kube-scheduler's finalizer back on the slice's deallocated claim (`domain.claims.protection_patch`);
    a claim changed since it was seen is refused, and its event brings it here again."""
    for claim in own_claims(facts):
        if (ops := protection_patch(claim)) is not None:
            await state.kube.json_patch(
                c.DRA_GROUP_VERSION, "ResourceClaim", claim.name, ops, claim.namespace, missing_ok=True
            )


async def sync_package_capacity(state: OperatorState, package: str, live: Capacity, idx: Indexes) -> None:
    """Write the package's status.capacity first when it lags the count this slice is decided on, so
    `kubectl get gpupackages` never shows free slices under a slice that waits for one."""
    view = one(idx.packages, package)
    if view is None or view.deleting:
        return
    if not capacity_behind(view.capacity, state.package_capacity.get(package), live):
        return
    desired = capacity_status(live).model_dump(by_alias=True, exclude_none=True)
    try:
        await state.kube.patch_status(c.GROUP_VERSION, c.PACKAGE_KIND, package, None, capacity_write(live))
    except ApiError as exc:
        if exc.status == 404:
            return
        raise
    state.package_capacity[package] = desired
    STATUS_UPDATES.labels("GpuPackage").inc()


#: Steps every slice passes through in a second or two: an Event for each would be two more writes per
#: slice that tell a user nothing (status still shows them).
QUIET_REASONS = frozenset({Reason.CREATING_CLAIM, Reason.SCHEDULING})


def _warn(entry: SliceView, reason: str, message: str) -> None:
    ref = {
        "apiVersion": c.GROUP_VERSION,
        "kind": c.SLICE_KIND,
        "metadata": {"name": entry.name, "namespace": entry.namespace, "uid": entry.uid},
    }
    kopf.event(cast(kopf.Body, ref), type="Warning", reason=reason, message=message[:1000])
    WRITES.labels("Event", "create").inc()


def _announce(entry: SliceView, before: dict[str, Any], desired: dict[str, Any]) -> None:
    """A Kubernetes Event on the GpuSlice for every phase/reason transition but the quiet steps."""
    TRANSITIONS.labels(desired["phase"], desired.get("reason", "")).inc()
    if before.get("phase") in (None, Phase.PENDING.value) and desired["phase"] in (
        Phase.ALLOCATED.value,
        Phase.IN_USE.value,
    ):
        waited = _seconds_since(entry.created)
        if waited is not None:
            SLICE_PENDING.labels(entry.package).observe(waited)
    if desired.get("reason") in QUIET_REASONS:
        return
    ref = {
        "apiVersion": c.GROUP_VERSION,
        "kind": c.SLICE_KIND,
        "metadata": {"name": entry.name, "namespace": entry.namespace, "uid": entry.uid},
    }
    kopf.event(
        cast(kopf.Body, ref),
        type="Warning" if desired["phase"] == "Failed" else "Normal",
        reason=desired.get("reason") or desired["phase"],
        message=f"{desired['phase']}: {desired.get('message', '')}"[:1000],
    )
    WRITES.labels("Event", "create").inc()
    log.info(
        "slice transition",
        namespace=entry.namespace,
        slice=entry.name,
        phase=desired["phase"],
        reason=desired.get("reason"),
    )


def _seconds_since(timestamp: str | None) -> float | None:
    if not timestamp:
        return None
    created = parse_rfc3339(timestamp)
    return max(0.0, (datetime.now(UTC) - created).total_seconds())


def _with_nulls(current: dict[str, Any], desired: dict[str, Any]) -> dict[str, Any]:
    """Merge patch that also clears fields no longer set (a released slice has no node)."""
    out: dict[str, Any] = dict(desired)
    for key in current:
        if key not in desired:
            out[key] = None
    return out


def route(state: OperatorState, targets: Iterable[Ref], idx: Indexes) -> list[Ref]:
    """Mark `targets` for their package's daemon; returns those no daemon runs for (their package
    is missing or being deleted: Kopf stops a deleted object's daemons), which the caller refreshes."""
    direct: list[Ref] = []
    marked: dict[str, list[Ref]] = {}
    for ref in set(targets):
        entry = one(idx.slices, ref)
        if entry is None:
            continue
        package = one(idx.packages, entry.package)
        if package is None or package.deleting:
            direct.append(ref)
        else:
            marked.setdefault(package.name, []).append(ref)
    for package_name, refs in marked.items():
        state.changes.mark(refs, package_name)
    return direct


async def refresh_routed(state: OperatorState, targets: Iterable[Ref], idx: Indexes) -> None:
    """What an event handler does: mark the slices, refresh at once only those no daemon takes."""
    for ns, name in route(state, targets, idx):
        await refresh(state, ns, name, idx)


# --- triggers -------------------------------------------------------------------------------------


@kopf.on.event(c.API_GROUP, c.API_VERSION, c.SLICE_PLURAL)
async def slice_event(namespace: str | None, name: str, type: str | None, memo: kopf.Memo, **kw: Any) -> None:
    namespace = ns_of(namespace)
    if type == "DELETED":
        memo.state.forget((namespace, name))
        return
    await refresh_routed(memo.state, [(namespace, name)], Indexes(kw, memo.state.workloads))


#: Waiting reasons whose verdict only the namespace's gpuslice quota changes (a claim freed, an
#: entitlement raised): rechecked on that quota's events (`tenancy.quota_event`), not every tick, so
#: thousands of them cost nothing while nothing changes.
QUOTA_REASONS = frozenset({Reason.QUOTA_EXCEEDED.value, Reason.NOT_ENTITLED.value})


def due_for_recheck(state: OperatorState, package: str, idx: Indexes, now: float | None = None) -> list[Ref]:
    """The package's slices to recompute on this tick of its timer: the Pending ones (a waiting
    slice's reason depends on capacity elsewhere, which no event of its own pod or claim announces)
    but those waiting for quota, and every one once per `resync_seconds` (the safety net)."""
    now = time.monotonic() if now is None else now
    last = state.resynced.get(package)
    full = last is None or now - last >= state.config.resync_seconds
    if full:
        state.resynced[package] = now
    out = []
    for ref in values(idx.package_slices, package):
        entry = one(idx.slices, ref)
        if entry is None:
            continue
        waiting = entry.phase in (None, Phase.PENDING.value) and entry.reason not in QUOTA_REASONS
        if full or waiting:
            out.append(ref)
    return out


def mark_quota_waiters(state: OperatorState, namespace: str, idx: Indexes) -> None:
    """The namespace's gpuslice quota changed (usage or entitlement): recheck its slices waiting for it."""
    by_package: dict[str, list[Ref]] = {}
    for ref in values(idx.namespace_slices, namespace):
        entry = one(idx.slices, ref)
        if entry is not None and entry.phase == Phase.PENDING.value and entry.reason in QUOTA_REASONS:
            by_package.setdefault(entry.package, []).append(ref)
    for package, refs in by_package.items():
        state.changes.mark(refs, package)


def recheck(state: OperatorState, package: str, idx: Indexes) -> None:
    """Run by the package's timer (so a standby replica, paused by peering, does not): GpuSlices get
    no Kopf timer of their own, which would be a task, a finalizer and metadata patches per slice.
    Marks them for the package's daemon, which refreshes them with whatever events marked; and the
    pods of the package that still lack their slice (its create was refused, or a predecessor of the
    pod's name was still being deleted)."""
    state.changes.mark(due_for_recheck(state, package, idx), package)
    state.changes.mark(pods_without_slice(idx, package), package)


async def refresh_logged(state: OperatorState, targets: list[Ref], idx: Indexes, failed: str) -> None:
    """Refresh each target, `REFRESHES_IN_FLIGHT` at a time; a failure is logged with `failed` and
    left to the next tick."""

    async def bounded(ns: str, name: str) -> None:
        async with state.refresh_slots:
            await refresh(state, ns, name, idx)

    results = await asyncio.gather(*(bounded(ns, n) for ns, n in targets), return_exceptions=True)
    for ref, result in zip(targets, results, strict=True):
        if isinstance(result, Exception):
            log.warning(failed, slice=f"{ref[0]}/{ref[1]}", error=str(result))


def register(config: OperatorConfig, registry: kopf.OperatorRegistry | None = None) -> None:
    """GpuSlices have no timers: `recheck` runs from the package timers (see packages.register)."""


def _slice_of_claim(labels: kopf.Labels, namespace: str) -> Ref | None:
    if labels.get(c.LABEL_SLICE):
        return (namespace, labels[c.LABEL_SLICE])
    if labels.get(c.LABEL_SLICE_TEMPLATE):
        return (namespace, labels[c.LABEL_SLICE_TEMPLATE])
    return None


@kopf.on.event(c.DRA_GROUP, c.DRA_VERSION, "resourceclaims", labels=MANAGED)
async def claim_event(
    namespace: str | None, labels: kopf.Labels, meta: kopf.Meta, memo: kopf.Memo, **kw: Any
) -> None:
    namespace = ns_of(namespace)
    idx = Indexes(kw, memo.state.workloads)
    if meta.get("deletionTimestamp") is not None:
        # A claim going changes no quota figure until it is gone, but what the namespace's slices
        # waiting for quota say (`slice_status`: which claim they wait for, and its pod).
        mark_quota_waiters(memo.state, namespace, idx)
    target = _slice_of_claim(labels, namespace)
    if target:
        await refresh_routed(memo.state, [target], idx)


@kopf.on.event(c.DRA_GROUP, c.DRA_VERSION, "resourceclaimtemplates", labels=MANAGED)
async def claim_template_event(
    namespace: str | None, name: str, type: str | None, memo: kopf.Memo, **kw: Any
) -> None:
    namespace = ns_of(namespace)
    if type == "DELETED":
        await refresh_routed(memo.state, [(namespace, name)], Indexes(kw, memo.state.workloads))


@kopf.daemon(c.API_GROUP, c.API_VERSION, c.PACKAGE_PLURAL, cancellation_timeout=5.0)
async def refresh_changed(name: str, stopped: kopf.DaemonStopped, memo: kopf.Memo, **kw: Any) -> None:
    """The package's slices marked in `changes` (by their events, the recheck timer and the pod and
    ReplicaSet watches). A daemon, so that only the active replica runs it: Kopf stops daemons while
    peering pauses the operator, and what is marked meanwhile waits for the next active one."""
    state: OperatorState = memo.state
    idx = Indexes(kw, state.workloads)
    wakeup = state.changes.listen(name)
    wakeup.set()  # what changed while no replica was active, or before this package was seen

    def package_of(ref: Ref) -> str | None:
        entry = one(idx.slices, ref)
        # No slice yet: a pod that asks for a product in resources.limits, whose slice is made here.
        return product_pod_package(idx, ref) if entry is None else entry.package

    try:
        while not stopped:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wakeup.wait(), 1.0)
            if not wakeup.is_set():
                continue
            wakeup.clear()
            targets = state.changes.take(name, package_of)
            await ensure_pod_slices(state, [t for t in targets if one(idx.slices, t) is None], idx)
            await refresh_logged(state, targets, idx, "slice refresh failed; the next recheck retries")
    finally:
        state.changes.unlisten(name)


@kopf.on.event("", "v1", "resourcequotas")
async def namespace_quota_event(namespace: str | None, memo: kopf.Memo, **kw: Any) -> None:
    """Quota usage moved: slices of the namespace that wait (or were refused) may go on now."""
    namespace = ns_of(namespace)
    idx = Indexes(kw, memo.state.workloads)
    targets = []
    for ref in values(idx.namespace_slices, namespace):
        entry = one(idx.slices, ref)
        if entry and entry.phase in (None, Phase.PENDING.value, Phase.FAILED.value):
            targets.append(ref)
    await refresh_routed(memo.state, targets, idx)


def _slices_in_pool(idx: Indexes, pool: str | None) -> list[Ref]:
    """The slices with a claim allocated in `pool` (every pool: None)."""
    out = []
    for p in [pool] if pool else list(idx.pool_claims):
        for ref in values(idx.pool_claims, p):
            claim = one(idx.claims, ref)
            if claim is not None and (target := _slice_of_claim(claim.labels, claim.namespace)):
                out.append(target)
    return out


@kopf.on.event(c.DRA_GROUP, c.DRA_VERSION, "devicetaintrules")
async def device_taint_rule_event(spec: kopf.Spec, memo: kopf.Memo, **kw: Any) -> None:
    """A drain began or ended: the slices on the pool it selects say so (GpuHealthy), at once."""
    memo.state.snapshot = None  # the next status must see the rule, not a snapshot from before it
    idx = Indexes(kw, memo.state.workloads)
    await refresh_routed(
        memo.state, _slices_in_pool(idx, (spec.get("deviceSelector") or {}).get("pool")), idx
    )


@kopf.on.event(c.DRA_GROUP, c.DRA_VERSION, "resourceslices")
async def resource_slice_event(spec: kopf.Spec, memo: kopf.Memo, **kw: Any) -> None:
    """A node republished (a card failed or recovered: device taints): its slices' status follows."""
    if spec.get("driver") != c.DRIVER_NAME:
        return
    memo.state.snapshot = None
    idx = Indexes(kw, memo.state.workloads)
    await refresh_routed(memo.state, _slices_in_pool(idx, (spec.get("pool") or {}).get("name")), idx)
