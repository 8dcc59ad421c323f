"""MIG placements as DRA partitionable devices (pure): what a card in MIG mode offers kube-scheduler.

A MIG-capable card has 8 memory slices and 7 compute slices; a GPU instance profile (1g.10gb,
3g.40gb, ...) can be created at a few placements, each a run of memory slices. Every placement of
every profile becomes one device that consumes, from the card's MIG counter set, one unit of each
memory slice it covers, its profile's compute slices, and (a "+me" profile) the card's single media
extension. kube-scheduler therefore never allocates two devices whose placements overlap, nor more
compute slices or media extensions than the card has: exactly the instances the driver can create
side by side. The profiles and placements are the driver's (read through NVML), not a table here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

MEMORY_SLICES: Final = 8
COMPUTE_SLICES: Final = 7
COUNTER_COMPUTE_SLICES: Final = "compute-slices"
COUNTER_MEDIA: Final = "media-extensions"


def memory_slice_counter(k: int) -> str:
    return f"memory-slice-{k}"


@dataclass(frozen=True)
class MigProfile:
    """A GPU instance profile as the driver reports it (nvmlDeviceGetGpuInstanceProfileInfoV and
    nvmlDeviceGetGpuInstancePossiblePlacements_v2)."""

    id: int  # the driver's profile id (19 for 1g.10gb on an A100-80GB)
    name: str  # "1g.10gb", "1g.10gb+me"
    slices: int  # compute slices
    instances: int  # how many of it fit on the card
    memory_mib: int
    multiprocessors: int
    placements: tuple[tuple[int, int], ...]  # (first memory slice, memory slices)

    @property
    def media(self) -> bool:
        """Whether it takes the card's media extension (the "+me" profiles; one per card)."""
        return self.name.endswith("+me")


@dataclass(frozen=True)
class MigPlacement:
    """One device: a profile at one placement on one card."""

    gpu_index: int
    profile: MigProfile
    start: int
    size: int

    def counters(self) -> dict[str, int]:
        """What it consumes of the card's MIG counter set."""
        out = {memory_slice_counter(k): 1 for k in range(self.start, self.start + self.size)}
        out[COUNTER_COMPUTE_SLICES] = self.profile.slices
        if self.profile.media:
            out[COUNTER_MEDIA] = 1
        return out


def counter_set_name(gpu_index: int) -> str:
    return f"gpu-{gpu_index}-mig"


def counter_set(gpu_index: int) -> dict[str, Any]:
    """The card's MIG counters: each memory slice once, its compute slices, one media extension."""
    counters = {memory_slice_counter(k): {"value": "1"} for k in range(MEMORY_SLICES)}
    counters[COUNTER_COMPUTE_SLICES] = {"value": str(COMPUTE_SLICES)}
    counters[COUNTER_MEDIA] = {"value": "1"}
    return {"name": counter_set_name(gpu_index), "counters": counters}


_NOT_LABEL = re.compile(r"[^a-z0-9]+")


def device_name(p: MigPlacement) -> str:
    """`gpu-<index>-mig-<profile>-<start>` as a DNS label ("gpu-0-mig-1g-10gb-me-6")."""
    return f"gpu-{p.gpu_index}-mig-{_NOT_LABEL.sub('-', p.profile.name.lower()).strip('-')}-{p.start}"


def placements(gpu_index: int, profiles: Iterable[MigProfile]) -> list[MigPlacement]:
    """Every profile at every placement the driver lists for it, by profile id then start."""
    return [
        MigPlacement(gpu_index, prof, start, size)
        for prof in sorted(profiles, key=lambda q: q.id)
        for start, size in sorted(prof.placements)
    ]


def device(p: MigPlacement, attributes: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The DRA device of a placement: its profile and placement as attributes (plus the card's
    `attributes`), the instance's memory as capacity, the counters it consumes."""
    return {
        "name": device_name(p),
        "attributes": {
            **dict(attributes or {}),
            "migProfile": {"string": p.profile.name},
            "migProfileId": {"int": p.profile.id},
            "migPlacementStart": {"int": p.start},
            "migPlacementSize": {"int": p.size},
            "multiprocessors": {"int": p.profile.multiprocessors},
            "gpuIndex": {"int": p.gpu_index},
        },
        "capacity": {"memory": {"value": str(p.profile.memory_mib * 1024 * 1024)}},
        "consumesCounters": [
            {
                "counterSet": counter_set_name(p.gpu_index),
                "counters": {k: {"value": str(v)} for k, v in p.counters().items()},
            }
        ],
    }


def fits_together(chosen: Sequence[MigPlacement]) -> bool:
    """Whether the scheduler's counter arithmetic admits all of `chosen` at once (one card each)."""
    used: dict[tuple[int, str], int] = {}
    for p in chosen:
        for k, v in p.counters().items():
            used[(p.gpu_index, k)] = used.get((p.gpu_index, k), 0) + v
    limit = {COUNTER_COMPUTE_SLICES: COMPUTE_SLICES, COUNTER_MEDIA: 1}
    return all(v <= limit.get(k, 1) for (_, k), v in used.items())
