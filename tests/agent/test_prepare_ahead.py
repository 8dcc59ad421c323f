"""Claims prepared while kubelet still mounts the pod's volumes, and given back when kubelet never
asks for them (the agent's side; tests/node/test_real_node.py has it on a real kubelet)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gpuslice.agent.ahead import PrepareAhead, pod_claims
from gpuslice.agent.prepare import NodePaths, Preparer

from .test_agent_prepare import UID, claim, published_slices, result

POD_UID = "pod-0001"


def pod(
    uid: str = POD_UID,
    *,
    phase: str | None = "Pending",
    claim_name: str | None = "job-gpu",
    deleting: bool = False,
    **status: Any,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"namespace": "team-a", "name": f"pod-{uid}", "uid": uid}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-05T06:00:00Z"
    spec: dict[str, Any] = {"nodeName": "node-a", "containers": [{"name": "main"}]}
    if claim_name:
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim_name}]
    return {"metadata": meta, "spec": spec, "status": ({"phase": phase} if phase else {}) | status}


def reserved(the_claim: dict[str, Any], *pod_uids: str) -> dict[str, Any]:
    the_claim["status"]["reservedFor"] = [{"resource": "pods", "name": "p", "uid": u} for u in pod_uids]
    return the_claim


class Node:
    """A Preparer and a PrepareAhead fed from a queue of pod events, over one claim's API reads."""

    def __init__(self, tmp_path: Path, the_claim: dict[str, Any]) -> None:
        self.paths = NodePaths(
            tmp_path / "state", tmp_path / "run", tmp_path / "cdi", Path("/opt/libgpuslice.so")
        )
        self.claim = the_claim
        self.fetches = 0
        self.preparer = self.new_preparer()
        self.ahead = PrepareAhead("node-a", self.preparer, self.fetch)
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.task = asyncio.create_task(self.ahead.follow(self.events()))

    def new_preparer(self) -> Preparer:
        async def list_slices() -> list[dict[str, Any]]:
            return published_slices()

        return Preparer("node-a", self.paths, self.fetch, list_slices)

    async def fetch(self, namespace: str, name: str) -> dict[str, Any]:
        self.fetches += 1
        return self.claim

    async def events(self) -> AsyncIterator[tuple[str, Any]]:
        while True:
            event = await self.queue.get()
            yield event
            self.queue.task_done()  # the consumer has asked for the next one: this one is handled

    async def send(self, kind: str, obj: Any) -> None:
        await self.queue.put((kind, obj))
        await self.queue.join()
        await self.ahead.drain()

    def prepared(self) -> bool:
        return self.paths.cdi_spec(UID).exists() and UID in self.preparer.checkpoint.claims

    def stop(self) -> None:
        self.task.cancel()


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    n = Node(tmp_path, reserved(claim([result()]), POD_UID))
    yield n
    n.stop()


async def test_a_bound_pods_claim_is_prepared_before_kubelet_asks_and_kubelet_is_answered_from_it(
    node: Node,
) -> None:
    await node.send("LIST", [pod()])
    assert node.prepared() and node.preparer.checkpoint.claims[UID].ahead
    assert node.fetches == 1

    devices = await node.preparer.prepare("team-a", "job-gpu", UID)  # kubelet's NodePrepareResources
    assert devices == node.preparer.checkpoint.claims[UID].devices
    assert node.fetches == 1, "kubelet's call is answered without reading the API server again"
    assert not node.preparer.checkpoint.claims[UID].ahead

    # kubelet has it now: the pod's end is kubelet's to act on (NodeUnprepareResources), not the agent's
    await node.send("DELETED", pod())
    assert node.prepared()


