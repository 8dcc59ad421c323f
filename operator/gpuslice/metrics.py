"""The one catalogue of gpuslice's Prometheus metrics: every series the operator and the agent export.

Each process serves its own registry (`OPERATOR_REGISTRY` or `AGENT_REGISTRY`), so the operator never
exports agent series and the other way round, although both import this module. Both serve it only
through `gpuslice.metrics_auth.serve_protected`, to readers the API server lets GET /metrics: the
series name tenants' namespaces, slices, pods and usage.
The Grafana dashboard in `manifests/components/monitoring/` queries exactly these names; a test keeps
the two in step.

Names follow Prometheus conventions: base units in the name (`_bytes`, `_seconds`, `_ratio`),
counters end in `_total`. Label sets are bounded: a slice is named by namespace/slice (one series
per live slice, removed with `forget_slice` when it goes) and GPUs by node/UUID.
"""

from __future__ import annotations

import platform

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)

from gpuslice import __version__
from gpuslice.api.slice import Phase
from gpuslice.domain.gpu_processes import ViolationKind

# No `<counter>_created` samples: one more series per counter and slice, which no query reads
# (bench/metrics_cardinality.py: 13 series a slice with them, 10 without).
disable_created_metrics()


def _process_registry() -> CollectorRegistry:
    # The standard process_*/python_* series as well, so a dashboard can tell a restart from a stall.
    registry = CollectorRegistry(auto_describe=True)
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(collector)
    return registry


OPERATOR_REGISTRY = _process_registry()
AGENT_REGISTRY = _process_registry()


def _build_info(registry: CollectorRegistry) -> Gauge:
    # Which release each process runs, as Kubernetes' own components export it: during a rolling
    # upgrade `count by (component, version) (gpuslice_build_info)` shows old and new side by side.
    return Gauge(
        "gpuslice_build_info",
        "Always 1: the gpuslice release (version) this process runs",
        ["component", "version", "python_version"],
        registry=registry,
    )


OPERATOR_BUILD_INFO = _build_info(OPERATOR_REGISTRY)
AGENT_BUILD_INFO = _build_info(AGENT_REGISTRY)


def build_info_labels(component: str) -> tuple[str, str, str]:
    return (component, __version__, platform.python_version())


#: Labels of every per-slice series the agent exports.
SLICE_LABELS = ("namespace", "slice", "package", "node", "gpu_uuid")
#: Labels of every per-GPU series the agent exports.
GPU_LABELS = ("node", "gpu_uuid", "model")


# --- operator ----------------------------------------------------------------------------------------
RECONCILE_DURATION = Histogram(
    "gpuslice_reconcile_duration_seconds",
    "Time one reconcile of a gpuslice object took, by kind (GpuPackage, GpuSlice)",
    ["kind"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    registry=OPERATOR_REGISTRY,
)
SLICES = Gauge(
    "gpuslice_slices",
    "GpuSlices by package and phase (Pending, Allocated, InUse, Released, Failed, Releasing)",
    ["package", "phase"],
    registry=OPERATOR_REGISTRY,
)
PACKAGE_CAPACITY_SLICES = Gauge(
    "gpuslice_package_capacity_slices",
    "Slices of a package the published GPUs can hold in total",
    ["package"],
    registry=OPERATOR_REGISTRY,
)
PACKAGE_FREE_SLICES = Gauge(
    "gpuslice_package_free_slices",
    "Slices of a package that could be allocated now",
    ["package"],
    registry=OPERATOR_REGISTRY,
)
SLICE_PENDING = Histogram(
    "gpuslice_slice_pending_seconds",
    "Time from a GpuSlice's creation until kube-scheduler allocated it",
    ["package"],
    # Slices wait for a GPU to free up, so the tail is minutes to hours, not milliseconds.
    buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 4 * 3600, 24 * 3600),
    registry=OPERATOR_REGISTRY,
)

