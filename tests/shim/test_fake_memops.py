"""Stream memory operations on the double: the _v2 calls work as the attributes the double reports say
(64-bit ops and NOR waits: 1), the v1 ABI does not (CAN_USE_STREAM_MEM_OPS_V1: 0), alone and under a slice."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shim.shim_helpers import GIB, env_of, values

CLIENT = Path(__file__).parent / "clients" / "memops_client.py"


@pytest.mark.parametrize("memory", [None, 8 * GIB], ids=["alone", "slice-8GiB"])
def test_stream_memory_operations_agree_with_the_device_attributes(make_slice, memory):
    s = make_slice(memory_bytes=memory)
    proc = subprocess.run(
        [sys.executable, str(CLIENT)], env=env_of(s, shim=memory is not None), capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    v = values(proc.stdout)
    assert (v["attr_v1"], v["attr_64"], v["attr_nor"]) == ("0", "1", "1")
    ok = [
        "init",
        "ctx",
        "alloc",
        "stream",
        "write32",
        "write64",
        "wait_geq_now",
        "wait64_eq_released",
        "batch",
    ]
    assert {k: v[k] for k in ok} == dict.fromkeys(ok, "0"), v
    assert v["read"] == f"7:{1 << 40}"
    assert v["waited_for_the_writer"] == "1"
    assert (v["misaligned"], v["bad_flags"]) == ("1", "1")  # CUDA_ERROR_INVALID_VALUE
    assert v["v1"] == "801"  # CUDA_ERROR_NOT_SUPPORTED, as CAN_USE_STREAM_MEM_OPS_V1 says
