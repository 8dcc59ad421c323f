"""The operator package itself, without a cluster: its indexes answer one question each, its
snapshot counts what kube-scheduler allocated, its timers run at the configured intervals, its event
handlers leave a refused write to a timer, and its command line says what is wrong."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import kopf
import pytest
import structlog
import structlog.testing
from kopf._cogs.aiokits.aioenums import FlagSetter
from kopf._cogs.structs.references import Resource

from gpuslice import cli
from gpuslice import constants as c
from gpuslice.domain.claim_retry import REFUSED_RETRY_MAX_SECONDS
from gpuslice.kubehttp import ApiError
from gpuslice.metrics import WRITES
from gpuslice.operator import indexes, nodes, packages, run, slices
from gpuslice.operator import state as state_module
from gpuslice.operator.config import OperatorConfig
from gpuslice.operator.indexes import Indexes
from gpuslice.operator.kube import Kube
from gpuslice.operator.retry import fast_path
from gpuslice.operator.state import OperatorState, one, values
from gpuslice.operator.workloads import Workloads
from support import allocated_claim, pod_doc, published, slice_doc

INDEX_FUNCTIONS = {name: fn for name, fn in vars(indexes).items() if name.startswith("gs_") and callable(fn)}
# the admission objects' indexes are one function registered once per kind
INDEX_FUNCTIONS |= {indexes.admission_index_id(kind): indexes.admission_view for kind in c.ADMISSION_PLURALS}


def _run(fn: Callable[..., Any]) -> Callable[..., Any]:
    """An index function called as Kopf calls it: awaited when it is a coroutine function."""
    if not inspect.iscoroutinefunction(fn):
        return fn

    def call(**kw: Any) -> Any:
        coro = fn(**kw)
        try:
            coro.send(None)  # they await nothing: one step runs them to the end
        except StopIteration as done:
            return done.value
        raise AssertionError(f"index function {fn.__name__} awaited something")

    return call


def test_index_functions_run_on_the_event_loop_not_in_a_thread_per_event() -> None:
    # Kopf runs a plain (sync) handler in its thread pool, one hop per watch event per index: a
    # quarter of the operator's CPU during a burst went there.
    assert INDEX_FUNCTIONS
    assert [n for n, fn in INDEX_FUNCTIONS.items() if not inspect.iscoroutinefunction(fn)] == []


def build(fn: Callable[..., Any], bodies: Iterable[dict[str, Any]]) -> dict[Any, list[Any]]:
    """What Kopf keeps for an index function: key -> the values of every object that yields it."""
    out: dict[Any, list[Any]] = defaultdict(list)
    for body in bodies:
        meta = body.get("metadata") or {}
        result = _run(fn)(
            name=meta.get("name", ""),
            namespace=meta.get("namespace"),
            spec=body.get("spec") or {},
            status=body.get("status") or {},
            meta=meta,
            labels=meta.get("labels") or {},
            body=body,
        )
        for key, value in (result or {}).items():
            out[key].append(value)
    return dict(out)


def idx_of(**bodies: list[dict[str, Any]]) -> Indexes:
    """Every index, built from the given objects (by resource: packages, slices, claims, pods, ...)."""
    kw, workloads = kw_of(**bodies)
    return Indexes(kw, workloads)


def kw_of(**bodies: list[dict[str, Any]]) -> tuple[dict[str, Any], Workloads]:
    """The index keyword arguments Kopf passes a handler, and the pod and ReplicaSet views."""
    sources = {
        "gs_packages": "packages",
        "gs_slices": "slices",
        "gs_package_slices": "slices",
        "gs_namespace_slices": "slices",
        "gs_claims": "claims",
        "gs_template_claims": "claims",
        "gs_pool_claims": "claims",
        "gs_claim_templates": "templates",
        "gs_quotas": "quotas",
        "gs_resource_slices": "resource_slices",
        "gs_device_taint_rules": "device_taint_rules",
        "gs_namespaces": "namespaces",
        "gs_device_classes": "device_classes",
        "gs_validatingadmissionpolicies": "policies",
        "gs_validatingadmissionpolicybindings": "bindings",
        "gs_mutatingadmissionpolicies": "mutating_policies",
        "gs_mutatingadmissionpolicybindings": "mutating_bindings",
    }
    assert set(sources) == set(INDEX_FUNCTIONS), "every index of the operator is built here"
    workloads = Workloads()
    for body in bodies.get("pods", []):
        workloads.pods.put(body)
    for body in bodies.get("workloads", []):
        workloads.replicasets.put(body)
    return {n: build(INDEX_FUNCTIONS[n], bodies.get(src, [])) for n, src in sources.items()}, workloads


def generated_claim(namespace: str, template_slice: str, pod: str, node: str, device: str) -> dict[str, Any]:
    claim = allocated_claim(namespace, f"{pod}-gpu-x1", node, device, reserved_for=(pod,))
    claim["metadata"]["labels"] = {c.LABEL_SLICE_TEMPLATE: template_slice}
    return claim


def test_each_index_has_one_key_shape() -> None:
    ns = "team-a"
    template_pod = pod_doc("w-1", ns, template="workers")
    template_pod["status"] = {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "w-1-gpu-x1"}]}
    idx = idx_of(
        slices=[slice_doc("llm", ns, "v100-8g"), slice_doc("workers", ns, "v100-8g", template=True)],
        claims=[
            allocated_claim(ns, "llm", "node-a", "gpu-0-v100-8g-0"),
            generated_claim(ns, "workers", "w-1", "node-b", "gpu-0-v100-8g-1"),
        ],
        pods=[pod_doc("p", ns, "llm"), template_pod],
    )
    assert set(idx.slices) == {(ns, "llm"), (ns, "workers")}
    assert sorted(values(idx.package_slices, "v100-8g")) == [(ns, "llm"), (ns, "workers")]
    assert sorted(values(idx.namespace_slices, ns)) == [(ns, "llm"), (ns, "workers")]
    assert set(idx.claims) == {(ns, "llm"), (ns, "w-1-gpu-x1")}
    assert values(idx.template_claims, (ns, "workers")) == [(ns, "w-1-gpu-x1")]
    assert {p: values(idx.pool_claims, p) for p in idx.pool_claims} == {
        "node-a": [(ns, "llm")],
        "node-b": [(ns, "w-1-gpu-x1")],
    }
    assert [p.name for p in values(idx.claim_pods, (ns, "llm"))] == ["p"]
    assert [p.name for p in values(idx.template_pods, (ns, "workers"))] == ["w-1"]
    # A pod of a template slice is not mistaken for a user of a claim named like its generated one.
    assert set(idx.claim_pods) == {(ns, "llm")}


def test_claims_of_other_drivers_are_not_indexed() -> None:
    other = allocated_claim("ns", "x", "node-a", "dev")
    other["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = "other.example.com"
    other["status"]["allocation"]["devices"]["results"][0]["driver"] = "other.example.com"
    idx = idx_of(claims=[other])
    assert not idx.claims and not idx.pool_claims


def _state(kube: Any = None, **config: Any) -> OperatorState:
    """An operator's state over `kube` (a stand-in for the API where a test needs one)."""
    return OperatorState(config=OperatorConfig(**config), kube=kube)


