"""The metering ledger: GpuUsage objects, one per namespace and UTC month, from the claims the API shows.

Handlers only mark: a claim event marks its namespace, a GpuSlice's new usage reading is queued, a
package's new price splits open intervals. One daemon (of the first GpuPackage by name, so only the
active replica runs it and only once) reconciles the marked namespaces every `FLUSH_SECONDS` with
`domain.ledger.reconcile` and writes what changed, one apply per changed object: a burst of
thousands of allocations in one namespace costs a write or two a second, not one per slice.

Restart: the ledger's objects and the claims are all there is. A claim still allocated continues its
open interval (or opens one at its allocation time, which the claim's managedFields carry); a claim
deallocated meanwhile closes it at the time of that status write; a claim being deleted at its
deletionTimestamp; a claim gone without trace at the month object's `confirmedAt`, which the daemon
renews every `--ledger-checkpoint-seconds`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

import aiohttp
import kopf

from gpuslice import constants as c
from gpuslice import kubehttp
from gpuslice.api.package import GpuPackageSpec
from gpuslice.api.usage import GpuUsage, Price, object_name
from gpuslice.domain.ledger import (
    BORROW_SETTLE,
    Holding,
    Interval,
    Ledger,
    LedgerFull,
    Reading,
    accumulator,
    borrowed_open,
    encode,
    fill_cards,
    load,
    mark_borrowed,
    merge,
    month_end,
    months_between,
    observe,
    reconcile,
    reprice,
)
from gpuslice.domain.multigpu import cards_held
from gpuslice.domain.queues import KUEUE_API, borrowed_slices, cluster_queue_name, uses_kueue
from gpuslice.domain.views import claim_package, uses_gpuslice
from gpuslice.kubehttp import ApiError
from gpuslice.logs import get
from gpuslice.metrics import LEDGER_WRITE_ERRORS, PACKAGE_PRICE, SLICE_ALLOCATED
from gpuslice.operator.indexes import ns_of
from gpuslice.operator.metering import Metering
from gpuslice.operator.state import OperatorState, one, values
from gpuslice.timefmt import micro_time, parse_rfc3339

log = get(__name__)

#: After a claim changes in a namespace holding slices of a package in sharing mode Kueue, how long
#: its ClusterQueue's status is read again every flush: Kueue writes its borrowed count a moment
#: after its admission (or eviction), which the claim event does not wait for.
BORROW_RECHECK_SECONDS = 10.0

#: How often marked namespaces are reconciled and written: an interval is in the API this long (plus
#: the write) after the operator sees its allocation. A crash before that loses nothing: the claim
#: still shows its allocation time.
FLUSH_SECONDS = 1.0


@dataclass(frozen=True, slots=True)
class MeteredClaim:
    """What the ledger needs of a gpuslice ResourceClaim."""

    namespace: str
    name: str
    uid: str
    package: str
    slice: str
    template: bool
    #: When kube-scheduler wrote the allocation (its managedFields entry); None: not allocated.
    allocated_at: datetime | None
    #: The latest status write: when not allocated, the deallocation's time.
    status_at: datetime | None
    deleting_at: datetime | None
    pod: str
    pool: str
    device: str
    node: str
    #: (pool, device) of every gpuslice device of the allocation, in its order (several: a
    #: multi-GPU product).
    devices: tuple[tuple[str, str], ...] = ()


def _time(value: Any) -> datetime | None:
    try:
        return parse_rfc3339(str(value)) if value else None
    except ValueError:
        return None


def metered_claim(body: Mapping[str, Any]) -> MeteredClaim:
    meta = body.get("metadata") or {}
    labels = meta.get("labels") or {}
    status = body.get("status") or {}
    allocation = status.get("allocation")
    allocated_at = status_at = None
    for entry in meta.get("managedFields") or []:
        if entry.get("subresource") != "status":
            continue
        at = _time(entry.get("time"))
        if at is None:
            continue
        status_at = at if status_at is None or at > status_at else status_at
        if allocation and "f:allocation" in ((entry.get("fieldsV1") or {}).get("f:status") or {}):
            allocated_at = at if allocated_at is None or at < allocated_at else allocated_at
    results = ((allocation or {}).get("devices") or {}).get("results") or []
    ours = [r for r in results if r.get("driver") == c.DRIVER_NAME]
    mine: Mapping[str, Any] = ours[0] if ours else {}
    package = claim_package(body) or ""
    pods = [r.get("name", "") for r in status.get("reservedFor") or [] if r.get("resource") == "pods"]
    owners = [o.get("name", "") for o in meta.get("ownerReferences") or [] if o.get("kind") == "Pod"]
    node = ""
    for term in (((allocation or {}).get("nodeSelector") or {}).get("nodeSelectorTerms")) or []:
        for req in (term.get("matchFields") or []) + (term.get("matchExpressions") or []):
            if req.get("values"):
                node = str(req["values"][0])
    return MeteredClaim(
        namespace=meta.get("namespace", ""),
        name=meta.get("name", ""),
        uid=meta.get("uid", ""),
        package=package,
        slice=labels.get(c.LABEL_SLICE) or labels.get(c.LABEL_SLICE_TEMPLATE) or "",
        template=bool(labels.get(c.LABEL_SLICE_TEMPLATE)),
        allocated_at=(allocated_at or status_at) if allocation and mine else None,
        status_at=status_at,
        deleting_at=_time(meta.get("deletionTimestamp")),
        pod=(pods or owners or [""])[0],
        pool=str(mine.get("pool", "")),
        device=str(mine.get("device", "")),
        node=node or str(mine.get("pool", "")),
        devices=tuple((str(r.get("pool", "")), str(r.get("device", ""))) for r in ours),
    )


# --- indexes ----------------------------------------------------------------------------------------


@kopf.index(c.DRA_GROUP, c.DRA_VERSION, "resourceclaims")
async def gs_ledger_claims(
    namespace: str | None, body: kopf.Body, **_: Any
) -> dict[str, MeteredClaim] | None:
    """Namespace -> its gpuslice claims, as the ledger reads them."""
    return {ns_of(namespace): metered_claim(body)} if uses_gpuslice(body) else None


# --- marks ------------------------------------------------------------------------------------------


def _metering(memo: kopf.Memo) -> Metering:
    state: OperatorState = memo.state
    return state.metering


@kopf.on.event(c.DRA_GROUP, c.DRA_VERSION, "resourceclaims")
async def ledger_claim_event(
    namespace: str | None, type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any
) -> None:
    if not uses_gpuslice(body):
        return
    metering = _metering(memo)
    meta = body.get("metadata") or {}
    uid = str(meta.get("uid", ""))
    now = datetime.now(UTC).replace(microsecond=0)
    if type == "DELETED":
        metering.released[uid] = released_at(metered_claim(body), now)
    elif uid in metering.seen_allocated and not (body.get("status") or {}).get("allocation"):
        # Deallocated as we watch: now is when (a deallocated claim keeps no time of it).
        metering.released.setdefault(uid, now)
    metering.mark(ns_of(namespace))
    metering.borrow_recheck[ns_of(namespace)] = time.monotonic() + BORROW_RECHECK_SECONDS


@kopf.on.event(c.API_GROUP, c.API_VERSION, c.SLICE_PLURAL)
async def ledger_usage_event(
    namespace: str | None,
    name: str,
    type: str | None,
    status: kopf.Status,
    spec: kopf.Spec,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    """The node agent's status.usage of a (direct) slice: summed for its open interval."""
    key = (ns_of(namespace), name)
    metering = _metering(memo)
    if type == "DELETED":
        metering.last_reading.pop(key, None)
        return
    usage = status.get("usage") or {}
    at = _time(usage.get("time"))
    previous = metering.last_reading.get(key)
    if at is None or spec.get("template") or (previous is not None and previous.at >= at):
        return
    util = usage.get("computeUtilizationPercent")
    reading = Reading(
        at=at,
        memory_used_bytes=int(usage.get("memoryUsedBytes") or 0),
        memory_limit_bytes=int(usage.get("memoryLimitBytes") or 0),
        utilization_percent=float(util) if util is not None else None,
        refused_allocations=int(usage.get("refusedAllocations") or 0),
    )
    observe(metering.pending.setdefault(key, accumulator()), reading, previous)
    metering.last_reading[key] = reading


