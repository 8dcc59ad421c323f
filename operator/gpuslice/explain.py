"""`gpuslice explain <namespace>/<slice>`: where a slice is and why, or what it waits for, in plain words.

The operator already decides phase, reason and message from the cluster's own objects; this command
reads them back with the package's capacity and the slice's usage, and adds what the tenant can do.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Mapping
from typing import Any

from gpuslice import constants as c
from gpuslice.domain.slice_status import CAPACITY_REASONS, Reason

#: What a tenant can do, per reason. `{ns}`, `{name}` and `{package}` are filled in.
ADVICE: Mapping[str, tuple[str, ...]] = {
    Reason.PACKAGE_NOT_FOUND: (
        "pick an existing product: kubectl get gpupackages",
        "then create a new GpuSlice with that spec.package (package cannot be changed in place)",
    ),
    Reason.QUOTA_EXCEEDED: (
        "delete a slice you no longer need: kubectl get gpuslices -n {ns}",
        "or ask the platform team to raise the {package} entitlement of this namespace",
    ),
    Reason.NOT_ENTITLED: (
        "this namespace holds no entitlement to {package}: ask the platform team for one",
        "see which products this namespace may use: "
        "kubectl get resourcequota -n {ns} -o yaml | grep deviceclass",
    ),
    Reason.GPUS_FULL: (
        "nothing: it starts by itself when a slice of a matching GPU frees "
        "(quota is an entitlement, not a reservation)",
        "or use a smaller product that still fits: kubectl get gpupackages",
    ),
    Reason.NO_NODE_FITS: (
        "nothing: it starts by itself when enough whole cards free on one node (quota is an "
        "entitlement, not a reservation); see free products: kubectl get gpupackage {package} "
        "-o jsonpath='{{.status.capacity.productsFree}}'",
        "or use a product of fewer cards: kubectl get gpupackages",
    ),
    Reason.GPUS_UNHEALTHY: (
        "nothing you can do: the platform team resets or replaces the card; "
        "the pod starts by itself once a GPU of the model is healthy again",
        "or pick a product of another model: kubectl get gpupackages -o wide",
    ),
    Reason.NO_MATCHING_GPU: (
        "no node offers this GPU model now; ask the platform team, or pick a product of another model: "
        "kubectl get gpupackages -o wide",
    ),
    Reason.POD_BLOCKED_BY_QUOTA: (
        "the pod, not the GPU slice, is refused by the namespace's CPU/memory quota: "
        "kubectl describe resourcequota -n {ns}",
        "lower the pod's requests, free quota by stopping other workloads, or ask for more",
    ),
    Reason.POD_CREATE_FAILED: ("see why the pod could not be created: kubectl get events -n {ns}",),
    Reason.CLAIM_REJECTED: (
        "the claim was rejected; the message says why. Do not edit gpuslice-owned claims: "
        "delete and recreate the GpuSlice",
    ),
    Reason.WAITING_FOR_POD: (
        "run a pod that uses it:\n"
        "      spec.resourceClaims: [{{name: gpu, resourceClaimName: {name}}}]\n"
        "      containers[].resources.claims: [{{name: gpu}}]",
        "a slice is allocated when kube-scheduler places the first pod that uses it",
    ),
    Reason.UNSCHEDULABLE: ("see the scheduler's message on the pod: kubectl describe pod -n {ns} <pod>",),
    Reason.SCHEDULING: ("nothing yet: kube-scheduler is placing the pod",),
    Reason.QUEUED: (
        "nothing: Kueue admits the pod when its queue has quota (its entitlement, or a slice it may "
        "borrow); see the queue: kubectl get workloads -n {ns}",
        "or ask the platform team for a larger entitlement or borrowingLimit",
    ),
    Reason.CREATING_CLAIM: ("nothing yet: the operator is creating the claim",),
    Reason.RELEASED: ("the pod finished and the GPU was freed; a new pod using the slice gets one again",),
}


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    if n >= c.GIB and n % c.GIB == 0:
        return f"{n // c.GIB} GiB"
    return f"{n / c.MIB:.0f} MiB"


def _count(cap: Mapping[str, Any]) -> str:
    return f"{cap.get('slicesFree', '?')} of {cap.get('slicesTotal', '?')}"


def capacity_lines(pkg_name: str, status: Mapping[str, Any], package: Mapping[str, Any] | None) -> list[str]:
    """The capacity a slice's verdict rests on, and the package's count when that moved on since.

    A slice that waits for capacity records the count it was decided on (status.capacity); the
    package's own count may be newer. Both are shown for what they are, never one under the other's
    verdict: "2 of 2 free" under "every card is full" would be a contradiction, not an explanation.
    """
    seen = status.get("capacity") or {}
    pkg_cap = ((package or {}).get("status") or {}).get("capacity") or {}
    reason = status.get("reason")
    unhealthy = (
        [f"  unhealthy: {n} GPU(s) of the model are out of service (failed, lost or waiting for a reset)"]
        if (n := pkg_cap.get("unhealthyGpus"))
        else []
    )
    return _capacity_lines(pkg_name, seen, pkg_cap, reason) + unhealthy


def _capacity_lines(
    pkg_name: str, seen: Mapping[str, Any], pkg_cap: Mapping[str, Any], reason: Any
) -> list[str]:
    if not seen:
        if not pkg_cap:
            return []
        gpus = pkg_cap.get("gpus", "?")
        line = f"  capacity: {_count(pkg_cap)} {pkg_name} slices free on {gpus} GPU(s) in the cluster"
        if reason in CAPACITY_REASONS:
            return [line + " (the package's count, newer than this slice's status)"]
        return [line]
    lines = [
        f"  capacity: {_count(seen)} {pkg_name} slices free on {seen.get('gpus', '?')} GPU(s) "
        "when this status was decided"
    ]
    if pkg_cap and (pkg_cap.get("slicesFree"), pkg_cap.get("slicesTotal")) != (
        seen.get("slicesFree"),
        seen.get("slicesTotal"),
    ):
        lines.append(
            f"  since:    the package counts {_count(pkg_cap)} free now; the slice's status follows on the "
            "operator's next recheck (kube-scheduler retries the pod by itself)"
        )
    return lines


def explain(slice_obj: Mapping[str, Any], package: Mapping[str, Any] | None) -> str:
    """The plain-words explanation of one GpuSlice, given it and its GpuPackage (None if missing)."""
    meta = slice_obj.get("metadata", {})
    ns, name = meta.get("namespace", "?"), meta.get("name", "?")
    pkg_name = slice_obj.get("spec", {}).get("package", "?")
    status = slice_obj.get("status") or {}
    lines = [f"GpuSlice {ns}/{name}"]
    if package is not None:
        spec = package.get("spec", {})
        pstat = package.get("status") or {}
        title = spec.get("displayName") or pkg_name
        # a Hardware product is one MIG instance: its profile says what the driver keeps apart
        mig = f", MIG instance {pstat['migProfile']} (hardware isolation)" if pstat.get("migProfile") else ""
        lines.append(
            f"  product:  {pkg_name} ({title}), "
            f"{pstat.get('memoryPerSlice', '?')} of a {spec.get('gpuModel', '?')}{mig}"
        )
    else:
        lines.append(f"  product:  {pkg_name} (no GpuPackage of that name exists)")
    phase = status.get("phase")
    if not phase:
        lines.append("  state:    not yet seen by the operator (is `gpuslice operator` running?)")
        return "\n".join(lines)
    reason = status.get("reason", "")
    lines.append(f"  state:    {phase} ({reason})" if reason else f"  state:    {phase}")
    if status.get("message"):
        lines.append(f"  why:      {status['message']}")
    for alloc in status.get("allocations") or []:
        uuids, devices = alloc.get("gpuUUIDs") or [], alloc.get("devices") or []
        if len(devices) > 1:  # a multi-GPU product: every card it holds
            where = (
                f"{len(devices)} GPUs {', '.join(uuids) or '?'} on node {alloc.get('node', '?')}, "
                f"devices {', '.join(devices)}"
            )
        else:
            where = (
                f"GPU {alloc.get('gpuUUID', '?')} on node {alloc.get('node', '?')}, "
                f"device {alloc.get('device', '?')}"
            )
        pod = f", held by pod {alloc['pod']}" if alloc.get("pod") else ""
        lines.append(f"  where:    claim {alloc.get('claim')}: {where}{pod}")
    queue = status.get("queue")
    if queue:
        lines.append(
            f"  queue:    position {queue.get('position')} of {queue.get('pending')} pending in Kueue's "
            f"LocalQueue {queue.get('localQueue')} (Workload {queue.get('workload')})"
        )
    quota = status.get("quota")
    if quota:
        lines.append(
            f"  quota:    {quota.get('used')} of {quota.get('hard')} {pkg_name} slices used in {ns} "
            f"(ResourceQuota {quota.get('quota')})"
        )
    lines.extend(capacity_lines(pkg_name, status, package))
    usage = status.get("usage")
    if usage:
        lines.append(
            f"  usage:    {_fmt_bytes(usage.get('memoryUsedBytes'))} "
            f"of {_fmt_bytes(usage.get('memoryLimitBytes'))}"
            f" GPU memory, {len(usage.get('processes') or [])} process(es), read {usage.get('time', '?')}"
        )
    for cond in status.get("conditions") or []:
        bad = {"MemoryIsolated": "False", "SoftwareCompatible": "False", "GpuIdle": "True"}
        if bad.get(cond.get("type", "")) == cond.get("status"):
            lines.append(f"  warning:  {cond.get('message')}")
    advice = ADVICE.get(reason)
    if advice and phase not in ("Allocated", "InUse"):
        lines.append("  what you can do:")
        lines.extend(f"    - {a.format(ns=ns, name=name, package=pkg_name)}" for a in advice)
    return "\n".join(lines)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "explain", help="say where a GpuSlice is, or why it waits, and what to do", description=__doc__
    )
    p.add_argument("slice", metavar="NAMESPACE/SLICE")
    p.add_argument("--kubeconfig", default=None)
    p.set_defaults(func=_run)


async def _fetch(
    namespace: str, name: str, kubeconfig: str | None
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    from kubernetes_asyncio import client, config
    from kubernetes_asyncio.client.exceptions import ApiException

    await config.load_kube_config(config_file=kubeconfig)
    async with client.ApiClient() as api:
        objs = client.CustomObjectsApi(api)
        slice_obj = await objs.get_namespaced_custom_object(
            c.API_GROUP, c.API_VERSION, namespace, c.SLICE_PLURAL, name
        )
        try:
            package = await objs.get_cluster_custom_object(
                c.API_GROUP, c.API_VERSION, c.PACKAGE_PLURAL, slice_obj["spec"]["package"]
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            package = None
        return slice_obj, package


def _run(args: argparse.Namespace) -> int:
    from kubernetes_asyncio.client.exceptions import ApiException

    ns, sep, name = args.slice.partition("/")
    if not sep or not ns or not name:
        print("error: give the slice as NAMESPACE/NAME, e.g. team-a/train-1", file=sys.stderr)
        return 2
    try:
        slice_obj, package = asyncio.run(_fetch(ns, name, args.kubeconfig))
    except ApiException as exc:
        if exc.status == 404:
            print(
                f"error: no GpuSlice {name} in namespace {ns} (see: kubectl get gpuslices -n {ns})",
                file=sys.stderr,
            )
            return 1
        print(f"error: the API server answered {exc.status} {exc.reason}", file=sys.stderr)
        return 1
    print(explain(slice_obj, package))
    return 0