def _package(name: str = "p", **meta: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "uid": "pu", **meta}, "spec": {"gpuModel": "m", "fraction": 25}}


def _slice(name: str, package: str = "p") -> dict[str, Any]:
    meta = {"namespace": "ns", "name": name, "uid": f"u-{name}"}
    return {"metadata": meta, "spec": {"package": package}, "status": {}}


def _one_slice(**more: list[dict[str, Any]]) -> tuple[Indexes, indexes.SliceView]:
    """The indexes of package `p` and its slice ns/s (and `more` objects), and the slice's view."""
    idx = idx_of(packages=[_package()], slices=[_slice("s")], **more)
    entry = slices.one(idx.slices, ("ns", "s"))
    assert entry is not None
    return idx, entry


def test_snapshot_counts_allocated_devices_from_the_pool_index() -> None:
    node = "node-a"
    rs = published(node, 1, {"v100-8g": 25})
    devices = [d["name"] for s in rs for d in s["spec"].get("devices", [])]
    idx = idx_of(
        resource_slices=rs,
        claims=[allocated_claim("ns", f"s{i}", node, devices[i]) for i in range(3)],
    )
    snapshot = _state().published(idx.resource_slices, idx.pool_claims, idx.claims)
    capacity = snapshot.capacity("v100-8g")
    assert (capacity.total, capacity.allocated, capacity.free) == (4, 3, 1)
    assert snapshot.uuids[(node, devices[0])] == f"GPU-{node}-0"


