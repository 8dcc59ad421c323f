"""The memory slice as a tenant process sees it: hard limit, slice-sized reporting, every path counted."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from gpuslice.shim.region import read_usage
from gpuslice_dev.gpusim.simulate import parse_gpu_spec
from shim.shim_helpers import GIB, Holder, env_of, probe, run, values

LIMIT = 8 * GIB
PHYSICAL = 32 * GIB


def test_oom_exactly_at_the_limit_and_frees_are_credited(make_slice, built):
    s = make_slice(memory_bytes=LIMIT)
    result = run(s, [probe(built), "limit", LIMIT])
    assert result.returncode == 0, result.stderr
    assert "ok limit" in result.stdout


@pytest.mark.parametrize("how", ["zero", "inflate"])
def test_a_tenant_rewriting_the_usage_region_does_not_lift_its_process_past_the_slice(make_slice, built, how):
    # The usage region is writable by every process of the slice (they share it); the limit is the
    # read-only limits file's, and a process's own allocations are held to it whatever the region says.
    s = make_slice(memory_bytes=LIMIT)
    six = 6 * GIB
    result = run(s, [probe(built), "tamper", s.usage_dir, six, how])
    assert result.returncode == 0, result.stderr
    out = dict(
        line.split(" ", 1) for line in result.stdout.splitlines() if line.startswith(("first", "second"))
    )
    assert out["first"] == "rc=0"
    assert out["second"] == "rc=2", result.stdout  # CUDA_ERROR_OUT_OF_MEMORY: 12 GiB on an 8 GiB slice


def test_every_allocation_path_is_counted_and_credited(make_slice, built):
    s = make_slice(memory_bytes=LIMIT)
    result = run(s, [probe(built), "paths", LIMIT])
    assert result.returncode == 0, result.stderr
    charged = dict(line.split(" charged=") for line in result.stdout.splitlines() if line.startswith("path "))
    # device memory is charged by size, host-located pools and VMM allocations are not
    assert charged["path cuMemAlloc_v2"] == str(64 << 20)
    assert charged["path cuMemAllocFromPoolAsync(host)"] == "0"
    assert charged["path cuMemCreate(host)"] == "0"
    assert charged["path cuMemCreate(device)"] == str(64 << 20)
    assert charged["path cuArrayCreate(v1)"] == str(512 * 512 * 8)
    assert len(charged) == 12


def test_reports_the_slice_through_every_driver_entry_point(make_slice, built):
    s = make_slice(memory_bytes=LIMIT)
    v = values(run(s, [probe(built), "info"]).stdout)
    assert v["name"] == "Tesla V100-PCIE-32GB"
    assert int(v["meminfo_total"]) == LIMIT
    assert int(v["meminfo_free"]) == LIMIT
    assert int(v["total_mem"]) == LIMIT
    # the legacy 32-bit entry points saturate instead of wrapping around
    assert int(v["meminfo_v1_total"]) == 2**32 - 1


def test_without_a_limit_the_physical_values_are_reported_never_zero(make_slice, built):
    s = make_slice(memory_bytes=None)
    v = values(run(s, [probe(built), "info"]).stdout)
    assert int(v["meminfo_total"]) == PHYSICAL
    assert int(v["total_mem"]) == PHYSICAL
    alloc = values(run(s, [probe(built), "alloc", 16 * GIB]).stdout)
    assert alloc["rc"] == "0"


def test_context_overhead_is_charged_once_per_process(make_slice, built):
    s = make_slice(memory_bytes=LIMIT, context_overhead_bytes=GIB)
    v = values(run(s, [probe(built), "info"]).stdout)
    assert int(v["meminfo_total"]) == LIMIT
    assert int(v["meminfo_free"]) == LIMIT - GIB
    assert values(run(s, [probe(built), "alloc", LIMIT - GIB + 1]).stdout)["rc"] == "2"
    assert values(run(s, [probe(built), "alloc", LIMIT - GIB]).stdout)["rc"] == "0"


NVML_SCRIPT = textwrap.dedent(
    """
    import pynvml
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    v1 = pynvml.nvmlDeviceGetMemoryInfo(h)
    v2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    print(f"name={pynvml.nvmlDeviceGetName(h)}")
    print(f"v1_total={v1.total}")
    print(f"v1_used={v1.used}")
    print(f"v1_free={v1.free}")
    print(f"v2_total={v2.total}")
    print(f"v2_used={v2.used}")
    """
)


def test_nvml_v1_and_v2_report_the_slice(make_slice, built):
    s = make_slice(memory_bytes=LIMIT)
    holder = Holder(s, built, 3 * GIB)
    try:
        v = values(run(s, [sys.executable, "-c", NVML_SCRIPT]).stdout)
    finally:
        holder.close()
    assert v["name"] == "Tesla V100-PCIE-32GB"
    assert int(v["v1_total"]) == LIMIT == int(v["v2_total"])
    assert int(v["v1_used"]) == 3 * GIB == int(v["v2_used"])
    assert int(v["v1_free"]) == LIMIT - 3 * GIB


def test_nvml_without_the_shim_reports_the_card(make_slice, built):
    s = make_slice(memory_bytes=LIMIT)
    v = values(run(s, [sys.executable, "-c", NVML_SCRIPT], shim=False).stdout)
    assert int(v["v1_total"]) == PHYSICAL


def test_processes_share_one_slice(make_slice, built):
    s = make_slice(memory_bytes=LIMIT)
    a = Holder(s, built, 5 * GIB)
    b = Holder(s, built, 2 * GIB)
    try:
        assert (a.rc, b.rc) == (0, 0)
        assert values(run(s, [probe(built), "alloc", GIB + 1]).stdout)["rc"] == "2"
        assert values(run(s, [probe(built), "alloc", GIB]).stdout)["rc"] == "0"
        snap = read_usage(s.usage_dir)
        held = sorted(p.memory_used_bytes for p in snap.processes)
        assert held == [2 * GIB, 5 * GIB]
        assert snap.memory_used_bytes == 7 * GIB
        assert {p.pid for p in snap.processes} == {a.proc.pid, b.proc.pid}
    finally:
        a.close()
        b.close()
    # a process that exits returns its memory to the slice
    assert values(run(s, [probe(built), "alloc", LIMIT]).stdout)["rc"] == "0"


def test_a_killed_process_returns_its_memory(make_slice, built):
    s = make_slice(memory_bytes=LIMIT)
    a = Holder(s, built, 6 * GIB)
    assert values(run(s, [probe(built), "alloc", 3 * GIB]).stdout)["rc"] == "2"
    a.kill()
    assert values(run(s, [probe(built), "alloc", LIMIT]).stdout)["rc"] == "0"
    assert read_usage(s.usage_dir).processes == []


def test_sigkill_while_holding_the_region_lock_does_not_block_others(make_slice, built):
    s = make_slice(memory_bytes=LIMIT)
    holder = subprocess.Popen(
        [str(probe(built, "lock_holder")), str(s.usage_dir), str(LIMIT), str(4 * GIB)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    result = run(s, [probe(built), "alloc", LIMIT], timeout=20)
    assert values(result.stdout)["rc"] == "0"
    assert read_usage(s.usage_dir).lock_recoveries_total == 1


@pytest.mark.parametrize(("processes", "threads"), [(1, 8), (4, 4)])
def test_racing_threads_and_processes_never_exceed_the_limit(make_slice, built, tmp_path, processes, threads):
    s = make_slice(memory_bytes=LIMIT)
    counter = tmp_path / f"counter-{processes}"
    procs = [
        subprocess.Popen(
            [str(probe(built)), "stress", str(LIMIT), str(threads), "20000", str(counter)],
            env={**__import__("os").environ, **s.env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(processes)
    ]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, out + err
        assert "violations=0" in out
    snap = read_usage(s.usage_dir)
    assert snap.refused_allocations_total > 0
    assert snap.memory_used_bytes == 0


def test_a_device_outside_the_slice_gets_no_memory(make_slice, built):
    spec = "2x Tesla V100-PCIE-32GB"
    other_gpu = parse_gpu_spec(spec, seed="test-node")[1]
    s = make_slice(memory_bytes=LIMIT, simulate_gpus=spec, gpu_uuid=other_gpu.uuid)
    # the probe works on device 0; the slice is on device 1
    info = values(run(s, [probe(built), "info"]).stdout)
    assert info["meminfo_total"] == "0" and info["total_mem"] == "0"
    assert values(run(s, [probe(built), "alloc", 1]).stdout)["rc"] == "2"
    assert read_usage(s.usage_dir).refused_allocations_total == 1


def _exporter(s, built, nbytes):
    proc = subprocess.Popen(
        [str(probe(built)), "ipc-export", str(nbytes)],
        env=env_of(s),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("handle="), line
    return proc, line.strip().split("=", 1)[1]


def test_ipc_within_a_slice_is_not_charged_twice_and_from_another_slice_it_is(make_slice, built):
    a = make_slice(memory_bytes=LIMIT)
    b = make_slice(memory_bytes=LIMIT)
    exporter, handle = _exporter(a, built, 4 * GIB)
    try:
        same = values(run(a, [probe(built), "ipc-open", handle]).stdout)
        assert same["rc"] == "0"
        assert int(same["free_after"]) == int(same["free_before"]) == 4 * GIB, "the slice pays once"
        other = values(run(b, [probe(built), "ipc-open", handle]).stdout)
        assert other["rc"] == "0"
        assert int(other["free_before"]) - int(other["free_after"]) == 4 * GIB, (
            "another slice's memory counts"
        )
    finally:
        assert exporter.stdin is not None
        exporter.stdin.close()
        exporter.wait(timeout=30)
