"""What `kubectl get gpupackages` prints follows allocations, releases and a failed card within the
bound the README states, on the real control plane (kube-scheduler allocates; GPUs published by hand
as the node agent does), and a burst of claim changes costs a few package status writes, not one each.

The module's operator rechecks only every 60 s, so its timer cannot be what keeps the count current.
Each lag is measured from no later than the cause (the start of the last poll that did not show it,
or the moment before the test's own write) to the first poll that shows the new count: it includes
the polls' own time, so the operator's real lag is smaller."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from gpuslice import constants as c
from gpuslice.domain.capacity_window import CAPACITY_BOUND_SECONDS, CAPACITY_WINDOW_SECONDS
from gpuslice.domain.health import HEALTHY, after_xid, taint
from gpuslice.timefmt import rfc3339
from gpuslice_dev.devcluster.cluster import DevCluster, free_port
from support import (
    apply,
    lag_of,
    metrics_readers,
    objects,
    pod_doc,
    published,
    slice_doc,
    wait_for,
)

from .operator_cluster import POOL_PREFIX, TEST_LABEL, OperatorProcess, get, module_operator, package_doc

pytestmark = [pytest.mark.cluster, pytest.mark.slow(seconds=120)]
NS_LABEL = "gpuslice-test/capacity"
WRITES = 'gpuslice_operator_status_updates_total{kind="GpuPackage"'


@pytest.fixture(scope="module")
def operator(cluster: DevCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    """With the package timer and the resync at 60 s: the capacity seen within the bound is the
    recount's, not theirs."""
    log = tmp_path_factory.mktemp("capacity-operator") / "operator.log"
    args = (f"--metrics-port={free_port()}", "--recheck-seconds=60", "--resync-seconds=60")
    with (
        metrics_readers(cluster) as readers,
        module_operator(cluster, log, *args, metrics_token=readers.prometheus) as op,
    ):
        yield op


def _writes(op: OperatorProcess) -> float:
    return sum(float(line.split()[-1]) for line in op.metrics().splitlines() if line.startswith(WRITES))


def _objects(cluster: DevCluster, namespace: str, package: str, claims: list[str]) -> dict[str, Any]:
    return objects(
        cluster,
        namespace,
        f"gpupackages.gpuslice.io/{package}",
        *(f"resourceclaims.{c.DRA_GROUP}/{n}" for n in claims),
    )


def _capacity(objs: dict[str, Any], package: str) -> dict[str, Any]:
    return dict(((objs.get(f"GpuPackage/{package}") or {}).get("status") or {}).get("capacity") or {})


def _allocated(objs: dict[str, Any], claim: str) -> bool:
    return bool(((objs.get(f"ResourceClaim/{claim}") or {}).get("status") or {}).get("allocation"))


