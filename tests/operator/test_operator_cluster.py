"""The operator on the real control plane: packages, quotas, admission, slices and their status.

One operator process serves the module; every test makes its own packages (named after a token)
entitled to its own namespace, and publishes its own GPUs by hand the way the node agent does.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuslice import constants as c
from gpuslice.api.package import GpuPackageSpec, IsolationMode
from gpuslice.operator.kube import MAX_WRITES_IN_FLIGHT
from gpuslice.operator.run import POSTING_WORKERS
from gpuslice_dev.devcluster.cluster import DevCluster, free_port
from support import (
    MetricsReaders,
    apply,
    argocd_health,
    deployment_doc,
    metrics_readers,
    pod_doc,
    scrape,
    slice_doc,
    wait_for,
)

from .operator_cluster import (
    REPO,
    TEST_LABEL,
    OperatorProcess,
    apply_tenant_roles,
    create_as,
    get,
    kubectl_as,
    module_operator,
    package_doc,
    publish_gpus,
    slice_status,
    tenant_rbac,
    wait_status,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow(seconds=320)]
NS_LABEL = "gpuslice-test/tenant"
#: The module's operator resyncs every slice this often (the product default is 30 s): the at-rest
#: test then sees a full resync in less time.
RESYNC_SECONDS = 10


@pytest.fixture(scope="module")
def readers(cluster: DevCluster) -> Iterator[MetricsReaders]:
    with metrics_readers(cluster) as found:
        yield found


@pytest.fixture(scope="module")
def operator(
    cluster: DevCluster, readers: MetricsReaders, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    with module_operator(
        cluster,
        tmp_path_factory.mktemp("operator") / "operator.log",
        f"--metrics-port={free_port()}",
        f"--resync-seconds={RESYNC_SECONDS}",
        "--max-gpuslices-per-namespace=1000",  # the scale test puts 150 slices in one namespace
        metrics_token=readers.prometheus,
    ) as op:
        yield op


@dataclass
class World:
    cluster: DevCluster
    namespace: str
    token: str

    def pkg(self, size: str) -> str:
        return f"op{self.token}-{size}"

    def packages(self, sizes: dict[str, int], slices: int = 2, model: str = "Tesla V100-PCIE-32GB") -> None:
        apply(
            self.cluster,
            [package_doc(self.pkg(s), f, {NS_LABEL: self.token}, slices, model) for s, f in sizes.items()],
        )
        for s in sizes:
            wait_for(
                lambda s=s: get(self.cluster, "deviceclass", c.device_class_name(self.pkg(s))),
                30,
                "DeviceClass",
            )

    def gpus(self, node: str, count: int, sizes: dict[str, int]) -> str:
        return publish_gpus(self.cluster, self.token, node, count, {self.pkg(s): f for s, f in sizes.items()})

    def quota_hard(self) -> dict[str, str]:
        q = get(self.cluster, "resourcequota", c.QUOTA_NAME, "-n", self.namespace)
        return (q or {}).get("spec", {}).get("hard", {})


@pytest.fixture
def world(cluster: DevCluster, namespace: str, operator: OperatorProcess) -> World:
    # A letter first: Go's YAML reads a label value like 12e456 as a number.
    token = "t" + uuid.uuid4().hex[:5]
    cluster.create_namespace(namespace, {NS_LABEL: token})
    return World(cluster, namespace, token)


def _tenant_ok(w: World) -> None:
    wait_for(lambda: w.quota_hard(), 30, "gpuslice quota")
    wait_for(
        lambda: (
            (get(w.cluster, "namespace", w.namespace) or {})
            .get("metadata", {})
            .get("labels", {})
            .get(c.LABEL_TENANT)
            == "true"
        ),
        30,
        "tenant label",
    )


# --- schema ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expect"),
    [
        ({"gpuModel": "X", "fraction": 0}, "spec.fraction"),
        ({"gpuModel": "X", "fraction": 101}, "spec.fraction"),
        ({"gpuModel": "X", "fraction": 25, "computeShare": 0}, "spec.computeShare"),
        ({"fraction": 25}, "spec.gpuModel: Required value"),
        (
            {
                "gpuModel": "X",
                "fraction": 25,
                "entitlements": [{"namespaceSelector": {"matchLabels": {"a": "b"}}, "slices": -1}],
            },
            "slices",
        ),
        (
            {
                "gpuModel": "X",
                "fraction": 25,
                "entitlements": [{"namespaceSelector": {"matchLabels": {"bad key!": "b"}}, "slices": 1}],
            },
            "matchLabels keys must be label keys",
        ),
        (
            {
                "gpuModel": "X",
                "fraction": 25,
                "entitlements": [
                    {"namespaceSelector": {"matchExpressions": [{"key": "a", "operator": "In"}]}, "slices": 1}
                ],
            },
            "In and NotIn need at least one value",
        ),
        (
            {"gpuModel": "X", "fraction": 25, "entitlements": [{"namespaceSelector": {}, "slices": 1}]},
            "would entitle every namespace",
        ),
        (
            {"gpuModel": "X", "fraction": 100, "isolation": {"mode": "Hardware"}},
            "migProfile or isolation.memory is required with isolation.mode Hardware",
        ),
        ({"gpuModel": "X", "fraction": 25, "migProfile": "1g.10gb"}, "forbidden otherwise"),
        (
            {"gpuModel": "X", "fraction": 25, "isolation": {"mode": "Hardware"}, "migProfile": "1g.10gb"},
            "fraction must be 100",
        ),
        (
            {"gpuModel": "X", "fraction": 100, "isolation": {"mode": "Hardware"}, "migProfile": "10gb"},
            "migProfile must be a MIG GPU instance profile name",
        ),
        (
            {
                "gpuModel": "X",
                "fraction": 100,
                "isolation": {"mode": "Hardware", "memory": "10Gi"},
                "migProfile": "1g.10gb",
            },
            "name migProfile or isolation.memory",
        ),
        (
            {"gpuModel": "X", "fraction": 100, "isolation": {"mode": "Hardware", "memory": "10GB"}},
            "isolation.memory must be a whole quantity",
        ),
        ({"gpuModel": "X", "fraction": 25, "isolation": {"memory": "10Gi"}}, "forbidden otherwise"),
    ],
)
def test_package_schema_rejects_bad_products_with_clear_messages(
    cluster: DevCluster, spec: dict[str, Any], expect: str
) -> None:
    cluster.apply_crds()
    doc = {"apiVersion": c.GROUP_VERSION, "kind": c.PACKAGE_KIND, "metadata": {"name": "bad"}, "spec": spec}
    proc = cluster.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(doc), check=False)
    assert proc.returncode != 0 and expect in proc.stderr, proc.stderr


def test_a_hardware_package_of_a_mig_profile_is_accepted(cluster: DevCluster) -> None:
    cluster.apply_crds()
    spec = {"gpuModel": "NVIDIA A100-SXM4-80GB", "fraction": 100, "isolation": {"mode": "Hardware"}}
    doc = {
        "apiVersion": c.GROUP_VERSION,
        "kind": c.PACKAGE_KIND,
        "metadata": {"name": "a100-1g"},
        "spec": {**spec, "migProfile": "1g.10gb+me"},
    }
    create = ("create", "--dry-run=server", "-o", "json", "-f", "-")
    proc = cluster.kubectl(*create, input=json.dumps(doc), check=False)
    assert proc.returncode == 0, proc.stderr
    # ... or of a memory size, which the operator maps to a profile
    doc["spec"] = {**spec, "isolation": {"mode": "Hardware", "memory": "9Gi"}}
    proc = cluster.kubectl(*create, input=json.dumps(doc), check=False)
    assert proc.returncode == 0, proc.stderr
    # A package that names no mode is a Software product. The CRD adds no default (an object stored by
    # 0.1.0 reads back as it was stored: tests/upgrade/test_crd_upgrade.py); the operator reads the
    # absence as Software.
    doc["spec"] = {"gpuModel": "X", "fraction": 25, "isolation": {}}
    proc = cluster.kubectl(*create, input=json.dumps(doc), check=False)
    assert proc.returncode == 0, proc.stderr
    stored = json.loads(proc.stdout)["spec"]
    assert "mode" not in stored["isolation"]
    assert GpuPackageSpec.model_validate(stored).isolation.mode == IsolationMode.SOFTWARE
    # ... and it stays one: naming Hardware later (no mode stored, so no field to compare) is refused.
    doc["metadata"]["name"] = "soft-then-hard"
    doc["spec"] = {"gpuModel": "NVIDIA A100-SXM4-80GB", "fraction": 100}
    cluster.kubectl("create", "-f", "-", input=json.dumps(doc))
    try:
        change = {"spec": {"isolation": {"mode": "Hardware"}, "migProfile": "1g.10gb"}}
        proc = cluster.kubectl(
            "patch", "gpupackages.gpuslice.io", "soft-then-hard", "--type=merge", "-p", json.dumps(change),
            check=False,
        )  # fmt: skip
        assert proc.returncode != 0 and "isolation.mode cannot be changed" in proc.stderr, proc.stderr
    finally:
        cluster.kubectl("delete", "gpupackages.gpuslice.io", "soft-then-hard", "--wait=false", check=False)


@pytest.mark.parametrize("template", [False, True], ids=["claim", "template"])
def test_slice_name_too_long_for_its_claim_labels_is_refused_at_create(
    cluster: DevCluster, template: bool
) -> None:
    cluster.apply_crds()
    name = "s" * 64  # a valid object name, but not a label value: the claim carries it as one
    doc = slice_doc(name, "default", "v100-8g", template=template)
    proc = cluster.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(doc), check=False)
    assert proc.returncode != 0 and "metadata.name must be at most 63 characters" in proc.stderr, proc.stderr
    doc["metadata"]["name"] = "s" * 63
    proc = cluster.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(doc), check=False)
    assert proc.returncode == 0, proc.stderr


def test_package_and_slice_fields_are_immutable(world: World) -> None:
    world.packages({"8g": 25})
    proc = world.cluster.kubectl(
        "patch",
        "gpupackages.gpuslice.io",
        world.pkg("8g"),
        "--type=merge",
        "-p",
        '{"spec":{"fraction":50}}',
        check=False,
    )
    assert proc.returncode != 0 and "fraction cannot be changed" in proc.stderr
    apply(world.cluster, [slice_doc("s", world.namespace, world.pkg("8g"))])
    proc = world.cluster.kubectl(
        "patch",
        "gpuslice",
        "s",
        "-n",
        world.namespace,
        "--type=merge",
        "-p",
        '{"spec":{"package":"x"}}',
        check=False,
    )
    assert proc.returncode != 0 and "package cannot be changed" in proc.stderr


# --- packages -> DeviceClass, quotas, tenant label ------------------------------------------------


def test_package_makes_device_class_and_quota_only_where_entitled(world: World) -> None:
    world.packages({"8g": 25, "32g": 100}, slices=3)
    dc = get(world.cluster, "deviceclass", c.device_class_name(world.pkg("8g")))
    assert f'.package == "{world.pkg("8g")}"' in dc["spec"]["selectors"][0]["cel"]["expression"]
    _tenant_ok(world)
    hard = world.quota_hard()
    assert hard[c.quota_key(world.pkg("8g"))] == "3" and hard[c.quota_key(world.pkg("32g"))] == "3"
    # Every other package in the cluster is listed with 0: a missing key would not limit it at all.
    assert all(v == "0" for k, v in hard.items() if world.token not in k)
    # How many GpuSlice objects the namespace may hold, whatever its entitlements: a quota of its own.
    count = wait_for(
        lambda: get(world.cluster, "resourcequota", c.COUNT_QUOTA_NAME, "-n", world.namespace), 30
    )
    assert count["spec"]["hard"] == {c.SLICE_COUNT_KEY: "1k"}  # this module's operator: 1000
    # What the tenant sees (lesson 6 of the field report).
    out = world.cluster.kubectl("get", "resourcequota", "-n", world.namespace, "-o", "yaml").stdout
    assert f"{world.pkg('8g')}.gpuslice.io.deviceclass.resource.k8s.io/devices" in out
    # A namespace the entitlement does not select gets nothing.
    other = world.cluster.create_namespace(f"{world.namespace}-x"[:63], {NS_LABEL: "nobody"})
    try:
        time.sleep(2)
        assert get(world.cluster, "resourcequota", c.QUOTA_NAME, "-n", other) is None
        assert get(world.cluster, "resourcequota", c.COUNT_QUOTA_NAME, "-n", other) is None
    finally:
        world.cluster.kubectl("delete", "namespace", other, "--wait=false", check=False)
    status = wait_for(
        lambda: (
            (get(world.cluster, "gpupackages.gpuslice.io", world.pkg("8g")) or {})
            .get("status", {})
            .get("entitledNamespaces")
            == 1
            and get(world.cluster, "gpupackages.gpuslice.io", world.pkg("8g"))["status"]
        ),
        30,
        "package status",
    )
    assert status["deviceClassName"] == c.device_class_name(world.pkg("8g"))
    assert status["guarantees"]["memory"] == "Enforced" and status["guarantees"]["compute"] == "Cooperative"
    assert status["guarantees"]["quota"] == "Entitlement"
    # The platform changes the entitlement: the quota follows.
    world.cluster.kubectl(
        "patch",
        "gpupackages.gpuslice.io",
        world.pkg("8g"),
        "--type=json",
        "-p",
        '[{"op":"replace","path":"/spec/entitlements/0/slices","value":1}]',
    )
    wait_for(
        lambda: world.quota_hard().get(c.quota_key(world.pkg("8g"))) == "1",
        30,
        "quota follows the entitlement",
    )
    # `kubectl explain` documents the product.
    explain = world.cluster.kubectl("explain", "gpupackages.spec.fraction").stdout
    assert "Percent of one card" in explain
    # The entitlement goes: quota and label go with it.
    world.cluster.kubectl("label", "namespace", world.namespace, f"{NS_LABEL}-")
    wait_for(
        lambda: all(
            get(world.cluster, "resourcequota", name, "-n", world.namespace) is None
            for name in (c.QUOTA_NAME, c.COUNT_QUOTA_NAME)
        ),
        30,
        "quotas removed",
    )
    ns = get(world.cluster, "namespace", world.namespace)
    assert c.LABEL_TENANT not in ns["metadata"]["labels"]


def _metric(op: OperatorProcess, series: str) -> float | None:
    for line in op.metrics().splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return None


def test_metrics_without_a_token_are_refused(operator: OperatorProcess) -> None:
    # The operator's series name tenants' namespaces, slices and pods (gpuslice_slice_allocated):
    # a pod that reaches the port must not read them.
    status, body = scrape(operator.metrics_url, None)
    assert (status, "bearer token" in body, "gpuslice_" in body) == (401, True, False), body


def test_metrics_for_a_service_account_without_the_metrics_reader_role_are_refused(
    operator: OperatorProcess, readers: MetricsReaders
) -> None:
    status, body = scrape(operator.metrics_url, readers.tenant)
    assert (status, "may not get /metrics" in body, "gpuslice_" in body) == (403, True, False), body


def test_the_metrics_reader_role_reads_the_operators_series_and_no_agents(
    operator: OperatorProcess, readers: MetricsReaders
) -> None:
    status, body = scrape(operator.metrics_url, readers.prometheus)
    assert status == 200, body
    assert "# TYPE gpuslice_slice_allocated gauge" in body
    assert "# TYPE gpuslice_operator_writes_total counter" in body
    assert "gpuslice_slice_memory_used_bytes" not in body  # the agents' own series


def test_package_capacity_counts_gpus_slices_and_what_other_packages_use(
    world: World, operator: OperatorProcess
) -> None:
    sizes = {"8g": 25, "16g": 50, "32g": 100}
    world.packages(sizes)
    node = world.cluster.nodes[0]
    world.gpus(node, 2, sizes)

    def cap(size: str) -> dict[str, Any]:
        return (
            (get(world.cluster, "gpupackages.gpuslice.io", world.pkg(size)) or {})
            .get("status", {})
            .get("capacity", {})
        )

    wait_for(
        lambda: cap("8g") == {"gpus": 2, "slicesTotal": 8, "slicesAllocated": 0, "slicesFree": 8},
        30,
        "8g capacity",
    )
    assert get(world.cluster, "gpupackages.gpuslice.io", world.pkg("8g"))["status"]["memoryPerSlice"] == "8Gi"
    # One 32 GiB slice takes a whole card: 8g and 16g lose that card's room.
    _tenant_ok(world)
    apply(
        world.cluster, [slice_doc("big", world.namespace, world.pkg("32g")), pod_doc("big", world.namespace)]
    )
    wait_status(world.cluster, world.namespace, "big", phase="InUse")
    wait_for(
        lambda: (
            cap("8g").get("slicesFree") == 4
            and cap("16g").get("slicesFree") == 2
            and cap("32g") == {"gpus": 2, "slicesTotal": 2, "slicesAllocated": 1, "slicesFree": 1}
        ),
        30,
        "capacity after allocation",
    )
    metrics = wait_for(
        lambda: (
            _metric(operator, f'gpuslice_package_free_slices{{package="{world.pkg("8g")}"}}') == 4.0
            and operator
        ),
        30,
        "metrics",
    )
    assert _metric(metrics, f'gpuslice_package_capacity_slices{{package="{world.pkg("8g")}"}}') == 8.0
    assert _metric(metrics, f'gpuslice_slices{{package="{world.pkg("32g")}",phase="InUse"}}') == 1.0
    table = world.cluster.kubectl("get", "gpupackages", world.pkg("32g")).stdout
    assert table.split("\n")[0].split()[:7] == [
        "NAME",
        "DEVICECLASS",
        "MEMORY",
        "GPUS",
        "TOTAL",
        "ALLOCATED",
        "FREE",
    ]


# --- slices ---------------------------------------------------------------------------------------


def _scheduler_writes(w: World, claim: str) -> list[tuple[str, str]]:
    """(manager, subresource) of kube-scheduler's writes to the claim, from its managed fields."""
    obj = get(w.cluster, "resourceclaim", claim, "-n", w.namespace, "--show-managed-fields")
    writes = [(m["manager"], m.get("subresource", "")) for m in obj["metadata"]["managedFields"]]
    return [x for x in writes if x[0] == "kube-scheduler"]


