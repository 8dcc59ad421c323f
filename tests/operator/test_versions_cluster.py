"""On the suite's Kubernetes minor (GPUSLICE_KUBERNETES) and on a 1.x API server whose platform turned a
gate off, the operator and `gpuslice check` say what this cluster cannot do, and keep running.

What each minor serves is the README's "Kubernetes versions" table (read from each release's
pkg/features/kube_features.go); `DEFAULT_OFF` is that table's off column for each minor's default gates.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from gpuslice.domain import features as f
from gpuslice_dev.devcluster.binaries import minor_of
from gpuslice_dev.devcluster.cluster import DevCluster
from gpuslice_dev.devcluster.components import gates_map
from support import apply, check_line, gpuslice_check, wait_for

from .operator_cluster import OperatorProcess, get, module_operator, package_doc

pytestmark = [pytest.mark.cluster, pytest.mark.slow(seconds=60)]

#: features off on each minor with its default gates
DEFAULT_OFF = {
    "1.35": {f.PARTITIONABLE, f.DEVICE_TAINTS, f.TAINT_RULES, f.EXTENDED_RESOURCES, f.MUTATING},
    "1.36": {f.TAINT_RULES},
    "1.37": set(),
}
#: the gate that turns each on where it is off by default ($GPUSLICE_FEATURE_GATES, `make test-versions`)
GATES = {
    f.PARTITIONABLE: "DRAPartitionableDevices",
    f.DEVICE_TAINTS: "DRADeviceTaints",
    f.EXTENDED_RESOURCES: "DRAExtendedResource",
}
TAINTS_OFF = "DRADeviceTaints=false,DRADeviceTaintRules=false"


def expected_off(cluster: DevCluster) -> set[str]:
    gates = gates_map(cluster.feature_gates)
    return {x for x in DEFAULT_OFF[minor_of(cluster.kubernetes)] if not gates.get(GATES.get(x, ""), False)}


def operator_sees(cluster: DevCluster) -> set[str]:
    # The operator may not write ResourceSlices, so it cannot probe the counters (the agents do).
    return expected_off(cluster) - {f.PARTITIONABLE, f.DEVICE_TAINTS}


def _condition(pkg: dict[str, Any]) -> dict[str, Any] | None:
    conds = (pkg.get("status") or {}).get("conditions") or []
    return next((x for x in conds if x.get("type") == "KubernetesFeaturesOff"), None)


@pytest.fixture(scope="module")
def operator(cluster: DevCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    with module_operator(cluster, tmp_path_factory.mktemp("versions") / "operator.log") as op:
        yield op


def test_the_package_names_the_version_and_each_feature_it_cannot_have(
    cluster: DevCluster, operator: OperatorProcess
) -> None:
    apply(cluster, [package_doc("versions-v100", 25, None)])
    pkg = wait_for(
        lambda: (
            (p := get(cluster, "gpupackage", "versions-v100"))
            and (p.get("status") or {}).get("conditions")
            and p
        ),
        60,
        "the package's status",
    )
    cond = _condition(pkg)
    off = operator_sees(cluster)
    if not off:
        assert cond is None, cond
        assert pkg["status"].get("resourceName"), pkg["status"]  # resources.limits form served
        return
    assert cond is not None and cond["status"] == "True", pkg["status"]
    message = cond["message"]
    print(message)
    assert message.startswith(f"Kubernetes {cluster.kubernetes}: ")
    for name in off:
        assert f"{name} off (" in message, (name, message)
    if f.EXTENDED_RESOURCES in off:
        assert "DRAExtendedResource" in message and not pkg["status"].get("resourceName")
    if f.MUTATING in off:
        # nothing of it installed (the API server does not serve it), and the operator runs on
        assert "does not install its mutating policies" in message
    assert operator.alive(), operator.tail()


@contextmanager
def control_plane(factory: pytest.TempPathFactory, name: str, **kw: Any) -> Iterator[DevCluster]:
    """A control plane of its own (no nodes) beside the suite's, for the module; `kw` for DevCluster."""
    dc = DevCluster(factory.mktemp(name), progress=lambda m: print(f"[{name}] {m}", file=sys.stderr), **kw)
    try:
        dc.up(nodes=0)
        yield dc
    finally:
        dc.down()


