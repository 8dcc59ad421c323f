"""The devcluster's Kubernetes minor: which release, which cache folder, which feature gates."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuslice_dev.devcluster import binaries, components
from gpuslice_dev.devcluster.binaries import (
    KUBERNETES_ENV,
    BuildError,
    cache_root,
    kubernetes_release,
)
from gpuslice_dev.devcluster.binaries import components as build_components
from gpuslice_dev.devcluster.components import feature_gates, gates_map


def test_a_minor_names_its_patch_release_and_the_environment_picks_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(KUBERNETES_ENV, raising=False)
    assert kubernetes_release() == "v1.37.2"
    assert [kubernetes_release(m) for m in ("1.35", "v1.36", "1.37.2")] == ["v1.35.4", "v1.36.3", "v1.37.2"]
    monkeypatch.setenv(KUBERNETES_ENV, "1.36")
    assert kubernetes_release() == "v1.36.3"
    assert kubernetes_release("1.35") == "v1.35.4"  # an explicit minor wins over the environment


@pytest.mark.parametrize("wanted", ["1.34", "1.38", "1.36.1", "latest"])
def test_an_unsupported_version_is_refused_with_the_choices(wanted: str) -> None:
    with pytest.raises(BuildError) as err:
        kubernetes_release(wanted)
    assert "choose one of 1.35 (v1.35.4), 1.36 (v1.36.3), 1.37 (v1.37.2)" in str(err.value)


def test_an_unsupported_version_in_the_environment_says_where_it_came_from(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(KUBERNETES_ENV, "1.34")
    with pytest.raises(BuildError, match=rf"'1.34' \(from \${KUBERNETES_ENV}\)"):
        kubernetes_release()


def test_each_release_has_its_own_cache_folder_and_kubelet() -> None:
    from gpuslice_dev.devcluster.node_binaries import _paths as node_paths

    k8s = {
        rel: next(c for c in build_components(rel) if c.name == "kubernetes")
        for rel in ("v1.35.4", "v1.36.3")
    }
    assert k8s["v1.35.4"].key == "kubernetes-v1.35.4" and k8s["v1.36.3"].key == "kubernetes-v1.36.3"
    assert "kubelet" in k8s["v1.35.4"].binary_names()
    assert "-X k8s.io/component-base/version.gitVersion=v1.35.4" in k8s["v1.35.4"].ldflags
    assert (
        binaries._paths("v1.36.3").kube_apiserver
        == cache_root() / "bin" / "kubernetes-v1.36.3" / "kube-apiserver"
    )
    assert node_paths("v1.35.4").kubelet == cache_root() / "bin" / "kubernetes-v1.35.4" / "kubelet"


def test_each_minor_runs_its_own_defaults_and_extra_gates_go_on_top() -> None:
    # 1.35: partitionable devices, consumable capacity and device taints are alpha (off), as a
    # managed 1.35 runs them; 1.36/1.37: beta/GA and on (see the README's "Kubernetes versions").
    assert feature_gates("v1.35.4") == ""
    assert gates_map(feature_gates("v1.36.3")) == {
        "DRAPartitionableDevices": True,
        "DRAConsumableCapacity": True,
        "DRADeviceTaints": True,
    }
    off = gates_map(feature_gates("v1.37.2", "DRADeviceTaints=false,DRADeviceTaintRules=false"))
    assert off["DRADeviceTaints"] is False and off["DRADeviceTaintRules"] is False
    assert off["DRAPartitionableDevices"] is True
    assert feature_gates("v1.35.4", "DRAPartitionableDevices=true") == "DRAPartitionableDevices=true"


def test_no_minor_is_given_a_gate_locked_there() -> None:
    # A gate set against its lock (or unknown) makes kube-apiserver refuse to start. Locked to their
    # default (kube_features.go of each release): DRAExtendedResource in 1.37, DRAAdminAccess from 1.36.
    locked = {
        "1.37": {"DRAExtendedResource", "DRAAdminAccess", "DRAResourceClaimDeviceStatus"},
        "1.36": {"DRAAdminAccess"},
    }
    for minor, gates in components.FEATURE_GATES_BY_MINOR.items():
        assert not set(gates_map(gates)) & locked.get(minor, set()), minor


def test_components_are_started_with_the_clusters_gates(tmp_path: Path) -> None:
    bins = binaries._paths("v1.35.4")
    kcm = components.controller_manager_argv(
        bins, kubeconfig=tmp_path / "k", port=1, pki_dir=tmp_path, service_account_key=tmp_path / "sa"
    )
    assert not [a for a in kcm if a.startswith("--feature-gates")]
    sched = components.scheduler_argv(
        binaries._paths("v1.37.2"),
        kubeconfig=tmp_path / "k",
        port=1,
        pki_dir=tmp_path,
        gates="DRADeviceTaints=false",
    )
    assert "--feature-gates=DRADeviceTaints=false" in sched
