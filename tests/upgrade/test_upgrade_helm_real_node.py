"""Release 0.1.0 installed on a real node with Helm (its own chart, from the commit the changelog
names), tenants running and one card drained, then upgraded to this tree's chart the way the README
says (the CRDs first: Helm does not upgrade a chart's `crds/`; then `helm upgrade --reuse-values`),
rolled out again to this tree under another image tag (a 0.2.0 -> 0.2.x patch rollout, where the old
agent already leaves its ResourceSlices to kubelet), and rolled back with `helm rollback` to 0.1.0.

After each step the same checks as the kustomize flow (`tests/upgrade/rig.py`: `tests/invariants.py`,
claims, ledger, usage, a new slice), and the drained card stays drained: its DeviceTaintRules are
the same objects, they still select every device the agent publishes for the card, and no claim is
allocated there.

The devcluster's node specifics (the agent's host paths, the simulated driver, the API relay) are
what `gpuslice_dev.devcluster.deploy` generates for kustomize; Helm applies them through a
post-renderer plugin (Helm v4: `--post-renderer <plugin>`) that runs `kubectl kustomize` of the
release's `manifests/overlays/devcluster` patches over the chart's output. `helm rollback` re-applies
the revision's stored (post-rendered) manifests.

Measured and printed (`[upgrade]` lines): the prepare window of each step (pods of another tenant
created every 0.5 s while the agent's DaemonSet rolls: time to Running, FailedScheduling).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuslice.api.resourceslice import newest_generation, parse_resource_slices
from gpuslice_dev.devcluster.cluster import DevCluster
from gpuslice_dev.devcluster.deploy import write_overlay
from gpuslice_dev.devcluster.realnode import start_real_nodes
from gpuslice_dev.tools import ensure_helm
from support import get_json, wait_for
from upgrade.rig import (
    IMAGE,
    NAMESPACE,
    NEW,
    NEXT,
    NODE,
    OLD,
    REPO,
    Run,
    _say,
    devcluster,
    images,
    images_running,
    kubectl,
    load_tagged,
    rollout,
    tag_image,
)

#: Two product images (0.1.0's built from its archived tree), a Helm install, a drain and three
#: rollouts on four cards: as the kustomize test, over the suite's 600 s default on a loaded machine.
pytestmark = [pytest.mark.cluster, pytest.mark.slow(seconds=1100), pytest.mark.timeout(2400)]

#: four cards, the last drained before the tenants come: three stay on sale
GPU_SPEC = "4x Tesla V100-PCIE-32GB"
DRAINED_INDEX = 3
PLUGIN = "devcluster-node"


def post_renderer(c: DevCluster, generated: Path, tree: Path, tag: str) -> Path:
    """A kustomization for the chart's output: the release's devcluster overlay (its patches, not its
    base nor its image: the chart's values set the image) and the generated node patches on top."""
    top = c.dir / f"helm-post-{tag}"
    overlay = top / "overlay"
    shutil.copytree(tree / "manifests/overlays/devcluster", overlay)
    doc = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    doc["resources"] = ["helm.yaml"]
    doc.pop("images", None)
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    node = yaml.safe_load((generated / "kustomization.yaml").read_text())
    node["resources"] = ["overlay"]
    (top / "kustomization.yaml").write_text(yaml.safe_dump(node, sort_keys=False))
    return top


def plugin_dir(c: DevCluster) -> Path:
    """HELM_PLUGINS with one postrenderer/v1 plugin: the chart's output (stdin) into the kustomization
    named by its argument, `kubectl kustomize` of it (stdout)."""
    plugins = c.dir / "helm-plugins"
    me = plugins / PLUGIN
    me.mkdir(parents=True)
    (me / "plugin.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "name": PLUGIN,
                "version": "0.1.0",
                "type": "postrenderer/v1",
                "runtime": "subprocess",
                "runtimeConfig": {"platformCommand": [{"command": "${HELM_PLUGIN_DIR}/render.sh"}]},
            },
            sort_keys=False,
        )
    )
    script = me / "render.sh"
    script.write_text(
        f'#!/bin/sh\nset -e\ncat > "$1/overlay/helm.yaml"\nexec {c.bins.kubectl} kustomize "$1"\n'
    )
    script.chmod(0o755)
    return plugins


