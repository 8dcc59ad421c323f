"""This tree's CRDs replace the first release's under the objects it stored, as a GitOps sync or a
chart upgrade does (CRDs first): nothing refused, nothing pruned, every object still updatable.

The schema comparison is pure; the round trip runs on a control plane of its own (CRDs are
cluster-wide: the shared test cluster keeps this tree's).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuslice_dev.devcluster.cluster import DevCluster
from support import get_json, wait_for
from upgrade.crd_compat import breaking_changes, crds_at, crds_here, example, prune, versions

FIRST_RELEASE = "4ff7adc9020e534cac8e7a17758cdd38992dd65f"  # 0.1.0, CHANGELOG.md
NAMESPACE = "team-a"


#: New rules over fields the first release stored that hold for every object it could store: they
#: constrain only fields it did not have (no isolation mode or memory, migProfile, gpus, topology; fraction
#: was required: both sides false, or the implication's premise false). The round trip below updates
#: such objects under them on a real API server.
_HARDWARE = "(has(self.isolation) && has(self.isolation.mode) && self.isolation.mode == 'Hardware')"
TRUE_FOR_THE_FIRST_RELEASE = {
    f"{_HARDWARE} == (has(self.migProfile) || (has(self.isolation) && has(self.isolation.memory)))",
    "!has(self.migProfile) || !has(self.isolation) || !has(self.isolation.memory)",
    f"!{_HARDWARE} || (has(self.fraction) && self.fraction == 100)",
    "has(self.fraction) || has(self.gpus)",
    "!has(self.gpus) || !has(self.fraction) || self.fraction == 100",
    "!has(self.topology) || self.topology == 'Any' || has(self.gpus)",
    # 0.1.0 had no computeBurst: every object it stored leaves it out.
    "!has(self.computeBurst) || !self.computeBurst || (!has(self.gpus) && (has(self.computeShare) ? "
    "self.computeShare < 100 : (has(self.fraction) && self.fraction < 100)))",
    # 0.1.0 had no price.borrowedPerHour: every object it stored leaves it out.
    "!has(self.price) || !has(self.price.borrowedPerHour) || (has(self.sharing) && has(self.sharing.mode) "
    "&& self.sharing.mode == 'Kueue')",
    "(has(oldSelf.isolation) && has(oldSelf.isolation.mode) ? oldSelf.isolation.mode : 'Software') == "
    "(has(self.isolation) && has(self.isolation.mode) ? self.isolation.mode : 'Software')",
}


@pytest.mark.parametrize("name", sorted(crds_here()))
def test_this_trees_crds_keep_every_field_and_version_the_first_release_stored(name: str) -> None:
    problems = [
        p
        for p in breaking_changes(crds_at(FIRST_RELEASE)[name], crds_here()[name])
        if not any(f"new validation rule {r!r}" in p for r in TRUE_FOR_THE_FIRST_RELEASE)
    ]
    assert not problems, f"{name}: a stored 0.1.0 object could be refused or lose data:\n" + "\n".join(
        problems
    )


def test_the_comparison_sees_a_removed_field_a_tightened_bound_and_a_dropped_version() -> None:
    old = crds_here()["gpuslice.io_gpupackages.yaml"]
    new = json.loads(json.dumps(old))
    schema = new["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    del schema["properties"]["spec"]["properties"]["displayName"]
    schema["properties"]["spec"].setdefault("required", []).append("price")
    problems = "\n".join(breaking_changes(old, new))
    assert ".spec.displayName: removed" in problems and "newly required 'price'" in problems
    new["spec"]["versions"][0]["served"] = False
    assert "no longer served" in "\n".join(breaking_changes(old, new))


def _schema(crd: dict[str, Any]) -> dict[str, Any]:
    (version,) = [v for v in versions(crd).values() if v.get("storage")]
    return version["schema"]["openAPIV3Schema"]


def _stored_objects(old: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Objects as 0.1.0 stored them, every status field set (its spec as its samples and docs write it)."""
    package_spec = yaml.safe_load(
        (Path(__file__).resolve().parents[2] / "manifests/samples/v100-8g.yaml").read_text()
    )["spec"]
    package_spec["price"] = {"perHour": "0.45", "currency": "EUR"}
    pkg = _schema(old["gpuslice.io_gpupackages.yaml"])
    sl = _schema(old["gpuslice.io_gpuslices.yaml"])
    usage = _schema(old["gpuslice.io_gpuusages.yaml"])
    meta = {"namespace": NAMESPACE}
    return [
        {"apiVersion": "gpuslice.io/v1alpha1", "kind": "GpuPackage", "metadata": {"name": "v100-8g"},
         "spec": package_spec, "status": example(pkg["properties"]["status"], ".status")},
        {"apiVersion": "gpuslice.io/v1alpha1", "kind": "GpuSlice", "metadata": {"name": "llm", **meta},
         "spec": {"package": "v100-8g"}, "status": example(sl["properties"]["status"], ".status")},
        {"apiVersion": "gpuslice.io/v1alpha1", "kind": "GpuSlice", "metadata": {"name": "web", **meta},
         "spec": {"package": "v100-8g", "template": True}},
        {"apiVersion": "gpuslice.io/v1alpha1", "kind": "GpuUsage", "metadata": {"name": "2026-11", **meta},
         **example(usage)},
    ]  # fmt: skip