TRANSITIONS = Counter(
    "gpuslice_slice_transitions_total",
    "GpuSlice phase transitions, by the phase entered and the reason",
    ["phase", "reason"],
    registry=OPERATOR_REGISTRY,
)
WRITES = Counter(
    "gpuslice_operator_writes_total",
    "API writes the operator made (applies, patches, status patches, deletes, Events), by kind and verb",
    ["kind", "verb"],
    registry=OPERATOR_REGISTRY,
)
STATUS_UPDATES = Counter(
    "gpuslice_operator_status_updates_total",
    "Status patches the operator wrote, by kind",
    ["kind"],
    registry=OPERATOR_REGISTRY,
)
#: Labels of the per-allocated-slice series (kube-state-metrics style: one series per held slice,
#: value 1, gone when the slice is released); a template slice has one per pod.
ALLOCATED_LABELS = ("namespace", "package", "slice", "pod", "node", "gpu_uuid")
SLICE_ALLOCATED = Gauge(
    "gpuslice_slice_allocated",
    "1 for every allocated slice (its claim allocated, not deallocated or deleted): "
    "sum_over_time of it is slice-time",
    ALLOCATED_LABELS,
    registry=OPERATOR_REGISTRY,
)
PACKAGE_PRICE = Gauge(
    "gpuslice_package_price_per_hour",
    "Price of one slice of a package per hour held (spec.price), in the currency of the label",
    ["package", "currency"],
    registry=OPERATOR_REGISTRY,
)
NAMESPACE_ENTITLED_SLICES = Gauge(
    "gpuslice_namespace_entitled_slices",
    "Slices of a package a tenant namespace is entitled to (its gpuslice ResourceQuota's hard)",
    ["namespace", "package"],
    registry=OPERATOR_REGISTRY,
)
NAMESPACE_HELD_SLICES = Gauge(
    "gpuslice_namespace_held_slices",
    "Slices of a package a tenant namespace holds, GpuSlices and resources.limits pods together "
    "(its gpuslice ResourceQuota's used)",
    ["namespace", "package"],
    registry=OPERATOR_REGISTRY,
)
LEDGER_WRITE_ERRORS = Counter(
    "gpuslice_ledger_write_errors_total",
    "GpuUsage writes that failed, by why: refused (the API server said no; retried) or full (the "
    "object would pass etcd's size; not written, logged as an error and an Event)",
    ["reason"],
    registry=OPERATOR_REGISTRY,
)
# Both reasons exported as 0 from the start: "no write failed" is a value, not an empty panel.
for _reason in ("refused", "full"):
    LEDGER_WRITE_ERRORS.labels(_reason)

# --- agent -------------------------------------------------------------------------------------------
PUBLISHED_DEVICES = Gauge(
    "gpuslice_agent_published_devices",
    "Partition devices in this node's ResourceSlices",
    ["node"],
    registry=AGENT_REGISTRY,
)
PUBLISHED_RESOURCESLICES = Gauge(
    "gpuslice_agent_published_resourceslices",
    "ResourceSlices of this node's pool",
    ["node"],
    registry=AGENT_REGISTRY,
)
POOL_GENERATION = Gauge(
    "gpuslice_agent_pool_generation",
    "Generation of this node's ResourceSlice pool",
    ["node"],
    registry=AGENT_REGISTRY,
)
PUBLISHES = Counter(
    "gpuslice_agent_publishes_total",
    "Republishes of this node's pool (its content changed)",
    ["node"],
    registry=AGENT_REGISTRY,
)
PREPARED_CLAIMS = Gauge(
    "gpuslice_agent_prepared_claims",
    "ResourceClaims prepared on this node",
    ["node"],
    registry=AGENT_REGISTRY,
)
PREPARE_ERRORS = Counter(
    "gpuslice_agent_prepare_errors_total",
    "Claims whose NodePrepareResources failed on this node",
    ["node"],
    registry=AGENT_REGISTRY,
)
TOOLKIT_UNSAFE = Gauge(
    "gpuslice_agent_toolkit_unsafe",
    "1 while the node's NVIDIA container toolkit config lets containers take GPUs outside CDI claims "
    "(the agent then publishes no devices), else 0",
    ["node"],
    registry=AGENT_REGISTRY,
)
SLICE_MEMORY_USED = Gauge(
    "gpuslice_slice_memory_used_bytes",
    "GPU memory a slice's processes hold, as counted by the shim",
    SLICE_LABELS,
    registry=AGENT_REGISTRY,
)
SLICE_MEMORY_LIMIT = Gauge(
    "gpuslice_slice_memory_limit_bytes",
    "GPU memory limit of a slice (what nvidia-smi shows as total inside the container)",
    SLICE_LABELS,
    registry=AGENT_REGISTRY,
)
SLICE_COMPUTE_UTILIZATION = Gauge(
    "gpuslice_slice_compute_utilization_ratio",
    "Share of the GPU's compute a slice used over the last sampling interval (0..1)",
    SLICE_LABELS,
    registry=AGENT_REGISTRY,
)
SLICE_REFUSED_ALLOCATIONS = Counter(
    "gpuslice_slice_refused_allocations_total",
    "Allocations the shim refused with CUDA_ERROR_OUT_OF_MEMORY because they would exceed the slice",
    SLICE_LABELS,
    registry=AGENT_REGISTRY,
)
SLICE_THROTTLED = Counter(
    "gpuslice_slice_throttled_seconds_total",
    "Time the shim held back a slice's kernel launches to keep it near its compute share",
    SLICE_LABELS,
    registry=AGENT_REGISTRY,
)
SLICE_VIOLATIONS = Counter(
    "gpuslice_slice_violations_total",
    "Out-of-band findings of the NVML cross-check on a slice's GPU, by kind",
    (*SLICE_LABELS, "kind"),
    registry=AGENT_REGISTRY,
)
GPU_MEMORY_ALLOCATED = Gauge(
    "gpuslice_gpu_memory_allocated_bytes",
    "GPU memory of a card handed out to prepared slices (occupancy, not use)",
    GPU_LABELS,
    registry=AGENT_REGISTRY,
)
GPU_MEMORY_TOTAL = Gauge(
    "gpuslice_gpu_memory_total_bytes",
    "GPU memory of a card as NVML reports it",
    GPU_LABELS,
    registry=AGENT_REGISTRY,
)