def test_tenant_slice_becomes_a_claim_a_pod_uses_and_status_tells_where(world: World, tmp_path: Path) -> None:
    world.packages({"8g": 25})
    pool = world.gpus(world.cluster.nodes[0], 1, {"8g": 25})
    _tenant_ok(world)
    with tenant_rbac(world.cluster, world.namespace, f"alice-{world.token}") as alice:
        assert (
            create_as(world.cluster, alice, slice_doc("llm", world.namespace, world.pkg("8g"))).returncode
            == 0
        )
        claim = wait_for(
            lambda: get(world.cluster, "resourceclaim", "llm", "-n", world.namespace), 30, "claim"
        )
        assert claim["spec"]["devices"]["requests"] == [
            {
                "name": "gpu",
                "exactly": {
                    "deviceClassName": c.device_class_name(world.pkg("8g")),
                    "allocationMode": "ExactCount",
                    "count": 1,
                },
            }
        ]
        assert claim["metadata"]["ownerReferences"][0]["kind"] == "GpuSlice"
        st = wait_status(world.cluster, world.namespace, "llm", phase="Pending", reason="WaitingForPod")
        assert "resourceClaimName: llm" in st["message"]
        proc = create_as(world.cluster, alice, pod_doc("ollama", world.namespace, "llm"))
        assert proc.returncode == 0, proc.stderr
        st = wait_status(world.cluster, world.namespace, "llm", phase="InUse")
    # Made with the scheduler's finalizer, the claim was allocated in one write of its status: no
    # update of the claim itself by kube-scheduler (one round trip less before the pod is bound).
    assert _scheduler_writes(world, "llm") == [("kube-scheduler", "status")]
    assert st["node"] == world.cluster.nodes[0] and st["gpuUUID"] == f"GPU-{pool}-0"
    assert st["device"].startswith("gpu-0-") and st["allocations"][0]["pod"] == "ollama"
    conds = {x["type"]: x["status"] for x in st["conditions"]}
    assert conds == {
        "Ready": "True",
        "ClaimReady": "True",
        "Allocated": "True",
        "InUse": "True",
        "MemoryIsolated": "True",
        "SoftwareCompatible": "True",
        "GpuIdle": "False",
    }
    row = world.cluster.kubectl("get", "gpuslices", "-n", world.namespace).stdout.splitlines()
    assert row[0].split() == ["NAME", "PACKAGE", "PHASE", "NODE", "GPU", "GPUS", "AGE"]
    node = world.cluster.nodes[0]
    assert row[1].split()[:6] == ["llm", world.pkg("8g"), "InUse", node, f"GPU-{pool}-0", "1"]
    events = world.cluster.kubectl(
        "get",
        "events",
        "-n",
        world.namespace,
        "--field-selector",
        "involvedObject.kind=GpuSlice,involvedObject.name=llm",
        "-o",
        "json",
    ).stdout
    reasons = [e["reason"] for e in json.loads(events)["items"]]
    assert "WaitingForPod" in reasons and "InUse" in reasons
    # The pod goes: the slice is released. kube-controller-manager deallocated the claim and took the
    # finalizer off; the operator puts it back, so the next pod's claim is again allocated in one write.
    world.cluster.kubectl("delete", "pod", "ollama", "-n", world.namespace, "--grace-period=0", "--force")
    wait_status(world.cluster, world.namespace, "llm", phase="Released")
    wait_for(
        lambda: (
            (get(world.cluster, "resourceclaim", "llm", "-n", world.namespace) or {})
            .get("metadata", {})
            .get("finalizers")
            == [c.DRA_CLAIM_FINALIZER]
        ),
        30,
        "the deallocated claim protected again",
    )
    with tenant_rbac(world.cluster, world.namespace, f"alice-{world.token}") as alice:
        proc = create_as(world.cluster, alice, pod_doc("ollama-2", world.namespace, "llm"))
        assert proc.returncode == 0, proc.stderr
        wait_status(world.cluster, world.namespace, "llm", phase="InUse")
    assert _scheduler_writes(world, "llm") == [("kube-scheduler", "status")]
    world.cluster.kubectl("delete", "pod", "ollama-2", "-n", world.namespace, "--grace-period=0", "--force")
    wait_status(world.cluster, world.namespace, "llm", phase="Released")
    # The GpuSlice goes: so does its claim.
    world.cluster.kubectl("delete", "gpuslices.gpuslice.io", "llm", "-n", world.namespace)
    wait_for(
        lambda: get(world.cluster, "resourceclaim", "llm", "-n", world.namespace) is None,
        60,
        "claim garbage-collected",
    )


