"""`gpuslice-dev devcluster up|status|down`: idempotent up, a log per component, no leftovers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpuslice import procfs
from gpuslice_dev.devcluster.binaries import staging_replaces
from gpuslice_dev.devcluster.cluster import CORE_COMPONENTS, DevCluster

pytestmark = pytest.mark.cluster


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuslice_dev", "devcluster", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_up_status_down_leaves_nothing_behind(tmp_path: Path) -> None:
    d = tmp_path / "dc"
    up = _cli("up", "--nodes", "2", "--dir", str(d))
    assert up.returncode == 0, up.stderr
    assert up.stdout.strip() == f"export KUBECONFIG={d.resolve() / 'kubeconfig'}"
    try:
        status = _cli("status", "--dir", str(d))
        assert status.returncode == 0, status.stdout
        for name in CORE_COMPONENTS:
            assert f"{name}" in status.stdout and "NOT RUNNING" not in status.stdout
            assert (d / "logs" / f"{name}.log").stat().st_size > 0

        # A second `up` is idempotent: same processes, same kubeconfig, one more node if asked.
        before = json.loads((d / "state.json").read_text())["processes"]
        again = _cli("up", "--nodes", "3", "--dir", str(d))
        assert again.returncode == 0, again.stderr
        assert "already running" in again.stderr
        after = json.loads((d / "state.json").read_text())
        assert {k: v["pid"] for k, v in after["processes"].items()} == {
            k: v["pid"] for k, v in before.items()
        }
        assert after["nodes"] == ["kwok-node-0", "kwok-node-1", "kwok-node-2"]
        nodes = DevCluster(d).kubectl("get", "nodes", "-o", "name").stdout.split()
        assert sorted(nodes) == ["node/kwok-node-0", "node/kwok-node-1", "node/kwok-node-2"]
    finally:
        down = _cli("down", "--dir", str(d))
    assert down.returncode == 0
    pids = [p["pid"] for p in before.values()]
    assert pids and not [p for p in pids if procfs.alive(p)]
    assert _cli("status", "--dir", str(d)).returncode == 1


def test_staging_replaces_come_from_the_kubernetes_go_mod() -> None:
    gomod = """module k8s.io/kubernetes
replace (
\tk8s.io/api => ./staging/src/k8s.io/api
\tk8s.io/client-go => ./staging/src/k8s.io/client-go
)
"""
    assert staging_replaces(gomod, "v1.37.2") == [
        "replace k8s.io/api => k8s.io/api v0.37.2",
        "replace k8s.io/client-go => k8s.io/client-go v0.37.2",
    ]
    with pytest.raises(RuntimeError, match="lists no staging modules"):
        staging_replaces("module x\n", "v1.37.2")


def test_a_port_taken_under_our_feet_is_not_fatal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process grabs the port picked for kube-apiserver: it is started again on another one."""
    import socket

    from gpuslice_dev.devcluster import cluster as cluster_mod

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    taken = busy.getsockname()[1]
    real_free_port = cluster_mod.free_port
    handed_out: list[int] = []

    def racy_free_port() -> int:
        # etcd takes two ports first; the third pick (kube-apiserver's) is the busy one.
        port = taken if len(handed_out) == 2 else real_free_port()
        handed_out.append(port)
        return port

    monkeypatch.setattr(cluster_mod, "free_port", racy_free_port)
    dc = DevCluster(tmp_path / "dc")
    try:
        st = dc.up(nodes=0)
        assert taken in handed_out
        assert st.ports["kube-apiserver"] != taken
        assert dc.status()["kube-apiserver"]
        assert "address already in use" in (tmp_path / "dc" / "logs" / "kube-apiserver.log").read_text()
    finally:
        dc.down()
        busy.close()
