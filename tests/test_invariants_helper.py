"""The fault tests' invariants catch what they promise to: each check is given a cluster state that
breaks it (in the shape the API server returns) and one that does not."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from invariants import World, card_memory, pods_undisturbed, running_slice_pods, slice_claims_and_status
from support import allocated_claim, published

NS = "team-a"


def _slice(name: str, uid: str, status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"namespace": NS, "name": name, "uid": uid, "generation": 1},
        "spec": {"package": "v100-8g"},
        "status": {"observedGeneration": 1, **(status or {})},
    }


def _owned(claim: dict[str, Any], slice_uid: str, uid: str) -> dict[str, Any]:
    claim["metadata"]["uid"] = uid
    claim["metadata"]["ownerReferences"] = [
        {"kind": "GpuSlice", "name": claim["metadata"]["name"], "uid": slice_uid}
    ]
    return claim


def _pod(name: str, restarts: int = 0, container: str = "containerd://a") -> dict[str, Any]:
    return {
        "metadata": {"namespace": NS, "name": name, "uid": f"uid-{name}"},
        "spec": {"nodeName": "n1", "resourceClaims": [{"name": "gpu", "resourceClaimName": name}]},
        "status": {
            "phase": "Running",
            "containerStatuses": [
                {"name": "main", "containerID": container, "restartCount": restarts, "state": {"running": {}}}
            ],
        },
    }


def _world(
    claims: list[dict[str, Any]], slices: Sequence[dict[str, Any]] = (), pods: Sequence[dict[str, Any]] = ()
) -> World:
    return World(list(slices), claims, [], list(pods), published("n1", 1))


def in_use(name: str) -> dict[str, Any]:
    return {
        "phase": "InUse",
        "claimName": name,
        "allocations": [
            {
                "claim": name,
                "node": "n1",
                "pool": "n1",
                "device": "gpu-0-v100-8g-0",
                "gpuUUID": "GPU-n1-0",
                "pod": name,
            }
        ],
        "conditions": [{"type": "Allocated", "status": "True"}, {"type": "InUse", "status": "True"}],
    }


def test_a_card_given_out_twice_or_past_its_memory_is_caught() -> None:
    ok = [
        allocated_claim(NS, "a", "n1", "gpu-0-v100-8g-0"),
        allocated_claim(NS, "b", "n1", "gpu-0-v100-16g-0"),
    ]
    assert card_memory(_world(ok)) == []
    twice = [
        allocated_claim(NS, "a", "n1", "gpu-0-v100-8g-0"),
        allocated_claim(NS, "b", "n1", "gpu-0-v100-8g-0"),
    ]
    assert "allocated to 2 claims" in card_memory(_world(twice))[0]
    over = [
        allocated_claim(NS, "a", "n1", "gpu-0-v100-32g-0"),
        allocated_claim(NS, "b", "n1", "gpu-0-v100-8g-1"),
    ]
    assert card_memory(_world(over)) == [
        "card n1/gpu-0 has 34359738368 bytes; its allocated slices take 42949672960"
    ]


def test_a_lost_duplicated_or_misreported_claim_is_caught() -> None:
    claim = _owned(allocated_claim(NS, "s", "n1", "gpu-0-v100-8g-0", ("s",)), "slice-1", "claim-1")
    known: dict[str, str] = {}
    world = _world([claim], [_slice("s", "slice-1", in_use("s"))], [_pod("s")])
    assert slice_claims_and_status(world, {NS}, known) == []
    assert known == {"slice-1": "claim-1"}

    stale = _world([claim], [_slice("s", "slice-1", {**in_use("s"), "phase": "Allocated"})], [_pod("s")])
    assert "status says ('Allocated'" in slice_claims_and_status(stale, {NS}, known)[0]
    wrong_gpu = copy.deepcopy(in_use("s"))
    wrong_gpu["allocations"][0]["gpuUUID"] = "GPU-other"
    assert slice_claims_and_status(
        _world([claim], [_slice("s", "slice-1", wrong_gpu)], [_pod("s")]), {NS}, known
    )

    replaced = _owned(copy.deepcopy(claim), "slice-1", "claim-2")
    assert (
        "was replaced"
        in slice_claims_and_status(
            _world([replaced], [_slice("s", "slice-1", in_use("s"))], [_pod("s")]), {NS}, known
        )[0]
    )
    second = _owned(allocated_claim(NS, "s-2", "n1", "gpu-0-v100-8g-1"), "slice-1", "claim-3")
    twice = _world([claim, second], [_slice("s", "slice-1", in_use("s"))], [_pod("s")])
    assert "owns ResourceClaims ['s', 's-2']" in slice_claims_and_status(twice, {NS}, known)[0]
    # a slice that never had a claim may still be making it; then its status must say so
    making = _world([], [_slice("n", "slice-9", {"phase": "Pending", "reason": "CreatingClaim"})])
    assert slice_claims_and_status(making, {NS}, known) == []
    lying = _world([], [_slice("n", "slice-9", {"phase": "Pending", "reason": "WaitingForPod"})])
    assert slice_claims_and_status(lying, {NS}, known)


def test_a_restarted_or_replaced_pod_is_caught() -> None:
    before = running_slice_pods(_world([], [], [_pod("p")]))
    assert pods_undisturbed(_world([], [], [_pod("p")]), before, set()) == []
    assert "restarts 1" in pods_undisturbed(_world([], [], [_pod("p", restarts=1)]), before, set())[0]
    assert pods_undisturbed(_world([], [], [_pod("p", container="containerd://b")]), before, set())
    replaced = _pod("p")
    replaced["metadata"]["uid"] = "uid-new"
    assert "replaced by uid uid-new" in pods_undisturbed(_world([], [], [replaced]), before, set())[0]
    assert "is gone" in pods_undisturbed(_world([], [], []), before, set())[0]
    assert pods_undisturbed(_world([], [], []), before, {"n1"}) == []  # a node lost for good


def test_a_resources_limits_pod_is_held_too() -> None:
    # its claim is kube-scheduler's (the extended-resource path): named in the pod's status, none in spec
    pod = _pod("lim")
    del pod["spec"]["resourceClaims"]
    pod["status"]["extendedResourceClaimStatus"] = {
        "resourceClaimName": "lim-extended-resources-abcde",
        "requestMappings": [
            {
                "containerName": "main",
                "resourceName": "gpuslice.io/v100-8g",
                "requestName": "container-0-request-0",
            },
        ],
    }
    before = running_slice_pods(_world([], [], [pod]))
    assert list(before) == [f"{NS}/lim"]
    assert before[f"{NS}/lim"].claims == ("lim-extended-resources-abcde",)
    restarted = copy.deepcopy(pod)
    restarted["status"]["containerStatuses"][0]["restartCount"] = 1
    assert "restarts 1" in pods_undisturbed(_world([], [], [restarted]), before, set())[0]
    plain = _pod("cpu")
    del plain["spec"]["resourceClaims"]
    assert running_slice_pods(_world([], [], [plain])) == {}