@kopf.on.event(c.API_GROUP, c.API_VERSION, c.PACKAGE_PLURAL)
async def ledger_price_event(name: str, spec: kopf.Spec, memo: kopf.Memo, **_: Any) -> None:
    """A package changed: if its price did, the daemon splits its open intervals (it reads the price
    from the package index, which is complete before any handler runs)."""
    metering = _metering(memo)
    try:
        price = GpuPackageSpec.model_validate(dict(spec)).price
    except ValueError:
        return
    if name in metering.prices and metering.prices[name] == price:
        return
    for namespace in metering.books:
        metering.mark(namespace)


def _prices(packages: kopf.Index[str, Any]) -> dict[str, Price | None]:
    out: dict[str, Price | None] = {}
    for name in packages:
        view = one(packages, name)
        if view is not None:
            out[name] = view.spec.price
    return out


def _cards(packages: kopf.Index[str, Any]) -> dict[str, float]:
    """Package -> the cards one of its products takes (`domain.multigpu.cards_held`)."""
    out: dict[str, float] = {}
    for name in packages:
        view = one(packages, name)
        if view is not None:
            out[name] = cards_held(view.spec)
    return out


def _export_prices(metering: Metering, prices: dict[str, Price | None]) -> None:
    if prices == metering.prices:
        return
    PACKAGE_PRICE.clear()
    for package, price in prices.items():
        if price is not None:
            PACKAGE_PRICE.labels(package, price.currency).set(float(price.per_hour))
    metering.prices = prices