def test_quota_used_up_says_x_of_y_and_recovers_when_a_slice_frees(world: World) -> None:
    world.packages({"8g": 25}, slices=2)
    _tenant_ok(world)
    apply(world.cluster, [slice_doc(n, world.namespace, world.pkg("8g")) for n in ("a", "b")])
    for n in ("a", "b"):
        wait_for(lambda n=n: get(world.cluster, "resourceclaim", n, "-n", world.namespace), 30, "claims")
    apply(world.cluster, [slice_doc("c", world.namespace, world.pkg("8g"))])
    st = wait_status(world.cluster, world.namespace, "c", reason="QuotaExceeded")
    assert st["phase"] == "Pending" and "2 of 2" in st["message"]
    assert st["quota"] == {"used": 2, "hard": 2, "quota": c.QUOTA_NAME}
    world.cluster.kubectl("delete", "gpuslices.gpuslice.io", "a", "-n", world.namespace)
    wait_for(
        lambda: get(world.cluster, "resourceclaim", "c", "-n", world.namespace),
        90,
        "claim of c after a slice freed",
    )


def test_a_slice_waiting_on_quota_learns_at_once_that_a_claim_is_going(world: World) -> None:
    """The new slice was refused while the old claim counted as any other; then the old claim starts
    to go. When its GpuSlice is deleted the garbage collector marks it some time after the slice's
    own events (and the GpuSlice-count quota's) have come and gone: here the claim alone is marked,
    which changes no quota figure. What the waiting slice says must follow the claim's event, not
    wait for the next resync."""
    world.packages({"8g": 25}, slices=1)
    _tenant_ok(world)
    hold = "gpuslice-test/hold"
    apply(world.cluster, [slice_doc("old", world.namespace, world.pkg("8g"))])
    wait_for(lambda: get(world.cluster, "resourceclaim", "old", "-n", world.namespace), 30, "claim")
    patch = json.dumps([{"op": "add", "path": "/metadata/finalizers/-", "value": hold}])
    world.cluster.kubectl("patch", "resourceclaim", "old", "-n", world.namespace, "--type=json", "-p", patch)
    try:
        apply(world.cluster, [slice_doc("new", world.namespace, world.pkg("8g"))])
        st = wait_status(world.cluster, world.namespace, "new", reason="QuotaExceeded")
        assert "delete a GpuSlice" in st["message"], st
        world.cluster.kubectl("delete", "resourceclaim", "old", "-n", world.namespace, "--wait=false")
        # well inside this module's resync (RESYNC_SECONDS): the claim's event told it
        wait_for(
            lambda: (
                "claim old (being deleted) counts until it is removed"
                in slice_status(world.cluster, world.namespace, "new").get("message", "")
            ),
            RESYNC_SECONDS / 2,
            "the waiting slice to name the claim being deleted",
        )
    finally:
        unhold = json.dumps({"metadata": {"finalizers": None}})  # no new finalizer on a claim going
        world.cluster.kubectl(
            "patch", "resourceclaim", "old", "-n", world.namespace, "--type=merge", "-p", unhold, check=False
        )
        world.cluster.kubectl("delete", "gpuslices.gpuslice.io", "old", "-n", world.namespace, check=False)
    wait_for(lambda: get(world.cluster, "resourceclaim", "new", "-n", world.namespace), 60, "the new claim")


