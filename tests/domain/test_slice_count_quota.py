"""The GpuSlice-count quota of a tenant namespace, and when to ask kube-controller-manager to count it."""

from __future__ import annotations

import math

from gpuslice import constants as c
from gpuslice.domain.tenancy import (
    ObservedTenant,
    count_quota_action,
    count_quota_nudges,
    count_quota_steps,
    slice_count_unknown,
    tenant_state,
)
from support import package_spec

KEY = "count/gpuslices.gpuslice.io"
PACKAGES = {
    "p": package_spec(25, entitlements=[{"namespaceSelector": {"matchLabels": {"t": "a"}}, "slices": 2}])
}
MANAGED = {c.LABEL_MANAGED_BY: c.MANAGED_BY_VALUE}


def test_a_tenant_gets_a_count_quota_of_its_own_at_the_configured_limit() -> None:
    state = tenant_state("ns", {"t": "a"}, PACKAGES, max_slices=7)
    quota = state.count_quota()
    assert quota is not None
    assert quota["metadata"]["name"] == "gpuslice-objects" and quota["metadata"]["namespace"] == "ns"
    assert quota["metadata"]["labels"] == MANAGED
    assert quota["spec"]["hard"] == {KEY: "7"}
    # The entitlement quota does not hold the count: a count unknown there would hold up pods too.
    assert KEY not in (state.quota() or {})["spec"]["hard"]
    default = tenant_state("ns", {"t": "a"}, PACKAGES).count_quota()
    assert default is not None and default["spec"]["hard"] == {KEY: "100"}
    assert tenant_state("ns", {"t": "b"}, PACKAGES, max_slices=7).count_quota() is None


def test_count_quota_is_written_when_missing_different_or_unlabelled_and_deleted_off_tenancy() -> None:
    desired = tenant_state("ns", {"t": "a"}, PACKAGES, max_slices=7)
    assert count_quota_action(desired, ObservedTenant(labeled=True, quota_hard=None)) == "apply"
    seen = ObservedTenant(labeled=True, quota_hard=None, count_hard={KEY: "7"}, count_labels=MANAGED)
    assert count_quota_action(desired, seen) == ""
    changed = ObservedTenant(labeled=True, quota_hard=None, count_hard={KEY: "6"}, count_labels=MANAGED)
    assert count_quota_action(desired, changed) == "apply"
    unlabelled = ObservedTenant(labeled=True, quota_hard=None, count_hard={KEY: "7"}, count_labels={})
    assert count_quota_action(desired, unlabelled) == "apply"
    # As the API server writes a quantity back (1000 -> 1k): no write.
    big = tenant_state("ns", {"t": "a"}, PACKAGES, max_slices=1000)
    canonical = ObservedTenant(labeled=True, quota_hard=None, count_hard={KEY: "1k"}, count_labels=MANAGED)
    assert count_quota_action(big, canonical) == ""
    gone = tenant_state("ns", {"t": "b"}, PACKAGES)
    assert count_quota_action(gone, seen) == "delete"
    assert count_quota_action(gone, ObservedTenant(labeled=False, quota_hard=None)) == ""


def test_count_is_unknown_only_when_the_controller_took_the_limit_on_without_counting() -> None:
    assert slice_count_unknown({KEY: "100"}, {})  # synced before GpuSlices were discovered
    assert not slice_count_unknown({KEY: "100"}, {KEY: "0"})  # counted
    assert not slice_count_unknown({}, {})  # not synced yet: the controller does that first
    assert not slice_count_unknown({"pods": "1"}, {})  # another quota's business


def test_until_the_count_is_known_anywhere_one_namespace_a_round_is_asked_to_recount() -> None:
    never = -math.inf
    unknown = {"b": never, "a": never, "c": never}
    assert count_quota_nudges(unknown, counted_elsewhere=False, now=100.0, interval=10.0) == ["a"]
    # The one asked longest ago goes next; none is asked twice within the interval.
    asked = {"a": 100.0, "b": 95.0, "c": 92.0}
    assert count_quota_nudges(asked, counted_elsewhere=False, now=105.0, interval=10.0) == ["c"]
    assert count_quota_nudges(asked, counted_elsewhere=False, now=101.0, interval=10.0) == []


def test_once_the_count_is_known_somewhere_every_unknown_namespace_is_asked_at_once() -> None:
    asked = {"a": 100.0, "b": -math.inf, "c": 92.0}
    assert count_quota_nudges(asked, counted_elsewhere=True, now=105.0, interval=10.0) == ["b", "c"]
    assert count_quota_nudges(asked, counted_elsewhere=True, now=110.0, interval=10.0) == ["b", "c", "a"]
    assert count_quota_nudges({}, counted_elsewhere=True, now=110.0, interval=10.0) == []


def test_a_recount_changes_the_limit_and_never_allows_more_than_it() -> None:
    for limit in (1, 2, 100):
        steps = list(count_quota_steps(limit))
        assert steps[-1] == limit  # it ends at the limit
        assert len(set(steps)) > 1  # spec.hard changes: kube-controller-manager re-counts
        assert all(0 <= s <= limit for s in steps)
