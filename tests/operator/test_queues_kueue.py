"""Sharing mode Kueue on the real control plane with the real Kueue: the operator writes a package's
ClusterQueues, LocalQueues and ResourceFlavor; an idle entitlement is lent to the cohort's other
tenant and taken back by Kueue's preemption when its owner asks. Pods ask for slices the plain way
(`resources.limits: {gpuslice.io/<package>: 1}`) and kube-scheduler allocates them by DRA on
published (simulated) GPUs; kwok plays the kubelet."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from gpuslice import constants as c
from gpuslice.domain.ledger import money
from gpuslice.timefmt import parse_rfc3339
from gpuslice_dev.devcluster.cluster import DevCluster, free_port
from gpuslice_dev.devcluster.components import KWOK_KEEP_RUNNING
from gpuslice_dev.devcluster.kueue import kill_kueue, restart_kueue
from invariants import Invariants, World, card_memory
from support import apply, metrics_readers, wait_for

from .operator_cluster import OperatorProcess, get, module_operator, package_doc, publish_gpus

pytestmark = [pytest.mark.cluster, pytest.mark.slow(seconds=240)]
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuslice_dev", "devcluster", *args],
        capture_output=True,
        text=True,
        timeout=900,
    )


@contextmanager
def kueue_devcluster(d: Path, *flags: str) -> Iterator[DevCluster]:
    """A one-node devcluster with the real Kueue (and `flags` for it), taken down afterwards."""
    up = _cli("up", "--nodes", "1", "--with-kueue", *flags, "--dir", str(d))
    try:
        assert up.returncode == 0, up.stderr
        yield DevCluster(d)
    finally:
        _cli("down", "--dir", str(d))


@pytest.fixture(scope="module")
def kcluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    with kueue_devcluster(tmp_path_factory.mktemp("kueue-share") / "dc") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def operator(kcluster: DevCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    with (
        metrics_readers(kcluster) as readers,
        module_operator(
            kcluster, log, f"--metrics-port={free_port()}", metrics_token=readers.prometheus
        ) as op,
    ):
        yield op


def _pod(name: str, namespace: str, resource: str, queue: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": {QUEUE_LABEL: queue}},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "main", "image": "busybox", "resources": {"limits": {resource: "1"}}}],
        },
    }


def _pods(cluster: DevCluster, namespace: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = get(cluster, "pods", "-n", namespace)["items"]
    return items


def _running(cluster: DevCluster, namespace: str) -> list[str]:
    return sorted(
        p["metadata"]["name"]
        for p in _pods(cluster, namespace)
        if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
    )


def _borrowed(cluster: DevCluster, cq: str, resource: str) -> int:
    for flavor in ((get(cluster, "clusterqueue", cq) or {}).get("status") or {}).get("flavorsUsage") or []:
        for r in flavor["resources"]:
            if r["name"] == resource:
                return int(r.get("borrowed") or 0)
    return 0


def _allocated_devices(cluster: DevCluster) -> list[str]:
    """Every allocated device of any claim: the same device twice would be a slice sold twice."""
    out = []
    for claim in get(cluster, "resourceclaims", "-A")["items"]:
        for result in ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get(
            "results"
        ) or []:
            out.append(f"{result['pool']}/{result['device']}")
    return out


@dataclass(frozen=True)
class LendingPair:
    """A package in mode Kueue whose two entitled namespaces share one V100 (4 slices of 25 %)."""

    token: str
    pkg: str
    resource: str
    owner: str
    borrower: str
    queue: str
    #: namespace -> the ClusterQueue the operator writes for it
    cqs: dict[str, str]


def _lending_pair(
    cl: DevCluster, prefix: str, sharing: dict[str, Any] | None = None, **spec: Any
) -> LendingPair:
    """Two namespaces entitled to 2 slices each, borrowingLimit 2, cohort `<prefix>-<token>` (and
    the other `sharing` fields as given), the package's other `spec` fields as given, and the GPU
    published."""
    token = uuid.uuid4().hex[:5]
    pkg = f"{prefix}{token}-8g"
    owner, borrower = f"{prefix}own-{token}", f"{prefix}bor-{token}"
    for ns in (owner, borrower):
        cl.create_namespace(ns, {"share": token})
    doc = package_doc(pkg, 25, {"share": token}, slices=2)
    doc["spec"]["sharing"] = {"mode": "Kueue", "cohort": f"{prefix}-{token}", "borrowingLimit": 2}
    doc["spec"]["sharing"].update(sharing or {})
    doc["spec"].update(spec)
    apply(cl, [doc])
    publish_gpus(cl, token, cl.nodes[0], 1, {pkg: 25})  # one V100: 4 slices of 25 %
    return LendingPair(
        token=token,
        pkg=pkg,
        resource=c.extended_resource_name(pkg),
        owner=owner,
        borrower=borrower,
        queue=f"gpuslice-{pkg}",
        cqs={ns: f"gpuslice-{pkg}-{ns}" for ns in (owner, borrower)},
    )


def test_idle_entitlement_is_lent_and_reclaimed_by_preemption(
    kcluster: DevCluster, operator: OperatorProcess
) -> None:
    cl = kcluster
    pair = _lending_pair(cl, "q")
    token, pkg, resource, owner, borrower = pair.token, pair.pkg, pair.resource, pair.owner, pair.borrower
    queue, cqs = pair.queue, pair.cqs

    # The operator's queues, in Kueue's own status: active, in the package's cohort.
    def active(cq: str) -> bool:
        found = get(cl, "clusterqueue", cq) or {}
        conds = (found.get("status") or {}).get("conditions") or []
        return any(x["type"] == "Active" and x["status"] == "True" for x in conds)

    wait_for(lambda: all(active(cq) for cq in cqs.values()), 60, "the ClusterQueues active")
    # The devcluster's default Kueue has fair sharing off (as Kueue ships): no share in the status.
    assert "fairSharing" not in (get(cl, "clusterqueue", cqs[owner]).get("status") or {})
    cq_spec = get(cl, "clusterqueue", cqs[owner])["spec"]
    assert cq_spec["cohortName"] == f"q-{token}"
    assert cq_spec["resourceGroups"][0]["flavors"][0]["resources"][0]["nominalQuota"] == "2"
    assert get(cl, "localqueue", queue, "-n", owner)["spec"]["clusterQueue"] == cqs[owner]
    cond = wait_for(
        lambda: next(
            (
                x
                for x in ((get(cl, "gpupackage", pkg) or {}).get("status") or {}).get("conditions") or []
                if x["type"] == "Queues"
            ),
            None,
        ),
        30,
        "the package's Queues condition",
    )
    assert cond["status"] == "True", cond
    # The ResourceQuota is the ceiling: entitlement 2 + borrowingLimit 2.
    quota = wait_for(lambda: get(cl, "resourcequota", c.QUOTA_NAME, "-n", borrower), 30, "quota")
    assert quota["spec"]["hard"][f"requests.{resource}"] == "4"

    try:
        _borrow_and_reclaim(cl, owner, borrower, resource, queue, cqs)
    finally:
        for ns in (owner, borrower):
            cl.kubectl("delete", "pods", "--all", "-n", ns, "--wait=false", check=False)


def _borrow_and_reclaim(
    cl: DevCluster, owner: str, borrower: str, resource: str, queue: str, cqs: dict[str, str]
) -> None:
    # Borrow: the owner is idle, the borrower runs 4 pods, 2 of them on the owner's entitlement.
    for i in range(4):
        apply(cl, [_pod(f"b{i}", borrower, resource, queue)])
    wait_for(lambda: len(_running(cl, borrower)) == 4, 90, "4 borrower pods Running")
    # Kueue writes a ClusterQueue's usage in its status a moment after it admits.
    wait_for(lambda: _borrowed(cl, cqs[borrower], resource) == 2, 30, "2 slices borrowed in Kueue's status")
    assert len(set(_allocated_devices(cl))) == len(_allocated_devices(cl)) == 4

    # Reclaim, five times: the owner asks for one slice; Kueue preempts a borrower's pod and the
    # owner's pod runs. Between rounds the owner lets go and the borrower borrows again.
    seconds = []
    for r in range(5):
        started = time.monotonic()
        apply(cl, [_pod(f"o{r}", owner, resource, queue)])
        wait_for(lambda r=r: f"o{r}" in _running(cl, owner), 120, f"the owner's pod o{r} Running")
        seconds.append(time.monotonic() - started)
        assert len(_running(cl, borrower)) == 3
        devices = _allocated_devices(cl)
        assert len(set(devices)) == len(devices) <= 4
        cl.kubectl("delete", "pod", f"o{r}", "-n", owner, "--wait=true", "--timeout=60s")
        apply(cl, [_pod(f"again{r}", borrower, resource, queue)])
        wait_for(lambda: len(_running(cl, borrower)) == 4, 90, "the borrower at 4 again")
    # A LocalQueue a tenant writes itself, pointing at the other tenant's ClusterQueue, admits
    # nothing: each ClusterQueue selects its own namespace only.
    sneaky = {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "LocalQueue",
        "metadata": {"name": "sneaky", "namespace": borrower},
        "spec": {"clusterQueue": cqs[owner]},
    }
    apply(cl, [sneaky])
    # At 4 running the borrower is at its ceiling (entitlement 2 + borrowingLimit 2): the quota
    # refuses a fifth whatever its queue.
    over = cl.kubectl(
        "create", "-f", "-", input=json.dumps(_pod("sneak", borrower, resource, "sneaky")), check=False
    )
    assert "exceeded quota" in over.stderr, over.stderr
    cl.kubectl("delete", "pods", "--all", "-n", borrower, "--wait=true", "--timeout=60s")
    apply(cl, [_pod("sneak", borrower, resource, "sneaky")])

    def refused() -> str:
        for wl in get(cl, "workloads", "-n", borrower)["items"]:
            if wl["spec"].get("queueName") == "sneaky":
                for cond in (wl.get("status") or {}).get("conditions") or []:
                    if cond["type"] == "QuotaReserved" and cond["status"] == "False":
                        return str(cond["message"])
        return ""

    assert wait_for(refused, 30, "the sneaky workload refused") == (
        "Workload namespace doesn't match ClusterQueue selector"
    )
    assert "sneak" not in _running(cl, borrower)
    evicted = [
        e
        for e in get(cl, "events", "-n", borrower)["items"]
        if e.get("reason") in ("Preempted", "EvictedDueToPreempted", "Stopped")
    ]
    assert evicted, "the borrower sees no event of its preemption"
    print(
        f"owner's request -> its pod Running while lent: median {statistics.median(seconds):.2f}s "
        f"(runs {', '.join(f'{s:.2f}' for s in seconds)}); borrower's notice: "
        f"{json.dumps(sorted({(e['reason'], e['message']) for e in evicted})[:2])}",
        flush=True,
    )


def _queues_condition(cl: DevCluster, pkg: str) -> dict[str, Any] | None:
    status = (get(cl, "gpupackage", pkg) or {}).get("status") or {}
    return next((x for x in status.get("conditions") or [] if x["type"] == "Queues"), None)


def test_a_platform_queue_in_the_cohort_is_never_overwritten_and_the_package_says_so(
    kcluster: DevCluster, operator: OperatorProcess
) -> None:
    cl = kcluster
    token = uuid.uuid4().hex[:5]
    pkg = f"c{token}-8g"
    cl.create_namespace(f"team-{token}", {"collide": token})
    platform_cq = {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "ClusterQueue",
        "metadata": {"name": f"research-{token}"},
        "spec": {"cohortName": f"shared-{token}", "namespaceSelector": {}, "resourceGroups": []},
    }
    # and one with the very name the operator would give its own queue
    taken = {**platform_cq, "metadata": {"name": f"gpuslice-{pkg}-team-{token}"}}
    taken["spec"] = {**platform_cq["spec"], "cohortName": f"theirs-{token}"}
    apply(cl, [platform_cq, taken])
    doc = package_doc(pkg, 25, {"collide": token}, slices=1)
    doc["spec"]["sharing"] = {"mode": "Kueue", "cohort": f"shared-{token}", "borrowingLimit": 0}
    apply(cl, [doc])
    cond = wait_for(lambda: _queues_condition(cl, pkg), 30, "the package's Queues condition")
    assert cond["status"] == "False" and cond["reason"] == "NotOwned", cond
    assert f"ClusterQueue gpuslice-{pkg}-team-{token} exists and is not gpuslice's" in cond["message"]
    assert f"ClusterQueue research-{token} is in cohort shared-{token}" in cond["message"]
    # untouched: still the platform's spec, and no LocalQueue was written for it
    assert get(cl, "clusterqueue", taken["metadata"]["name"])["spec"]["cohortName"] == f"theirs-{token}"
    assert get(cl, "localqueues", "-n", f"team-{token}")["items"] == []
    # the platform's queue leaves the cohort and the name: the operator writes its own
    cl.kubectl("delete", "clusterqueue", f"research-{token}", taken["metadata"]["name"])
    wait_for(lambda: (x := _queues_condition(cl, pkg)) and x["status"] == "True" and x, 30, "Queues True")
    assert get(cl, "clusterqueue", f"gpuslice-{pkg}-team-{token}")["spec"]["cohortName"] == f"shared-{token}"


def _intervals(cl: DevCluster, namespace: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for usage in (get(cl, "gpuusages", "-n", namespace) or {}).get("items") or []:
        out += usage.get("intervals") or []
    return out


def _writes(op: OperatorProcess, kind: str | None = None) -> float:
    """The operator's API writes so far (of one kind, or all)."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in op.metrics().splitlines()
        if line.startswith("gpuslice_operator_writes_total{") and (kind is None or f'kind="{kind}"' in line)
    )