def _leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, value


def _missing(before: dict[str, Any], after: dict[str, Any]) -> list[tuple[str, Any]]:
    """The spec and status values of `before` that `after` does not have."""
    kept = set(_leaves(after))
    return [(p, v) for p, v in _leaves(before) if p.startswith((".spec", ".status")) and (p, v) not in kept]


def _resource(obj: dict[str, Any]) -> list[str]:
    kind = obj["kind"].lower() + "s.gpuslice.io"
    ns = ["-n", obj["metadata"]["namespace"]] if "namespace" in obj["metadata"] else []
    return [kind, obj["metadata"]["name"], *ns]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    c = DevCluster(tmp_path_factory.mktemp("upgrade-crds"))
    try:
        c.up(nodes=1, crds=False)
        yield c
    finally:
        c.down()


def _apply_crds(cluster: DevCluster, crds: dict[str, dict[str, Any]]) -> None:
    cluster.kubectl(
        "apply", "--server-side", "--force-conflicts", "--field-manager=helm", "-f", "-",
        input=yaml.safe_dump_all(crds.values()),
    )  # fmt: skip
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")


@pytest.mark.cluster
def test_objects_stored_by_the_first_release_survive_this_trees_crds(cluster: DevCluster) -> None:
    old = crds_at(FIRST_RELEASE)
    _apply_crds(cluster, old)
    cluster.create_namespace(NAMESPACE)
    objects = _stored_objects(old)
    for obj in objects:
        cluster.kubectl("create", "-f", "-", input=json.dumps(obj))
        if "status" in obj:
            cluster.kubectl(
                "patch", *_resource(obj), "--subresource=status", "--type=merge",
                "-p", json.dumps({"status": obj["status"]}),
            )  # fmt: skip
    stored = {obj["metadata"]["name"]: get_json(cluster, *_resource(obj)) for obj in objects}
    for obj in objects:  # the old schema itself keeps everything the example sets
        got = stored[obj["metadata"]["name"]]
        lost = [
            p
            for p, v in _leaves(obj)
            if p.startswith((".spec", ".status")) and (p, v) not in set(_leaves(got))
        ]
        assert not lost, f"0.1.0's own CRD does not keep {lost} (fix the example)"

    _apply_crds(cluster, crds_here())
    # The API server serves a changed CRD a moment after it stores it: wait until a dry-run copy of
    # each object comes back as the new schema keeps it, then compare with what was stored.
    for obj in objects:
        stored_obj = stored[obj["metadata"]["name"]]
        kept = _body(prune(stored_obj, _schema_of(obj["kind"])))
        wait_for(
            lambda o=stored_obj, k=kept: _body(_dry_run_copy(cluster, o)) == k, 30, "the new CRDs in force"
        )
        assert kept == _body(stored_obj), f"the new CRD prunes {obj['kind']} fields 0.1.0 stored"
    for obj in objects:
        got = get_json(cluster, *_resource(obj))
        lost = _missing(stored[obj["metadata"]["name"]], got)
        assert not lost, f"{obj['kind']} {obj['metadata']['name']} read with the new CRDs lost {lost}"
        # A write as the operator (or a GitOps sync) makes it: the whole object, status on its own.
        cluster.kubectl("replace", "-f", "-", input=json.dumps(got))
        if "status" in obj:
            cluster.kubectl(
                "replace",
                "--subresource=status",
                "-f",
                "-",
                input=json.dumps(get_json(cluster, *_resource(obj))),
            )
        after = get_json(cluster, *_resource(obj))
        pruned = _missing(got, after)
        assert not pruned, f"{obj['kind']} {obj['metadata']['name']} lost {pruned} when written again"


