"""The agent watches card health through NVML events on the driver double, exactly as on a real
driver: a fatal XID taints the card's devices NoExecute at once, a pending remap NoSchedule, an
application XID changes nothing, and a reset takes the taint away."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gpuslice.domain.health import TAINT_KEY

SPEC = "2x Tesla V100-PCIE-32GB, 1x NVIDIA A100-SXM4-40GB"

SCENARIO = """
import asyncio, json, sys, time
from pathlib import Path
from gpuslice import logs, metrics
from gpuslice.agent import gpus, health, nvml
from gpuslice_dev.gpusim import faults, simulate

logs.configure("ERROR")
config = simulate.write_node_config(sys.argv[1], "health-node", Path(sys.argv[2]))
simulate.use_fake_driver(config)
found = gpus.discover()
uuids = [g.uuid for g in found]


async def main():
    changes = asyncio.Queue()
    last = [None]

    def set_taints(taints):
        view = {str(uuids.index(u)): t for u, t in taints.items()}
        if view != last[0]:
            last[0] = view
            changes.put_nowait((time.monotonic(), view))

    events = []

    async def node_event(type_, reason, message):
        events.append([type_, reason, message])

    async def no_slices(uuid):
        return []

    monitor = health.HealthMonitor(
        "health-node", found, set_taints, node_event, no_slices, probe_interval=0.5
    )
    task = asyncio.create_task(monitor.run())
    await monitor.ready.wait()
    await changes.get()  # the first publish: nothing tainted

    async def step(gpu, **fault):
        t0 = time.monotonic()
        await asyncio.to_thread(faults.inject, config, gpu, **fault)
        try:
            at, view = await asyncio.wait_for(changes.get(), 3.0)
            return {"taints": view, "seconds": at - t0}
        except TimeoutError:
            return {"taints": last[0], "seconds": None}

    out = {"app_xid": await step("0", xid=13)}
    out["lost"] = await step("0", xid=79)
    # the NVML probe may see the card lost before the XID thread delivers XID 79: the taint then
    # changes once more, to name the XID; what is published is the settled view
    await asyncio.sleep(1.5)
    out["lost"]["taints"] = last[0]
    while not changes.empty():
        changes.get_nowait()
    with nvml.session():  # another card of the node still answers NVML while one is lost
        out["other_card_while_lost"] = [nvml.probe(uuids[1]).lost, len(nvml.compute_processes([uuids[1]]))]
    out["reset"] = await step("0", clear=True)
    out["pending"] = await step("2", xid=63)
    out["pending_reset"] = await step("2", clear=True)
    out["events"] = events
    out["xids"] = {k: metrics.GPU_XIDS.labels("health-node", uuids[0], k, c)._value.get()
                   for k, c in (("13", "application"), ("79", "fatal"))}
    out["healthy"] = metrics.GPU_HEALTHY.labels("health-node", uuids[0], "0")._value.get()
    task.cancel()
    print(json.dumps(out))


asyncio.run(main())
"""


def test_xids_and_resets_become_device_taints(tmp_path: Path) -> None:
    # one process, as the agent: the double is loaded into it like the real driver
    proc = subprocess.run(
        [sys.executable, "-c", SCENARIO, SPEC, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["app_xid"] == {"taints": {}, "seconds": None}, "an application XID changes nothing"

    lost = out["lost"]
    [taint] = lost["taints"]["0"]
    assert (taint["key"], taint["value"], taint["effect"]) == (TAINT_KEY, "xid-79", "NoExecute")
    assert taint["timeAdded"].endswith("Z")
    assert set(lost["taints"]) == {"0"}, "only the failed card"
    assert lost["seconds"] < 1.0, f"tainted {lost['seconds']:.2f} s after the XID"
    assert out["other_card_while_lost"] == [False, 0]

    assert out["reset"]["taints"] == {}, "a reset card is healthy again"
    [pending] = out["pending"]["taints"]["2"]
    assert (pending["value"], pending["effect"]) == ("xid-63", "NoSchedule")
    assert out["pending_reset"]["taints"] == {}

    reasons = [(t, r) for t, r, _ in out["events"]]
    assert reasons == [("Warning", "GpuUnhealthy"), ("Normal", "GpuHealthy")] * 2
    assert "XID 79 (GPU has fallen off the bus)" in out["events"][0][2]
    assert out["xids"] == {"13": 1.0, "79": 1.0}
    assert out["healthy"] == 1.0


def test_a_card_lost_before_a_restart_stays_published_from_memory(tmp_path: Path) -> None:
    from gpuslice.agent.gpus import with_remembered
    from support import gpu

    both = [gpu(0), gpu(1)]
    assert with_remembered(both, tmp_path) == both
    # card 0 fell off the bus while the agent was down: NVML's discovery no longer lists it
    assert with_remembered([both[1]], tmp_path) == both, "published (and then tainted) from memory"
    assert json.loads((tmp_path / "gpus.json").read_text())[0]["uuid"] == both[0].uuid
    (tmp_path / "gpus.json").write_text("not json")
    assert with_remembered([both[1]], tmp_path) == [both[1]], "an unreadable memory is no card"


PRODUCT_SCENARIO = """
import asyncio, json, sys, time
from pathlib import Path
from gpuslice import logs
from gpuslice.agent import gpus, health
from gpuslice.agent.checkpoint import Checkpoint, CheckpointStore, ClaimRecord, PreparedDevice
from gpuslice.agent.prepare import NodePaths
from gpuslice_dev.gpusim import faults, simulate

