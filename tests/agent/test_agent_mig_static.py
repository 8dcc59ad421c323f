"""A static MIG layout (`gpuslice agent --mig-layout static`), on the driver double's A100-SXM4-80GB:
the card sells exactly the instances the platform made, prepare hands one out as it is (no instance
made), unprepare leaves it, and a claim of an instance the platform has since removed fails with why."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import asyncio, json, os, sys
from pathlib import Path
import pynvml
from gpuslice import logs
from gpuslice.agent import gpus as agent_gpus, nvml
from gpuslice.agent.prepare import NodePaths, PrepareError, Preparer
from gpuslice.agent.slices import Package, build_specs, with_generation
from gpuslice.api.package import GpuPackageSpec
from gpuslice.domain.claims import documented_claim_spec
from gpuslice_dev.gpusim import nvidia_cdi, simulate
logs.configure()
tmp = Path(sys.argv[1])
MODEL = "NVIDIA A100-SXM4-80GB"
config = simulate.write_node_config(f"1x {MODEL}", "node-a", tmp / "sim")
simulate.use_fake_driver(config)
nvidia_cdi.write_spec(simulate.parse_gpu_spec(f"1x {MODEL}", seed="node-a"),
                      gpu_dir=tmp / "sim", driver_dir=config.parent, cdi_dir=tmp / "nvidia-cdi")
os.environ["GPUSLICE_NVIDIA_CDI_DIRS"] = str(tmp / "nvidia-cdi")
out = {}
with nvml.session():  # the platform: MIG on, and its layout (as with nvidia-smi mig -cgi ... -C)
    uuid = nvml.devices()[0].uuid
    assert pynvml.nvmlDeviceSetMigMode(nvml.handle(uuid), 1) == 0
    profiles = {p.name: p for p in nvml.mig_profiles(uuid)}
    made = {"1g": nvml.mig_create(uuid, profiles["1g.10gb"], 0).uuid,
            "3g": nvml.mig_create(uuid, profiles["3g.40gb"], 4).uuid}
(card,) = agent_gpus.discover(static_mig=True)
(dynamic,) = agent_gpus.discover()
out["layout"], out["dynamic_layout"] = card.mig_layout, dynamic.mig_layout
def hw(profile):
    spec = {"gpuModel": MODEL, "fraction": 100, "isolation": {"mode": "Hardware"}, "migProfile": profile}
    return GpuPackageSpec.model_validate(spec)
packages = [Package("a-1g", hw("1g.10gb")), Package("a-3g", hw("3g.40gb")), Package("a-4g", hw("4g.40gb"))]
slices = with_generation("node-a", build_specs("node-a", [card], packages), 1)
devices = [d for s in slices for d in s["spec"].get("devices", [])]
out["devices"] = sorted((d["name"], d["attributes"].get("migStatic")) for d in devices)
claims = {}
def claim(uid, package, device):
    claims[uid] = {"metadata": {"namespace": "team-a", "name": uid, "uid": uid},
                   "spec": documented_claim_spec(package),
                   "status": {"allocation": {"devices": {"results": [
                       {"request": "gpu", "driver": "gpuslice.io", "pool": "node-a", "device": device}]}}}}
async def fetch(namespace, name):
    return claims[name]
async def list_slices():
    return slices
paths = NodePaths(tmp / "state", tmp / "run", tmp / "cdi", tmp / "libgpuslice.so")
def instances():
    with nvml.session():
        return sorted(i.uuid for i in nvml.mig_instances(uuid))
async def main():
    p = Preparer("node-a", paths, fetch, list_slices, [card])
    claim("small", "a-1g", "gpu-0-mig-1g-10gb-0")
    (small,) = await p.prepare("team-a", "small", "small")
    out["small"] = small.mig_uuid
    out["after_prepare"] = instances()
    spec = json.loads(paths.cdi_spec("small").read_text())
    nodes = spec["devices"][0]["containerEdits"]["deviceNodes"]
    out["caps"] = [n["path"] for n in nodes if "caps" in n["path"]]
    await p.unprepare("small")
    out["after_unprepare"] = instances()
    out["cdi_left"] = sorted(x.name for x in paths.cdi_dir.iterdir())
    with nvml.session():  # the platform removes its 3g instance; the agent has not restarted
        assert nvml.mig_destroy(uuid, made["3g"])
    claim("large", "a-3g", "gpu-0-mig-3g-40gb-4")
    try:
        await p.prepare("team-a", "large", "large")
        out["gone"] = "prepared"
    except PrepareError as e:
        out["gone"] = str(e)
    out["after_gone"] = instances()
asyncio.run(main())
out["made"] = made
print(json.dumps(out))
"""


def test_a_static_layout_sells_and_hands_out_the_platforms_instances_as_they_are(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    made = out["made"]
    assert out["layout"] == [["1g.10gb", 0], ["3g.40gb", 4]] and out["dynamic_layout"] is None
    # only the platform's two instances are sold (no other 1g placement, no 4g.40gb), marked static
    assert out["devices"] == [
        ["gpu-0-mig-1g-10gb-0", {"bool": True}],
        ["gpu-0-mig-3g-40gb-4", {"bool": True}],
    ]
    # prepare hands out the platform's instance: nothing made, the CDI spec names its capabilities
    assert out["small"] == made["1g"]
    assert out["after_prepare"] == sorted(made.values())
    assert len(out["caps"]) == 2
    # unprepare leaves it for the next claim; the claim's CDI spec goes
    assert out["after_unprepare"] == sorted(made.values()) and out["cdi_left"] == []
    # an instance the platform removed since the agent started: the claim says so, nothing is made
    assert "static MIG layout" in out["gone"] and "no 3g.40gb instance at memory slice 4" in out["gone"]
    assert out["after_gone"] == [made["1g"]]
