"""Sharing mode Kueue: the Kueue objects a package's entitlements become, ownership, the quota ceiling."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from gpuslice import constants as c
from gpuslice.api.package import GpuPackageSpec
from gpuslice.domain.queues import borrowed_slices, conflicts, desired_objects, fair_share_weight, stale
from gpuslice.domain.tenancy import tenant_state

V100 = "Tesla V100-PCIE-32GB"


def _spec(**sharing: Any) -> GpuPackageSpec:
    return GpuPackageSpec.model_validate(
        {
            "gpuModel": V100,
            "fraction": 25,
            "entitlements": [{"namespaceSelector": {"matchLabels": {"team": "x"}}, "slices": 2}],
            "sharing": sharing,
        }
    )


def test_default_mode_writes_no_kueue_objects_and_keeps_the_entitlement_as_quota() -> None:
    spec = _spec()
    assert desired_objects("v100-8g", spec, {"team-a": 2}) == []
    state = tenant_state("team-a", {"team": "x"}, {"v100-8g": spec})
    assert state.hard[c.quota_key("v100-8g")] == "2"


def test_kueue_mode_one_cluster_queue_per_namespace_in_the_cohort_with_the_entitlement() -> None:
    spec = _spec(mode="Kueue", cohort="gpus", borrowingLimit=2, lendingLimit=1)
    docs = desired_objects("v100-8g", spec, {"team-a": 2, "team-b": 3})
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    (flavor,) = by_kind["ResourceFlavor"]
    assert flavor["metadata"]["name"] == "gpuslice-tesla-v100-pcie-32gb"
    cqs = {d["metadata"]["name"]: d["spec"] for d in by_kind["ClusterQueue"]}
    assert set(cqs) == {"gpuslice-v100-8g-team-a", "gpuslice-v100-8g-team-b"}
    a = cqs["gpuslice-v100-8g-team-a"]
    assert a["cohortName"] == "gpus"
    assert a["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "team-a"}}
    (group,) = a["resourceGroups"]
    assert group["coveredResources"] == ["gpuslice.io/v100-8g"]
    assert group["flavors"] == [
        {
            "name": "gpuslice-tesla-v100-pcie-32gb",
            "resources": [
                {
                    "name": "gpuslice.io/v100-8g",
                    "nominalQuota": "2",
                    "lendingLimit": "1",
                    "borrowingLimit": "2",
                }
            ],
        }
    ]
    assert a["preemption"]["reclaimWithinCohort"] == "Any"
    lqs = {(d["metadata"]["namespace"], d["spec"]["clusterQueue"]) for d in by_kind["LocalQueue"]}
    assert lqs == {("team-a", "gpuslice-v100-8g-team-a"), ("team-b", "gpuslice-v100-8g-team-b")}
    assert all(d["metadata"]["labels"][c.LABEL_MANAGED_BY] == c.MANAGED_BY_VALUE for d in docs)


def test_kueue_mode_quota_is_the_ceiling_entitlement_plus_borrowing_limit() -> None:
    spec = _spec(mode="Kueue", borrowingLimit=3)
    state = tenant_state("team-a", {"team": "x"}, {"v100-8g": spec})
    assert state.hard[c.quota_key("v100-8g")] == "5"
    assert state.hard[c.QUOTA_REQUESTS_PREFIX + "gpuslice.io/v100-8g"] == "5"
    # a namespace no entitlement selects still gets 0, not the borrowing limit
    other = tenant_state("team-z", {"team": "x"}, {"v100-8g": spec, "o": _spec()})
    assert other.hard[c.quota_key("v100-8g")] == "5"


def test_bad_sharing_is_refused() -> None:
    with pytest.raises(ValidationError, match="needs borrowingLimit"):
        _spec(mode="Kueue")
    with pytest.raises(ValidationError, match="apply to mode Kueue only"):
        _spec(cohort="x")


def test_fair_share_weights_go_on_the_selected_namespaces_queues_only() -> None:
    spec = _spec(
        mode="Kueue",
        borrowingLimit=4,
        weights=[
            {"namespaceSelector": {"matchLabels": {"tier": "gold"}}, "weight": 2},
            {"namespaceSelector": {"matchLabels": {"tier": "gold", "vip": "yes"}}, "weight": 0.5},
            {"namespaceSelector": {"matchLabels": {"tier": "scrap"}}, "weight": 0},
        ],
    )
    # the largest weight that selects a namespace applies, as with entitlements
    assert fair_share_weight(spec, {"tier": "gold", "vip": "yes"}) == 2
    assert fair_share_weight(spec, {"tier": "scrap"}) == 0
    assert fair_share_weight(spec, {"tier": "silver"}) is None
    docs = desired_objects("v100-8g", spec, {"a": 1, "b": 1, "c": 1}, {"a": 2, "b": 0.5, "c": 0})
    cqs = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "ClusterQueue"}
    assert cqs["gpuslice-v100-8g-a"]["fairSharing"] == {"weight": "2"}
    assert cqs["gpuslice-v100-8g-b"]["fairSharing"] == {"weight": "0.5"}
    assert cqs["gpuslice-v100-8g-c"]["fairSharing"] == {"weight": "0"}
    # no weight given: no field, Kueue's own default (1)
    plain = desired_objects("v100-8g", spec, {"a": 1})
    assert "fairSharing" not in next(d for d in plain if d["kind"] == "ClusterQueue")["spec"]


def test_bad_weights_are_refused() -> None:
    weight = {"namespaceSelector": {"matchLabels": {"tier": "gold"}}, "weight": 2}
    with pytest.raises(ValidationError, match="weights apply to mode Kueue only"):
        _spec(weights=[weight])
    with pytest.raises(ValidationError, match=r"0 or at least 0\.001"):
        _spec(mode="Kueue", borrowingLimit=1, weights=[{**weight, "weight": 1e-10}])
    with pytest.raises(ValidationError, match="less than or equal to 1000"):
        _spec(mode="Kueue", borrowingLimit=1, weights=[{**weight, "weight": 1001}])


def test_objects_it_does_not_own_are_conflicts_never_overwritten() -> None:
    spec = _spec(mode="Kueue", cohort="gpus", borrowingLimit=0)
    desired = desired_objects("v100-8g", spec, {"team-a": 2})
    assert conflicts("v100-8g", desired, desired) == []
    platform_cq = {
        "kind": "ClusterQueue",
        "metadata": {"name": "gpuslice-v100-8g-team-a", "labels": {}},
        "spec": {"cohortName": "other"},
    }
    (found,) = conflicts("v100-8g", desired, [platform_cq])
    assert "ClusterQueue gpuslice-v100-8g-team-a exists and is not gpuslice's" in found.message()
    # a platform queue already in the cohort would borrow the package's slices
    theirs = {
        "kind": "ClusterQueue",
        "metadata": {"name": "research", "labels": {}},
        "spec": {"cohortName": "gpus"},
    }
    (found,) = conflicts("v100-8g", desired, [theirs])
    assert found.message() == "ClusterQueue research is in cohort gpus; gpuslice does not overwrite it"
    # another package's queue of the same name is not this package's either
    other_pkg = {
        **desired[1],
        "metadata": {
            **desired[1]["metadata"],
            "labels": {c.LABEL_MANAGED_BY: "gpuslice", c.LABEL_PREFIX + "package": "p2"},
        },
    }
    assert len(conflicts("v100-8g", desired, [other_pkg])) == 1


def test_queues_of_a_namespace_no_longer_entitled_are_stale() -> None:
    spec = _spec(mode="Kueue", borrowingLimit=0)
    before = desired_objects("v100-8g", spec, {"team-a": 2, "team-b": 2})
    after = desired_objects("v100-8g", spec, {"team-a": 2})
    gone = {(o["kind"], o["metadata"]["name"]) for o in stale("v100-8g", after, before)}
    assert gone == {("ClusterQueue", "gpuslice-v100-8g-team-b"), ("LocalQueue", "gpuslice-v100-8g")}


def test_borrowed_slices_are_read_from_the_packages_own_cluster_queue_only() -> None:
    resource = "gpuslice.io/v100-8g"
    ours = {
        "metadata": {
            "labels": {c.LABEL_MANAGED_BY: c.MANAGED_BY_VALUE, c.LABEL_PREFIX + "package": "v100-8g"}
        },
        "status": {
            "flavorsUsage": [
                {"name": "f", "resources": [{"name": resource, "total": "3", "borrowed": "1"}]},
                {"name": "g", "resources": [{"name": "cpu", "total": "9", "borrowed": "5"}]},
            ]
        },
    }
    assert borrowed_slices(ours, "v100-8g", resource) == 1
    # Nothing borrowed: Kueue leaves the field out.
    ours_idle = {**ours, "status": {"flavorsUsage": [{"name": "f", "resources": [{"name": resource}]}]}}
    assert borrowed_slices(ours_idle, "v100-8g", resource) == 0
    # Someone else's queue of that name, or none: nothing is known.
    assert borrowed_slices({**ours, "metadata": {"labels": {}}}, "v100-8g", resource) is None
    assert borrowed_slices(None, "v100-8g", resource) is None


def test_a_borrowed_price_needs_sharing_mode_kueue() -> None:
    price = {"perHour": "0.45", "borrowedPerHour": "0.30", "currency": "EUR"}
    base = {"gpuModel": V100, "fraction": 25, "price": price}
    with pytest.raises(ValidationError, match=r"borrowedPerHour applies to sharing\.mode Kueue only"):
        GpuPackageSpec.model_validate(base)
    spec = GpuPackageSpec.model_validate({**base, "sharing": {"mode": "Kueue", "borrowingLimit": 1}})
    assert spec.price is not None and spec.price.borrowed_per_hour == "0.30"
    with pytest.raises(ValidationError, match="String should match pattern"):
        GpuPackageSpec.model_validate(
            {
                **base,
                "price": {**price, "borrowedPerHour": "-1"},
                "sharing": {"mode": "Kueue", "borrowingLimit": 1},
            }
        )
