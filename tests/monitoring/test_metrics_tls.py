"""The metrics port over TLS, read by a real Prometheus: HTTPS with a serving certificate from
mounted files (a kubernetes.io/tls Secret's `tls.crt`/`tls.key`), the bearer token still reviewed by
the API server (no token 401, a tenant's 403), plain HTTP refused, and a rotated certificate served
at the next connection without a restart.

Prometheus' TLS and token settings are the translation of a ServiceMonitor endpoint with
`scheme: https` and a `tlsConfig` (caFile, serverName), as the Prometheus Operator writes them;
the target is given statically (discovery is tests/monitoring/test_prometheus.py's)."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from prometheus_client import CollectorRegistry, Gauge

from gpuslice import kubehttp
from gpuslice.metrics_auth import (
    MetricsGate,
    ServingCertificate,
    reviewer,
    serve_protected,
    serving_certificate,
)
from gpuslice_dev.devcluster import prometheus as prom
from gpuslice_dev.devcluster.cluster import DevCluster, free_port
from gpuslice_dev.devcluster.pki import LocalCA
from gpuslice_dev.paths import MANIFESTS
from support import metrics_readers, scrape, wait_for

pytestmark = pytest.mark.cluster

#: What the metrics-tls component's ServiceMonitor checks (its tlsConfig.serverName).
SERVER_NAME = "gpuslice-metrics.gpuslice-system.svc"
#: Its tlsConfig.ca: the Secret's ca.crt, which the Prometheus Operator mounts for Prometheus.
CA_IN_POD = "secret/gpuslice-metrics-tls/ca.crt"


@dataclass
class Served:
    port: int
    ca: LocalCA
    mounted: Path  # the Secret's volume: tls.crt, tls.key
    tenant: str
    prometheus: str
    token_file: Path
    work: Path
    cluster: DevCluster

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}/metrics"


def _issue(ca: LocalCA, stem: str, into: Path) -> int:
    """A serving certificate for the Service's name and loopback, written over `into` the way the
    kubelet updates a Secret volume (each file replaced whole); returns its serial number."""
    pair = ca.issue(stem, SERVER_NAME, server=True, hosts=[SERVER_NAME, "127.0.0.1"])
    for src, name in ((pair.cert, "tls.crt"), (pair.key, "tls.key")):
        tmp = into / f".{name}.new"
        shutil.copyfile(src, tmp)
        os.replace(tmp, into / name)
    return x509.load_pem_x509_certificate(pair.cert.read_bytes()).serial_number


@pytest.fixture(scope="module")
def served(cluster: DevCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    work = tmp_path_factory.mktemp("metrics-tls")
    ca = LocalCA(work / "ca")
    mounted = work / "secret"
    mounted.mkdir()
    _issue(ca, "serving-1", mounted)
    registry = CollectorRegistry()
    Gauge("gpuslice_slice_memory_used_bytes", "x", ["namespace"], registry=registry).labels("team-b").set(1)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    api = kubehttp.Client(kubehttp.Config.from_kubeconfig(cluster.kubeconfig))
    port = free_port()
    tls = ServingCertificate(mounted / "tls.crt", mounted / "tls.key")
    server, _ = serve_protected(port, registry, MetricsGate(reviewer(api), loop), addr="127.0.0.1", tls=tls)
    try:
        with metrics_readers(cluster) as readers:
            token_file = work / "token"
            token_file.write_text(readers.prometheus)
            yield Served(port, ca, mounted, readers.tenant, readers.prometheus, token_file, work, cluster)
    finally:
        server.shutdown()
        asyncio.run_coroutine_threadsafe(api.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)


def _client_context(ca: LocalCA) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca.cert_path))
    return ctx


def _served_serial(s: Served) -> int:
    raw = socket.create_connection(("127.0.0.1", s.port), timeout=10)
    with _client_context(s.ca).wrap_socket(raw, server_hostname=SERVER_NAME) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def _https(s: Served, token: str | None) -> tuple[int, str]:
    # support.scrape through urllib with the CA: urllib checks the name against the URL's host
    # (127.0.0.1, in the certificate's SANs), as a client by address would.
    import urllib.request

    handler = urllib.request.HTTPSHandler(context=_client_context(s.ca))
    opener = urllib.request.build_opener(handler)
    req = urllib.request.Request(s.url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with opener.open(req, timeout=20) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_over_https_the_token_gate_still_decides(served: Served) -> None:
    assert _https(served, None)[0] == 401
    status, body = _https(served, served.tenant)
    assert status == 403 and "team-b" not in body
    status, body = _https(served, served.prometheus)
    assert status == 200 and 'namespace="team-b"' in body


def test_plain_http_is_refused(served: Served) -> None:
    with pytest.raises(OSError):  # the TLS handshake fails: no HTTP answer, no series
        scrape(f"http://127.0.0.1:{served.port}/metrics", served.prometheus, timeout=10)


def _servicemonitor(cluster: DevCluster, work: Path, components: list[str]) -> dict[str, Any]:
    """The ServiceMonitor as `kubectl kustomize` renders it with these components of manifests/."""
    layer = work / ("kustomize-" + "-".join(components))
    layer.mkdir(exist_ok=True)
    (layer / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "components": [os.path.relpath(MANIFESTS / "components" / n, layer) for n in components],
            }
        )
    )
    rendered = cluster.kubectl("kustomize", str(layer)).stdout
    (sm,) = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "ServiceMonitor"]
    return dict(sm)


def _scrape_config(s: Served, scheme: str) -> dict[str, Any]:
    """https: the ServiceMonitor with the metrics-tls component; http: the monitoring one alone."""
    with_tls = ["monitoring", "metrics-tls"] if scheme == "https" else ["monitoring"]
    sm = _servicemonitor(s.cluster, s.work, with_tls)
    assert sm["spec"]["endpoints"][0].get("scheme", "http") == scheme
    creds = prom.Credentials(
        api_server="https://127.0.0.1:1",
        api_ca_file=s.ca.cert_path,
        api_token_file=s.token_file,
        files={prom.SERVICE_ACCOUNT_TOKEN: s.token_file, CA_IN_POD: s.ca.cert_path},
    )
    (config,) = prom.scrape_configs(sm, creds)
    config.pop("kubernetes_sd_configs")
    config.pop("relabel_configs")
    config["job_name"] = scheme
    config["scrape_interval"] = "1s"
    config["static_configs"] = [{"targets": [f"127.0.0.1:{s.port}"]}]
    return config


def test_prometheus_scrapes_over_https_with_its_token_and_not_over_http(served: Served) -> None:
    binaries = prom.ensure_prometheus()
    config = {"scrape_configs": [_scrape_config(served, "https"), _scrape_config(served, "http")]}
    server = prom.start_prometheus(binaries.prometheus, config, served.work / "prom", free_port())
    try:

        def health() -> dict[str, Any] | None:
            by_job = {t["labels"]["job"]: t for t in server.targets()}
            done = all(t["health"] != "unknown" for t in by_job.values()) and len(by_job) == 2
            return by_job if done else None

        by_job = wait_for(health, 30, "both targets scraped")
        assert by_job["https"]["health"] == "up", by_job["https"]["lastError"]
        assert by_job["http"]["health"] == "down"
        assert server.query('gpuslice_slice_memory_used_bytes{job="https", namespace="team-b"}')
        # The certificate rotated in its Secret: served at the next connection, no restart, and
        # Prometheus (trusting the CA) keeps scraping.
        before = _served_serial(served)
        rotated = _issue(served.ca, "serving-2", served.mounted)
        assert rotated != before
        wait_for(lambda: _served_serial(served) == rotated, 10, "the rotated certificate served")
        seen = {_https_target(server)["lastScrape"]}

        def scraped_again() -> dict[str, Any] | None:
            t = _https_target(server)
            seen.add(t["lastScrape"])
            return t if len(seen) >= 3 else None  # two scrapes since, on new connections or kept ones

        target = wait_for(scraped_again, 30, "scrapes after the rotation")
        assert target["health"] == "up", target["lastError"]
    finally:
        server.stop()


def _https_target(server: prom.PrometheusServer) -> dict[str, Any]:
    (t,) = [t for t in server.targets() if t["labels"]["job"] == "https"]
    return t


def test_a_certificate_without_its_key_or_unreadable_fails_at_start(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="go together"):
        serving_certificate(tmp_path / "tls.crt", None)
    (tmp_path / "tls.crt").write_text("not a certificate")
    (tmp_path / "tls.key").write_text("not a key")
    with pytest.raises(ValueError, match=r"tls\.crt"):
        serve_protected(
            free_port(),
            CollectorRegistry(),
            None,
            tls=ServingCertificate(tmp_path / "tls.crt", tmp_path / "tls.key"),
        )  # type: ignore[arg-type]
