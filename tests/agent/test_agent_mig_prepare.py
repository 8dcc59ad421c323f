"""Dynamic MIG at prepare, on the driver double's A100-SXM4-80GB in MIG mode: the agent makes the
allocated placement's instance, hands the container only that MIG device, finds it again after a
restart, and destroys it at unprepare; prepare time with instance creation is measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import asyncio, json, os, statistics, subprocess, sys, time
from pathlib import Path
import pynvml
from gpuslice import logs
from gpuslice.agent import gpus as agent_gpus, nvml
from gpuslice.agent.prepare import NodePaths, PrepareError, Preparer
from gpuslice.agent.slices import Package, build_specs, with_generation
from gpuslice.api.package import GpuPackageSpec
from gpuslice.domain.claims import documented_claim_spec
from gpuslice_dev.gpusim import simulate
logs.configure()
tmp = Path(sys.argv[1])
config = simulate.write_node_config("1x NVIDIA A100-SXM4-80GB", "node-a", tmp / "sim")
simulate.use_fake_driver(config)
from gpuslice_dev.gpusim import nvidia_cdi
nvidia_cdi.write_spec(simulate.parse_gpu_spec("1x NVIDIA A100-SXM4-80GB", seed="node-a"),
                      gpu_dir=tmp / "sim", driver_dir=config.parent, cdi_dir=tmp / "nvidia-cdi")
os.environ["GPUSLICE_NVIDIA_CDI_DIRS"] = str(tmp / "nvidia-cdi")
from gpuslice_dev.gpusim.build import ensure_built
built = ensure_built()
probe = str(built.fake_dir.parent / "probe" / "gpuslice-probe")
def in_container(mig_uuid):  # a container's CUDA process: the CDI env, no shim
    env = {**os.environ, **simulate.fake_driver_env(config, built.fake_dir)}
    return {**env, "CUDA_VISIBLE_DEVICES": mig_uuid}
with nvml.session():  # the platform turns MIG on, as with nvidia-smi -mig 1
    uuid = nvml.devices()[0].uuid
    assert pynvml.nvmlDeviceSetMigMode(nvml.handle(uuid), 1) == 0
(card,) = agent_gpus.discover()
A100 = card.product_name
def hw(profile):
    spec = {"gpuModel": A100, "fraction": 100, "isolation": {"mode": "Hardware"}, "migProfile": profile}
    return GpuPackageSpec.model_validate(spec)
packages = [Package("a100-1g", hw("1g.10gb")), Package("a100-3g", hw("3g.40gb"))]
slices = with_generation("node-a", build_specs("node-a", [card], packages), 1)
claims = {}
def claim(uid, package, device):
    claims[uid] = {
        "metadata": {"namespace": "team-a", "name": uid, "uid": uid},
        "spec": documented_claim_spec(package),
        "status": {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": "gpuslice.io", "pool": "node-a", "device": device}]}}},
    }
async def fetch(namespace, name):
    return claims[name]
async def list_slices():
    return slices
paths = NodePaths(tmp / "state", tmp / "run", tmp / "cdi", tmp / "libgpuslice.so")
def instances():
    with nvml.session():
        return sorted(i.uuid for i in nvml.mig_instances(uuid))
def env(uid):
    spec = json.loads(paths.cdi_spec(uid).read_text())
    return spec["devices"][0]["containerEdits"]
out = {"card_in_mig": card.mig_profiles is not None}
async def main():
    p = Preparer("node-a", paths, fetch, list_slices, [card])
    claim("small", "a100-1g", "gpu-0-mig-1g-10gb-0")
    claim("large", "a100-3g", "gpu-0-mig-3g-40gb-4")
    small = (await p.prepare("team-a", "small", "small"))[0]
    large = (await p.prepare("team-a", "large", "large"))[0]
    out["uuids"] = [small.mig_uuid, large.mig_uuid]
    out["instances"] = instances()
    out["edits"] = {"small": env("small"), "large": env("large")}
    out["ids"] = {"small": small.cdi_device_ids, "large": large.cdi_device_ids}
    with nvml.session():
        out["gi_ci"] = {i.uuid: [i.gpu_instance_id, i.compute_instance_id] for i in nvml.mig_instances(uuid)}
    # the instance is the container's whole GPU: past its memory the driver itself refuses
    def hold(size, mig_uuid):  # what the holder says first (it keeps the memory until killed)
        h = subprocess.Popen([probe, "hold", size, "0"], env=in_container(mig_uuid), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        line = h.stdout.readline().strip()
        h.terminate(); h.wait(timeout=30)
        return line
    out["hold"] = [hold("9Gi", small.mig_uuid), hold("10Gi", small.mig_uuid)]
    # an instance overlapping the 3g one (the scheduler's counters would not allocate it): the
    # driver itself refuses it, and the claim's error says so
    try:
        claim("clash", "a100-1g", "gpu-0-mig-1g-10gb-5")
        await p.prepare("team-a", "clash", "clash")
        out["clash"] = "prepared"
    except PrepareError as e:
        out["clash"] = str(e)
    # a restarted agent answers from its checkpoint and makes nothing new
    p2 = Preparer("node-a", paths, fetch, list_slices, [card])
    out["again"] = (await p2.prepare("team-a", "small", "small"))[0].mig_uuid
    out["instances_after_restart"] = instances()
    # an agent killed after the driver made the instance but before it recorded the UUID: the record
    # says PrepareStarted without one; the next agent finishes it with the same instance
    store = json.loads((paths.state_dir / "checkpoint.json").read_text())
    store["claims"]["large"]["state"] = "PrepareStarted"
    del store["claims"]["large"]["devices"][0]["mig_uuid"]
    (paths.state_dir / "checkpoint.json").write_text(json.dumps(store))
    p2 = Preparer("node-a", paths, fetch, list_slices, [card])
    out["finished"] = (await p2.prepare("team-a", "large", "large"))[0].mig_uuid
    out["instances_after_crash"] = instances()
    await p2.unprepare("small")
    out["after_unprepare"] = instances()
    await p2.unprepare("small")  # kubelet repeats it: nothing left to do, no error
    # while a process still runs on the instance the driver keeps it: unprepare fails, kubelet retries
    h = subprocess.Popen([probe, "hold", "1Gi", "0"], env=in_container(large.mig_uuid),
                         stdout=subprocess.PIPE, text=True)
    assert "held" in h.stdout.readline()
    try:
        await p2.unprepare("large")
        out["busy"] = "unprepared"
    except PrepareError as e:
        out["busy"] = str(e)
    out["busy_kept"] = instances()
    h.terminate(); h.wait(timeout=30)
    # a record without the UUID (an agent that wrote no UUID): unprepare finds it by its placement
    store = json.loads((paths.state_dir / "checkpoint.json").read_text())
    del store["claims"]["large"]["devices"][0]["mig_uuid"]
    (paths.state_dir / "checkpoint.json").write_text(json.dumps(store))
    p2 = Preparer("node-a", paths, fetch, list_slices, [card])
    await p2.unprepare("large")
    out["after_all"] = instances()
    out["cdi_left"] = sorted(x.name for x in paths.cdi_dir.iterdir())
    times = []
    for k in range(10):
        uid = f"m{k}"
        claim(uid, "a100-1g", f"gpu-0-mig-1g-10gb-{k % 7}")
        t = time.perf_counter()
        await p2.prepare("team-a", uid, uid)
        times.append(time.perf_counter() - t)
        await p2.unprepare(uid)
    out["prepare_ms_median"] = statistics.median(times) * 1000
asyncio.run(main())
print(json.dumps(out))
"""