def test_a_borrowed_slice_is_metered_borrowed_and_an_owners_is_not_across_a_restart(
    kcluster: DevCluster, operator: OperatorProcess
) -> None:
    cl = kcluster
    pair = _lending_pair(cl, "m", price={"perHour": "0.45", "borrowedPerHour": "0.30", "currency": "EUR"})
    resource, owner, borrower, queue = pair.resource, pair.owner, pair.borrower, pair.queue
    cq = pair.cqs[borrower]
    wait_for(lambda: get(cl, "localqueue", queue, "-n", borrower), 60, "the borrower's LocalQueue")
    wait_for(lambda: get(cl, "localqueue", queue, "-n", owner), 60, "the owner's LocalQueue")
    settle = 12  # past the operator's re-reads of Kueue's status after a claim change

    def written_for(pod: str, namespace: str) -> tuple[float, float]:
        """The operator's writes (GpuUsage, all) from a pod's creation to its interval settled."""
        before = (_writes(operator, "GpuUsage"), _writes(operator))
        apply(cl, [_pod(pod, namespace, resource, queue)])
        wait_for(lambda: pod in _running(cl, namespace), 90, f"{pod} Running")
        wait_for(lambda: any(iv["pod"] == pod for iv in _intervals(cl, namespace)), 30, f"{pod} metered")
        time.sleep(settle)
        return _writes(operator, "GpuUsage") - before[0], _writes(operator) - before[1]

    try:
        # Each is entitled to 2 (the GPU has 4 slices): the owner uses 1 of its own, the borrower
        # its 2 and a third lent from the owner's idle one.
        apply(cl, [_pod("b0", borrower, resource, queue)])
        wait_for(lambda: _running(cl, borrower) == ["b0"], 90, "b0 Running")
        plain = written_for("b1", borrower)  # within the entitlement
        lent_writes = written_for("b2", borrower)  # borrowed
        wait_for(lambda: _borrowed(cl, cq, resource) == 1, 30, "Kueue: 1 borrowed")
        apply(cl, [_pod("o0", owner, resource, queue)])
        wait_for(lambda: _running(cl, owner) == ["o0"], 90, "o0 Running")

        def marked() -> list[dict[str, Any]] | None:
            ivs = [iv for iv in _intervals(cl, borrower) if iv.get("end") is None]
            return ivs if len(ivs) == 3 and sum(bool(iv.get("borrowed")) for iv in ivs) == 1 else None

        ivs = wait_for(marked, 30, "the borrower's ledger: 3 open intervals, 1 borrowed")
        (lent,) = [iv for iv in ivs if iv.get("borrowed")]
        # Kueue counts quota, not pods: the newest slice is the borrowed one, borrowed from its start
        # (no split at the moment Kueue's status said so).
        assert lent["pod"] == "b2", ivs
        assert [iv for iv in _intervals(cl, borrower) if iv["claimUID"] == lent["claimUID"]] == [lent]
        owners = wait_for(lambda: _intervals(cl, owner) or None, 30, "the owner's ledger")
        assert [iv.get("borrowed") for iv in owners] == [None], owners

        # The operator restarts while the borrowed slice is held: nothing lost, nothing split.
        operator.stop()
        time.sleep(3)
        operator.start()
        time.sleep(8)  # its takeover, a flush and a Kueue read
        assert [iv for iv in _intervals(cl, borrower) if iv["claimUID"] == lent["claimUID"]] == [lent]
        cl.kubectl("delete", "pod", "b2", "-n", borrower, "--wait=true", "--timeout=60s")

        def closed() -> dict[str, Any] | None:
            mine = [iv for iv in _intervals(cl, borrower) if iv["claimUID"] == lent["claimUID"]]
            return mine[0] if len(mine) == 1 and mine[0].get("end") else None

        done = wait_for(closed, 30, "the borrowed interval closed")
        assert done["borrowed"] is True and done["start"] == lent["start"]
        # b0 and b1 were never borrowed, and are not now (Kueue: 0 borrowed).
        wait_for(lambda: _borrowed(cl, cq, resource) == 0, 30, "Kueue: 0 borrowed")
        time.sleep(3)
        others = [iv for iv in _intervals(cl, borrower) if iv["pod"] in ("b0", "b1")]
        assert len(others) == 2 and not any(iv.get("borrowed") for iv in others), others
        usage = [sys.executable, "-m", "gpuslice", "usage", f"--kubeconfig={cl.kubeconfig}", "-n", borrower]
        proc = subprocess.run([*usage, "-o", "json"], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        (row,) = json.loads(proc.stdout)["usage"]
        held = int((parse_rfc3339(done["end"]) - parse_rfc3339(done["start"])).total_seconds())
        assert row["borrowedSliceSeconds"] == held and 0 < held < row["sliceSeconds"], row
        # The borrowed hours at the package's borrowedPerHour, the rest at perHour.
        assert done["borrowedPricePerHour"] == "0.30" and done["pricePerHour"] == "0.45", done
        assert row["borrowedCost"] == money(Decimal("0.30") * held / 3600), row
        others_cost = Decimal("0.45") * (row["sliceSeconds"] - held) / 3600
        assert abs(Decimal(row["cost"]) - Decimal(row["borrowedCost"]) - others_cost) < Decimal("0.000002"), (
            row
        )
        table = subprocess.run(usage, capture_output=True, text=True, timeout=60).stdout
        assert "BORROWED-HOURS" in table.splitlines()[1], table
        # A borrowed price without Kueue is refused by the API server: nothing would be borrowed.
        bad = package_doc(f"{pair.pkg}-x", 25, {"share": pair.token}, slices=1)
        bad["spec"]["price"] = {"perHour": "0.45", "borrowedPerHour": "0.30", "currency": "EUR"}
        refused = cl.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(bad), check=False)
        assert (
            refused.returncode != 0 and "borrowedPerHour applies to sharing.mode Kueue only" in refused.stderr
        )
        print(
            f"borrowed interval {done['start']}..{done['end']} ({held}s) metered borrowed; "
            f"operator's writes (GpuUsage, all kinds) for a slice within the entitlement {plain}, "
            f"for a borrowed one {lent_writes}",
            flush=True,
        )
    finally:
        for ns in (owner, borrower):
            cl.kubectl("delete", "pods", "--all", "-n", ns, "--wait=false", check=False)