# --- the daemon -------------------------------------------------------------------------------------


def _leader(packages: Mapping[str, Any]) -> str | None:
    """The package whose daemon runs the ledger: the first by name that is not being deleted."""
    names = sorted(n for n in packages if (v := one(packages, n)) is not None and not v.deleting)
    return names[0] if names else None


@kopf.daemon(c.API_GROUP, c.API_VERSION, c.PACKAGE_PLURAL, cancellation_timeout=5.0)
async def ledger_daemon(name: str, stopped: kopf.DaemonStopped, memo: kopf.Memo, **kw: Any) -> None:
    """Runs on every package; works on one (`_leader`), so the ledger has exactly one writer while any
    package exists, and none on a standby replica (Kopf stops daemons while peering pauses it)."""
    state: OperatorState = memo.state
    metering = state.metering
    claims: kopf.Index[str, MeteredClaim] = kw["gs_ledger_claims"]
    leading = False
    while not stopped:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(metering.wakeup.wait(), FLUSH_SECONDS)
        if _leader(kw["gs_packages"]) != name:
            leading = False
            continue
        if not leading:
            # Taking over (start-up, or the previous leader's package went): every namespace with
            # claims or open months is reconciled once, which is what a restart needs (written only
            # where that changes something; the checkpoint comes at its own time).
            if metering.preloaded is None and not await _preload(state):
                continue  # the API refused: tried again next second, and nothing is written meanwhile
            leading = True
            metering.checkpointed = time.monotonic()
            metering.heartbeat_read = False
            for namespace in {*claims, *(metering.preloaded or {}), *metering.books}:
                metering.mark(namespace)
        metering.wakeup.clear()
        if metering.dirty or _checkpoint_due(state):
            began = time.monotonic()
            await flush(state, claims, kw)
            # What comes meanwhile is one batch; a flush that took long (a month of thousands of
            # intervals, a slow API server) waits as long again, so it never takes the whole CPU.
            await asyncio.sleep(max(FLUSH_SECONDS, time.monotonic() - began))
        elif _heartbeat_due(state):
            await _heartbeat(state)


