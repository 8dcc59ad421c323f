"""The operator's MIG profile tables (what a memory size maps to, decided before any node is asked)
are the profiles the driver double's cards report through NVML in MIG mode, model by model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gpuslice.domain import mig

SCRIPT = """
import json, sys
from pathlib import Path
import pynvml
from gpuslice.agent import nvml
from gpuslice_dev.gpusim import simulate
models = json.loads(sys.argv[2])
spec = ", ".join(f"1x {m}" for m in models)
simulate.use_fake_driver(simulate.write_node_config(spec, "node-a", Path(sys.argv[1])))
out = {}
with nvml.session():
    for d in nvml.devices():
        assert pynvml.nvmlDeviceSetMigMode(nvml.handle(d.uuid), 1) == 0
        out[d.name] = sorted([p.name, p.slices, p.memory_mib] for p in nvml.mig_profiles(d.uuid))
print(json.dumps(out))
"""


def test_the_operators_profile_tables_are_the_drivers(tmp_path: Path) -> None:
    models = sorted(mig.PROFILE_TABLES)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path), json.dumps(models)], capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    reported = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(reported) == models
    for model in models:
        table = sorted([p.name, p.compute_slices, p.memory_mib] for p in mig.PROFILE_TABLES[model])
        assert reported[model] == table, model
