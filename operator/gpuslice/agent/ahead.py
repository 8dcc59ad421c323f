"""Claims prepared ahead of kubelet, as soon as a pod that uses them is bound to this node.

kubelet calls NodePrepareResources only once the pod's volumes are mounted (it checks them every
300 ms), just before it makes the pod's sandbox, and waits for the answer: whatever the agent does
then (read the claim and the node's ResourceSlices, write and fsync the slice's files) is added to
the pod's start. The agent follows the pods bound to its node (the field-selector watch kubelet
itself uses) and prepares each claim of a pod it sees bound, while kubelet is still mounting
volumes; kubelet's call then finds the claim prepared and is answered from the checkpoint.

kubelet unprepares only what it prepared. A claim prepared ahead that kubelet never asked for (its
pod deleted, or refused by kubelet, before it got that far) is unprepared by the agent once no pod
of the node that has not finished refers to it. Everything kubelet asked for stays kubelet's to
unprepare.

`pod_claims` and `unclaimed` decide; `PrepareAhead` follows the watch and does the I/O.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuslice import logs
from gpuslice.agent.checkpoint import ClaimRecord
from gpuslice.agent.prepare import PrepareError, Preparer
from gpuslice.api.resourceclaim import allocation_results
from gpuslice.kubehttp import ApiError

log = logs.get(__name__)

FetchClaim = Callable[[str, str], Awaitable[dict[str, Any]]]
PodEvents = AsyncIterator[tuple[str, list[dict[str, Any]] | dict[str, Any]]]

_FINISHED = ("Succeeded", "Failed")


@dataclass(frozen=True, slots=True)
class PodClaims:
    """What the agent keeps of a pod bound to its node: the ResourceClaims it refers to."""

    uid: str
    namespace: str
    claims: tuple[str, ...]
    #: bound and not started yet, not being deleted: its claims are about to be asked for
    starting: bool
    #: Succeeded or Failed: kubelet has unprepared (or will unprepare) its claims
    finished: bool


def pod_claims(pod: Mapping[str, Any]) -> PodClaims | None:
    """The claims of a pod (None for a pod without any): named in the spec
    (`resourceClaimName`) or, for a claim made from a template, in the status
    (`status.resourceClaimStatuses`, written before the pod could be scheduled)."""
    entries = (pod.get("spec") or {}).get("resourceClaims") or []
    if not entries:
        return None
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    generated = {s.get("name"): s.get("resourceClaimName") for s in status.get("resourceClaimStatuses") or []}
    names = []
    for entry in entries:
        name = entry.get("resourceClaimName") or generated.get(entry.get("name"))
        if name:
            names.append(str(name))
    phase = status.get("phase") or "Pending"
    return PodClaims(
        uid=str(meta.get("uid", "")),
        namespace=str(meta.get("namespace", "")),
        claims=tuple(names),
        starting=phase == "Pending" and not meta.get("deletionTimestamp"),
        finished=phase in _FINISHED,
    )


def in_use(pods: Iterable[PodClaims]) -> set[tuple[str, str]]:
    """(namespace, name) of every claim a pod of the node that has not finished refers to."""
    return {(p.namespace, name) for p in pods if not p.finished for name in p.claims}


def unclaimed(records: Iterable[ClaimRecord], used: set[tuple[str, str]]) -> list[str]:
    """UIDs of claims prepared ahead, never asked for by kubelet, that no pod of the node uses."""
    return [r.uid for r in records if r.ahead and (r.namespace, r.name) not in used]


def allocated_here(claim: Mapping[str, Any], node: str, pod_uid: str) -> bool:
    """The claim holds a gpuslice device of this node and is reserved for the pod: what kubelet is
    about to ask for. Claims of other drivers, or not (yet) reserved for this pod, are left alone."""
    reserved = {str(r.get("uid")) for r in (claim.get("status") or {}).get("reservedFor") or []}
    return pod_uid in reserved and any(r.pool == node for r in allocation_results(claim))


class PrepareAhead:
    def __init__(self, node: str, preparer: Preparer, fetch_claim: FetchClaim) -> None:
        self.node = node
        self._preparer = preparer
        self._fetch_claim = fetch_claim
        self._pods: dict[str, PodClaims] = {}
        self._listed = False  # nothing is unprepared before the node's pods are known
        #: (pod uid, namespace, claim) already tried: one read of a claim per pod, whatever it held
        self._tried: set[tuple[str, str, str]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._in_flight: set[tuple[str, str]] = set()  # (namespace, claim) being prepared here

    async def follow(self, events: PodEvents) -> None:
        async for kind, obj in events:
            if kind == "LIST":
                assert isinstance(obj, list)
                self._pods = {p.uid: p for p in map(pod_claims, obj) if p is not None}
                self._listed = True
                self._tried = {t for t in self._tried if t[0] in self._pods}
                changed = list(self._pods.values())
            else:
                assert isinstance(obj, dict)
                uid = str((obj.get("metadata") or {}).get("uid", ""))
                seen = pod_claims(obj)
                if kind == "DELETED" or seen is None:
                    self._pods.pop(uid, None)
                    self._tried = {t for t in self._tried if t[0] != uid}
                    changed = []
                else:
                    self._pods[uid] = seen
                    changed = [seen]
            for pod in changed:  # an event changes one pod: the others were looked at already
                if pod.starting:
                    for name in pod.claims:
                        self._start(pod.namespace, name, pod.uid)
            await self.collect()

    def _start(self, namespace: str, name: str, pod_uid: str) -> None:
        key = (pod_uid, namespace, name)
        if (
            key in self._tried
            or key[1:] in self._in_flight
            or any((r.namespace, r.name) == key[1:] for r in self._preparer.checkpoint.claims.values())
        ):
            return
        self._tried.add(key)
        self._in_flight.add(key[1:])
        task = asyncio.create_task(self._prepare(namespace, name, pod_uid))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _prepare(self, namespace: str, name: str, pod_uid: str) -> None:
        try:
            claim = await self._fetch_claim(namespace, name)
            if allocated_here(claim, self.node, pod_uid):
                uid = str(claim["metadata"]["uid"])
                await self._preparer.prepare(namespace, name, uid, claim=claim, ahead=True)
        except (ApiError, PrepareError, OSError, ValueError) as exc:
            # kubelet's own call tries again and reports what is wrong on the pod
            log.info("claim not prepared ahead", claim=f"{namespace}/{name}", error=str(exc))
        finally:
            self._in_flight.discard((namespace, name))
        await self.collect()  # its pod may have gone while it was prepared

    async def drain(self) -> None:
        """Wait until no prepare started here is under way."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def collect(self) -> None:
        """Unprepare the claims prepared ahead that no pod of the node uses any more."""
        if not self._listed:
            return
        used = in_use(self._pods.values())
        for uid in unclaimed(list(self._preparer.checkpoint.claims.values()), used):
            await self._preparer.unprepare_unclaimed(uid)