HEARTBEAT_LEASE = "gpuslice-ledger"


async def _preload(state: OperatorState) -> bool:
    """The GpuUsage objects of months not final, read once when this process takes over (the
    operator does not watch them: every write would come back as a copy of the whole object)."""
    try:
        items = await state.kube.list_all(
            c.GROUP_VERSION, c.USAGE_KIND, labelSelector=f"{c.LABEL_FINAL}!=true"
        )
    except (ApiError, TimeoutError, aiohttp.ClientError) as exc:
        log.warning("ledger objects unreadable; retried", error=str(exc))
        return False
    preloaded: dict[str, list[GpuUsage]] = {}
    for item in items:
        usage = GpuUsage.model_validate(item)
        if not usage.final:
            preloaded.setdefault(str((item.get("metadata") or {}).get("namespace", "")), []).append(usage)
    state.metering.preloaded = preloaded
    return True


async def _read_heartbeat(state: OperatorState) -> datetime | None:
    try:
        lease = await state.kube.get(
            "coordination.k8s.io/v1", "Lease", HEARTBEAT_LEASE, state.config.ledger_namespace
        )
    except (ApiError, TimeoutError, aiohttp.ClientError) as exc:
        log.warning("ledger heartbeat unreadable", error=str(exc))
        return None
    renewed = str(((lease or {}).get("spec") or {}).get("renewTime") or "")
    try:
        return parse_rfc3339(renewed)
    except ValueError:
        return None


def _heartbeat_due(state: OperatorState) -> bool:
    """Only while something is held (nothing to confirm otherwise: no write at rest), and only with
    every mark reconciled (the time it records must be one at which every open interval was true)."""
    metering = state.metering
    if metering.dirty or not any(
        ledger.open_intervals() for months in metering.books.values() for ledger in months.values()
    ):
        return False
    last = metering.heartbeat_sent
    return last is None or time.monotonic() - last >= state.config.ledger_heartbeat_seconds


async def _heartbeat(state: OperatorState) -> None:
    state.metering.heartbeat_sent = time.monotonic()
    now = datetime.now(UTC)
    body = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": HEARTBEAT_LEASE,
            "namespace": state.config.ledger_namespace,
            "labels": {c.LABEL_MANAGED_BY: c.MANAGED_BY_VALUE},
        },
        "spec": {
            "holderIdentity": "gpuslice-operator",
            "renewTime": micro_time(now),
            "leaseDurationSeconds": max(1, int(state.config.ledger_heartbeat_seconds * 3)),
        },
    }
    try:
        await state.kube.apply(body)
    except (ApiError, TimeoutError, aiohttp.ClientError) as exc:
        LEDGER_WRITE_ERRORS.labels("refused").inc()
        log.warning("ledger heartbeat refused; retried", error=str(exc))


def _checkpoint_due(state: OperatorState) -> bool:
    last = state.metering.checkpointed
    return last is None or time.monotonic() - last >= state.config.ledger_checkpoint_seconds


