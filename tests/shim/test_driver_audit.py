"""The driver double's audit (shim/fake/driver_audit.tsv) matches the built library; every stub says why."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from shim.shim_helpers import env_of

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "shim" / "tools"))
import driver_audit  # noqa: E402

AUDIT = ROOT / "shim" / "fake" / "driver_audit.tsv"
PROCS = ROOT / "shim" / "src" / "gs_procs.h"


def _rows(built) -> list[tuple[str, str, str, str]]:
    return driver_audit.audit(built.fake_cuda, PROCS)


def test_the_checked_in_audit_is_what_the_built_double_exports(built):
    made = driver_audit.render(_rows(built))
    assert AUDIT.read_text() == made, (
        "shim/fake/driver_audit.tsv is stale: regenerate it with "
        "`python shim/tools/driver_audit.py --lib shim/build/fake/libcuda.so.1 > shim/fake/driver_audit.tsv` "
        "and review the diff"
    )


def test_every_stub_has_a_reason(built):
    unexplained = [r[0] for r in _rows(built) if r[1] == "stub" and r[2] == "unexplained"]
    assert unexplained == [], f"stubs with no reason in shim/tools/driver_audit.py RULES: {unexplained}"


def test_a_feature_the_double_says_is_absent_is_absent_in_its_attribute(make_slice, built):
    """Each not-on-v100 stub names the device attribute by which software learns not to call it; the
    simulated 535 driver (CUDA 12.2) both say the feature is absent."""
    absent = [r[3] for r in _rows(built) if r[2] == "not-on-v100"]
    checks = sorted({m for reason in absent for m in re.findall(r"attr:(\w+)==(-?\d+)", reason)})
    assert checks, "the not-on-v100 reasons name no attribute"
    header = (built.fake_cuda.parents[1] / "include" / "cuda.h").read_text()
    values = {name: int(re.search(rf"\b{name}\s*=\s*(\d+)", header).group(1)) for name, _ in checks}  # type: ignore[union-attr]
    code = (
        "import ctypes, sys\n"
        "cu = ctypes.CDLL('libcuda.so.1')\n"
        "assert cu.cuInit(0) == 0\n"
        "v = ctypes.c_int()\n"
        "for a in sys.argv[1:]:\n"
        "    rc = cu.cuDeviceGetAttribute(ctypes.byref(v), int(a), 0)\n"
        "    print(a, rc, v.value)\n"
    )
    for driver in ("535", "580"):
        _check_attributes(make_slice(memory_bytes=None, driver=driver), code, checks, values)


def _check_attributes(s, code, checks, values) -> None:
    out = subprocess.run(
        [sys.executable, "-c", code, *(str(values[n]) for n, _ in checks)],
        env=env_of(s, shim=False),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split("\n")
    got = {int(a): (int(rc), int(v)) for a, rc, v in (line.split() for line in out if line)}
    for name, want in checks:
        rc, value = got[values[name]]
        # CUDA_ERROR_INVALID_VALUE: an attribute newer than the simulated driver (software reads: absent)
        assert rc == 1 or (rc, value) == (0, int(want)), f"{name}: the double answers rc={rc} value={value}"
