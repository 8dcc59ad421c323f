"""A fresh install: the GpuSlice CRD applied and tenant quotas made at once, on a control plane of its
own (about 10 s to start), whose kube-controller-manager has not discovered GpuSlices yet.

Its quota controller learns new resources every 30 s. The GpuSlice-count quota it syncs before that
has a limit and no usage, and the quota admission plugin refuses every GpuSlice create of the
namespace ("status unknown for quota") until the quota is counted again: by itself only at its full
resync, 5 minutes later. The operator asks for the count (a spec change) until the quota has one.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuslice import constants as c
from gpuslice_dev.devcluster.cluster import DevCluster
from support import apply, slice_doc, wait_for

from .operator_cluster import OperatorProcess, get, package_doc

pytestmark = [pytest.mark.cluster, pytest.mark.slow(seconds=60)]
#: kube-controller-manager's discovery period (30 s), the operator's re-count interval, a timer tick.
CREATES_WITHIN = 30 + c.COUNT_QUOTA_NUDGE_SECONDS + 10


def _progress(msg: str) -> None:
    print(f"[fresh devcluster] {msg}", file=sys.stderr, flush=True)


@pytest.fixture
def bare(tmp_path: Path) -> Iterator[DevCluster]:
    """A control plane without gpuslice's CRDs and without nodes."""
    cluster = DevCluster(tmp_path / "devcluster", progress=_progress)
    try:
        cluster.up(nodes=0, crds=False)
        yield cluster
    finally:
        cluster.down()


def _quota(cluster: DevCluster, namespace: str, name: str) -> dict[str, Any]:
    return get(cluster, "resourcequota", name, "-n", namespace) or {}


def test_gpuslices_can_be_created_within_a_minute_of_a_fresh_install(
    bare: DevCluster, tmp_path: Path
) -> None:
    # Just after `up`, kube-controller-manager's next discovery round is nearly 30 s away (measured: a
    # CRD applied then is discovered about 30 s later), and the operator makes the quotas within a few
    # seconds. Should discovery come first anyway, the case did not occur: the test says so and skips.
    installed = time.monotonic()
    bare.apply_crds()
    op = OperatorProcess(bare, tmp_path / "operator.log")
    op.start()
    try:
        bare.create_namespace("team-a", {"team": "a"})
        apply(bare, [package_doc("fresh", 25, {"team": "a"}, slices=2)])

        def status() -> dict[str, Any]:
            return _quota(bare, "team-a", c.COUNT_QUOTA_NAME).get("status") or {}

        # The case: the limit taken on, no usage (kube-controller-manager does not know GpuSlices yet).
        wait_for(lambda: c.SLICE_COUNT_KEY in status().get("hard", {}), 25, "the GpuSlice-count quota synced")
        if c.SLICE_COUNT_KEY in status().get("used", {}):
            pytest.skip(
                "kube-controller-manager discovered GpuSlices before it synced the quota "
                f"({time.monotonic() - installed:.0f}s after the install): the fresh-install case did "
                "not occur"
            )
        doc = json.dumps(slice_doc("first", "team-a", "fresh"))
        refusal = bare.kubectl("create", "-f", "-", input=doc, check=False).stderr
        assert "status unknown for quota: gpuslice-objects" in refusal, refusal

        def created() -> bool:
            return bare.kubectl("create", "-f", "-", input=doc, check=False).returncode == 0

        wait_for(created, CREATES_WITHIN, "a GpuSlice create accepted", interval=1)
        took = time.monotonic() - installed
        print(f"GpuSlice create accepted {took:.1f}s after the CRDs were applied", file=sys.stderr)
        assert status()["used"][c.SLICE_COUNT_KEY] == "1"
    finally:
        op.stop()
        print(op.tail(), file=sys.stderr)
