"""Who a GPU process is, seen from the host: host PID -> /proc/<pid>/cgroup -> pod UID -> claims.

- NVML lists host PIDs (the agent runs with hostPID; the driver reports the PIDs of its own, the
  host's, namespace). /proc/<pid>/cgroup names the kubelet's pod cgroup: `.../pod<uid>/<container>`
  with the cgroupfs driver, `.../kubepods-<qos>-pod<uid_with_underscores>.slice/...` with systemd.
  The first pod component counts: a container that may create cgroups can only nest them under its
  own pod's, so a deeper `pod<other uid>` is not believed. Under cgroup v1 every hierarchy's line
  must agree.
- The pods on this node (one LIST by field selector, cached per pod UID: a pod's claims never
  change once it runs) give each pod's claims: `spec.resourceClaims` by name, or the generated claim
  named in `status.resourceClaimStatuses`; the checkpoint maps (namespace, name) to the prepared
  claim and its slice.
- Stopping goes through a pidfd, after checking again that the PID is still the process that was
  judged (same start time, same pod): a PID reused in between is never signalled.

The judgement itself is `gpuslice.domain.gpu_processes.judge`.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuslice import logs, procfs
from gpuslice.api.package import OnViolation
from gpuslice.domain.gpu_processes import Finding, GpuProcess, Owner, PodClaims, SliceClaim, judge

if TYPE_CHECKING:
    from gpuslice.agent.kube import Kube

log = logs.get(__name__)

_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
# a whole path component: "pod<uid>" (cgroupfs) or "<anything>-pod<uid>.slice" (systemd)
_POD_COMPONENT = re.compile(rf"^(?:pod|.*-pod)({_UID})(?:\.slice)?$")


def pod_uid_of_path(path: str) -> str | None:
    """The pod UID a kubelet cgroup path names (its first pod component), with dashes."""
    for component in path.split("/"):
        m = _POD_COMPONENT.match(component)
        if m:
            return m.group(1).replace("_", "-")
    return None


def owner_from_cgroup(text: str) -> Owner:
    """Owner of a process from its /proc/<pid>/cgroup (v1: one line per hierarchy; v2: `0::path`)."""
    uids: set[str | None] = set()
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy != "0" and controllers.startswith("name="):
            continue  # named v1 hierarchies (name=systemd) are not the kubelet's
        if hierarchy == "0" and path == "/" and len(uids) > 0:
            continue  # the empty v2 line of a v1 (hybrid) host
        uids.add(pod_uid_of_path(path))
    if not uids:
        return Owner(None, certain=False)
    named = {u for u in uids if u is not None}
    if len(named) > 1:
        return Owner(None, certain=False)  # hierarchies disagree: someone moved it
    if named and None in uids:
        return Owner(None, certain=False)
    return Owner(next(iter(named)) if named else None)


@dataclass(frozen=True)
class Seen:
    """A process as judged: its owner and start time (to tell it from a later one with its PID)."""

    owner: Owner
    start_time: int | None


def read_owner(pid: int, proc: Path = Path("/proc")) -> Seen:
    stat = procfs.read_stat(pid, proc)
    try:
        text = (proc / str(pid) / "cgroup").read_text()
    except OSError:
        return Seen(Owner(None, certain=False), None)
    if stat is None or stat.zombie:
        return Seen(Owner(None, certain=False), None)
    return Seen(owner_from_cgroup(text), stat.start_time)


def read_owners(pids: Iterable[int], proc: Path = Path("/proc")) -> dict[int, Seen]:
    return {pid: read_owner(pid, proc) for pid in set(pids)}


def pod_claim_names(pod: Mapping[str, Any]) -> list[str] | None:
    """Names of the ResourceClaims a pod holds; None while a generated claim is not named yet."""
    statuses = {
        s.get("name"): s.get("resourceClaimName")
        for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []
    }
    out: list[str] = []
    for rc in (pod.get("spec") or {}).get("resourceClaims") or []:
        if rc.get("resourceClaimName"):
            out.append(rc["resourceClaimName"])
        elif rc.get("resourceClaimTemplateName"):
            name = statuses.get(rc.get("name"))
            if name is None and rc.get("name") not in statuses:
                return None  # the controller has not created it yet
            if name:  # None in status: the template produced no claim
                out.append(name)
    # A container's `resources.limits: {gpuslice.io/<package>: 1}`: the claim kube-scheduler made.
    extended = ((pod.get("status") or {}).get("extendedResourceClaimStatus") or {}).get("resourceClaimName")
    if extended:
        out.append(extended)
    return out


@dataclass(frozen=True)
class _Pod:
    namespace: str
    name: str
    claims: tuple[str, ...]  # claim names

    def resolve(self, claim_uids: Mapping[tuple[str, str], str]) -> PodClaims:
        keys = ((self.namespace, n) for n in self.claims)
        return PodClaims(self.namespace, self.name, frozenset(claim_uids[k] for k in keys if k in claim_uids))


def pod_claims(pod: Mapping[str, Any], claim_uids: Mapping[tuple[str, str], str]) -> PodClaims | None:
    """A pod's claims as UIDs of claims prepared on this node (`claim_uids`: (namespace, name) -> uid)."""
    p = _pod(pod)
    return p.resolve(claim_uids) if p else None


