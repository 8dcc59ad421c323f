"""Compatibility matrix: the NVML monitor tenants `pip install` to watch their GPU (nvitop 1.7.2 on
nvidia-ml-py 13.615), its API and its one-shot screen (`nvitop --once`), on the driver test double
alone and under an 8 GiB slice of a simulated V100 (shim/README.md, "Real CUDA software"): the
device's total, used and free memory, its utilization, and its processes with their memory.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from shim.matrix import CLIENTS, GIB, MODES, Probe, Tenant, explain, facts, nvitop_pythonpath, tenant

pytestmark = pytest.mark.slow(seconds=30)
SCRIPT = str(CLIENTS / "nvml_readers.py")


def _api(t: Tenant) -> dict[str, str]:
    proc = t.run([SCRIPT, "api"], extra_env={"PYTHONPATH": nvitop_pythonpath()}, timeout=120)
    assert proc.returncode == 0, explain(proc)
    return facts(proc.stdout)


@pytest.mark.parametrize("mode", MODES)
def test_nvitop_reads_memory_and_processes(make_slice, built, mode):
    """With one process holding 2 GiB: the slice's total (or the card's), what is used and free of
    it, and that process listed with its memory."""
    t = tenant(make_slice, mode)
    holder = Probe(t, built, "hold", "2Gi", "0", ready="held")
    try:
        f = _api(t)
    finally:
        holder.close()
    assert "processes_error" not in f, f["processes_error"]
    assert int(f["memory_total"]) == t.total
    assert int(f["memory_used"]) >= 2 * GIB
    # a real card also keeps some memory reserved (nvmlMemory_v2_t.reserved): free is at most the rest
    free, rest = int(f["memory_free"]), t.total - int(f["memory_used"])
    assert free <= rest if t.real else free == rest
    listed = dict(entry.split(":") for entry in f["processes"].split(","))
    assert int(listed[str(holder.proc.pid)]) >= 2 * GIB, f["processes"]
    # through pynvml as scripts call it: the process is a compute one; no graphics, no MPS server
    assert "pynvml_graphics_error" not in f, f["pynvml_graphics_error"]
    assert "pynvml_mpscompute_error" not in f, f["pynvml_mpscompute_error"]
    pid = str(holder.proc.pid)
    assert dict(e.split(":") for e in f["pynvml_compute"].split(","))[pid] == listed[pid]
    assert f["pynvml_graphics"] == f["pynvml_mpscompute"] == ""


@pytest.mark.parametrize("mode", MODES)
def test_nvitop_reads_utilization_of_a_busy_process(make_slice, built, mode):
    t = tenant(make_slice, mode)
    # Sampled from the first kernel on: counted from the process's start, its set-up (exec, the
    # shim, the probe's calibration) took much of the window on a loaded machine (45 % read).
    burn = Probe(t, built, "burn", "5", ready="burn")
    try:
        time.sleep(1.5)
        f = _api(t)
    finally:
        burn.close()
    assert "processes_error" not in f, f["processes_error"]
    assert int(f["gpu_utilization"]) > 50
    sm = dict(entry.split(":") for entry in f["process_sm"].split(","))
    assert int(sm[str(burn.proc.pid)]) > 50, f["process_sm"]


@pytest.mark.parametrize("mode", MODES)
def test_nvitop_once_shows_the_slice_and_its_process(make_slice, built, mode):
    """The screen a user prints with `nvitop --once`: the device's memory total, the process."""
    t = tenant(make_slice, mode)
    holder = Probe(t, built, "hold", "1Gi", "0", ready="held")
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "nvitop", "--once"],
            env=t.env({"PYTHONPATH": nvitop_pythonpath(), "COLUMNS": "120", "TERM": "dumb"}),
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    finally:
        holder.close()
    assert proc.returncode == 0, explain(proc)
    assert "Error" not in proc.stdout + proc.stderr, explain(proc)
    # the Memory-Usage column: "1024MiB / 8192MiB" (nvitop writes 32 GiB as 32.00GiB)
    usage = re.search(r"(\d+)MiB / ([\d.]+)(MiB|GiB)", proc.stdout)
    assert usage, proc.stdout[-2000:]
    total = float(usage[2]) * (GIB if usage[3] == "GiB" else 1 << 20)
    assert int(usage[1]) == 1024 and abs(total - t.total) < GIB / 100, usage[0]
    row = rf"\b{holder.proc.pid} C .* 1024MiB .*gpuslice-probe hold"
    assert re.search(row, proc.stdout), proc.stdout[-2000:]
