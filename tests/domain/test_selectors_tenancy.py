"""Entitlements -> tenant namespaces and their one gpuslice quota."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpuslice import constants as c
from gpuslice.api.package import LabelSelector
from gpuslice.domain.isolation import pod_security_labels
from gpuslice.domain.selectors import matches
from gpuslice.domain.tenancy import ObservedTenant, changes, counting_packages, entitled_slices, tenant_state
from support import package_spec

label_keys = st.sampled_from(["team", "tier", "env", "tenant.example.com/project"])
label_values = st.sampled_from(["a", "b", "gold", "prod"])
labels = st.dictionaries(label_keys, label_values, max_size=4)


def sel(**kw: object) -> LabelSelector:
    return LabelSelector.model_validate(kw)


def test_match_labels_and_expressions_follow_kubernetes_semantics() -> None:
    ns = {"team": "a", "tier": "gold"}
    assert matches(sel(matchLabels={"team": "a"}), ns)
    assert not matches(sel(matchLabels={"team": "b"}), ns)
    assert matches(sel(matchExpressions=[{"key": "tier", "operator": "In", "values": ["gold", "x"]}]), ns)
    assert not matches(sel(matchExpressions=[{"key": "env", "operator": "In", "values": ["prod"]}]), ns)
    assert matches(sel(matchExpressions=[{"key": "env", "operator": "NotIn", "values": ["prod"]}]), ns)
    assert not matches(sel(matchExpressions=[{"key": "tier", "operator": "NotIn", "values": ["gold"]}]), ns)
    assert matches(sel(matchExpressions=[{"key": "team", "operator": "Exists"}]), ns)
    assert not matches(sel(matchExpressions=[{"key": "team", "operator": "DoesNotExist"}]), ns)


@given(labels, labels)
def test_selector_built_from_a_subset_of_labels_matches_exactly_the_supersets(
    ns: dict[str, str], want: dict[str, str]
) -> None:
    assert matches(sel(matchLabels=want), ns) == all(ns.get(k) == v for k, v in want.items())


def test_overlapping_entitlements_take_the_largest_not_the_sum() -> None:
    spec = package_spec(
        25,
        entitlements=[
            {"namespaceSelector": {"matchLabels": {"team": "a"}}, "slices": 2},
            {"namespaceSelector": {"matchLabels": {"tier": "gold"}}, "slices": 5},
        ],
    )
    assert entitled_slices(spec, {"team": "a", "tier": "gold"}) == 5
    assert entitled_slices(spec, {"team": "a"}) == 2
    assert entitled_slices(spec, {"team": "b"}) is None


def test_tenant_quota_lists_every_package_with_zero_where_not_entitled() -> None:
    packages = {
        "v100-8g": package_spec(
            25, entitlements=[{"namespaceSelector": {"matchLabels": {"team": "a"}}, "slices": 2}]
        ),
        "v100-32g": package_spec(100),
    }
    state = tenant_state("team-a", {"team": "a"}, packages)
    quota = state.quota()
    assert state.tenant and quota is not None
    assert quota["metadata"] == {
        "name": c.QUOTA_NAME,
        "namespace": "team-a",
        "labels": {c.LABEL_MANAGED_BY: c.MANAGED_BY_VALUE},
    }
    # the product's extended resource too: a pod asking for it in resources.limits is charged
    # requests.gpuslice.io/<package> when it is created, a GpuSlice's claim when it is
    assert quota["spec"]["hard"] == {
        "v100-8g.gpuslice.io.deviceclass.resource.k8s.io/devices": "2",
        "v100-32g.gpuslice.io.deviceclass.resource.k8s.io/devices": "0",
        "requests.gpuslice.io/v100-8g": "2",
        "requests.gpuslice.io/v100-32g": "0",
    }
    off = {**packages, "v100-32g": package_spec(100, extendedResourceName="")}
    assert (
        "requests.gpuslice.io/v100-32g"
        not in (tenant_state("team-a", {"team": "a"}, off).quota() or {})["spec"]["hard"]
    )
    assert state.namespace_patch()["metadata"]["labels"] == {
        c.LABEL_TENANT: "true",
        **pod_security_labels({}, "baseline"),
    }


def test_namespace_without_entitlement_gets_no_quota_and_loses_the_label() -> None:
    packages = {
        "v100-8g": package_spec(
            25, entitlements=[{"namespaceSelector": {"matchLabels": {"team": "a"}}, "slices": 2}]
        )
    }
    state = tenant_state("other", {"team": "b"}, packages)
    assert not state.tenant and state.quota() is None
    assert "labels" not in state.namespace_patch()["metadata"]
    # It used to be a tenant: the label goes and the quota is deleted.
    assert changes(state, ObservedTenant(labeled=True, quota_hard={"x": "1"})) == (True, "delete")


@given(labels, st.lists(st.tuples(labels, st.integers(0, 9)), max_size=3))
def test_converged_namespace_needs_no_write(
    ns_labels: dict[str, str], ents: list[tuple[dict[str, str], int]]
) -> None:
    packages = {
        f"p{i}": package_spec(25, entitlements=[{"namespaceSelector": {"matchLabels": sl}, "slices": n}])
        for i, (sl, n) in enumerate(ents)
        if sl
    }
    desired = tenant_state("ns", ns_labels, packages)
    quota = desired.quota()
    observed = ObservedTenant(
        labeled=desired.tenant,
        quota_hard=dict(quota["spec"]["hard"]) if quota else None,
        quota_labels=dict(quota["metadata"]["labels"]) if quota else None,
        labels={**ns_labels, **desired.labels},
    )
    assert changes(desired, observed) == (False, "")
    # ...and one that lost its quota (deleted by hand) gets it back.
    if desired.tenant:
        lost = ObservedTenant(labeled=True, quota_hard=None, labels=observed.labels)
        assert changes(desired, lost) == (False, "apply")


def test_quota_as_the_api_server_writes_it_back_needs_no_write() -> None:
    packages = {
        "p": package_spec(
            25, entitlements=[{"namespaceSelector": {"matchLabels": {"t": "a"}}, "slices": 1000}]
        )
    }
    desired = tenant_state("ns", {"t": "a"}, packages)
    canonical = {c.quota_key("p"): "1k", "requests.gpuslice.io/p": "1k"}
    labels = {c.LABEL_MANAGED_BY: c.MANAGED_BY_VALUE}
    ns = {"t": "a", **desired.labels}
    assert changes(
        desired, ObservedTenant(labeled=True, quota_hard=canonical, quota_labels=labels, labels=ns)
    ) == (
        False,
        "",
    )
    assert changes(
        desired,
        ObservedTenant(labeled=True, quota_hard={c.quota_key("p"): "999"}, quota_labels=labels, labels=ns),
    ) == (
        False,
        "apply",
    )


def test_a_package_whose_deletion_is_ending_entitles_nobody_but_its_key_stays_at_zero() -> None:
    """Deleted and used by no GpuSlice: the namespace it alone entitled stops being a tenant at once
    (no event may put the label back); where another package entitles it, the ending package's key
    stays at 0 until the package is gone, so no claim of its class goes uncounted meanwhile."""
    team_a = [{"namespaceSelector": {"matchLabels": {"team": "a"}}, "slices": 2}]
    packages = {
        "v100-8g": package_spec(25, entitlements=team_a),
        "v100-32g": package_spec(100, entitlements=team_a),
    }
    both = tenant_state("team-a", {"team": "a"}, counting_packages(packages, {"v100-32g"}))
    assert both.tenant
    assert both.hard["v100-8g.gpuslice.io.deviceclass.resource.k8s.io/devices"] == "2"
    assert both.hard["v100-32g.gpuslice.io.deviceclass.resource.k8s.io/devices"] == "0"
    assert both.hard["requests.gpuslice.io/v100-32g"] == "0"
    alone = tenant_state("team-a", {"team": "a"}, counting_packages(packages, {"v100-8g", "v100-32g"}))
    assert not alone.tenant and alone.quota() is None
    # What is not ending counts as written, and nothing is changed in place.
    assert counting_packages(packages, set()) == packages
    assert packages["v100-32g"].entitlements