def _schema_of(kind: str) -> dict[str, Any]:
    (crd,) = [c for c in crds_here().values() if c["spec"]["names"]["kind"] == kind]
    return _schema(crd)


def _body(obj: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v for k, v in obj.items() if k in ("spec", "status") or k not in ("apiVersion", "kind", "metadata")
    }


def _dry_run_copy(cluster: DevCluster, obj: dict[str, Any]) -> dict[str, Any]:
    copy = {**obj, "metadata": {k: v for k, v in obj["metadata"].items() if k in ("namespace", "labels")}}
    copy["metadata"]["name"] = obj["metadata"]["name"] + "-copy"
    out = cluster.kubectl(
        "create", "--dry-run=server", "--validate=ignore", "-o", "json", "-f", "-", input=json.dumps(copy)
    ).stdout
    created: dict[str, Any] = json.loads(out)
    # A create ignores status (the status subresource): compare it from the stored object's schema.
    if "status" in obj:
        created["status"] = prune(obj["status"], _schema_of(obj["kind"])["properties"]["status"])
    return created


def _as(obj: dict[str, Any], version: str) -> list[str]:
    """The object's resource at an explicit version (`gpuslices.v1beta1.gpuslice.io llm -n team-a`)."""
    kind, *rest = _resource(obj)
    plural = kind.split(".", 1)[0]
    return [f"{plural}.{version}.gpuslice.io", *rest]


@pytest.mark.cluster
def test_every_object_reads_the_same_under_v1beta1_and_v1alpha1_which_warns(cluster: DevCluster) -> None:
    """Objects 0.1.0 stored under v1alpha1 read back under v1beta1 with the same spec and status, one
    written under v1beta1 reads back under v1alpha1, and v1alpha1 is announced deprecated to whoever
    uses it (kubectl prints the API server's warning); v1beta1 is the version kubectl prefers."""
    old = crds_at(FIRST_RELEASE)
    if get_json(cluster, "crd", "gpuslices.gpuslice.io") is None:
        _apply_crds(cluster, old)
    cluster.create_namespace(NAMESPACE)
    objects = _stored_objects(old)
    for obj in objects:
        if get_json(cluster, *_resource(obj)) is None:
            cluster.kubectl("create", "-f", "-", input=json.dumps(obj))
    _apply_crds(cluster, crds_here())
    for obj in objects:
        wait_for(lambda o=obj: get_json(cluster, *_as(o, "v1beta1")) is not None, 30, "v1beta1 served")
        alpha = get_json(cluster, *_as(obj, "v1alpha1"))
        beta = get_json(cluster, *_as(obj, "v1beta1"))
        assert (alpha["apiVersion"], beta["apiVersion"]) == ("gpuslice.io/v1alpha1", "gpuslice.io/v1beta1")
        assert _body(alpha) == _body(beta), f"{obj['kind']} reads differently under v1beta1"
        assert get_json(cluster, *_resource(obj))["apiVersion"] == "gpuslice.io/v1beta1"  # preferred
        warned = cluster.kubectl("get", *_as(obj, "v1alpha1"), "-o", "name").stderr
        assert f"gpuslice.io/v1alpha1 {obj['kind']} is deprecated; use gpuslice.io/v1beta1" in warned, warned
    new = {
        "apiVersion": "gpuslice.io/v1beta1",
        "kind": "GpuSlice",
        "metadata": {"name": "written-as-beta", "namespace": NAMESPACE},
        "spec": {"package": "v100-8g", "template": True},
    }
    created = cluster.kubectl("create", "-f", "-", input=json.dumps(new))
    assert "deprecated" not in created.stderr, created.stderr
    back = get_json(cluster, *_as(new, "v1alpha1"))
    assert back["spec"] == new["spec"] and back["apiVersion"] == "gpuslice.io/v1alpha1"
    explained = cluster.kubectl("explain", "gpuslices.spec.package", "--api-version=gpuslice.io/v1beta1")
    assert re.search(r"VERSION:\s+v1beta1", explained.stdout), explained.stdout
