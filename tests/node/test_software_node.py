"""A tenant whose software cannot use the slice's GPU is told so, on a real node in a real container.

The probe image carries NVIDIA's libcudart 12.9 and two kernel images assembled by NVIDIA's ptxas:
one as a CUDA 12 build for Volta carries them (sm_70 code, compute_70 PTX), one as a build without
Volta (sm_75/sm_90 code, compute_90 PTX, what CUDA 13 builds carry). On the simulated V100 the first
runs and the second fails with "no kernel image is available"; the shim records it, the agent puts it
in status.usage, the operator in condition SoftwareCompatible with a Warning Event.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from gpuslice_dev.devcluster.cluster import DevCluster
from gpuslice_dev.devcluster.images import KERNEL_IMAGES_IN_IMAGE
from node.node_cluster import TENANT, exec_in, sleeping_slice_pod
from support import get_json, wait_for

pytestmark = pytest.mark.cluster
NO_VOLTA = f"{KERNEL_IMAGES_IN_IMAGE}/kernels-no-volta.fatbin"
SM70 = f"{KERNEL_IMAGES_IN_IMAGE}/kernels-sm70.fatbin"


@pytest.fixture
def app(node_cluster: DevCluster) -> Iterator[str]:
    with sleeping_slice_pod(node_cluster, "sw-app") as pod:
        yield pod


def condition(cluster: DevCluster, name: str, type_: str) -> dict[str, Any] | None:
    status = get_json(cluster, "gpuslice", name, "-n", TENANT).get("status") or {}
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), None)


def test_a_build_without_volta_is_named_on_the_slice_and_a_volta_build_clears_it(
    node_cluster: DevCluster, app: str
) -> None:
    rc, out, err = exec_in(node_cluster, app, "gpuslice-cudart-probe", "kernels", NO_VOLTA, "empty")
    assert rc == 0 and "load 209 cudaErrorNoKernelImageForDevice" in out, out + err
    refused = time.monotonic()
    cond = wait_for(
        lambda: (c := condition(node_cluster, app, "SoftwareCompatible")) and c["status"] == "False" and c,
        timeout=60,
        what="SoftwareCompatible=False on the slice",
    )
    print(f"refused load -> condition in status: {time.monotonic() - refused:.1f}s")
    assert cond["reason"] == "NoKernelImageForGpu"
    for part in (
        "gpuslice-cudart",
        "sm_75, sm_90, compute_90",
        "Tesla V100-PCIE-32GB, sm_70",
        "includes sm_70",
    ):
        assert part in cond["message"], cond["message"]
    events = get_json(node_cluster, "events", "-n", TENANT, "--field-selector", f"involvedObject.name={app}")[
        "items"
    ]
    assert any(e["reason"] == "NoKernelImageForGpu" and e["type"] == "Warning" for e in events), events

    rc, out, err = exec_in(node_cluster, app, "gpuslice-cudart-probe", "kernels", SM70, "empty")
    assert rc == 0 and "launch 0 cudaSuccess" in out, out + err
    wait_for(
        lambda: (c := condition(node_cluster, app, "SoftwareCompatible")) and c["status"] == "True",
        timeout=60,
        what="SoftwareCompatible back to True once a Volta build ran",
    )
    usage = get_json(node_cluster, "gpuslice", app, "-n", TENANT)["status"]["usage"]
    assert "software" not in usage and usage["firstGpuUseTime"]
    idle = condition(node_cluster, app, "GpuIdle")
    assert idle is not None and (idle["status"], idle["reason"]) == ("False", "GpuUsed")
