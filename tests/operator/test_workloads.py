"""The operator's own pod and ReplicaSet watches: unrelated pods cost nothing kept and mark nothing,
a pod that uses a slice's claim marks that slice, a relist forgets what it no longer shows."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gpuslice import kubehttp
from gpuslice.operator.state import one, values
from gpuslice.operator.workloads import ViewIndex, Workloads
from support import pod_doc


def with_uid(body: dict[str, Any], uid: str) -> dict[str, Any]:
    body["metadata"]["uid"] = uid
    return body


def noise(i: int) -> dict[str, Any]:
    return {"metadata": {"name": f"web-{i}", "namespace": "shop", "uid": f"n{i}"}, "spec": {"containers": []}}


def test_a_view_index_reports_only_keys_whose_values_changed() -> None:
    index: ViewIndex[str, int] = ViewIndex()
    assert index.put("a", {"k": 1}) == {"k"}
    assert index.put("a", {"k": 1}) == set()  # the same again: nothing to refresh
    assert index.put("b", {"k": 2}) == {"k"}
    assert sorted(values(index, "k")) == [1, 2]
    assert index.put("a", {"j": 1}) == {"k", "j"}  # moved from k to j
    assert values(index, "k") == [2] and one(index, "j") == 1
    assert index.put("b", {}) == {"k"}
    assert "k" not in index and len(index) == 1 and index.objects() == {"a"}


async def run_watch(
    monkeypatch: pytest.MonkeyPatch, workloads: Workloads, events: list[tuple[str, Any]]
) -> None:
    async def fake(_client: Any, url: str, **_: Any) -> AsyncIterator[tuple[str, Any]]:
        for event in events if url.endswith("/pods") else [("RELIST", []), ("SYNCED", [])]:
            yield event

    monkeypatch.setattr(kubehttp, "watch_forever", fake)
    workloads.start(None)  # type: ignore[arg-type]
    await asyncio.wait_for(workloads.ready(), 5)
    await workloads.stop()


async def test_unrelated_pods_keep_nothing_and_mark_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    workloads = Workloads()
    page = [noise(i) for i in range(2000)]
    await run_watch(monkeypatch, workloads, [("RELIST", []), ("PAGE", page), ("PAGE", page), ("SYNCED", [])])
    assert workloads.changes.unrouted == set()
    assert len(workloads.pods.by_claim) == 0 and len(workloads.pods.by_template) == 0


async def test_a_pod_that_uses_a_claim_marks_it_and_a_relist_forgets_deleted_pods(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    workloads = Workloads()
    first = with_uid(pod_doc("p", "team-a", "llm"), "u1")
    other = with_uid(pod_doc("q", "team-a", "bert"), "u2")
    await run_watch(
        monkeypatch,
        workloads,
        [
            ("RELIST", []),
            ("PAGE", [first, noise(1)]),
            ("SYNCED", []),
            ("ADDED", other),
            ("MODIFIED", noise(1)),
        ],
    )
    # The first listing marks nothing (Kopf's own first pass refreshes every slice); later events do.
    assert workloads.changes.unrouted == {("team-a", "bert")}
    assert [p.name for p in values(workloads.pods.by_claim, ("team-a", "llm"))] == ["p"]
    workloads.changes.unrouted.add(("team-b", "gone"))
    # Taken by whoever refreshes; refs no slice has are dropped.
    assert workloads.changes.take("p", lambda ref: None if ref[1] == "gone" else "p") == [("team-a", "bert")]
    assert workloads.changes.unrouted == set()

    # The watch broke; the relist no longer shows "p" (deleted meanwhile): its slice is marked again.
    await run_watch(monkeypatch, workloads, [("RELIST", []), ("PAGE", [other]), ("SYNCED", [])])
    assert workloads.changes.unrouted == {("team-a", "llm")}
    assert values(workloads.pods.by_claim, ("team-a", "llm")) == []
    assert [p.name for p in values(workloads.pods.by_claim, ("team-a", "bert"))] == ["q"]


async def test_every_listener_is_woken_by_a_change(monkeypatch: pytest.MonkeyPatch) -> None:
    workloads = Workloads()
    a, b = workloads.changes.listen("pkg-a"), workloads.changes.listen("pkg-b")
    await run_watch(
        monkeypatch,
        workloads,
        [("RELIST", []), ("SYNCED", []), ("ADDED", with_uid(pod_doc("p", "t", "x"), "u"))],
    )
    assert a.is_set() and b.is_set()
    workloads.changes.unlisten("pkg-a")
    assert list(workloads.changes._listeners) == ["pkg-b"]
