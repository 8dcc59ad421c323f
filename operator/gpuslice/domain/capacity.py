"""Package capacity from what nodes publish (ResourceSlices) and what kube-scheduler allocated (claims).

Devices of all packages on one GPU draw from that GPU's shared counters (`memory`, `compute`), so a
slice of package A can be unavailable although no A device is allocated: a 32 GiB slice of another
package may hold the whole card. "Free" therefore counts what kube-scheduler could still place.
A card whose devices carry a NoSchedule or NoExecute taint (an unhealthy card, `domain.health`)
places nothing: it counts in `unhealthy_gpus` only, not in GPUs, total, allocated or free.
A Hardware (MIG) package's devices are the placements of its profile on cards of its model (they
carry no package); each placement consumes its own memory slices, so its free count is how many
open placements still fit side by side, taken one after another.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from gpuslice.api.resourceslice import PublishedDevice, PublishedSlice, newest_generation
from gpuslice.domain.health import tainted_effect


@dataclass(frozen=True, slots=True)
class Capacity:
    gpus: int
    total: int
    allocated: int
    free: int
    memory_per_slice_bytes: int | None
    unhealthy_gpus: int = 0
    #: multi-GPU packages: whole products placeable now (`domain.multigpu.products_free`)
    products_free: int | None = None
    #: multi-GPU packages, when no product fits: why (`domain.multigpu.placement`)
    placement_message: str | None = None


def package_capacity(
    package: str,
    slices: Iterable[PublishedSlice],
    allocated: Iterable[tuple[str, str]],
    mig: tuple[str, str] | None = None,
) -> Capacity:
    """Count GPUs, slices and free slices of one package.

    `allocated` holds (pool, device) of every device of driver gpuslice.io in an allocated claim.
    `mig`: (gpuModel, migProfile) of a Hardware package, whose devices are matched by those.
    """
    live = newest_generation(slices)
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
            if (d.package == package) if mig is None else ((d.product_name, d.mig_profile) == mig):
                mine[(d.pool, d.counter_set)].append(d)
                if d.memory_bytes is not None:
                    memory = d.memory_bytes if memory is None else min(memory, d.memory_bytes)
    total = allocated_n = free = 0
    unhealthy = {card for card, ds in mine.items() if any(tainted_effect(d.taints) for d in ds)}
    for (pool, cs), devices in mine.items():
        if (pool, cs) in unhealthy:
            continue
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
        if mig is not None:
            free += _placeable(open_devices, remaining)
            continue
        need = open_devices[0].consumes
        fits = min(
            (remaining.get(k, 0) // v for k, v in need.items() if v > 0),
            default=len(open_devices),
        )
        free += max(0, min(len(open_devices), fits))
    return Capacity(
        gpus=len(set(mine) - unhealthy),
        total=total,
        allocated=allocated_n,
        free=free,
        memory_per_slice_bytes=memory,
        unhealthy_gpus=len(unhealthy),
    )


def _placeable(devices: Iterable[PublishedDevice], remaining: dict[str, int]) -> int:
    """How many of `devices` (each with its own counters) fit in `remaining` together, in order. The
    placements of one MIG profile do not overlap each other, so taking them in order is the most."""
    left, n = dict(remaining), 0
    for d in sorted(devices, key=lambda x: (x.mig_start or 0, x.name)):
        if all(left.get(k, 0) >= v for k, v in d.consumes.items()):
            for k, v in d.consumes.items():
                left[k] -= v
            n += 1
    return n
