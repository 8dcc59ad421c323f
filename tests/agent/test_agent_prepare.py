"""Prepare decisions and the files a prepared claim leaves on the node (no API server involved)."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from gpuslice import constants, metrics
from gpuslice.agent.checkpoint import CheckpointError, CheckpointStore
from gpuslice.agent.gpus import GpuInfo
from gpuslice.agent.prepare import NodePaths, PrepareError, Preparer, prepare_many, resolve_claim
from gpuslice.agent.slices import Package, build_specs, with_generation
from gpuslice.api.package import GpuPackageSpec
from gpuslice.api.quantity import parse_int_quantity
from gpuslice.domain.claims import documented_claim_spec
from gpuslice.kubehttp import ApiError
from gpuslice.shim.config import SliceConfig
from gpuslice.shim.region import utilization_file_for

CONTAINER_UTILIZATION = str(utilization_file_for(constants.CONTAINER_CONFIG_PATH))
CONTAINER_REGION = f"{constants.CONTAINER_USAGE_DIR}/usage.bin"

UID = "6a3c1f0e-1111-2222-3333-444455556666"
GPU = GpuInfo(
    index=1,
    uuid="GPU-12345678-aaaa-bbbb-cccc-1234567890ab",
    product_name="Tesla V100-PCIE-32GB",
    memory_bytes=32 * constants.GIB,
    cuda_compute_capability="7.0",
    driver_version="535.104.05",
    cuda_driver_version="12.2",
    minor_number=1,
    pci_bus_id="00000000:3B:00.0",
)


def published_slices(node: str = "node-a") -> list[dict[str, Any]]:
    specs = build_specs(
        node, [GPU], [Package("v100-8g", GpuPackageSpec(gpuModel=GPU.product_name, fraction=25))]
    )
    slices = with_generation(node, specs, 3)
    # what the API server returns: quantities in canonical form
    for s in slices:
        for d in s["spec"].get("devices", []):
            d["capacity"]["memory"]["value"] = "8Gi"
    return slices


def read(path: str) -> str:
    return Path(path).read_text()


def is_dir(path: str) -> bool:
    return Path(path).is_dir()


def mode_of(path: str) -> int:
    return os.lstat(path).st_mode


def claim(results: list[dict[str, str]], uid: str = UID, package: str = "v100-8g") -> dict[str, Any]:
    """An allocated claim of the documented form for `package` (the agent checks the request's class)."""
    return {
        "metadata": {"namespace": "team-a", "name": "job-gpu", "uid": uid},
        "spec": documented_claim_spec(package),
        "status": {"allocation": {"devices": {"results": results}}},
    }


def result(
    device: str = "gpu-1-v100-8g-2", pool: str = "node-a", driver: str = "gpuslice.io"
) -> dict[str, str]:
    return {"request": "gpu", "driver": driver, "pool": pool, "device": device}


def test_resolves_the_allocated_slice_with_its_limits_and_cdi_ids() -> None:
    [device] = resolve_claim(claim([result()]), uid=UID, node="node-a", slices=published_slices())
    assert device.device == "gpu-1-v100-8g-2"
    assert device.gpu_uuid == GPU.uuid
    assert device.memory_bytes == 8 * constants.GIB
    assert device.compute_share == 25
    assert device.cdi_device_ids == [f"gpuslice.io/slice={UID}", f"nvidia.com/gpu={GPU.uuid}"]


@pytest.mark.parametrize(
    ("the_claim", "message"),
    [
        (claim([result()], uid="other"), "the claim was replaced"),
        (claim([]), "no device of driver gpuslice.io allocated on node node-a"),
        (claim([result(pool="node-b")]), "no device of driver gpuslice.io allocated on node node-a"),
        (claim([result(driver="gpu.nvidia.com")]), "no device of driver gpuslice.io"),
        (claim([result(), result("gpu-1-v100-8g-3")]), "a gpuslice claim holds exactly one slice"),
        (claim([result("gpu-9-v100-8g-0")]), "is not in any ResourceSlice of pool node-a"),
    ],
)
def test_claims_that_cannot_be_prepared_say_why(the_claim: dict[str, Any], message: str) -> None:
    with pytest.raises(PrepareError, match=message):
        resolve_claim(the_claim, uid=UID, node="node-a", slices=published_slices())


def test_a_multi_gpu_product_is_prepared_as_its_whole_cards_and_slices_are_not() -> None:
    pair = GpuPackageSpec(gpuModel=GPU.product_name, gpus=2)
    cards = [
        GPU,
        GPU.model_copy(update={"index": 2, "uuid": GPU.uuid.replace("1234567890ab", "1234567890ac")}),
    ]
    packages = [
        Package("v100-x2", pair),
        Package("v100-8g", GpuPackageSpec(gpuModel=GPU.product_name, fraction=25)),
    ]
    slices = with_generation("node-a", build_specs("node-a", cards, packages), 1)
    names = sorted(d["name"] for s in slices for d in s["spec"].get("devices", []) if "x2" in d["name"])
    allocated = {
        "metadata": {"namespace": "team-a", "name": "pair", "uid": UID},
        "spec": documented_claim_spec("v100-x2", pair),
        "status": {"allocation": {"devices": {"results": [result(n) for n in names]}}},
    }
    devices = resolve_claim(allocated, uid=UID, node="node-a", slices=slices)
    assert sorted(d.gpu_uuid for d in devices) == sorted(g.uuid for g in cards)
    assert all((d.memory_bytes, d.compute_share) == (32 * constants.GIB, 100) for d in devices)
    # The claim's own CDI device once, every card's NVIDIA device.
    assert [d.cdi_device_ids for d in devices] == [
        [f"gpuslice.io/slice={UID}", f"nvidia.com/gpu={devices[0].gpu_uuid}"],
        [f"nvidia.com/gpu={devices[1].gpu_uuid}"],
    ]
    # Two quarter slices of the same cards in one claim are still refused.
    quarters = sorted(d["name"] for s in slices for d in s["spec"].get("devices", []) if "8g" in d["name"])
    two = claim([result(quarters[0]), result(quarters[-1])])
    with pytest.raises(PrepareError, match="a gpuslice claim holds exactly one slice"):
        resolve_claim(two, uid=UID, node="node-a", slices=slices)


def test_quantities_as_the_api_server_returns_them() -> None:
    assert parse_int_quantity("8Gi") == 8 * 1024**3
    assert parse_int_quantity("34359738368") == 32 * 1024**3
    assert parse_int_quantity("100") == 100
    assert parse_int_quantity("2k") == 2000
    with pytest.raises(ValueError, match="not a whole number"):
        parse_int_quantity("1.5Gi")


def test_a_garbled_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    path.write_text("{not json")
    with pytest.raises(CheckpointError, match="not readable"):
        CheckpointStore(path).load()


async def test_prepare_writes_cdi_spec_limits_and_preload_then_unprepare_removes_them(tmp_path: Path) -> None:
    paths = NodePaths(tmp_path / "state", tmp_path / "run", tmp_path / "cdi", Path("/opt/gs/libgpuslice.so"))
    fetches = []

    async def fetch(namespace: str, name: str) -> dict[str, Any]:
        fetches.append((namespace, name))
        return claim([result()])

    async def list_slices() -> list[dict[str, Any]]:
        return published_slices()

    preparer = Preparer("node-a", paths, fetch, list_slices)
    devices = await preparer.prepare("team-a", "job-gpu", UID)
    again = await preparer.prepare("team-a", "job-gpu", UID)
    assert again == devices
    assert fetches == [("team-a", "job-gpu")], "a prepared claim is answered from the checkpoint"

    spec = json.loads(paths.cdi_spec(UID).read_text())
    assert spec["kind"] == "gpuslice.io/slice"
    [cdi_device] = spec["devices"]
    assert cdi_device["name"] == UID
    mounts = {m["containerPath"]: m for m in cdi_device["containerEdits"]["mounts"]}
    assert set(mounts) == {
        "/etc/ld.so.preload",
        constants.CONTAINER_SHIM_PATH,
        constants.CONTAINER_CONFIG_PATH,
        CONTAINER_UTILIZATION,
        CONTAINER_REGION,
    }
    assert read(mounts["/etc/ld.so.preload"]["hostPath"]) == f"{constants.CONTAINER_SHIM_PATH}\n"
    assert mounts[constants.CONTAINER_SHIM_PATH]["hostPath"] == "/opt/gs/libgpuslice.so"
    ro = (
        "/etc/ld.so.preload",
        constants.CONTAINER_SHIM_PATH,
        constants.CONTAINER_CONFIG_PATH,
        CONTAINER_UTILIZATION,
    )
    for path in ro:
        assert "ro" in mounts[path]["options"]
    # the agent's utilization figure exists before a container mounts it; tenants only read it
    assert read(mounts[CONTAINER_UTILIZATION]["hostPath"])[:8] == "GSUTIL01"
    limits = SliceConfig.parse(read(mounts[constants.CONTAINER_CONFIG_PATH]["hostPath"]))
    assert (limits.memory_bytes, limits.compute_share, limits.gpu_uuid, limits.usage_dir) == (
        8 * constants.GIB,
        25,
        GPU.uuid,
        constants.CONTAINER_USAGE_DIR,
    )
    # the region file alone, made by the agent: the tenant gets no directory of the host to write in
    region = mounts[CONTAINER_REGION]["hostPath"]
    assert (
        mode_of(region) == stat.S_IFREG | 0o666 and mode_of(str(Path(region).parent)) == stat.S_IFDIR | 0o755
    )
    assert "rw" in mounts[CONTAINER_REGION]["options"]

    # a restarted agent knows the claim without asking the API server
    restarted = Preparer("node-a", paths, fetch, list_slices)
    assert await restarted.prepare("team-a", "job-gpu", UID) == devices
    assert len(fetches) == 1

    await restarted.unprepare(UID)
    assert not paths.cdi_spec(UID).exists()
    assert not paths.claim_dir(UID).exists()
    assert not paths.usage_dir(UID).exists()
    assert restarted.checkpoint.claims == {}
    await restarted.unprepare(UID)  # unknown claim: nothing to do, no error


def _gpu_gauge(name: str, node: str) -> float | None:
    labels = {"node": node, "gpu_uuid": GPU.uuid, "model": GPU.product_name}
    return metrics.AGENT_REGISTRY.get_sample_value(name, labels)


async def test_gpu_memory_gauges_count_what_prepared_slices_hold(tmp_path: Path) -> None:
    # The dashboard's "GPU memory handed out" panel reads these two series.
    paths = NodePaths(tmp_path / "state", tmp_path / "run", tmp_path / "cdi", Path("/opt/gs/libgpuslice.so"))

    async def fetch(namespace: str, name: str) -> dict[str, Any]:
        return claim([result(pool="node-gauges")])

    async def list_slices() -> list[dict[str, Any]]:
        return published_slices("node-gauges")

    preparer = Preparer("node-gauges", paths, fetch, list_slices, [GPU])
    assert _gpu_gauge("gpuslice_gpu_memory_total_bytes", "node-gauges") == 32 * constants.GIB
    assert _gpu_gauge("gpuslice_gpu_memory_allocated_bytes", "node-gauges") == 0
    await preparer.prepare("team-a", "job-gpu", UID)
    assert _gpu_gauge("gpuslice_gpu_memory_allocated_bytes", "node-gauges") == 8 * constants.GIB
    await preparer.unprepare(UID)
    assert _gpu_gauge("gpuslice_gpu_memory_allocated_bytes", "node-gauges") == 0


async def test_claims_prepared_together_read_the_api_server_together(tmp_path: Path) -> None:
    # kubelet prepares the claims of pods that start together in concurrent calls: one claim's reads
    # of the API server (a round trip each) must not wait until another claim is prepared.
    paths = NodePaths(tmp_path / "state", tmp_path / "run", tmp_path / "cdi", Path("/opt/gs/libgpuslice.so"))
    uids = {"job-a": UID, "job-b": "7b4d2e1f-1111-2222-3333-444455556666"}
    devices = {"job-a": "gpu-1-v100-8g-2", "job-b": "gpu-1-v100-8g-3"}
    reading: set[str] = set()
    both_reading = asyncio.Event()

    async def fetch(namespace: str, name: str) -> dict[str, Any]:
        reading.add(name)
        if len(reading) == 2:
            both_reading.set()
        await both_reading.wait()  # the API server answers once both reads are in flight
        the_claim = claim([result(devices[name])], uid=uids[name])
        the_claim["metadata"]["name"] = name
        return the_claim

    async def list_slices() -> list[dict[str, Any]]:
        return published_slices()

    preparer = Preparer("node-a", paths, fetch, list_slices)
    prepared = await asyncio.wait_for(
        asyncio.gather(*(preparer.prepare("team-a", name, uid) for name, uid in uids.items())), timeout=5
    )
    assert [[d.device for d in p] for p in prepared] == [[devices["job-a"]], [devices["job-b"]]]
    assert {uid: r.state for uid, r in preparer.checkpoint.claims.items()} == dict.fromkeys(
        uids.values(), "Prepared"
    )
    assert all(paths.cdi_spec(uid).exists() for uid in uids.values())


async def test_prepare_reads_the_claim_and_the_slices_at_once(tmp_path: Path) -> None:
    # kubelet makes the pod's sandbox only once prepare answers: the two reads are not made in turn.
    paths = NodePaths(tmp_path / "state", tmp_path / "run", tmp_path / "cdi", Path("/opt/gs/libgpuslice.so"))
    claim_asked, slices_asked = asyncio.Event(), asyncio.Event()

    async def fetch(namespace: str, name: str) -> dict[str, Any]:
        claim_asked.set()
        await slices_asked.wait()  # answers only once the slices were asked for too
        return claim([result()])

    async def list_slices() -> list[dict[str, Any]]:
        slices_asked.set()
        await claim_asked.wait()
        return published_slices()

    preparer = Preparer("node-a", paths, fetch, list_slices)
    [device] = await asyncio.wait_for(preparer.prepare("team-a", "job-gpu", UID), timeout=10)
    assert device.device == "gpu-1-v100-8g-2"
    assert paths.cdi_spec(UID).exists()


async def test_a_failed_read_is_the_claims_error_and_nothing_is_prepared(tmp_path: Path) -> None:
    paths = NodePaths(tmp_path / "state", tmp_path / "run", tmp_path / "cdi", Path("/opt/gs/libgpuslice.so"))

    async def fetch(namespace: str, name: str) -> dict[str, Any]:
        raise ApiError(403, "Forbidden", "")

    async def list_slices() -> list[dict[str, Any]]:
        return published_slices()

    preparer = Preparer("node-a", paths, fetch, list_slices)
    outcome = await prepare_many(preparer, [("team-a", "job-gpu", UID)])
    assert outcome[UID] == (
        "reading ResourceClaim team-a/job-gpu or this node's ResourceSlices: 403 Forbidden"
    )
    assert preparer.checkpoint.claims == {}
    assert not paths.cdi_spec(UID).exists()