def _timers(registry: kopf.OperatorRegistry) -> dict[str, tuple[float | None, Any]]:
    return {
        h.fn.__name__: (h.interval, h.initial_delay)  # type: ignore[attr-defined]
        for h in registry._spawning.get_all_handlers()
    }


def test_timers_run_at_the_configured_intervals() -> None:
    registry = kopf.OperatorRegistry()
    config = OperatorConfig(resync_seconds=12.0, recheck_seconds=3.0)
    slices.register(config, registry)
    packages.register(config, registry)
    timers = _timers(registry)
    assert timers["package_timer"][0] == 3.0


def test_the_defaults_are_what_the_operator_always_did() -> None:
    registry = kopf.OperatorRegistry()
    slices.register(OperatorConfig(), registry)
    packages.register(OperatorConfig(), registry)
    config = OperatorConfig()
    assert (config.resync_seconds, config.recheck_seconds, _timers(registry)["package_timer"][0]) == (
        30,
        5,
        5,
    )


def test_only_gpu_nodes_are_watched_and_only_when_a_gpu_label_is_set() -> None:
    # Every Node of the cluster came down Kopf's watch and into a handler, to be told it is no GPU
    # node: with 20,000 noise pods on 200 CPU nodes, idle RSS 17.7 % above a cluster without them.
    core_nodes = Resource("", "v1", "nodes", kind="Node", namespaced=False)
    settings = kopf.OperatorSettings()
    run.configure_kopf(settings, OperatorConfig())
    assert list(settings.watching.label_selectors.collect(core_nodes)) == [c.GPU_NODE_LABEL]
    registry = kopf.OperatorRegistry()
    nodes.register(OperatorConfig(), registry)
    assert [h.fn.__name__ for h in registry._watching.get_all_handlers()] == ["node_event"]

    settings, registry = kopf.OperatorSettings(), kopf.OperatorRegistry()
    run.configure_kopf(settings, OperatorConfig(gpu_node_label=""))
    nodes.register(OperatorConfig(gpu_node_label=""), registry)
    assert list(settings.watching.label_selectors.collect(core_nodes)) == []
    assert list(registry._watching.get_all_handlers()) == []


def test_slices_get_no_kopf_timer_of_their_own() -> None:
    # A Kopf timer per GpuSlice is an asyncio task per slice, Kopf's finalizer on every slice and
    # metadata patches (4 per slice in a 200-slice burst): the package timer rechecks them instead.
    registry = kopf.OperatorRegistry()
    slices.register(OperatorConfig(), registry)
    packages.register(OperatorConfig(), registry)
    assert set(_timers(registry)) == {"package_timer"}


def test_the_package_timer_rechecks_pending_slices_every_tick_and_all_at_the_resync_interval() -> None:
    state = _state(resync_seconds=30.0, recheck_seconds=5.0)
    pending = {"phase": "Pending", "reason": "AllGpusFull"}

    def doc(name: str, package: str, status: dict[str, str]) -> dict[str, Any]:
        meta = {"namespace": "ns", "name": name, "uid": name}
        return {"metadata": meta, "spec": {"package": package}, "status": status}

    idx = idx_of(slices=[doc("a", "p", pending), doc("b", "p", {"phase": "InUse"}), doc("c", "q", pending)])
    assert sorted(slices.due_for_recheck(state, "p", idx, now=100.0)) == [("ns", "a"), ("ns", "b")]
    assert sorted(slices.due_for_recheck(state, "p", idx, now=105.0)) == [("ns", "a")]
    assert sorted(slices.due_for_recheck(state, "p", idx, now=131.0)) == [("ns", "a"), ("ns", "b")]


def test_slices_waiting_for_quota_are_rechecked_on_quota_events_not_every_tick() -> None:
    # 6,000 QuotaExceeded slices of one tenant, all recomputed every 5 s: operator CPU 0 -> 51-72 %.
    state = _state(resync_seconds=30.0, recheck_seconds=5.0)

    def doc(name: str, status: dict[str, str], ns: str = "ns") -> dict[str, Any]:
        return {
            "metadata": {"namespace": ns, "name": name, "uid": name},
            "spec": {"package": "p"},
            "status": status,
        }

    quota = {"phase": "Pending", "reason": "QuotaExceeded"}
    idx = idx_of(
        slices=[
            doc("full", {"phase": "Pending", "reason": "AllGpusFull"}),
            doc("q1", quota),
            doc("q2", {"phase": "Pending", "reason": "NotEntitled"}),
            doc("q3", quota, ns="other"),
        ]
    )
    assert len(slices.due_for_recheck(state, "p", idx, now=100.0)) == 4  # the safety net takes all
    assert slices.due_for_recheck(state, "p", idx, now=105.0) == [("ns", "full")]
    slices.mark_quota_waiters(state, "ns", idx)  # the namespace's quota moved
    assert sorted(state.changes.take("p", lambda ref: "p")) == [("ns", "q1"), ("ns", "q2")]