async def test_a_claim_prepared_ahead_whose_pod_goes_before_kubelet_asks_is_unprepared(node: Node) -> None:
    await node.send("ADDED", pod())
    await node.send("LIST", [])  # the first listing may come after events: nothing is removed before it
    assert not node.prepared()

    await node.send("ADDED", pod())
    assert node.prepared()
    await node.send("MODIFIED", pod(deleting=True))
    assert node.prepared(), "a pod being deleted may still be started by kubelet's sync: kept"
    await node.send("DELETED", pod(deleting=True))
    assert not node.prepared()
    assert not node.paths.claim_dir(UID).exists() and not node.paths.usage_dir(UID).exists()


async def test_a_pod_that_fails_before_kubelet_asks_gives_its_claim_back(node: Node) -> None:
    await node.send("LIST", [pod()])
    assert node.prepared()
    await node.send("MODIFIED", pod(phase="Failed"))
    assert not node.prepared()


async def test_a_claim_two_pods_share_stays_while_one_of_them_has_not_finished(node: Node) -> None:
    node.claim = reserved(claim([result()]), POD_UID, "pod-0002")
    await node.send("LIST", [pod(), pod("pod-0002")])
    assert node.prepared() and node.fetches == 1
    await node.send("DELETED", pod())
    assert node.prepared()
    await node.send("DELETED", pod("pod-0002"))
    assert not node.prepared()


@pytest.mark.parametrize(
    "the_claim",
    [
        pytest.param(reserved(claim([result(driver="gpu.nvidia.com")]), POD_UID), id="another driver"),
        pytest.param(reserved(claim([result(pool="node-b")]), POD_UID), id="another node"),
        pytest.param(reserved(claim([result()]), "someone-else"), id="reserved for another pod"),
        pytest.param(claim([result(device="gpu-9-v100-8g-0")]) | {}, id="not reserved"),
    ],
)
async def test_claims_kubelet_will_not_ask_this_agent_for_are_left_alone_and_read_once(
    node: Node, the_claim: dict[str, Any]
) -> None:
    node.claim = the_claim
    await node.send("LIST", [pod()])
    for _ in range(3):  # kubelet's status updates of the pending pod
        await node.send("MODIFIED", pod())
    assert node.preparer.checkpoint.claims == {}
    assert node.fetches == 1


async def test_running_and_finished_pods_and_pods_without_claims_prepare_nothing(node: Node) -> None:
    await node.send("LIST", [pod(phase="Running"), pod("p2", phase="Succeeded"), pod("p3", claim_name=None)])
    await node.send("ADDED", pod("p4", deleting=True))
    assert node.fetches == 0 and node.preparer.checkpoint.claims == {}


async def test_a_restarted_agent_gives_back_what_it_prepared_ahead_for_a_pod_gone_meanwhile(
    node: Node,
) -> None:
    await node.send("LIST", [pod()])
    assert node.prepared()
    node.stop()

    restarted = node.new_preparer()
    assert restarted.checkpoint.claims[UID].ahead
    ahead = PrepareAhead("node-a", restarted, node.fetch)
    events = asyncio.Queue[tuple[str, Any]]()
    await events.put(("LIST", []))

    async def once() -> AsyncIterator[tuple[str, Any]]:
        yield await events.get()

    await ahead.follow(once())
    assert restarted.checkpoint.claims == {} and not node.paths.cdi_spec(UID).exists()


def test_claims_of_a_pod_are_read_from_its_spec_and_for_templates_from_its_status() -> None:
    from_template = pod(claim_name=None)
    from_template["spec"]["resourceClaims"] = [
        {"name": "gpu", "resourceClaimTemplateName": "t"},
        {"name": "none-needed", "resourceClaimTemplateName": "u"},
    ]
    from_template["status"]["resourceClaimStatuses"] = [
        {"name": "gpu", "resourceClaimName": "pod-x-gpu-abcde"},
        {"name": "none-needed"},
    ]
    seen = pod_claims(from_template)
    assert seen is not None and seen.claims == ("pod-x-gpu-abcde",) and seen.starting
    assert pod_claims(pod(claim_name=None)) is None
    no_phase = pod_claims(pod(phase=None))
    assert no_phase is not None and no_phase.starting and not no_phase.finished
