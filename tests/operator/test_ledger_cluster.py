"""The metering ledger on the real control plane: slices held for a measured time are billed that time
through an operator SIGKILL and restart, template slices per pod, a price change, the tenant's read
access (RBAC on the real API server), `kubectl get gpuusages` and `gpuslice usage`'s outputs.

Ground truth is what the test itself saw: the moment the claim showed its allocation and the moment
it showed it gone. `BILLING_ERRORS` collects |billed - seen| of every interval checked; the module
prints the largest.
"""

from __future__ import annotations

import csv
import io
import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from gpuslice import constants as c
from gpuslice_dev.devcluster.cluster import DevCluster, free_port
from support import apply, deployment_doc, pod_doc, slice_doc, wait_for

from .operator_cluster import (
    REPO,
    OperatorProcess,
    get,
    module_operator,
    package_doc,
    publish_gpus,
    tenant_rbac,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow(seconds=140)]
NS_LABEL = "gpuslice-test/ledger"
#: Allowed |billed - seen| seconds: the API's times have whole seconds, and the test polls.
TOLERANCE = 3.0
#: The module's operator renews the ledger's heartbeat this often (product default 10 s).
HEARTBEAT_SECONDS = 2
BILLING_ERRORS: list[float] = []


@pytest.fixture(scope="module")
def operator(cluster: DevCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    log = tmp_path_factory.mktemp("ledger-operator") / "operator.log"
    heartbeat = f"--ledger-heartbeat-seconds={HEARTBEAT_SECONDS}"
    with module_operator(cluster, log, f"--metrics-port={free_port()}", heartbeat) as op:
        try:
            yield op
        finally:
            if BILLING_ERRORS:
                worst = max(BILLING_ERRORS)
                print(f"\n[ledger] billing error, max over {len(BILLING_ERRORS)} intervals: {worst:.2f} s")


@dataclass
class World:
    cluster: DevCluster
    namespace: str
    token: str

    @property
    def pkg(self) -> str:
        return f"lg{self.token}-8g"

    def package(self, price: dict[str, str] | None, slices: int = 4) -> None:
        doc = package_doc(self.pkg, 25, {NS_LABEL: self.token}, slices)
        if price:
            doc["spec"]["price"] = price
        apply(self.cluster, [doc])
        publish_gpus(self.cluster, self.token, self.cluster.nodes[0], 1, {self.pkg: 25})
        wait_for(
            lambda: (
                (get(self.cluster, "resourcequota", c.QUOTA_NAME, "-n", self.namespace) or {})
                .get("status", {})
                .get("hard")
            ),
            60,
            "quota",
        )

    def claim(self, name: str) -> dict[str, Any] | None:
        result: dict[str, Any] | None = get(self.cluster, "resourceclaim", name, "-n", self.namespace)
        return result

    def usage(self) -> dict[str, Any]:
        month = datetime.now(UTC).strftime("%Y-%m")
        return get(self.cluster, "gpuusages.gpuslice.io", month, "-n", self.namespace) or {}

    def intervals(self) -> list[dict[str, Any]]:
        return list(self.usage().get("intervals") or [])


@pytest.fixture
def world(cluster: DevCluster, namespace: str, operator: OperatorProcess) -> World:
    token = "t" + uuid.uuid4().hex[:5]
    cluster.create_namespace(namespace, {NS_LABEL: token})
    return World(cluster, namespace, token)


def _ts(value: str) -> float:
    return datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def _allocated(w: World, claim: str) -> float:
    """The wall time the claim was first seen allocated."""
    wait_for(lambda: ((w.claim(claim) or {}).get("status") or {}).get("allocation"), 60, f"{claim} allocated")
    return time.time()


def _released(w: World, claim: str) -> float:
    wait_for(
        lambda: not ((w.claim(claim) or {}).get("status") or {}).get("allocation"), 60, f"{claim} deallocated"
    )
    return time.time()


def _interval(w: World, claim: str, closed: bool = True) -> dict[str, Any]:
    def find() -> dict[str, Any] | None:
        for iv in w.intervals():
            if iv["claim"] == claim and (iv.get("end") is not None) == closed:
                return iv
        return None

    return wait_for(find, 30, f"{'closed' if closed else 'open'} interval of {claim}")


def _check(iv: dict[str, Any], seen_start: float, seen_end: float) -> None:
    """The interval's times against what the test saw (it sees a change a poll after it happens)."""
    billed = _ts(iv["end"]) - _ts(iv["start"])
    error = abs(billed - (seen_end - seen_start))
    BILLING_ERRORS.append(error)
    assert error <= TOLERANCE, (iv, seen_start, seen_end)
    assert abs(_ts(iv["start"]) - seen_start) <= TOLERANCE
    assert abs(_ts(iv["end"]) - seen_end) <= TOLERANCE


def _kill_pod(w: World, name: str) -> None:
    w.cluster.kubectl("delete", "pod", name, "-n", w.namespace, "--grace-period=0", "--force")


def gpuslice_usage(
    cluster: DevCluster, *args: str, kubeconfig: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuslice",
            "usage",
            f"--kubeconfig={kubeconfig or cluster.kubeconfig}",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        check=False,
    )


def test_held_slices_are_billed_the_time_they_were_held_through_a_sigkill_and_restart(
    world: World, operator: OperatorProcess
) -> None:
    """b is held across the operator's SIGKILL and restart: billed exactly. a is released while no
    operator runs: a deallocated claim keeps no time of it in the API, so it is billed until the
    heartbeat's last renewal before the kill (never more than it was held)."""
    w = world
    w.package({"perHour": "0.45", "currency": "EUR"})
    apply(w.cluster, [slice_doc(n, w.namespace, w.pkg) for n in ("a", "b")])
    wait_for(lambda: w.claim("a") and w.claim("b"), 30, "claims")
    apply(w.cluster, [pod_doc("pa", w.namespace, "a"), pod_doc("pb", w.namespace, "b")])
    start_a, start_b = _allocated(w, "a"), _allocated(w, "b")
    # Written when it starts: the open interval is in the API before anything else happens.
    open_a = _interval(w, "a", closed=False)
    assert (open_a["pod"], open_a["pricePerHour"], open_a["currency"]) == ("pa", "0.45", "EUR")
    assert open_a["gpu"].startswith("GPU-") and open_a["node"] == w.cluster.nodes[0]
    time.sleep(5)
    operator.stop(signal.SIGKILL)  # no clean-up runs
    killed = time.time()
    # While no operator runs: a's pod ends (its claim is deallocated), b goes on.
    time.sleep(3)
    _kill_pod(w, "pa")
    end_a = _released(w, "a")
    time.sleep(30)
    operator.start()
    wait_for(lambda: "operator starting" in operator.tail(200), 30, "restart")
    iv_a = _interval(w, "a")
    assert abs(_ts(iv_a["start"]) - start_a) <= TOLERANCE
    assert killed - HEARTBEAT_SECONDS - TOLERANCE <= _ts(iv_a["end"]) <= killed + 1
    print(f"\n[ledger] released during the outage: billed {_ts(iv_a['end']) - killed:+.1f} s from the kill, "
          f"{_ts(iv_a['end']) - end_a:+.1f} s from the release")  # fmt: skip
    assert not [iv for iv in w.intervals() if iv["claim"] == "b" and iv.get("end")]
    time.sleep(3)
    _kill_pod(w, "pb")
    end_b = _released(w, "b")
    iv_b = _interval(w, "b")
    _check(iv_b, start_b, end_b)
    seen_a = _ts(iv_a["end"]) - start_a
    # One interval per allocation: the restart continued b's, it did not open a second one.
    assert sorted(iv["claim"] for iv in w.intervals()) == ["a", "b"]
    usage = w.usage()
    (pkg,) = usage["packages"]
    billed = pkg["sliceSeconds"]
    assert abs(billed - (seen_a + (end_b - start_b))) <= 2 * TOLERANCE
    assert pkg["peakSlices"] == 2 and usage["intervalCount"] == 2
    # kubectl get shows the month's totals.
    rows = w.cluster.kubectl("get", "gpuusages", "-n", w.namespace).stdout.splitlines()
    assert rows[0].split() == [
        "NAME",
        "MONTH",
        "SLICE-HOURS",
        "COST",
        "PACKAGES",
        "INTERVALS",
        "FINAL",
        "AGE",
    ]
    month = datetime.now(UTC).strftime("%Y-%m")
    assert rows[1].split()[:4] == [month, month, f"{billed / 3600:.2f}", usage["cost"].split()[0]]

    # gpuslice usage: JSON, CSV and the table agree with the object.
    proc = gpuslice_usage(w.cluster, "-n", w.namespace, "-o", "json", "--intervals")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    (row,) = doc["usage"]
    assert (row["namespace"], row["package"], row["sliceSeconds"], row["currency"]) == (
        w.namespace,
        w.pkg,
        billed,
        "EUR",
    )
    assert abs(float(row["cost"]) - billed / 3600 * 0.45) < 1e-6
    assert sorted(iv["pod"] for iv in doc["intervals"]) == ["pa", "pb"]
    proc = gpuslice_usage(w.cluster, "-n", w.namespace, "-o", "csv")
    (csv_row,) = list(csv.DictReader(io.StringIO(proc.stdout)))
    assert (csv_row["package"], csv_row["sliceSeconds"], csv_row["cost"]) == (w.pkg, str(billed), row["cost"])
    proc = gpuslice_usage(w.cluster, "-n", w.namespace)
    lines = proc.stdout.splitlines()
    assert lines[1].split() == [
        "NAMESPACE",
        "PACKAGE",
        "SLICE-HOURS",
        "CARD-HOURS",
        "PEAK",
        "INTERVALS",
        "COST",
        "CURRENCY",
    ]
    assert lines[2].split() == [
        w.namespace,
        w.pkg,
        f"{billed / 3600:.2f}",
        f"{billed * 0.25 / 3600:.2f}",  # quarter slices: a quarter card each
        "2",
        "2",
        f"{float(row['cost']):.2f}",
        "EUR",
    ]


def test_template_slices_are_billed_per_pod(world: World) -> None:
    w = world
    w.package(None)
    apply(
        w.cluster,
        [
            slice_doc("workers", w.namespace, w.pkg, template=True),
            deployment_doc("workers", w.namespace, template="workers", replicas=2),
        ],
    )

    def claims() -> list[dict[str, Any]]:
        items = get(w.cluster, "resourceclaims", "-n", w.namespace)["items"]
        return [x for x in items if (x.get("status") or {}).get("allocation")]

    wait_for(lambda: len(claims()) == 2, 90, "two allocated claims")
    seen = time.time()
    names = sorted(x["metadata"]["name"] for x in claims())
    wait_for(
        lambda: len([iv for iv in w.intervals() if iv.get("end") is None]) == 2, 30, "two open intervals"
    )
    ivs = w.intervals()
    assert sorted(iv["claim"] for iv in ivs) == names
    assert all(iv["slice"] == "workers" and iv["template"] for iv in ivs)
    assert len({iv["pod"] for iv in ivs}) == 2 and all(iv["pod"].startswith("workers-") for iv in ivs)
    time.sleep(4)
    w.cluster.kubectl("scale", "deployment", "workers", "-n", w.namespace, "--replicas=0")
    wait_for(lambda: not claims(), 90, "claims released")
    gone = time.time()
    wait_for(lambda: all(iv.get("end") for iv in w.intervals()), 30, "intervals closed")
    for iv in w.intervals():
        # The claims were seen allocated a poll late and seen gone a poll late (they go together).
        assert _ts(iv["start"]) <= seen + 1 and abs(_ts(iv["end"]) - gone) <= TOLERANCE + 2
    (pkg,) = w.usage()["packages"]
    assert (pkg["peakSlices"], pkg["intervals"], pkg.get("cost") or {}) == (2, 2, {})


def test_a_price_change_bills_what_was_held_before_at_the_old_price(world: World) -> None:
    w = world
    bad = package_doc(f"lg{w.token}-bad", 25, None)
    bad["spec"]["price"] = {"perHour": "0.45", "currency": "EURO"}
    proc = w.cluster.kubectl("apply", "-f", "-", input=json.dumps(bad), check=False)
    assert proc.returncode != 0 and "ISO 4217" in proc.stderr
    bad["spec"]["price"] = {"perHour": "1e3", "currency": "EUR"}
    proc = w.cluster.kubectl("apply", "-f", "-", input=json.dumps(bad), check=False)
    assert proc.returncode != 0 and "spec.price.perHour" in proc.stderr

    w.package({"perHour": "0.45", "currency": "EUR"})
    apply(w.cluster, [slice_doc("s", w.namespace, w.pkg)])
    wait_for(lambda: w.claim("s"), 30, "claim")
    apply(w.cluster, [pod_doc("p", w.namespace, "s")])
    start = _allocated(w, "s")
    _interval(w, "s", closed=False)
    time.sleep(4)
    w.cluster.kubectl(
        "patch",
        "gpupackages.gpuslice.io",
        w.pkg,
        "--type=merge",
        "-p",
        '{"spec":{"price":{"perHour":"0.90"}}}',
    )
    changed = time.time()
    wait_for(lambda: len(w.intervals()) == 2, 30, "a second interval at the new price")
    time.sleep(3)
    _kill_pod(w, "p")
    end = _released(w, "s")
    wait_for(lambda: all(iv.get("end") for iv in w.intervals()), 30, "closed")
    old, new = sorted(w.intervals(), key=lambda iv: iv["start"])
    assert (old["pricePerHour"], new["pricePerHour"]) == ("0.45", "0.90")
    assert old["end"] == new["start"] and abs(_ts(old["end"]) - changed) <= TOLERANCE
    _check({"start": old["start"], "end": new["end"]}, start, end)
    (pkg,) = w.usage()["packages"]
    expected = (_ts(old["end"]) - _ts(old["start"])) * 0.45 / 3600 + (
        _ts(new["end"]) - _ts(new["start"])
    ) * 0.9 / 3600
    assert abs(float(pkg["cost"]["EUR"]) - expected) < 1e-5


def test_a_tenant_reads_its_own_ledger_and_no_other(world: World, cluster: DevCluster) -> None:
    w = world
    other = f"{w.namespace[:50]}-other"
    cluster.create_namespace(other)
    try:
        w.package(None)
        apply(w.cluster, [slice_doc("s", w.namespace, w.pkg)])
        wait_for(lambda: w.claim("s"), 30, "claim")
        apply(w.cluster, [pod_doc("p", w.namespace, "s")])
        _allocated(w, "s")
        _interval(w, "s", closed=False)
        month = datetime.now(UTC).strftime("%Y-%m")
        # A ledger object in the other namespace, as the operator would write one there.
        cluster.kubectl(
            "apply", "--server-side", "-f", "-",
            input=json.dumps({"apiVersion": c.GROUP_VERSION, "kind": c.USAGE_KIND, "month": month,
                              "metadata": {"name": month, "namespace": other,
                                           "labels": {c.LABEL_MONTH: month}}}),
        )  # fmt: skip
        with tenant_rbac(cluster, w.namespace, f"bob-{w.token}") as bob:
            own = cluster.kubectl("get", "gpuusages", "-n", w.namespace, kubeconfig=bob, check=False)
            assert own.returncode == 0 and month in own.stdout, own.stderr
            theirs = cluster.kubectl("get", "gpuusages", "-n", other, kubeconfig=bob, check=False)
            assert theirs.returncode != 0 and "forbidden" in theirs.stderr.lower()
            everyone = gpuslice_usage(cluster, "-A", kubeconfig=bob)
            assert everyone.returncode == 2 and "cannot read GpuUsage in all namespaces" in everyone.stderr
            mine = gpuslice_usage(cluster, "-n", w.namespace, "-o", "json", kubeconfig=bob)
            assert mine.returncode == 0, mine.stderr
            assert [r["package"] for r in json.loads(mine.stdout)["usage"]] == [w.pkg]
            # Read only, even with `edit` in the namespace: the ledger is the operator's.
            patch = cluster.kubectl(
                "patch", "gpuusages", month, "-n", w.namespace, "--type=merge", "-p", '{"final":true}',
                kubeconfig=bob, check=False,
            )  # fmt: skip
            assert patch.returncode != 0 and "forbidden" in patch.stderr.lower()
            delete = cluster.kubectl(
                "delete", "gpuusages", month, "-n", w.namespace, kubeconfig=bob, check=False
            )
            assert delete.returncode != 0 and "forbidden" in delete.stderr.lower()
    finally:
        cluster.kubectl("delete", "namespace", other, "--wait=false", check=False)


def _usage(used_gib: float, limit_gib: int, util: float, refused: int, at: datetime) -> str:
    """status.usage as the node agent writes it (agent/usage.py: usage_status), as a JSON patch."""
    usage = {
        "memoryUsedBytes": int(used_gib * 2**30),
        "memoryLimitBytes": limit_gib * 2**30,
        "computeShare": 50,
        "refusedAllocations": refused,
        "throttledSeconds": 0.0,
        "processes": [{"pid": 4242, "memoryUsedBytes": int(used_gib * 2**30), "refusedAllocations": refused}],
        "time": at.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "computeUtilizationPercent": util,
    }
    return json.dumps([{"op": "add", "path": "/status/usage", "value": usage}])


def test_real_usage_goes_into_the_interval_and_the_advice_names_a_package(world: World) -> None:
    w = world
    small, big = f"lg{w.token}-8g", f"lg{w.token}-16g"
    apply(
        w.cluster,
        [package_doc(small, 25, {NS_LABEL: w.token}, 2), package_doc(big, 50, {NS_LABEL: w.token}, 2)],
    )
    publish_gpus(w.cluster, w.token, w.cluster.nodes[1], 1, {small: 25, big: 50})

    def hard() -> dict[str, str]:
        quota = get(w.cluster, "resourcequota", c.QUOTA_NAME, "-n", w.namespace) or {}
        return dict((quota.get("spec") or {}).get("hard") or {})

    keys = {c.quota_key(small), c.quota_key(big)}
    wait_for(lambda: keys <= hard().keys() or None, 60, f"quota for both packages ({keys})")
    apply(w.cluster, [slice_doc("llm", w.namespace, big)])
    wait_for(lambda: w.claim("llm"), 30, "claim")
    apply(w.cluster, [pod_doc("p", w.namespace, "llm")])
    _allocated(w, "llm")
    _interval(w, "llm", closed=False)
    # Two readings of the agent 20 s apart: 3 GiB of the 16 GiB slice at most, 60 % then 20 %.
    t0 = datetime.now(UTC).replace(microsecond=0)
    for used, util, dt in ((2.0, 60.0, 0), (3.0, 20.0, 20)):
        patch = _usage(used, 16, util, 0, datetime.fromtimestamp(t0.timestamp() + dt, UTC))
        w.cluster.kubectl(
            "patch", "gpuslices.gpuslice.io", "llm", "-n", w.namespace, "--subresource=status",
            "--type=json", "-p", patch,
        )  # fmt: skip
        time.sleep(1)
    _kill_pod(w, "p")
    _released(w, "llm")
    iv = _interval(w, "llm")
    assert (iv["peakMemoryBytes"], iv["memoryLimitBytes"]) == (3 * 2**30, 16 * 2**30)
    assert (iv["meanUtilizationPercent"], iv["observedSeconds"]) == (60.0, 20)
    proc = gpuslice_usage(w.cluster, "-n", w.namespace, "--advice", "-o", "json")
    assert proc.returncode == 0, proc.stderr
    (advice,) = json.loads(proc.stdout)["advice"]
    assert (advice["slice"], advice["advice"], advice["suggest"]) == ("llm", "smaller", small)
    assert "peak 3.0 GiB of 16.0 GiB" in advice["reason"]
    table = gpuslice_usage(w.cluster, "-n", w.namespace, "--advice").stdout
    assert f"{w.namespace}/llm ({big}): use a smaller package {small}" in table
