"""Pods and ReplicaSets that reference ResourceClaims, watched without Kopf.

A slice's status needs the few pods (and pod-template owners) that use its claim, but a cluster has
tens of thousands of other pods, and no selector tells them apart on the server. Through Kopf each one
would cost per-object memories and a worker, and Kopf holds every handler until all of them are
indexed, so start-up and memory would grow with unrelated pods (bench/operator_scale.py
--noise-pods measures both). Here an unrelated pod costs a JSON decode and nothing kept; the listing
is read in pages, so a big cluster never sits in memory whole; only views of pods that reference
claims are kept, in indexes that read like Kopf's (`one`, `values`).

The watches run on every replica, so a standby's views are current when it takes over. What changed is
marked in `changes` and refreshed by each package's daemon (`slices.refresh_changed`), which Kopf runs
only on the active replica: a paused standby writes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from gpuslice import kubehttp
from gpuslice.domain.views import PodView, WorkloadView, pod_view, workload_view
from gpuslice.logs import get
from gpuslice.operator import heap
from gpuslice.operator.changes import Changes, Ref

log = get(__name__)

K = TypeVar("K")
V = TypeVar("V")

#: Objects per list page: a page is decoded whole, and its bodies are garbage a moment later, but
#: the heap keeps part of what a page took (fragmented among long-lived objects), so smaller pages
#: leave a smaller RSS after a big listing; below 50 the gain is noise (bench/operator_scale.py
#: --noise-pods).
PAGE = 50


class ViewIndex(Mapping[K, tuple[V, ...]], Generic[K, V]):
    """key -> the values objects put under it, like a `kopf.Index` (read with `one` and `values`)."""

    def __init__(self) -> None:
        self._values: dict[K, dict[str, V]] = {}
        self._entries: dict[str, dict[K, V]] = {}

    def put(self, obj: str, entries: Mapping[K, V]) -> set[K]:
        """What object `obj` (its uid) now puts under which keys; returns the keys whose values changed."""
        old = self._entries.get(obj, {})
        if old == entries:
            return set()
        for key in old:
            bucket = self._values[key]
            del bucket[obj]
            if not bucket:
                del self._values[key]
        if entries:
            self._entries[obj] = dict(entries)
            for key, value in entries.items():
                self._values.setdefault(key, {})[obj] = value
        else:
            self._entries.pop(obj, None)
        return set(old) | set(entries)

    def holds(self, obj: str) -> bool:
        return obj in self._entries

    def objects(self) -> set[str]:
        return set(self._entries)

    def __getitem__(self, key: K) -> tuple[V, ...]:
        return tuple(self._values[key].values())

    def __iter__(self) -> Iterator[K]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


Entries = tuple[dict[Ref, V], dict[Ref, V], dict[Ref, V]]


def pod_entries(body: Mapping[str, Any]) -> Entries[PodView]:
    """(namespace, claim) -> the pod, for claims it names; (namespace, template) -> the pod, for the
    templates its claims come from; (namespace, pod) -> the pod, when it asks for a gpuslice product
    in resources.limits (its GpuSlice is named like the pod). Empty for a pod that does neither."""
    view = pod_view(body)
    if view is None:
        return {}, {}, {}
    claims = {(view.namespace, claim): view for claim in view.direct_claims}
    products = {(view.namespace, view.name): view} if view.product else {}
    return claims, {(view.namespace, t): view for t in view.templates.values()}, products


def workload_entries(body: Mapping[str, Any]) -> Entries[WorkloadView]:
    """The same for a ReplicaSet's pod template (no product entries: a pod's slice is the pod's)."""
    view = workload_view(body)
    if view is None:
        return {}, {}, {}
    claims = {(view.namespace, n): view for n in view.claim_names}
    return claims, {(view.namespace, n): view for n in view.template_names}, {}


@dataclass
class Source(Generic[V]):
    """One watched resource: two indexes (by claim, by template) and what a body puts in them."""

    url: str
    entries: Callable[[Mapping[str, Any]], Entries[V]]
    by_claim: ViewIndex[Ref, V] = field(default_factory=ViewIndex)
    by_template: ViewIndex[Ref, V] = field(default_factory=ViewIndex)
    #: (namespace, pod) -> pods that ask for a gpuslice product in resources.limits.
    by_product: ViewIndex[Ref, V] = field(default_factory=ViewIndex)
    synced: asyncio.Event = field(default_factory=asyncio.Event)

    def _indexes(self) -> tuple[ViewIndex[Ref, V], ...]:
        return (self.by_claim, self.by_template, self.by_product)

    def put(self, body: Mapping[str, Any], deleted: bool = False) -> tuple[set[Ref], str]:
        meta = body.get("metadata") or {}
        uid = str(meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}")
        entries = ({}, {}, {}) if deleted else self.entries(body)
        changed: set[Ref] = set()
        for index, entry in zip(self._indexes(), entries, strict=True):
            changed |= index.put(uid, entry)
        return changed, uid

    def holds(self, uid: str) -> bool:
        """Whether the views hold anything of object `uid`."""
        return any(index.holds(uid) for index in self._indexes())

    def drop_except(self, seen: set[str]) -> set[Ref]:
        """After a relist: forget the objects it no longer showed."""
        changed: set[Ref] = set()
        held: set[str] = set().union(*(index.objects() for index in self._indexes()))
        for uid in held - seen:
            for index in self._indexes():
                changed |= index.put(uid, {})
        return changed


class Workloads:
    """The pod and ReplicaSet views, their watches, and which slices they changed (in `changes`)."""

    def __init__(self) -> None:
        self.changes = Changes()
        self.pods: Source[PodView] = Source(kubehttp.path("", "v1", "pods"), pod_entries)
        self.replicasets: Source[WorkloadView] = Source(
            kubehttp.path("apps", "v1", "replicasets"), workload_entries
        )
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, client: kubehttp.Client) -> None:
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._watch(client, s)) for s in (self.pods, self.replicasets)]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    async def ready(self) -> None:
        """Until both resources have been listed once (at once when nothing watches them: tests that
        fill the indexes themselves)."""
        if self._tasks:
            await self.pods.synced.wait()
            await self.replicasets.synced.wait()

    async def _watch(self, client: kubehttp.Client, source: Source[Any]) -> None:
        seen: set[str] = set()
        async for kind, obj in kubehttp.watch_forever(client, source.url, paged=True, page_size=PAGE):
            if kind == "RELIST":
                seen = set()
            elif kind == "PAGE":
                for body in obj:
                    changed, uid = source.put(body)
                    if source.holds(uid):
                        # Only what the views hold can go missing from a relist: 20,000 unrelated
                        # pods' uids kept between relists were 2.5 MB of the operator's idle RSS.
                        seen.add(uid)
                    # The first listing marks nothing: every slice gets its first refresh from Kopf's own
                    # listing, which waits for this one (`ready`).
                    if source.synced.is_set():
                        self.changes.mark(changed)
            elif kind == "SYNCED":
                dropped = source.drop_except(seen)
                seen = set()
                if source.synced.is_set():
                    self.changes.mark(dropped)
                source.synced.set()
                # A listing decoded every pod of the cluster, page by page, and dropped nearly all.
                heap.trim(min_interval=0.0)
            else:
                self.changes.mark(source.put(obj, deleted=kind == "DELETED")[0])
