"""`gpuslice-dev demo --kubernetes`: on each minor the demo plays what that minor lets gpuslice do and
says, per lesson left out, what stops it (decided from what the API server serves, as the product
decides it)."""

from __future__ import annotations

from domain.test_features import ALL_SERVED, facts
from gpuslice.domain import features as f
from gpuslice.domain.features import decide
from gpuslice_dev.demo import lessons_skipped, try_lines


def platform(version: str, **kw: object) -> f.Platform:
    return decide(facts(version, **kw))


def defaults_135() -> f.Platform:
    """What a 1.35 API server with its default gates serves and drops."""
    return platform(
        "v1.35.4",
        served=frozenset({f.VALIDATING_POLICIES, f.RESOURCE_SLICES}),
        dropped_slice_fields=("spec.sharedCounters", "spec.devices[partition].consumesCounters"),
        dropped_taints=("partition",),
        extended_resource_kept=False,
    )


def test_1_37_and_1_36_play_every_lesson() -> None:
    assert lessons_skipped(platform("v1.37.2")) == {}
    # 1.36 lacks only DeviceTaintRules, which no lesson of the demo uses
    assert lessons_skipped(platform("v1.36.3", served=ALL_SERVED - {f.DEVICE_TAINT_RULES})) == {}


def test_1_35_with_its_defaults_plays_only_the_admission_lessons_and_says_why() -> None:
    p = defaults_135()
    skipped = lessons_skipped(p)
    assert set(skipped) == {"chart form", "allocation", "capacity", "usage", "bypass"}
    assert all("DRAPartitionableDevices" in why and "v1.35.4" in why for why in skipped.values())


def test_without_the_extended_resource_gate_only_the_chart_form_is_left_out() -> None:
    skipped = lessons_skipped(platform("v1.35.4", extended_resource_kept=False))
    assert list(skipped) == ["chart form"]
    assert "DRAExtendedResource" in skipped["chart form"]


def test_the_closing_hints_name_only_what_the_lessons_played_made() -> None:
    """On 1.35 with its defaults nothing is sold: no hint to explain a slice the capacity lesson never
    made or to exec into a pod the allocation lesson never started (the demo on a real 1.35 printed
    both); on 1.37 all of them."""
    p135 = defaults_135()
    hints = {"kubectl": "kubectl", "gs": "gpuslice", "nodes": 2}
    on_135 = "\n".join(try_lines(lessons_skipped(p135), **hints))
    assert "llm-worker" not in on_135 and "explain" not in on_135
    assert "gpuslice check" in on_135
    on_137 = "\n".join(try_lines(lessons_skipped(platform("v1.37.2")), **hints))
    assert "gpuslice explain team-b/big-1" in on_137 and "exec -n team-a llm-worker" in on_137
