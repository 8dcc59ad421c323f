"""DRA ResourceSlices of driver gpuslice.io, as gpuslice reads them back: one parser for every reader.

The node agent writes them (`gpuslice.agent.slices`); the operator counts capacity from them and the
agent's prepare step finds a claimed device's GPU in them. Both read through this module, so device
attributes, quantities and "the newest pool generation wins" are decided once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuslice import constants as c
from gpuslice.api.quantity import parse_int_quantity

#: The value fields of a DRA DeviceAttribute (exactly one is set).
ATTRIBUTE_KINDS = ("string", "int", "version", "bool")


def attribute(attrs: Mapping[str, Any], name: str) -> str | int | bool | None:
    """A device attribute's value by its short name; the qualified `gpuslice.io/<name>` form is the same
    attribute (the API server keeps whichever the publisher wrote)."""
    value = attrs.get(name) or attrs.get(f"{c.DRIVER_NAME}/{name}") or {}
    for kind in ATTRIBUTE_KINDS:
        if kind in value:
            result: str | int | bool = value[kind]
            return result
    return None


def _counters(counters: Mapping[str, Any] | None) -> dict[str, int]:
    return {k: parse_int_quantity(v["value"]) for k, v in (counters or {}).items()}


@dataclass(frozen=True, slots=True)
class PublishedDevice:
    pool: str
    name: str
    package: str | None
    uuid: str | None
    product_name: str | None
    memory_bytes: int | None
    compute_share: int | None
    counter_set: str | None
    consumes: Mapping[str, int] = field(default_factory=dict)
    #: DRA device taints (resource.k8s.io/v1 DeviceTaint: key, value, effect, timeAdded)
    taints: tuple[Mapping[str, Any], ...] = ()
    #: may use idle compute of its card above its share (published only when it may)
    compute_burst: bool = False
    #: topology the agent publishes (multi-GPU products' constraints); None where it does not
    pcie_root: str | None = None
    numa_node: int | None = None
    #: a MIG placement (domain.mig): its profile and first memory slice
    mig_profile: str | None = None
    mig_start: int | None = None
    #: an instance of the platform's static MIG layout: handed out as it is, never made or removed
    mig_static: bool = False


@dataclass(frozen=True, slots=True)
class PublishedSlice:
    """One ResourceSlice of driver gpuslice.io: its pool, generation, devices and counter sets."""

    name: str
    pool: str
    generation: int
    node: str | None
    devices: tuple[PublishedDevice, ...]
    counter_sets: Mapping[str, Mapping[str, int]]


#: Kubernetes' standard attribute for a device's PCIe root complex (also in domain.multigpu).
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"


def _device(pool: str, dev: Mapping[str, Any]) -> PublishedDevice:
    attrs = dev.get("attributes") or {}
    consumption = (dev.get("consumesCounters") or [{}])[0]
    memory = ((dev.get("capacity") or {}).get("memory") or {}).get("value")
    share = attribute(attrs, "computeShare")
    return PublishedDevice(
        pool=pool,
        name=str(dev["name"]),
        package=_text(attribute(attrs, "package")),
        uuid=_text(attribute(attrs, "uuid")),
        product_name=_text(attribute(attrs, "productName")),
        memory_bytes=parse_int_quantity(memory) if memory is not None else None,
        compute_share=int(share) if share is not None else None,
        counter_set=consumption.get("counterSet"),
        consumes=_counters(consumption.get("counters")),
        taints=tuple(dev.get("taints") or ()),
        compute_burst=attribute(attrs, "computeBurst") is True,
        pcie_root=_text(attribute(attrs, PCIE_ROOT)),
        numa_node=int(numa) if isinstance(numa := attribute(attrs, "numaNode"), int) else None,
        mig_profile=_text(attribute(attrs, "migProfile")),
        mig_start=int(start) if (start := attribute(attrs, "migPlacementStart")) is not None else None,
        mig_static=attribute(attrs, "migStatic") is True,
    )


def _text(value: str | int | bool | None) -> str | None:
    return None if value is None else str(value)


def parse_resource_slice(obj: Mapping[str, Any]) -> PublishedSlice | None:
    """None for slices of other drivers."""
    spec = obj.get("spec") or {}
    if spec.get("driver") != c.DRIVER_NAME:
        return None
    pool = spec.get("pool") or {}
    pool_name = str(pool.get("name", ""))
    return PublishedSlice(
        name=str((obj.get("metadata") or {}).get("name", "")),
        pool=pool_name,
        generation=int(pool.get("generation", 0)),
        node=spec.get("nodeName"),
        devices=tuple(_device(pool_name, d) for d in spec.get("devices") or []),
        counter_sets={cs["name"]: _counters(cs.get("counters")) for cs in spec.get("sharedCounters") or []},
    )


def parse_resource_slices(objects: Iterable[Mapping[str, Any]]) -> list[PublishedSlice]:
    return [s for s in map(parse_resource_slice, objects) if s is not None]


def newest_generation(slices: Iterable[PublishedSlice]) -> list[PublishedSlice]:
    """Only the newest generation of each pool counts, as for kube-scheduler."""
    slices = list(slices)
    newest: dict[str, int] = {}
    for s in slices:
        newest[s.pool] = max(newest.get(s.pool, s.generation), s.generation)
    return [s for s in slices if s.generation == newest[s.pool]]


def find_device(slices: Iterable[PublishedSlice], pool: str, device: str) -> PublishedDevice | None:
    """The device as last published in the pool (newest generation), or None."""
    for s in newest_generation(x for x in slices if x.pool == pool):
        for d in s.devices:
            if d.name == device:
                return d
    return None


# --- fields an API server drops when their feature gate is off ---------------------------------------

#: ResourceSlice fields behind a DRA feature gate -> (gate, what it is). On 1.34/1.35 (alpha) and
#: wherever the gate is turned off, the API server silently drops them from what it stores.
GATED_FIELDS: Mapping[str, tuple[str, str]] = {
    "sharedCounters": ("DRAPartitionableDevices", "partitionable devices"),
    "consumesCounters": ("DRAPartitionableDevices", "partitionable devices"),
    "allowMultipleAllocations": ("DRAConsumableCapacity", "consumable capacity"),
}


def dropped_fields(sent: Mapping[str, Any], stored: Mapping[str, Any]) -> list[str]:
    """The gated fields of a ResourceSlice spec that were sent but are missing from what the API
    server returned, as paths (`spec.sharedCounters`, `spec.devices[gpu-0-a-0].consumesCounters`)."""
    out = [f"spec.{k}" for k in ("sharedCounters",) if sent.get(k) and not stored.get(k)]
    kept = {d.get("name"): d for d in stored.get("devices") or []}
    for device in sent.get("devices") or []:
        back = kept.get(device.get("name"), {})
        for key in ("consumesCounters", "allowMultipleAllocations"):
            if device.get(key) and not back.get(key):
                out.append(f"spec.devices[{device.get('name')}].{key}")
    return out


def dropped_gates(paths: Iterable[str]) -> list[str]:
    """The feature gates behind dropped field paths, each once, in a stable order."""
    gates = {GATED_FIELDS[p.rsplit(".", 1)[-1]][0] for p in paths}
    return sorted(gates)


def gates_fix(gates: Iterable[str]) -> str:
    """How to turn the gates on."""
    flag = ",".join(f"{g}=true" for g in gates)
    return (
        f"turn on --feature-gates={flag} on kube-apiserver, kube-scheduler, kube-controller-manager and "
        "every kubelet (on by default from Kubernetes 1.36)"
    )


def dropped_message(paths: Iterable[str]) -> str:
    """What to tell an operator whose API server dropped gated fields."""
    paths = list(paths)
    gates = dropped_gates(paths)
    shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    return (
        f"the API server dropped {shown} from the ResourceSlices it stored: feature gate(s) "
        f"{', '.join(gates)} off, so the devices would not consume the cards' counters and nothing would "
        f"stop two slices being sold on one card's memory: publishing no device; {gates_fix(gates)}"
    )


def dropped_taints(sent: Mapping[str, Any], stored: Mapping[str, Any]) -> list[str]:
    """Devices sent with taints that the API server stored without (DRADeviceTaints off: before 1.37
    it is beta, and off where turned off): an unhealthy card would stay on sale."""
    kept = {d.get("name"): d for d in stored.get("devices") or []}
    return [
        str(d.get("name"))
        for d in sent.get("devices") or []
        if d.get("taints") and not kept.get(d.get("name"), {}).get("taints")
    ]
