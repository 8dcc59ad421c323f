"""Judging the processes on a node's GPUs against the slices they belong to.

The shim runs in the tenant's address space, so a process that loads the CUDA driver library by
another way (a renamed copy, `dlmopen`, a static driver) allocates past its slice. The node agent
sees every GPU process from the host: NVML lists host PIDs, /proc/<pid>/cgroup names the pod (the
kubelet's cgroup path holds the pod UID), the pod names its claims, and the agent's checkpoint says
which claim holds which slice of which GPU. This module is the pure part: given who each process
belongs to, which processes break which slice, and which of them may be stopped.

- A process of a pod that holds slices on the process's GPU is counted against those slices: it may
  use the memory of any slice its pod holds there (the shim's limit is per slice, shared by its
  processes). Pods may hold overlapping sets of slices ({shared}, {m1}, {m1, shared}), so the
  question is whether the processes' memory can be spread over the slices, each process within the
  slices its pod holds, with no slice past its size: a flow from processes to slices. Where it
  cannot (the minimum cut: processes whose slices together are smaller than what they hold), those
  slices are violated; under `Stop` the largest of those processes are stopped until the rest fits.
- Any other process on a GPU that holds slices is "unknown": a host process, a pod without a claim
  for that GPU, or one the agent could not attribute (its /proc was unreadable, its pod is not on
  this node). It is reported on every slice of that GPU, never stopped: the agent is not certain
  whose it is.
- A process on a GPU that holds no slice harms no slice; it is returned with no slices, for the log.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from gpuslice.api.package import OnViolation


class ViolationKind(StrEnum):
    """What the agent's out-of-band NVML check found (also the `kind` label of
    gpuslice_slice_violations_total)."""

    #: NVML shows a slice's processes using more GPU memory than the slice holds (a shim bypass).
    MEMORY_OVER_SLICE = "memory_over_slice"
    #: A process on a slice's GPU that belongs to no prepared slice.
    UNKNOWN_PROCESS = "unknown_process"


KIND_OVER = ViolationKind.MEMORY_OVER_SLICE
KIND_UNKNOWN = ViolationKind.UNKNOWN_PROCESS


@dataclass(frozen=True)
class GpuProcess:
    """One process NVML lists on a GPU (host PID, as the agent sees it)."""

    gpu_uuid: str
    pid: int
    used_bytes: int


@dataclass(frozen=True)
class SliceClaim:
    """A claim prepared on this node: one slice of one GPU."""

    uid: str
    key: str  # namespace/name it is reported under (its GpuSlice, or the claim itself)
    gpu_uuid: str
    limit_bytes: int
    on_violation: OnViolation = OnViolation.STOP


@dataclass(frozen=True)
class Owner:
    """Whose a host process is, from its /proc entry.

    `pod_uid` None and `certain`: in no pod's cgroup (a host process). `certain` False: /proc could
    not be read or named more than one pod; the process is treated as unknown.
    """

    pod_uid: str | None
    certain: bool = True


@dataclass(frozen=True)
class PodClaims:
    """A pod on this node and the UIDs of the claims it holds (from its spec and status)."""

    namespace: str
    name: str
    claim_uids: frozenset[str]


@dataclass(frozen=True)
class Finding:
    gpu_uuid: str
    kind: ViolationKind
    pids: tuple[int, ...]
    used_bytes: int
    allowed_bytes: int
    slices: tuple[str, ...]  # report keys of the slices affected (empty: the GPU holds none)
    stop: tuple[int, ...]  # pids to SIGKILL (only certain attributions under Stop)
    message: str


def _mib(n: int) -> str:
    return f"{n >> 20} MiB"


def _to_stop(procs: Sequence[GpuProcess], allowed: int) -> tuple[int, ...]:
    """Largest first, until what remains fits the slices."""
    remaining = sum(p.used_bytes for p in procs)
    out: list[int] = []
    for p in sorted(procs, key=lambda p: (-p.used_bytes, p.pid)):
        if remaining <= allowed:
            break
        out.append(p.pid)
        remaining -= p.used_bytes
    return tuple(sorted(out))


def _why_unknown(pid: int, owner: Owner | None, pod: PodClaims | None) -> str:
    if owner is None or not owner.certain:
        return f"process {pid} could not be attributed to a pod (its /proc entry is gone or ambiguous)"
    if owner.pod_uid is None:
        return f"process {pid} belongs to no pod (a host process)"
    if pod is None:
        return f"process {pid} belongs to pod UID {owner.pod_uid}, which is not on this node"
    return f"process {pid} belongs to pod {pod.namespace}/{pod.name}, which holds no slice of this GPU"


def judge(
    processes: Iterable[GpuProcess],
    owners: Mapping[int, Owner],
    pods: Mapping[str, PodClaims],
    claims: Sequence[SliceClaim],
) -> list[Finding]:
    """Every violation on this node's GPUs: slices whose processes hold more than the slices, and
    unknown processes on GPUs that hold slices (see the module docstring)."""
    by_gpu: dict[str, list[SliceClaim]] = {}
    for c in claims:
        by_gpu.setdefault(c.gpu_uuid, []).append(c)
    procs_by_gpu: dict[str, list[GpuProcess]] = {}
    for p in processes:
        procs_by_gpu.setdefault(p.gpu_uuid, []).append(p)
    found: list[Finding] = []
    for uuid, procs in sorted(procs_by_gpu.items()):
        on_gpu = {c.uid: c for c in by_gpu.get(uuid, [])}
        keys = tuple(sorted({c.key for c in on_gpu.values()}))
        # group the attributed processes by the set of this GPU's slices their pod holds
        groups: dict[tuple[str, ...], list[GpuProcess]] = {}
        for p in sorted(procs, key=lambda p: p.pid):
            owner = owners.get(p.pid)
            pod = pods.get(owner.pod_uid) if owner and owner.certain and owner.pod_uid else None
            mine = tuple(sorted(pod.claim_uids & on_gpu.keys())) if pod else ()
            if mine:
                groups.setdefault(mine, []).append(p)
                continue
            why = _why_unknown(p.pid, owner, pod)
            if not keys:
                message = f"{why}; it holds {_mib(p.used_bytes)} on GPU {uuid}, which holds no slice"
            else:
                message = (
                    f"{why}; it holds {_mib(p.used_bytes)} on GPU {uuid}, whose memory is sold to "
                    f"slices {', '.join(keys)}: the agent reports it and does not stop it"
                )
            found.append(Finding(uuid, KIND_UNKNOWN, (p.pid,), p.used_bytes, 0, keys, (), message))
        found.extend(_over(uuid, groups, on_gpu))
    return found


def _over(
    uuid: str, groups: Mapping[tuple[str, ...], Sequence[GpuProcess]], on_gpu: Mapping[str, SliceClaim]
) -> list[Finding]:
    """The slices of one GPU whose processes cannot fit them, one finding per connected region."""
    limits = {u: c.limit_bytes for u, c in on_gpu.items()}
    demand = {g: sum(p.used_bytes for p in members) for g, members in groups.items()}
    deficit = overloaded(demand, limits)
    if not deficit:
        return []
    # Under Stop, the largest processes of the overloaded region go first, until everything fits.
    stoppable = {
        p.pid: (g, p)
        for g in deficit
        for p in groups[g]
        if all(on_gpu[u].on_violation == OnViolation.STOP for u in _region_of(g, deficit))
    }
    left = dict(demand)
    stopped: set[int] = set()
    region = deficit
    while region:
        candidates = [gp for gp in stoppable.values() if gp[0] in region and gp[1].pid not in stopped]
        if not candidates:
            break
        g, p = max(candidates, key=lambda gp: (gp[1].used_bytes, -gp[1].pid))
        stopped.add(p.pid)
        left[g] -= p.used_bytes
        region = overloaded(left, limits)
    out = []
    for component in _components(deficit):
        uids = sorted({u for g in component for u in g})
        slices = [on_gpu[u] for u in uids]
        members = sorted((p for g in component for p in groups[g]), key=lambda p: p.pid)
        allowed = sum(s.limit_bytes for s in slices)
        used = sum(p.used_bytes for p in members)
        stop = all(s.on_violation == OnViolation.STOP for s in slices)
        to_stop = tuple(sorted(p.pid for p in members if p.pid in stopped))
        names = ", ".join(sorted({s.key for s in slices}))
        pids = ", ".join(str(p.pid) for p in members)
        message = (
            f"process(es) {pids} of slice {names} hold {_mib(used)} on GPU {uuid}, more than the "
            f"slice's {_mib(allowed)}: they bypassed the gpuslice shim; "
            + (
                f"the agent stops {', '.join(map(str, to_stop))} (onViolation: Stop)"
                if stop
                else "reported only (onViolation: Report)"
            )
        )
        out.append(
            Finding(
                uuid, KIND_OVER, tuple(p.pid for p in members), used, allowed,
                tuple(sorted({s.key for s in slices})), to_stop, message,
            )
        )  # fmt: skip
    return out


def overloaded(demand: Mapping[tuple[str, ...], int], limits: Mapping[str, int]) -> set[tuple[str, ...]]:
    """The claim sets whose processes cannot all fit: empty when every byte can be placed.

    `demand`: bytes held per claim set (each byte may go to any slice of its set); `limits`: bytes per
    slice. A maximum flow source -> claim set -> slice -> sink (a few nodes: the slices of one GPU);
    what the source still reaches afterwards is the overloaded region: those sets hold more than all
    the slices they can reach together (the minimum cut).
    """
    sets = sorted(g for g, d in demand.items() if d > 0)
    slices = sorted(limits)
    n = len(sets) + len(slices) + 2
    source, sink = 0, n - 1
    slice_node = {u: 1 + len(sets) + i for i, u in enumerate(slices)}
    cap = [[0] * n for _ in range(n)]
    for i, g in enumerate(sets, start=1):
        cap[source][i] = demand[g]
        for u in g:
            if u in slice_node:
                cap[i][slice_node[u]] = demand[g]  # as good as unbounded: never more than it holds
    for u, node in slice_node.items():
        cap[node][sink] = limits[u]

    def search() -> list[int]:
        parent = [-1] * n
        parent[source] = source
        queue = [source]
        for v in queue:
            for w in range(n):
                if parent[w] < 0 and cap[v][w] > 0:
                    parent[w] = v
                    queue.append(w)
        return parent

    while (parent := search())[sink] >= 0:
        amount, w = None, sink
        while w != source:
            amount = cap[parent[w]][w] if amount is None else min(amount, cap[parent[w]][w])
            w = parent[w]
        assert amount is not None
        w = sink
        while w != source:
            cap[parent[w]][w] -= amount
            cap[w][parent[w]] += amount
            w = parent[w]
    return {g for i, g in enumerate(sets, start=1) if parent[i] >= 0}


def _region_of(group: tuple[str, ...], region: set[tuple[str, ...]]) -> set[str]:
    """The slices of the connected part of `region` that `group` is in."""
    for component in _components(region):
        if group in component:
            return {u for g in component for u in g}
    return set(group)


def _components(region: set[tuple[str, ...]]) -> list[list[tuple[str, ...]]]:
    """Claim sets joined by the slices they share, in a stable order."""
    out: list[list[tuple[str, ...]]] = []
    for g in sorted(region):
        touching = [c for c in out if any(set(g) & set(h) for h in c)]
        merged = [g, *(h for c in touching for h in c)]
        out = [c for c in out if c not in touching] + [sorted(merged)]
    return sorted(out)
