"""The driver test double's host-side part (gpuslice-fake-driverd), playing the kernel module.

Processes in their own PID namespace (as in any pod) are listed by NVML under their host PIDs, and
the memory of a process that was SIGKILLed is freed by the daemon, like the real driver does.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gpuslice_dev.gpusim.simulate import driver_socket, start_fake_driverd
from shim.shim_helpers import GIB, env_of, probe, run, values

pytestmark = pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)")

LIST_PROCESSES = textwrap.dedent(
    """
    import pynvml
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
    print("procs=" + ",".join(f"{p.pid}:{p.usedGpuMemory}" for p in procs))
    print(f"used={pynvml.nvmlDeviceGetMemoryInfo(h).used}")
    """
)


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found.extend(int(p) for p in text)
    return found


def _host_view(s) -> dict[str, str]:
    out = run(s, [sys.executable, "-c", LIST_PROCESSES], shim=False)
    assert out.returncode == 0, out.stderr
    return values(out.stdout)


@pytest.fixture
def driverd(make_slice):
    s = make_slice(memory_bytes=None)
    conf = s.workdir / "fake-gpus.conf"
    proc = start_fake_driverd(conf)
    assert driver_socket(conf).is_socket()
    yield s
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=10)
    assert not driver_socket(conf).exists(), "the daemon removes its socket on exit"


@pytest.mark.parametrize("with_shim", [False, True])
def test_nvml_lists_host_pids_and_a_killed_process_is_freed(driverd, built, with_shim):
    s = driverd
    holder = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", str(probe(built)), "hold", str(GIB)],
        env=env_of(s, shim=with_shim),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held rc=0"
        (host_pid,) = _children(holder.pid)
        view = _host_view(s)
        assert view["procs"] == f"{host_pid}:{GIB}", "NVML must report the host PID, not the namespace's"
        assert int(view["used"]) == GIB
        subprocess.run(["kill", "-KILL", str(host_pid)], check=True)
        holder.wait(timeout=30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _host_view(s)["procs"]:
            time.sleep(0.05)
        view = _host_view(s)
        assert view["procs"] == "" and int(view["used"]) == 0, f"memory of the killed process stays: {view}"
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=30)


def test_a_process_that_ends_normally_is_freed_and_the_double_works_without_the_daemon(make_slice, built):
    s = make_slice(memory_bytes=None)
    conf = s.workdir / "fake-gpus.conf"
    assert (
        values(run(s, [probe(built), "alloc", GIB], shim=False).stdout)["rc"] == "0"
    )  # no daemon: as before
    proc = start_fake_driverd(conf)
    try:
        assert values(run(s, [probe(built), "alloc", GIB], shim=False).stdout)["rc"] == "0"
        assert int(_host_view(s)["used"]) == 0
    finally:
        proc.terminate()
        proc.wait(timeout=10)
