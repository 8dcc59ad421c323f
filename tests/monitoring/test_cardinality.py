"""Label cardinality: no series is labelled by something unbounded (a process, a claim's UID), and at
2,000 slices the operator exports one series a held slice plus two a namespace and package, all
gone when the slices are.

The operator's side runs its own exporters (the ledger's `gpuslice_slice_allocated` export and the
per-namespace entitlement gauges fed from quota statuses); bench/metrics_cardinality.py measures
the bytes and time of a scrape of both registries at the same scale.
"""

from __future__ import annotations

from datetime import UTC, datetime

from prometheus_client import CollectorRegistry, Metric, generate_latest

from gpuslice import constants as c
from gpuslice import metrics
from gpuslice.domain.entitlement_use import entitlement_use
from gpuslice.domain.ledger import Holding
from gpuslice.operator.entitlement_metrics import set_namespace_entitlements
from gpuslice.operator.ledger import _export
from gpuslice.operator.metering import Metering

SLICES = 2000
NAMESPACES = 40
PACKAGES = ("v100-8g", "v100-16g")

#: Every label any gpuslice series carries. Each is bounded by something a platform sizes: the
#: slices held (namespace, slice, pod), the catalogue (package, currency), the fleet (node, card),
#: or a fixed enumeration (phase, kind, verb, reason, XID and its class, the release).
ALLOWED_LABELS = {
    "namespace", "slice", "package", "pod", "node", "gpu_uuid", "gpu_index", "model",
    "phase", "reason", "kind", "verb", "currency", "xid", "xid_class",
    "component", "version", "python_version",
}  # fmt: skip


def _gpuslice_metrics(registry: CollectorRegistry) -> list[Metric]:
    return [m for m in registry.collect() if m.name.startswith("gpuslice_")]


def test_no_series_carries_a_label_outside_the_bounded_set() -> None:
    seen: dict[str, set[str]] = {}
    for registry in (metrics.OPERATOR_REGISTRY, metrics.AGENT_REGISTRY):
        for collector in list(registry._collector_to_names):  # every registered metric, set or not
            labels = set(getattr(collector, "_labelnames", ()))
            for name in registry._collector_to_names[collector]:
                seen[name] = labels
    assert seen, "no gpuslice metric found"
    unbounded = {name: labels - ALLOWED_LABELS for name, labels in seen.items() if labels - ALLOWED_LABELS}
    assert unbounded == {}
    # A pod label only where a held claim is the unit (a template slice holds one claim per pod).
    assert {n for n, labels in seen.items() if "pod" in labels} == {"gpuslice_slice_allocated"}


def _series(registry: CollectorRegistry) -> int:
    return sum(1 for line in generate_latest(registry).splitlines() if line and not line.startswith(b"#"))


def _holding(i: int, pod: str | None = None) -> Holding:
    ns = f"tenant-{i % NAMESPACES:02d}"
    return Holding(
        namespace=ns, package=PACKAGES[i % len(PACKAGES)], slice=f"s-{i:05d}", claim=f"s-{i:05d}",
        claim_uid=f"uid-{i}", pod=pod or f"pod-{i}", node=f"node-{i // 400}", gpu=f"GPU-{i % 8}",
        allocated_at=datetime(2026, 12, 1, tzinfo=UTC),
    )  # fmt: skip


def _quota_status(ns: str, held: dict[tuple[str, str], int]) -> dict[str, tuple[int, int]]:
    hard = {c.quota_key(p): "100" for p in PACKAGES}
    used = {c.quota_key(p): str(held.get((ns, p), 0)) for p in PACKAGES}
    return entitlement_use(hard, used)


def test_at_2000_slices_the_operator_exports_one_series_a_slice_and_two_a_namespace_package() -> None:
    base = _series(metrics.OPERATOR_REGISTRY)
    metering = Metering()
    held: dict[str, list[Holding]] = {}
    for i in range(SLICES):
        h = _holding(i)
        held.setdefault(h.namespace, []).append(h)
    counts: dict[tuple[str, str], int] = {}
    for ns, hs in held.items():
        for h in hs:
            counts[(ns, h.package)] = counts.get((ns, h.package), 0) + 1
    for ns, hs in held.items():
        _export(metering, ns, hs)
        set_namespace_entitlements(ns, _quota_status(ns, counts))
    try:
        assert _series(metrics.OPERATOR_REGISTRY) - base == SLICES + 2 * NAMESPACES * len(PACKAGES)
        # Exported again (every reconcile does): the same series, none added.
        for ns, hs in held.items():
            _export(metering, ns, hs)
        assert _series(metrics.OPERATOR_REGISTRY) - base == SLICES + 2 * NAMESPACES * len(PACKAGES)
        # A template slice's claim moving to a new pod replaces its series rather than adding one.
        ns0 = "tenant-00"
        moved = [_holding(0, pod="pod-0-replacement"), *held[ns0][1:]]
        _export(metering, ns0, moved)
        assert _series(metrics.OPERATOR_REGISTRY) - base == SLICES + 2 * NAMESPACES * len(PACKAGES)
    finally:
        # Every slice released and every namespace no longer a tenant: nothing of them is left.
        for ns in held:
            _export(metering, ns, [])
            set_namespace_entitlements(ns, {})
    assert _series(metrics.OPERATOR_REGISTRY) == base
