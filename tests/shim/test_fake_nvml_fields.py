"""Two NVML calls XLA (JAX 0.12's CUDA plugin) makes at its start that the driver double did not
export, so XLA logged `INTERNAL: NVML library doesn't have required functions`: nvmlDeviceGetFieldValues
(the field API every driver since R384 has: per-field results, NVLink figures on boards with NVLink)
and nvmlSystemGetConfComputeState (confidential computing, R535 on: off on a node of Volta cards).
Through ctypes on the double, for a PCIe V100 (no NVLink) and an SXM2 pair (NVLink)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shim.shim_helpers import env_of, values

NVML_SUCCESS, NVML_ERROR_INVALID_ARGUMENT, NVML_ERROR_NOT_SUPPORTED = 0, 2, 3
CLIENT = r"""
import ctypes
class Field(ctypes.Structure):
    _fields_ = [("fieldId", ctypes.c_uint), ("scopeId", ctypes.c_uint), ("timestamp", ctypes.c_longlong),
                ("latencyUsec", ctypes.c_longlong), ("valueType", ctypes.c_int), ("nvmlReturn", ctypes.c_int),
                ("value", ctypes.c_ulonglong)]
n = ctypes.CDLL("libnvidia-ml.so.1")
print(f"init={n.nvmlInit_v2()}")
h = ctypes.c_void_p()
n.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(h))
fields = (Field * 4)()
# NVLink LINK_COUNT, SPEED_MBPS_COMMON, GET_SPEED; C2C_LINK_COUNT
for f, fid in zip(fields, (91, 90, 164, 170)):
    f.fieldId = fid
print(f"fields={n.nvmlDeviceGetFieldValues(h, 4, fields)}")
for f in fields:
    print(f"field{f.fieldId}={f.nvmlReturn} {f.valueType} {f.value & 0xffffffff} {f.timestamp > 0}")
print(f"fields_null={n.nvmlDeviceGetFieldValues(h, 1, None)}")
state = (ctypes.c_uint * 3)(7, 7, 7)
print(f"cc_state={n.nvmlSystemGetConfComputeState(state)} {list(state)}")
print(f"cc_state_null={n.nvmlSystemGetConfComputeState(None)}")
"""


@pytest.mark.parametrize("board", ["1x Tesla V100-PCIE-32GB", "2x Tesla V100-SXM2-32GB"])
def test_field_values_and_the_confidential_computing_state(make_slice, board):
    s = make_slice(memory_bytes=None, simulate_gpus=board)
    proc = subprocess.run(
        [sys.executable, "-c", CLIENT], env=env_of(s, shim=False), capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    v = values(proc.stdout)
    calls = (v["init"], v["fields"], v["fields_null"])
    assert calls == ("0", "0", str(NVML_ERROR_INVALID_ARGUMENT)), proc.stdout
    unsupported = f"{NVML_ERROR_NOT_SUPPORTED} "
    if "SXM2" in board:  # 6 links on the board, 25.781 GB/s each (NVLink 2)
        assert v["field91"].startswith("0 ") and v["field91"].split()[2] == "6"
        assert v["field90"].startswith("0 ") and v["field90"].split()[2] == "25781"
        assert v["field164"].startswith("0 ") and v["field164"].split()[2] == "25781"
    else:
        assert all(v[f"field{i}"].startswith(unsupported) for i in (91, 90, 164)), proc.stdout
    assert v["field170"].startswith(unsupported)  # chip-to-chip links: Grace boards only
    assert v["cc_state"] == "0 [0, 0, 0]"  # unavailable, feature off, devtools off
    assert v["cc_state_null"] == str(NVML_ERROR_INVALID_ARGUMENT)