def test_a_slot_freed_at_the_entitlement_goes_to_the_next_slice_within_seconds(world: World) -> None:
    # A tenant at its entitlement of one deletes a slice and creates another at once, and expects the
    # freed slot within a second or two. The old claim counts until garbage collection deletes it,
    # and, while a pod holds it, until that pod is gone; kube-controller-manager then recounts the
    # quota, and that quota event must reach the waiting slice (not the operator's resync, 10 s here).
    ns, pkg = world.namespace, world.pkg("8g")
    world.packages({"8g": 25}, slices=1)
    world.gpus(world.cluster.nodes[0], 1, {"8g": 25})
    _tenant_ok(world)

    def claim_within(name: str, seconds: float) -> float:
        start = time.monotonic()
        wait_for(lambda: get(world.cluster, "resourceclaim", name, "-n", ns), 30, f"claim {name}")
        took = time.monotonic() - start
        assert took < seconds, f"claim {name} {took:.1f} s after the slot was freed"
        return took

    apply(world.cluster, [slice_doc("a", ns, pkg)])
    claim_within("a", 5)
    world.cluster.kubectl("delete", "gpuslices.gpuslice.io", "a", "-n", ns)
    apply(world.cluster, [slice_doc("b", ns, pkg)])
    claim_within("b", 5)
    # b in use; its pod is stopping (the finalizer stands in for a kubelet stopping its containers)
    # when the tenant deletes b and creates c: c waits for the quota, and goes once the pod has gone.
    pod = pod_doc("b", ns)
    pod["metadata"]["finalizers"] = ["gpuslice-test/stopping"]
    apply(world.cluster, [pod])
    wait_status(world.cluster, ns, "b", phase="InUse")
    world.cluster.kubectl("delete", "pod", "b", "-n", ns, "--wait=false")
    # b stays (Releasing) while its stopping pod still holds its claim.
    world.cluster.kubectl("delete", "gpuslices.gpuslice.io", "b", "-n", ns, "--wait=false")
    wait_status(world.cluster, ns, "b", phase="Releasing")
    apply(world.cluster, [slice_doc("c", ns, pkg)])
    st = wait_status(world.cluster, ns, "c", reason="QuotaExceeded")
    assert st["quota"] == {"used": 1, "hard": 1, "quota": c.QUOTA_NAME}
    world.cluster.kubectl(
        "patch",
        "pod",
        "b",
        "-n",
        ns,
        "--type=json",
        "-p",
        '[{"op": "remove", "path": "/metadata/finalizers"}]',
    )
    claim_within("c", 3)


def test_no_gpu_of_the_model_and_all_gpus_full_are_told_apart(world: World) -> None:
    world.packages({"32g": 100, "none": 25}, slices=4)
    world.gpus(world.cluster.nodes[1], 1, {"32g": 100})
    _tenant_ok(world)
    apply(world.cluster, [slice_doc("n", world.namespace, world.pkg("none")), pod_doc("n", world.namespace)])
    st = wait_status(world.cluster, world.namespace, "n", reason="NoMatchingGpu")
    assert "Tesla V100-PCIE-32GB" in st["message"]
    apply(
        world.cluster, [slice_doc("one", world.namespace, world.pkg("32g")), pod_doc("one", world.namespace)]
    )
    wait_status(world.cluster, world.namespace, "one", phase="InUse")
    apply(
        world.cluster, [slice_doc("two", world.namespace, world.pkg("32g")), pod_doc("two", world.namespace)]
    )
    st = wait_status(world.cluster, world.namespace, "two", reason="AllGpusFull")
    assert st["phase"] == "Pending" and "not a reservation" in st["message"]
    # When the first slice's pod goes, the waiting one starts.
    world.cluster.kubectl("delete", "pod", "one", "-n", world.namespace, "--grace-period=0", "--force")
    wait_status(world.cluster, world.namespace, "two", phase="InUse", timeout=120)


def _wait_ready(cluster: DevCluster, *what: str) -> subprocess.CompletedProcess[str]:
    return cluster.kubectl("wait", "--for=condition=Ready", "--timeout=30s", *what, check=False)


def test_gitops_tools_read_health_from_real_slices_and_packages(world: World) -> None:
    world.packages({"32g": 100, "none": 25}, slices=4)
    world.gpus(world.cluster.nodes[1], 1, {"32g": 100})
    _tenant_ok(world)
    ns = world.namespace
    # `kubectl wait` and Flux (kstatus) read Ready; Argo CD runs manifests/argocd/health.lua.
    proc = _wait_ready(world.cluster, f"gpupackages.gpuslice.io/{world.pkg('32g')}")
    assert proc.returncode == 0, proc.stderr
    package = get(world.cluster, "gpupackages.gpuslice.io", world.pkg("32g"))
    assert argocd_health(package)["status"] == "Healthy"
    apply(
        world.cluster,
        [
            slice_doc("one", ns, world.pkg("32g")),
            pod_doc("one", ns),
            slice_doc("ghost", ns, world.pkg("nosuch")),
            slice_doc("n", ns, world.pkg("none")),
            pod_doc("n", ns),
        ],
    )
    wait_status(world.cluster, ns, "one", phase="InUse")
    proc = _wait_ready(world.cluster, "-n", ns, "gpuslices.gpuslice.io/one")
    assert proc.returncode == 0, proc.stderr
    apply(world.cluster, [slice_doc("two", ns, world.pkg("32g")), pod_doc("two", ns)])
    wait_status(world.cluster, ns, "two", reason="AllGpusFull")
    wait_status(world.cluster, ns, "ghost", reason="PackageNotFound")
    wait_status(world.cluster, ns, "n", reason="NoMatchingGpu")
    seen = {}
    for name in ("one", "two", "ghost", "n"):
        obj = get(world.cluster, "gpuslices.gpuslice.io", name, "-n", ns)
        conds = {x["type"]: x for x in obj["status"]["conditions"]}
        gen = obj["metadata"]["generation"]
        assert obj["status"]["observedGeneration"] == gen
        assert all(x["observedGeneration"] == gen for x in conds.values()), name
        seen[name] = (
            argocd_health(obj)["status"],
            sorted(k for k in conds if k in ("Reconciling", "Stalled")),
        )
    assert seen == {
        "one": ("Healthy", []),
        "two": ("Progressing", ["Reconciling"]),  # starts by itself when a slice frees
        "ghost": ("Degraded", ["Stalled"]),
        "n": ("Degraded", ["Stalled"]),  # no node offers the model: someone must act
    }
    assert (
        "not a reservation"
        in argocd_health(get(world.cluster, "gpuslices.gpuslice.io", "two", "-n", ns))["message"]
    )
    # A slice that is not Ready makes `kubectl wait` fail, as it makes a Flux health check fail.
    proc = world.cluster.kubectl(
        "wait", "--for=condition=Ready", "--timeout=2s", "-n", ns, "gpuslices.gpuslice.io/two", check=False
    )
    assert proc.returncode != 0