async def test_an_event_handlers_refused_write_is_logged_and_left_to_the_timer() -> None:
    async def refused() -> None:
        raise kopf.TemporaryError("DeviceClass of p: denied", delay=5)

    with structlog.testing.capture_logs() as logs:
        await fast_path(refused(), "package_timer")  # does not raise: Kopf would only log it
    assert [(e["log_level"], e["retried_by"], e["error"]) for e in logs] == [
        ("warning", "package_timer", "DeviceClass of p: denied")
    ]


async def test_other_errors_of_an_event_handler_are_not_hidden() -> None:
    async def broken() -> None:
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError):
        await fast_path(broken(), "package_timer")


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--resync-seconds=0", "--resync-seconds: Input should be greater than 0"),
        ("--recheck-seconds=-1", "--recheck-seconds: Input should be greater than 0"),
        ("--memory-floor=lots", "--memory-floor 'lots' is not a quantity"),
    ],
)
def test_bad_settings_are_refused_with_the_flag_named(
    flag: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    saved, root = structlog.get_config(), logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        assert cli.main(["operator", flag]) == 2
    finally:
        # The command configures logging onto pytest's captured stderr, which closes after the test.
        structlog.configure(**saved)
        root.handlers[:] = handlers
        root.setLevel(level)
    assert message in capsys.readouterr().err


def test_one_and_values_read_an_index() -> None:
    idx = idx_of(slices=[slice_doc("a", "ns", "p")])
    entry = one(idx.slices, ("ns", "a"))
    assert entry is not None and entry.package == "p" and entry.ref == ("ns", "a")
    assert one(idx.slices, ("ns", "missing")) is None
    assert values(idx.package_slices, "none") == []


def test_a_standby_takes_over_within_the_peering_lifetime_of_seconds_not_a_minute() -> None:
    from gpuslice.cli import build_parser
    from gpuslice.operator.run import configure_kopf

    args = build_parser(["operator"]).parse_args(["operator", "--peering"])
    assert args.peering_lifetime == 10
    settings = kopf.OperatorSettings()
    configure_kopf(settings, OperatorConfig(peering_lifetime=args.peering_lifetime))
    assert settings.peering.lifetime == 10  # Kopf's default is 60: a killed replica blocked a minute
    custom = kopf.OperatorSettings()
    configure_kopf(custom, OperatorConfig(peering_lifetime=25))
    assert custom.peering.lifetime == 25


def test_a_new_allocation_does_not_rebuild_the_snapshot_for_every_slice() -> None:
    # In a burst every refresh of a just-allocated slice rebuilt the whole snapshot (all pools, all
    # claims): work per slice grew with the cluster. Its GPU's UUID is all a new allocation needs.
    node = "node-a"
    rs = published(node, 2, {"v100-8g": 25})
    devices = [d["name"] for s in rs for d in s["spec"].get("devices", [])]
    claims = [allocated_claim("ns", f"s{i}", node, devices[i]) for i in range(2)]
    state = _state(capacity_cache_seconds=60.0)
    first = state.published(
        *_snapshot_inputs(idx_of(resource_slices=rs, claims=claims[:1])), [(node, devices[0])]
    )
    idx = idx_of(resource_slices=rs, claims=claims)
    again = state.published(*_snapshot_inputs(idx), [(node, devices[1])])
    assert again is first and again.uuids[(node, devices[1])] == f"GPU-{node}-0"
    # A device no snapshot knows (a pool published since) still rebuilds it.
    fresh = published("node-b", 1, {"v100-8g": 25})
    idx = idx_of(resource_slices=rs + fresh, claims=claims)
    other = state.published(*_snapshot_inputs(idx), [("node-b", fresh[-1]["spec"]["devices"][0]["name"])])
    assert other is not first


def _snapshot_inputs(idx: Indexes) -> tuple[Any, Any, Any]:
    return idx.resource_slices, idx.pool_claims, idx.claims


def _slices_clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The operator's monotonic clock as a list of one value the test moves on."""
    clock = [1000.0]
    monkeypatch.setattr(slices.time, "monotonic", lambda: clock[0])
    return clock


class _RecordingKube:
    def __init__(self) -> None:
        self.applied: list[str] = []

    async def apply(self, body: dict[str, Any], **_: Any) -> dict[str, Any]:
        self.applied.append(body["metadata"]["name"])
        return body


async def test_a_claim_is_applied_once_while_its_watch_event_lags_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # At 2,000 slices the claims' watch lagged past a 10 s grace and every refresh applied again
    # (6,771 applies for 2,000 claims). Applied once; again only once the index showed it and lost it.
    clock = _slices_clock(monkeypatch)
    kube = _RecordingKube()
    state = _state(kube)
    without, entry = _one_slice()
    for _ in range(5):  # 100 s without a watch event of the claim
        await slices.ensure_claim(state, entry, without)
        clock[0] += 20
    assert kube.applied == ["s"]
    claim = {
        "metadata": {"namespace": "ns", "name": "s", "labels": {}},
        "spec": allocated_claim("ns", "s", "n", "d")["spec"],
    }
    shown, _ = _one_slice(claims=[claim])
    await slices.ensure_claim(state, entry, shown)
    await slices.ensure_claim(state, entry, without)  # deleted by someone: put back
    assert kube.applied == ["s", "s"]


class _StatusKube(_RecordingKube):
    def __init__(self) -> None:
        super().__init__()
        self.statuses: list[dict[str, Any]] = []  # GpuSlice status patches
        self.package_statuses: list[dict[str, Any]] = []  # GpuPackage status.capacity written first

    async def apply(self, body: dict[str, Any], **_: Any) -> dict[str, Any]:
        await super().apply(body)
        return {**body, "metadata": {**body["metadata"], "uid": "cu"}}

    async def patch_status(self, _api_version: str, kind: str, *args: Any) -> None:
        (self.statuses if kind == c.SLICE_KIND else self.package_statuses).append(args[-1])


def _kopf_event_reasons(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The reasons of the Events the operator records through Kopf, in order."""
    events: list[str] = []
    monkeypatch.setattr(slices.kopf, "event", lambda *_, reason, **__: events.append(reason))
    return events


async def test_the_refresh_that_creates_a_claim_writes_the_state_after_it_not_creating_claim(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # CreatingClaim lasted until the claim's watch event came back: one more status patch per slice
    # (a quarter of them in a burst). The apply's answer is the claim.
    events = _kopf_event_reasons(monkeypatch)
    kube = _StatusKube()
    state = _state(kube)
    await slices.refresh(state, "ns", "s", _one_slice()[0])
    assert kube.applied == ["s"]
    assert [(x["phase"], x["reason"]) for x in kube.statuses] == [("Pending", "WaitingForPod")]
    assert events == ["WaitingForPod"]


async def test_a_refresh_before_the_claims_watch_event_does_not_go_back_to_creating_claim(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events = _kopf_event_reasons(monkeypatch)
    kube = _StatusKube()
    state = _state(kube)
    idx, _ = _one_slice()
    await slices.refresh(state, "ns", "s", idx)
    await slices.refresh(state, "ns", "s", idx)  # another event of the slice; the claim's not seen yet
    assert [(x["phase"], x["reason"]) for x in kube.statuses] == [("Pending", "WaitingForPod")]
    # WaitingForPod is not decided on capacity: the package's capacity is left to its timer (writing it
    # before every slice's status was 7.5 package writes per slice in a burst).
    assert kube.package_statuses == []
    assert events == ["WaitingForPod"] and kube.applied == ["s"]


class _RefusingApi:
    """An API server that refuses every write, as an overloaded one answers (timeouts, 429, 500)."""

    def __init__(self) -> None:
        self.requests = 0

    async def _refuse(self, *_: Any, **__: Any) -> Any:
        self.requests += 1
        raise ApiError(500, "Internal Server Error", '{"message": "etcdserver: request timed out"}')

    apply = merge_patch = json_patch = delete = _refuse


def _written(kind: str, verb: str) -> float:
    return WRITES.labels(kind, verb)._value.get()  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("call", "kind", "verb"),
    [
        (
            lambda k: k.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "x"}}),
            "Node",
            "apply",
        ),
        (lambda k: k.patch_status("v1", "Node", "x", None, {}), "Node", "patch-status"),
        (lambda k: k.json_patch("v1", "Node", "x", []), "Node", "patch"),
        (lambda k: k.delete("v1", "Node", "x"), "Node", "delete"),
    ],
)
async def test_the_writes_metric_counts_a_refused_write(
    call: Callable[[Kube], Any], kind: str, verb: str
) -> None:
    # At 5,000 slices the API server counted 35,530 claim applies and the metric 4,725: only the
    # accepted ones were counted, so the metric hid the retries an overloaded API server paid for.
    api = _RefusingApi()
    before = _written(kind, verb)
    with pytest.raises(ApiError):
        await call(Kube(api))  # type: ignore[arg-type]
    assert api.requests == 1
    assert _written(kind, verb) - before == 1


async def test_a_refused_claim_is_retried_with_a_growing_delay_not_on_every_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every pod or quota event refreshes the slice; each refresh re-applied a refused claim at once,
    # a write per event into an API server that was refusing because it was overloaded.
    clock = _slices_clock(monkeypatch)
    api = _RefusingApi()
    state = _state(Kube(api))  # type: ignore[arg-type]
    idx, entry = _one_slice()
    for _ in range(600):  # an event every 0.1 s for a minute
        await slices.ensure_claim(state, entry, idx)
        clock[0] += 0.1
    assert 3 <= api.requests <= 10, api.requests
    assert state.create_errors[("ns", "s")] == "etcdserver: request timed out"
    # Once the API server answers again, the next retry after the delay creates it.
    created: list[str] = []

    async def accept(url: str, body: Any, *_: Any, **__: Any) -> Any:
        created.append(body["metadata"]["name"])
        return body

    api.apply = accept  # type: ignore[method-assign]
    clock[0] += REFUSED_RETRY_MAX_SECONDS
    await slices.ensure_claim(state, entry, idx)
    assert created == ["s"]
    assert ("ns", "s") not in state.create_errors


def _quota(used: int, hard: int = 1, requests_used: int | None = None) -> dict[str, Any]:
    """The gpuslice quota of ns for package p, as kube-controller-manager last counted it; the
    `requests.<resource>` key counts `requests_used` (default: as many as the devices key)."""
    key, requests = c.quota_key("p"), c.QUOTA_REQUESTS_PREFIX + c.extended_resource_name("p")
    hard_keys = {key: str(hard), requests: str(hard)}
    used_keys = {key: str(used), requests: str(used if requests_used is None else requests_used)}
    return {
        "metadata": {"namespace": "ns", "name": c.QUOTA_NAME},
        "spec": {"hard": hard_keys},
        "status": {"hard": hard_keys, "used": used_keys},
    }


class _QuotaRefusingKube(_RecordingKube):
    """The API server's quota admission, which refuses the first `refusals` creates."""

    def __init__(self, refusals: int) -> None:
        super().__init__()
        self.refusals = refusals

    async def apply(self, body: dict[str, Any], **kw: Any) -> dict[str, Any]:
        if self.refusals:
            self.refusals -= 1
            self.applied.append("refused")
            name = body["metadata"]["name"]
            message = f'resourceclaims.resource.k8s.io "{name}" is forbidden: exceeded quota: gpuslice'
            raise ApiError(403, "Forbidden", json.dumps({"message": message}))
        return await super().apply(body, **kw)


async def test_a_slice_refused_for_quota_the_quota_already_shows_free_is_tried_again_by_itself() -> None:
    # The old slice's claim went and kube-controller-manager's recount (the quota event that marks
    # waiting slices) reached the operator before the API server's refusal of the new slice's claim:
    # no event came again, and the freed slot stayed unused until the resync (up to 30 s).
    kube = _QuotaRefusingKube(refusals=1)
    state = _state(kube)
    idx, entry = _one_slice(quotas=[_quota(used=0)])
    await slices.ensure_claim(state, entry, idx)
    assert kube.applied == ["refused"]
    assert state.changes.take("p", lambda ref: "p") == []
    await asyncio.sleep(0.6)  # the first retry's delay, half a second
    assert state.changes.take("p", lambda ref: "p") == [("ns", "s")]
    await slices.ensure_claim(state, entry, idx)  # what the package's daemon does with the mark
    assert kube.applied == ["refused", "s"]
    assert ("ns", "s") not in state.create_errors


@pytest.mark.parametrize(
    "full_quota",
    [_quota(used=1), _quota(used=0, requests_used=1)],
    ids=["devices", "requests-of-the-product"],  # pods asking for it in resources.limits use it up first
)
async def test_a_slice_refused_for_quota_without_room_waits_for_the_quota_event_then_goes_at_once(
    monkeypatch: pytest.MonkeyPatch, full_quota: dict[str, Any]
) -> None:
    clock = _slices_clock(monkeypatch)
    kube = _QuotaRefusingKube(refusals=1)
    state = _state(kube)
    full, entry = _one_slice(quotas=[full_quota])
    for _ in range(50):  # other events of the slice meanwhile: no create while the quota is used up
        await slices.ensure_claim(state, entry, full)
        clock[0] += 0.1
    assert kube.applied == ["refused"]
    await asyncio.sleep(0)
    assert state.changes.take("p", lambda ref: "p") == []  # no timer: thousands may wait like this
    freed, _ = _one_slice(quotas=[_quota(used=0)])  # the quota event after the old claim went
    await slices.ensure_claim(state, entry, freed)
    assert kube.applied == ["refused", "s"]


async def test_a_create_without_an_answer_in_time_is_retried_with_a_delay_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # At 5,000 slices 1,281 claim applies timed out in the client: the error escaped the refresh
    # (a traceback per slice event), nothing remembered it, and the next events applied again.
    clock = _slices_clock(monkeypatch)
    api = _RefusingApi()

    async def no_answer(*_: Any, **__: Any) -> Any:
        api.requests += 1
        raise TimeoutError

    api.apply = no_answer  # type: ignore[method-assign]
    state = _state(Kube(api))  # type: ignore[arg-type]
    idx, entry = _one_slice()
    for _ in range(100):  # an event every 0.1 s for 10 s
        assert await slices.ensure_claim(state, entry, idx) is None
        clock[0] += 0.1
    assert 2 <= api.requests <= 5, api.requests
    assert "no answer from the API server" in state.create_errors[("ns", "s")]


async def test_the_operator_has_a_bounded_number_of_writes_in_flight() -> None:
    # A recheck tick refreshes every Pending slice at once: 5,000 writes queued in the API server.
    in_flight, most = 0, 0

    class SlowApi:
        async def merge_patch(self, *_: Any, **__: Any) -> Any:
            nonlocal in_flight, most
            in_flight += 1
            most = max(most, in_flight)
            await asyncio.sleep(0.01)
            in_flight -= 1

    kube = Kube(SlowApi(), max_in_flight=8)  # type: ignore[arg-type]
    await asyncio.gather(*(kube.patch_status("v1", "Node", f"n{i}", None, {}) for i in range(200)))
    assert most == 8


class _StuckKube(_StatusKube):
    """An API server that never answers a status patch (an overloaded one, until the timeout)."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight = self.most = 0

    async def patch_status(self, *_: Any) -> None:
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            await asyncio.Event().wait()
        finally:
            self.in_flight -= 1


async def test_an_event_of_a_slice_marks_it_for_its_package_and_does_not_wait_for_its_write() -> None:
    # At 5,000 slices every event handler refreshed its slice itself, waiting for the write: Kopf
    # indexes an object's next event only after its handler returns, so the claims index lagged
    # minutes behind and claims were applied again (30,765 applies for 5,000 claims).
    kube = _StuckKube()
    state = _state(kube)
    kw, workloads = kw_of(packages=[_package()], slices=[_slice("s")])
    state.workloads = workloads
    await asyncio.wait_for(
        slices.slice_event(namespace="ns", name="s", type="ADDED", memo=kopf.Memo(state=state), **kw), 1
    )
    claim = {"metadata": {"namespace": "ns", "name": "s", "labels": {c.LABEL_SLICE: "s"}}}
    await asyncio.wait_for(
        slices.claim_event(
            namespace="ns",
            labels=claim["metadata"]["labels"],
            meta=claim["metadata"],
            memo=kopf.Memo(state=state),
            **kw,
        ),
        1,
    )
    assert kube.applied == [] and kube.in_flight == 0
    assert state.changes.take("p", lambda ref: "p") == [("ns", "s")]


async def test_a_claim_being_deleted_marks_the_slices_waiting_for_quota_in_its_namespace() -> None:
    # What they say names the claim they wait for, and no quota figure changes until it is gone.
    state = _state(_StuckKube())
    waiting = {**_slice("w"), "status": {"phase": "Pending", "reason": "QuotaExceeded"}}
    kw, workloads = kw_of(packages=[_package()], slices=[waiting])
    state.workloads = workloads
    meta: dict[str, Any] = {"namespace": "ns", "name": "old", "labels": {c.LABEL_SLICE: "old"}}
    for deleting, marked in ((False, []), (True, [("ns", "w")])):
        if deleting:
            meta["deletionTimestamp"] = "2026-12-05T00:00:00Z"
        await slices.claim_event(
            namespace="ns", labels=meta["labels"], meta=meta, memo=kopf.Memo(state=state), **kw
        )
        assert state.changes.take("p", lambda ref: "p") == marked


async def test_a_slice_of_a_package_without_a_daemon_is_refreshed_by_its_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No daemon takes what is marked for a missing package (or one being deleted: Kopf stops its
    # daemons); its slices still get a status from their own events.
    monkeypatch.setattr(slices.kopf, "event", lambda *_, **__: None)
    kube = _StatusKube()
    state = _state(kube)
    deleting = _package("gone", deletionTimestamp="2026-12-03T00:00:00Z")
    kw, workloads = kw_of(packages=[deleting], slices=[_slice("a", "missing"), _slice("b", "gone")])
    state.workloads = workloads
    memo = kopf.Memo(state=state)
    await slices.slice_event(namespace="ns", name="a", type="ADDED", memo=memo, **kw)
    await slices.slice_event(namespace="ns", name="b", type="ADDED", memo=memo, **kw)
    assert [x["phase"] for x in kube.statuses] == ["Failed", "Failed"]
    assert state.changes.unrouted == set() and state.changes.routed == {}


async def test_a_burst_of_marked_slices_is_refreshed_a_bounded_number_at_a_time() -> None:
    # 5,000 refreshes at once each held its facts and status while its write waited for a slot.
    kube = _StuckKube()
    state = _state(kube)
    many = [_slice(f"s{i}") for i in range(300)]
    kw, workloads = kw_of(packages=[_package()], slices=many)
    state.workloads = workloads
    state.changes.mark((("ns", f"s{i}") for i in range(300)), "p")
    stopped = FlagSetter[Any]().async_waiter  # what Kopf passes a daemon as `stopped`
    daemon = asyncio.create_task(
        slices.refresh_changed(name="p", stopped=stopped, memo=kopf.Memo(state=state), **kw)
    )
    for _ in range(100):
        await asyncio.sleep(0.01)
    assert kube.most == state_module.REFRESHES_IN_FLIGHT < 300
    assert len(kube.applied) == kube.most  # the others wait for a slot, holding nothing yet
    daemon.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await daemon


def test_a_drained_card_is_not_sold_and_its_slices_say_draining() -> None:
    node = "node-a"
    rs = published(node, 2, {"v100-8g": 25})
    card0 = [d["name"] for s in rs for d in s["spec"].get("devices", []) if d["name"].startswith("gpu-0-")]
    rules = [
        {"metadata": {"name": f"drain-{d}"},
         "spec": {"deviceSelector": {"driver": "gpuslice.io", "pool": node, "device": d},
                  "taint": {"key": "gpuslice.io/drain", "value": "maintenance", "effect": "NoSchedule"}}}
        for d in card0
    ]  # fmt: skip
    other_driver = {"metadata": {"name": "other"}, "spec": {"deviceSelector": {"driver": "example.com"},
                    "taint": {"key": "x", "effect": "NoExecute"}}}  # fmt: skip
    idx = idx_of(resource_slices=rs, device_taint_rules=[*rules, other_driver])
    snap = _state().published(*_snapshot_inputs(idx), rules=idx.device_taint_rules)
    cap = snap.capacity("v100-8g")
    assert (cap.gpus, cap.total, cap.free, cap.unhealthy_gpus) == (1, 4, 4, 1)
    assert snap.taints[(node, card0[0])] == ({"key": "gpuslice.io/drain", "value": "maintenance",
                                              "effect": "NoSchedule"},)  # fmt: skip
    node_rule = {"metadata": {"name": "node"}, "spec": {"deviceSelector": {"pool": node},
                 "taint": {"key": "gpuslice.io/drain", "effect": "NoExecute"}}}  # fmt: skip
    whole = idx_of(resource_slices=rs, device_taint_rules=[node_rule])
    cap = _state().published(*_snapshot_inputs(whole), rules=whole.device_taint_rules).capacity("v100-8g")
    assert (cap.gpus, cap.free, cap.unhealthy_gpus) == (0, 0, 2), "a rule without a device drains the pool"