async def flush(state: OperatorState, claims: kopf.Index[str, MeteredClaim], kw: Mapping[str, Any]) -> None:
    metering = state.metering
    checkpoint = _checkpoint_due(state)
    if checkpoint:
        metering.checkpointed = time.monotonic()
        metering.dirty.update(metering.books)
        metering.dirty.update(ns for ns, _ in metering.stats_dirty)
    targets, metering.dirty = metering.dirty, set()
    _export_prices(metering, _prices(kw["gs_packages"]))
    metering.cards = _cards(kw["gs_packages"])
    uuids = state.published(kw["gs_resource_slices"], kw["gs_pool_claims"], kw["gs_claims"]).uuids
    kueue = _kueue_resources(kw["gs_packages"])
    for namespace in sorted(targets):
        if time.monotonic() < metering.retry_at.get(namespace, 0.0):
            metering.dirty.add(namespace)  # refused a moment ago: not again every second
            continue
        seen = one(kw["gs_namespaces"], namespace)
        if seen is None or seen.terminating:
            # Its GpuUsage objects go with it (and nothing can be written there any more).
            metering.books.pop(namespace, None)
            for key in [k for k in metering.written if k[0] == namespace]:
                del metering.written[key]
            _export(metering, namespace, [])
            continue
        try:
            await _flush_namespace(state, namespace, values(claims, namespace), uuids, checkpoint, kueue)
        except (ApiError, TimeoutError, aiohttp.ClientError) as exc:
            LEDGER_WRITE_ERRORS.labels("refused").inc()
            log.warning("ledger write refused; retried", namespace=namespace, error=str(exc))
            metering.retry_at[namespace] = time.monotonic() + state.config.recheck_seconds
            metering.dirty.add(namespace)
        else:
            metering.retry_at.pop(namespace, None)


def _kueue_resources(packages: kopf.Index[str, Any]) -> dict[str, str]:
    """Package -> the resource Kueue counts, for packages in sharing mode Kueue."""
    out: dict[str, str] = {}
    for name in packages:
        view = one(packages, name)
        if view is not None and uses_kueue(view.spec):
            resource = view.spec.extended_resource(name)
            if resource:
                out[name] = resource
    return out


async def _mark_borrowed(
    state: OperatorState, namespace: str, months: dict[str, Ledger], kueue: Mapping[str, str], now: datetime
) -> set[str]:
    """Kueue's word on how many of the namespace's open slices are borrowed, per package in sharing
    mode Kueue that it holds; kept re-read while Kueue may not have written its status yet."""
    metering = state.metering
    held = {iv.package for ledger in months.values() if not ledger.final for iv in ledger.open_intervals()}
    changed: set[str] = set()
    for package in sorted(held & set(kueue)):
        cq = await state.kube.get(KUEUE_API, "ClusterQueue", cluster_queue_name(package, namespace))
        borrowed = borrowed_slices(cq, package, kueue[package])
        if borrowed is None:
            continue
        # A lower count releases a borrowed interval only once it has held for BORROW_SETTLE: Kueue
        # may write it before the borrowed slice's own claim is seen going.
        key = (namespace, package)
        if borrowed < borrowed_open(months, package):
            since = metering.borrow_low_since.setdefault(key, now)
            release = now - since >= BORROW_SETTLE
            if not release:
                metering.borrow_recheck[namespace] = max(
                    metering.borrow_recheck.get(namespace, 0.0), time.monotonic() + 2.0
                )
        else:
            metering.borrow_low_since.pop(key, None)
            release = True
        changed |= mark_borrowed(months, package, borrowed, now, release=release)
    if held & set(kueue) and time.monotonic() < metering.borrow_recheck.get(namespace, 0.0):
        metering.dirty.add(namespace)
    else:
        metering.borrow_recheck.pop(namespace, None)
    return changed


def _ledgers(metering: Metering, namespace: str) -> dict[str, Ledger]:
    months = metering.books.get(namespace)
    if months is None:
        by_month: dict[str, list[GpuUsage]] = {}
        for usage in (metering.preloaded or {}).pop(namespace, []):
            by_month.setdefault(usage.month, []).append(usage)
        months = metering.books[namespace] = {m: load(namespace, shards) for m, shards in by_month.items()}
        for m, shards in by_month.items():
            for shard in shards:
                metering.written[(namespace, object_name(m, shard.shard))] = _digest(_fields(shard))
    return months


