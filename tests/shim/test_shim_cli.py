"""`gpuslice-dev shim run`: the way a user tries the shim without Kubernetes."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from shim.shim_helpers import GIB, V100, probe, values

PYNVML = textwrap.dedent(
    """
    import pynvml
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    print(f"name={pynvml.nvmlDeviceGetName(h)}")
    print(f"total={pynvml.nvmlDeviceGetMemoryInfo(h).total}")
    """
)


def gpuslice_dev(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuslice_dev", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_pynvml_under_shim_run_sees_the_slice_and_the_model():
    result = gpuslice_dev(
        "shim", "run", "--memory", "8Gi", "--simulate-gpus", V100, "--", sys.executable, "-c", PYNVML
    )
    assert result.returncode == 0, result.stderr
    v = values(result.stdout)
    assert v["name"] == "Tesla V100-PCIE-32GB"
    assert v["total"] == "8589934592"


def test_cuMemAlloc_past_the_slice_fails_with_out_of_memory(built):
    run = ["shim", "run", "--memory", "8Gi", "--simulate-gpus", V100, "--", str(probe(built)), "alloc"]
    over = gpuslice_dev(*run, str(8 * GIB + 1))
    assert values(over.stdout)["rc"] == "2"
    fits = gpuslice_dev(*run, str(8 * GIB))
    assert values(fits.stdout)["rc"] == "0"


def test_exit_status_of_the_command_is_passed_through():
    result = gpuslice_dev(
        "shim", "run", "--memory", "1Gi", "--simulate-gpus", V100, "--", "sh", "-c", "exit 7"
    )
    assert result.returncode == 7


def test_bad_arguments_say_what_is_wrong():
    unknown = gpuslice_dev(
        "shim", "run", "--memory", "8Gi", "--simulate-gpus", "1x GeForce 256", "--", "true"
    )
    assert unknown.returncode == 2
    assert "unknown GPU model 'GeForce 256'" in unknown.stderr
    assert "Tesla V100-PCIE-32GB" in unknown.stderr
    bad_memory = gpuslice_dev("shim", "run", "--memory", "lots", "--", "true")
    assert bad_memory.returncode == 2
    assert "not a memory size like 8Gi" in bad_memory.stderr
    bad_share = gpuslice_dev("shim", "run", "--memory", "8Gi", "--compute-share", "0", "--", "true")
    assert "compute share must be a whole percent in 1..100" in bad_share.stderr
    no_command = gpuslice_dev("shim", "run", "--memory", "8Gi", "--simulate-gpus", V100)
    assert no_command.returncode == 2
    assert "no command" in no_command.stderr


def test_usage_prints_the_region(tmp_path, built):
    usage = tmp_path / "usage"
    run = ["shim", "run", "--memory", "8Gi", "--simulate-gpus", V100, "--usage-dir", str(usage), "--"]
    held = gpuslice_dev(*run, str(probe(built)), "alloc", str(GIB))
    assert values(held.stdout)["rc"] == "0"
    shown = gpuslice_dev("shim", "usage", str(usage))
    assert shown.returncode == 0
    assert '"memory_limit_bytes": 8589934592' in shown.stdout
    assert '"initialized": true' in shown.stdout
