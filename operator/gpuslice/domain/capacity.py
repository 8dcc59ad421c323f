"""Package capacity from what nodes publish (ResourceSlices) and what kube-scheduler allocated (claims).

Devices of all packages on one GPU draw from that GPU's shared counters (`memory`, `compute`), so a
slice of package A can be unavailable although no A device is allocated: a 32 GiB slice of another
package may hold the whole card. "Free" therefore counts what kube-scheduler could still place.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuslice import constants as c
from gpuslice.api.quantity import parse_int_quantity


@dataclass(frozen=True)
class PublishedDevice:
    pool: str
    name: str
    package: str | None
    uuid: str | None
    product_name: str | None
    memory_bytes: int | None
    counter_set: str | None
    consumes: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class PublishedSlice:
    """The part of one ResourceSlice of driver gpuslice.io that capacity needs."""

    name: str
    pool: str
    generation: int
    node: str | None
    devices: tuple[PublishedDevice, ...]
    counter_sets: Mapping[str, Mapping[str, int]]


def _attr(attrs: Mapping[str, Any], name: str) -> Any:
    value = attrs.get(name) or attrs.get(f"{c.DRIVER_NAME}/{name}") or {}
    for kind in ("string", "int", "version", "bool"):
        if kind in value:
            return value[kind]
    return None


def summarize_resource_slice(obj: Mapping[str, Any]) -> PublishedSlice | None:
    """None for slices of other drivers."""
    spec = obj.get("spec") or {}
    if spec.get("driver") != c.DRIVER_NAME:
        return None
    pool = spec.get("pool") or {}
    pool_name = str(pool.get("name", ""))
    devices = []
    for dev in spec.get("devices") or []:
        attrs = dev.get("attributes") or {}
        consumption = (dev.get("consumesCounters") or [{}])[0]
        memory = ((dev.get("capacity") or {}).get("memory") or {}).get("value")
        devices.append(
            PublishedDevice(
                pool=pool_name,
                name=dev["name"],
                package=_attr(attrs, "package"),
                uuid=_attr(attrs, "uuid"),
                product_name=_attr(attrs, "productName"),
                memory_bytes=parse_int_quantity(memory) if memory is not None else None,
                counter_set=consumption.get("counterSet"),
                consumes={
                    k: parse_int_quantity(v["value"]) for k, v in (consumption.get("counters") or {}).items()
                },
            )
        )
    counter_sets = {
        cs["name"]: {k: parse_int_quantity(v["value"]) for k, v in (cs.get("counters") or {}).items()}
        for cs in spec.get("sharedCounters") or []
    }
    return PublishedSlice(
        name=str((obj.get("metadata") or {}).get("name", "")),
        pool=pool_name,
        generation=int(pool.get("generation", 0)),
        node=spec.get("nodeName"),
        devices=tuple(devices),
        counter_sets=counter_sets,
    )


def current(slices: Iterable[PublishedSlice]) -> list[PublishedSlice]:
    """Only the newest generation of each pool counts, as for kube-scheduler."""
    slices = list(slices)
    newest: dict[str, int] = {}
    for s in slices:
        newest[s.pool] = max(newest.get(s.pool, s.generation), s.generation)
    return [s for s in slices if s.generation == newest[s.pool]]


@dataclass(frozen=True)
class Capacity:
    gpus: int
    total: int
    allocated: int
    free: int
    memory_per_slice_bytes: int | None


def package_capacity(
    package: str,
    slices: Iterable[PublishedSlice],
    allocated: Iterable[tuple[str, str]],
) -> Capacity:
    """Count GPUs, slices and free slices of one package.

    `allocated` holds (pool, device) of every device of driver gpuslice.io in an allocated claim.
    """
    live = current(slices)
    taken = set(allocated)
    counters: dict[tuple[str, str], dict[str, int]] = {}
    for s in live:
        for name, values in s.counter_sets.items():
            counters[(s.pool, name)] = dict(values)
    used: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    mine: dict[tuple[str, str | None], list[PublishedDevice]] = defaultdict(list)
    memory: int | None = None
    for s in live:
        for d in s.devices:
            if (d.pool, d.name) in taken and d.counter_set:
                for k, v in d.consumes.items():
                    used[(d.pool, d.counter_set)][k] += v
            if d.package == package:
                mine[(d.pool, d.counter_set)].append(d)
                if d.memory_bytes is not None:
                    memory = d.memory_bytes if memory is None else min(memory, d.memory_bytes)
    total = allocated_n = free = 0
    for (pool, cs), devices in mine.items():
        total += len(devices)
        taken_here = sum(1 for d in devices if (d.pool, d.name) in taken)
        allocated_n += taken_here
        open_devices = [d for d in devices if (d.pool, d.name) not in taken]
        if not open_devices:
            continue
        if cs is None or (pool, cs) not in counters:
            # Without a published counter set kube-scheduler cannot place devices that consume it;
            # devices that consume nothing are free when unallocated.
            free += sum(1 for d in open_devices if not d.consumes)
            continue
        remaining = {k: v - used[(pool, cs)].get(k, 0) for k, v in counters[(pool, cs)].items()}
        need = open_devices[0].consumes
        fits = min(
            (remaining.get(k, 0) // v for k, v in need.items() if v > 0),
            default=len(open_devices),
        )
        free += max(0, min(len(open_devices), fits))
    return Capacity(
        gpus=len({(pool, cs) for (pool, cs) in mine}),
        total=total,
        allocated=allocated_n,
        free=free,
        memory_per_slice_bytes=memory,
    )


def allocated_devices(claim: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(pool, device) of every gpuslice.io device in a claim's allocation."""
    alloc = ((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}
    return [(r["pool"], r["device"]) for r in alloc.get("results") or [] if r.get("driver") == c.DRIVER_NAME]
