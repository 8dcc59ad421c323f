"""Reads what this cluster's API server serves, for `domain.features.decide` (the boundary).

Discovery names the served resources; a gated field the API server drops is seen only in what a
server-side dry-run write returns (nothing is stored): a ResourceSlice pair carrying shared
counters, devices that consume them and a tainted device, and a DeviceClass with an
extendedResourceName. A refused or denied probe leaves its fact unknown (None), never a guess.
"""

from __future__ import annotations

from typing import Any

from gpuslice import constants as c
from gpuslice import kubehttp, logs
from gpuslice.api.resourceslice import dropped_fields, dropped_taints
from gpuslice.domain import features
from gpuslice.domain.features import Platform, PlatformFacts, decide

log = logs.get(__name__)

PROBE_DRIVER = "probe.check.gpuslice.io"
GROUP_VERSIONS = (f"{c.DRA_GROUP}/{c.DRA_VERSION}", "admissionregistration.k8s.io/v1")


def probe_slices(node: str | None = None) -> list[dict[str, Any]]:
    """Two ResourceSlices carrying every gated field gpuslice relies on: one with shared counters;
    one whose devices consume them, allow several allocations, carry a taint.

    node None (`gpuslice check`, an administrator): of a driver nobody serves, for all nodes. node
    given (the agent): of that node, its pool and driver gpuslice.io, the only ResourceSlices the
    agents' own-node admission policy lets it write, in a dry run too."""
    pool = {"name": node or "gpuslice-check", "generation": 1, "resourceSliceCount": 2}
    meta = {"labels": {c.LABEL_MANAGED_BY: c.MANAGED_BY_VALUE}}
    api = c.DRA_GROUP_VERSION
    where: dict[str, Any] = {"nodeName": node} if node else {"allNodes": True}
    driver = c.DRIVER_NAME if node else PROBE_DRIVER

    def name(kind: str) -> str:
        # (nothing is stored; a name no real slice of the node has, so the dry run cannot collide)
        return f"{node}-gpuslice-probe-{kind}" if node else f"gpuslice-check-probe-{kind}"

    counters = {
        "apiVersion": api,
        "kind": "ResourceSlice",
        "metadata": {"name": name("counters"), **meta},
        "spec": {
            "driver": driver,
            **where,
            "pool": pool,
            "sharedCounters": [{"name": "gpu-0", "counters": {"memory": {"value": "32Gi"}}}],
        },
    }
    devices = {
        "apiVersion": api,
        "kind": "ResourceSlice",
        "metadata": {"name": name("devices"), **meta},
        "spec": {
            "driver": driver,
            **where,
            "pool": pool,
            "devices": [
                {
                    "name": "partition",
                    "consumesCounters": [{"counterSet": "gpu-0", "counters": {"memory": {"value": "8Gi"}}}],
                    "taints": [{"key": f"{c.API_GROUP}/probe", "value": "x", "effect": "NoSchedule"}],
                },
                {
                    "name": "shared",
                    "allowMultipleAllocations": True,
                    "capacity": {"memory": {"value": "32Gi"}},
                },
            ],
        },
    }
    return [counters, devices]


def probe_device_class() -> dict[str, Any]:
    return {
        "apiVersion": c.DRA_GROUP_VERSION,
        "kind": "DeviceClass",
        "metadata": {"name": "gpuslice-check-probe"},
        "spec": {"extendedResourceName": f"{c.API_GROUP}/gpuslice-check-probe"},
    }


async def _served(api: kubehttp.Client) -> frozenset[str]:
    out: set[str] = set()
    for gv in GROUP_VERSIONS:
        try:
            listing = await api.get(f"/apis/{gv}")
        except kubehttp.ApiError as exc:
            if exc.status != 404:
                raise
            continue
        out.update(f"{gv}/{r['name']}" for r in listing.get("resources") or [] if "/" not in r["name"])
    return frozenset(out)


async def _dry_run(api: kubehttp.Client, plural: str, body: dict[str, Any]) -> dict[str, Any] | None:
    try:
        stored: dict[str, Any] = await api.request(
            "POST", kubehttp.path(c.DRA_GROUP, c.DRA_VERSION, plural), body, params={"dryRun": "All"}
        )
        return stored
    except kubehttp.ApiError as exc:
        log.warning("a dry-run probe was refused", kind=body["kind"], status=exc.status, reason=exc.reason)
        return None


async def _scheduler_reads_taint_rules(api: kubehttp.Client) -> bool | None:
    try:
        role = await api.get("/apis/rbac.authorization.k8s.io/v1/clusterroles/system:kube-scheduler")
    except kubehttp.ApiError:
        return None  # not allowed to read it, or a platform without the bootstrap roles
    return any(
        "devicetaintrules" in (r.get("resources") or []) and c.DRA_GROUP in (r.get("apiGroups") or [])
        for r in role.get("rules") or []
    )


async def read_facts(
    api: kubehttp.Client, *, device_class: bool = True, slices: bool = True, node: str | None = None
) -> PlatformFacts:
    """device_class, slices: whether to probe with a dry-run DeviceClass, ResourceSlices (each needs
    create on it: the agent may not write DeviceClasses, the operator not ResourceSlices). node: the
    agent's node, whose ResourceSlices alone its admission policy admits (probe_slices)."""
    version = await api.get("/version")
    served = await _served(api)
    dropped: tuple[str, ...] | None = None
    untainted: tuple[str, ...] | None = None
    extended: bool | None = None
    if f"{c.DRA_GROUP}/{c.DRA_VERSION}/resourceslices" in served:
        sent = probe_slices(node) if slices else []
        stored = [await _dry_run(api, "resourceslices", b) for b in sent]
        if sent and all(s is not None for s in stored):
            pairs = [(b["spec"], (s or {}).get("spec") or {}) for b, s in zip(sent, stored, strict=True)]
            dropped = tuple(p for a, b in pairs for p in dropped_fields(a, b))
            untainted = tuple(d for a, b in pairs for d in dropped_taints(a, b))
        dc = await _dry_run(api, "deviceclasses", probe_device_class()) if device_class else None
        if dc is not None:
            extended = "extendedResourceName" in (dc.get("spec") or {})
    return PlatformFacts(
        scheduler_reads_taint_rules=await _scheduler_reads_taint_rules(api),
        git_version=features.served_version(version),
        served=served,
        dropped_slice_fields=dropped,
        dropped_taints=untainted,
        extended_resource_kept=extended,
    )


async def read_platform(
    api: kubehttp.Client, *, device_class: bool = True, slices: bool = True, node: str | None = None
) -> Platform:
    return decide(await read_facts(api, device_class=device_class, slices=slices, node=node))


def log_platform(platform: Platform, component: str) -> None:
    """One line per feature that is off, and one for a version gpuslice is not tested on."""
    if platform.version_problem:
        log.error("unsupported Kubernetes version", component=component, message=platform.version_problem)
    for f in platform.off:
        log.warning(
            "Kubernetes feature off", component=component, version=platform.version, feature=f.name,
            gate=f.gate, why=f.reason,
        )  # fmt: skip
    if not platform.off and not platform.version_problem:
        log.info("Kubernetes features", component=component, message=platform.summary())
