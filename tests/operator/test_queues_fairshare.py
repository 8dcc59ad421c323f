"""Fair sharing on the real control plane with a real Kueue whose Configuration enables it
(`devcluster up --with-kueue --kueue-fair-sharing`): two borrowers both want a cohort's whole idle
pool; Kueue splits it by the ClusterQueues' `fairSharing.weight`, which the operator writes from the
package's `sharing.weights`. The first borrower takes the whole pool while the second is idle; when the
second asks, Kueue preempts the first down to its fair share. Pods ask for slices the plain way
(`resources.limits`), kube-scheduler allocates them by DRA on published (simulated) GPUs; kwok plays
the kubelet."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from gpuslice import constants as c
from gpuslice_dev.devcluster.cluster import DevCluster, free_port
from invariants import World, card_memory
from support import apply, wait_for

from .operator_cluster import OperatorProcess, get, module_operator, package_doc, publish_gpus
from .test_queues_kueue import _pod, _pods, _running, kueue_devcluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow(seconds=300)]
POOL = 6  # three V100s of two 50 % slices, all of them the idle owner's entitlement


@pytest.fixture(scope="module")
def fcluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    with kueue_devcluster(tmp_path_factory.mktemp("kueue-fair") / "dc", "--kueue-fair-sharing") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def operator(fcluster: DevCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    with module_operator(fcluster, log, f"--metrics-port={free_port()}") as op:
        yield op


def _contend(cl: DevCluster, weight_a: float, weight_b: float) -> tuple[int, int, list[str]]:
    """An idle owner entitled to the whole pool, borrowers a and b entitled to none, each wanting all
    of it: a first, alone, then b. Returns the slices a and b hold once Kueue has settled, and the
    reasons of the preemptions a saw. No card is over-sold at any poll."""
    token = uuid.uuid4().hex[:5]
    pkg = f"f{token}-16g"
    resource = c.extended_resource_name(pkg)
    owner, a, b = f"fown-{token}", f"fa-{token}", f"fb-{token}"
    cl.create_namespace(owner, {"fair": token, "role": "owner"})
    cl.create_namespace(a, {"fair": token, "role": "borrower", "tier": "a"})
    cl.create_namespace(b, {"fair": token, "role": "borrower", "tier": "b"})
    doc = package_doc(pkg, 50, None)
    doc["spec"]["entitlements"] = [
        {"namespaceSelector": {"matchLabels": {"fair": token, "role": "owner"}}, "slices": POOL},
        {"namespaceSelector": {"matchLabels": {"fair": token, "role": "borrower"}}, "slices": 0},
    ]
    doc["spec"]["sharing"] = {
        "mode": "Kueue",
        "cohort": f"fair-{token}",
        "borrowingLimit": POOL,
        "weights": [
            {"namespaceSelector": {"matchLabels": {"fair": token, "tier": "a"}}, "weight": weight_a},
            {"namespaceSelector": {"matchLabels": {"fair": token, "tier": "b"}}, "weight": weight_b},
        ],
    }
    apply(cl, [doc])
    publish_gpus(cl, token, cl.nodes[0], POOL // 2, {pkg: 50})
    queue = f"gpuslice-{pkg}"
    cqs = {ns: f"gpuslice-{pkg}-{ns}" for ns in (a, b)}
    for ns, weight in ((a, weight_a), (b, weight_b)):
        wait_for(lambda ns=ns: get(cl, "localqueue", queue, "-n", ns), 60, f"{ns}'s LocalQueue")
        spec = get(cl, "clusterqueue", cqs[ns])["spec"]
        assert float(spec["fairSharing"]["weight"]) == weight, spec
    wait_for(lambda: get(cl, "localqueue", queue, "-n", owner), 60, "the owner's LocalQueue")

    def sold_once() -> None:
        problems = card_memory(World.read(cl))
        assert not problems, problems

    try:
        for i in range(POOL):
            apply(cl, [_pod(f"a{i}", a, resource, queue)])
        wait_for(lambda: len(_running(cl, a)) == POOL, 120, f"a alone holds all {POOL} slices")
        sold_once()
        for i in range(POOL):
            apply(cl, [_pod(f"b{i}", b, resource, queue)])
        # Settled: every slice held, no pod of a on its way out, the split unchanged for 15 s.
        seen: list[tuple[int, int]] = []
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            sold_once()
            leaving = [p for p in _pods(cl, a) if p["metadata"].get("deletionTimestamp")]
            now = (len(_running(cl, a)), len(_running(cl, b)))
            seen.append(now)
            if sum(now) == POOL and now[1] > 0 and not leaving and seen[-8:] == [now] * 8:
                break
            time.sleep(2)
        else:
            raise AssertionError(f"the split never settled: {seen[-10:]}")
        # Kueue computed shares: its status says so (recorded only with fair sharing on).
        shares = {
            ns: (get(cl, "clusterqueue", cq).get("status") or {}).get("fairSharing") for ns, cq in cqs.items()
        }
        assert all(s is not None for s in shares.values()), shares
        reasons = sorted(
            {
                str(e.get("message", "")).split(" due to ")[-1].split(";")[0]
                for e in get(cl, "events", "-n", a)["items"]
                if e.get("reason") == "EvictedDueToPreempted"
            }
        )
        print(
            f"weights {weight_a}:{weight_b}: a holds {now[0]}, b holds {now[1]} of {POOL} "
            f"(Kueue's weightedShare a={shares[a]}, b={shares[b]}); a's preemptions: {reasons}",
            flush=True,
        )
        return now[0], now[1], reasons
    finally:
        for ns in (owner, a, b):
            cl.kubectl("delete", "pods", "--all", "-n", ns, "--wait=false", check=False)


def test_two_borrowers_of_equal_weight_split_the_idle_pool_evenly(
    fcluster: DevCluster, operator: OperatorProcess
) -> None:
    a, b, reasons = _contend(fcluster, 1, 1)
    assert abs(a - b) <= 1 and a + b == POOL, (a, b)
    assert reasons == ["Fair Sharing within the cohort"], reasons


def test_weights_two_to_one_split_the_idle_pool_two_to_one(
    fcluster: DevCluster, operator: OperatorProcess
) -> None:
    a, b, reasons = _contend(fcluster, 2, 1)
    assert a + b == POOL and abs(a - 2 * b) <= 1, (a, b)
    assert reasons == ["Fair Sharing within the cohort"], reasons


def test_bad_weights_are_refused_by_the_api_server(fcluster: DevCluster) -> None:
    token = uuid.uuid4().hex[:5]
    weight: dict[str, Any] = {"namespaceSelector": {"matchLabels": {"tier": "gold"}}, "weight": 2}

    def refused(sharing: dict[str, Any]) -> str:
        doc = package_doc(f"bad{token}-8g", 25, {"fair": token})
        doc["spec"]["sharing"] = sharing
        proc = fcluster.kubectl("create", "-f", "-", input=json.dumps(doc), check=False)
        assert proc.returncode != 0, f"{sharing} was accepted"
        return proc.stderr

    assert "weights apply to sharing.mode Kueue only" in refused({"weights": [weight]})
    kueue = {"mode": "Kueue", "borrowingLimit": 1}
    assert "a weight is 0 or at least 0.001" in refused({**kueue, "weights": [{**weight, "weight": 1e-10}]})
    too_heavy = refused({**kueue, "weights": [{**weight, "weight": 1001}]})
    assert "should be less than or equal to 1000" in too_heavy
    # the bounds themselves are weights
    for ok in (0, 0.001, 1000):
        doc = package_doc(f"ok{token}-{str(ok).replace('.', '')}-8g", 25, {"fair": token})
        doc["spec"]["sharing"] = {**kueue, "weights": [{**weight, "weight": ok}]}
        proc = fcluster.kubectl("create", "-f", "-", "--dry-run=server", input=json.dumps(doc), check=False)
        assert proc.returncode == 0, proc.stderr