class Helm:
    def __init__(self, c: DevCluster) -> None:
        self.c, self.bin = c, ensure_helm()
        home = c.dir / "helm-home"
        self.env = {
            **os.environ,
            "KUBECONFIG": str(c.kubeconfig),
            "HELM_PLUGINS": str(plugin_dir(c)),
            "HELM_CACHE_HOME": str(home / "cache"),
            "HELM_CONFIG_HOME": str(home / "config"),
            "HELM_DATA_HOME": str(home / "data"),
        }

    def __call__(self, *args: str, renderer: Path | None = None) -> str:
        post = ["--post-renderer", PLUGIN, "--post-renderer-args", str(renderer)] if renderer else []
        proc = subprocess.run(
            [str(self.bin), *args, *post],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        _say(
            f"helm {' '.join(args[:2])}: {proc.returncode} {proc.stdout.strip()[-600:]} {proc.stderr[-1500:]}"
        )
        assert proc.returncode == 0, f"helm {' '.join(args)}:\n{proc.stderr[-3000:]}"
        return proc.stdout

    def revisions(self) -> list[dict[str, Any]]:
        return list(json.loads(self("history", "gpuslice", "-o", "json")))


def wait_deployed(c: DevCluster, tag: str) -> None:
    rollout(c, "deploy/gpuslice-operator")
    rollout(c, "ds/gpuslice-agent")
    wait_for(lambda: images_running(c) == {tag}, 180, f"only {tag} running in {NAMESPACE}")


def node_devices(c: DevCluster) -> list[tuple[str, str, int]]:
    """(device name, card UUID, card index) of every device the node's newest ResourceSlices publish
    (read as `gpuslice drain` reads them; the index is the one in the device's name, gpu-<index>-...)."""
    items = get_json(c, "resourceslices", "--field-selector", f"spec.nodeName={NODE}")["items"]
    slices = newest_generation(s for s in parse_resource_slices(items) if s.pool == NODE)
    return [
        (d.name, d.uuid, int(m.group(1)))
        for s in slices
        for d in s.devices
        if d.uuid and (m := re.match(r"gpu-(\d+)-", d.name))
    ]


class Drained:
    """One card drained with `gpuslice drain --gpu` (DeviceTaintRules, NoSchedule): what must stay."""

    def __init__(self, c: DevCluster) -> None:
        self.c = c
        self.uuid = next(u for _, u, i in node_devices(c) if i == DRAINED_INDEX)
        proc = subprocess.run(
            [sys.executable, "-m", "gpuslice", "drain", "--node", NODE, "--gpu", self.uuid,
             "--kubeconfig", str(c.kubeconfig)],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        _say(f"drain: {proc.stdout.strip()}")
        self.rules = self.read_rules()
        assert self.rules, "gpuslice drain made no DeviceTaintRule"
        wait_for(
            lambda: not self.problems("drained"), 60, f"the drain of {self.uuid} ({len(self.rules)} rules)"
        )

    def read_rules(self) -> dict[str, tuple[str, str, str]]:
        items = get_json(self.c, "devicetaintrules", "-l", f"gpuslice.io/drain-node={NODE}")["items"]
        return {
            r["metadata"]["name"]: (
                r["metadata"]["uid"],
                r["metadata"]["resourceVersion"],
                json.dumps(r["spec"]),
            )
            for r in items
        }

    def problems(self, step: str) -> list[str]:
        out = []
        now = self.read_rules()
        if now != self.rules:
            out.append(f"the drain's DeviceTaintRules changed: {self.rules} -> {now}")
        selected = {json.loads(spec)["deviceSelector"].get("device") for _, _, spec in now.values()}
        card = {name for name, uuid, _ in node_devices(self.c) if uuid == self.uuid}
        if not card:
            out.append(f"the drained card {self.uuid} is no longer published")
        if card - selected:
            out.append(f"devices of the drained card no rule selects: {sorted(card - selected)}")
        for cl in get_json(self.c, "resourceclaims", "-A")["items"]:
            for r in ((cl.get("status") or {}).get("allocation") or {}).get("devices", {}).get(
                "results"
            ) or []:
                if r.get("pool") == NODE and r.get("device") in card:
                    out.append(
                        f"claim {cl['metadata']['namespace']}/{cl['metadata']['name']} is allocated "
                        f"{r['device']} on the drained card"
                    )
        if not out:
            _say(
                f"{step}: the drained card {self.uuid} stays drained ({len(now)} rules, {len(card)} devices)"
            )
        return out


def window(figures: dict[str, Any]) -> dict[str, Any]:
    """A step's prepare window in short: new pods' time to Running, the scheduler's and kubelet's
    waits, and the time from the old agent stopping to the new one Ready."""
    stopping, ready = figures["agent_stopping_at"], figures["new_agent_ready_at"]
    return {
        "median_s": figures["median_s"],
        "max_s": figures["max_s"],
        **{
            reason: sum(n for w, n in figures["warnings"].items() if w.startswith(reason))
            for reason in ("FailedScheduling", "FailedPrepareDynamicResources")
        },
        "agent_gap_s": round(ready - stopping, 1) if stopping is not None and ready is not None else None,
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    yield from devcluster(tmp_path_factory, "upgrade-helm")


def test_helm_upgrade_from_0_1_0_a_patch_rollout_and_helm_rollback_under_running_slice_pods(
    cluster: DevCluster, tmp_path: Path
) -> None:
    c = cluster
    started = time.monotonic()
    old_tree, old_image, new_image = images(tmp_path)
    _say(f"both images after {time.monotonic() - started:.0f}s")
    c.up(nodes=0, crds=False)  # 0.1.0's chart installs its CRDs
    start_real_nodes(c, 1)
    load_tagged(c, old_image, OLD)
    load_tagged(c, new_image, NEW)
    tag_image(c, NEW, NEXT)
    generated = write_overlay(c, NODE, GPU_SPEC, out=c.dir / "deploy-generated")
    old_post = post_renderer(c, generated, old_tree, OLD)
    new_post = post_renderer(c, generated, REPO, NEW)
    helm = Helm(c)
    # the README's install (release in the default namespace), with the node's image repository
    local = ["--set", f"image.repository={IMAGE}", "--set", "image.pullPolicy=Never"]
    helm("install", "gpuslice", str(old_tree / "manifests/helm/gpuslice"), *local, renderer=old_post)
    wait_deployed(c, OLD)
    _say(f"{OLD} installed with Helm after {time.monotonic() - started:.0f}s")
    run = Run(c, old_tree)
    drained: list[Drained] = []

    def drain() -> None:
        # once the products exist: the agent publishes a card's devices per product, and a rule
        # selects devices by name (both runs before this found none to drain)
        wait_for(lambda: {i for _, _, i in node_devices(c)} == {0, 1, 2, 3}, 120, "every card's devices")
        drained.append(Drained(c))
        run.checks.append(drained[0].problems)

    run.tenants(after_packages=drain)
    assert not drained[0].problems("installed"), drained[0].problems("installed")

    def upgrade() -> None:
        kubectl(
            c, "apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds")
        )  # CRDs first (README)
        kubectl(c, "wait", "--for=condition=Established", "crd", "--all", "--timeout=60s")
        helm(
            "upgrade", "gpuslice", str(REPO / "manifests/helm/gpuslice"), "--reuse-values", renderer=new_post
        )
        wait_deployed(c, NEW)

    def patch_rollout() -> None:
        helm(
            "upgrade", "gpuslice", str(REPO / "manifests/helm/gpuslice"), "--reuse-values",
            "--set", f"image.tag={NEXT}", renderer=new_post,
        )  # fmt: skip
        wait_deployed(c, NEXT)

    def rollback() -> None:
        helm("rollback", "gpuslice", "1")
        wait_deployed(c, OLD)

    run.step("helm-upgrade", upgrade, "v1beta1")
    run.step("patch-rollout", patch_rollout, "v1beta1")
    run.step("helm-rollback", rollback, "v1alpha1")
    history = [(r["revision"], r["app_version"], r["status"]) for r in helm.revisions()]
    _say(f"helm history: {history}")
    run.check(
        [a for _, a, _ in history] == [OLD, NEW, NEW, OLD] and history[-1][2] == "deployed",
        f"helm history: {history}",
    )
    # Helm leaves the CRDs as the upgrade made them: v1beta1 stays served after the rollback
    served = [
        v["name"] for v in get_json(c, "crd", "gpuslices.gpuslice.io")["spec"]["versions"] if v.get("served")
    ]
    run.check("v1beta1" in served, f"after helm rollback gpuslices serve {served}")
    figures = {k: window(v) for k, v in run.figures.items()}
    _say(f"windows: {json.dumps(figures)}")
    run.finish(started)
