"""What the API server serves -> which gpuslice features are on, each off one with its reason."""

from __future__ import annotations

from gpuslice.check import Outcome, evaluate_features
from gpuslice.domain import features as f
from gpuslice.domain.features import PlatformFacts, decide

ALL_SERVED = frozenset({f.MUTATING_POLICIES, f.VALIDATING_POLICIES, f.DEVICE_TAINT_RULES, f.RESOURCE_SLICES})


def facts(version: str = "v1.37.2", **kw: object) -> PlatformFacts:
    base: dict[str, object] = {
        "served": ALL_SERVED,
        "dropped_slice_fields": (),
        "dropped_taints": (),
        "extended_resource_kept": True,
    }
    base.update(kw)
    return PlatformFacts(git_version=version, **base)  # type: ignore[arg-type]


def test_a_1_37_cluster_serves_everything() -> None:
    p = decide(facts())
    assert p.off == [] and p.version_problem == "" and p.publish_refusal is None
    assert p.summary() == "Kubernetes v1.37.2: every feature gpuslice uses is served"


def test_a_1_35_cluster_with_its_defaults_refuses_publishing_and_names_each_missing_feature() -> None:
    # What a 1.35 API server with its default gates answers (tests/operator/test_versions_cluster.py
    # reads the same from a real one).
    p = decide(
        facts(
            "v1.35.4",
            served=frozenset({f.VALIDATING_POLICIES, f.RESOURCE_SLICES}),
            dropped_slice_fields=("spec.sharedCounters", "spec.devices[partition].consumesCounters"),
            dropped_taints=("partition",),
            extended_resource_kept=False,
        )
    )
    assert p.version_problem == ""
    assert {x.name for x in p.off} == {
        f.PARTITIONABLE,
        f.DEVICE_TAINTS,
        f.TAINT_RULES,
        f.EXTENDED_RESOURCES,
        f.MUTATING,
    }
    refusal = p.publish_refusal or ""
    assert refusal.startswith("partitionable devices off on Kubernetes v1.35.4")
    assert "two slices being sold on one card's memory" in refusal and "DRAPartitionableDevices" in refusal
    summary = p.summary()
    assert "resources.limits form off (DRAExtendedResource)" in summary
    assert "MutatingAdmissionPolicy off (MutatingAdmissionPolicy)" in summary


def test_a_1_36_cluster_lacks_only_device_taint_rules() -> None:
    p = decide(facts("v1.36.3", served=ALL_SERVED - {f.DEVICE_TAINT_RULES}))
    assert [x.name for x in p.off] == [f.TAINT_RULES]
    assert "gpuslice drain" in p.feature(f.TAINT_RULES).reason
    assert p.publish_refusal is None


def test_a_gate_turned_off_on_1_37_is_named_and_the_pool_is_still_published() -> None:
    p = decide(facts(dropped_taints=("partition",), served=ALL_SERVED - {f.DEVICE_TAINT_RULES}))
    assert {x.name for x in p.off} == {f.DEVICE_TAINTS, f.TAINT_RULES}
    assert "leaves them out of its ResourceSlices" in p.feature(f.DEVICE_TAINTS).reason
    assert p.publish_refusal is None  # an unhealthy card's devices go; the healthy ones stay on sale


def test_unsupported_versions_say_so_without_refusing_what_is_served() -> None:
    old = decide(facts("v1.34.6"))
    assert "older than gpuslice supports (1.35, 1.36, 1.37)" in old.version_problem
    new = decide(facts("v1.38.0"))
    assert "newer than gpuslice was tested on" in new.version_problem
    assert new.publish_refusal is None and new.summary().startswith(
        "Kubernetes v1.38.0: Kubernetes v1.38.0 is newer"
    )
    assert "cannot read" in decide(facts("weird")).version_problem


def test_an_unread_fact_is_unknown_not_off() -> None:
    p = decide(facts(dropped_slice_fields=None, dropped_taints=None, extended_resource_kept=None))
    assert p.off == [] and p.publish_refusal is None
    assert p.feature(f.PARTITIONABLE).unknown


def test_check_prints_each_feature_with_the_fix() -> None:
    p = decide(facts("v1.35.4", served=frozenset({f.VALIDATING_POLICIES}), extended_resource_kept=False))
    lines = {r.name: r for r in evaluate_features(p)}
    ext = lines["resources.limits form (DRAExtendedResource)"]
    assert ext.outcome == Outcome.FAIL and "off on Kubernetes v1.35.4" in ext.detail
    assert "DRAExtendedResource" in ext.fix
    assert lines["MutatingAdmissionPolicy (MutatingAdmissionPolicy)"].fix.startswith(
        "Kubernetes 1.36 or newer"
    )
    assert lines["ValidatingAdmissionPolicy"].outcome == Outcome.OK
    assert "partitionable devices (DRAPartitionableDevices)" not in lines  # the probe's own lines say it


def test_device_taint_rules_served_but_gated_off_are_off() -> None:
    # 1.37 serves resource.k8s.io/v1 DeviceTaintRules whatever the gate; kube-scheduler then ignores them.
    p = decide(facts(scheduler_reads_taint_rules=False))
    assert [x.name for x in p.off] == [f.TAINT_RULES]
    assert "kube-scheduler ignores the rules" in p.feature(f.TAINT_RULES).reason
    both = decide(facts(dropped_taints=("partition",)))
    assert "it needs DRADeviceTaints" in both.feature(f.TAINT_RULES).reason
    assert decide(facts(scheduler_reads_taint_rules=True)).off == []


def test_an_api_server_emulating_an_older_minor_is_judged_by_the_minor_it_emulates() -> None:
    """A 1.37 binary run with --emulated-version=kube=1.34 serves 1.34's APIs and gates: its /version
    says so in emulationMajor/emulationMinor, and gpuslice must call it unsupported."""
    from gpuslice.domain.features import served_version

    binary = {"major": "1", "minor": "37", "gitVersion": "v1.37.2"}
    version = served_version({**binary, "emulationMajor": "1", "emulationMinor": "34"})
    assert version == "v1.34 (emulated by v1.37.2)"
    assert "older than gpuslice supports" in decide(facts(version)).version_problem
    assert served_version({**binary, "emulationMajor": "1", "emulationMinor": "37"}) == "v1.37.2"
    assert served_version({"gitVersion": "v1.30.1"}) == "v1.30.1"