def _pod(pod: Mapping[str, Any]) -> _Pod | None:
    meta = pod.get("metadata") or {}
    names = pod_claim_names(pod)
    return None if names is None else _Pod(meta.get("namespace", ""), meta.get("name", ""), tuple(names))


#: lists the pods bound to this node (dicts as the API server returns them)
ListPods = Callable[[], Awaitable[Sequence[Mapping[str, Any]]]]


@dataclass
class PodDirectory:
    """Pod UID -> the pod's claims, listed from the API only when a UID not seen before shows up
    (and a UID not found is looked for again at most every `miss_ttl` seconds)."""

    list_pods: ListPods
    miss_ttl: float = 30.0
    _pods: dict[str, _Pod] = field(default_factory=dict)
    _missing: dict[str, float] = field(default_factory=dict)

    async def lookup(
        self, pod_uids: Iterable[str], claim_uids: Mapping[tuple[str, str], str]
    ) -> dict[str, PodClaims]:
        want = set(pod_uids)
        now = time.monotonic()
        stale = {u for u in want - self._pods.keys() if now - self._missing.get(u, -1e9) >= self.miss_ttl}
        if stale:
            listed: dict[str, _Pod] = {}
            for obj in await self.list_pods():
                uid = (obj.get("metadata") or {}).get("uid")
                pod = _pod(obj)
                if uid and pod is not None:
                    listed[uid] = pod
            self._pods = listed  # pods gone from the node are forgotten with the relist
            for uid in stale - listed.keys():
                self._missing[uid] = now
            for uid in list(self._missing):
                if uid in listed or now - self._missing[uid] > 10 * self.miss_ttl:
                    del self._missing[uid]
        return {u: self._pods[u].resolve(claim_uids) for u in want if u in self._pods}


def node_pod_lister(kube: Kube, node: str) -> ListPods:
    """Lists the pods bound to `node` (one request; the agent's role may list pods)."""

    async def list_pods() -> Sequence[Mapping[str, Any]]:
        return await kube.list_node_pods(node)

    return list_pods


async def find_violations(
    processes: Sequence[GpuProcess],
    claims: Sequence[SliceClaim],
    claim_uids: Mapping[tuple[str, str], str],
    pods: PodDirectory,
    proc: Path = Path("/proc"),
) -> tuple[list[Finding], dict[int, Seen]]:
    """Attribute each GPU process and judge it; also returns what was seen of each PID (for `stop`)."""
    if not processes:
        return [], {}
    seen = read_owners((p.pid for p in processes), proc)
    owners = {pid: s.owner for pid, s in seen.items()}
    pod_uids = {o.pod_uid for o in owners.values() if o.certain and o.pod_uid}
    try:
        found = await pods.lookup(pod_uids, claim_uids)
    except Exception as exc:  # no pod list: nobody is attributed with certainty, nobody is stopped
        log.warning(
            "could not list this node's pods; GPU processes are reported, not stopped", error=str(exc)
        )
        owners = {pid: Owner(None, certain=False) for pid in owners}
        found = {}
    return judge(processes, owners, found, claims), seen


def package_policy(packages: Mapping[str, Any], name: str) -> OnViolation:
    """A package's `spec.isolation.onViolation` (`packages`: name -> slices.Package); Stop when the
    package is unknown (deleted while its slices run): the CRD's default."""
    package = packages.get(name)
    if package is None:
        return OnViolation.STOP
    return OnViolation(package.spec.isolation.on_violation)


def stop(pid: int, seen: Seen, proc: Path = Path("/proc")) -> bool:
    """SIGKILL `pid` if it is still the process that was judged; True when signalled."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    try:
        now = read_owner(pid, proc)  # after the pidfd is open the PID cannot be reused under it
        if now.start_time is None or now.start_time != seen.start_time or now.owner != seen.owner:
            log.warning("not stopping: the PID is another process now", pid=pid)
            return False
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        log.error("cannot stop the process: another uid's process needs the KILL capability", pid=pid)
        return False
    finally:
        os.close(fd)
