"""Real compiled kernels take the time a test gives them on the driver test double: NVRTC-built
CuPy kernels timed by GPUSLICE_FAKE_KERNEL_TIME (shim/README.md, "Kernel time"), seen by the
stream's synchronization, NVML's utilization and the slice's compute share, alone and under a slice.
The double does not execute the kernels: their time is the one configured, what is judged is that
every reader of the device sees it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from shim.matrix import CLIENTS, MODES, REAL_GPU, SLICE, Tenant, cupy_kernels_env, explain, facts, tenant
from shim.shim_helpers import env_of, probe, values

pytestmark = [
    pytest.mark.slow(seconds=40),
    pytest.mark.skipif(REAL_GPU, reason="times the double's kernels; a real GPU times its own"),
]
SCRIPT = str(CLIENTS / "cupy_timed.py")
TIMES = "spin=200ms,per_thread=100ns/thread"


def _run(t: Tenant, path: str, tmp_path: Path, spec: str = TIMES, *args: str) -> dict[str, str]:
    env = {
        **cupy_kernels_env(t),
        "CUPY_CACHE_DIR": str(tmp_path / "kernels"),
        "GPUSLICE_FAKE_KERNEL_TIME": spec,
    }
    proc = t.run([SCRIPT, path, *args], extra_env=env)
    assert proc.returncode == 0, explain(proc)
    return facts(proc.stdout)


@pytest.mark.parametrize("mode", MODES)
def test_a_configured_kernel_time_is_what_sync_and_nvml_see(make_slice, mode, tmp_path):
    t = tenant(make_slice, mode)
    f = _run(t, "timed", tmp_path)
    assert int(f["idle_util"]) == 0, f
    # one 200 ms kernel: the launch returns while it runs, the synchronization waits for it
    assert float(f["one_launch_s"]) < 0.1, f
    assert 0.2 <= float(f["one_launch_s"]) + float(f["one_sync_s"]) < 0.5, f
    assert float(f["one_sync_s"]) >= 0.15, f
    assert 15 <= int(f["one_util"]) <= 30, f  # 200 ms of NVML's last second
    # five back to back: a second of work, the whole of NVML's window
    assert 1.0 <= float(f["five_launch_s"]) + float(f["five_sync_s"]) < 1.5, f
    assert int(f["five_util"]) >= 90, f
    # 100 ns a thread: 262,144 threads take 26 ms, four times as many 105 ms
    assert 0.026 <= float(f["grid1024_s"]) < 0.08, f
    assert 0.105 <= float(f["grid4096_s"]) < 0.2, f


def test_without_a_rule_a_compiled_kernel_takes_the_default(make_slice, tmp_path):
    """A rule naming other functions leaves these at the double's 10 us."""
    t = tenant(make_slice, "double")
    f = _run(t, "timed", tmp_path, spec="nothing_here=1s")
    assert float(f["one_launch_s"]) + float(f["one_sync_s"]) < 0.05, f
    assert int(f["five_util"]) <= 5, f


def test_a_spec_that_cannot_be_read_fails_cuinit(make_slice, tmp_path):
    t = tenant(make_slice, "double")
    env = {**cupy_kernels_env(t), "GPUSLICE_FAKE_KERNEL_TIME": "spin=200 parsecs"}
    proc = t.run([SCRIPT, "timed"], extra_env=env)
    assert proc.returncode != 0
    assert 'GPUSLICE_FAKE_KERNEL_TIME: cannot read "spin=200 parsecs"' in proc.stderr, explain(proc)


def test_the_compute_share_steers_real_kernels(make_slice, tmp_path):
    """50 ms NVRTC kernels back to back for 6 s in a slice with share 25: the shim's throttle sees
    their time through NVML and holds the device near a quarter busy once settled (the second 3 s).
    The double alone keeps them back to back."""
    prepared = make_slice(memory_bytes=SLICE, compute_share=25)
    gpus = prepared.fake_gpus
    assert gpus
    t = Tenant(prepared, True, SLICE, gpus[0].name)
    f = _run(t, "busy", tmp_path, "spin=50ms", "6")
    assert 0.15 <= float(f["busy_fraction"]) <= 0.35, f
    assert int(f["end_util"]) >= 60, f  # the slice reads its own use as a share of its quota
    alone = _run(tenant(make_slice, "double"), "busy", tmp_path, "spin=50ms", "2")
    assert float(alone["busy_fraction"]) >= 0.9, alone
    assert int(alone["end_util"]) >= 90, alone


@pytest.mark.parametrize("kind", ["kernel", "graph"])
def test_a_rule_wins_over_the_annotation_launched_or_in_a_graph(make_slice, built, kind):
    """The probe's annotated PTX says 1 ms; a rule naming its kernel makes it 5 ms, launched directly
    and as a graph's kernel node (each launch waited for: busy about the whole time only if both
    take 5 ms, as the probe's events time it)."""
    s = make_slice(memory_bytes=SLICE)
    env = {**env_of(s), "GPUSLICE_FAKE_KERNEL_TIME": "sp?n=5ms"}
    proc = subprocess.run(
        [str(probe(built)), "launch", "1", "1000", kind], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    v = values(proc.stdout)
    assert 4.9 <= float(v["kernel_ms"]) < 7, v
    assert 0.8 <= float(v["busy_fraction"]) <= 1.05, v