SLICE_SOFTWARE_INCOMPATIBLE = Gauge(
    "gpuslice_slice_software_incompatible",
    "1 while a slice's software cannot use its GPU, by reason (NoKernelImageForGpu, PtxTooNewForDriver, "
    "DriverTooOld); see the slice's SoftwareCompatible condition",
    (*SLICE_LABELS, "reason"),
    registry=AGENT_REGISTRY,
)
SLICE_GPU_IDLE = Gauge(
    "gpuslice_slice_gpu_idle",
    "1 while a slice has been held past the agent's --idle-after without any process using its GPU",
    SLICE_LABELS,
    registry=AGENT_REGISTRY,
)
GPU_HEALTHY = Gauge(
    "gpuslice_gpu_healthy",
    "1 while a card is healthy, 0 while its devices carry a gpuslice.io/gpu-unhealthy taint",
    ("node", "gpu_uuid", "gpu_index"),
    registry=AGENT_REGISTRY,
)
GPU_XIDS = Counter(
    "gpuslice_gpu_xid",
    "XID events NVML delivered for a card, by XID and class (fatal, pending, application, unclassified)",
    ("node", "gpu_uuid", "xid", "xid_class"),
    registry=AGENT_REGISTRY,
)
SOFTWARE_REASONS = ("NoKernelImageForGpu", "PtxTooNewForDriver", "DriverTooOld")
_SLICE_METRICS = (SLICE_MEMORY_USED, SLICE_MEMORY_LIMIT, SLICE_COMPUTE_UTILIZATION, SLICE_GPU_IDLE)
_SLICE_COUNTERS = (SLICE_REFUSED_ALLOCATIONS, SLICE_THROTTLED)


class CounterFromTotal:
    """Feeds a cumulative total read from elsewhere (the shim's usage region) into a Counter.

    The shim keeps running totals; a Counter can only be increased. Each reading adds the growth
    since the previous one. A total that went down means its source restarted (the slice's region
    was recreated), so the new total is all growth since then.
    """

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self._last: dict[tuple[str, ...], float] = {}

    def update(self, labels: tuple[str, ...], total: float) -> None:
        if total < 0:
            raise ValueError(f"running total {total} for {labels} is negative; the shim never reports one")
        last = self._last.get(labels, 0.0)
        growth = total - last if total >= last else total
        if growth:
            self.counter.labels(*labels).inc(growth)
        self._last[labels] = total

    def forget(self, labels: tuple[str, ...]) -> None:
        self._last.pop(labels, None)
        self.counter.remove(*labels)


def slice_labels(namespace: str, slice_name: str, package: str, node: str, gpu_uuid: str) -> tuple[str, ...]:
    """The label values of a slice's series, in SLICE_LABELS order."""
    return (namespace, slice_name, package, node, gpu_uuid)


def forget_slice(labels: tuple[str, ...], *totals: CounterFromTotal) -> None:
    """Drop every series of a slice that is gone, so dashboards do not show it as still holding memory."""
    for metric in (*_SLICE_METRICS, *_SLICE_COUNTERS):
        metric.remove(*labels)
    for kind in ViolationKind:
        SLICE_VIOLATIONS.remove(*labels, kind.value)
    for reason in SOFTWARE_REASONS:
        SLICE_SOFTWARE_INCOMPATIBLE.remove(*labels, reason)
    for tracker in totals:
        tracker.forget(labels)


def forget_package(package: str) -> None:
    """Drop the operator's series of a deleted GpuPackage."""
    for phase in Phase:
        SLICES.remove(package, phase.value)
    PACKAGE_CAPACITY_SLICES.remove(package)
    PACKAGE_FREE_SLICES.remove(package)
    SLICE_PENDING.remove(package)
