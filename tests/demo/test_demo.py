"""`gpuslice-dev demo`, the README's first command, plays the whole field report end to end."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpuslice_dev.devcluster.cluster import DevCluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow(seconds=80)]


def test_demo_plays_every_lesson_and_leaves_the_cluster_running(tmp_path: Path) -> None:
    d = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "gpuslice_dev", "demo", "--dir", str(d)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout
    try:
        assert proc.returncode == 0, f"demo failed:\n{out[-3000:]}\n{proc.stderr[-3000:]}"
        # What the suite's minor lets gpuslice do, read as the product reads it (1.36, 1.37: all lessons).
        assert re.search(r"What Kubernetes v1\.3\d\.\d+ lets gpuslice do", out)
        assert "\u221a partitionable devices (DRAPartitionableDevices)" in out
        assert "Not on Kubernetes" not in out
        # Lesson 1 and 2: rejections that say what to do instead.
        # The demo wraps long messages at 100 columns behind "| ": read them as one line.
        flat = re.sub(r"\s*\n\s*\|?\s*", " ", out)
        assert "a container may not request nvidia.com/gpu" in flat
        assert "Create a GpuSlice instead" in flat
        # The way charts ask: a stock Deployment's resources.limits, served from the same product.
        assert re.search(r"kube-scheduler made pod chart-\S+ a claim \(chart-\S+-extended-resources-", out)
        assert re.search(r"\| chart-\S+ +v100-8g +InUse", out)
        assert re.search(r"requests\.gpuslice\.io/v100-8g +1 +\d", out)
        assert "its pod's GpuSlice and claim went with the pod" in out
        # Allocation by kube-scheduler, and the slice as the workload sees it through the shim.
        assert "Tesla V100-PCIE-32GB, 8192 MiB" in out
        assert f"cuMemAlloc({2 << 30}) -> 2 CUDA_ERROR_OUT_OF_MEMORY" in out
        # The workload is a real pod on a real node, and its root cannot take the shim out.
        assert "Read-only file system" in out
        # A slice beyond capacity waits with a reason, then starts by itself.
        assert "team-b/big-1: Pending (AllGpusFull)" in out
        # (Allocated or already InUse: on a real node the pod takes a moment to start)
        assert re.search(r"team-b/big-1 started by itself: (Allocated|InUse)", out)
        assert "status.usage: 3.0 GiB of 8 GiB used" in out
        # A process that bypasses the shim is caught by the agent's NVML cross-check.
        assert "condition MemoryIsolated=False (ShimBypassed)" in out
        assert "SliceMemoryViolation" in out
        assert f"export KUBECONFIG={d.resolve() / 'kubeconfig'}" in out
        status = DevCluster(d).status()
        assert status.get("operator") and status.get("kube-apiserver")
        # The closing hint's stop command, run as printed, stops it.
        (stop,) = re.findall(r"^Stop everything with: +(.+)$", out, re.MULTILINE)
        done = subprocess.run(stop.split(), capture_output=True, text=True, timeout=180, check=False)
        assert done.returncode == 0, f"{stop}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
        assert not DevCluster(d).status().get("kube-apiserver"), DevCluster(d).status()
    finally:
        DevCluster(d).down()