def test_prepare_makes_the_allocated_instance_and_unprepare_destroys_it(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["card_in_mig"]
    small, large = out["uuids"]
    assert small.startswith("MIG-") and large.startswith("MIG-") and small != large
    assert out["instances"] == sorted([small, large])
    # the container is told only its instance; no shim, no limits file: the driver keeps the memory
    for name, mig_uuid in (("small", small), ("large", large)):
        edits = out["edits"][name]
        assert f"CUDA_VISIBLE_DEVICES={mig_uuid}" in edits["env"]
        assert not any("gpuslice" in m["containerPath"] for m in edits.get("mounts", []))
        # only our device: not the whole card's nvidia.com/gpu=<uuid>
        assert out["ids"][name] == [f"gpuslice.io/slice={name}"]
    # the card's node, the control nodes, and the instance's GI and CI capability devices, with the
    # minors the kernel's mig-minors layout gives them (gpu<minor>/gi<G>/access, then its ci<C>s)
    caps = {}
    for name, mig_uuid in (("small", small), ("large", large)):
        gi, ci = out["gi_ci"][mig_uuid]
        gi_minor = 3 + 0 * 135 + gi * 9
        want = [gi_minor, gi_minor + 1 + ci]
        nodes = out["edits"][name]["deviceNodes"]
        paths = [n["path"] for n in nodes]
        assert paths[:2] == ["/dev/nvidia0", "/dev/nvidiactl"] and "/dev/nvidia-uvm" in paths
        got = [n for n in nodes if n["path"].startswith("/dev/nvidia-caps/")]
        assert [n["path"] for n in got] == [f"/dev/nvidia-caps/nvidia-cap{m}" for m in want]
        assert all(n["type"] == "c" and n["major"] == 237 for n in got)  # the double's /proc/devices
        caps[name] = set(want)
    assert not caps["small"] & caps["large"]  # never another instance's capability
    assert not (caps["small"] | caps["large"]) & {1, 2}  # nor config/monitor (make and watch instances)
    assert out["hold"] == [
        "held 9663676416 -> 0 CUDA_SUCCESS",
        "held 10737418240 -> 2 CUDA_ERROR_OUT_OF_MEMORY",
    ]
    assert "in use" in out["busy"].lower() and out["busy_kept"] == [large]
    assert "1g.10gb" in out["clash"] and "memory slice 5" in out["clash"]
    assert out["again"] == small and out["instances_after_restart"] == sorted([small, large])
    assert out["finished"] == large and out["instances_after_crash"] == sorted([small, large])
    assert out["after_unprepare"] == [large]
    assert out["after_all"] == [] and out["cdi_left"] == []
    median = out["prepare_ms_median"]
    print(f"\nMIG prepare with instance creation (driver double), median of 10: {median:.1f} ms")