def test_capacity_follows_allocation_release_and_a_failed_card_within_the_bound(
    cluster: DevCluster, namespace: str, operator: OperatorProcess
) -> None:
    token = "t" + uuid.uuid4().hex[:5]
    cluster.kubectl("label", "namespace", namespace, f"{NS_LABEL}={token}")
    pkg = f"cc{token}-8g"
    apply(cluster, [package_doc(pkg, 25, {NS_LABEL: token}, 20)])
    pool = f"{POOL_PREFIX}{token}-{cluster.nodes[0]}"

    def publish(taints: dict[int, list[dict[str, Any]]] | None = None, generation: int = 1) -> None:
        docs = published(pool, 2, {pkg: 25}, generation=generation, taints=taints)
        for d in docs:
            d["spec"]["nodeName"] = cluster.nodes[0]
            d["metadata"]["labels"][TEST_LABEL] = "true"
        apply(cluster, docs)

    publish()
    wait_for(
        lambda: (
            (get(cluster, "resourcequota", c.QUOTA_NAME, "-n", namespace) or {}).get("status", {}).get("hard")
        ),
        60,
        "quota",
    )
    full = {"gpus": 2, "slicesTotal": 8, "slicesAllocated": 0, "slicesFree": 8}
    wait_for(lambda: _capacity(_objects(cluster, namespace, pkg, []), pkg) == full, 30, "capacity of 2 cards")

    # An allocation: kube-scheduler allocates the slice's claim for its pod.
    apply(cluster, [slice_doc("one", namespace, pkg), pod_doc("one", namespace)])
    wait_for(lambda: get(cluster, "resourceclaim", "one", "-n", namespace), 30, "the slice's claim")
    lags = {}
    lags["allocation"] = lag_of(
        lambda: _objects(cluster, namespace, pkg, ["one"]),
        lambda o: _allocated(o, "one"),
        lambda o: _capacity(o, pkg) == {**full, "slicesAllocated": 1, "slicesFree": 7},
        "capacity with the allocation",
    )

    # A release: the pod and its slice go, and with them the claim.
    cluster.kubectl("delete", "pod", "one", "-n", namespace, "--wait=false")
    cluster.kubectl("delete", "gpuslices.gpuslice.io", "one", "-n", namespace, "--wait=false")
    lags["release"] = lag_of(
        lambda: _objects(cluster, namespace, pkg, ["one"]),
        lambda o: not _allocated(o, "one"),
        lambda o: _capacity(o, pkg) == full,
        "capacity without the released claim",
    )

    # A card fails: the node republishes its devices with the NoExecute taint (as the agent does on XID 79).
    failed = taint(after_xid(HEALTHY, 79, rfc3339(datetime.now(UTC))))
    assert failed is not None and failed["effect"] == "NoExecute"
    since = time.monotonic()
    publish({0: [failed]}, generation=2)
    lags["failed card"] = lag_of(
        lambda: _objects(cluster, namespace, pkg, []),
        lambda o: True,
        lambda o: (
            _capacity(o, pkg)
            == {"gpus": 1, "slicesTotal": 4, "slicesAllocated": 0, "slicesFree": 4, "unhealthyGpus": 1}
        ),
        "capacity without the failed card",
        since=since,
    )
    since = time.monotonic()
    publish(generation=3)
    lags["recovered card"] = lag_of(
        lambda: _objects(cluster, namespace, pkg, []),
        lambda o: True,
        lambda o: _capacity(o, pkg) == full,
        "capacity with the card back",
        since=since,
    )
    print("\n[capacity lag] " + ", ".join(f"{k} {v:.2f} s" for k, v in lags.items()))
    assert all(v <= CAPACITY_BOUND_SECONDS for v in lags.values()), lags

    # A burst: ten slices allocated, then all ten released, each as quickly as the cluster goes.
    names = [f"b{i}" for i in range(10)]
    before = _writes(operator)
    started = time.monotonic()
    apply(cluster, [d for n in names for d in (slice_doc(n, namespace, pkg), pod_doc(n, namespace))])
    wait_for(
        lambda: _capacity(_objects(cluster, namespace, pkg, []), pkg).get("slicesAllocated") == 8,
        60,
        "8 of the 10 slices allocated (the cards hold 8)",
    )
    allocating = time.monotonic() - started
    allocated = _writes(operator) - before

    before = _writes(operator)
    started = time.monotonic()
    cluster.kubectl("delete", "pods,gpuslices.gpuslice.io", *names, "-n", namespace, "--wait=false")
    wait_for(lambda: _capacity(_objects(cluster, namespace, pkg, []), pkg) == full, 60, "all released")
    releasing = time.monotonic() - started
    released = _writes(operator) - before
    print(
        f"[capacity writes] 10 allocations in {allocating:.1f} s: {allocated:.0f} package status writes; "
        f"10 releases in {releasing:.1f} s: {released:.0f}"
    )
    # One write per window at most, whatever the number of claim changes in it.
    for writes, took in ((allocated, allocating), (released, releasing)):
        assert 1 <= writes <= math.ceil(took / CAPACITY_WINDOW_SECONDS) + 1, (writes, took)
        assert writes < 10, (writes, took)

    # Nothing changes: nothing is written.
    at_rest = _writes(operator)
    time.sleep(3 * CAPACITY_WINDOW_SECONDS + 1)
    assert _writes(operator) == at_rest


