"""The metrics catalogue: the names, types and labels dashboards and alerts are written against."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gpuslice import metrics, metrics_auth

SLICE = ("namespace", "slice", "package", "node", "gpu_uuid")
GPU = ("node", "gpu_uuid", "model")

#: The published contract (what dashboards and alerts are written against, plus health series):
#: exported family name -> (type, label names).
BUILD_INFO = {"gpuslice_build_info": ("gauge", ("component", "version", "python_version"))}
OPERATOR = {
    **BUILD_INFO,
    "gpuslice_reconcile_duration_seconds": ("histogram", ("kind",)),
    "gpuslice_slices": ("gauge", ("package", "phase")),
    "gpuslice_package_capacity_slices": ("gauge", ("package",)),
    "gpuslice_package_free_slices": ("gauge", ("package",)),
    "gpuslice_slice_pending_seconds": ("histogram", ("package",)),
    "gpuslice_slice_transitions": ("counter", ("phase", "reason")),
    "gpuslice_operator_writes": ("counter", ("kind", "verb")),
    "gpuslice_operator_status_updates": ("counter", ("kind",)),
    "gpuslice_slice_allocated": ("gauge", ("namespace", "package", "slice", "pod", "node", "gpu_uuid")),
    "gpuslice_package_price_per_hour": ("gauge", ("package", "currency")),
    "gpuslice_namespace_entitled_slices": ("gauge", ("namespace", "package")),
    "gpuslice_namespace_held_slices": ("gauge", ("namespace", "package")),
    "gpuslice_ledger_write_errors": ("counter", ("reason",)),
}
AGENT = {
    **BUILD_INFO,
    "gpuslice_slice_memory_used_bytes": ("gauge", SLICE),
    "gpuslice_slice_memory_limit_bytes": ("gauge", SLICE),
    "gpuslice_slice_compute_utilization_ratio": ("gauge", SLICE),
    # prometheus-client names counter families without `_total`; the samples carry it.
    "gpuslice_slice_refused_allocations": ("counter", SLICE),
    "gpuslice_slice_throttled_seconds": ("counter", SLICE),
    "gpuslice_slice_violations": ("counter", (*SLICE, "kind")),
    "gpuslice_slice_software_incompatible": ("gauge", (*SLICE, "reason")),
    "gpuslice_slice_gpu_idle": ("gauge", SLICE),
    "gpuslice_gpu_memory_allocated_bytes": ("gauge", GPU),
    "gpuslice_gpu_memory_total_bytes": ("gauge", GPU),
    "gpuslice_agent_published_devices": ("gauge", ("node",)),
    "gpuslice_agent_published_resourceslices": ("gauge", ("node",)),
    "gpuslice_agent_pool_generation": ("gauge", ("node",)),
    "gpuslice_agent_publishes": ("counter", ("node",)),
    "gpuslice_agent_prepared_claims": ("gauge", ("node",)),
    "gpuslice_agent_prepare_errors": ("counter", ("node",)),
    "gpuslice_agent_toolkit_unsafe": ("gauge", ("node",)),
    "gpuslice_gpu_healthy": ("gauge", ("node", "gpu_uuid", "gpu_index")),
    "gpuslice_gpu_xid": ("counter", ("node", "gpu_uuid", "xid", "xid_class")),
}

LABELS = ("team-a", "llm", "v100-8g", "node-1", "GPU-0")
OTHER = ("team-b", "train", "v100-16g", "node-2", "GPU-1")


def families(registry: CollectorRegistry) -> dict[str, tuple[str, tuple[str, ...]]]:
    """gpuslice families of a registry, with the label names their describe() announces."""
    out = {}
    for collector in list(registry._collector_to_names):
        for fam in collector.describe() if hasattr(collector, "describe") else []:
            if fam.name.startswith("gpuslice_"):
                out[fam.name] = (fam.type, tuple(getattr(collector, "_labelnames", ())))
    return out


def sample_names(registry: CollectorRegistry) -> set[str]:
    return {s.name for fam in registry.collect() for s in fam.samples}


@pytest.fixture(autouse=True)
def _clean_series():
    yield
    for collector in [
        *metrics.OPERATOR_REGISTRY._collector_to_names,
        *metrics.AGENT_REGISTRY._collector_to_names,
    ]:
        if getattr(collector, "_labelnames", None):
            collector.clear()


def test_operator_registry_holds_exactly_the_operator_catalogue():
    assert families(metrics.OPERATOR_REGISTRY) == OPERATOR


def test_agent_registry_holds_exactly_the_agent_catalogue():
    assert families(metrics.AGENT_REGISTRY) == AGENT


def test_each_process_also_exports_process_series_but_not_the_others_metrics():
    metrics.SLICE_MEMORY_USED.labels(*LABELS).set(1)
    metrics.SLICES.labels("v100-8g", "Pending").set(1)
    operator_text = generate_latest(metrics.OPERATOR_REGISTRY).decode()
    agent_text = generate_latest(metrics.AGENT_REGISTRY).decode()
    assert "process_resident_memory_bytes" in operator_text and "process_resident_memory_bytes" in agent_text
    assert "gpuslice_slice_memory_used_bytes" not in operator_text
    assert "gpuslice_slices{" not in agent_text


def test_counters_are_exposed_with_the_total_suffix():
    metrics.SLICE_REFUSED_ALLOCATIONS.labels(*LABELS).inc()
    metrics.SLICE_THROTTLED.labels(*LABELS).inc(0.5)
    metrics.SLICE_VIOLATIONS.labels(*LABELS, metrics.ViolationKind.MEMORY_OVER_SLICE).inc()
    names = sample_names(metrics.AGENT_REGISTRY)
    assert {
        "gpuslice_slice_refused_allocations_total",
        "gpuslice_slice_throttled_seconds_total",
        "gpuslice_slice_violations_total",
    } <= names


def test_counter_from_total_adds_growth_and_survives_a_restarted_source():
    tracker = metrics.CounterFromTotal(metrics.SLICE_REFUSED_ALLOCATIONS)
    child = metrics.SLICE_REFUSED_ALLOCATIONS.labels(*LABELS)
    tracker.update(LABELS, 3)
    tracker.update(LABELS, 3)
    tracker.update(LABELS, 5)
    assert child._value.get() == 5
    # The slice's usage region was recreated: its total starts again from 0.
    tracker.update(LABELS, 2)
    assert child._value.get() == 7
    with pytest.raises(ValueError, match="negative"):
        tracker.update(LABELS, -1)


def test_forget_slice_drops_every_series_of_that_slice_only():
    tracker = metrics.CounterFromTotal(metrics.SLICE_THROTTLED)
    for labels in (LABELS, OTHER):
        metrics.SLICE_MEMORY_USED.labels(*labels).set(1)
        metrics.SLICE_MEMORY_LIMIT.labels(*labels).set(8 * 2**30)
        metrics.SLICE_COMPUTE_UTILIZATION.labels(*labels).set(0.25)
        metrics.SLICE_REFUSED_ALLOCATIONS.labels(*labels).inc()
        tracker.update(labels, 4)
        metrics.SLICE_VIOLATIONS.labels(*labels, metrics.ViolationKind.UNKNOWN_PROCESS).inc()
    metrics.forget_slice(LABELS, tracker)
    text = generate_latest(metrics.AGENT_REGISTRY).decode()
    assert 'slice="llm"' not in text
    assert text.count('slice="train"') >= 6
    # A slice of the same name that comes back starts its counters from its own new total.
    tracker.update(LABELS, 1)
    assert metrics.SLICE_THROTTLED.labels(*LABELS)._value.get() == 1


def test_forget_package_drops_the_operator_series_of_that_package():
    for phase in ("Pending", "InUse"):
        metrics.SLICES.labels("v100-8g", phase).set(2)
    metrics.SLICES.labels("v100-16g", "InUse").set(1)
    metrics.PACKAGE_CAPACITY_SLICES.labels("v100-8g").set(4)
    metrics.PACKAGE_FREE_SLICES.labels("v100-8g").set(2)
    metrics.SLICE_PENDING.labels("v100-8g").observe(3)
    metrics.forget_package("v100-8g")
    text = generate_latest(metrics.OPERATOR_REGISTRY).decode()
    assert 'package="v100-8g"' not in text
    assert 'gpuslice_slices{package="v100-16g",phase="InUse"} 1.0' in text


@pytest.mark.parametrize("port", [0, -1, 70000])
def test_serve_rejects_a_port_that_is_not_one(port: int):
    async def never_asked(token: str) -> tuple[int, str]:
        raise AssertionError("no request can reach a server that was not started")

    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(ValueError, match="not a TCP port"):
            metrics_auth.serve_protected(
                port, metrics.AGENT_REGISTRY, metrics_auth.MetricsGate(never_asked, loop)
            )
    finally:
        loop.close()
