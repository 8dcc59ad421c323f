"""The agent's metrics, read the way the red team read them (any pod's token, or none) and the way
Prometheus reads them, against the real API server's TokenReview and SubjectAccessReview."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry, Gauge

from gpuslice import kubehttp
from gpuslice.metrics_auth import MetricsGate, reviewer, serve_protected
from gpuslice_dev.devcluster.cluster import DevCluster, free_port
from support import metrics_readers, scrape

pytestmark = pytest.mark.cluster


@dataclass
class Served:
    url: str
    tenant_token: str
    prometheus_token: str
    calls: list[str]


@pytest.fixture(scope="module")
def served(cluster: DevCluster) -> Iterator[Served]:
    registry = CollectorRegistry()
    used = Gauge("gpuslice_slice_memory_used_bytes", "x", ["namespace"], registry=registry)
    used.labels("team-b").set(8 << 30)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    api = kubehttp.Client(kubehttp.Config.from_kubeconfig(cluster.kubeconfig))
    calls: list[str] = []
    review = reviewer(api)

    async def counted(t: str) -> tuple[int, str]:
        calls.append(t[:8])
        return await review(t)

    port = free_port()
    server, _ = serve_protected(port, registry, MetricsGate(counted, loop), addr="127.0.0.1")
    try:
        with metrics_readers(cluster) as readers:
            yield Served(f"http://127.0.0.1:{port}/metrics", readers.tenant, readers.prometheus, calls)
    finally:
        server.shutdown()
        asyncio.run_coroutine_threadsafe(api.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)


def test_without_a_token_nothing_is_served(served: Served) -> None:
    status, body = scrape(served.url, None)
    assert status == 401 and "bearer token" in body and "team-b" not in body


def test_a_forged_token_is_refused(served: Served) -> None:
    status, body = scrape(served.url, "not-a-token")
    assert status == 401 and "not valid" in body and "team-b" not in body


def test_another_tenants_pod_token_is_refused(served: Served) -> None:
    status, body = scrape(served.url, served.tenant_token)
    assert status == 403 and "may not get /metrics" in body and "nonResourceURLs" in body
    assert "team-b" not in body


def test_prometheus_with_the_metrics_reader_role_reads_them_and_is_reviewed_once_a_minute(
    served: Served,
) -> None:
    before = len(served.calls)
    for _ in range(3):
        status, body = scrape(served.url, served.prometheus_token)
        assert status == 200 and 'gpuslice_slice_memory_used_bytes{namespace="team-b"}' in body
    assert len(served.calls) - before == 1  # cached
