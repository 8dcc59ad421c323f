"""Pure builder: the GPUs of a node + the GpuPackages -> the ResourceSlices the agent publishes.

Every physical GPU becomes a shared counter set (`gpu-<index>`: `memory` = card bytes, `compute` =
100) and, for every GpuPackage whose gpuModel equals the card's NVML product name, `100 // fraction`
partition devices that each consume the slice's memory and compute share from that counter set.
kube-scheduler therefore never places more than one card's memory or compute on a card, whatever
the mix of packages. Since Kubernetes 1.35 a ResourceSlice holds either counters or devices, so the
pool (one per node, named after the node) is split into counter slices (at most 8 counter sets each)
and device slices (at most 64 devices each, the limit when devices consume counters).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from gpuslice import constants as c
from gpuslice.agent.gpus import GpuInfo, semver
from gpuslice.api.package import GpuPackageSpec
from gpuslice.api.resourceslice import parse_resource_slices
from gpuslice.domain import mig
from gpuslice.domain.multigpu import PCIE_ROOT_ATTRIBUTE

#: Per-slice limits from k8s.io/api/resource/v1 (ResourceSliceMaxCounterSets,
#: ResourceSliceMaxDevicesWithAdvancedFeatures).
MAX_COUNTER_SETS_PER_SLICE: Final = 8
MAX_DEVICES_PER_SLICE: Final = 64
COMPUTE_TOTAL: Final = 100
COUNTER_MEMORY: Final = "memory"
COUNTER_COMPUTE: Final = "compute"
ANNOTATION_CONTENT_HASH: Final = f"{c.ANNOTATION_PREFIX}content-hash"

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_LABEL_MAX = 63
_OBJECT_NAME_MAX = 253


@dataclass(frozen=True)
class Package:
    """A GpuPackage as the builder needs it: its name and validated spec."""

    name: str
    spec: GpuPackageSpec


def counter_set_name(gpu: GpuInfo) -> str:
    return f"gpu-{gpu.index}"


def _short_hash(text: str, n: int = 8) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def device_name(gpu: GpuInfo, package: str, k: int) -> str:
    """`gpu-<index>-<package>-<k>`, a DNS label. Package names are DNS subdomains (dots, up to 253
    characters), so names that would not be a label get a shortened, hash-suffixed package part."""
    plain = f"gpu-{gpu.index}-{package}-{k}"
    if len(plain) <= _DNS_LABEL_MAX and _DNS_LABEL.match(plain):
        return plain
    prefix, suffix = f"gpu-{gpu.index}-", f"-{_short_hash(package)}-{k}"
    room = _DNS_LABEL_MAX - len(prefix) - len(suffix)
    part = re.sub(r"[^a-z0-9-]", "-", package.lower())[:room].strip("-")
    return f"{prefix}{part}{suffix}" if part else f"{prefix}{suffix[1:]}"


def slice_name(node: str, kind: str, index: int) -> str:
    """ResourceSlice object name: `<node>-gpuslice-<kind>-<index>`, within the 253-character limit."""
    name = f"{node}-gpuslice-{kind}-{index}"
    if len(name) <= _OBJECT_NAME_MAX:
        return name
    tail = f"-{_short_hash(node)}-gpuslice-{kind}-{index}"
    return node[: _OBJECT_NAME_MAX - len(tail)].rstrip("-.") + tail


def matching_packages(gpu: GpuInfo, packages: Iterable[Package]) -> list[Package]:
    """Packages cut from this card's model, ordered by name so device names are stable: on a card in
    MIG mode only Hardware packages (the driver has split the card; a software slice of it would span
    instances), on any other card only Software ones."""
    in_mig = gpu.mig_profiles is not None
    return sorted(
        (p for p in packages if p.spec.gpu_model == gpu.product_name and p.spec.hardware == in_mig),
        key=lambda p: p.name,
    )


def _card_attributes(gpu: GpuInfo) -> dict[str, Any]:
    return {
        "uuid": {"string": gpu.uuid},
        "productName": {"string": gpu.product_name},
        "cudaComputeCapability": {"version": semver(gpu.cuda_compute_capability)},
        "driverVersion": {"version": semver(gpu.driver_version)},
        "cudaDriverVersion": {"version": semver(gpu.cuda_driver_version)},
        "pciBusId": {"string": gpu.pci_bus_id},
    }


def _mig_devices(
    gpu: GpuInfo, packages: Sequence[Package], taints: Sequence[dict[str, Any]] = ()
) -> list[dict[str, Any]]:
    """One device per placement of every MIG profile a Hardware package of this model sells (a profile
    the card's driver lacks offers nothing), each consuming its memory slices and compute slices of the
    card's MIG counter set. The devices carry `migProfile`, not `package`: two packages of one profile
    sell the same placements, and the scheduler's counters keep them from overlapping."""
    wanted = {mig.package_profile(p.spec) for p in packages if p.spec.hardware}
    profiles = [q for q in gpu.mig_profiles or () if q.name in wanted]
    out = []
    layout = set(gpu.mig_layout) if gpu.mig_layout is not None else None
    for p in mig.placements(gpu.index, profiles):
        if layout is not None and (p.profile.name, p.start) not in layout:
            continue  # a static layout sells the instances the platform made, no other placement
        attrs = _card_attributes(gpu) | ({"migStatic": {"bool": True}} if layout is not None else {})
        d = mig.device(p, attrs)
        if taints:
            d["taints"] = [dict(t) for t in taints]
        out.append(d)
    return out


def topology_attributes(gpu: GpuInfo) -> dict[str, Any]:
    """The card's place on the node, for multi-GPU products' `matchAttribute` constraints: the PCIe
    root under Kubernetes' standard name, NUMA node and NVLink peers under the driver's domain.
    Left out where the node does not show them (a constraint on them then matches no such card)."""
    out: dict[str, Any] = {}
    if gpu.pcie_root:
        out[PCIE_ROOT_ATTRIBUTE] = {"string": gpu.pcie_root}
    if gpu.numa_node is not None and gpu.numa_node >= 0:
        out["numaNode"] = {"int": gpu.numa_node}
    if gpu.nvlink_peers:
        out["nvlinkPeers"] = {"string": ",".join(str(i) for i in sorted(gpu.nvlink_peers))}
    return out


def _device(gpu: GpuInfo, package: Package, k: int, taints: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    memory = package.spec.memory_bytes(gpu.memory_bytes)
    return {
        "name": device_name(gpu, package.name, k),
        "attributes": {
            **topology_attributes(gpu),
            "package": {"string": package.name},
            "uuid": {"string": gpu.uuid},
            "productName": {"string": gpu.product_name},
            "cudaComputeCapability": {"version": semver(gpu.cuda_compute_capability)},
            "driverVersion": {"version": semver(gpu.driver_version)},
            "cudaDriverVersion": {"version": semver(gpu.cuda_driver_version)},
            "gpuIndex": {"int": gpu.index},
            "pciBusId": {"string": gpu.pci_bus_id},
            "computeShare": {"int": package.spec.effective_compute_share},
            **({"computeBurst": {"bool": True}} if package.spec.compute_burst else {}),
        },
        "capacity": {"memory": {"value": str(memory)}},
        "consumesCounters": [
            {
                "counterSet": counter_set_name(gpu),
                "counters": {
                    COUNTER_MEMORY: {"value": str(memory)},
                    COUNTER_COMPUTE: {"value": str(package.spec.effective_compute_share)},
                },
            }
        ],
        **({"taints": [dict(t) for t in taints]} if taints else {}),
    }


def devices_for(
    gpu: GpuInfo, packages: Iterable[Package], taints: Sequence[dict[str, Any]] = ()
) -> list[dict[str, Any]]:
    """The partition devices one card offers, each with the card's DRA device `taints` (an unhealthy
    card). A package whose slice would have no memory on this card (a tiny card and a tiny
    fraction) offers nothing rather than a zero-sized device."""
    if gpu.mig_profiles is not None:
        return _mig_devices(gpu, matching_packages(gpu, packages), taints)
    out: list[dict[str, Any]] = []
    for package in matching_packages(gpu, packages):
        if package.spec.memory_bytes(gpu.memory_bytes) <= 0:
            continue
        out.extend(_device(gpu, package, k, taints) for k in range(package.spec.slices_per_card()))
    return out


def _counter_sets(gpu: GpuInfo) -> list[dict[str, Any]]:
    """The card's counter set; a card in MIG mode has its MIG counter set (memory and compute slices)
    instead, so nothing can consume the card as a whole."""
    return [mig.counter_set(gpu.index)] if gpu.mig_profiles is not None else [_counter_set(gpu)]


def _counter_set(gpu: GpuInfo) -> dict[str, Any]:
    return {
        "name": counter_set_name(gpu),
        "counters": {
            COUNTER_MEMORY: {"value": str(gpu.memory_bytes)},
            COUNTER_COMPUTE: {"value": str(COMPUTE_TOTAL)},
        },
    }


def _chunks(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def build_specs(
    node: str,
    gpus: Sequence[GpuInfo],
    packages: Iterable[Package],
    taints: Mapping[str, Sequence[dict[str, Any]]] | None = None,
) -> list[tuple[str, dict[str, Any]]]:
    """(name, spec) of every slice of the node's pool, with pool generation 0 (set by `with_generation`).
    `taints`: the DRA device taints of each card (by UUID) that every device of the card carries.

    A node whose GPUs match no package still publishes its counter sets: that keeps the GPU facts
    visible and makes the pool exist, so adding a package later is a plain republish.
    """
    packages = list(packages)
    ordered = sorted(gpus, key=lambda g: g.index)
    counter_chunks = _chunks([cs for g in ordered for cs in _counter_sets(g)], MAX_COUNTER_SETS_PER_SLICE)
    devices = [d for g in ordered for d in devices_for(g, packages, (taints or {}).get(g.uuid, ()))]
    device_chunks = _chunks(devices, MAX_DEVICES_PER_SLICE)
    count = len(counter_chunks) + len(device_chunks)
    pool = {"name": node, "generation": 0, "resourceSliceCount": count}

    def spec(body: dict[str, Any]) -> dict[str, Any]:
        return {"driver": c.DRIVER_NAME, "nodeName": node, "pool": dict(pool), **body}

    specs = [
        (slice_name(node, "counters", i), spec({"sharedCounters": list(chunk)}))
        for i, chunk in enumerate(counter_chunks)
    ]
    specs += [
        (slice_name(node, "devices", i), spec({"devices": list(chunk)}))
        for i, chunk in enumerate(device_chunks)
    ]
    return specs


def content_hash(specs: Sequence[tuple[str, dict[str, Any]]], node_uid: str | None = None) -> str:
    """Identifies what a pool offers (and its owner), independent of its generation: equal hashes need
    no republish."""
    return hashlib.sha256(json.dumps([node_uid, specs], sort_keys=True).encode()).hexdigest()


def with_generation(
    node: str, specs: Sequence[tuple[str, dict[str, Any]]], generation: int, node_uid: str | None = None
) -> list[dict[str, Any]]:
    """Full ResourceSlice objects for server-side apply, all stamped with one pool generation.

    With the Node's uid the slices are owned by the Node, so the garbage collector deletes them
    with it even when the agent is not running."""
    digest = content_hash(specs, node_uid)
    owner = [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid, "controller": True}]
    out = []
    for name, spec in specs:
        body = json.loads(json.dumps(spec))
        body["pool"]["generation"] = generation
        out.append(
            {
                "apiVersion": c.DRA_GROUP_VERSION,
                "kind": "ResourceSlice",
                "metadata": {
                    "name": name,
                    "labels": {
                        c.LABEL_MANAGED_BY: c.MANAGED_BY_VALUE,
                        c.LABEL_NODE: node,
                    },
                    "annotations": {ANNOTATION_CONTENT_HASH: digest},
                    **({"ownerReferences": owner} if node_uid else {}),
                },
                "spec": body,
            }
        )
    return out


@dataclass(frozen=True)
class PublishPlan:
    """What to do to make the published pool equal the desired one."""

    apply: list[dict[str, Any]]
    delete: list[str]

    @property
    def empty(self) -> bool:
        return not self.apply and not self.delete


def plan_publish(
    node: str,
    desired: Sequence[tuple[str, dict[str, Any]]],
    existing: Sequence[dict[str, Any]],
    node_uid: str | None = None,
) -> PublishPlan:
    """Decide a republish from the slices already in the API (any of the pool's, as read back).

    Nothing is written when the same content is already published under one generation. Otherwise
    every desired slice is applied under a generation above any existing one (kube-scheduler then
    ignores the old ones), and slices that are no longer desired are deleted afterwards.
    """
    digest = content_hash(desired, node_uid)
    names = {name for name, _ in desired}
    existing_names = {s["metadata"]["name"] for s in existing}
    generations = {s.generation for s in parse_resource_slices(existing)}
    hashes = {s["metadata"].get("annotations", {}).get(ANNOTATION_CONTENT_HASH) for s in existing}
    if existing and existing_names == names and hashes == {digest} and len(generations) == 1:
        return PublishPlan(apply=[], delete=[])
    generation = max(generations, default=0) + 1
    return PublishPlan(
        apply=with_generation(node, desired, generation, node_uid) if desired else [],
        delete=sorted(existing_names - names),
    )
