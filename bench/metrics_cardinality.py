"""Series per slice and scrape cost of the agent's and the operator's metrics, at 8 cards x 50
claims (400 slices) and at 2,000 slices, and that a slice's series go with it.

    .venv/bin/python bench/metrics_cardinality.py [--slices 400 2000] [--scrapes 20] [--json]
        [--https [--dir DEVCLUSTER]]

In-process, on the product's own registries and setters: each slice gets every per-slice series
the agent's usage reporter sets for a slice with a running process (memory used and limit, compute
utilization, refused allocations and throttled time from the shim's totals, software compatibility
per reason, idle) plus one violation, and the operator's `gpuslice_slice_allocated`; then the
exposition Prometheus would scrape is generated (`generate_latest`, what `/metrics` returns before
TLS and the token gate) `--scrapes` times. Figures: series and bytes per slice, median time per
scrape, each as a ratio to the empty registries measured in the same run; then every slice is
forgotten as the agent and the operator do when a slice goes, and the series left are counted.

With `--https`, each scrape is also made as Prometheus makes it: a new TLS connection to the product's
own metrics server (`metrics_auth.serve_protected`, a certificate from a local CA), a service
account's bearer token that the gate has the API server review (TokenReview and SubjectAccessReview,
a devcluster's: `--dir` of a running one, else one is started and stopped), `Accept-Encoding: gzip`.
Figures: bytes on the wire and unzipped, median time per scrape with the verdict cached (how
Prometheus scrapes every 30 s: one review a minute), and the first scrape of a token (reviewed).
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import http.client
import json
import ssl
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry, generate_latest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "operator"))

from gpuslice import kubehttp, metrics  # noqa: E402
from gpuslice.domain.gpu_processes import ViolationKind  # noqa: E402
from gpuslice.metrics_auth import MetricsGate, ServingCertificate, reviewer, serve_protected  # noqa: E402

CARDS = 8


def _series(text: bytes) -> int:
    return sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))


def _scrape(registry: Any, n: int) -> tuple[int, int, float]:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        body = generate_latest(registry)
        times.append(time.perf_counter() - t)
    return _series(body), len(body), statistics.median(times)


class HttpsScraper:
    """Both registries behind the product's metrics servers (TLS + token gate), scraped with a
    metrics reader's token; the token reviews go to the devcluster's API server."""

    def __init__(self, cluster: Any, work: Path, registries: dict[str, CollectorRegistry]) -> None:
        from gpuslice_dev.devcluster.cluster import free_port
        from gpuslice_dev.devcluster.pki import LocalCA

        ca = LocalCA(work / "ca")
        pair = ca.issue("metrics", "127.0.0.1", server=True, hosts=["127.0.0.1"])
        self.client = ssl.create_default_context(cafile=str(ca.cert_path))
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.api = kubehttp.Client(kubehttp.Config.from_kubeconfig(cluster.kubeconfig))
        self.gates: dict[str, MetricsGate] = {}
        self.ports: dict[str, int] = {}
        self.servers = []
        tls = ServingCertificate(pair.cert, pair.key)
        for name, registry in registries.items():
            self.gates[name] = MetricsGate(reviewer(self.api), self.loop)
            self.ports[name] = free_port()
            server, _ = serve_protected(self.ports[name], registry, self.gates[name], "127.0.0.1", tls)
            self.servers.append(server)
        self.token = ""

    def once(self, name: str) -> tuple[int, int, int, float]:
        """One scrape on a new connection: series, bytes unzipped, bytes on the wire, seconds."""
        t = time.perf_counter()
        conn = http.client.HTTPSConnection("127.0.0.1", self.ports[name], context=self.client, timeout=60)
        conn.request(
            "GET", "/metrics", headers={"Authorization": f"Bearer {self.token}", "Accept-Encoding": "gzip"}
        )
        resp = conn.getresponse()
        wire = resp.read()
        conn.close()
        took = time.perf_counter() - t
        if resp.status != 200:
            raise RuntimeError(f"GET /metrics of the {name}: {resp.status} {wire[:200]!r}")
        body = gzip.decompress(wire) if resp.getheader("Content-Encoding") == "gzip" else wire
        return _series(body), len(body), len(wire), took

    def scrape(self, name: str, n: int) -> dict[str, Any]:
        """The first scrape of a fresh token verdict (reviewed by the API server), then `n` cached."""
        self.gates[name]._cache.clear()
        first = self.once(name)
        rest = [self.once(name) for _ in range(n)]
        series, plain, wire, _ = rest[-1]
        return {
            "series": series,
            "bytes": plain,
            "wire_bytes": wire,
            "scrape_s": round(statistics.median(r[3] for r in rest), 5),
            "first_scrape_s": round(first[3], 5),
        }

    def close(self) -> None:
        for server in self.servers:
            server.shutdown()
        asyncio.run_coroutine_threadsafe(self.api.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


@contextmanager
def https_scraper(directory: Path | None, registries: dict[str, CollectorRegistry]) -> Iterator[HttpsScraper]:
    """A devcluster (the running one in `directory`, else a new one, stopped afterwards), a service
    account bound to the manifests' metrics-reader role, and the scraper with its token."""
    from gpuslice_dev.devcluster.cluster import DevCluster

    work = Path(tempfile.mkdtemp(prefix="gpuslice-scrape-"))
    cluster = DevCluster(directory or work / "devcluster")
    started = not (cluster.status() and all(cluster.status().values()))
    if started:
        cluster.up(nodes=1)
    name = f"gpuslice-bench-scrape-{uuid.uuid4().hex[:6]}"
    (role,) = [d for d in yaml.safe_load_all((REPO / "manifests/base/metrics-reader.yaml").read_text()) if d]
    role["metadata"]["name"] = name
    docs = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": "default"}},
        role,
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": "default"}],
        },
    ]
    cluster.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
    scraper = HttpsScraper(cluster, work, registries)
    try:
        scraper.token = cluster.kubectl("create", "token", name, "-n", "default").stdout.strip()
        yield scraper
    finally:
        scraper.close()
        cluster.kubectl("delete", "clusterrole,clusterrolebinding", name, "--wait=false", check=False)
        cluster.kubectl("delete", "serviceaccount", name, "-n", "default", "--wait=false", check=False)
        if started:
            cluster.down()