def _free_column(cluster: DevCluster, package: str) -> str:
    """The FREE column of `kubectl get gpupackages` (columns are fixed-width; an unset one is blank)."""
    header, row = cluster.kubectl("get", "gpupackages.gpuslice.io", package).stdout.splitlines()[:2]
    start = header.index("FREE")
    return row[start:].split(" ", 1)[0]


def test_explain_and_package_columns_never_show_free_slices_under_a_slice_waiting_for_one(
    world: World,
) -> None:
    world.packages({"16g": 50, "32g": 100}, slices=4)
    world.gpus(world.cluster.nodes[1], 1, {"16g": 50, "32g": 100})
    _tenant_ok(world)
    ns, half = world.namespace, world.pkg("16g")
    wait_for(lambda: _free_column(world.cluster, half) == "2", 30, "2 of 2 16g slices free")
    # A whole-card slice takes the only card; the half-card slice then waits: every card is full.
    apply(world.cluster, [slice_doc("whole", ns, world.pkg("32g")), pod_doc("whole", ns)])
    wait_status(world.cluster, ns, "whole", phase="InUse")
    apply(world.cluster, [slice_doc("half", ns, half), pod_doc("half", ns)])
    wait_status(world.cluster, ns, "half", reason="AllGpusFull")
    # The moment the slice says so, what a user reads agrees: no second look, no wait.
    free = _free_column(world.cluster, half)
    explained = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuslice",
            "explain",
            f"{ns}/half",
            f"--kubeconfig={world.cluster.kubeconfig}",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    ).stdout
    assert free == "0", free
    assert f"capacity: 0 of 2 {half} slices free on 1 GPU(s) when this status was decided" in explained
    assert "2 of 2" not in explained, explained


def test_pod_blocked_by_the_namespaces_cpu_quota_is_named(world: World) -> None:
    world.packages({"8g": 25})
    world.gpus(world.cluster.nodes[0], 1, {"8g": 25})
    _tenant_ok(world)
    apply(
        world.cluster,
        [
            {
                "apiVersion": "v1",
                "kind": "ResourceQuota",
                "metadata": {"name": "compute", "namespace": world.namespace},
                "spec": {"hard": {"requests.cpu": "1"}},
            }
        ],
    )
    wait_for(
        lambda: (
            (get(world.cluster, "resourcequota", "compute", "-n", world.namespace) or {})
            .get("status", {})
            .get("hard")
        ),
        30,
        "cpu quota",
    )
    apply(
        world.cluster,
        [
            slice_doc("s", world.namespace, world.pkg("8g")),
            deployment_doc("web", world.namespace, claim="s", cpu="2"),
        ],
    )
    st = wait_status(world.cluster, world.namespace, "s", reason="PodBlockedByQuota", timeout=90)
    assert "exceeded quota: compute" in st["message"] and "cpu" in st["message"]


def test_template_slice_gives_each_replica_its_own_slice(world: World) -> None:
    world.packages({"8g": 25}, slices=3)
    world.gpus(world.cluster.nodes[2], 1, {"8g": 25})
    _tenant_ok(world)
    apply(
        world.cluster,
        [
            slice_doc("workers", world.namespace, world.pkg("8g"), template=True),
            deployment_doc("workers", world.namespace, template="workers", replicas=2),
        ],
    )
    tmpl = wait_for(
        lambda: get(world.cluster, "resourceclaimtemplate", "workers", "-n", world.namespace), 30, "template"
    )
    assert tmpl["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"] == 1
    st = wait_status(world.cluster, world.namespace, "workers", phase="InUse", timeout=90)
    assert len(st["allocations"]) == 2 and len({a["device"] for a in st["allocations"]}) == 2
    assert st["claimTemplateName"] == "workers"
    # A fourth replica exceeds the entitlement of three.
    world.cluster.kubectl("scale", "deployment", "workers", "-n", world.namespace, "--replicas=4")
    st = wait_status(world.cluster, world.namespace, "workers", reason="QuotaExceeded", timeout=90)
    assert "3 of 3" in st["message"]


# --- admission ------------------------------------------------------------------------------------


def test_admission_rejects_bypasses_with_what_to_do_instead(world: World) -> None:
    world.packages({"8g": 25})
    _tenant_ok(world)
    ns = world.namespace
    with tenant_rbac(world.cluster, ns, f"bob-{world.token}") as bob:

        def refused(doc: dict[str, Any], *expect: str) -> None:
            proc = create_as(world.cluster, bob, doc)
            assert proc.returncode != 0, f"accepted: {doc}"
            for e in expect:
                assert e in proc.stderr, proc.stderr

        raw = pod_doc("raw", ns)
        raw["spec"].pop("resourceClaims")
        raw["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
        refused(raw, "nvidia.com/gpu", "create a GpuSlice", "resourceClaimName")

        env = pod_doc("env", ns)
        env["spec"]["containers"][0]["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]
        refused(env, "NVIDIA_VISIBLE_DEVICES", "Remove the variable")
        shim = pod_doc("shim", ns)
        shim["spec"]["containers"][0]["env"] = [{"name": "GPUSLICE_LIMIT", "value": "0"}]
        refused(shim, "GPUSLICE_")

        env_from = pod_doc("envfrom", ns)
        env_from["spec"]["containers"][0]["envFrom"] = [{"configMapRef": {"name": "x"}}]
        refused(env_from, "envFrom", "list the variables one by one")

        # Node access (hostPath, privileged, host namespaces, capabilities) is Pod Security's, at
        # baseline in every tenant namespace; test_isolation_cluster.py tries each way around it.
        hp = pod_doc("hp", ns)
        hp["spec"]["volumes"] = [{"name": "h", "hostPath": {"path": "/data/models"}}]
        refused(hp, 'violates PodSecurity "baseline:latest"', "hostPath volumes")
        block = pod_doc("block", ns)
        block["spec"]["containers"][0]["volumeDevices"] = [{"name": "raw", "devicePath": "/dev/xvda"}]
        block["spec"]["volumes"] = [{"name": "raw", "persistentVolumeClaim": {"claimName": "disk"}}]
        refused(block, "raw block devices", "volumeMounts")
        pinned = pod_doc("pinned", ns)
        pinned["spec"]["nodeName"] = world.cluster.nodes[0]
        refused(pinned, "may not set spec.nodeName", "nodeSelector")
        # Pod Security applies to pods without a slice too: host namespaces are refused everywhere here.
        plain = pod_doc("plain", ns)
        plain["spec"].pop("resourceClaims")
        plain["spec"]["containers"][0].pop("resources", None)
        plain["spec"]["hostNetwork"] = True
        refused(plain, "PodSecurity", "host namespaces")

        claim: dict[str, Any] = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "hand", "namespace": ns, "labels": {c.LABEL_PACKAGE: world.pkg("8g")}},
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "gpu",
                            "exactly": {
                                "deviceClassName": c.device_class_name(world.pkg("8g")),
                                "allocationMode": "ExactCount",
                                "count": 2,
                            },
                        }
                    ]
                }
            },
        }
        refused(
            claim,
            "ExactCount and count 1",
            "Create a GpuSlice instead",
            "deviceClassName: <package>.gpuslice.io",
        )
        claim["spec"]["devices"]["requests"][0]["exactly"]["count"] = 1
        claim["metadata"]["labels"] = {}
        refused(claim, f"carries the label {c.LABEL_PACKAGE}")
        claim["metadata"]["labels"] = {c.LABEL_PACKAGE: world.pkg("8g")}
        claim["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = [{"cel": {"expression": "true"}}]
        refused(claim, "no selectors")
        del claim["spec"]["devices"]["requests"][0]["exactly"]["selectors"]
        claim["spec"]["devices"]["requests"][0]["exactly"]["adminAccess"] = True
        refused(claim)
        del claim["spec"]["devices"]["requests"][0]["exactly"]["adminAccess"]
        # The documented form itself passes.
        proc = kubectl_as(
            world.cluster, bob, "create", "--dry-run=server", "-f", "-", input=json.dumps(claim)
        )
        assert proc.returncode == 0, proc.stderr
        tmpl = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": "hand", "namespace": ns},
            "spec": {
                "metadata": {"labels": {c.LABEL_PACKAGE: world.pkg("8g")}},
                "spec": {
                    "devices": {
                        "requests": [
                            {
                                "name": "gpu",
                                "firstAvailable": [
                                    {"name": "a", "deviceClassName": c.device_class_name(world.pkg("8g"))}
                                ],
                            }
                        ]
                    }
                },
            },
        }
        refused(tmpl, "one request named gpu")

        # 2e: a warning, not a rejection.
        small = pod_doc("small", ns, memory="512Mi")
        proc = kubectl_as(
            world.cluster, bob, "create", "--dry-run=server", "-f", "-", input=json.dumps(small)
        )
        assert (
            proc.returncode == 0
            and "Warning:" in proc.stderr
            and "below 1Gi" in proc.stderr
            and "OOMKilled" in proc.stderr
        )