def _slice_status(cl: DevCluster, namespace: str, name: str) -> dict[str, Any]:
    return ((get(cl, "gpuslice", name, "-n", namespace) or {}).get("status")) or {}


def test_a_pod_kueue_holds_has_its_slice_queued_with_kueues_reason_and_place(
    kcluster: DevCluster, operator: OperatorProcess
) -> None:
    cl = kcluster
    pair = _lending_pair(cl, "w")
    resource, owner, borrower, queue = pair.resource, pair.owner, pair.borrower, pair.queue
    wait_for(lambda: get(cl, "localqueue", queue, "-n", borrower), 60, "the borrower's LocalQueue")
    wait_for(lambda: get(cl, "localqueue", queue, "-n", owner), 60, "the owner's LocalQueue")
    try:
        # Each holds its own 2 slices of the GPU's 4: nothing is left to lend.
        for ns, prefix in ((owner, "o"), (borrower, "b")):
            for i in range(2):
                apply(cl, [_pod(f"{prefix}{i}", ns, resource, queue)])
        wait_for(lambda: len(_running(cl, owner)) == len(_running(cl, borrower)) == 2, 90, "2 + 2 Running")
        apply(cl, [_pod("b2", borrower, resource, queue)])
        time.sleep(1)  # b3 younger than b2: Kueue's queue is first in, first out within a priority
        apply(cl, [_pod("b3", borrower, resource, queue)])

        def queued(name: str, position: int, pending: int) -> dict[str, Any] | None:
            st = _slice_status(cl, borrower, name)
            where = st.get("queue") or {}
            place = (where.get("position"), where.get("pending"))
            return st if st.get("reason") == "Queued" and place == (position, pending) else None

        st = wait_for(lambda: queued("b2", 1, 2), 60, "b2's slice Queued, 1st of 2")
        assert st["phase"] == "Pending", st
        # Kueue's own words, from its Workload's QuotaReserved condition
        assert f"waits in Kueue's queue {queue}: 1st of 2 pending (Workload " in st["message"], st
        assert f"insufficient unused quota for {resource}" in st["message"], st
        assert st["queue"]["localQueue"] == queue
        wl = get(cl, "workload", st["queue"]["workload"], "-n", borrower)
        assert wl["metadata"]["ownerReferences"][0]["name"] == "b2"
        wait_for(lambda: queued("b3", 2, 2), 60, "b3's slice Queued, 2nd of 2")
        explained = subprocess.run(
            [sys.executable, "-m", "gpuslice", "explain", f"{borrower}/b3", f"--kubeconfig={cl.kubeconfig}"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert explained.returncode == 0, explained.stderr
        assert "state:    Pending (Queued)" in explained.stdout, explained.stdout
        assert f"queue:    position 2 of 2 pending in Kueue's LocalQueue {queue}" in explained.stdout
        # The owner lets one slice go: Kueue lends it to b2, and b3 moves up.
        cl.kubectl("delete", "pod", "o1", "-n", owner, "--wait=true", "--timeout=60s")
        wait_for(lambda: "b2" in _running(cl, borrower), 90, "b2 Running on the lent slice")
        wait_for(lambda: _slice_status(cl, borrower, "b2").get("reason") == "InUse", 60, "b2's slice InUse")
        assert "queue" not in _slice_status(cl, borrower, "b2")
        wait_for(lambda: queued("b3", 1, 1), 60, "b3's slice Queued, 1st of 1")
        print(f"queued: {st['message']}", flush=True)
    finally:
        for ns in (owner, borrower):
            cl.kubectl("delete", "pods", "--all", "-n", ns, "--wait=false", check=False)


def _gated(pod: dict[str, Any]) -> bool:
    return any(g["name"] == c.KUEUE_ADMISSION_GATE for g in pod["spec"].get("schedulingGates") or [])


def _evicted_workloads(cl: DevCluster, namespace: str) -> list[dict[str, Any]]:
    return [
        wl
        for wl in get(cl, "workloads", "-n", namespace)["items"]
        if any(
            x["type"] == "Evicted" and x["status"] == "True"
            for x in (wl.get("status") or {}).get("conditions") or []
        )
    ]


def test_the_lending_limit_holds_while_more_is_idle_and_the_owners_unlent_part_is_admitted_at_once(
    kcluster: DevCluster, operator: OperatorProcess
) -> None:
    cl = kcluster
    # The owner lends at most 1 of its 2 slices; the borrower may borrow 2 (its quota ceiling is 4).
    pair = _lending_pair(cl, "l", sharing={"lendingLimit": 1})
    resource, owner, borrower, queue = pair.resource, pair.owner, pair.borrower, pair.queue

    def limits(cq: str) -> dict[str, Any]:
        found = get(cl, "clusterqueue", cq) or {}
        groups = (found.get("spec") or {}).get("resourceGroups") or [{}]
        return dict(groups[0].get("flavors", [{}])[0].get("resources", [{}])[0])

    wait_for(lambda: limits(pair.cqs[owner]).get("lendingLimit") == "1", 60, "the owner's lendingLimit 1")
    assert limits(pair.cqs[borrower])["borrowingLimit"] == "2"
    wait_for(lambda: get(cl, "localqueue", queue, "-n", borrower), 60, "the borrower's LocalQueue")
    wait_for(lambda: get(cl, "localqueue", queue, "-n", owner), 60, "the owner's LocalQueue")
    quota = wait_for(lambda: get(cl, "resourcequota", c.QUOTA_NAME, "-n", borrower), 30, "quota")
    assert quota["spec"]["hard"][f"requests.{resource}"] == "4"
    samples: list[int] = []

    def running_borrower() -> int:
        samples.append(len(_running(cl, borrower)))
        return samples[-1]

    try:
        # 4 pods pass the quota (ceiling 4) and the GPU has 4 slices idle: only 3 may run.
        for i in range(4):
            apply(cl, [_pod(f"b{i}", borrower, resource, queue)])
        wait_for(lambda: running_borrower() == 3, 90, "3 borrower pods Running")
        watched = time.monotonic()
        while time.monotonic() - watched < 15:
            running_borrower()
            time.sleep(0.5)
        assert max(samples) == 3, samples
        (held,) = [p for p in _pods(cl, borrower) if p["status"].get("phase") != "Running"]
        assert _gated(held), held["spec"]
        assert _borrowed(cl, pair.cqs[borrower], resource) == 1
        assert len(_allocated_devices(cl)) == 3  # the fourth slice idle, not lent
        # The owner's unlent slice is admitted at once: no preemption needed, none done.
        started = time.monotonic()
        apply(cl, [_pod("o0", owner, resource, queue)])
        wait_for(lambda: "o0" in _running(cl, owner), 60, "the owner's pod o0 Running")
        took = time.monotonic() - started
        assert running_borrower() == 3 and not _evicted_workloads(cl, borrower)
        watched = time.monotonic()
        while time.monotonic() - watched < 5:
            running_borrower()
            time.sleep(0.5)
        assert max(samples) == 3, samples
        print(
            f"lendingLimit 1: borrower's Running pods over {len(samples)} samples max {max(samples)} "
            f"(4 asked, 4 slices idle); owner's unlent slice Running {took:.2f}s after its request, "
            "no borrower evicted",
            flush=True,
        )
    finally:
        for ns in (owner, borrower):
            cl.kubectl("delete", "pods", "--all", "-n", ns, "--wait=false", check=False)


def _job(name: str, namespace: str, resource: str, queue: str) -> dict[str, Any]:
    """A Job of 2 pods through Kueue's batch/job integration. kwok completes a Job's pod as soon as
    it runs; these carry the devcluster's keep-running annotation, so they stay Running, as the
    pods of a Job at work do."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": namespace, "labels": {QUEUE_LABEL: queue}},
        "spec": {
            "parallelism": 2,
            "completions": 2,
            "template": {
                "metadata": {"annotations": {KWOK_KEEP_RUNNING: "true"}},
                "spec": {
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": 1,
                    "containers": [
                        {"name": "main", "image": "busybox", "resources": {"limits": {resource: "1"}}}
                    ],
                },
            },
        },
    }


def _deployment(name: str, namespace: str, resource: str, queue: str, replicas: int) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": {QUEUE_LABEL: queue}},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "terminationGracePeriodSeconds": 1,
                    "containers": [
                        {"name": "main", "image": "busybox", "resources": {"limits": {resource: "1"}}}
                    ],
                },
            },
        },
    }


def _owned_by(pod: dict[str, Any], kind: str) -> bool:
    return any(o["kind"] == kind for o in pod["metadata"].get("ownerReferences") or [])


def test_a_job_and_a_deployment_borrow_through_kueues_integrations_and_are_preempted_on_reclaim(
    kcluster: DevCluster, operator: OperatorProcess
) -> None:
    cl = kcluster
    pair = _lending_pair(cl, "j")
    resource, owner, borrower, queue = pair.resource, pair.owner, pair.borrower, pair.queue
    cq = pair.cqs[borrower]
    wait_for(lambda: get(cl, "localqueue", queue, "-n", borrower), 60, "the borrower's LocalQueue")
    wait_for(lambda: get(cl, "localqueue", queue, "-n", owner), 60, "the owner's LocalQueue")

    def pods_of(kind: str) -> list[dict[str, Any]]:
        return [
            p
            for p in _pods(cl, borrower)
            if _owned_by(p, kind) and not p["metadata"].get("deletionTimestamp")
        ]

    def running_of(kind: str) -> int:
        return sum(1 for p in pods_of(kind) if p["status"].get("phase") == "Running")

    def job_workload() -> dict[str, Any] | None:
        for wl in get(cl, "workloads", "-n", borrower)["items"]:
            if any(o["kind"] == "Job" for o in wl["metadata"].get("ownerReferences") or []):
                return dict(wl)
        return None

    def cond(wl: dict[str, Any] | None, type_: str) -> dict[str, Any]:
        return next(
            (x for x in ((wl or {}).get("status") or {}).get("conditions") or [] if x["type"] == type_), {}
        )

    try:
        # The Deployment's 2 pods use the borrower's own entitlement; the Job borrows the owner's 2.
        apply(cl, [_deployment("serve", borrower, resource, queue, 2)])
        wait_for(lambda: running_of("ReplicaSet") == 2, 90, "the Deployment's 2 pods Running")
        apply(cl, [_job("batch", borrower, resource, queue)])
        wait_for(lambda: running_of("Job") == 2, 90, "the Job's 2 pods Running")
        assert get(cl, "job", "batch", "-n", borrower)["spec"]["suspend"] is False
        wait_for(lambda: _borrowed(cl, cq, resource) == 2, 30, "2 slices borrowed in Kueue's status")
        # Reclaim: the owner asks for its 2; Kueue preempts the newest borrower, the Job.
        started = time.monotonic()
        for i in range(2):
            apply(cl, [_pod(f"o{i}", owner, resource, queue)])
        wait_for(lambda: len(_running(cl, owner)) == 2, 120, "the owner's 2 pods Running")
        job_reclaim = time.monotonic() - started
        job = wait_for(
            lambda: (j := get(cl, "job", "batch", "-n", borrower)) and j["spec"]["suspend"] and j,
            30,
            "the Job suspended",
        )
        assert job["spec"]["suspend"] is True
        wait_for(lambda: not pods_of("Job"), 60, "the Job's pods gone")
        wl = job_workload()
        assert cond(wl, "Preempted").get("reason") == "InCohortReclamation", wl
        # re-queued: it waits for quota again, in the same queue
        wl = wait_for(
            lambda: (w := job_workload()) and cond(w, "QuotaReserved").get("status") == "False" and w,
            60,
            "the Job's Workload pending again",
        )
        assert wl["spec"]["queueName"] == queue
        job_workload_name = wl["metadata"]["name"]
        assert running_of("ReplicaSet") == 2  # the Deployment's own slices untouched
        notice = [
            e
            for e in get(cl, "events", "-n", borrower)["items"]
            if e["involvedObject"]["kind"] in ("Job", "Workload")
            and e["involvedObject"]["name"] in ("batch", wl["metadata"]["name"])
            and e.get("reason") in ("Preempted", "EvictedDueToPreempted", "Stopped")
        ]
        assert notice, "the Job's owner sees no event of its preemption"
        job_notice = sorted({(e["involvedObject"]["kind"], e["reason"], e["message"]) for e in notice})

        # The Deployment borrows next: the Job gone and the owner idle, it grows to 4.
        cl.kubectl("delete", "job", "batch", "-n", borrower, "--cascade=foreground", "--wait=true")
        for i in range(2):
            cl.kubectl("delete", "pod", f"o{i}", "-n", owner, "--wait=true", "--timeout=60s")
        cl.kubectl("scale", "deployment", "serve", "-n", borrower, "--replicas=4")
        wait_for(lambda: running_of("ReplicaSet") == 4, 90, "the Deployment's 4 pods Running")
        wait_for(lambda: _borrowed(cl, cq, resource) == 2, 30, "2 slices borrowed in Kueue's status")
        started = time.monotonic()
        for i in range(2):
            apply(cl, [_pod(f"p{i}", owner, resource, queue)])
        wait_for(lambda: len(_running(cl, owner)) == 2, 120, "the owner's 2 pods Running again")
        deploy_reclaim = time.monotonic() - started
        wait_for(lambda: running_of("ReplicaSet") == 2, 60, "the Deployment back at 2 Running")
        # The ReplicaSet replaced the preempted pods; Kueue holds the replacements, and their
        # slices say so.
        held = wait_for(
            lambda: (
                [p for p in pods_of("ReplicaSet") if _gated(p)] if len(pods_of("ReplicaSet")) == 4 else None
            ),
            60,
            "the 2 replacement pods held by Kueue",
        )
        assert len(held) == 2
        st = wait_for(
            lambda: (
                (s := _slice_status(cl, borrower, held[0]["metadata"]["name"])).get("reason") == "Queued"
                and s
            ),
            60,
            "the replacement's slice Queued",
        )
        assert f"waits in Kueue's queue {queue}" in st["message"], st
        # A pod's Workload goes with its pod: what the borrower keeps is the events of its preemption.
        pod_notice = sorted(
            {
                (e["involvedObject"]["kind"], e["reason"], e["message"])
                for e in get(cl, "events", "-n", borrower)["items"]
                if e.get("reason") in ("Preempted", "EvictedDueToPreempted", "Stopped")
                and e["involvedObject"]["kind"] in ("Pod", "Workload")
                and e["involvedObject"]["name"] != job_workload_name
            }
        )
        assert pod_notice, "the Deployment's owner sees no event of its pods' preemption"
        print(
            f"Job (parallelism 2) reclaimed: owner's 2 pods Running {job_reclaim:.2f}s after the request, "
            f"Job suspended and re-queued; notice {json.dumps(job_notice[:3])}; Deployment (4 replicas, 2 "
            f"borrowed) reclaimed: owner's 2 pods Running {deploy_reclaim:.2f}s after the request, "
            f"replacements Queued: {st['message']!r}; notice {json.dumps(pod_notice[:2])}",
            flush=True,
        )
    finally:
        cl.kubectl("delete", "deployment,job", "--all", "-n", borrower, "--wait=false", check=False)
        for ns in (owner, borrower):
            cl.kubectl("delete", "pods", "--all", "-n", ns, "--wait=false", check=False)


def test_kueue_killed_mid_reclaim_oversells_nothing_and_the_owner_runs_without_an_operator_restart(
    kcluster: DevCluster, operator: OperatorProcess
) -> None:
    """Runs last in this file: it kills the module's Kueue (and starts it again, whatever happens)."""
    cl = kcluster
    pair = _lending_pair(cl, "k")
    resource, owner, borrower, queue = pair.resource, pair.owner, pair.borrower, pair.queue
    cq = pair.cqs[borrower]
    wait_for(lambda: get(cl, "localqueue", queue, "-n", borrower), 60, "the borrower's LocalQueue")
    wait_for(lambda: get(cl, "localqueue", queue, "-n", owner), 60, "the owner's LocalQueue")
    assert operator.proc is not None
    operator_pid = operator.proc.pid
    checks = 0

    def sold_once() -> None:
        nonlocal checks
        problems = card_memory(World.read(cl))
        checks += 1
        assert not problems, problems

    def evicted() -> str | None:
        # Kueue's "Preempted" event on the victim's Workload: it outlives the Workload, which the
        # garbage collector deletes with its pod a second or two after the eviction, sooner than a
        # loaded machine's next look at the Evicted condition (a run timed out there after 60 s)
        for ev in get(cl, "events", "-n", borrower, "--field-selector=reason=Preempted")["items"]:
            if ev["involvedObject"].get("kind") == "Workload":
                return str(ev["involvedObject"]["name"])
        for wl in get(cl, "workloads", "-n", borrower)["items"]:
            for cond in (wl.get("status") or {}).get("conditions") or []:
                if cond["type"] == "Evicted" and cond["status"] == "True":
                    return str(wl["metadata"]["name"])
        return None

    try:
        for i in range(4):
            apply(cl, [_pod(f"b{i}", borrower, resource, queue)])
        wait_for(lambda: len(_running(cl, borrower)) == 4, 90, "4 borrower pods Running")
        wait_for(lambda: _borrowed(cl, cq, resource) == 2, 30, "2 slices borrowed in Kueue's status")
        sold_once()
        started = time.monotonic()
        apply(cl, [_pod("o0", owner, resource, queue)])
        # Mid-reclaim: Kueue has evicted a borrower's Workload; the owner's pod does not run yet.
        victim = wait_for(evicted, 60, "Kueue evicting a borrower's workload")
        pid = kill_kueue(cl)
        killed = time.monotonic()
        assert "o0" not in _running(cl, owner), "the reclaim was over before Kueue was killed"
        print(f"killed kueue (pid {pid}) {killed - started:.2f}s after the owner's request, victim {victim}")
        while time.monotonic() - killed < 10:  # down for 10 s, no card over-sold meanwhile
            sold_once()
            time.sleep(0.5)
        down_running = "o0" in _running(cl, owner)
        restart_kueue(cl)
        restarted = time.monotonic()

        def owner_runs() -> bool:
            sold_once()
            return "o0" in _running(cl, owner)

        wait_for(owner_runs, 120, "the owner's pod Running after Kueue's restart")
        ran = time.monotonic()
        wait_for(lambda: len(_running(cl, borrower)) == 3, 60, "the borrower at 3")
        took = Invariants(cl, {owner, borrower}).settle("kueue killed mid-reclaim", restarted, timeout=60)
        # The operator was not restarted, and still keeps the package's queues.
        assert operator.proc is not None and operator.proc.pid == operator_pid
        assert operator.proc.poll() is None
        cond = wait_for(
            lambda: (x := _queues_condition(cl, pair.pkg)) and x["status"] == "True" and x, 30, "Queues True"
        )
        assert cond["reason"] == "QueuesReady", cond
        print(
            f"kueue killed mid-reclaim: owner's pod Running {ran - restarted:.2f}s after Kueue's restart "
            f"({ran - started:.2f}s after its request, Kueue down 10 s; Running while it was down: "
            f"{down_running}); invariants held {took:.2f}s after the restart; {checks} over-sale checks, "
            "none failed; operator not restarted",
            flush=True,
        )
    finally:
        if not _kueue_alive(cl):
            restart_kueue(cl)
        for ns in (owner, borrower):
            cl.kubectl("delete", "pods", "--all", "-n", ns, "--wait=false", check=False)


def _kueue_alive(cl: DevCluster) -> bool:
    st = cl.state()
    rec = st.processes.get("kueue") if st is not None else None
    return rec is not None and rec.alive()
