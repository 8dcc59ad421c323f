"""Status bookkeeping and the shape of the admission objects (their CEL runs on the real API server
in test_operator_cluster.py)."""

from __future__ import annotations

from gpuslice import constants as c
from gpuslice.api.package import Condition, GpuPackageSpec
from gpuslice.domain.admission import AdmissionConfig, admission_objects
from gpuslice.domain.capacity import Capacity
from gpuslice.domain.conditions import contains, same_status, stamp
from gpuslice.domain.package_status import (
    capacity_behind,
    capacity_write,
    deletion_condition,
    format_bytes,
    package_status,
)


def test_contains_allows_server_defaults_but_not_different_values() -> None:
    desired = {"spec": {"a": 1, "list": [{"x": 1}]}}
    assert contains({"spec": {"a": 1, "b": "default", "list": [{"x": 1, "y": 2}]}}, desired)
    assert not contains({"spec": {"a": 2, "list": [{"x": 1}]}}, desired)
    assert not contains({"spec": {"a": 1, "list": [{"x": 1}, {"x": 2}]}}, desired)
    assert not contains({"spec": {"list": [{"x": 1}]}}, desired)


def test_same_status_ignores_only_transition_times() -> None:
    a = {"phase": "Pending", "conditions": [{"type": "A", "status": "True", "lastTransitionTime": "t1"}]}
    b = {"phase": "Pending", "conditions": [{"type": "A", "status": "True", "lastTransitionTime": "t2"}]}
    assert same_status(a, b)
    assert not same_status(a, {**b, "phase": "InUse"})


def test_stamp_keeps_time_of_unchanged_conditions() -> None:
    old = [Condition(type="A", status="True", reason="r", lastTransitionTime="t0")]
    new = [Condition(type="A", status="True", reason="r2"), Condition(type="B", status="False", reason="r")]
    assert [x.last_transition_time for x in stamp(new, old, "t1")] == ["t0", "t1"]


def test_deletion_condition_names_the_slices_holding_it() -> None:
    cond = deletion_condition([f"ns/s{i}" for i in range(7)])
    assert cond.type == "Deleting" and cond.reason == "SlicesStillExist"
    assert "7 GpuSlice(s)" in cond.message and "ns/s0" in cond.message and "and 2 more" in cond.message


def test_package_is_ready_once_its_device_class_exists_and_reconciling_until_then() -> None:
    spec = GpuPackageSpec(gpuModel="Tesla V100-PCIE-32GB", fraction=25)
    none = Capacity(gpus=0, total=0, allocated=0, free=0, memory_per_slice_bytes=None)
    waiting = package_status("p", spec, 4, none, 0, device_class_present=False)
    assert {cd.type: (cd.status, cd.observed_generation) for cd in waiting.conditions} == {
        "Ready": ("False", 4),
        "Reconciling": ("True", 4),
    }
    ready = package_status("p", spec, 4, none, 0, device_class_present=True)
    assert {cd.type: cd.status for cd in ready.conditions} == {"Ready": "True"}
    assert ready.observed_generation == 4


def test_package_capacity_is_written_first_only_when_it_lags_the_live_count() -> None:
    live = Capacity(gpus=1, total=2, allocated=2, free=0, memory_per_slice_bytes=None)
    shown = {"gpus": 1, "slicesTotal": 2, "slicesAllocated": 0, "slicesFree": 2}
    now = {"gpus": 1, "slicesTotal": 2, "slicesAllocated": 2, "slicesFree": 0}
    assert capacity_behind(shown, None, live)
    # Written a moment ago; the watch has not shown it yet: no second write.
    assert not capacity_behind(shown, now, live)
    assert not capacity_behind(now, None, live)


def test_format_bytes_uses_the_largest_even_unit() -> None:
    assert [format_bytes(n) for n in (8 * c.GIB, 512 * c.MIB, 1000)] == ["8Gi", "512Mi", "1000"]


def test_every_policy_has_a_binding_with_the_right_action_and_scope() -> None:
    objs = admission_objects(
        AdmissionConfig(operator_identities=("system:serviceaccount:gs:op",), memory_floor="2Gi")
    )
    policies = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ValidatingAdmissionPolicy"}
    bindings = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ValidatingAdmissionPolicyBinding"}
    assert set(policies) == set(bindings)
    assert all(b["spec"]["policyName"] == n for n, b in bindings.items())
    assert bindings["gpuslice-pod-memory"]["spec"]["validationActions"] == ["Warn"]
    assert all(
        b["spec"]["validationActions"] == ["Deny"] for n, b in bindings.items() if n != "gpuslice-pod-memory"
    )
    tenant = {"matchExpressions": [{"key": c.LABEL_TENANT, "operator": "In", "values": ["true"]}]}
    for name in ("gpuslice-pods", "gpuslice-pod-memory", "gpuslice-vms"):
        assert bindings[name]["spec"]["matchResources"]["namespaceSelector"] == tenant
    assert bindings["gpuslice-protect"]["spec"]["matchResources"]["objectSelector"] == {
        "matchLabels": {c.LABEL_MANAGED_BY: c.MANAGED_BY_VALUE}
    }
    # The operator's identity and the configured floor reach the CEL.
    assert (
        '"system:serviceaccount:gs:op"'
        in policies["gpuslice-protect"]["spec"]["validations"][0]["expression"]
    )
    assert 'quantity("2Gi")' in policies["gpuslice-pod-memory"]["spec"]["validations"][0]["expression"]
    assert "below 2Gi" in policies["gpuslice-pod-memory"]["spec"]["validations"][0]["message"]
    # Admission messages cannot hold line breaks.
    assert not [v for p in policies.values() for v in p["spec"]["validations"] if "\n" in v["message"]]


def test_a_capacity_write_carries_the_memory_of_a_slice_once_cards_are_published() -> None:
    """The capacity is written apart from the package's other status (within seconds of a change):
    with it goes what one slice holds, known only from the published cards, so `kubectl get
    gpupackages` never shows cards without the size of their slices."""
    none = Capacity(gpus=0, total=0, allocated=0, free=0, memory_per_slice_bytes=None)
    assert capacity_write(none) == {
        "capacity": {
            "gpus": 0,
            "slicesTotal": 0,
            "slicesAllocated": 0,
            "slicesFree": 0,
            "unhealthyGpus": None,
        }
    }
    two = Capacity(gpus=2, total=8, allocated=1, free=7, memory_per_slice_bytes=8 << 30)
    patch = capacity_write(two)
    assert patch["memoryPerSlice"] == "8Gi"
    assert patch["capacity"]["slicesFree"] == 7
