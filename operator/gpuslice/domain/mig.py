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
from typing import TYPE_CHECKING, Any, Final

from gpuslice.api.quantity import parse_int_quantity

if TYPE_CHECKING:
    from gpuslice.api.package import GpuPackageSpec

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


# ---------------------------------------------------------------- memory size -> profile
# A Hardware package may name a memory size (spec.isolation.memory) instead of a profile: the
# product is then the smallest GPU instance profile of its card model whose memory holds that size.
# The operator decides this before any node is asked (the DeviceClass selects the profile by name),
# so it works from the profile tables of the models NVIDIA documents (MIG User Guide, "Supported MIG
# Profiles"), the same the driver double serves; a test holds the two equal.


@dataclass(frozen=True)
class ProfileSize:
    name: str
    compute_slices: int
    memory_mib: int  # what nvmlDeviceGetGpuInstanceProfileInfo reports: less than the name's "gb"


def _table(*rows: tuple[str, int, int]) -> tuple[ProfileSize, ...]:
    return tuple(ProfileSize(*r) for r in rows)


_A100_40GB = _table(
    ("1g.5gb", 1, 4864), ("1g.5gb+me", 1, 4864), ("1g.10gb", 1, 9856), ("2g.10gb", 2, 9856),
    ("3g.20gb", 3, 19968), ("4g.20gb", 4, 19968), ("7g.40gb", 7, 40192),
)  # fmt: skip
_A100_80GB = _table(
    ("1g.10gb", 1, 9728), ("1g.10gb+me", 1, 9728), ("1g.20gb", 1, 19968), ("2g.20gb", 2, 19968),
    ("3g.40gb", 3, 40192), ("4g.40gb", 4, 40192), ("7g.80gb", 7, 80896),
)  # fmt: skip
_H100_80GB = _table(
    ("1g.10gb", 1, 9984), ("1g.10gb+me", 1, 9984), ("1g.20gb", 1, 20096), ("2g.20gb", 2, 20096),
    ("3g.40gb", 3, 40448), ("4g.40gb", 4, 40448), ("7g.80gb", 7, 81152),
)  # fmt: skip

#: GPU instance profiles by the model name NVML reports (GpuPackage spec.gpuModel).
PROFILE_TABLES: Final[Mapping[str, tuple[ProfileSize, ...]]] = {
    "NVIDIA A100-SXM4-40GB": _A100_40GB,
    "NVIDIA A100-PCIE-40GB": _A100_40GB,
    "NVIDIA A100-SXM4-80GB": _A100_80GB,
    "NVIDIA H100 80GB HBM3": _H100_80GB,
}


@dataclass(frozen=True)
class ProfileChoice:
    """The profile a memory size maps to, or why none does (`profile` None, `message` says)."""

    profile: ProfileSize | None
    message: str


def _gib(mib: int) -> str:
    return f"{mib / 1024:.2f} GiB ({mib} MiB)"


def profile_for_memory(gpu_model: str, memory_bytes: int) -> ProfileChoice:
    """The smallest profile of `gpu_model` whose memory holds `memory_bytes`: least memory, then
    fewest compute slices (3g.40gb before 4g.40gb); a "+me" profile only where nothing else is
    (it also takes the card's one media extension)."""
    table = PROFILE_TABLES.get(gpu_model)
    if table is None:
        known = ", ".join(sorted(PROFILE_TABLES))
        return ProfileChoice(
            None,
            f"isolation.memory: gpuslice has no MIG profile table for {gpu_model!r} (it knows {known}); "
            "name the profile in spec.migProfile instead",
        )
    want_mib = -(-memory_bytes // (1024 * 1024))
    fits = [p for p in table if p.memory_mib >= want_mib]
    if not fits:
        largest = max(table, key=lambda p: p.memory_mib)
        return ProfileChoice(
            None,
            f"isolation.memory {_gib(want_mib)} is more than any MIG instance of {gpu_model} holds: "
            f"the largest, {largest.name}, has {_gib(largest.memory_mib)}",
        )
    best = min(fits, key=lambda p: (p.memory_mib, p.compute_slices, p.name.endswith("+me")))
    return ProfileChoice(
        best,
        f"isolation.memory {_gib(want_mib)} maps to {best.name} ({_gib(best.memory_mib)}), the smallest "
        f"MIG profile of {gpu_model} that holds it",
    )


def profile_choice(spec: GpuPackageSpec) -> ProfileChoice | None:
    """For a Hardware package sized by isolation.memory: the profile it maps to, or why none does."""
    if not spec.hardware or spec.mig_profile is not None or spec.isolation.memory is None:
        return None
    return profile_for_memory(spec.gpu_model, parse_int_quantity(spec.isolation.memory))


def package_profile(spec: GpuPackageSpec) -> str | None:
    """The MIG profile one slice of the package is: migProfile, or the one isolation.memory maps to
    (None: a Software package, or no profile of gpuModel holds the memory)."""
    choice = profile_choice(spec)
    if choice is None:
        return spec.mig_profile
    return choice.profile.name if choice.profile else None