def released_at(claim: MeteredClaim, now: datetime) -> datetime:
    """When a claim that is gone released its device: its deallocation (the last status write, once
    no pod reserves it), not its deletion request; a GpuSlice deleted while pods still use its claim
    is billed until they are done. Gone while still allocated (no finalizer held it): now."""
    if claim.allocated_at is None and claim.status_at is not None:
        return claim.status_at
    return now


def holdings(
    claims: Iterable[MeteredClaim],
    uuids: Mapping[tuple[str, str], str],
    cards: Mapping[str, float] | None = None,
) -> list[Holding]:
    """The namespace's allocated claims as the ledger counts them; `cards`: package -> the cards one
    product of it takes."""
    held = []
    for claim in claims:
        if claim.allocated_at is None:
            continue
        held.append(
            Holding(
                namespace=claim.namespace,
                package=claim.package,
                slice=claim.slice or claim.name,
                claim=claim.name,
                claim_uid=claim.uid,
                pod=claim.pod,
                node=claim.node,
                gpu=uuids.get((claim.pool, claim.device), claim.device),
                gpus=tuple(uuids.get(d, d[1]) for d in claim.devices) if len(claim.devices) > 1 else None,
                allocated_at=claim.allocated_at,
                # Still allocated is still held, whether or not its deletion was asked for (the
                # GpuSlice deleted while its pods run): the device is billed until it is released.
                ended_at=None,
                template=claim.template,
                cards=(cards or {}).get(claim.package),
            )
        )
    return held


async def _flush_namespace(
    state: OperatorState,
    namespace: str,
    claims: list[MeteredClaim],
    uuids: Mapping[tuple[str, str], str],
    checkpoint: bool,
    kueue: Mapping[str, str],
) -> None:
    metering = state.metering
    months = _ledgers(metering, namespace)
    if not metering.heartbeat_read and any(ledger.open_intervals() for ledger in months.values()):
        # Read once per takeover, and only where an interval may need it (none: no read at all).
        metering.heartbeat_at = await _read_heartbeat(state)
        metering.heartbeat_read = True
    held = holdings(claims, uuids, metering.cards)
    released = dict(metering.released)
    metering.seen_allocated.update(h.claim_uid for h in held)
    now = datetime.now(UTC).replace(microsecond=0)
    await _ended_months(state, namespace, months, held, now)
    _fold_readings(metering, namespace, months)
    changed = fill_cards(months, metering.cards)
    for package, price in metering.prices.items():
        # A price that changed (or changed while no operator ran) from here on.
        changed |= reprice(months, package, price, now)
    changed |= reconcile(months, namespace, held, released, metering.prices, now, metering.heartbeat_at)
    if kueue:
        changed |= await _mark_borrowed(state, namespace, months, kueue, now)
    _export(metering, namespace, held)
    stats = {m for ns, m in metering.stats_dirty if ns == namespace}
    write = changed | (stats if checkpoint or changed else set())
    if checkpoint:
        write |= {m for m, ledger in months.items() if ledger.open_intervals()}
    for month in sorted(write):
        ledger = months[month]
        if not ledger.final:
            ledger.confirmed_at = min(now, ledger.end)
        await _write(state, ledger, now)
        metering.stats_dirty.discard((namespace, month))
    # What is written final is never looked at again: only the fact that it is final stays.
    for month in [m for m, ledger in months.items() if ledger.final and ledger.intervals]:
        months[month] = Ledger(namespace, month, final=True)
    # A deletion seen is kept until the interval it closes is written.
    still_open = {iv.claim_uid for ledger in months.values() for iv in ledger.open_intervals()}
    present = {claim.uid for claim in claims}
    allocated = {h.claim_uid for h in held}
    for uid in [u for u in metering.released if u not in still_open and u not in allocated]:
        del metering.released[uid]
    for uid in [u for u in metering.seen_allocated if u not in present]:
        metering.seen_allocated.discard(uid)


