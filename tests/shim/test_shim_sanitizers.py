"""The C test suite under AddressSanitizer and ThreadSanitizer (`make -C shim asan` / `tsan`)."""

from __future__ import annotations

import re
import subprocess

import pytest

from gpuslice_dev.gpusim.build import SHIM_SOURCE_DIR

pytestmark = pytest.mark.slow(seconds=160)


@pytest.mark.parametrize("target", ["asan", "tsan"])
def test_c_suite_is_clean_under_sanitizer(target, built):
    result = subprocess.run(
        ["make", "-C", str(SHIM_SOURCE_DIR), target], capture_output=True, text=True, timeout=900, check=False
    )
    tail = "\n".join((result.stdout + result.stderr).splitlines()[-40:])
    assert result.returncode == 0, tail
    assert re.search(r"^\d+ passed, 0 failed$", result.stdout, re.M), tail
    assert "Sanitizer" not in result.stdout


@pytest.mark.parametrize("target", ["test", "test-driverd"])  # test-driverd: through the double's daemon
def test_plain_c_suite_passes(built, target):
    result = subprocess.run(["make", "-C", str(SHIM_SOURCE_DIR), target], capture_output=True, text=True,
                            timeout=600, check=False)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:]
    assert re.search(r"^\d+ passed, 0 failed$", result.stdout, re.M)


def test_benchmark_prints_added_cost_and_ratio(built):
    cmd = ["make", "-C", str(SHIM_SOURCE_DIR), "bench", "BENCH_ITERS=20000"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines() if line.startswith("cu")}
    assert set(rows) == {"cuLaunchKernel", "cuMemAlloc", "cuMemFree"}
    for row in rows.values():
        # call, driver ns, +shim ns, added ns, median ratio, its p25-p75 and min-max over paired rounds
        driver_ns, shim_ns, _added, ratio = map(float, row[1:5])
        (p25, p75), (low, high) = (tuple(map(float, r.split("-"))) for r in row[5:7])
        assert driver_ns > 0 and shim_ns > 0 and ratio > 0
        assert low <= p25 <= ratio <= p75 <= high