@pytest.fixture(scope="module")
def taints_off(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    """The suite's minor, with the platform's DRADeviceTaints (and its dependant) turned off."""
    with control_plane(tmp_path_factory, "taints-off", extra_feature_gates=TAINTS_OFF) as dc:
        yield dc


def test_a_platform_that_turned_device_taints_off_is_told_and_nothing_crashes(
    taints_off: DevCluster, tmp_path: Path
) -> None:
    proc = gpuslice_check(taints_off.kubeconfig)
    out = proc.stdout
    print(out)
    assert proc.returncode == 1, proc.stderr
    line = check_line(out, "device taints (DRADeviceTaints)")
    assert line.startswith("\u00d7 ") and f"off on Kubernetes {taints_off.kubernetes}" in line
    assert "leaves them out of its ResourceSlices" in line
    assert check_line(out, "DeviceTaintRules (DRADeviceTaintRules)").startswith("\u00d7 ")

    op = OperatorProcess(taints_off, tmp_path / "operator.log")
    op.start()
    try:
        wait_for(
            lambda: "Kubernetes feature off" in (op.log.read_text() if op.log.exists() else ""), 60, "log"
        )
        log = op.log.read_text()
        assert "feature=DeviceTaintRules" in log or "DeviceTaintRules" in log
        wait_for(
            lambda: get(taints_off, "validatingadmissionpolicybinding", "gpuslice-protect"), 60, "policies"
        )
        assert op.alive(), op.tail()
    finally:
        op.stop()


def test_check_on_the_suites_version_names_what_is_off(cluster: DevCluster) -> None:
    out = gpuslice_check(cluster.kubeconfig).stdout
    off = expected_off(cluster)
    assert check_line(out, "Kubernetes version").startswith("\u221a "), out
    for name, gate in (
        (f.TAINT_RULES, "DRADeviceTaintRules"),
        (f.EXTENDED_RESOURCES, "DRAExtendedResource"),
        (f.MUTATING, "MutatingAdmissionPolicy"),
    ):
        line = check_line(out, f"{name} ({gate})")
        assert line.startswith("\u00d7 " if name in off else "\u221a "), (cluster.feature_gates, line)


def test_where_device_taints_are_dropped_an_unhealthy_card_is_left_out_of_the_pool(
    taints_off: DevCluster,
) -> None:
    # The agent's start-up decision and publisher against the real API server: a taint it would drop
    # cannot take the card off sale, so the card's devices are not offered at all.
    import asyncio

    from gpuslice.agent.kube import Kube, api_client
    from gpuslice.agent.publisher import Publisher
    from gpuslice.agent.service import _adapt_to_platform
    from support import counters_kept, gpu
    from support import package_doc as bare_package

    node = "taints-off-node"
    cards = [gpu(0, node=node), gpu(1, node=node)]
    taint = {"key": "gpuslice.io/gpu-unhealthy", "value": "Failed", "effect": "NoExecute"}

    counters = counters_kept(taints_off)  # 1.35 with its defaults: no counters either, nothing published

    async def publish() -> list[dict[str, Any]]:
        api = api_client(taints_off.kubeconfig)
        kube = Kube(api)
        try:
            publisher = Publisher(node, cards, kube)
            await _adapt_to_platform(api, kube, publisher)
            assert publisher.taints_dropped and (publisher.refused is None) == counters, publisher.refused
            publisher.packages_listed([bare_package("v100-8g", 25)])
            publisher.node_seen({"metadata": {"name": node}})
            publisher.set_taints({cards[0].uuid: [taint]})
            try:
                await publisher.sync()
                return await kube.list_pool_slices(node)
            finally:
                await publisher.withdraw()
        finally:
            await api.close()

    pool = asyncio.run(publish())
    uuids = {d["attributes"]["uuid"]["string"] for s in pool for d in s["spec"].get("devices") or []}
    assert uuids == ({cards[1].uuid} if counters else set()), uuids


@pytest.fixture(scope="module")
def emulating_1_34(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    """A kube-apiserver that serves 1.34 (`--emulated-version`): its binary is the suite's minor, its
    APIs and gates are 1.34's, as on a platform that has not upgraded."""
    with control_plane(tmp_path_factory, "emulated-1.34", emulated_version="1.34") as dc:
        yield dc


def test_an_api_server_emulating_an_unsupported_minor_is_named_and_nothing_crashes(
    emulating_1_34: DevCluster, tmp_path: Path
) -> None:
    proc = gpuslice_check(emulating_1_34.kubeconfig)
    out = proc.stdout
    print(out)
    assert proc.returncode == 1, proc.stderr
    line = check_line(out, "Kubernetes version")
    # the binary's gitVersion alone would pass it: the line must judge the minor it serves
    assert line.startswith("\u00d7 ") and "v1.34 (emulated by v1." in line, line
    assert "older than gpuslice supports" in line

    op = OperatorProcess(emulating_1_34, tmp_path / "operator.log")
    op.start()
    try:
        wait_for(
            lambda: "unsupported Kubernetes version" in (op.log.read_text() if op.log.exists() else ""),
            60,
            "the operator to log the version",
        )
        assert "v1.34 (emulated by" in op.log.read_text()
        # it goes on serving what the API server has: its admission policies are installed
        binding = "validatingadmissionpolicybinding"
        wait_for(lambda: get(emulating_1_34, binding, "gpuslice-protect"), 60, "policies")
        assert op.alive(), op.tail()
    finally:
        op.stop()
