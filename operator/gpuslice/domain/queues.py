"""A package in sharing mode Kueue -> the Kueue objects that carry its entitlements (pure).

Per entitled namespace a ClusterQueue whose nominal quota is the entitlement, in the package's
resource name (`gpuslice.io/<package>`, what Kueue counts from a pod's requests), in the package's
cohort, so Kueue lends idle quota to the cohort's other queues and takes it back by preemption
(`reclaimWithinCohort: Any`) when its owner asks; a LocalQueue in the namespace pointing at it; a
ResourceFlavor for the package's GPU model. What the operator writes carries its managed-by and
package labels; an object of the same name without them belongs to someone else and is never
overwritten (`conflicts`), nor is a cohort another ClusterQueue already uses.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuslice import constants as c
from gpuslice.api.package import GpuPackageSpec
from gpuslice.api.sharing import SharingMode
from gpuslice.domain.ownership import managed_labels
from gpuslice.domain.selectors import matches

KUEUE_API = "kueue.x-k8s.io/v1beta2"


def uses_kueue(spec: GpuPackageSpec) -> bool:
    return spec.sharing.mode is SharingMode.KUEUE


def cohort(package: str, spec: GpuPackageSpec) -> str:
    return spec.sharing.cohort or f"gpuslice-{package}"


def quota_ceilings(
    packages: Mapping[str, GpuPackageSpec], entitled: Mapping[str, int | None]
) -> dict[str, int | None]:
    """A namespace's ResourceQuota per package: its entitlement, or where Kueue governs, the
    entitlement plus borrowingLimit. The guarantee that the entitlement is there when its owner asks
    moves to Kueue (its ClusterQueue's nominal quota, reclaimed by preemption); the quota keeps only
    the ceiling, which holds for GpuSlices and pods without a queue too."""
    out: dict[str, int | None] = {}
    for name, slices in entitled.items():
        spec = packages.get(name)
        if slices is not None and spec is not None and uses_kueue(spec):
            slices += spec.sharing.borrowing_limit or 0
        out[name] = slices
    return out


def fair_share_weight(spec: GpuPackageSpec, namespace_labels: Mapping[str, str]) -> float | None:
    """The namespace's fair-sharing weight (`sharing.weights`, the largest that selects it, as with
    entitlements); None when none does: its ClusterQueue then carries none and Kueue weighs it 1."""
    found = [w.weight for w in spec.sharing.weights if matches(w.namespace_selector, namespace_labels)]
    return max(found) if found else None


def _quantity(weight: float) -> str:
    """A weight as a Kueue quantity: 2.0 -> "2", 0.5 -> "0.5"."""
    return format(weight, "g")


def flavor_name(gpu_model: str) -> str:
    """A DNS label for a GPU model: "Tesla V100-PCIE-32GB" -> "gpuslice-tesla-v100-pcie-32gb"."""
    slug = re.sub(r"[^a-z0-9]+", "-", gpu_model.lower()).strip("-")
    return f"gpuslice-{slug}"[:63].rstrip("-")


def cluster_queue_name(package: str, namespace: str) -> str:
    return f"gpuslice-{package}-{namespace}"


def local_queue_name(package: str) -> str:
    return f"gpuslice-{package}"


def _labels(package: str) -> dict[str, str]:
    return managed_labels(package=package)


def desired_objects(
    package: str,
    spec: GpuPackageSpec,
    entitled: Mapping[str, int],
    weights: Mapping[str, float] | None = None,
) -> list[dict[str, Any]]:
    """The Kueue objects for `package` (none unless its sharing mode is Kueue, or when it has no
    extended resource to count); entitled: namespace -> slices of its entitlement; weights:
    namespace -> its fair-sharing weight, where `sharing.weights` gives it one."""
    resource = spec.extended_resource(package)
    if not uses_kueue(spec) or resource is None:
        return []
    flavor = flavor_name(spec.gpu_model)
    out: list[dict[str, Any]] = [
        {
            "apiVersion": KUEUE_API,
            "kind": "ResourceFlavor",
            "metadata": {
                "name": flavor,
                "labels": managed_labels(),
                "annotations": {c.LABEL_PREFIX + "gpu-model": spec.gpu_model},
            },
            "spec": {},
        }
    ]
    for namespace, slices in sorted(entitled.items()):
        quota: dict[str, Any] = {"name": resource, "nominalQuota": str(slices)}
        if spec.sharing.lending_limit is not None:
            quota["lendingLimit"] = str(min(spec.sharing.lending_limit, slices))
        if spec.sharing.borrowing_limit is not None:
            quota["borrowingLimit"] = str(spec.sharing.borrowing_limit)
        cq = cluster_queue_name(package, namespace)
        out.append(
            {
                "apiVersion": KUEUE_API,
                "kind": "ClusterQueue",
                "metadata": {"name": cq, "labels": _labels(package)},
                "spec": {
                    "cohortName": cohort(package, spec),
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                    "queueingStrategy": "BestEffortFIFO",
                    "resourceGroups": [
                        {"coveredResources": [resource], "flavors": [{"name": flavor, "resources": [quota]}]}
                    ],
                    # The owner's entitlement is a guarantee: what it lent is taken back by
                    # preempting the borrowers, whatever their priority.
                    "preemption": {"reclaimWithinCohort": "Any", "withinClusterQueue": "LowerPriority"},
                },
            }
        )
        weight = (weights or {}).get(namespace)
        if weight is not None:
            out[-1]["spec"]["fairSharing"] = {"weight": _quantity(weight)}
        out.append(
            {
                "apiVersion": KUEUE_API,
                "kind": "LocalQueue",
                "metadata": {
                    "name": local_queue_name(package),
                    "namespace": namespace,
                    "labels": _labels(package),
                },
                "spec": {"clusterQueue": cq},
            }
        )
    return out


@dataclass(frozen=True)
class Conflict:
    kind: str
    name: str
    namespace: str | None
    reason: str

    def message(self) -> str:
        where = f"{self.namespace}/{self.name}" if self.namespace else self.name
        return f"{self.kind} {where} {self.reason}; gpuslice does not overwrite it"


def owned_by(obj: Mapping[str, Any], package: str | None = None) -> bool:
    labels = obj.get("metadata", {}).get("labels") or {}
    if labels.get(c.LABEL_MANAGED_BY) != c.MANAGED_BY_VALUE:
        return False
    return package is None or labels.get(c.LABEL_PREFIX + "package") == package


def _key(obj: Mapping[str, Any]) -> tuple[str, str, str | None]:
    meta = obj["metadata"]
    return obj["kind"], meta["name"], meta.get("namespace")


def conflicts(
    package: str,
    desired: Iterable[Mapping[str, Any]],
    existing: Iterable[Mapping[str, Any]],
) -> list[Conflict]:
    """Why the desired objects cannot be written: an object of the same kind and name that gpuslice
    (for this package: ClusterQueues and LocalQueues carry it) does not own, or a ClusterQueue it
    does not own in the package's cohort (the package's idle slices would be lent to it)."""
    existing = list(existing)
    by_key = {_key(o): o for o in existing}
    out: list[Conflict] = []
    cohorts = set()
    for want in desired:
        kind, name, namespace = _key(want)
        if kind == "ClusterQueue":
            cohorts.add(want["spec"]["cohortName"])
        have = by_key.get((kind, name, namespace))
        if have is None:
            continue
        # A ResourceFlavor is shared by every package of the model: any gpuslice one is ours.
        if not owned_by(have, None if kind == "ResourceFlavor" else package):
            out.append(Conflict(kind, name, namespace, "exists and is not gpuslice's"))
    named = {(x.kind, x.name) for x in out}
    for have in existing:
        if have["kind"] != "ClusterQueue" or owned_by(have, package):
            continue
        if ("ClusterQueue", have["metadata"]["name"]) in named:
            continue
        cq_cohort = (have.get("spec") or {}).get("cohortName")
        if cq_cohort in cohorts:
            out.append(Conflict("ClusterQueue", have["metadata"]["name"], None, f"is in cohort {cq_cohort}"))
    return out


def stale(
    package: str, desired: Iterable[Mapping[str, Any]], existing: Iterable[Mapping[str, Any]]
) -> list[Mapping[str, Any]]:
    """This package's ClusterQueues and LocalQueues that should no longer exist (an entitlement
    gone, the mode back to Quota)."""
    keep = {_key(d) for d in desired}
    return [
        o
        for o in existing
        if o["kind"] in ("ClusterQueue", "LocalQueue") and owned_by(o, package) and _key(o) not in keep
    ]


def borrowed_slices(cluster_queue: Mapping[str, Any] | None, package: str, resource: str) -> int | None:
    """How many of its namespace's slices Kueue counts borrowed from the cohort (its ClusterQueue's
    status.flavorsUsage `borrowed`, admitted workloads only); None when the queue is not the
    package's own (missing, or someone else's): then nothing is known of borrowing."""
    if cluster_queue is None or not owned_by(cluster_queue, package):
        return None
    total = 0
    for flavor in (cluster_queue.get("status") or {}).get("flavorsUsage") or []:
        for r in flavor.get("resources") or []:
            if r.get("name") == resource:
                total += _count(r.get("borrowed"))
    return total


def _count(quantity: Any) -> int:
    """A Kueue quantity of slices ("2", 2, "0"); anything else counts none."""
    try:
        return max(0, int(str(quantity or 0)))
    except ValueError:
        return 0


@dataclass(frozen=True)
class KueueWait:
    """Where Kueue holds a pod: its Workload, the LocalQueue, its place among the queue's pending
    Workloads (1: admitted next when quota frees) and Kueue's own words on why it waits."""

    workload: str
    local_queue: str
    position: int
    pending: int
    message: str