def _labels(i: int) -> tuple[str, ...]:
    ns = f"tenant-{i % 40:02d}"
    return metrics.slice_labels(
        ns, f"slice-{i:05d}", "v100-8g", f"node-{i // (CARDS * 50)}", f"GPU-{i % CARDS:02d}"
    )


def fill(n: int) -> tuple[metrics.CounterFromTotal, metrics.CounterFromTotal]:
    refused = metrics.CounterFromTotal(metrics.SLICE_REFUSED_ALLOCATIONS)
    throttled = metrics.CounterFromTotal(metrics.SLICE_THROTTLED)
    for i in range(n):
        labels = _labels(i)
        metrics.SLICE_MEMORY_USED.labels(*labels).set(1 << 30)
        metrics.SLICE_MEMORY_LIMIT.labels(*labels).set(8 << 30)
        metrics.SLICE_COMPUTE_UTILIZATION.labels(*labels).set(0.2)
        refused.update(labels, 1)
        throttled.update(labels, 0.5)
        for reason in metrics.SOFTWARE_REASONS:
            metrics.SLICE_SOFTWARE_INCOMPATIBLE.labels(*labels, reason).set(0)
        metrics.SLICE_GPU_IDLE.labels(*labels).set(0)
        metrics.SLICE_VIOLATIONS.labels(*labels, next(iter(ViolationKind)).value).inc()
        ns, name, package, node, gpu = labels
        metrics.SLICE_ALLOCATED.labels(ns, package, name, f"pod-{i}", node, gpu).set(1)
    return refused, throttled


def forget(n: int, totals: tuple[metrics.CounterFromTotal, ...]) -> None:
    for i in range(n):
        labels = _labels(i)
        metrics.forget_slice(labels, *totals)
        ns, name, package, node, gpu = labels
        metrics.SLICE_ALLOCATED.remove(ns, package, name, f"pod-{i}", node, gpu)


