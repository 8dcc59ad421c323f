"""NVML's process, memory and utilization API family, as the 535 and 580 drivers' libnvidia-ml.so.1
export it (tests/shim/nvml_family.json, recorded from each branch's public nvml.h by
shim/tools/nvml_family.py), against the driver test double: every name is there, and the calls a
monitor makes answer as the driver does, on the double alone and under an 8 GiB slice (whose
process lists hold only the slice's own processes).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import time
from pathlib import Path

import pytest

from gpuslice_dev.gpusim.build import ShimPaths
from shim.matrix import CLIENTS, GIB, REAL_GPU, Probe, Tenant, explain, facts, nvitop_pythonpath, tenant

pytestmark = pytest.mark.skipif(REAL_GPU, reason="tests the driver double against the real driver's names")

FAMILY = json.loads((Path(__file__).parent / "nvml_family.json").read_text())
SCRIPT = str(CLIENTS / "nvml_readers.py")


@pytest.mark.parametrize("branch", sorted(FAMILY))
def test_the_double_exports_the_whole_family(built: ShimPaths, branch: str) -> None:
    lib = ctypes.CDLL(str(built.fake_dir / "libnvidia-ml.so.1"))
    missing = [name for name in FAMILY[branch]["family"] if not hasattr(lib, name)]
    assert not missing, f"the {branch} driver's NVML exports these, the double does not: {missing}"


def _family(t: Tenant) -> dict[str, str]:
    proc = t.run([SCRIPT, "family"], extra_env={"PYTHONPATH": nvitop_pythonpath()}, timeout=120)
    assert proc.returncode == 0, explain(proc)
    return facts(proc.stdout)


def _pids(listing: str) -> dict[int, int]:
    return {int(p): int(v) for p, v in (e.split(":") for e in listing.split(",") if e)}


def test_what_the_580_branch_adds_is_not_found_on_535(make_slice) -> None:
    """One library plays both branches: a call the 535 library does not have answers as pynvml
    reports a missing one (FunctionNotFound), never with made-up data."""
    f = _family(tenant(make_slice, "double", driver="535"))
    assert f["util_info_error"] == "NVMLError_FunctionNotFound: Function Not Found"


@pytest.mark.parametrize("mode", ["double", "slice"])
def test_process_lists_and_samples_on_580(make_slice, built: ShimPaths, mode: str) -> None:
    """A busy process of the slice and, beside it, another tenant's process on the same card (not
    under the slice): the double lists both, the slice only its own."""
    t = tenant(make_slice, mode, driver="580")
    other = Probe(dataclasses.replace(t, shim=False), built, "hold", "3Gi", "0", ready="held")
    try:
        burn = Probe(t, built, "burn", "5", ready=None)
        try:
            time.sleep(1.5)
            f = _family(t)
        finally:
            burn.close()
    finally:
        other.close()
    compute = _pids(f["detail_compute"])
    assert burn.proc.pid in compute
    assert (other.proc.pid in compute) == (mode == "double")
    if mode == "double":
        assert compute[other.proc.pid] == 3 * GIB
    assert f["detail_graphics"] == f["detail_mps"] == ""
    for key in ("util_info", "process_util"):
        sampled = _pids(f[key])
        assert sampled.get(burn.proc.pid, 0) > 50, f[key]
        assert other.proc.pid not in sampled  # it ran no kernels