def _condition(wl: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    return next((x for x in (wl.get("status") or {}).get("conditions") or [] if x.get("type") == type_), None)


def _is_true(wl: Mapping[str, Any], type_: str) -> bool:
    cond = _condition(wl, type_)
    return cond is not None and cond.get("status") == "True"


def _pending(wl: Mapping[str, Any]) -> bool:
    return (
        (wl.get("spec") or {}).get("active", True) is not False
        and not _is_true(wl, "QuotaReserved")
        and not _is_true(wl, "Finished")
        and not (wl.get("metadata") or {}).get("deletionTimestamp")
    )


def _queue_order(wl: Mapping[str, Any]) -> tuple[int, str, str]:
    """Kueue's BestEffortFIFO order within a ClusterQueue: higher priority first, then older; a
    Workload preempted to reclaim quota while its queue borrowed queues from when it was preempted."""
    meta = wl.get("metadata") or {}
    stamp = str(meta.get("creationTimestamp") or "")
    preempted = _condition(wl, "Preempted")
    if (
        preempted
        and preempted.get("status") == "True"
        and preempted.get("reason") == "InCohortReclaimWhileBorrowing"
    ):
        stamp = str(preempted.get("lastTransitionTime") or stamp)
    return -int((wl.get("spec") or {}).get("priority") or 0), stamp, str(meta.get("name") or "")


def kueue_wait(pod_uid: str, workloads: Iterable[Mapping[str, Any]]) -> KueueWait | None:
    """The wait of the pod `pod_uid` from its namespace's Workloads; None when no pending Workload
    owns it (Kueue has not made one yet, or admitted it). The package's ClusterQueue selects its
    namespace only, so the namespace's pending Workloads of the same LocalQueue are the whole queue."""
    workloads = list(workloads)
    mine = next(
        (
            wl
            for wl in workloads
            if any(o.get("uid") == pod_uid for o in (wl.get("metadata") or {}).get("ownerReferences") or [])
        ),
        None,
    )
    if mine is None or not _pending(mine):
        return None
    queue = str((mine.get("spec") or {}).get("queueName") or "")
    ahead = sorted(
        (wl for wl in workloads if _pending(wl) and (wl.get("spec") or {}).get("queueName") == queue),
        key=_queue_order,
    )
    reserved = _condition(mine, "QuotaReserved")
    return KueueWait(
        workload=str(mine["metadata"]["name"]),
        local_queue=queue,
        position=1 + [_queue_order(w) for w in ahead].index(_queue_order(mine)),
        pending=len(ahead),
        message=str((reserved or {}).get("message") or ""),
    )