def _https_row(now: dict[str, Any], empty: dict[str, Any]) -> dict[str, Any]:
    return {
        **now,
        "bytes_vs_empty": round(now["bytes"] / empty["bytes"], 1),
        "wire_bytes_vs_empty": round(now["wire_bytes"] / empty["wire_bytes"], 1),
        "series_vs_empty": round(now["series"] / empty["series"], 1),
        "scrape_time_vs_empty": round(now["scrape_s"] / empty["scrape_s"], 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slices", type=int, nargs="+", default=[CARDS * 50, 2000])
    ap.add_argument("--scrapes", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--https", action="store_true", help="also scrape over HTTPS with a reviewed bearer token"
    )
    ap.add_argument("--dir", type=Path, default=None, help="--https: a running devcluster's directory")
    args = ap.parse_args()
    registries = {"agent": metrics.AGENT_REGISTRY, "operator": metrics.OPERATOR_REGISTRY}
    if not args.https:
        return _report(args, registries, None)
    with https_scraper(args.dir, registries) as scraper:
        return _report(args, registries, scraper)


def _report(
    args: argparse.Namespace, registries: dict[str, CollectorRegistry], https: HttpsScraper | None
) -> int:
    base = {k: _scrape(r, args.scrapes) for k, r in registries.items()}
    https_base = {k: https.scrape(k, args.scrapes) for k in registries} if https else {}
    rows: list[dict[str, Any]] = []
    for n in args.slices:
        totals = fill(n)
        for name, registry in registries.items():
            series, size, took = _scrape(registry, args.scrapes)
            b_series, b_size, b_took = base[name]
            rows.append({
                "process": name, "slices": n, "series": series, "bytes": size, "scrape_s": round(took, 5),
                "series_per_slice": round((series - b_series) / n, 2),
                "bytes_per_slice": round((size - b_size) / n),
                "scrape_time_vs_empty": round(took / b_took, 1),
            })  # fmt: skip
            if https:
                rows[-1]["https"] = _https_row(https.scrape(name, args.scrapes), https_base[name])
        forget(n, totals)
        for name, registry in registries.items():
            rows.append(
                {
                    "process": name,
                    "slices": n,
                    "series_left_after_forget": _scrape(registry, 1)[0] - base[name][0],
                }
            )
    if args.json:
        print(json.dumps({"empty": base, "https_empty": https_base, "rows": rows}, indent=1))
        return 0
    for name, (series, size, took) in base.items():
        print(f"{name:8} empty: {series} series, {size} bytes, {took * 1e3:.2f} ms a scrape")
    for name, h in https_base.items():
        print(
            f"{name:8} empty over HTTPS: {h['series']} series, {h['bytes']} bytes "
            f"({h['wire_bytes']} gzipped), "
            f"{h['scrape_s'] * 1e3:.2f} ms a scrape, {h['first_scrape_s'] * 1e3:.1f} ms with the token review"
        )
    for r in rows:
        if "series_left_after_forget" in r:
            print(
                f"{r['process']:8} {r['slices']:5} slices gone: {r['series_left_after_forget']} series left"
            )
            continue
        print(
            f"{r['process']:8} {r['slices']:5} slices: {r['series']} series "
            f"({r['series_per_slice']} a slice), {r['bytes'] / 1e6:.2f} MB "
            f"({r['bytes_per_slice']} B a slice), "
            f"{r['scrape_s'] * 1e3:.1f} ms a scrape ({r['scrape_time_vs_empty']}x empty)"
        )
        if (h := r.get("https")) is not None:
            print(
                f"{'':8} {'':5} over HTTPS: {h['series']} series ({h['series_vs_empty']}x empty), "
                f"{h['bytes'] / 1e6:.2f} MB ({h['bytes_vs_empty']}x), {h['wire_bytes'] / 1e6:.3f} MB gzipped "
                f"({h['wire_bytes_vs_empty']}x), {h['scrape_s'] * 1e3:.1f} ms a scrape "
                f"({h['scrape_time_vs_empty']}x empty), first of a token {h['first_scrape_s'] * 1e3:.1f} ms"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
