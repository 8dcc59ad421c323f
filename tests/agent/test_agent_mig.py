"""The agent's MIG operations (the MIG part of gpuslice.agent.nvml) and the devices it would publish
for a card in MIG mode (gpuslice.domain.mig), on the driver double's A100-SXM4-80GB: instances made
at a placement and removed, idempotently across an agent restart, and the published counters admit
exactly the sets of placements the driver can create side by side."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

SETUP = """
import json, sys
from pathlib import Path
import pynvml
from gpuslice import logs
from gpuslice.agent import nvml
from gpuslice.domain import mig
from gpuslice_dev.gpusim import simulate
logs.configure()
simulate.use_fake_driver(simulate.write_node_config("1x NVIDIA A100-SXM4-80GB", "node-a", Path(sys.argv[1])))
out = {}
session = nvml.session()
session.__enter__()  # one NVML reference for the whole script
uuid = nvml.devices()[0].uuid
if sys.argv[2] == "enable":  # the platform turns MIG on, as with nvidia-smi -mig 1
    assert pynvml.nvmlDeviceSetMigMode(nvml.handle(uuid), 1) == 0
profiles = {p.name: p for p in nvml.mig_profiles(uuid)}
def attempt(f, *a):
    try:
        return f(*a)
    except nvml.MigError as e:
        return e.code
"""


def _run(tmp: Path, mode: str, body: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", SETUP + body + "\nprint(json.dumps(out))", str(tmp), mode],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_instances_are_made_at_a_placement_and_removed_idempotently(tmp_path: Path) -> None:
    first = _run(
        tmp_path,
        "enable",
        """
out["mode"] = nvml.mig_mode(uuid)
a = nvml.mig_create(uuid, profiles["1g.10gb"], 6)
out["small"] = [a.uuid, a.start, a.size, a.gpu_instance_id]
out["again"] = nvml.mig_create(uuid, profiles["1g.10gb"], 6).uuid
""",
    )
    assert first["mode"] == [True, True]
    small, start, size, _ = first["small"]
    assert re.fullmatch(r"MIG-[0-9a-f-]{36}", small) and (start, size) == (6, 1)
    assert first["again"] == small  # prepare retried: the same instance, not a second one

    # a new agent process (a restart): it finds what the previous one made
    second = _run(
        tmp_path,
        "keep",
        """
out["small"] = nvml.mig_create(uuid, profiles["1g.10gb"], 6).uuid
large = nvml.mig_create(uuid, profiles["3g.40gb"], 0)
out["large"] = [large.start, large.size]
out["overlap"] = attempt(nvml.mig_create, uuid, profiles["3g.40gb"], 4)
out["no_such_placement"] = attempt(nvml.mig_create, uuid, profiles["3g.40gb"], 2)
out["listed"] = sorted((i.profile_id, i.start) for i in nvml.mig_instances(uuid))
out["destroyed"] = nvml.mig_destroy(uuid, out["small"])
out["destroyed_again"] = nvml.mig_destroy(uuid, out["small"])
out["left"] = [i.uuid == large.uuid for i in nvml.mig_instances(uuid)]
""",
    )
    assert second["small"] == small
    assert second["large"] == [0, 4]
    assert second["overlap"] == 23  # NVML_ERROR_INSUFFICIENT_RESOURCES: slices 4-7 hold the 1g at 6
    assert second["no_such_placement"] == 2
    assert second["listed"] == [[9, 0], [19, 6]]
    assert (second["destroyed"], second["destroyed_again"], second["left"]) == (True, False, [True])


def test_published_counters_admit_exactly_what_the_driver_can_create(tmp_path: Path) -> None:
    """Random sets of the card's published devices: the scheduler's counter arithmetic admits a set
    exactly when the driver creates all of its instances side by side."""
    out = _run(
        tmp_path,
        "enable",
        """
import random
places = mig.placements(0, profiles.values())
devices = [mig.device(p) for p in places]
out["devices"] = len(devices)
out["names_unique"] = len({d["name"] for d in devices}) == len(devices)
rng = random.Random(4815)
agree = feasible = 0
mismatches = []
for _ in range(150):
    chosen = rng.sample(places, rng.randint(1, 5))
    made, ok = [], True
    for p in chosen:
        try:
            made.append(nvml.mig_create(uuid, p.profile, p.start))
        except nvml.MigError:
            ok = False
    for m in made:
        nvml.mig_destroy(uuid, m.uuid)
    admitted = mig.fits_together(chosen)
    # a repeated placement is one instance to the driver (create is idempotent) but two devices
    distinct = len({(p.profile.id, p.start) for p in chosen}) == len(chosen)
    ok = ok and distinct
    feasible += admitted
    if admitted == ok:
        agree += 1
    else:
        mismatches.append([(p.profile.name, p.start) for p in chosen])
out.update(agree=agree, feasible=feasible, mismatches=mismatches[:5])
""",
    )
    assert out["devices"] == 25 and out["names_unique"]  # 7 + 7 (+me) + 4 + 3 + 2 + 1 + 1 placements
    assert out["mismatches"] == [] and out["agree"] == 150
    assert 10 < out["feasible"] < 140  # both kinds of set were tried
