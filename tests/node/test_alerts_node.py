"""On the real node, a process that bypasses the shim fires GpuSliceMemoryViolation in a real
Prometheus that scrapes the node's agent the way the shipped ServiceMonitor says.

The agent serves its metrics port (restarted with one), the shipped agent Service gets an
EndpointSlice naming it, and Prometheus discovers it through the translated ServiceMonitor with the
monitoring component's binding and token, with the shipped PrometheusRule loaded (its `for`s at 0:
promtool tests those, tests/monitoring/test_alerts.py). The violator is the isolation test's: the
host's cuda_probe moved into the pod's cgroups and PID namespace, holding 10 GiB of the pod's 8 GiB
slice; under the package's default `onViolation: Stop` the agent kills it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from gpuslice_dev.devcluster import prometheus as prom
from gpuslice_dev.devcluster.cluster import DevCluster, free_port
from gpuslice_dev.devcluster.node_agents import agent_process_name, start_agents
from monitoring.test_prometheus import MONITORING, REPO, _docs, _rules_without_for
from node.node_cluster import GPU_SPEC, TENANT
from node.test_isolation_node import NODE, _release, bypass_pod, gpu_holder  # noqa: F401 (a fixture)
from support import apply, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow(seconds=60)]

GIB = 1024**3


@pytest.fixture(scope="module")
def server(
    node_cluster: DevCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[prom.PrometheusServer]:
    cluster = node_cluster
    binaries = prom.ensure_prometheus()
    work = tmp_path_factory.mktemp("prometheus-node")
    cluster.stop_processes(lambda name: name == agent_process_name(NODE))
    assert start_agents(cluster, GPU_SPEC, metrics=True) == [NODE]
    assert prom.expose_agents(cluster) == 1
    (binding,) = _docs(MONITORING / "metrics-reader.yaml")
    (role,) = _docs(REPO / "manifests/base/metrics-reader.yaml")
    namespace = binding["subjects"][0]["namespace"]
    cluster.create_namespace(namespace)
    apply(cluster, [role, *prom.scraper_docs(binding, namespace)])
    token = work / "token"
    token.write_text(
        cluster.kubectl("create", "token", binding["subjects"][0]["name"], "-n", namespace).stdout.strip()
    )
    token.chmod(0o600)
    ca = cluster.dir / "pki" / "ca.crt"
    st = cluster.state()
    assert st is not None
    creds = prom.Credentials(
        st.server, ca, token, {prom.SERVICE_ACCOUNT_TOKEN: token, prom.SERVICE_ACCOUNT_CA: ca}
    )
    scrape = prom.scrape_configs(prom.load_servicemonitor(MONITORING / "servicemonitor.yaml"), creds)
    for s in scrape:
        s["scrape_interval"] = "2s"
    config = {"global": {"scrape_interval": "2s", "evaluation_interval": "1s"}, "scrape_configs": scrape}
    srv = prom.start_prometheus(
        binaries.prometheus, config, work, free_port(), rule_files=[_rules_without_for(work)]
    )
    try:
        yield srv
    finally:
        srv.stop()


def _firing(server: prom.PrometheusServer, alert: str, **labels: str) -> list[dict[str, Any]]:
    return [
        a
        for a in server.api("alerts")["alerts"]
        if a["labels"]["alertname"] == alert
        and a["state"] == "firing"
        and labels.items() <= a["labels"].items()
    ]


def test_a_process_past_its_slice_fires_memory_violation(
    server: prom.PrometheusServer,
    node_cluster: DevCluster,
    bypass_pod: tuple[str, str, int],  # noqa: F811
) -> None:
    uuid, _, container_pid = bypass_pod
    up = wait_for(
        lambda: [t for t in server.targets() if t["labels"].get("job") == "agent" and t["health"] == "up"],
        60, "the node's agent scraped",
    )  # fmt: skip
    assert len(up) == 1, up
    # The slice's series are there before anything is wrong, and no violation is.
    wait_for(
        lambda: server.query(f'gpuslice_slice_memory_limit_bytes{{namespace="{TENANT}", slice="bypass"}}'),
        60, "the slice's series scraped",
    )  # fmt: skip
    assert not _firing(server, "GpuSliceMemoryViolation")
    started = time.monotonic()
    holder = gpu_holder(node_cluster, uuid, 10 * GIB, into_pod_of=container_pid)
    try:
        (alert,) = wait_for(
            lambda: _firing(server, "GpuSliceMemoryViolation", namespace=TENANT, slice="bypass"),
            90, "GpuSliceMemoryViolation firing",
        )  # fmt: skip
        took = time.monotonic() - started
        print(f"\n[alerts] bypass to GpuSliceMemoryViolation firing (for: 0): {took:.1f} s")
        assert alert["labels"]["node"] == NODE
        assert alert["labels"]["severity"] == "warning"
        holder.wait(timeout=60)  # onViolation: Stop (the default): the agent killed it
    finally:
        _release(holder)