async def _ended_months(
    state: OperatorState, namespace: str, months: dict[str, Ledger], held: list[Holding], now: datetime
) -> None:
    """Ended months a holding reaches into that this process has no book of (it started after
    they ended, and final objects are not read at takeover): read them, so that a final one is
    known as such and never written over, and an open one is continued."""
    wanted = {
        m
        for h in held
        for m in months_between(h.allocated_at, min(h.ended_at or now, now))
        if m not in months and month_end(m) <= now
    }
    for month in sorted(wanted):
        url = kubehttp.path(c.API_GROUP, c.API_VERSION, c.USAGE_PLURAL, namespace=namespace)
        answer = await state.kube.api.get(url, labelSelector=f"{c.LABEL_MONTH}={month}")
        shards = [GpuUsage.model_validate(item) for item in answer.get("items") or []]
        if any(s.final for s in shards):
            months[month] = Ledger(namespace, month, final=True)
        elif shards:
            months[month] = load(namespace, shards)
            for shard in shards:
                state.metering.written[(namespace, object_name(month, shard.shard))] = _digest(_fields(shard))


def _fold_readings(metering: Metering, namespace: str, months: Mapping[str, Ledger]) -> None:
    keys = [k for k in metering.pending if k[0] == namespace]
    if not keys:
        return
    by_slice: dict[str, list[tuple[Ledger, Interval]]] = {}
    for ledger in months.values():
        if not ledger.final:
            for iv in ledger.open_intervals():
                if not iv.template:
                    by_slice.setdefault(iv.slice, []).append((ledger, iv))
    for key in keys:
        acc = metering.pending.pop(key)
        for ledger, iv in by_slice.get(key[1], ()):
            if merge(iv, acc):
                metering.stats_dirty.add((namespace, ledger.month))


def _fields(usage: GpuUsage) -> dict[str, Any]:
    return usage.model_dump(by_alias=True, exclude_none=True, mode="json")


def _digest(fields: dict[str, Any]) -> str:
    """What is compared with the last write: a hash, not a second copy of every interval."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


async def _write(state: OperatorState, ledger: Ledger, now: datetime) -> None:
    metering = state.metering
    try:
        shards = encode(ledger, now)
    except LedgerFull as exc:
        LEDGER_WRITE_ERRORS.labels("full").inc()
        log.error("ledger object full; not written", namespace=ledger.namespace, error=str(exc))
        ref = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ledger.namespace}}
        kopf.event(cast(kopf.Body, ref), type="Warning", reason="GpuUsageLedgerFull", message=str(exc)[:1000])
        return
    for shard, usage in sorted(shards.items()):
        name = object_name(ledger.month, shard)
        fields = _fields(usage)
        digest = _digest(fields)
        if metering.written.get((ledger.namespace, name)) == digest:
            continue
        body = {
            "apiVersion": c.GROUP_VERSION,
            "kind": c.USAGE_KIND,
            "metadata": {
                "name": name,
                "namespace": ledger.namespace,
                "labels": {
                    c.LABEL_MANAGED_BY: c.MANAGED_BY_VALUE,
                    c.LABEL_MONTH: ledger.month,
                    c.LABEL_FINAL: "true" if ledger.final else "false",
                },
            },
            **fields,
        }
        await state.kube.apply(body)
        metering.written[(ledger.namespace, name)] = digest


def _export(metering: Metering, namespace: str, held: list[Holding]) -> None:
    """gpuslice_slice_allocated: one series per held slice of the namespace, gone when released."""
    now: set[tuple[str, ...]] = {
        (namespace, h.package, h.slice, h.pod, h.node, h.gpu) for h in held if h.ended_at is None
    }
    for labels in metering.exported.get(namespace, set()) - now:
        SLICE_ALLOCATED.remove(*labels)
    for labels in now:
        SLICE_ALLOCATED.labels(*labels).set(1)
    metering.exported[namespace] = now