logs.configure("ERROR")
tmp = Path(sys.argv[2])
config = simulate.write_node_config(sys.argv[1], "product-node", tmp)
simulate.use_fake_driver(config)
found = gpus.discover()
uuids = [g.uuid for g in found]
paths = NodePaths(tmp / "state", tmp / "run", tmp / "cdi", tmp / "libgpuslice.so")
paths.state_dir.mkdir(parents=True)


def whole(i):
    return PreparedDevice(request="gpu", pool="product-node", device=f"gpu-{i}-v100-x2", gpu_uuid=uuids[i],
                          memory_bytes=found[i].memory_bytes, compute_share=100, cdi_device_ids=[])


quarter = PreparedDevice(request="gpu", pool="product-node", device="gpu-2-v100-8g-0", gpu_uuid=uuids[2],
                         memory_bytes=8 << 30, compute_share=25, cdi_device_ids=[])
CheckpointStore(paths.state_dir / "checkpoint.json").save(Checkpoint(claims={
    "u-pair": ClaimRecord(uid="u-pair", namespace="t", name="pair", state="Prepared",
                          devices=[whole(0), whole(1)]),
    "u-q": ClaimRecord(uid="u-q", namespace="t", name="q", state="Prepared", devices=[quarter]),
}))


async def main():
    tainted = asyncio.Queue()

    def set_taints(taints):
        if taints:
            tainted.put_nowait(sorted(uuids.index(u) for u in taints))

    async def node_event(type_, reason, message):
        pass

    async def names(uuid):
        return [f"{r.namespace}/{r.name}" for r in health.records_on_card(paths, uuid)]

    monitor = health.HealthMonitor("product-node", found, set_taints, node_event, names,
                                   claims_on_card=health.checkpoint_claims(paths), probe_interval=0.5)
    task = asyncio.create_task(monitor.run())
    await monitor.ready.wait()
    await asyncio.to_thread(faults.inject, config, "1", xid=79)
    cards = await asyncio.wait_for(tainted.get(), 5.0)
    claims = {i: monitor.claims_on_card(uuids[i]) for i in cards}
    [(_, _, devices)] = claims[1]
    status = [(d["device"], d["conditions"][0]["status"], d["conditions"][0]["reason"])
              for d in monitor.claim_device_status(devices, health.now_iso())]
    out = {"tainted": cards, "slices": {i: await names(uuids[i]) for i in cards},
           "claims": {i: [c[:2] for c in v] for i, v in claims.items()}, "status": status}
    task.cancel()
    print(json.dumps(out))


asyncio.run(main())
"""


def test_a_fault_on_a_products_second_card_is_the_products(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", PRODUCT_SCENARIO, "3x Tesla V100-PCIE-32GB", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["tainted"] == [1], "only the card that failed"
    # what the agent tells on the card (GpuFailed Events, the claims' device status) reaches the
    # product whose second card it is, and only the device of that card
    assert out["slices"] == {"1": ["t/pair"]}
    assert out["claims"] == {"1": [["t", "pair"]]}
    # the claim's device status: both its devices in one apply, each with its own card's health
    assert out["status"] == [
        ["gpu-0-v100-x2", "True", "Healthy"],
        ["gpu-1-v100-x2", "False", "GpuFailed"],
    ]
