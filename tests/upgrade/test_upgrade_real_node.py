"""Release 0.1.0 installed on a real node (kubelet + containerd + runc) through the README's devcluster
deploy flow, with tenants running, upgraded to this tree the way the README says (the CRDs first,
then the manifests), rolled out again to this tree under another image tag (a 0.2.0 -> 0.2.x patch
rollout) and rolled back to 0.1.0, each time checked with `tests/invariants.py`.

0.1.0 is the commit the changelog names, exported with `git archive` (the checkout is untouched), its
image built by its own `gpuslice_dev.image` and its manifests and CRDs applied as they were. Both
images sit on the node side by side (tagged `0.1.0` and this tree's version, as a registry holds a
release's tags), and each release is deployed from its own overlay with that tag.

Through each step, for every slice pod that was running: the same pod uid, container ids and restart
counts; the shim still grants half the slice and refuses past it; no ResourceClaim re-created or
re-allocated; the ledger continuous (each open interval still open with its start, every closed one
unchanged, no second interval of a claim); the agent's usage readings go on; a new slice works.

Measured and printed (`[upgrade]` lines): the window in which kubelet could not prepare new claims
while the agent's DaemonSet rolled (a pod of another tenant started every 0.5 s meanwhile: time to
Running, kubelet's prepare errors), and the writes each step made to what was there before.

The helpers are `tests/upgrade/rig.py`'s (the Helm flow, `test_upgrade_helm_real_node.py`, shares them).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuslice_dev.devcluster.cluster import DevCluster
from gpuslice_dev.devcluster.deploy import write_overlay
from gpuslice_dev.devcluster.realnode import start_real_nodes
from upgrade.rig import (
    NEW,
    NEXT,
    NODE,
    OLD,
    REPO,
    Run,
    _say,
    deploy,
    devcluster,
    images,
    kubectl,
    load_tagged,
    release_overlay,
    tag_image,
)

#: Two product images (0.1.0's built from its archived tree) and three rollouts: 267 s warm on an idle
#: machine for two of them, over the suite's 600 s default at load 10 with cold images.
pytestmark = [pytest.mark.cluster, pytest.mark.slow(seconds=1000), pytest.mark.timeout(1500)]

#: three cards: the slices made after each of the three steps fit beside the prober's pods
GPU_SPEC = "3x Tesla V100-PCIE-32GB"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    yield from devcluster(tmp_path_factory, "upgrade")


def test_upgrade_from_0_1_0_and_back_under_running_slice_pods(cluster: DevCluster, tmp_path: Path) -> None:
    c = cluster
    started = time.monotonic()
    old_tree, old_image, new_image = images(tmp_path)
    _say(f"both images after {time.monotonic() - started:.0f}s")

    # 0.1.0's CRDs, as that release's README installs them: nothing of this tree's yet
    c.up(nodes=0, crds=False)
    start_real_nodes(c, 1)
    load_tagged(c, old_image, OLD)
    load_tagged(c, new_image, NEW)
    tag_image(c, NEW, NEXT)
    generated = write_overlay(c, NODE, GPU_SPEC, out=c.dir / "deploy-generated")
    old_overlay = release_overlay(c, generated, old_tree / "manifests/overlays/devcluster", OLD)
    new_overlay = release_overlay(c, generated, REPO / "manifests/overlays/devcluster", NEW)
    next_overlay = release_overlay(c, generated, REPO / "manifests/overlays/devcluster", NEXT)
    kubectl(c, "apply", "--server-side", "-k", str(old_tree / "manifests" / "crds"))
    kubectl(c, "wait", "--for=condition=Established", "crd", "--all", "--timeout=60s")
    deploy(c, old_overlay, OLD)
    _say(f"{OLD} deployed after {time.monotonic() - started:.0f}s")

    run = Run(c, old_tree)
    run.tenants()

    def upgrade() -> None:
        kubectl(
            c, "apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds")
        )  # CRDs first (README)
        kubectl(c, "wait", "--for=condition=Established", "crd", "--all", "--timeout=60s")
        deploy(c, new_overlay, NEW)

    run.step("upgrade", upgrade, "v1beta1")
    # this tree again under another tag: a patch rollout, the stopping agent leaves its pool to kubelet
    run.step("patch-rollout", lambda: deploy(c, next_overlay, NEXT), "v1beta1")
    run.step("rollback", lambda: deploy(c, old_overlay, OLD), "v1alpha1")
    windows = {
        k: {
            "median_s": v["median_s"],
            "max_s": v["max_s"],
            "FailedScheduling": sum(n for w, n in v["warnings"].items() if w.startswith("FailedScheduling")),
        }
        for k, v in run.figures.items()
    }
    _say(f"windows: {windows}")
    run.finish(started)