def test_gpuslice_claims_outside_entitled_namespaces_are_refused(world: World, cluster: DevCluster) -> None:
    world.packages({"8g": 25})
    other = cluster.create_namespace(f"noent-{world.token}")
    try:
        apply(cluster, [slice_doc("s", other, world.pkg("8g"))])
        st = wait_status(cluster, other, "s", phase="Failed", reason="ClaimRejected")
        assert "holds no gpuslice entitlement" in st["message"]
    finally:
        cluster.kubectl("delete", "namespace", other, "--wait=false", check=False)


def test_virtual_machines_cannot_attach_slices(world: World, cluster: DevCluster) -> None:
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "virtualmachineinstances.kubevirt.io"},
        "spec": {
            "group": "kubevirt.io",
            "scope": "Namespaced",
            "names": {
                "kind": "VirtualMachineInstance",
                "plural": "virtualmachineinstances",
                "singular": "virtualmachineinstance",
            },
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                    },
                }
            ],
        },
    }
    apply(cluster, [crd])
    cluster.kubectl(
        "wait", "--for=condition=Established", "crd/virtualmachineinstances.kubevirt.io", "--timeout=30s"
    )
    world.packages({"8g": 25})
    _tenant_ok(world)
    vmi = {
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": {"name": "vm", "namespace": world.namespace},
        "spec": {
            "resourceClaims": [{"name": "gpu", "resourceClaimName": "llm"}],
            "domain": {"devices": {"gpus": [{"name": "g", "claim": {"name": "gpu", "request": "gpu"}}]}},
        },
    }
    proc = cluster.kubectl("create", "-f", "-", input=json.dumps(vmi), check=False)
    assert proc.returncode != 0 and "slices are for containers" in proc.stderr
    vmi["spec"] = {"domain": {"devices": {}}}
    assert (
        cluster.kubectl(
            "create", "--dry-run=server", "-f", "-", input=json.dumps(vmi), check=False
        ).returncode
        == 0
    )


def test_tenant_cannot_touch_products_or_what_gpuslice_owns(world: World) -> None:
    world.packages({"8g": 25})
    _tenant_ok(world)
    apply(world.cluster, [slice_doc("s", world.namespace, world.pkg("8g"))])
    wait_for(lambda: get(world.cluster, "resourceclaim", "s", "-n", world.namespace), 30, "claim")
    with tenant_rbac(world.cluster, world.namespace, f"eve-{world.token}") as eve:
        # RBAC: products and devices are the platform's.
        pkg = package_doc(f"eve{world.token}", 100, None)
        assert "forbidden" in create_as(world.cluster, eve, pkg).stderr
        dc = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": "eve.gpuslice.io"},
            "spec": {},
        }
        assert "forbidden" in create_as(world.cluster, eve, dc).stderr
        rs = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": "eve"},
            "spec": {
                "driver": "gpuslice.io",
                "pool": {"name": "p", "generation": 1, "resourceSliceCount": 1},
                "allNodes": True,
            },
        }
        assert "forbidden" in create_as(world.cluster, eve, rs).stderr
        proc = kubectl_as(
            world.cluster,
            eve,
            "patch",
            "resourcequota",
            c.QUOTA_NAME,
            "-n",
            world.namespace,
            "--type=merge",
            "-p",
            '{"spec":{"hard":{"x":"1"}}}',
        )
        assert proc.returncode != 0 and "forbidden" in proc.stderr
        # `edit` may write claims, but not gpuslice's: the protect policy says what to do instead.
        proc = kubectl_as(world.cluster, eve, "label", "resourceclaim", "s", "-n", world.namespace, "x=y")
        assert proc.returncode != 0 and "managed by gpuslice" in proc.stderr
        proc = kubectl_as(world.cluster, eve, "delete", "resourceclaim", "s", "-n", world.namespace)
        assert proc.returncode != 0 and "edit or delete the GpuSlice" in proc.stderr
        fake = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {
                "name": "fake",
                "namespace": world.namespace,
                "labels": {c.LABEL_MANAGED_BY: c.MANAGED_BY_VALUE, c.LABEL_PACKAGE: world.pkg("8g")},
            },
            "spec": {
                "devices": {
                    "requests": [
                        {"name": "gpu", "exactly": {"deviceClassName": c.device_class_name(world.pkg("8g"))}}
                    ]
                }
            },
        }
        assert "managed by gpuslice" in create_as(world.cluster, eve, fake).stderr
        for kind in ("validatingadmissionpolicy", "validatingadmissionpolicybinding"):
            proc = kubectl_as(world.cluster, eve, "delete", kind, "gpuslice-pods")
            assert proc.returncode != 0 and "forbidden" in proc.stderr


# --- lifecycle ------------------------------------------------------------------------------------


def test_package_deletion_is_held_while_slices_use_it(world: World) -> None:
    world.packages({"8g": 25})
    _tenant_ok(world)
    apply(world.cluster, [slice_doc("s", world.namespace, world.pkg("8g"))])
    wait_for(lambda: get(world.cluster, "resourceclaim", "s", "-n", world.namespace), 30, "claim")
    pkg = world.pkg("8g")
    world.cluster.kubectl("delete", "gpupackages.gpuslice.io", pkg, "--wait=false")

    def held() -> Any:
        p = get(world.cluster, "gpupackages.gpuslice.io", pkg) or {}
        return next((x for x in p.get("status", {}).get("conditions", []) if x["type"] == "Deleting"), None)

    cond = wait_for(held, 30, "Deleting condition")
    assert cond["reason"] == "SlicesStillExist" and f"{world.namespace}/s" in cond["message"]
    assert get(world.cluster, "deviceclass", c.device_class_name(pkg)) is not None
    assert get(world.cluster, "gpupackages.gpuslice.io", pkg)["metadata"]["finalizers"] == [c.FINALIZER]
    world.cluster.kubectl("delete", "gpuslices.gpuslice.io", "s", "-n", world.namespace)
    wait_for(lambda: get(world.cluster, "gpupackages.gpuslice.io", pkg) is None, 60, "package gone")
    wait_for(
        lambda: get(world.cluster, "deviceclass", c.device_class_name(pkg)) is None, 30, "DeviceClass gone"
    )
    wait_for(lambda: c.quota_key(pkg) not in world.quota_hard(), 30, "quota key gone")