def _refuse_package_status(cluster: DevCluster, name: str, package: str) -> None:
    """A ValidatingAdmissionPolicy refusing every GpuPackage status write, as a stricter policy or an
    outage would; waits until the API server refuses one (dry run)."""
    admission = "admissionregistration.k8s.io/v1"
    meta = {"name": name, "labels": {TEST_LABEL: "true"}}
    rule = {
        "apiGroups": [c.API_GROUP],
        "apiVersions": ["*"],
        "operations": ["UPDATE"],
        "resources": ["gpupackages/status"],
    }
    apply(
        cluster,
        [
            {
                "apiVersion": admission,
                "kind": "ValidatingAdmissionPolicy",
                "metadata": meta,
                "spec": {
                    "failurePolicy": "Fail",
                    "matchConstraints": {"resourceRules": [rule]},
                    "validations": [{"expression": "false", "message": f"refused for the test ({name})"}],
                },
            },
            {
                "apiVersion": admission,
                "kind": "ValidatingAdmissionPolicyBinding",
                "metadata": meta,
                "spec": {"policyName": name, "validationActions": ["Deny"]},
            },
        ],
    )

    def refused() -> bool:
        proc = cluster.kubectl(
            "patch", "gpupackages.gpuslice.io", package, "--subresource=status", "--type=merge",
            "-p", '{"status": {"entitledNamespaces": 7}}', "--dry-run=server", check=False,
        )  # fmt: skip
        return "refused for the test" in proc.stderr

    wait_for(refused, 30, f"{name} in force")


def test_a_refused_capacity_write_is_retried_within_the_window_not_after_a_timer_backoff(
    cluster: DevCluster, namespace: str, operator: OperatorProcess
) -> None:
    token = "t" + uuid.uuid4().hex[:5]
    cluster.kubectl("label", "namespace", namespace, f"{NS_LABEL}={token}")
    pkg = f"cr{token}-8g"
    apply(cluster, [package_doc(pkg, 25, {NS_LABEL: token}, 4)])
    pool = f"{POOL_PREFIX}{token}-{cluster.nodes[0]}"
    docs = published(pool, 1, {pkg: 25})
    for d in docs:
        d["spec"]["nodeName"] = cluster.nodes[0]
        d["metadata"]["labels"][TEST_LABEL] = "true"
    apply(cluster, docs)
    full = {"gpus": 1, "slicesTotal": 4, "slicesAllocated": 0, "slicesFree": 4}
    wait_for(lambda: _capacity(_objects(cluster, namespace, pkg, []), pkg) == full, 30, "capacity of 1 card")
    wait_for(
        lambda: (
            (get(cluster, "resourcequota", c.QUOTA_NAME, "-n", namespace) or {}).get("status", {}).get("hard")
        ),
        60,
        "quota",
    )
    policy = f"refuse-{pkg}"
    _refuse_package_status(cluster, policy, pkg)
    try:
        apply(cluster, [slice_doc("one", namespace, pkg), pod_doc("one", namespace)])
        wait_for(
            lambda: _allocated(_objects(cluster, namespace, pkg, ["one"]), "one"), 60, "the claim allocated"
        )
        time.sleep(3 * CAPACITY_WINDOW_SECONDS)  # several recounts refused meanwhile
        assert _capacity(_objects(cluster, namespace, pkg, []), pkg) == full, "the refusal was in force"
    finally:
        cluster.kubectl("delete", "validatingadmissionpolicybinding,validatingadmissionpolicy", policy)
    since = time.monotonic()
    lag = lag_of(
        lambda: _objects(cluster, namespace, pkg, []),
        lambda o: True,
        lambda o: _capacity(o, pkg) == {**full, "slicesAllocated": 1, "slicesFree": 3},
        "capacity once the refusal is lifted",
        since=since,
    )
    # The policy's removal takes a moment to reach the API server's admission: the bound from then on
    # is the window plus a write; a failed recount waiting out Kopf's 60 s backoff would not pass.
    assert lag <= CAPACITY_BOUND_SECONDS + 1, lag
