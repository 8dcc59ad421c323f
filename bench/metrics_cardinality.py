"""Series per slice and scrape cost of the agent's and the operator's metrics, at 8 cards x 50
claims (400 slices) and at 2,000 slices, and that a slice's series go with it.

    .venv/bin/python bench/metrics_cardinality.py [--slices 400 2000] [--scrapes 20] [--json]

In-process, on the product's own registries and setters: each slice gets every per-slice series
the agent's usage reporter sets for a slice with a running process (memory used and limit, compute
utilization, refused allocations and throttled time from the shim's totals, software compatibility
per reason, idle) plus one violation, and the operator's `gpuslice_slice_allocated`; then the
exposition Prometheus would scrape is generated (`generate_latest`, what `/metrics` returns before
TLS and the token gate) `--scrapes` times. Figures: series and bytes per slice, median time per
scrape, each as a ratio to the empty registries measured in the same run; then every slice is
forgotten as the agent and the operator do when a slice goes, and the series left are counted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from prometheus_client import generate_latest

from gpuslice import metrics
from gpuslice.domain.gpu_processes import ViolationKind

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slices", type=int, nargs="+", default=[CARDS * 50, 2000])
    ap.add_argument("--scrapes", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    registries = {"agent": metrics.AGENT_REGISTRY, "operator": metrics.OPERATOR_REGISTRY}
    base = {k: _scrape(r, args.scrapes) for k, r in registries.items()}
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
        print(json.dumps({"empty": base, "rows": rows}, indent=1))
        return 0
    for name, (series, size, took) in base.items():
        print(f"{name:8} empty: {series} series, {size} bytes, {took * 1e3:.2f} ms a scrape")
    for r in rows:
        if "series_left_after_forget" in r:
            print(
                f"{r['process']:8} {r['slices']:5} slices gone: {r['series_left_after_forget']} series left"
            )
        else:
            print(
                f"{r['process']:8} {r['slices']:5} slices: {r['series']} series "
                f"({r['series_per_slice']} a slice), {r['bytes'] / 1e6:.2f} MB "
                f"({r['bytes_per_slice']} B a slice), "
                f"{r['scrape_s'] * 1e3:.1f} ms a scrape ({r['scrape_time_vs_empty']}x empty)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