def _label_history(
    cluster: DevCluster, namespace: str, label: str
) -> tuple[subprocess.Popen[str], list[str | None]]:
    """A watch of the namespace (kubectl's own) recording the label's value at each event."""
    history: list[str | None] = []
    watch = subprocess.Popen(
        cluster.kubectl_argv("get", "namespace", namespace, "-w", "-o", "json"),
        stdout=subprocess.PIPE,
        text=True,
    )

    def read() -> None:
        decoder, buf = json.JSONDecoder(), ""
        assert watch.stdout is not None
        for line in watch.stdout:
            buf += line
            with contextlib.suppress(json.JSONDecodeError):
                doc, _ = decoder.raw_decode(buf.strip())
                buf = ""
                history.append((doc["metadata"].get("labels") or {}).get(label))

    threading.Thread(target=read, daemon=True).start()
    return watch, history


def test_deleting_the_last_package_removes_the_tenant_label_for_good(world: World) -> None:
    """A namespace event between the deletion handler's label removal and the package's removal from
    the operator's view must not put the label back: after uninstall nobody is left to take it off."""
    world.packages({"8g": 25})
    _tenant_ok(world)
    watch, history = _label_history(world.cluster, world.namespace, c.LABEL_TENANT)
    try:
        wait_for(lambda: history, 10, "the watch's first event")
        world.cluster.kubectl("delete", "gpupackages.gpuslice.io", world.pkg("8g"), "--wait=true")
        wait_for(lambda: history[-1] is None, 30, "the tenant label removed")
        time.sleep(5)  # the operator's answers to its own label removal come within this
    finally:
        watch.terminate()
        watch.wait()
    assert history[0] == "true"
    removed = history.index(None)
    assert history[removed:] == [None] * (len(history) - removed), history


def test_a_slice_deleted_in_the_foreground_takes_its_claim_and_no_new_one_is_made(world: World) -> None:
    """GitOps tools prune with foreground deletion: the GpuSlice stays, deleting, until the garbage
    collector has deleted its claim. Its claim going must not make the operator create another."""
    world.packages({"8g": 25})
    _tenant_ok(world)
    for i in range(3):
        name = f"fg{i}"
        apply(world.cluster, [slice_doc(name, world.namespace, world.pkg("8g"))])
        wait_for(lambda n=name: get(world.cluster, "resourceclaim", n, "-n", world.namespace), 30, "claim")
        world.cluster.kubectl(
            "delete",
            "gpuslices.gpuslice.io",
            name,
            "-n",
            world.namespace,
            "--cascade=foreground",
            "--timeout=60s",
        )
        wait_for(
            lambda n=name: get(world.cluster, "resourceclaim", n, "-n", world.namespace) is None,
            30,
            "claim gone",
        )
        time.sleep(2)
        assert get(world.cluster, "resourceclaim", name, "-n", world.namespace) is None, (
            f"{name}: a claim again"
        )


def _versions(w: World) -> dict[str, str]:
    out = {}
    for args in (
        ("deviceclass", c.device_class_name(w.pkg("8g"))),
        ("resourcequota", c.QUOTA_NAME, "-n", w.namespace),
        ("resourceclaim", "s", "-n", w.namespace),
        ("resourceclaimtemplate", "t", "-n", w.namespace),
        ("namespace", w.namespace),
        ("validatingadmissionpolicy", "gpuslice-pods"),
        ("validatingadmissionpolicybinding", "gpuslice-protect"),
        ("gpuslices.gpuslice.io", "s", "-n", w.namespace),
        ("gpupackages.gpuslice.io", w.pkg("8g")),
    ):
        out[" ".join(args[:2])] = get(w.cluster, *args)["metadata"]["resourceVersion"]
    return out


def test_restart_converges_without_writes_or_duplicates(world: World, operator: OperatorProcess) -> None:
    world.packages({"8g": 25})
    _tenant_ok(world)
    apply(
        world.cluster,
        [
            slice_doc("s", world.namespace, world.pkg("8g")),
            slice_doc("t", world.namespace, world.pkg("8g"), template=True),
        ],
    )
    wait_status(world.cluster, world.namespace, "s", reason="WaitingForPod")
    wait_status(world.cluster, world.namespace, "t", reason="WaitingForPod")
    time.sleep(6)  # let package status settle (its timer runs every 5 s)
    before = _versions(world)
    operator.stop(signal.SIGKILL)  # killed, not asked to stop: no clean-up runs
    operator.start()
    wait_for(lambda: "operator starting" in operator.tail(200), 30, "restart")
    time.sleep(8)
    assert _versions(world) == before
    claims = json.loads(
        world.cluster.kubectl("get", "resourceclaims", "-n", world.namespace, "-o", "json").stdout
    )["items"]
    assert [x["metadata"]["name"] for x in claims] == ["s"]
    pkg = get(world.cluster, "gpupackages.gpuslice.io", world.pkg("8g"))
    annotations = pkg["metadata"].get("annotations", {})
    assert not [k for k in annotations if "kopf.zalando.org" in k]
    assert pkg["metadata"]["finalizers"] == [c.FINALIZER]


def test_samples_apply_and_work_end_to_end(cluster: DevCluster, operator: OperatorProcess) -> None:
    samples = REPO / "manifests" / "samples"
    docs = [d for f in sorted(samples.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    products = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "GpuPackage"}
    assert {k: (v["gpuModel"], v["fraction"]) for k, v in products.items()} == {
        "v100-8g": ("Tesla V100-PCIE-32GB", 25),
        "v100-16g": ("Tesla V100-PCIE-32GB", 50),
        "v100-32g": ("Tesla V100-PCIE-32GB", 100),
    }
    sizes = {"v100-8g": 25, "v100-16g": 50, "v100-32g": 100}
    publish_gpus(cluster, "samples", cluster.nodes[0], 1, sizes)
    try:
        apply_tenant_roles(cluster)
        for name in ("v100-8g.yaml", "v100-16g.yaml", "v100-32g.yaml", "tenant-team-a.yaml"):
            cluster.apply(samples / name)
        st = wait_status(cluster, "team-a", "llm", phase="InUse", timeout=90)
        assert st["gpuUUID"].startswith("GPU-optest-samples-")
        wait_status(cluster, "team-a", "workers", phase="InUse", timeout=90)
        out = cluster.kubectl("get", "resourcequota", "-n", "team-a", "-o", "yaml").stdout
        assert 'v100-8g.gpuslice.io.deviceclass.resource.k8s.io/devices: "2"' in out
        # Applying the same manifests again changes nothing the operator owns.
        before = get(cluster, "resourceclaim", "llm", "-n", "team-a")["metadata"]["resourceVersion"]
        cluster.apply(samples / "tenant-team-a.yaml")
        time.sleep(2)
        assert get(cluster, "resourceclaim", "llm", "-n", "team-a")["metadata"]["resourceVersion"] == before
    finally:
        cluster.kubectl("delete", "namespace", "team-a", "--timeout=60s", check=False)
        cluster.kubectl("delete", "gpupackages.gpuslice.io", *sizes, "--timeout=60s", check=False)


def _metric_lines(op: OperatorProcess, prefix: str) -> list[str]:
    return [line for line in op.metrics().splitlines() if line.startswith(prefix)]


def _metric_sum(op: OperatorProcess, prefix: str) -> float:
    return sum(float(line.split()[-1]) for line in op.metrics().splitlines() if line.startswith(prefix))


def _sockets(pid: int) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return n


class SocketPeak(threading.Thread):
    """The most sockets a process held at once while this ran (sampled every 50 ms)."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self.done = pid, 0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.05):
            self.peak = max(self.peak, _sockets(self.pid))


def test_many_slices_cost_a_bounded_number_of_writes_and_none_at_rest(
    world: World, operator: OperatorProcess
) -> None:
    n = 150
    world.packages({"8g": 25}, slices=1000)
    _tenant_ok(world)
    assert operator.proc is not None
    idle_sockets = _sockets(operator.proc.pid)
    sockets = SocketPeak(operator.proc.pid)
    sockets.start()
    claims_before = _metric_sum(operator, 'gpuslice_operator_writes_total{kind="ResourceClaim"')
    status_before = _metric_sum(operator, 'gpuslice_operator_status_updates_total{kind="GpuSlice"')
    started = time.monotonic()
    apply(world.cluster, [slice_doc(f"s{i}", world.namespace, world.pkg("8g")) for i in range(n)])

    def settled() -> bool:
        items = get(world.cluster, "gpuslices.gpuslice.io", "-n", world.namespace)["items"]
        return len(items) == n and all(
            (x.get("status") or {}).get("reason") == "WaitingForPod" for x in items
        )

    wait_for(settled, 180, f"{n} slices with claims")
    took = time.monotonic() - started
    sockets.done.set()
    sockets.join()
    claims = _metric_sum(operator, 'gpuslice_operator_writes_total{kind="ResourceClaim"') - claims_before
    statuses = _metric_sum(operator, 'gpuslice_operator_status_updates_total{kind="GpuSlice"') - status_before
    print(
        f"\n[scale] {n} GpuSlices -> claims and status in {took:.1f}s: {claims:.0f} claim applies, "
        f"{statuses:.0f} status patches; sockets {idle_sockets} idle, {sockets.peak} at most"
    )
    assert claims == n  # one apply per slice: none repeated while the watch catches up
    # Connections to the API server do not grow with the slices: the writes' pool and a few Event
    # posters (each TLS connection holds ~0.2 MiB; Kopf's posting pool has no limit of its own).
    bound = idle_sockets + MAX_WRITES_IN_FLIGHT + POSTING_WORKERS + 4
    assert sockets.peak <= bound, (idle_sockets, sockets.peak)
    events = json.loads(world.cluster.kubectl("get", "events", "-n", world.namespace, "-o", "json").stdout)[
        "items"
    ]
    reasons: dict[str, int] = {}
    for e in events:
        if e["involvedObject"]["kind"] == "GpuSlice":
            reasons[e["reason"]] = reasons.get(e["reason"], 0) + e.get("count", 1)
    # CreatingClaim, then WaitingForPod; a few more where a status was decided while the claim's watch
    # event was in flight. What must not happen is a rewrite of every slice on every change (n * n).
    assert statuses <= 2 * n + n // 10, reasons
    # At rest, including a full resync of every slice, the operator writes nothing.
    writes = _metric_sum(operator, "gpuslice_operator_writes_total")
    statuses_now = _metric_sum(operator, 'gpuslice_operator_status_updates_total{kind="GpuSlice"')
    breakdown = _metric_lines(operator, "gpuslice_operator_writes_total")
    time.sleep(RESYNC_SECONDS + 5)
    assert _metric_sum(operator, "gpuslice_operator_writes_total") == writes, (
        breakdown,
        _metric_lines(operator, "gpuslice_operator_writes_total"),
    )
    assert _metric_sum(operator, 'gpuslice_operator_status_updates_total{kind="GpuSlice"') == statuses_now


def test_slice_waits_for_a_package_that_appears_later(world: World) -> None:
    apply(world.cluster, [slice_doc("s", world.namespace, world.pkg("late"))])
    st = wait_status(world.cluster, world.namespace, "s", phase="Failed", reason="PackageNotFound")
    assert "kubectl get gpupackages" in st["message"]
    world.packages({"late": 25})
    wait_status(world.cluster, world.namespace, "s", phase="Pending", reason="WaitingForPod", timeout=30)


def test_killed_mid_work_the_operator_converges_without_duplicates(
    world: World, operator: OperatorProcess
) -> None:
    world.packages({"8g": 25}, slices=100)
    _tenant_ok(world)
    n = 40
    apply(world.cluster, [slice_doc(f"k{i}", world.namespace, world.pkg("8g")) for i in range(n)])
    time.sleep(0.5)
    operator.stop(signal.SIGKILL)  # somewhere between the first claim and the last status
    operator.start()

    def settled() -> bool:
        items = get(world.cluster, "gpuslices.gpuslice.io", "-n", world.namespace)["items"]
        return len(items) == n and all(
            (x.get("status") or {}).get("reason") == "WaitingForPod" for x in items
        )

    wait_for(settled, 120, "all slices converge after the restart")
    claims = get(world.cluster, "resourceclaims", "-n", world.namespace)["items"]
    assert sorted(x["metadata"]["name"] for x in claims) == sorted(f"k{i}" for i in range(n))
    assert all(len(x["metadata"]["ownerReferences"]) == 1 for x in claims)


# --- retries --------------------------------------------------------------------------------------


def _dry_run(w: World, probe: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    return w.cluster.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(probe), check=False)


def _refuse(w: World, name: str, resource: str, expression: str, probe: dict[str, Any]) -> None:
    """A temporary ValidatingAdmissionPolicy (+ binding) that refuses writes of `resource` for which
    `expression` is false, as a stricter policy or an outage would; waits until it refuses `probe`."""
    rule = {
        "apiGroups": ["*"],
        "apiVersions": ["*"],
        "operations": ["CREATE", "UPDATE"],
        "resources": [resource],
    }
    meta = {"name": name, "labels": {TEST_LABEL: "true"}}
    admission = "admissionregistration.k8s.io/v1"
    policy = {
        "apiVersion": admission,
        "kind": "ValidatingAdmissionPolicy",
        "metadata": meta,
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [rule]},
            "validations": [{"expression": expression, "message": f"refused for the test ({name})"}],
        },
    }
    binding = {
        "apiVersion": admission,
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": meta,
        "spec": {"policyName": name, "validationActions": ["Deny"]},
    }
    apply(w.cluster, [policy, binding])
    wait_for(lambda: "refused for the test" in _dry_run(w, probe).stderr, 30, f"{name} in force")


def _lift(w: World, name: str, probe: dict[str, Any]) -> float:
    """Remove the refusal; returns the moment the API server accepts `probe` again (dry run)."""
    w.cluster.kubectl(
        "delete", "validatingadmissionpolicybinding,validatingadmissionpolicy", name, check=False
    )

    def accepted() -> bool:
        proc = _dry_run(w, probe)
        return proc.returncode == 0 or "AlreadyExists" in proc.stderr

    wait_for(accepted, 30, f"{name} lifted")
    return time.monotonic()


def _settle(w: World, pkg: str) -> None:
    """Wait until the package's status is written and then longer than its timer's interval: from
    then on no event of the package (or of anything gpuslice watches) announces the refusal's end."""
    wait_for(
        lambda: (
            ((get(w.cluster, "gpupackages.gpuslice.io", pkg) or {}).get("status") or {}).get(
                "entitledNamespaces"
            )
            == 1
        ),
        30,
        "package status",
    )
    time.sleep(7)


def test_refused_device_class_and_quota_writes_are_retried_without_another_event(world: World) -> None:
    # Both refused at once, one wait: each refusal costs the suite a settle time.
    pkg = world.pkg("8g")
    dc_name = c.device_class_name(pkg)
    dc_probe = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": dc_name}}
    quota_probe = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": c.QUOTA_NAME, "namespace": world.namespace},
        "spec": {"hard": {c.quota_key(pkg): "2"}},
    }
    refusals = {
        f"optest-{world.token}-refuse-dc": dc_probe,
        f"optest-{world.token}-refuse-quota": quota_probe,
    }
    _refuse(
        world,
        f"optest-{world.token}-refuse-dc",
        "deviceclasses",
        f"object.metadata.name != {json.dumps(dc_name)}",
        dc_probe,
    )
    _refuse(
        world,
        f"optest-{world.token}-refuse-quota",
        "resourcequotas",
        f"object.metadata.namespace != {json.dumps(world.namespace)}",
        quota_probe,
    )
    apply(world.cluster, [package_doc(pkg, 25, {NS_LABEL: world.token})])
    _settle(world, pkg)
    assert get(world.cluster, "deviceclass", dc_name) is None
    assert get(world.cluster, "resourcequota", c.QUOTA_NAME, "-n", world.namespace) is None
    lifted = max(_lift(world, name, probe) for name, probe in refusals.items())
    wait_for(lambda: get(world.cluster, "deviceclass", dc_name), 20, "DeviceClass after the refusal ended")
    wait_for(lambda: world.quota_hard(), 20, "quota after the refusal ended")
    assert time.monotonic() - lifted < 15
